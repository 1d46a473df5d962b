//! [`generate`]: prefill a prompt after whatever a [`KvCache`] already holds, then decode
//! token by token, streaming text deltas, until EOS, a stop string, the token budget or the
//! context limit; with TTFT, prefill and decode speeds and peak memory.

use std::time::Instant;

use cache::KvCache;
use serde::Serialize;

use crate::constrained::Constraint;
use crate::device_sampler::DeviceSampler;
use crate::error::{EngineError, Result};
use crate::model::{default_prefill_chunk, Model, DEFAULT_PREFILL_CHUNK};
use crate::sampler::{Sampled, SamplingParams};
use crate::tokenizer::Tokenizer;

/// What to generate and when to stop.
#[derive(Clone, Debug, PartialEq)]
pub struct GenerateParams {
    /// Most tokens to generate. Default: 256.
    pub max_tokens: usize,
    /// Stop when the text contains one of these (the stop string is not returned).
    /// Default: none.
    pub stop: Vec<String>,
    /// Stop at the tokenizer's EOS / end-of-turn ids. Default: true.
    pub stop_at_eos: bool,
    /// Token sampling. Default: greedy.
    pub sampling: SamplingParams,
    /// Per-request context limit (prompt + output), capped by the model's
    /// `max_position_embeddings`. Default: None (the model's).
    pub context_limit: Option<usize>,
    /// Tokens per prefill step (with `serve`, while no other row decodes; while rows decode
    /// the engine's smaller step bounds it). Default: [`default_prefill_chunk`].
    pub prefill_chunk: usize,
    /// A grammar the output must follow (structured output, forced tool calls): tokens it
    /// does not allow are never sampled, and an end-of-sequence token ends the output only
    /// where the grammar accepts (whatever `stop_at_eos` says). Default: None.
    pub constraint: Option<Constraint>,
}

impl Default for GenerateParams {
    fn default() -> Self {
        GenerateParams {
            max_tokens: 256,
            stop: Vec::new(),
            stop_at_eos: true,
            sampling: SamplingParams::default(),
            context_limit: None,
            prefill_chunk: default_prefill_chunk(),
            constraint: None,
        }
    }
}

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// An EOS / end-of-turn token, or a stop string.
    Stop,
    /// `max_tokens` or the context limit.
    Length,
    /// The token callback asked to stop.
    Cancelled,
}

/// Timings and counts of one generation.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Timings {
    /// Prompt tokens, including those already in the cache.
    pub prompt_tokens: usize,
    /// Prompt tokens the cache held before the call (not prefilled).
    pub cached_tokens: usize,
    /// Tokens generated.
    pub generated_tokens: usize,
    /// Time to first token in seconds: prefill plus the first sample; through
    /// [`crate::generate_with_reuse`] also the prefix lookup and restore before them (the
    /// same figure as its report's `ttft_s`: what the user waited for).
    pub ttft_s: f64,
    /// Prefill speed: prefilled tokens / prefill seconds.
    pub prefill_tok_per_s: f64,
    /// Decode speed: tokens after the first / their seconds.
    pub decode_tok_per_s: f64,
    /// Wall time of the whole call, in seconds.
    pub total_s: f64,
    /// MLX's peak memory during the call, in bytes.
    pub peak_memory_bytes: usize,
    /// Host seconds spent computing a grammar's token masks (0 without a constraint).
    pub mask_s: f64,
}

/// The result of [`generate`].
#[derive(Clone, Debug, Serialize)]
pub struct Generation {
    /// Generated token ids (a trailing EOS is included; text stops before stop strings).
    pub tokens: Vec<u32>,
    /// Generated text, without special tokens and without the stop string.
    pub text: String,
    /// Why it ended.
    pub finish_reason: FinishReason,
    /// Per-token log-probabilities, when asked for.
    pub logprobs: Vec<Sampled>,
    /// Timings.
    pub timings: Timings,
}

/// One streamed token.
#[derive(Clone, Debug)]
pub struct TokenEvent<'a> {
    /// The token and its log-probabilities.
    pub sampled: &'a Sampled,
    /// Text that became final with this token (may be empty: a partial UTF-8 sequence or a
    /// possible stop-string prefix is held back).
    pub text: &'a str,
}

/// Text decoded so far, releasing only what no later token or stop string can change.
pub(crate) struct TextStream<'a> {
    pub(crate) tokenizer: &'a Tokenizer,
    pub(crate) stop: &'a [String],
    pub(crate) emitted: usize,
}

impl TextStream<'_> {
    /// Returns (new final text, whether a stop string ended it, the full text).
    pub(crate) fn update(&mut self, tokens: &[u32], last: bool) -> Result<(String, bool, String)> {
        let mut text = self.tokenizer.decode(tokens, true)?;
        let mut stopped = false;
        if let Some(pos) = self.stop.iter().filter_map(|s| text.find(s.as_str())).min() {
            text.truncate(pos);
            stopped = true;
        }
        let mut end = text.len();
        if !stopped && !last {
            // An incomplete UTF-8 sequence decodes as U+FFFD until its last byte arrives.
            if text.ends_with('\u{FFFD}') {
                end = text.trim_end_matches('\u{FFFD}').len();
            }
            // Hold back a suffix that could grow into a stop string.
            for s in self.stop {
                for k in (1..s.len()).rev() {
                    if s.is_char_boundary(k) && text[..end].ends_with(&s[..k]) {
                        end = end.min(text[..end].len() - k);
                        break;
                    }
                }
            }
        }
        let end = end.max(self.emitted);
        let delta = text.get(self.emitted..end).unwrap_or_default().to_string();
        self.emitted = end;
        Ok((delta, stopped, text))
    }
}

/// Generates after `prompt`. The first `cache.offset()` prompt tokens must already be in
/// `cache` (a restored prefix, at most `prompt.len() - 1`); the rest is prefilled in
/// chunks. `on_token` sees each token as it is sampled and returns false to stop.
pub fn generate(
    model: &Model,
    tokenizer: &Tokenizer,
    cache: &mut dyn KvCache,
    prompt: &[u32],
    params: &GenerateParams,
    on_token: &mut dyn FnMut(TokenEvent<'_>) -> bool,
) -> Result<Generation> {
    let start = Instant::now();
    let context = params
        .context_limit
        .unwrap_or(usize::MAX)
        .min(model.info().max_position_embeddings);
    if prompt.is_empty() {
        return Err(EngineError::InvalidParameter {
            name: "prompt",
            message: "the prompt is empty".into(),
        });
    }
    if prompt.len() >= context {
        return Err(EngineError::PromptTooLong {
            prompt: prompt.len(),
            context,
        });
    }
    let cached = cache.offset();
    if cached >= prompt.len() {
        return Err(EngineError::InvalidParameter {
            name: "cache",
            message: format!(
                "the cache holds {cached} tokens; at most prompt length - 1 = {} may be reused",
                prompt.len() - 1
            ),
        });
    }
    mlx::reset_peak_memory()?;
    let vocab = model.info().vocab_size;
    let mut sampler = DeviceSampler::new(params.sampling.clone(), vocab, prompt)?;
    let mut constraint = params.constraint.clone();
    let mask = |c: &mut Option<Constraint>| c.as_mut().map(|c| c.device_mask(vocab)).transpose();

    // 1. Prefill what the cache lacks; pick the first token on the device.
    let logits = model.prefill(&prompt[cached..], cache, params.prefill_chunk)?;
    let mut pick = sampler.select_masked(&logits, mask(&mut constraint)?.as_ref())?;
    pick.start()?;
    let mut tokens: Vec<u32> = Vec::new();
    let mut logprobs = Vec::new();
    let mut stream = TextStream {
        tokenizer,
        stop: &params.stop,
        emitted: 0,
    };
    let mut text;
    let mut finish = FinishReason::Length;
    let mut prefill_done = None;
    let mut ttft = std::time::Duration::ZERO;
    let mut first_token_at = Instant::now();

    // 2. Decode, one step ahead: step n+1 is built from step n's pick, still on the device,
    // and queued before the host waits for that pick, so the device never idles while the
    // host reads, detokenizes and streams. A step queued for a token that turns out to end
    // the generation is dropped from the cache. Under a grammar, step n+1's mask needs
    // token n on the host: the step is queued only after the pick was read.
    loop {
        let n = tokens.len() + 1;
        let last = n >= params.max_tokens || prompt.len() + n >= context;
        let ahead = if last || constraint.is_some() {
            None
        } else {
            sampler.observe(&pick.token, prompt, &tokens)?;
            let logits = model.forward_token(&pick.token, cache)?;
            let next = sampler.select(&logits)?;
            next.start()?;
            Some(next)
        };
        let sampled = pick.read()?;
        if tokens.is_empty() {
            prefill_done = Some(Instant::now());
            ttft = start.elapsed();
            first_token_at = Instant::now();
        }
        let is_eos = (params.stop_at_eos || constraint.is_some())
            && tokenizer.eos_ids().contains(&sampled.token);
        if let Some(c) = &mut constraint {
            c.commit(sampled.token)?;
        }
        tokens.push(sampled.token);
        let (delta, stopped, full) = stream.update(&tokens, is_eos || last)?;
        text = full;
        let keep_going = on_token(TokenEvent {
            sampled: &sampled,
            text: &delta,
        });
        if params.sampling.logprobs.is_some() {
            logprobs.push(sampled);
        }
        let end = if is_eos || stopped {
            Some(FinishReason::Stop)
        } else if !keep_going {
            Some(FinishReason::Cancelled)
        } else {
            None
        };
        match (end, ahead) {
            (Some(reason), ahead) => {
                finish = reason;
                if ahead.is_some() {
                    cache.trim(1)?;
                }
                break;
            }
            (None, Some(next)) => pick = next,
            (None, None) if last => break,
            (None, None) => {
                // Constrained: the pick was read; queue the next step with its mask.
                sampler.observe(&pick.token, prompt, &tokens[..tokens.len() - 1])?;
                let logits = model.forward_token(&pick.token, cache)?;
                let next = sampler.select_masked(&logits, mask(&mut constraint)?.as_ref())?;
                next.start()?;
                pick = next;
            }
        }
    }
    let prefill_done = prefill_done.unwrap_or_else(Instant::now);
    let end = Instant::now();
    let prefill_s = (prefill_done - start).as_secs_f64();
    let decode_s = (end - first_token_at).as_secs_f64();
    let decoded_after_first = tokens.len().saturating_sub(1);
    Ok(Generation {
        timings: Timings {
            prompt_tokens: prompt.len(),
            cached_tokens: cached,
            generated_tokens: tokens.len(),
            ttft_s: ttft.as_secs_f64(),
            prefill_tok_per_s: rate(prompt.len() - cached, prefill_s),
            decode_tok_per_s: rate(decoded_after_first, decode_s),
            total_s: (end - start).as_secs_f64(),
            peak_memory_bytes: mlx::peak_memory()?,
            mask_s: constraint.map_or(0.0, |c| c.mask_stats().1.as_secs_f64()),
        },
        tokens,
        text,
        finish_reason: finish,
        logprobs,
    })
}

fn rate(n: usize, s: f64) -> f64 {
    if s > 0.0 && n > 0 {
        n as f64 / s
    } else {
        0.0
    }
}

/// Greedy ids for `n` tokens after `prompt` with a fresh contiguous cache, ignoring EOS: the
/// form the parity goldens are written in.
pub fn greedy_ids(model: &Model, prompt: &[u32], n: usize) -> Result<Vec<u32>> {
    let mut cache = model.new_cache();
    let mut logits = model.prefill(prompt, &mut cache, DEFAULT_PREFILL_CHUNK)?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let t = crate::sampler::argmax(&logits.to_vec::<f32>()?);
        out.push(t);
        if out.len() == n {
            break;
        }
        logits = model.forward(&[t], &mut cache)?;
    }
    Ok(out)
}
