//! [`generate`]: prefill a prompt after whatever a [`KvCache`] already holds, then decode
//! token by token, streaming text deltas, until EOS, a stop string, the token budget or the
//! context limit; with TTFT, prefill and decode speeds and peak memory. The loop itself is
//! the engine's (engine/src/sequence.rs); this file holds the request types it shares with
//! [`crate::Engine`] and the text stream.

use cache::KvCache;
use serde::Serialize;

use crate::constrained::Constraint;
use crate::error::Result;
use crate::model::{default_prefill_chunk, Model, DEFAULT_PREFILL_CHUNK};
use crate::sampler::{Sampled, SamplingParams};
use crate::sequence::{decode_alone, prefill_alone, Sequence};
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
///
/// This is the [`Engine`](crate::Engine)'s generation loop run as a batch of one in the
/// caller's thread over the caller's cache: the same [`Sequence`] state and the same
/// prefill, decode and emit steps the engine's worker runs (docs/engine.md, "One generation
/// loop"). After the call the cache holds the prompt and every generated token but the
/// last.
pub fn generate(
    model: &Model,
    tokenizer: &Tokenizer,
    cache: &mut dyn KvCache,
    prompt: &[u32],
    params: &GenerateParams,
    on_token: &mut dyn FnMut(TokenEvent<'_>) -> bool,
) -> Result<Generation> {
    let mut seq = Sequence::alone(model, prompt, params)?;
    seq.set_cached(cache)?;
    mlx::reset_peak_memory()?;
    prefill_alone(&mut seq, model, cache)?;
    let generation = decode_streaming(&mut seq, model, tokenizer, cache, on_token)?;
    // The contract above: the last token's KV is not kept, whether or not a step ran
    // ahead with it.
    if cache.offset() == prompt.len() + seq.tokens.len() {
        cache.trim(1)?;
    }
    Ok(generation)
}

/// Decodes a prefilled `seq` alone to its end ([`decode_alone`]), streaming each token to
/// `on_token` and keeping log-probabilities when the request asks for them.
pub(crate) fn decode_streaming(
    seq: &mut Sequence,
    model: &Model,
    tokenizer: &Tokenizer,
    cache: &mut dyn KvCache,
    on_token: &mut dyn FnMut(TokenEvent<'_>) -> bool,
) -> Result<Generation> {
    let mut logprobs = Vec::new();
    let keep_logprobs = seq.params.sampling.logprobs.is_some();
    decode_alone(seq, model, tokenizer, cache, &mut |sampled, text| {
        let keep_going = on_token(TokenEvent {
            sampled: &sampled,
            text: &text,
        });
        if keep_logprobs {
            logprobs.push(sampled);
        }
        keep_going
    })?;
    Ok(Generation {
        timings: seq.timings()?,
        finish_reason: seq.finish.unwrap_or(FinishReason::Length),
        text: seq.text.clone(),
        tokens: seq.tokens.clone(),
        logprobs,
    })
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
