//! [`DeviceSampler`]: picks the next token as MLX ops on the device, so a decode step's
//! output stays on the device and the next step can be built from it before the host has
//! read it (see `generate`'s pipelined loop). Greedy, temperature, top-k, top-p, min-p,
//! repetition / presence / frequency penalties, seeds and log-probabilities, with the
//! semantics of the host [`crate::sampler::Sampler`]:
//!
//! - Greedy picks are identical (MLX's argmax takes the first of equal maxima, as the host
//!   does), so greedy output is token for token what the host sampler gives.
//! - Penalties are kept as per-token counts on the device (the repetition window over the
//!   last `repetition_context` tokens of prompt and output, and the output's counts), updated
//!   by one one-hot add per step, and applied to the logits as the host applies them.
//! - Draws use MLX's counter-based PRNG (`random::categorical` under a key split once per
//!   step from the seed), not the host's splitmix64: a seed reproduces a device draw exactly,
//!   but not the host sampler's draw for the same seed. The filters cut at a threshold, so
//!   tokens tied with the last one kept are all kept (the host keeps the lower ids of a tie
//!   to exactly k or to the top-p mass). The tests compare distributions, not single draws
//!   (docs/engine.md).
//! - A grammar's mask of allowed tokens ([`DeviceSampler::select_masked`]) sets every other
//!   logit to -inf after the penalties, before the pick and its filters.

use std::sync::{Arc, Mutex, OnceLock};

use mlx::{Array, Dtype};

use crate::error::Result;
use crate::sampler::{Sampled, SamplingParams};

/// The device's pick of one token, not yet read.
pub(crate) struct Selection {
    /// The token id, `[1]` u32.
    pub(crate) token: Array,
    picked: Picked,
}

/// Where a selection's log-probabilities come from.
enum Picked {
    /// Its own ops: the log-probability `[1]` f32 under the raw logits and the most likely
    /// alternatives, ids `[n]` u32 and log-probabilities `[n]` f32.
    Own {
        logprob: Array,
        top: Option<(Array, Array)>,
    },
    /// Row `row` of a batch of greedy picks made together.
    Batch { batch: Arc<GreedyBatch>, row: usize },
}

/// The greedy picks of several rows of one decode step, made by one argmax over the rows'
/// logits `[B, vocab]` and read to the host once for all of them (instead of a few ops and
/// two reads per row): for rows without penalties, grammar masks, draws or requested
/// log-probabilities, where a pick is the argmax of the raw logits.
pub(crate) struct GreedyBatch {
    /// `[B]` u32 picks and `[B]` f32 log-probabilities under the raw logits (each pick's
    /// logit, the row's maximum, minus the row's log-sum-exp); behind a lock only so the
    /// rows' selections can move between threads with the sequences that hold them.
    arrays: Mutex<(Array, Array)>,
    /// The host's copy, read by the first row that needs it.
    read: OnceLock<(Vec<u32>, Vec<f32>)>,
}

impl GreedyBatch {
    /// The picks of every row of `logits` (`[B, vocab]`, lazy), not yet computed.
    pub(crate) fn new(logits: &Array) -> Result<Arc<Self>> {
        let tokens = logits.argmax(-1, false)?.astype(Dtype::U32)?;
        let logprobs = logits.max(-1, false)?.sub(&logits.logsumexp(-1, false)?)?;
        Ok(Arc::new(GreedyBatch {
            arrays: Mutex::new((tokens, logprobs)),
            read: OnceLock::new(),
        }))
    }

    /// Row `row`'s pick.
    pub(crate) fn selection(self: &Arc<Self>, row: usize) -> Result<Selection> {
        let r = row as i32;
        let (tokens, _) = self.arrays()?;
        Ok(Selection {
            token: tokens.slice(&[r], &[r + 1])?,
            picked: Picked::Batch {
                batch: Arc::clone(self),
                row,
            },
        })
    }

    fn arrays(&self) -> Result<(Array, Array)> {
        let a = self.arrays.lock().map_err(|_| {
            crate::error::EngineError::StepFailed("a batch pick's lock was poisoned".into())
        })?;
        Ok((a.0.clone(), a.1.clone()))
    }

    fn host(&self) -> Result<&(Vec<u32>, Vec<f32>)> {
        if let Some(r) = self.read.get() {
            return Ok(r);
        }
        let (tokens, logprobs) = self.arrays()?;
        let r = (tokens.to_vec::<u32>()?, logprobs.to_vec::<f32>()?);
        Ok(self.read.get_or_init(|| r))
    }
}

impl Selection {
    /// Everything the host will read.
    pub(crate) fn arrays(&self) -> Result<Vec<Array>> {
        Ok(match &self.picked {
            Picked::Own { logprob, top } => {
                let mut arrays = vec![self.token.clone(), logprob.clone()];
                if let Some((ids, lps)) = top {
                    arrays.extend([ids.clone(), lps.clone()]);
                }
                arrays
            }
            Picked::Batch { batch, .. } => {
                let (tokens, logprobs) = batch.arrays()?;
                vec![tokens, logprobs]
            }
        })
    }

    /// Whether this pick is a row of a [`GreedyBatch`].
    pub(crate) fn is_batched(&self) -> bool {
        matches!(self.picked, Picked::Batch { .. })
    }

    /// Starts computing everything the host will read, without waiting.
    pub(crate) fn start(&self) -> Result<()> {
        let arrays = self.arrays()?;
        mlx::async_eval(&arrays.iter().collect::<Vec<_>>())?;
        Ok(())
    }

    /// Waits for the pick and reads it.
    pub(crate) fn read(&self) -> Result<Sampled> {
        match &self.picked {
            Picked::Own { logprob, top } => {
                let token = self.token.to_vec::<u32>()?.first().copied().unwrap_or(0);
                let logprob = logprob.item_f32()?;
                let top_logprobs = match top {
                    Some((ids, lps)) => ids
                        .to_vec::<u32>()?
                        .into_iter()
                        .zip(lps.to_vec::<f32>()?)
                        .collect(),
                    None => Vec::new(),
                };
                Ok(Sampled {
                    token,
                    logprob,
                    top_logprobs,
                })
            }
            Picked::Batch { batch, row } => {
                let (tokens, logprobs) = batch.host()?;
                match (tokens.get(*row), logprobs.get(*row)) {
                    (Some(&token), Some(&logprob)) => Ok(Sampled {
                        token,
                        logprob,
                        top_logprobs: Vec::new(),
                    }),
                    _ => Err(crate::error::EngineError::StepFailed(format!(
                        "row {row} of a batch of {} picks",
                        tokens.len()
                    ))),
                }
            }
        }
    }
}

impl Drop for Selection {
    /// A pick dropped unread (a step queued for a generation that then ended) is waited
    /// for: no MLX work of a request outlives it, so none is still running on MLX's stream
    /// threads when its engine stops or the process exits. Waiting on a pick already read
    /// costs nothing.
    fn drop(&mut self) {
        let arrays = match self.arrays() {
            Ok(a) => a,
            Err(e) => return tracing::debug!(error = %e, "a dropped pick could not be waited for"),
        };
        if let Err(e) = mlx::eval(&arrays.iter().collect::<Vec<_>>()) {
            tracing::debug!(error = %e, "a dropped pick failed to compute");
        }
    }
}

/// Picks tokens under [`SamplingParams`] on the device; holds one request's PRNG key and
/// penalty counts.
pub(crate) struct DeviceSampler {
    params: SamplingParams,
    vocab: usize,
    /// `[vocab]` u32 ids, for one-hot rows.
    ids: Array,
    key: Option<Array>,
    /// Occurrences of each token in the repetition window, `[vocab]` f32.
    window: Option<Array>,
    /// Occurrences of each token in the output, `[vocab]` f32.
    output: Option<Array>,
}

impl DeviceSampler {
    /// A sampler for a model of `vocab` tokens after `prompt`; the parameters are validated.
    pub(crate) fn new(params: SamplingParams, vocab: usize, prompt: &[u32]) -> Result<Self> {
        params.validate()?;
        let ids = mlx::ops::arange(0.0, vocab as f64, 1.0, Dtype::U32)?;
        let key = if params.temperature > 0.0 {
            Some(mlx::random::key(params.seed_or_clock())?)
        } else {
            None
        };
        let window = if params.repetition_penalty != 1.0 && params.repetition_context > 0 {
            let mut counts = vec![0f32; vocab];
            let from = prompt.len().saturating_sub(params.repetition_context);
            for &t in &prompt[from..] {
                if let Some(c) = counts.get_mut(t as usize) {
                    *c += 1.0;
                }
            }
            Some(Array::from_slice(&counts, &[vocab as i32])?)
        } else {
            None
        };
        let output = if params.presence_penalty != 0.0 || params.frequency_penalty != 0.0 {
            Some(mlx::ops::zeros(&[vocab as i32], Dtype::F32)?)
        } else {
            None
        };
        Ok(DeviceSampler {
            params,
            vocab,
            ids,
            key,
            window,
            output,
        })
    }

    /// Whether this sampler's pick is the argmax of the raw logits with nothing else to
    /// compute (no penalties, no draw, no log-probabilities asked for), so it can be one row
    /// of a [`GreedyBatch`] (a grammar's mask is the caller's to rule out).
    pub(crate) fn plain_greedy(&self) -> bool {
        self.key.is_none()
            && self.window.is_none()
            && self.output.is_none()
            && self.params.logprobs.is_none()
    }

    fn one_hot(&self, token: &Array) -> Result<Array> {
        Ok(self.ids.eq(&token.reshape(&[1])?)?.astype(Dtype::F32)?)
    }

    /// Records that `token` (`[1]` u32 on the device, possibly not computed yet) follows
    /// `prompt` and the `generated` tokens the host has read, for the penalties.
    pub(crate) fn observe(
        &mut self,
        token: &Array,
        prompt: &[u32],
        generated: &[u32],
    ) -> Result<()> {
        if let Some(w) = &self.window {
            let mut next = w.add(&self.one_hot(token)?)?;
            let total = prompt.len() + generated.len() + 1;
            let ctx = self.params.repetition_context;
            if total > ctx {
                // The token that leaves the window is at least one older than `token`.
                let i = total - ctx - 1;
                let leaving = if i < prompt.len() {
                    prompt.get(i)
                } else {
                    generated.get(i - prompt.len())
                };
                if let Some(&t) = leaving {
                    next = next.sub(&self.one_hot(&Array::from_slice(&[t], &[1])?)?)?;
                }
            }
            self.window = Some(next);
        }
        if let Some(o) = &self.output {
            self.output = Some(o.add(&self.one_hot(token)?)?);
        }
        Ok(())
    }

    /// The pick from `logits` (`[vocab]` f32, lazy), not yet computed (the engine always
    /// goes through [`DeviceSampler::select_masked`]; the tests pick unmasked).
    #[cfg(test)]
    pub(crate) fn select(&mut self, logits: &Array) -> Result<Selection> {
        self.select_masked(logits, None)
    }

    /// The pick from `logits` (`[vocab]` f32, lazy), not yet computed, among the tokens
    /// `allowed` (`[vocab]` bool) holds, when given: every other token's logit is -inf before the pick (a grammar's mask, see
    /// `constrained.rs`). Log-probabilities stay those of the raw logits.
    pub(crate) fn select_masked(
        &mut self,
        logits: &Array,
        allowed: Option<&Array>,
    ) -> Result<Selection> {
        let p = &self.params;
        let scalar = |v: f64| Array::scalar(v, Dtype::F32);
        let mut x = logits.clone();
        // 1. Penalties, as the host applies them.
        if let Some(w) = &self.window {
            let seen = w.gt(&scalar(0.0)?)?;
            let rp = f64::from(p.repetition_penalty);
            let penalized = mlx::ops::where_(
                &x.gt(&scalar(0.0)?)?,
                &x.div(&scalar(rp)?)?,
                &x.mul(&scalar(rp)?)?,
            )?;
            x = mlx::ops::where_(&seen, &penalized, &x)?;
        }
        if let Some(o) = &self.output {
            let presence = o.gt(&scalar(0.0)?)?.astype(Dtype::F32)?;
            let penalty = presence
                .mul(&scalar(f64::from(p.presence_penalty))?)?
                .add(&o.mul(&scalar(f64::from(p.frequency_penalty))?)?)?;
            x = x.sub(&penalty)?;
        }
        if let Some(allowed) = allowed {
            x = mlx::ops::where_(allowed, &x, &scalar(f64::NEG_INFINITY)?)?;
        }
        // 2. Greedy, or a draw from the truncated, tempered distribution.
        let token = match self.key.take() {
            None => x.argmax(-1, false)?,
            Some(key) => {
                let (next, step) = mlx::random::split(&key)?;
                self.key = Some(next);
                mlx::random::categorical(&self.truncate(&x)?, -1, &step)?
            }
        };
        let token = token.astype(Dtype::U32)?.reshape(&[1])?;
        // 3. Log-probabilities under the raw logits.
        let lp = logits.sub(&logits.logsumexp(-1, true)?)?;
        let logprob = lp.take(&token, 0)?;
        let top = match p.logprobs {
            Some(n) if n > 0 => {
                let n = n.min(self.vocab) as i32;
                let order = lp.neg()?.argsort(-1)?.slice(&[0], &[n])?;
                let ids = order.astype(Dtype::U32)?;
                let lps = lp.take(&order, 0)?;
                Some((ids, lps))
            }
            _ => None,
        };
        Ok(Selection {
            token,
            picked: Picked::Own { logprob, top },
        })
    }

    /// The tempered logits with everything outside top-k, top-p and min-p at -inf.
    fn truncate(&self, x: &Array) -> Result<Array> {
        let p = &self.params;
        let scalar = |v: f64| Array::scalar(v, Dtype::F32);
        let neg_inf = scalar(f64::NEG_INFINITY)?;
        let mut x = x.div(&scalar(f64::from(p.temperature))?)?;
        if p.top_k > 0 && p.top_k < self.vocab {
            let kth = x.topk(p.top_k as i32, -1)?.min(-1, true)?;
            x = mlx::ops::where_(&x.lt(&kth)?, &neg_inf, &x)?;
        }
        if p.top_p < 1.0 {
            // Keep a token when the mass of the tokens above it is below top_p.
            let probs = x.softmax(-1, true)?;
            let desc = probs.neg()?.sort(-1)?.neg()?;
            let above = desc.cumsum(-1, false, false)?;
            let kept = above
                .lt(&scalar(f64::from(p.top_p))?)?
                .astype(Dtype::U32)?
                .sum(-1, true)?;
            let last = kept.sub(&Array::scalar(1.0, Dtype::U32)?)?;
            let floor = desc.take(&last, 0)?;
            x = mlx::ops::where_(&probs.lt(&floor)?, &neg_inf, &x)?;
        }
        if p.min_p > 0.0 {
            let max = x.max(-1, true)?;
            let cut = max.add(&scalar(f64::from(p.min_p).ln())?)?;
            x = mlx::ops::where_(&x.lt(&cut)?, &neg_inf, &x)?;
        }
        Ok(x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampler::Sampler;

    fn params(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
        let mut p = SamplingParams::default();
        f(&mut p);
        p
    }

    fn logits(v: &[f32]) -> Array {
        Array::from_slice(v, &[v.len() as i32]).unwrap()
    }

    #[test]
    fn a_greedy_batch_picks_what_each_row_picks_alone() {
        // Row 2 has a tie (the first of equal maxima wins), row 3 is all equal.
        let rows: [[f32; 6]; 4] = [
            [0.1, 2.5, -1.0, 0.3, 2.4, 0.0],
            [-3.0, -2.0, -1.0, -0.5, -4.0, -0.6],
            [1.0, 5.0, 0.0, 5.0, 2.0, 4.9],
            [0.7; 6],
        ];
        let flat: Vec<f32> = rows.iter().flatten().copied().collect();
        let all = Array::from_slice(&flat, &[4, 6]).unwrap();
        let batch = GreedyBatch::new(&all).unwrap();
        for (i, row) in rows.iter().enumerate() {
            let mut own = DeviceSampler::new(SamplingParams::default(), 6, &[]).unwrap();
            assert!(own.plain_greedy());
            let want = own.select(&logits(row)).unwrap().read().unwrap();
            let pick = batch.selection(i).unwrap();
            assert!(pick.is_batched());
            let got = pick.read().unwrap();
            assert_eq!(got.token, want.token, "row {i}");
            assert!(
                (got.logprob - want.logprob).abs() < 1e-6,
                "row {i}: {got:?} vs {want:?}"
            );
            assert!(got.top_logprobs.is_empty());
            // The token the next step runs is the same array element.
            assert_eq!(pick.token.to_vec::<u32>().unwrap(), vec![want.token]);
        }
        // Anything beyond the argmax of the raw logits keeps its own pick.
        for p in [
            params(|p| p.logprobs = Some(0)),
            params(|p| p.repetition_penalty = 1.3),
            params(|p| p.presence_penalty = 0.5),
            params(|p| p.temperature = 0.7),
        ] {
            assert!(!DeviceSampler::new(p, 6, &[1, 2]).unwrap().plain_greedy());
        }
    }

    /// `n` draws from a fresh device sampler over `x`, as a histogram.
    fn histogram(p: &SamplingParams, x: &[f32], n: usize) -> Vec<usize> {
        let mut s = DeviceSampler::new(p.clone(), x.len(), &[]).unwrap();
        let l = logits(x);
        let mut h = vec![0; x.len()];
        for _ in 0..n {
            let pick = s.select(&l).unwrap();
            pick.start().unwrap();
            h[pick.read().unwrap().token as usize] += 1;
        }
        h
    }

    /// Pearson's chi-square statistic of `observed` against probabilities `expected`
    /// (cells with zero probability must be empty).
    fn chi_square(observed: &[usize], expected: &[f64]) -> f64 {
        let n: usize = observed.iter().sum();
        observed
            .iter()
            .zip(expected)
            .map(|(&o, &e)| {
                if e == 0.0 {
                    assert_eq!(o, 0, "a token of probability 0 was drawn");
                    0.0
                } else {
                    let e = e * n as f64;
                    (o as f64 - e).powi(2) / e
                }
            })
            .sum()
    }

    fn softmax(x: &[f32], t: f32) -> Vec<f64> {
        let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let e: Vec<f64> = x.iter().map(|&v| (((v - m) / t) as f64).exp()).collect();
        let s: f64 = e.iter().sum();
        e.into_iter().map(|v| v / s).collect()
    }

    /// Keeps the probabilities of `keep` and renormalizes.
    fn restrict(p: &[f64], keep: &[usize]) -> Vec<f64> {
        let s: f64 = keep.iter().map(|&i| p[i]).sum();
        (0..p.len())
            .map(|i| if keep.contains(&i) { p[i] / s } else { 0.0 })
            .collect()
    }

    const X: [f32; 6] = [1.0, 2.5, 0.3, 2.0, -1.0, 1.6];
    /// Chi-square critical values at significance 0.001 for 5, 3 and 2 degrees of freedom.
    const CHI2_5: f64 = 20.52;
    const CHI2_3: f64 = 16.27;
    const CHI2_2: f64 = 13.82;

    #[test]
    fn greedy_picks_are_the_host_samplers_ties_included() {
        let cases: [&[f32]; 4] = [
            &[0.1, 3.0, 2.0],
            &[5.0, 5.0, 1.0],
            &[-1.0, -0.5, -0.5, -3.0],
            &X,
        ];
        for x in cases {
            let mut d = DeviceSampler::new(SamplingParams::default(), x.len(), &[]).unwrap();
            let pick = d.select(&logits(x)).unwrap();
            pick.start().unwrap();
            let mut h = Sampler::new(SamplingParams::default()).unwrap();
            assert_eq!(
                pick.read().unwrap().token,
                h.sample(x, &[], &[]).unwrap().token,
                "{x:?}"
            );
        }
    }

    #[test]
    fn penalized_greedy_picks_are_the_host_samplers() {
        // Random logits, prompts and outputs; every penalty on; 200 cases.
        let mut seed = 0x5eed_u64;
        let mut next = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) as u32
        };
        let vocab = 40;
        for case in 0..200 {
            let x: Vec<f32> = (0..vocab)
                .map(|_| (next() % 2000) as f32 / 500.0 - 2.0)
                .collect();
            let prompt: Vec<u32> = (0..(next() % 12)).map(|_| next() % vocab as u32).collect();
            let p = params(|p| {
                p.repetition_penalty = 1.0 + (next() % 100) as f32 / 50.0;
                p.repetition_context = 1 + (next() % 8) as usize;
                p.presence_penalty = (next() % 100) as f32 / 60.0;
                p.frequency_penalty = (next() % 100) as f32 / 80.0;
            });
            let mut d = DeviceSampler::new(p.clone(), vocab, &prompt).unwrap();
            let mut h = Sampler::new(p.clone()).unwrap();
            let mut generated: Vec<u32> = Vec::new();
            for _ in 0..6 {
                let pick = d.select(&logits(&x)).unwrap();
                pick.start().unwrap();
                let got = pick.read().unwrap().token;
                let want = h.sample(&x, &prompt, &generated).unwrap().token;
                assert_eq!(
                    got, want,
                    "case {case}: {p:?} prompt {prompt:?} out {generated:?}"
                );
                d.observe(&pick.token, &prompt, &generated).unwrap();
                generated.push(got);
            }
        }
    }

    #[test]
    fn logprobs_are_the_host_samplers() {
        let p = params(|p| p.logprobs = Some(3));
        let mut d = DeviceSampler::new(p.clone(), X.len(), &[]).unwrap();
        let pick = d.select(&logits(&X)).unwrap();
        pick.start().unwrap();
        let got = pick.read().unwrap();
        let want = Sampler::new(p).unwrap().sample(&X, &[], &[]).unwrap();
        assert_eq!(got.token, want.token);
        assert!((got.logprob - want.logprob).abs() < 1e-5);
        assert_eq!(got.top_logprobs.len(), 3);
        for (g, w) in got.top_logprobs.iter().zip(&want.top_logprobs) {
            assert_eq!(g.0, w.0);
            assert!((g.1 - w.1).abs() < 1e-5, "{g:?} {w:?}");
        }
    }

    #[test]
    fn tempered_draws_follow_the_softmax() {
        for t in [0.7f32, 1.0, 1.5] {
            let p = params(|p| {
                p.temperature = t;
                p.seed = Some(11);
            });
            let h = histogram(&p, &X, 3000);
            let chi = chi_square(&h, &softmax(&X, t));
            assert!(chi < CHI2_5, "t={t}: chi-square {chi:.2} for {h:?}");
        }
    }

    #[test]
    fn a_seed_reproduces_the_draws_and_another_seed_does_not() {
        let run = |seed| {
            let p = params(|p| {
                p.temperature = 1.0;
                p.seed = Some(seed);
            });
            let mut s = DeviceSampler::new(p, X.len(), &[]).unwrap();
            (0..40)
                .map(|_| {
                    let pick = s.select(&logits(&X)).unwrap();
                    pick.start().unwrap();
                    pick.read().unwrap().token
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(run(3), run(3));
        assert_ne!(run(3), run(4));
    }

    #[test]
    fn top_k_top_p_and_min_p_never_emit_an_excluded_token() {
        let full = softmax(&X, 1.0);
        // Order by probability: 1 (2.5), 3 (2.0), 5 (1.6), 0 (1.0), 2 (0.3), 4 (-1.0).
        let top_k = params(|p| {
            p.temperature = 1.0;
            p.top_k = 3;
            p.seed = Some(5);
        });
        let h = histogram(&top_k, &X, 3000);
        let chi = chi_square(&h, &restrict(&full, &[1, 3, 5]));
        assert!(chi < CHI2_2, "top-k: chi-square {chi:.2} for {h:?}");

        // Mass above token 5 is p1 + p3 ≈ 0.68 < 0.8, above token 0 ≈ 0.85: keep 1, 3, 5.
        let top_p = params(|p| {
            p.temperature = 1.0;
            p.top_p = 0.8;
            p.seed = Some(6);
        });
        let h = histogram(&top_p, &X, 3000);
        let chi = chi_square(&h, &restrict(&full, &[1, 3, 5]));
        assert!(chi < CHI2_2, "top-p: chi-square {chi:.2} for {h:?}");

        // min_p 0.2: keep tokens with p ≥ 0.2 p1, i.e. logit ≥ 2.5 + ln 0.2 ≈ 0.89.
        let min_p = params(|p| {
            p.temperature = 1.0;
            p.min_p = 0.2;
            p.seed = Some(7);
        });
        let h = histogram(&min_p, &X, 3000);
        let chi = chi_square(&h, &restrict(&full, &[0, 1, 3, 5]));
        assert!(chi < CHI2_3, "min-p: chi-square {chi:.2} for {h:?}");
    }

    #[test]
    fn a_mask_limits_greedy_and_sampled_picks_to_the_allowed_tokens() {
        let x = [3.0f32, 1.0, 2.5, -1.0, 0.5];
        let allowed = Array::from_slice(&[0u8, 1, 0, 1, 1], &[5])
            .unwrap()
            .astype(Dtype::Bool)
            .unwrap();
        let mut greedy = DeviceSampler::new(SamplingParams::default(), 5, &[]).unwrap();
        let pick = greedy.select_masked(&logits(&x), Some(&allowed)).unwrap();
        pick.start().unwrap();
        let s = pick.read().unwrap();
        assert_eq!(s.token, 1, "the best allowed token");
        // The log-probability is still the raw distribution's.
        let raw = x[1] - x.iter().map(|v| v.exp()).sum::<f32>().ln();
        assert!((s.logprob - raw).abs() < 1e-4, "{} vs {raw}", s.logprob);
        let p = params(|p| {
            p.temperature = 1.5;
            p.top_k = 4;
            p.seed = Some(9);
        });
        let mut drawn = DeviceSampler::new(p, 5, &[]).unwrap();
        let mut seen = [0usize; 5];
        for _ in 0..300 {
            let pick = drawn.select_masked(&logits(&x), Some(&allowed)).unwrap();
            pick.start().unwrap();
            seen[pick.read().unwrap().token as usize] += 1;
        }
        assert_eq!((seen[0], seen[2]), (0, 0), "masked tokens drawn: {seen:?}");
        assert!(seen[1] > 0 && seen[4] > 0, "{seen:?}");
    }
}
