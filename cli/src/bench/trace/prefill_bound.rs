//! What a cache's hits leave each request to prefill, as percentiles against the whole
//! prompts: the TTFT ratio (with the cache / without it) that the hits allow where a
//! request's TTFT follows the tokens it computes and no queue forms. A cache gets below it
//! only by shortening queues (an engine near its no-cache capacity); restores, fixed costs
//! per pass and attention over the cached context all push the ratio up towards 1.
//!
//! Why it matters: issue 18 asks for a P50 TTFT ratio of at most 0.5 on the Mooncake
//! conversation trace, whose median request reuses a small part of its prompt; the bound
//! says how much of that a cache can give at a load that leaves the engine idle between
//! bursts (docs/benchmarks.md, "How far hits can move TTFT").

use serde::Serialize;

use super::report::Percentiles;

/// The tokens a request computes, without a cache and with given hits, as nearest-rank
/// percentiles over the requests, and their ratios.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct PrefillBound {
    /// Prompt tokens per request (no cache).
    pub no_cache: Percentiles,
    /// Tokens left to prefill per request: its prompt less its hit, at least one (the last
    /// prompt token is always computed: its logits pick the first token).
    pub cached: Percentiles,
    /// `cached / no_cache` at each percentile.
    pub ratio: Percentiles,
}

impl PrefillBound {
    /// The bound of `requests`, each `(prompt tokens, hit tokens)`; `None` without requests.
    pub fn of(requests: impl IntoIterator<Item = (usize, usize)>) -> Option<PrefillBound> {
        let (prompts, left): (Vec<f64>, Vec<f64>) = requests
            .into_iter()
            .map(|(len, hit)| (len as f64, len.saturating_sub(hit).max(1) as f64))
            .unzip();
        if prompts.is_empty() {
            return None;
        }
        let no_cache = Percentiles::of(&prompts);
        let cached = Percentiles::of(&left);
        let over = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::NAN };
        Some(PrefillBound {
            no_cache,
            cached,
            ratio: Percentiles {
                p50: over(cached.p50, no_cache.p50),
                p90: over(cached.p90, no_cache.p90),
                p99: over(cached.p99, no_cache.p99),
            },
        })
    }

    /// `"0.558 / 0.812 / 0.867 (4488 / ... of 8041 / ... tokens)"`: the ratios, then the
    /// tokens left and the prompts' tokens at P50 / P90 / P99.
    pub fn describe(&self) -> String {
        let (c, n, r) = (&self.cached, &self.no_cache, &self.ratio);
        format!(
            "{:.3} / {:.3} / {:.3} ({:.0} / {:.0} / {:.0} of {:.0} / {:.0} / {:.0} tokens)",
            r.p50, r.p90, r.p99, c.p50, c.p90, c.p99, n.p50, n.p90, n.p99
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Hand-computed: prompts 10, 20, 30, 40 with hits 0, 15, 30, 10 leave 10, 5, 1 (a
    /// whole hit still computes its last token), 30. Nearest rank over four: P50 is the 2nd,
    /// P90 and P99 the 4th.
    #[test]
    fn percentiles_of_what_is_left_against_whole_prompts() {
        let b = PrefillBound::of([(10, 0), (20, 15), (30, 30), (40, 10)]).unwrap();
        assert_eq!(
            (b.no_cache.p50, b.no_cache.p90, b.no_cache.p99),
            (20.0, 40.0, 40.0)
        );
        // Left: 10, 5, 1, 30 → sorted 1, 5, 10, 30.
        assert_eq!(
            (b.cached.p50, b.cached.p90, b.cached.p99),
            (5.0, 30.0, 30.0)
        );
        assert_eq!((b.ratio.p50, b.ratio.p90), (0.25, 0.75));
        assert_eq!(
            b.describe(),
            "0.250 / 0.750 / 0.750 (5 / 30 / 30 of 20 / 40 / 40 tokens)"
        );
        // No hits: every ratio is 1.
        let none = PrefillBound::of([(7, 0), (9, 0)]).unwrap();
        assert_eq!((none.ratio.p50, none.ratio.p99), (1.0, 1.0));
        assert!(PrefillBound::of([]).is_none());
    }
}
