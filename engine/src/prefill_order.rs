//! [`PrefillOrder`]: which admitted prompt the engine prefills next.
//!
//! The engine prefills one prompt's chunk per step (riders aside). In arrival order a prompt
//! whose prefix was restored from the cache, with a few hundred tokens left, waits behind
//! every older prompt's chunks. [`PrefillOrder::FewestNew`] takes the prompt with the
//! fewest tokens left to compute first, as SGLang's prefix-aware schedule (`lpm`) and a
//! shortest-remaining-first queue do: cached prompts start answering at once, and the mean
//! wait falls. So that a long prompt cannot be passed over for ever, each engine step it
//! waits counts as one chunk of it computed: a prompt has waited at most as many steps as
//! its own chunks before it ranks ahead of anything new.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// The order in which admitted prompts are prefilled.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PrefillOrder {
    /// Oldest admitted first, each to its end (first come, first served).
    Arrival,
    /// Fewest tokens left to compute first, a step waited counting as a chunk computed
    /// (the default: a lower median TTFT on the H200's trace slice, docs/benchmarks.md).
    #[default]
    FewestNew,
}

impl PrefillOrder {
    /// Its name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            PrefillOrder::Arrival => "arrival",
            PrefillOrder::FewestNew => "fewest-new",
        }
    }

    /// The index of the prompt to prefill next among `waiting` (admission order: tokens
    /// left to compute, engine steps since admission), `chunk` tokens a step at most.
    /// Ties go to the older.
    pub fn next(self, waiting: impl IntoIterator<Item = (usize, u64)>, chunk: usize) -> usize {
        match self {
            PrefillOrder::Arrival => 0,
            PrefillOrder::FewestNew => waiting
                .into_iter()
                .enumerate()
                .min_by_key(|&(i, (left, waited))| {
                    let credit = waited.saturating_mul(chunk.max(1) as u64);
                    ((left as u64).saturating_sub(credit), i)
                })
                .map_or(0, |(i, _)| i),
        }
    }

    /// The order in which the prompts behind the front are tried as riders of its pass
    /// (`rests`: each one's tokens left, in queue order; returns their positions in it):
    /// queue order in arrival order; with fewest-new the fewest tokens first (ties to the
    /// older), so a pass's leftover budget finishes as many prompts as fit.
    pub fn rider_order(self, rests: &[usize]) -> Vec<usize> {
        let mut order: Vec<usize> = (0..rests.len()).collect();
        if self == PrefillOrder::FewestNew {
            order.sort_by_key(|&i| rests[i]);
        }
        order
    }
}

impl fmt::Display for PrefillOrder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for PrefillOrder {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "arrival" => Ok(PrefillOrder::Arrival),
            "fewest-new" => Ok(PrefillOrder::FewestNew),
            _ => Err(format!(
                "unknown prefill order `{s}`: one of arrival, fewest-new"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arrival_takes_the_oldest() {
        assert_eq!(PrefillOrder::Arrival.next([(900, 0), (10, 0)], 512), 0);
    }

    #[test]
    fn fewest_new_takes_the_shortest_rest_and_waiting_counts_as_chunks() {
        let o = PrefillOrder::FewestNew;
        // A prompt mostly restored (300 left) goes before a cold one (4,000 left).
        assert_eq!(o.next([(4000, 0), (300, 0)], 512), 1);
        // Ties go to the older.
        assert_eq!(o.next([(300, 2), (300, 2)], 512), 0);
        // 4,000 tokens after 7 steps waited (7 × 512 = 3,584 credited) rank as 416: behind
        // 300; after 8 (4,096) as 0: ahead of anything.
        assert_eq!(o.next([(4000, 7), (300, 0)], 512), 1);
        assert_eq!(o.next([(4000, 8), (300, 0)], 512), 0);
        // A prompt whose last chunk is due goes first whatever waits.
        assert_eq!(o.next([(2000, 0), (700, 0), (0, 0)], 512), 2);
        assert_eq!(o.next(std::iter::empty(), 512), 0);
    }

    #[test]
    fn riders_are_tried_in_queue_order_or_fewest_tokens_first() {
        let rests = [900, 40, 300, 40];
        assert_eq!(PrefillOrder::Arrival.rider_order(&rests), vec![0, 1, 2, 3]);
        assert_eq!(
            PrefillOrder::FewestNew.rider_order(&rests),
            vec![1, 3, 2, 0]
        );
        assert!(PrefillOrder::FewestNew.rider_order(&[]).is_empty());
    }

    #[test]
    fn names_round_trip_and_unknown_ones_are_refused() {
        for o in [PrefillOrder::Arrival, PrefillOrder::FewestNew] {
            assert_eq!(o.name().parse::<PrefillOrder>(), Ok(o));
            assert_eq!(
                serde_json::to_string(&o).unwrap(),
                format!("\"{}\"", o.name())
            );
        }
        assert!("shortest"
            .parse::<PrefillOrder>()
            .unwrap_err()
            .contains("one of arrival, fewest-new"));
    }
}
