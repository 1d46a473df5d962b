//! [`Sampler`]: picks the next token from logits on the host — greedy, temperature, top-k,
//! top-p, min-p, repetition / presence / frequency penalties, a grammar's token mask — with a
//! seeded PRNG so a seed reproduces a sample exactly, on any machine.

use serde::{Deserialize, Serialize};

use crate::error::{EngineError, Result};

/// How to pick tokens. The defaults are greedy decoding with no penalties.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// Softmax temperature; 0 picks the most likely token. Default: 0.
    pub temperature: f32,
    /// Keep only the k most likely tokens; 0 keeps all. Default: 0.
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches p; 1 keeps all. Default: 1.
    pub top_p: f32,
    /// Drop tokens less likely than min_p × the top probability; 0 keeps all. Default: 0.
    pub min_p: f32,
    /// Divides positive (multiplies negative) logits of recently seen tokens; 1 is off.
    /// Default: 1.
    pub repetition_penalty: f32,
    /// Tokens (prompt and output) the repetition penalty looks back over. Default: 64.
    pub repetition_context: usize,
    /// Subtracted from the logit of every token already generated. Default: 0.
    pub presence_penalty: f32,
    /// Subtracted once per earlier occurrence in the output. Default: 0.
    pub frequency_penalty: f32,
    /// PRNG seed; `None` seeds from the clock. Default: None.
    pub seed: Option<u64>,
    /// Also return the log-probabilities of this many most likely alternatives. Default: None.
    pub logprobs: Option<usize>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            repetition_context: 64,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            logprobs: None,
        }
    }
}

impl SamplingParams {
    /// The seed, or one from the clock when none was given.
    pub(crate) fn seed_or_clock(&self) -> u64 {
        self.seed.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0)
        })
    }

    /// Rejects values outside their ranges.
    pub fn validate(&self) -> Result<()> {
        let bad = |name: &'static str, message: String| {
            Err(EngineError::InvalidParameter { name, message })
        };
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return bad("temperature", format!("{} must be ≥ 0", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", format!("{} must be in (0, 1]", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad("min_p", format!("{} must be in [0, 1]", self.min_p));
        }
        if !self.repetition_penalty.is_finite() || self.repetition_penalty <= 0.0 {
            return bad(
                "repetition_penalty",
                format!("{} must be > 0", self.repetition_penalty),
            );
        }
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !v.is_finite() || v.abs() > 2.0 {
                return bad(name, format!("{v} must be in [-2, 2]"));
            }
        }
        if self.logprobs.is_some_and(|n| n > 20) {
            return bad("logprobs", "at most 20 alternatives".into());
        }
        Ok(())
    }
}

/// One sampled token.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Sampled {
    /// The token id.
    pub token: u32,
    /// Its log-probability under the model (raw logits, before penalties and temperature).
    pub logprob: f32,
    /// The most likely alternatives and their log-probabilities, when asked for.
    pub top_logprobs: Vec<(u32, f32)>,
}

/// splitmix64: tiny, fast, and fixed forever, so seeds reproduce across versions.
#[derive(Clone, Debug)]
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Picks tokens under [`SamplingParams`]; holds the PRNG state of one request.
#[derive(Clone, Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: Rng,
}

impl Sampler {
    /// A sampler; the parameters are validated.
    pub fn new(params: SamplingParams) -> Result<Sampler> {
        params.validate()?;
        let seed = params.seed_or_clock();
        Ok(Sampler {
            params,
            rng: Rng(seed),
        })
    }

    /// The parameters.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Picks the next token from `logits` (`[vocab]`), given the prompt and the tokens
    /// generated so far (for the penalties).
    pub fn sample(&mut self, logits: &[f32], prompt: &[u32], generated: &[u32]) -> Result<Sampled> {
        self.sample_allowed(logits, prompt, generated, None)
    }

    /// [`Sampler::sample`] among the tokens `allowed` marks with a non-zero byte, when given
    /// (a grammar's mask, [`crate::Constraint::allowed`]): every other token's logit is -inf
    /// after the penalties, as the device sampler applies it. Log-probabilities stay those
    /// of the raw logits. A mask that allows no token is an error.
    pub fn sample_allowed(
        &mut self,
        logits: &[f32],
        prompt: &[u32],
        generated: &[u32],
        allowed: Option<&[u8]>,
    ) -> Result<Sampled> {
        if logits.is_empty() {
            return Err(EngineError::InvalidParameter {
                name: "logits",
                message: "empty".into(),
            });
        }
        let p = self.params.clone();
        let mut x = logits.to_vec();
        // 1. Penalties.
        if p.repetition_penalty != 1.0 {
            let all = prompt.iter().chain(generated.iter());
            let total = prompt.len() + generated.len();
            let mut seen = std::collections::HashSet::new();
            for &t in all.skip(total.saturating_sub(p.repetition_context)) {
                if seen.insert(t) {
                    if let Some(l) = x.get_mut(t as usize) {
                        *l = if *l > 0.0 {
                            *l / p.repetition_penalty
                        } else {
                            *l * p.repetition_penalty
                        };
                    }
                }
            }
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            let mut counts = std::collections::HashMap::<u32, u32>::new();
            for &t in generated {
                *counts.entry(t).or_default() += 1;
            }
            for (t, c) in counts {
                if let Some(l) = x.get_mut(t as usize) {
                    *l -= p.presence_penalty + p.frequency_penalty * c as f32;
                }
            }
        }
        if let Some(allowed) = allowed {
            let mut any = false;
            for (i, l) in x.iter_mut().enumerate() {
                if allowed.get(i).is_some_and(|&a| a != 0) {
                    any = true;
                } else {
                    *l = f32::NEG_INFINITY;
                }
            }
            if !any {
                return Err(EngineError::InvalidParameter {
                    name: "allowed",
                    message: "the mask allows no token".into(),
                });
            }
        }
        // 2. Greedy, or a draw from the truncated, tempered distribution.
        let token = if p.temperature == 0.0 {
            argmax(&x)
        } else {
            self.draw(&x)
        };
        let (logprob, top_logprobs) = logprobs(logits, token, p.logprobs);
        Ok(Sampled {
            token,
            logprob,
            top_logprobs,
        })
    }

    fn draw(&mut self, x: &[f32]) -> u32 {
        let p = &self.params;
        let t = p.temperature;
        let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        // Candidates by descending logit.
        let mut idx: Vec<u32> = (0..x.len() as u32).collect();
        let need_sort = p.top_k > 0 || p.top_p < 1.0;
        if need_sort {
            if p.top_k > 0 && p.top_k < idx.len() {
                idx.select_nth_unstable_by(p.top_k, |&a, &b| {
                    x[b as usize].total_cmp(&x[a as usize])
                });
                idx.truncate(p.top_k);
            }
            idx.sort_unstable_by(|&a, &b| x[b as usize].total_cmp(&x[a as usize]).then(a.cmp(&b)));
        }
        let mut probs: Vec<f64> = idx
            .iter()
            .map(|&i| (((x[i as usize] - max) / t) as f64).exp())
            .collect();
        let sum: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|q| *q /= sum);
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            let mut keep = probs.len();
            for (i, q) in probs.iter().enumerate() {
                acc += q;
                if acc >= p.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
            probs.truncate(keep);
            idx.truncate(keep);
        }
        if p.min_p > 0.0 {
            let top = probs.iter().copied().fold(0.0, f64::max);
            let floor = top * p.min_p as f64;
            for q in probs.iter_mut() {
                if *q < floor {
                    *q = 0.0;
                }
            }
        }
        let total: f64 = probs.iter().sum();
        let mut u = self.rng.next_f64() * total;
        for (i, q) in probs.iter().enumerate() {
            if u < *q {
                return idx[i];
            }
            u -= q;
        }
        // Rounding left u past the end: the last candidate with mass.
        probs
            .iter()
            .rposition(|&q| q > 0.0)
            .map(|i| idx[i])
            .unwrap_or(idx[0])
    }
}

/// Index of the largest logit (the first on ties, as MLX's argmax).
pub fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in x.iter().enumerate() {
        if *v > x[best] {
            best = i;
        }
    }
    best as u32
}

fn logprobs(logits: &[f32], token: u32, top: Option<usize>) -> (f32, Vec<(u32, f32)>) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = max as f64
        + logits
            .iter()
            .map(|&l| ((l - max) as f64).exp())
            .sum::<f64>()
            .ln();
    let lp = |i: u32| (logits[i as usize] as f64 - lse) as f32;
    let alts = match top {
        Some(n) if n > 0 => {
            let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
            let n = n.min(idx.len());
            idx.select_nth_unstable_by(n - 1, |&a, &b| {
                logits[b as usize].total_cmp(&logits[a as usize])
            });
            idx.truncate(n);
            idx.sort_unstable_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
            idx.into_iter().map(|i| (i, lp(i))).collect()
        }
        _ => Vec::new(),
    };
    (lp(token), alts)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
        let mut p = SamplingParams::default();
        f(&mut p);
        p
    }

    #[test]
    fn greedy_picks_the_largest_logit() {
        let mut s = Sampler::new(SamplingParams::default()).unwrap();
        assert_eq!(s.sample(&[0.1, 3.0, 2.0], &[], &[]).unwrap().token, 1);
    }

    #[test]
    fn a_seed_reproduces_a_sample() {
        let logits: Vec<f32> = (0..100).map(|i| (i as f32 * 0.37).sin()).collect();
        let p = params(|p| {
            p.temperature = 1.0;
            p.seed = Some(7);
        });
        let run = || {
            let mut s = Sampler::new(p.clone()).unwrap();
            (0..20)
                .map(|_| s.sample(&logits, &[], &[]).unwrap().token)
                .collect::<Vec<_>>()
        };
        assert_eq!(run(), run());
        assert!(run().iter().collect::<std::collections::HashSet<_>>().len() > 3);
    }

    #[test]
    fn top_k_one_is_greedy() {
        let p = params(|p| {
            p.temperature = 5.0;
            p.top_k = 1;
            p.seed = Some(1);
        });
        let mut s = Sampler::new(p).unwrap();
        for _ in 0..20 {
            assert_eq!(s.sample(&[0.0, 1.0, 0.5], &[], &[]).unwrap().token, 1);
        }
    }

    #[test]
    fn top_p_and_min_p_cut_the_tail() {
        let logits = [10.0, 9.9, -10.0, -10.0];
        for p in [
            params(|p| {
                p.temperature = 1.0;
                p.top_p = 0.9;
                p.seed = Some(3);
            }),
            params(|p| {
                p.temperature = 1.0;
                p.min_p = 0.5;
                p.seed = Some(3);
            }),
        ] {
            let mut s = Sampler::new(p).unwrap();
            for _ in 0..50 {
                assert!(s.sample(&logits, &[], &[]).unwrap().token < 2);
            }
        }
    }

    #[test]
    fn penalties_move_greedy_off_repeated_tokens() {
        let logits = [2.0, 1.9, 0.0];
        let mut s = Sampler::new(params(|p| p.repetition_penalty = 1.5)).unwrap();
        assert_eq!(s.sample(&logits, &[0], &[]).unwrap().token, 1);
        let mut s = Sampler::new(params(|p| p.presence_penalty = 0.5)).unwrap();
        assert_eq!(s.sample(&logits, &[], &[0]).unwrap().token, 1);
        let mut s = Sampler::new(params(|p| p.frequency_penalty = 0.06)).unwrap();
        assert_eq!(s.sample(&logits, &[], &[0, 0]).unwrap().token, 1);
    }

    #[test]
    fn logprobs_are_normalized() {
        let mut s = Sampler::new(params(|p| p.logprobs = Some(2))).unwrap();
        let r = s.sample(&[0.0, 0.0], &[], &[]).unwrap();
        assert!((r.logprob - 0.5f32.ln()).abs() < 1e-6);
        assert_eq!(r.top_logprobs.len(), 2);
    }

    #[test]
    fn invalid_values_are_rejected() {
        for p in [
            params(|p| p.temperature = -1.0),
            params(|p| p.top_p = 0.0),
            params(|p| p.min_p = 2.0),
            params(|p| p.repetition_penalty = 0.0),
            params(|p| p.temperature = f32::NAN),
        ] {
            assert!(matches!(
                Sampler::new(p),
                Err(EngineError::InvalidParameter { .. })
            ));
        }
    }

    #[test]
    fn a_mask_keeps_picks_among_the_allowed_tokens() {
        let x = [3.0f32, 1.0, 2.5, -1.0, 0.5];
        let allowed = [0u8, 1, 0, 1, 1];
        let mut greedy = Sampler::new(SamplingParams::default()).unwrap();
        let s = greedy.sample_allowed(&x, &[], &[], Some(&allowed)).unwrap();
        assert_eq!(s.token, 1);
        let mut drawn = Sampler::new(params(|p| {
            p.temperature = 2.0;
            p.top_p = 0.9;
            p.seed = Some(3);
        }))
        .unwrap();
        for _ in 0..200 {
            let t = drawn
                .sample_allowed(&x, &[], &[], Some(&allowed))
                .unwrap()
                .token;
            assert_eq!(allowed[t as usize], 1, "drew masked token {t}");
        }
        assert!(greedy.sample_allowed(&x, &[], &[], Some(&[0; 5])).is_err());
    }
}
