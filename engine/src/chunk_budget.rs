//! [`ChunkBudget`]: how many prompt tokens an engine step prefills while rows decode.
//!
//! A step that carries a prefill chunk delays every decoding row by that chunk's cost. With
//! a fixed chunk the delay is whatever the chunk costs on this machine and model: on the
//! CPU a 512-token chunk of SmolLM2 takes several decode steps, so a long prompt arriving
//! triples the running streams' inter-token latency (docs/benchmarks.md). As Sarathi-Serve
//! does, the budget here is time, learned from the engine's own steps: a step with a chunk
//! may take at most `stretch` times a decode-only step, and the chunk is the largest power
//! of two (so chunk starts stay aligned) whose cost fits.
//!
//! A chunk's cost is what steps of its size measured, where one ran, else the fit of all
//! chunks (a fixed part, a part per token and one per attended position). Measured sizes
//! come first because the cost is not one line: on the CPU, 8 decoding rows and 8 prompt
//! tokens stay in the row kernel while 16 go to BLAS, whose copy of every weight adds ~30
//! ms (docs/server.md, "Step budget"); a fit across both reads that as a fixed cost of
//! every chunk. Where nothing fits and the smallest size has not run, it runs once.
//!
//! A chunk is never one whose time per token is over twice the best (the best measured
//! size's where any was measured, else the fit's: at most 2x the prefill time per token
//! while rows decode). Where no chunk fits the budget, the smallest that meets this runs:
//! a large one where a pass's fixed cost dwarfs a token's (the H200's case), a few dozen
//! tokens where tokens are dear.

use crate::cost_model::Measure;
use std::collections::BTreeMap;

/// The smallest chunk the budget picks.
pub(crate) const MIN_CHUNK: usize = 8;

/// Weight of the newest step in a chunk size's running estimate of its cost.
const SIZE_WEIGHT: f64 = 0.5;

/// Weight of the newest decode-only step in the running estimate of its time.
const DECODE_WEIGHT: f64 = 0.25;

/// The chunk budget of one engine: its setting and what it has measured.
#[derive(Debug)]
pub(crate) struct ChunkBudget {
    /// A step with a chunk may take this multiple of a decode-only step; `None` always
    /// runs the engine's whole `prefill_chunk`.
    stretch: Option<f64>,
    /// Running estimate of a decode-only step's seconds.
    decode_s: Option<f64>,
    /// What a chunk adds to a step: seconds beyond the decode estimate for n prompt tokens
    /// after c cached ones.
    chunks: Measure,
    /// The same by the number of prompt tokens a step ran: a running estimate of each.
    by_size: BTreeMap<usize, f64>,
}

impl ChunkBudget {
    /// A budget of `stretch` times a decode-only step (`None`: no budget).
    pub(crate) fn new(stretch: Option<f64>) -> Self {
        ChunkBudget {
            stretch: stretch.filter(|s| s.is_finite() && *s > 1.0),
            decode_s: None,
            chunks: Measure::default(),
            by_size: BTreeMap::new(),
        }
    }

    /// A step that decoded and prefilled nothing took `seconds`.
    pub(crate) fn observe_decode(&mut self, seconds: f64) {
        if !(seconds.is_finite() && seconds > 0.0) {
            return;
        }
        self.decode_s = Some(match self.decode_s {
            Some(d) => d + DECODE_WEIGHT * (seconds - d),
            None => seconds,
        });
    }

    /// A step that decoded and prefilled `tokens` after `cached` took `seconds`.
    pub(crate) fn observe_chunk(&mut self, tokens: usize, cached: usize, seconds: f64) {
        if let Some(d) = self.decode_s {
            let beyond = (seconds - d).max(1e-6);
            self.chunks.record(tokens, cached, beyond);
            let e = self.by_size.entry(tokens).or_insert(beyond);
            *e += SIZE_WEIGHT * (beyond - *e);
        }
    }

    /// What a step of `seconds` that decoded and ran a chunk spent beyond a decode-only
    /// step (all of it before a decode-only step was measured): the chunk's share.
    pub(crate) fn beyond_decode(&self, seconds: f64) -> f64 {
        (seconds - self.decode_s.unwrap_or(0.0)).max(0.0)
    }

    /// The most prompt tokens a step prefills after `cached` while rows decode, at most
    /// `ceiling` (the engine's `prefill_chunk`).
    pub(crate) fn most(&self, cached: usize, ceiling: usize) -> usize {
        // Chunks all of one size cannot tell a fixed cost from a cost per token: read them
        // as per token, so the next chunk is smaller and the fit then separates the two.
        match (
            self.stretch,
            self.decode_s,
            self.chunks.fit_or_per_unit(true),
        ) {
            (Some(stretch), Some(decode_s), Some(fit)) => {
                let cost = |n: usize| match self.by_size.get(&n) {
                    Some(&measured) => (measured, true),
                    None => (fit.seconds(n, cached), false),
                };
                let untried = !self.by_size.contains_key(&MIN_CHUNK);
                chunk_within(cost, (stretch - 1.0) * decode_s, ceiling, untried)
            }
            _ => ceiling,
        }
    }
}

/// The largest power-of-two chunk (at least [`MIN_CHUNK`], at most `ceiling`, or
/// `ceiling` itself) whose `cost` is at most `budget_s` and whose time per token is at
/// most twice the best of these sizes'. Where none fits: [`MIN_CHUNK`] when
/// `min_untried` (a cost read from larger chunks may not hold for it), else the smallest
/// size within twice the best time per token. `cost` gives each size's seconds and
/// whether they were measured; where any size was, the best time per token is the best
/// measured one (a fit's estimate for a size not run may be far too low on a machine
/// whose cost is not one line, and would make every measured size look dear).
pub(crate) fn chunk_within(
    cost: impl Fn(usize) -> (f64, bool),
    budget_s: f64,
    ceiling: usize,
    min_untried: bool,
) -> usize {
    let ceiling = ceiling.max(1);
    if ceiling <= MIN_CHUNK {
        return ceiling;
    }
    let mut sizes: Vec<usize> = std::iter::successors(Some(MIN_CHUNK), |n| Some(n * 2))
        .take_while(|&n| n < ceiling)
        .collect();
    sizes.push(ceiling);
    let costs: Vec<(usize, f64, bool)> = sizes
        .iter()
        .map(|&n| {
            let (c, measured) = cost(n);
            (n, c, measured)
        })
        .collect();
    let any_measured = costs.iter().any(|c| c.2);
    let best = costs
        .iter()
        .filter(|c| c.2 || !any_measured)
        .map(|&(n, c, _)| c / n as f64)
        .fold(f64::INFINITY, f64::min);
    let efficient = |&&(n, c, _): &&(usize, f64, bool)| c <= 2.0 * best * n as f64;
    if let Some(&(n, _, _)) = costs.iter().rfind(|p| efficient(p) && p.1 <= budget_s) {
        return n;
    }
    if min_untried {
        return MIN_CHUNK;
    }
    costs.iter().find(efficient).map_or(ceiling, |&(n, _, _)| n)
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::cost_model::Fit;

    fn fit(fixed_s: f64, per_unit_s: f64) -> Fit {
        Fit {
            fixed_s,
            per_unit_s,
            per_position_s: 0.0,
        }
    }

    /// [`chunk_within`] with every size's cost from `f` after `cached` tokens.
    fn within(f: Fit, cached: usize, budget_s: f64, ceiling: usize) -> usize {
        chunk_within(|n| (f.seconds(n, cached), false), budget_s, ceiling, false)
    }

    #[test]
    fn the_chunk_is_the_largest_power_of_two_within_the_budget() {
        // 1 ms fixed + 1 ms a token, 100 ms of budget: 64 tokens cost 65 ms, 128 cost 129.
        assert_eq!(within(fit(0.001, 0.001), 0, 0.100, 512), 64);
        // Everything fits: the ceiling, even when it is not a power of two.
        assert_eq!(within(fit(0.001, 0.0001), 0, 1.0, 500), 500);
        // Nothing fits: the smallest chunk.
        assert_eq!(within(fit(0.001, 0.01), 0, 0.05, 512), MIN_CHUNK);
    }

    #[test]
    fn a_fixed_cost_that_dwarfs_the_tokens_keeps_a_large_chunk() {
        // A pass costs 40 ms whatever its tokens, 10 µs a token, the budget is 10 ms: no
        // chunk fits; 512 tokens cost 88 µs a token, and 256 (166 µs) are the smallest
        // within twice that.
        assert_eq!(within(fit(0.040, 0.00001), 0, 0.010, 512), 256);
    }

    #[test]
    fn a_fixed_cost_over_the_budget_still_shrinks_a_dear_chunk() {
        // About 31 ms fixed and 1.7 ms a token against a 24.5 ms budget. No chunk fits;
        // 16 tokens (58 ms, 3.6 ms a token) would be mostly fixed cost, 32 (85 ms) are
        // not, and the whole 512 would take 0.9 s.
        assert_eq!(within(fit(0.031, 0.0017), 0, 0.0245, 512), 32);
    }

    #[test]
    fn a_chunk_is_never_mostly_its_fixed_cost() {
        // 20 ms fixed, 0.5 ms a token, 30 ms budget: 16 tokens would fit (28 ms) but spend
        // 71 % of it on the fixed cost; 64 tokens are the first within twice the best time
        // a token.
        assert_eq!(within(fit(0.020, 0.0005), 0, 0.030, 512), 64);
    }

    #[test]
    fn attention_over_the_cached_context_shrinks_the_chunk() {
        let f = Fit {
            fixed_s: 0.0,
            per_unit_s: 0.001,
            per_position_s: 1e-6,
        };
        // After 0 cached: 64 tokens cost 66 ms; after 4,096 cached 16 cost 82 ms.
        assert_eq!(within(f, 0, 0.100, 512), 64);
        assert_eq!(within(f, 4096, 0.100, 512), 16);
    }

    #[test]
    fn measured_sizes_outrank_the_fit_and_the_smallest_size_is_tried() {
        // The CPU's mixed step (cpu-vm, SmolLM2, 8 rows decoding in 49 ms, stretch 1.5: a
        // 24.5 ms budget): 512 tokens add 0.92 s, 16 tokens 57 ms (24 rows: BLAS and its
        // weight copy). A line through both puts ~29 ms of fixed cost on every chunk, so 8
        // tokens would not fit either; they have not run, so they are tried.
        let mut b = ChunkBudget::new(Some(1.5));
        b.observe_decode(0.049);
        b.observe_chunk(512, 0, 0.049 + 0.92);
        b.observe_chunk(16, 512, 0.049 + 0.057);
        assert_eq!(b.most(528, 512), MIN_CHUNK);
        // 8 tokens add 18 ms (16 rows: the row kernel): they fit, and stay.
        b.observe_chunk(8, 528, 0.049 + 0.018);
        assert_eq!(b.most(536, 512), 8);
        // Once tried, a size that does not fit is not tried again: where 8 tokens add 45
        // ms (5.6 ms a token), the smallest size within twice the best time a token (1.8
        // ms, the 512-token chunk's) runs: 16 tokens at 3.6 ms.
        let mut b = ChunkBudget::new(Some(1.5));
        b.observe_decode(0.049);
        b.observe_chunk(512, 0, 0.049 + 0.92);
        b.observe_chunk(8, 512, 0.049 + 0.045);
        b.observe_chunk(16, 520, 0.049 + 0.057);
        assert_eq!(b.most(536, 512), 16);
    }

    #[test]
    fn a_fitted_size_never_sets_the_bar_for_measured_ones() {
        // Session 33's slow stretch arm (cpu-vm, SmolLM2, 8 rows decoding in 49 ms): the
        // 512-token chunk measured 1.8 ms a token, 16 tokens 4 ms and 32 tokens 2.5 ms; a line through the
        // measured sizes put 128 unmeasured tokens at ~1.2 ms a token. Against that
        // estimate, 32 measured tokens were over twice the best and 128 ran (a 150 ms
        // stall). Against the best measured size (1.8 ms) 32 tokens are efficient, and
        // the smallest efficient size runs.
        let measured = [(8, 0.071), (16, 0.064), (32, 0.080), (512, 0.92)];
        let cost = |n: usize| match measured.iter().find(|m| m.0 == n) {
            Some(&(_, s)) => (s, true),
            None => (n as f64 * 0.0012, false),
        };
        assert_eq!(chunk_within(cost, 0.0245, 512, false), 32);
        // With nothing measured the fit is all there is: the same estimates set the bar.
        let fitted = |n: usize| (cost(n).0, false);
        assert_eq!(chunk_within(fitted, 0.0245, 512, false), 64);
    }

    #[test]
    fn without_a_stretch_or_measurements_the_ceiling_runs() {
        let mut b = ChunkBudget::new(None);
        b.observe_decode(0.1);
        b.observe_chunk(512, 0, 0.74);
        assert_eq!(b.most(0, 512), 512);
        let mut b = ChunkBudget::new(Some(1.5));
        assert_eq!(b.most(0, 512), 512, "no decode step measured yet");
        b.observe_decode(0.1);
        assert_eq!(b.most(0, 512), 512, "no chunk measured yet");
        // 512 tokens added 0.64 s to a 0.1 s step: through the origin, 1.25 ms a token;
        // the budget is 50 ms: 32 tokens.
        b.observe_chunk(512, 0, 0.74);
        assert_eq!(b.most(0, 512), 32);
        // A stretch of 1 or less (or not finite) is no budget.
        assert_eq!(ChunkBudget::new(Some(1.0)).stretch, None);
        assert_eq!(ChunkBudget::new(Some(f64::NAN)).stretch, None);
    }

    #[test]
    fn chunks_of_one_size_are_read_as_cost_per_token_until_another_size_runs() {
        let mut b = ChunkBudget::new(Some(1.5));
        b.observe_decode(0.1);
        // 512-token chunks after growing contexts, each 0.5 s: a fixed cost and a cost per
        // attended position would explain them as well; per token it is 0.98 ms, so the
        // 50 ms budget takes 32 tokens.
        for c in [0, 512, 1024, 1536] {
            b.observe_chunk(512, c, 0.6);
        }
        assert_eq!(b.most(2048, 512), 32);
        // A 32-token chunk then costs 40 ms: about 9 ms fixed and 0.96 ms a token fit both
        // sizes, so 64 tokens would take 70 ms: 32 stays.
        b.observe_chunk(32, 2048, 0.14);
        assert_eq!(b.most(2048, 512), 32);
    }

    #[test]
    fn a_chunk_is_charged_what_its_step_took_beyond_a_decode_step() {
        let mut b = ChunkBudget::new(None);
        assert_eq!(
            b.beyond_decode(0.3),
            0.3,
            "no decode step measured: all of it"
        );
        b.observe_decode(0.1);
        assert!((b.beyond_decode(0.3) - 0.2).abs() < 1e-12);
        assert_eq!(b.beyond_decode(0.05), 0.0);
    }

    #[test]
    fn the_decode_estimate_follows_recent_steps() {
        let mut b = ChunkBudget::new(Some(2.0));
        b.observe_decode(0.1);
        b.observe_decode(0.2);
        let d = b.decode_s.unwrap();
        assert!((d - 0.125).abs() < 1e-12, "{d}");
        b.observe_decode(f64::NAN);
        b.observe_decode(-1.0);
        assert_eq!(b.decode_s, Some(d));
    }
}
