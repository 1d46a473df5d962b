//! What an engine with a prefix cache measures before its first request, so that the
//! first requests' restore-or-recompute decisions rest on this machine's costs: the
//! restore path ([`KvTiers::warm_restore`], the import's prior) and here the prefill's
//! fixed and per-token cost (the prefill estimate's prior).
//!
//! Why the prefill: with one measured prompt the estimate cannot separate a prefill's fixed
//! cost (launching a pass of every layer, the first pick) from its cost per token, and
//! reads it all as per-token, which overstates what restoring a short prefix saves: on
//! the H200 a SmolLM2-shaped prefill costs ~24 ms whether it computes 80 or 592 tokens
//! (docs/benchmarks.md, session 18, the 13-turn session's worst turn).

use std::time::Instant;

use crate::cost_model::Fit;
use crate::error::Result;
use crate::model::Model;
use crate::reuse::KvTiers;

/// Prompt lengths the prefill is timed at on a GPU (a pass's fixed cost shows at the
/// first, the cost per token between them) and on the CPU (where every token costs
/// milliseconds, shorter). On a GPU both must lie past where a pass stops being bound by
/// its launches: on the H100 a SmolLM2-shaped prefill costs ~17 ms from 32 to ~600 tokens
/// and ~20 µs a token beyond (docs/benchmarks.md, session 50), so timing 32 and 512 read
/// no cost per token at all and the estimate priced every restore as saving nothing.
const GPU_LENGTHS: (usize, usize) = (256, 2048);
const CPU_LENGTHS: (usize, usize) = (8, 64);
/// Rounds of two timed runs per length the warm-up takes at most, while the long prefill
/// times no slower than the short one.
const MAX_TIMING_ROUNDS: usize = 4;

/// Times a prefill of two lengths on a fresh cache of `tiers` (each three times, more where
/// noise made the long one look no slower; the first run pays kernels' first use and is
/// not counted, the fastest of the others is) and sets the prefill estimate's prior from
/// them where it knows nothing yet. The prior's values at both lengths are also kept as
/// the estimate's first samples, so the requests' own samples are fitted beside them: a
/// few requests of similar lengths, whose times differ by noise more than by their sizes,
/// would otherwise fit a cost per token of zero and undo the prior. Returns the prior
/// measured, or `None` when the estimate already knew something (a saved cost file) and
/// nothing was run.
pub(crate) fn warm_prefill(model: &Model, tiers: &KvTiers) -> Result<Option<Fit>> {
    if !tiers.prefill_is_unknown() {
        return Ok(None);
    }
    let (short, long) = match mlx::default_device()? {
        mlx::Device::Gpu => GPU_LENGTHS,
        mlx::Device::Cpu => CPU_LENGTHS,
    };
    let long = long.min(model.info().max_position_embeddings.saturating_sub(1));
    if long <= short {
        return Ok(None);
    }
    let time = |n: usize| -> Result<f64> {
        // Any valid token; a prefill's cost does not depend on which.
        let tokens = vec![1u32.min(model.info().vocab_size as u32 - 1); n];
        let mut cache = tiers.empty_cache()?;
        let t = Instant::now();
        let logits = model.forward(&tokens, &mut cache)?;
        // The first pick, read, as a request's prefill ends.
        logits.argmax(-1, false)?.to_vec::<u32>()?;
        Ok(t.elapsed().as_secs_f64())
    };
    time(short)?;
    time(long)?;
    // The fastest timed run of each: one run interrupted on a busy machine could make the
    // long prefill look no slower than the short one, a cost per token of zero, which
    // prices every restore as saving nothing. A longer prefill is never really cheaper, so
    // while it looks so, both are timed again (a few rounds at most; a machine that stays
    // that noisy keeps the flat prior, clamped below).
    let (mut t_short, mut t_long) = (f64::INFINITY, f64::INFINITY);
    for _ in 0..MAX_TIMING_ROUNDS {
        t_short = t_short.min(time(short)?).min(time(short)?);
        t_long = t_long.min(time(long)?).min(time(long)?);
        if t_long > t_short {
            break;
        }
    }
    let per_token = ((t_long - t_short) / (long - short) as f64).max(0.0);
    let prior = Fit {
        fixed_s: (t_short - per_token * short as f64).max(0.0),
        per_unit_s: per_token,
        per_position_s: 0.0,
    };
    tiers.set_prefill_prior(prior);
    // The prior's own points, not the raw timings: where noise made those inconsistent
    // (the long prefill no slower, or a line through them below zero at no tokens), the
    // prior is clamped, and raw samples would fit another line than the prior.
    tiers.record_prefill(short, 0, prior.seconds(short, 0));
    tiers.record_prefill(long, 0, prior.seconds(long, 0));
    Ok(Some(prior))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reuse::ReuseConfig;

    fn tiers(dir: &std::path::Path, restore_always: bool) -> (Model, KvTiers) {
        let model_dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/goldens/tiny-qwen3");
        let (model, tok) = crate::load(&model_dir, &crate::LoadOptions::default()).unwrap();
        let config = ReuseConfig {
            store: store::StoreConfig::default().root(dir),
            block_size: 4,
            restore_always,
            ..ReuseConfig::default()
        };
        let tiers = KvTiers::open(&model, &tok, config).unwrap();
        (model, tiers)
    }

    #[test]
    fn a_prefill_prior_is_measured_once_and_only_where_estimates_decide() {
        let dir = tempfile::tempdir().unwrap();
        let (model, t) = tiers(dir.path(), false);
        assert!(
            t.prefill_estimate().is_none(),
            "a fresh store knows no prefill cost"
        );
        let prior = warm_prefill(&model, &t).unwrap().expect("measured");
        assert!(prior.fixed_s >= 0.0 && prior.per_unit_s >= 0.0 && prior.per_position_s == 0.0);
        assert!(prior.fixed_s + prior.per_unit_s > 0.0, "{prior:?}");
        // The two timings are the estimate's first samples, and their fit is the prior.
        let fit = t.prefill_estimate().expect("an estimate");
        let near = |a: f64, b: f64| (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1e-12);
        assert!(
            near(fit.fixed_s, prior.fixed_s)
                && near(fit.per_unit_s, prior.per_unit_s)
                && fit.per_position_s == 0.0,
            "the prior is the estimate now: {fit:?} against {prior:?}"
        );
        assert!(
            warm_prefill(&model, &t).unwrap().is_none(),
            "known: not measured again"
        );
        // Requests' samples are fitted beside the warm-up's: a request that took exactly
        // what the prior says leaves the estimate where it was.
        t.record_prefill(40, 0, prior.seconds(40, 0));
        let fit = t.prefill_estimate().unwrap();
        assert!(
            near(fit.fixed_s, prior.fixed_s) && near(fit.per_unit_s, prior.per_unit_s),
            "{fit:?} against {prior:?}"
        );
        // Requests of nearby lengths whose times differ by noise more than by size (here:
        // not at all) do not fit away the cost per token the warm-up measured.
        for n in [20, 30, 50] {
            t.record_prefill(n, 0, prior.seconds(40, 0));
        }
        let fit = t.prefill_estimate().unwrap();
        assert!(
            fit.per_unit_s > 0.0 || fit.per_position_s > 0.0,
            "the warm-up's sizes keep a cost per token: {fit:?} (prior {prior:?})"
        );

        let dir = tempfile::tempdir().unwrap();
        let (model, t) = tiers(dir.path(), true);
        assert!(
            warm_prefill(&model, &t).unwrap().is_none(),
            "restore_always: no estimate used"
        );
    }
}
