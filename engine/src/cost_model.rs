//! The restore-or-recompute cost model (docs/prefix-reuse.md, step 4).
//!
//! Four measures, each a least-squares fit `seconds = fixed + per_unit · n` over its most
//! recent [`WINDOW`] samples: prefill (n = new tokens, plus a term for the positions they
//! attend to over the cached context), host → device import, SSD reads and remote fetches
//! (n = blocks). [`plan_restore`] prices restoring each candidate prefix of a cached run
//! (the fixed term of every tier it touches plus its per-block terms) against the prefill
//! it saves (the marginal prefill cost: the fixed part is paid anyway) and restores the
//! prefix with the largest net saving, if its cost is at most [`RESTORE_MARGIN`] of it. The
//! samples are saved in the store per device ([`CostsFile`]).

use std::collections::HashMap;

use serde::{Deserialize, Serialize};
use store::Tier;

/// Samples a measure keeps: the most recent, so that a changed machine is followed.
pub(crate) const WINDOW: usize = 32;

/// A tier is restored only when its estimated cost is at most this share of the prefill it
/// saves: near break-even the estimates' noise would make some requests slower than
/// recomputing.
pub(crate) const RESTORE_MARGIN: f64 = 0.8;

/// SSD blocks read to measure the SSD's speed when no estimate exists yet.
pub(crate) const SSD_PROBE_BLOCKS: usize = 4;

/// Read rate an SSD nobody has measured yet is priced at: a slow disk (a cloud block
/// volume's baseline). A request reads an unmeasured SSD only where even such a disk beats
/// recomputing; elsewhere the SSD is measured off the request's path
/// ([`crate::KvTiers`]'s background probe), and the next request decides by that.
pub(crate) const UNMEASURED_SSD_BYTES_PER_S: f64 = 250e6;

/// Fixed cost an unmeasured SSD is priced at (opening files, the first seek).
pub(crate) const UNMEASURED_SSD_FIXED_S: f64 = 2e-3;

/// A request whose plan cuts the cached run measures again what the cut left out once in
/// this many ([`plan_with_probes`]: the SSD in the background, other tiers by restoring the
/// whole run), so a first restore that paid one-off costs or a tier that became fast again
/// does not stay cut for good.
pub(crate) const PROBE_EVERY: u64 = 16;

/// A fitted cost: `seconds = fixed_s + per_unit_s · n + per_position_s · (n·c + n²/2)` for
/// `n` units (tokens or blocks) after `c` cached tokens. The last term is prefill's
/// attention (each of n new tokens attends to the c cached ones and to the new ones before
/// it); it is zero for restores.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Fit {
    /// Seconds paid once, whatever the size (launches, a first pick, a transfer per layer
    /// part, opening files, a round trip).
    pub fixed_s: f64,
    /// Seconds per token (prefill) or per block (restores).
    pub per_unit_s: f64,
    /// Prefill: seconds per attended position.
    #[serde(default)]
    pub per_position_s: f64,
}

impl Fit {
    /// A cost proportional to its size (what the per-unit estimates of old cost files say).
    fn per_unit(seconds: f64) -> Fit {
        Fit {
            per_unit_s: seconds,
            ..Fit::default()
        }
    }

    /// Estimated seconds for `n` units after `cached` tokens.
    pub fn seconds(&self, n: usize, cached: usize) -> f64 {
        let n = n as f64;
        self.fixed_s + self.per_unit_s * n + self.per_position_s * attended(n, cached as f64)
    }

    /// Prefill seconds saved by starting at token `to` instead of `from` (`to >= from`): the
    /// marginal cost of the tokens between them (the fixed part is paid either way).
    fn saved_between(&self, from: usize, to: usize) -> f64 {
        let (from, to) = (from as f64, to as f64);
        self.per_unit_s * (to - from) + self.per_position_s * (to * to - from * from) / 2.0
    }

    fn is_valid(&self) -> bool {
        [self.fixed_s, self.per_unit_s, self.per_position_s]
            .iter()
            .all(|v| v.is_finite() && *v >= 0.0)
    }
}

/// Positions attended by `n` new tokens after `c` cached ones (causal): `n·c + n²/2`.
fn attended(n: f64, c: f64) -> f64 {
    n * c + n * n / 2.0
}

/// The restore cost estimates of one device, each for n blocks ([`Fit::seconds`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct RestoreEstimates {
    /// Moving blocks from host bytes to the device.
    pub import: Option<Fit>,
    /// Reading and verifying blocks from SSD.
    pub ssd: Option<Fit>,
    /// Fetching and verifying blocks from the remote tier.
    pub remote: Option<Fit>,
}

/// How many samples each measure of one device holds (at most [`WINDOW`] each).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CostSamples {
    /// Prefills.
    pub prefill: usize,
    /// Host → device imports.
    pub import: usize,
    /// SSD reads.
    pub ssd: usize,
    /// Remote fetches.
    pub remote: usize,
}

/// One measurement: `seconds` for `n` units after `c` cached tokens (0 for restores).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
struct Sample(f64, f64, f64);

impl Sample {
    fn is_valid(&self) -> bool {
        let Sample(n, c, s) = *self;
        n.is_finite() && c.is_finite() && s.is_finite() && n >= 1.0 && c >= 0.0 && s > 0.0
    }
}

/// The recent samples of one measure, and the estimate to use before there are any (from an
/// old cost file, or calibrated).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct Measure {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    prior: Option<Fit>,
    #[serde(default)]
    samples: Vec<Sample>,
}

impl Measure {
    /// Adds a sample (`n` units after `cached` tokens took `seconds`), dropping the oldest
    /// beyond [`WINDOW`]; an unusable one (no units, no time, not finite) is ignored.
    pub(crate) fn record(&mut self, n: usize, cached: usize, seconds: f64) {
        let sample = Sample(n as f64, cached as f64, seconds);
        if sample.is_valid() {
            self.samples.push(sample);
            self.keep_window();
        }
    }

    /// The fit of the samples (with the attention term when `with_positions`), else the
    /// prior; `None` when neither exists. Samples all of one size cannot separate the
    /// terms: they keep the prior's fixed part (at most their mean) and put the rest per
    /// unit, or without a prior go through the origin.
    pub(crate) fn fit(&self, with_positions: bool) -> Option<Fit> {
        let Some(&Sample(n, c, _)) = self.samples.first() else {
            return self.prior;
        };
        let one_size = self.samples.iter().all(|s| s.0 == n && s.1 == c);
        match (one_size, self.prior) {
            (true, Some(prior)) => {
                let mean =
                    self.samples.iter().map(|s| s.2).sum::<f64>() / self.samples.len() as f64;
                let fixed_s = prior.fixed_s.min(mean);
                Some(Fit {
                    fixed_s,
                    per_unit_s: (mean - fixed_s) / n,
                    per_position_s: 0.0,
                })
            }
            _ => Some(least_squares(&self.samples, with_positions)),
        }
    }

    /// [`Measure::fit`] where the samples span two sizes at least; where all have one size
    /// (whatever their cached tokens), its whole mean cost per unit, through the origin:
    /// the pessimistic reading, which makes a caller that sizes by it try a smaller size.
    pub(crate) fn fit_or_per_unit(&self, with_positions: bool) -> Option<Fit> {
        let &Sample(n, _, _) = self.samples.first()?;
        if self.samples.iter().any(|s| s.0 != n) {
            return self.fit(with_positions);
        }
        let mean = self.samples.iter().map(|s| s.2).sum::<f64>() / self.samples.len() as f64;
        Some(Fit::per_unit(mean / n))
    }

    /// Whether nothing is known: no sample and no prior.
    pub(crate) fn is_unknown(&self) -> bool {
        self.samples.is_empty() && self.prior.is_none()
    }

    /// Sets the estimate used until a sample arrives.
    pub(crate) fn set_prior(&mut self, prior: Fit) {
        self.prior = Some(prior);
    }

    /// The samples held, oldest first: (units, seconds) of each.
    pub(crate) fn sizes_and_seconds(&self) -> Vec<(usize, f64)> {
        self.samples.iter().map(|s| (s.0 as usize, s.2)).collect()
    }

    /// Samples held.
    pub(crate) fn len(&self) -> usize {
        self.samples.len()
    }

    /// Drops the oldest samples beyond [`WINDOW`].
    fn keep_window(&mut self) {
        let excess = self.samples.len().saturating_sub(WINDOW);
        self.samples.drain(..excess);
    }

    /// Drops unusable samples and an unusable prior (a hand-edited or damaged file) and
    /// anything beyond the window.
    fn sanitized(mut self) -> Self {
        self.samples.retain(Sample::is_valid);
        self.keep_window();
        self.prior = self.prior.filter(Fit::is_valid);
        self
    }
}

/// The terms a fit may use: 0 fixed, 1 per unit, 2 per attended position.
const TERMS: usize = 3;

/// Candidate sets of free terms, in order of preference on a tie (fewer terms first, a
/// per-unit cost before a fixed one): samples that cannot tell the terms apart (one sample,
/// all of one size) get a cost through the origin.
const SUBSETS: [&[usize]; 7] = [&[1], &[2], &[0], &[1, 2], &[0, 1], &[0, 2], &[0, 1, 2]];

/// Non-negative least squares of `samples` on the terms (fixed, per unit and, when
/// `with_positions`, per attended position). With so few terms the exact solution is found
/// by enumeration: it is the unconstrained least-squares solution on the subset of terms it
/// leaves non-zero, so the best non-negative subset solution is the optimum.
/// `samples` must not be empty.
fn least_squares(samples: &[Sample], with_positions: bool) -> Fit {
    let row = |s: &Sample| [1.0, s.0, attended(s.0, s.1)];
    // Columns scaled to at most 1 keep the normal equations well conditioned (positions
    // reach 10⁹ where the fixed column is 1).
    let mut scale = [0.0f64; TERMS];
    for s in samples {
        for (m, x) in scale.iter_mut().zip(row(s)) {
            *m = m.max(x.abs());
        }
    }
    let y_max = samples.iter().map(|s| s.2).fold(0.0, f64::max);
    let total: f64 = samples.iter().map(|s| s.2 * s.2).sum();
    // Two subsets whose residuals differ by less than this fit equally well.
    let tie = 1e-9 * total;
    let mut best: Option<(f64, [f64; TERMS])> = None;
    for subset in SUBSETS {
        if subset
            .iter()
            .any(|&j| scale[j] == 0.0 || (j == 2 && !with_positions))
        {
            continue;
        }
        let x = |s: &Sample, i: usize| row(s)[subset[i]] / scale[subset[i]];
        let k = subset.len();
        let mut normal = [[0.0f64; TERMS + 1]; TERMS];
        for s in samples {
            let xs: Vec<f64> = (0..k).map(|i| x(s, i)).collect();
            for (row, xi) in normal.iter_mut().zip(&xs) {
                for (cell, xj) in row.iter_mut().zip(&xs) {
                    *cell += xi * xj;
                }
                row[k] += xi * s.2;
            }
        }
        let Some(solution) = solve(&mut normal, k) else {
            continue;
        };
        // A coefficient below zero by more than rounding: the optimum is on another face.
        if solution[..k].iter().any(|&c| c < -1e-9 * y_max.max(1e-300)) {
            continue;
        }
        let mut coef = [0.0f64; TERMS];
        for i in 0..k {
            coef[subset[i]] = solution[i].max(0.0) / scale[subset[i]];
        }
        let sse: f64 = samples
            .iter()
            .map(|s| {
                let r = row(s);
                let e = s.2 - (0..TERMS).map(|j| coef[j] * r[j]).sum::<f64>();
                e * e
            })
            .sum();
        if best.is_none_or(|(b, _)| sse < b - tie) {
            best = Some((sse, coef));
        }
    }
    // The fixed term alone always solves (one sample at least): `best` is set.
    let coef = best.map_or([0.0; TERMS], |(_, c)| c);
    Fit {
        fixed_s: coef[0],
        per_unit_s: coef[1],
        per_position_s: coef[2],
    }
}

/// Solves the `k`×`k` system in `m` (right-hand side in column `k`) by Gaussian elimination
/// with partial pivoting; `None` when it is singular (the samples cannot separate the
/// terms).
fn solve(m: &mut [[f64; TERMS + 1]; TERMS], k: usize) -> Option<[f64; TERMS]> {
    let largest = (0..k).map(|i| m[i][i].abs()).fold(0.0, f64::max);
    for col in 0..k {
        let pivot = (col..k).max_by(|&a, &b| m[a][col].abs().total_cmp(&m[b][col].abs()))?;
        if m[pivot][col].abs() <= 1e-10 * largest {
            return None;
        }
        m.swap(col, pivot);
        let (top, below) = m.split_at_mut(col + 1);
        let pivot_row = &top[col];
        for row in &mut below[..k - col - 1] {
            let f = row[col] / pivot_row[col];
            for (cell, p) in row.iter_mut().zip(pivot_row).take(k + 1).skip(col) {
                *cell -= f * p;
            }
        }
    }
    let mut x = [0.0f64; TERMS];
    for r in (0..k).rev() {
        let rest: f64 = (r + 1..k).map(|c| m[r][c] * x[c]).sum();
        x[r] = (m[r][k] - rest) / m[r][r];
    }
    x.iter().all(|v| v.is_finite()).then_some(x)
}

/// The cost model of one device.
#[derive(Debug, Default, Clone, PartialEq)]
pub(crate) struct Costs {
    /// Prefilling n new tokens after c cached ones (with its fixed part: launches, the first
    /// pick).
    pub(crate) prefill: Measure,
    /// Moving n blocks from host bytes to the device (assembly + one transfer per layer
    /// part), whatever tier they came from.
    pub(crate) import: Measure,
    /// Reading and verifying n blocks from SSD.
    pub(crate) ssd: Measure,
    /// Fetching and verifying n blocks from the remote tier.
    pub(crate) remote: Measure,
    /// Requests whose cached run was cut; every [`PROBE_EVERY`]th measures it again.
    pub(crate) cuts: u64,
    /// What SSD blocks cost while the SSD has no estimate ([`Costs::price_unmeasured_ssd`];
    /// free until set). Not saved: it follows from the block size.
    pub(crate) unmeasured_ssd: Fit,
}

impl Costs {
    /// Prices an unmeasured SSD as a slow disk reading blocks of `block_bytes`
    /// ([`UNMEASURED_SSD_BYTES_PER_S`], [`UNMEASURED_SSD_FIXED_S`]).
    pub(crate) fn price_unmeasured_ssd(&mut self, block_bytes: u64) {
        self.unmeasured_ssd = Fit {
            fixed_s: UNMEASURED_SSD_FIXED_S,
            per_unit_s: block_bytes as f64 / UNMEASURED_SSD_BYTES_PER_S,
            per_position_s: 0.0,
        };
    }

    /// The prefill fit (with its attention term).
    pub(crate) fn prefill(&self) -> Option<Fit> {
        self.prefill.fit(true)
    }

    /// The import fit.
    pub(crate) fn import(&self) -> Option<Fit> {
        self.import.fit(false)
    }

    /// The SSD read fit.
    pub(crate) fn ssd(&self) -> Option<Fit> {
        self.ssd.fit(false)
    }

    /// The remote fetch fit.
    pub(crate) fn remote(&self) -> Option<Fit> {
        self.remote.fit(false)
    }

    /// How many samples each measure holds.
    pub(crate) fn samples(&self) -> CostSamples {
        CostSamples {
            prefill: self.prefill.len(),
            import: self.import.len(),
            ssd: self.ssd.len(),
            remote: self.remote.len(),
        }
    }

    /// This device's entry of a costs.json's bytes; an unreadable file is ignored with a
    /// warning (the estimates are an optimization), a missing entry gives empty measures.
    pub(crate) fn from_saved(bytes: &[u8], device: &str) -> Costs {
        match serde_json::from_slice::<HashMap<String, CostsFile>>(bytes) {
            Ok(mut all) => all.remove(device).map(Costs::from).unwrap_or_default(),
            Err(e) => {
                tracing::warn!(error = %e, "ignoring an unreadable cost model (costs.json)");
                Costs::default()
            }
        }
    }

    /// `bytes` (a costs.json, or nothing) with this device's entry replaced by `self`;
    /// other devices' entries are kept as they are, an unreadable file is replaced.
    pub(crate) fn merged_into(&self, bytes: Option<&[u8]>, device: &str) -> Option<Vec<u8>> {
        let mut all: serde_json::Map<String, serde_json::Value> = bytes
            .and_then(|b| serde_json::from_slice(b).ok())
            .unwrap_or_default();
        all.insert(
            device.to_string(),
            serde_json::to_value(CostsFile::from(self)).ok()?,
        );
        serde_json::to_vec(&all).ok()
    }
}

/// One device's entry in costs.json. Today's files hold the samples of each measure; files
/// written before the fits held one per-unit estimate per measure (`*_per_token`,
/// `*_per_block`), read back as priors.
#[derive(Debug, Default, Serialize, Deserialize)]
struct CostsFile {
    #[serde(default)]
    prefill: Option<Measure>,
    #[serde(default)]
    import: Option<Measure>,
    #[serde(default)]
    ssd: Option<Measure>,
    #[serde(default)]
    remote: Option<Measure>,
    #[serde(default, skip_serializing)]
    prefill_s_per_token: Option<f64>,
    #[serde(default, skip_serializing)]
    import_s_per_block: Option<f64>,
    #[serde(default, skip_serializing)]
    ssd_s_per_block: Option<f64>,
    #[serde(default, skip_serializing)]
    remote_s_per_block: Option<f64>,
}

impl From<CostsFile> for Costs {
    fn from(f: CostsFile) -> Costs {
        let measure = |m: Option<Measure>, old: Option<f64>| match m {
            Some(m) => m.sanitized(),
            None => Measure {
                prior: old.map(Fit::per_unit).filter(Fit::is_valid),
                samples: Vec::new(),
            },
        };
        Costs {
            prefill: measure(f.prefill, f.prefill_s_per_token),
            import: measure(f.import, f.import_s_per_block),
            ssd: measure(f.ssd, f.ssd_s_per_block),
            remote: measure(f.remote, f.remote_s_per_block),
            cuts: 0,
            unmeasured_ssd: Fit::default(),
        }
    }
}

impl From<&Costs> for CostsFile {
    fn from(c: &Costs) -> CostsFile {
        CostsFile {
            prefill: Some(c.prefill.clone()),
            import: Some(c.import.clone()),
            ssd: Some(c.ssd.clone()),
            remote: Some(c.remote.clone()),
            ..CostsFile::default()
        }
    }
}

/// Which prefix of a cached run to restore.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RestorePlan {
    /// Blocks to load (a prefix of the run).
    pub(crate) usable: usize,
    /// Blocks after it left in each tier (recomputed instead).
    pub(crate) ram_skipped: usize,
    pub(crate) ssd_skipped: usize,
    pub(crate) remote_skipped: usize,
}

impl RestorePlan {
    /// Restoring the first `usable` blocks of `tiers`.
    pub(crate) fn first(tiers: &[Tier], usable: usize) -> RestorePlan {
        let usable = usable.min(tiers.len());
        let count = |tier: Tier| tiers[usable..].iter().filter(|t| **t == tier).count();
        RestorePlan {
            usable,
            ram_skipped: count(Tier::Ram),
            ssd_skipped: count(Tier::Ssd),
            remote_skipped: count(Tier::Remote),
        }
    }
}

/// How much of the cached run `tiers` (block `i` holds tokens `start + i·block_size ..`) to
/// restore. Restoring the first k blocks costs the import's fixed and per-block terms, plus
/// the fixed and per-block terms of the SSD and the remote tier if it reads any of their
/// blocks; it saves prefilling k blocks' tokens after `start` (marginal cost, attention
/// included). Within one tier the net saving is convex in k, so its best is at a tier
/// boundary or the run's end: the candidate with the largest net saving whose cost is at most
/// [`RESTORE_MARGIN`] of its saving wins (none: everything is recomputed).
///
/// Without a prefill estimate everything is restored. A measure with no estimate costs
/// nothing, except an unmeasured SSD: it is priced as a slow disk ([`Costs::unmeasured_ssd`])
/// and read for at most [`SSD_PROBE_BLOCKS`] blocks (to measure it; the caller plans again).
pub(crate) fn plan_restore(
    tiers: &[Tier],
    costs: &Costs,
    start: usize,
    block_size: usize,
) -> RestorePlan {
    let Some(prefill) = costs.prefill() else {
        return RestorePlan::first(tiers, tiers.len());
    };
    let import = costs.import();
    let ssd = costs.ssd();
    let ssd_priced = ssd.or(Some(costs.unmeasured_ssd));
    let remote = costs.remote();
    let tier_cost = |fit: Option<Fit>, blocks: usize| match (fit, blocks) {
        (Some(f), 1..) => f.seconds(blocks, 0),
        _ => 0.0,
    };
    let mut best = (0, 0.0);
    let (mut ssd_blocks, mut remote_blocks) = (0, 0);
    for k in 1..=tiers.len() {
        match tiers[k - 1] {
            Tier::Ssd => ssd_blocks += 1,
            Tier::Remote => remote_blocks += 1,
            Tier::Ram => {}
        }
        if k < tiers.len() && tiers[k] == tiers[k - 1] {
            continue;
        }
        let cost = tier_cost(import, k)
            + tier_cost(ssd_priced, ssd_blocks)
            + tier_cost(remote, remote_blocks);
        let saved = prefill.saved_between(start, start + k * block_size);
        if cost <= RESTORE_MARGIN * saved && saved - cost > best.1 {
            best = (k, saved - cost);
        }
    }
    let mut usable = best.0;
    if ssd.is_none() {
        if let Some(first) = tiers.iter().position(|t| *t == Tier::Ssd) {
            usable = usable.min(first + SSD_PROBE_BLOCKS);
        }
    }
    RestorePlan::first(tiers, usable)
}

/// [`plan_restore`], except that every [`PROBE_EVERY`]th request whose run it cuts measures
/// again what the cut left out: a tier the plan stopped restoring from gets no new samples
/// otherwise, so one misleading sample (a first restore that paid one-off costs) or a tier
/// that became faster would keep it cut for good. Where the cut starts at an SSD block, the
/// request keeps its plan and the second value says to measure the SSD in the background
/// (off the request's path: the request is never slower than its plan); elsewhere the
/// request restores the whole run, a probe that costs at most what the estimates misjudge,
/// on one cut request in sixteen.
pub(crate) fn plan_with_probes(
    tiers: &[Tier],
    costs: &mut Costs,
    start: usize,
    block_size: usize,
) -> (RestorePlan, bool) {
    let plan = plan_restore(tiers, costs, start, block_size);
    if plan.usable < tiers.len() {
        costs.cuts += 1;
        if costs.cuts.is_multiple_of(PROBE_EVERY) {
            return match tiers[plan.usable] {
                Tier::Ssd => (plan, true),
                _ => (RestorePlan::first(tiers, tiers.len()), false),
            };
        }
    }
    (plan, false)
}

#[cfg(test)]
mod tests {
    use super::*;

    const R: Tier = Tier::Ram;
    const S: Tier = Tier::Ssd;
    const N: Tier = Tier::Remote;

    fn measure(prior: Option<Fit>) -> Measure {
        Measure {
            prior,
            samples: Vec::new(),
        }
    }

    /// Costs from priors: prefill per token, and per block for the SSD and the remote; the
    /// import costs nothing.
    fn costs(prefill_per_token: f64, ssd: f64, remote: f64) -> Costs {
        Costs {
            prefill: measure(Some(Fit::per_unit(prefill_per_token))),
            import: measure(Some(Fit::default())),
            ssd: measure(Some(Fit::per_unit(ssd))),
            remote: measure(Some(Fit::per_unit(remote))),
            cuts: 0,
            unmeasured_ssd: Fit::default(),
        }
    }

    fn fit(fixed_s: f64, per_unit_s: f64) -> Fit {
        Fit {
            fixed_s,
            per_unit_s,
            per_position_s: 0.0,
        }
    }

    fn close(a: f64, b: f64, rel: f64) -> bool {
        (a - b).abs() <= rel * a.abs().max(b.abs()).max(1e-12)
    }

    /// Deterministic noise in [-1, 1) (a 64-bit LCG).
    fn noise(state: &mut u64) -> f64 {
        *state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (*state >> 11) as f64 / (1u64 << 52) as f64 - 1.0
    }

    #[test]
    fn two_sizes_without_cached_tokens_fit_a_fixed_part_and_a_cost_per_token() {
        // What the warm-up's two prefills leave in a fresh estimate: the prior's line.
        let mut m = Measure::default();
        m.record(256, 0, 0.016);
        m.record(2048, 0, 0.040);
        let f = m.fit(true).unwrap();
        let per_token = 0.024 / 1792.0;
        assert!(close(f.per_unit_s, per_token, 1e-9), "{f:?}");
        assert!(close(f.fixed_s, 0.016 - 256.0 * per_token, 1e-9), "{f:?}");
        assert_eq!(f.per_position_s, 0.0, "{f:?}");
    }

    #[test]
    fn the_warm_up_samples_keep_the_cost_per_token_through_flat_early_requests() {
        // The H100's 13-turn session: prefills of 520-917 tokens took 17-20 ms, their
        // differences noise, not size. Fitted alone they read no cost per token, and no
        // restore saves anything by that estimate.
        let requests = [(520, 0, 0.0172), (592, 0, 0.0166), (917, 0, 0.0165)];
        let mut alone = Measure::default();
        for (n, c, t) in requests {
            alone.record(n, c, t);
        }
        let f = alone.fit(true).unwrap();
        assert_eq!(f.saved_between(0, 592), 0.0, "{f:?}");
        // Beside the warm-up's two timings (256 and 2,048 tokens) the slope stays.
        let mut m = Measure::default();
        m.set_prior(fit(0.0126, 1.34e-5));
        m.record(256, 0, 0.016);
        m.record(2048, 0, 0.040);
        for (n, c, t) in requests {
            m.record(n, c, t);
        }
        let f = m.fit(true).unwrap();
        // That session's RAM import of such a prefix took 0.25 ms: it must be worth it.
        let saved = f.saved_between(0, 592);
        assert!(
            RESTORE_MARGIN * saved > 4.0 * 0.00025,
            "a 592-token prefix saves more than its import: {saved} ({f:?})"
        );
        assert!(
            f.saved_between(0, 1344) > 2.0 * saved,
            "longer prefixes save more: {f:?}"
        );
    }

    #[test]
    fn the_fit_recovers_fixed_and_per_unit_terms_from_exact_samples() {
        let mut m = Measure::default();
        for n in [1, 4, 16, 64, 130] {
            m.record(n, 0, 0.002 + 0.0005 * n as f64);
        }
        let f = m.fit(false).unwrap();
        assert!(close(f.fixed_s, 0.002, 1e-6), "{f:?}");
        assert!(close(f.per_unit_s, 0.0005, 1e-6), "{f:?}");
        assert_eq!(f.per_position_s, 0.0);
    }

    #[test]
    fn the_fit_recovers_the_attention_term_of_prefill_from_exact_samples() {
        // 20 ms per request, 30 µs per token, 2 ns per attended position.
        let truth = Fit {
            fixed_s: 0.02,
            per_unit_s: 30e-6,
            per_position_s: 2e-9,
        };
        let mut m = Measure::default();
        for (n, c) in [
            (520, 0),
            (72, 512),
            (325, 576),
            (451, 896),
            (321, 1344),
            (67, 3456),
        ] {
            m.record(n, c, truth.seconds(n, c));
        }
        let f = m.fit(true).unwrap();
        assert!(close(f.fixed_s, truth.fixed_s, 1e-6), "{f:?}");
        assert!(close(f.per_unit_s, truth.per_unit_s, 1e-6), "{f:?}");
        assert!(close(f.per_position_s, truth.per_position_s, 1e-6), "{f:?}");
    }

    #[test]
    fn the_fit_recovers_the_terms_from_noisy_samples() {
        let mut state = 7;
        let mut m = Measure::default();
        for i in 0..WINDOW {
            let n = 1 + (i * 37) % 128;
            let exact = 0.01 + 0.0002 * n as f64;
            m.record(n, 0, exact * (1.0 + 0.05 * noise(&mut state)));
        }
        let f = m.fit(false).unwrap();
        assert!(close(f.fixed_s, 0.01, 0.15), "{f:?}");
        assert!(close(f.per_unit_s, 0.0002, 0.1), "{f:?}");
    }

    #[test]
    fn a_negative_term_is_clamped_to_zero_and_the_rest_refitted() {
        // Faster per unit on larger sizes than a straight line through zero allows: the
        // unconstrained fit has a negative fixed term; the constrained one goes through
        // the origin.
        let mut m = Measure::default();
        for (n, s) in [(10, 0.009), (20, 0.02), (40, 0.041)] {
            m.record(n, 0, s);
        }
        let f = m.fit(false).unwrap();
        assert_eq!(f.fixed_s, 0.0, "{f:?}");
        let through_origin = (10.0 * 0.009 + 20.0 * 0.02 + 40.0 * 0.041) / (100.0 + 400.0 + 1600.0);
        assert!(close(f.per_unit_s, through_origin, 1e-9), "{f:?}");
        // Slower on small sizes than any positive slope explains: a fixed cost alone.
        let mut m = Measure::default();
        for (n, s) in [(1, 0.05), (50, 0.04), (100, 0.045)] {
            m.record(n, 0, s);
        }
        let f = m.fit(false).unwrap();
        assert_eq!(f.per_unit_s, 0.0, "{f:?}");
        assert!(close(f.fixed_s, 0.045, 1e-9), "{f:?}");
    }

    #[test]
    fn samples_that_cannot_separate_the_terms_give_a_cost_through_the_origin() {
        // One sample.
        let mut m = Measure::default();
        m.record(8, 0, 0.016);
        assert_eq!(m.fit(false), Some(fit(0.0, 0.002)));
        // All of one size.
        m.record(8, 0, 0.024);
        m.record(8, 0, 0.020);
        let f = m.fit(false).unwrap();
        assert_eq!(f.fixed_s, 0.0, "{f:?}");
        assert!(close(f.per_unit_s, 0.0025, 1e-12), "{f:?}");
        // Prefill samples of one size and context: per token, no attention term.
        let mut p = Measure::default();
        p.record(100, 200, 0.5);
        p.record(100, 200, 0.5);
        assert_eq!(p.fit(true), Some(fit(0.0, 0.005)));
    }

    #[test]
    fn samples_of_one_size_keep_the_priors_fixed_part() {
        let mut m = Measure::default();
        m.set_prior(fit(0.004, 1e-4));
        m.record(16, 0, 0.010);
        m.record(16, 0, 0.012);
        // Mean 11 ms for 16 blocks: the prior's 4 ms fixed, 7 ms over 16 blocks.
        let f = m.fit(false).unwrap();
        assert_eq!(f.fixed_s, 0.004, "{f:?}");
        assert!(close(f.per_unit_s, 0.007 / 16.0, 1e-12), "{f:?}");
        // A prior whose fixed part exceeds what was measured is capped at the measurement.
        m.set_prior(fit(0.05, 0.0));
        let f = m.fit(false).unwrap();
        assert!(
            close(f.fixed_s, 0.011, 1e-12) && f.per_unit_s == 0.0,
            "{f:?}"
        );
        // Two sizes separate the terms: the prior no longer counts.
        m.record(64, 0, 0.002 + 64.0 * 1e-3);
        m.record(32, 0, 0.002 + 32.0 * 1e-3);
        let f = m.fit(false).unwrap();
        assert!(f.fixed_s < 0.011 && f.per_unit_s > 5e-4, "{f:?}");
    }

    #[test]
    fn without_samples_the_prior_is_used_and_unusable_samples_are_ignored() {
        let mut m = Measure::default();
        assert_eq!(m.fit(false), None);
        assert!(m.is_unknown());
        m.set_prior(fit(0.0, 0.003));
        assert_eq!(m.fit(false), Some(fit(0.0, 0.003)));
        m.record(0, 0, 0.1);
        m.record(4, 0, 0.0);
        m.record(4, 0, f64::NAN);
        assert_eq!(m.len(), 0);
        m.record(4, 0, 0.004);
        assert_eq!(m.fit(false), Some(fit(0.0, 0.001)));
    }

    #[test]
    fn the_window_keeps_the_most_recent_samples() {
        let mut m = Measure::default();
        // An old machine at 10 ms per block, then a new one at 1 ms.
        for n in 1..=WINDOW {
            m.record(n, 0, 0.01 * n as f64);
        }
        for n in 1..=WINDOW {
            m.record(n, 0, 0.001 * n as f64);
        }
        assert_eq!(m.len(), WINDOW);
        assert!(close(m.fit(false).unwrap().per_unit_s, 0.001, 1e-9));
    }

    #[test]
    fn a_small_ram_restore_whose_fixed_import_cost_exceeds_the_saving_is_not_restored() {
        // Recomputing: 30 µs per token, 32-token blocks: ~1 ms per block. Importing: 10 ms
        // fixed (a transfer per layer part), 0.1 ms per block.
        let mut c = costs(30e-6, 0.0, 0.0);
        c.import.set_prior(fit(0.01, 1e-4));
        let small = plan_restore(&[R; 8], &c, 0, 32);
        assert_eq!(small, RestorePlan::first(&[R; 8], 0));
        assert_eq!(small.ram_skipped, 8);
        let long = plan_restore(&[R; 64], &c, 0, 32);
        assert_eq!(long.usable, 64);
    }

    #[test]
    fn an_ssd_part_is_cut_where_its_fixed_and_per_block_cost_exceed_the_saving() {
        // Recomputing ~1 ms per block; importing is nearly free; the SSD costs 50 ms to
        // start (opening files) and 0.5 ms per block: 20 SSD blocks save 20 ms and cost 60.
        let mut c = costs(30e-6, 0.0, 0.0);
        c.import.set_prior(fit(1e-4, 1e-5));
        c.ssd.set_prior(fit(0.05, 5e-4));
        let run: Vec<Tier> = [[R; 10].as_slice(), &[S; 20]].concat();
        let plan = plan_restore(&run, &c, 0, 32);
        assert_eq!(
            plan,
            RestorePlan {
                usable: 10,
                ram_skipped: 0,
                ssd_skipped: 20,
                remote_skipped: 0
            }
        );
        // 400 SSD blocks save ~390 ms and cost ~250: restored.
        let run: Vec<Tier> = [[R; 10].as_slice(), &[S; 400]].concat();
        assert_eq!(plan_restore(&run, &c, 0, 32).usable, 410);
    }

    #[test]
    fn recomputing_deeper_into_a_long_context_saves_more_per_block() {
        // 10 µs per token and 10 ns per attended position: a block after 8K cached tokens
        // costs ~2.9 ms to recompute, one at the start ~0.3 ms. An SSD read of 1 ms a block
        // is worth it only deep in the context.
        let mut c = costs(10e-6, 1e-3, 0.0);
        c.prefill.set_prior(Fit {
            fixed_s: 0.05,
            per_unit_s: 10e-6,
            per_position_s: 10e-9,
        });
        assert_eq!(plan_restore(&[S; 8], &c, 0, 32).usable, 0);
        assert_eq!(plan_restore(&[S; 8], &c, 8192, 32).usable, 8);
    }

    #[test]
    fn a_host_to_device_transfer_slower_than_recompute_cuts_at_the_first_ram_block() {
        // Recomputing a 16-token block: 16 ms; moving a block to the device: 20 ms.
        let mut slow_import = costs(1e-3, 1e-3, 1e-3);
        slow_import.import.set_prior(Fit::per_unit(20e-3));
        let plan = plan_restore(&[R, R, S, N], &slow_import, 0, 16);
        assert_eq!(
            plan,
            RestorePlan {
                usable: 0,
                ram_skipped: 2,
                ssd_skipped: 1,
                remote_skipped: 1
            }
        );
        // The import counts on top of an SSD read: 10 + 10 ms > 0.8 × 16 ms.
        let mut both = costs(1e-3, 10e-3, 1e-3);
        both.import.set_prior(Fit::per_unit(10e-3));
        assert_eq!(plan_restore(&[R, S, S], &both, 0, 16).usable, 1);
    }

    #[test]
    fn a_remote_slower_than_recompute_is_cut_at_its_first_block() {
        let run = [R, R, S, N, N, N];
        // Recomputing a 16-token block: 16 ms; SSD 1 ms; remote 40 ms per block.
        let plan = plan_restore(&run, &costs(1e-3, 1e-3, 40e-3), 0, 16);
        assert_eq!(
            plan,
            RestorePlan {
                usable: 3,
                ram_skipped: 0,
                ssd_skipped: 0,
                remote_skipped: 3
            }
        );
        // Every 16th request that is cut restores everything anyway, to measure again;
        // requests restored whole are not counted.
        let mut c = costs(1e-3, 1e-3, 40e-3);
        let got: Vec<usize> = (0..32)
            .map(|_| plan_with_probes(&run, &mut c, 0, 16).0.usable)
            .collect();
        let probes: Vec<usize> = (0..32).filter(|&i| got[i] == 6).collect();
        assert_eq!(probes, vec![15, 31]);
        assert!(got.iter().all(|&u| u == 3 || u == 6));
        let mut fast = costs(1e-3, 1e-3, 2e-3);
        for _ in 0..20 {
            assert_eq!(plan_with_probes(&[R, N], &mut fast, 0, 16).0.usable, 2);
        }
        assert_eq!(fast.cuts, 0);
    }

    #[test]
    fn an_ssd_cut_is_measured_again_in_the_background_not_in_the_request() {
        // Recomputing a 16-token block: 16 ms; the SSD measured at 40 ms a block.
        let run = [R, R, S, S];
        let mut c = costs(1e-3, 40e-3, 1e-3);
        let got: Vec<(usize, bool)> = (0..32)
            .map(|_| {
                let (plan, measure) = plan_with_probes(&run, &mut c, 0, 16);
                (plan.usable, measure)
            })
            .collect();
        // Every request keeps the RAM part only; every 16th cut asks for the SSD to be
        // measured off its path.
        assert!(got.iter().all(|&(u, _)| u == 2));
        let measured: Vec<usize> = (0..32).filter(|&i| got[i].1).collect();
        assert_eq!(measured, vec![15, 31]);
    }

    #[test]
    fn a_remote_faster_than_recompute_is_restored() {
        let run = [R, S, N, N];
        let plan = plan_restore(&run, &costs(1e-3, 1e-3, 2e-3), 0, 16);
        assert_eq!(plan.usable, 4);
        assert_eq!(plan.remote_skipped, 0);
    }

    #[test]
    fn a_slow_ssd_cut_also_skips_the_remote_blocks_after_it() {
        let run = [R, S, S, N];
        let plan = plan_restore(&run, &costs(1e-3, 50e-3, 2e-3), 0, 16);
        assert_eq!(
            plan,
            RestorePlan {
                usable: 1,
                ram_skipped: 0,
                ssd_skipped: 2,
                remote_skipped: 1
            }
        );
    }

    #[test]
    fn an_unmeasured_ssd_is_probed_with_a_few_blocks_once_prefill_speed_is_known() {
        let run = [R, R, S, S, S, S, S, S, N];
        let mut no_ssd_yet = costs(1e-3, 0.0, 1e-6);
        no_ssd_yet.ssd = Measure::default();
        let plan = plan_restore(&run, &no_ssd_yet, 0, 16);
        assert_eq!(
            plan,
            RestorePlan {
                usable: 2 + SSD_PROBE_BLOCKS,
                ram_skipped: 0,
                ssd_skipped: 6 - SSD_PROBE_BLOCKS,
                remote_skipped: 1
            }
        );
        // Once measured fast, the whole run is restored.
        assert_eq!(
            plan_restore(&run, &costs(1e-3, 1e-4, 1e-6), 0, 16).usable,
            9
        );
    }

    #[test]
    fn an_unmeasured_ssd_is_read_only_where_a_slow_disk_would_beat_recomputing() {
        // Blocks of 1.5 MB: an unmeasured SSD is priced 2 ms + 6 ms a block.
        let run = [R, R, S, S, S, S, S, S];
        let mut c = costs(0.0, 0.0, 0.0);
        c.ssd = Measure::default();
        c.price_unmeasured_ssd(1_500_000);
        assert!(close(c.unmeasured_ssd.per_unit_s, 6e-3, 1e-9));
        // A fast prefill (a GPU: 10 µs a token, 0.3 ms a 32-token block): the RAM part
        // only, and no SSD probe on the request's path.
        c.prefill.set_prior(Fit::per_unit(10e-6));
        assert_eq!(
            plan_restore(&run, &c, 0, 32),
            RestorePlan {
                usable: 2,
                ram_skipped: 0,
                ssd_skipped: 6,
                remote_skipped: 0
            }
        );
        // A slow one (a CPU: 3 ms a token): probed with a few blocks.
        c.prefill.set_prior(Fit::per_unit(3e-3));
        assert_eq!(plan_restore(&run, &c, 0, 32).usable, 2 + SSD_PROBE_BLOCKS);
        // Once measured, the measurement decides, not the slow-disk price.
        c.ssd.set_prior(fit(1e-4, 1e-5));
        c.prefill.set_prior(Fit::per_unit(10e-6));
        assert_eq!(plan_restore(&run, &c, 0, 32).usable, 8);
    }

    #[test]
    fn an_unmeasured_ssd_is_not_probed_when_the_import_alone_loses() {
        let mut slow_import = costs(1e-3, 0.0, 0.0);
        slow_import.ssd = Measure::default();
        slow_import.import.set_prior(Fit::per_unit(20e-3));
        assert_eq!(
            plan_restore(&[S, S, S, S, S, S], &slow_import, 0, 16).usable,
            0
        );
    }

    #[test]
    fn without_measurements_everything_is_restored() {
        let run = [S, N, N];
        assert_eq!(plan_restore(&run, &Costs::default(), 0, 16).usable, 3);
        let mut no_remote_yet = costs(1e-3, 1e-3, 0.0);
        no_remote_yet.remote = Measure::default();
        assert_eq!(plan_restore(&run, &no_remote_yet, 0, 16).usable, 3);
    }

    #[test]
    fn a_cost_file_written_before_the_fits_loads_as_priors() {
        let old: &[u8] = br#"{"Device(gpu, 0)/gpu": {"prefill_s_per_token": 0.00003,
            "ssd_s_per_block": 0.0004, "remote_s_per_block": null, "import_s_per_block": 0.0002},
            "Device(cpu, 0)/cpu-only": {"prefill_s_per_token": 0.03}}"#;
        let c = Costs::from_saved(old, "Device(gpu, 0)/gpu");
        assert_eq!(c.prefill(), Some(Fit::per_unit(0.00003)));
        assert_eq!(c.ssd(), Some(Fit::per_unit(0.0004)));
        assert_eq!(c.import(), Some(Fit::per_unit(0.0002)));
        assert_eq!(c.remote(), None);
        assert_eq!(c.prefill.len(), 0);
        // Another device's entry is kept, as written, when this one is saved.
        let merged = c.merged_into(Some(old), "Device(gpu, 0)/gpu").unwrap();
        let other = Costs::from_saved(&merged, "Device(cpu, 0)/cpu-only");
        assert_eq!(other.prefill(), Some(Fit::per_unit(0.03)));
        assert_eq!(Costs::from_saved(&merged, "Device(gpu, 0)/gpu"), c);
    }

    #[test]
    fn samples_survive_a_save_and_a_reload() {
        let mut c = Costs::default();
        let mut state = 3;
        for i in 1..40 {
            c.prefill.record(
                10 * i,
                50 * i,
                0.01 + 1e-5 * i as f64 * (1.5 + noise(&mut state)),
            );
            c.ssd.record(i, 0, 0.002 + 3e-4 * i as f64);
        }
        c.import.set_prior(fit(0.0, 2e-4));
        let bytes = c.merged_into(None, "d").unwrap();
        let back = Costs::from_saved(&bytes, "d");
        assert_eq!(back.prefill.len(), WINDOW);
        assert_eq!(back.ssd.len(), WINDOW);
        assert_eq!(back.import(), Some(fit(0.0, 2e-4)));
        assert_eq!(back.remote(), None);
        let (a, b) = (c.prefill().unwrap(), back.prefill().unwrap());
        for (x, y) in [
            (a.fixed_s, b.fixed_s),
            (a.per_unit_s, b.per_unit_s),
            (a.per_position_s, b.per_position_s),
        ] {
            assert!(close(x, y, 1e-9), "{a:?} {b:?}");
        }
        // Another device saved later is merged beside it.
        let both = Costs::default()
            .merged_into(Some(bytes.as_slice()), "e")
            .unwrap();
        assert_eq!(Costs::from_saved(&both, "d").ssd.len(), WINDOW);
    }

    #[test]
    fn a_corrupt_cost_file_is_ignored() {
        let corrupt: [&[u8]; 4] = [
            b"{\"Device(gpu, 0)/gpu\": {\"prefill\": 7",
            b"\xff\xfe",
            b"[]",
            b"{\"d\": {\"prefill\": {\"samples\": \"many\"}}}",
        ];
        for bytes in corrupt {
            assert_eq!(Costs::from_saved(bytes, "d"), Costs::default());
        }
        // Samples no measurement gives (negative or zero seconds, no units) are dropped.
        let odd = br#"{"d": {"ssd": {"samples": [[4, 0, -1.0], [0, 0, 0.1], [4, 0, 0.004]],
            "prior": {"fixed_s": -1, "per_unit_s": 1}}}}"#;
        let c = Costs::from_saved(odd, "d");
        assert_eq!(c.ssd.len(), 1);
        assert_eq!(c.ssd.prior, None);
        // A corrupt file is replaced by the next save.
        let saved = Costs::default()
            .merged_into(Some(&b"\xff"[..]), "d")
            .unwrap();
        assert_eq!(Costs::from_saved(&saved, "d"), Costs::default());
    }
}
