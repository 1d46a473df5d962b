//! [`Sequence`]: one request's generation state, and the rules every generation follows,
//! whoever drives it. The [`Engine`](crate::Engine)'s worker keeps one per row and drives
//! them in batches; [`crate::generate`] drives one alone over the caller's cache, through
//! the same steps ([`Sequence::prefill_step`], [`decode_step`], [`Sequence::emit`]).
//!
//! A sequence owns: the prompt and parameters, the device sampler, the accepted tokens and
//! the text stream (stop strings held back), EOS under the constraint rule, `max_tokens`
//! and the context limit, the finish reason, the picks in flight (one step ahead), and the
//! timings (TTFT, prefill and decode rates). Publication to the tiers
//! ([`Sequence::publish_prompt`], [`Sequence::retire`]) also lives here.

use std::time::{Duration, Instant};

use cache::{Chain, KvCache, PagedKvCache, PagedKvRows};

use crate::census::StepShape;
use crate::device_sampler::{DeviceSampler, GreedyBatch, Selection};
use crate::error::{EngineError, Result};
use crate::generate::{FinishReason, GenerateParams, TextStream, Timings};
use crate::model::{aligned_chunk, Model, PromptChunk};
use crate::reuse::{KvTiers, ReuseReport};
use crate::sampler::Sampled;
use crate::tokenizer::Tokenizer;

/// The context a request may fill (prompt + output): its own limit, the engine's and the
/// model's, whichever is smallest.
pub(crate) fn context_limit(params: &GenerateParams, engine: Option<usize>, model: usize) -> usize {
    params
        .context_limit
        .unwrap_or(usize::MAX)
        .min(engine.unwrap_or(usize::MAX))
        .min(model)
}

/// Refuses a prompt that is empty or leaves no room for a token within `context`.
pub(crate) fn check_prompt(prompt: &[u32], context: usize) -> Result<()> {
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
    Ok(())
}

/// One request's generation: see the module docs. Fields drop in order: the picks first,
/// so a step still in flight is waited for (`Selection`'s drop) before the sampler whose
/// arrays it reads goes.
pub(crate) struct Sequence {
    /// The pick of the last decode step, still on the device and not yet read.
    unread: Option<Selection>,
    /// The pick of the step queued now, which consumed `unread` (or `next`).
    launched: Option<Selection>,
    pub(crate) prompt: Vec<u32>,
    pub(crate) params: GenerateParams,
    sampler: DeviceSampler,
    vocab: usize,
    /// Tokens emitted so far.
    pub(crate) tokens: Vec<u32>,
    /// The whole text so far, stop strings cut.
    pub(crate) text: String,
    /// Bytes of `text` released to the stream.
    emitted: usize,
    /// A sampled token read from the device, not yet emitted (and not yet in the cache).
    next: Option<Sampled>,
    /// The last emitted token is not in the cache yet: the next decode step runs it. The
    /// first token is emitted as soon as it is read ([`Sequence::emit_first`]), before the
    /// step that runs it is queued.
    last_unfed: bool,
    pub(crate) context: usize,
    /// Prompt tokens the cache held before prefill (restored or caller-provided).
    pub(crate) cached: usize,
    pub(crate) finish: Option<FinishReason>,
    /// When the sequence was created: admission (before any restore), or `generate`'s call.
    started: Instant,
    /// Seconds computing prefill chunks and the first pick.
    pub(crate) prefill_s: f64,
    /// Seconds from `started` to the first token.
    pub(crate) ttft_s: f64,
    first_token_at: Option<Instant>,
    last_token_at: Option<Instant>,
}

impl Sequence {
    /// A sequence for `prompt` (already checked with [`check_prompt`] against `context`)
    /// whose first `cached` tokens the cache already holds; `started` is when the request
    /// began waiting for its first token on this side of the queue.
    pub(crate) fn new(
        prompt: Vec<u32>,
        params: GenerateParams,
        vocab: usize,
        context: usize,
        started: Instant,
    ) -> Result<Sequence> {
        let sampler = DeviceSampler::new(params.sampling.clone(), vocab, &prompt)?;
        Ok(Sequence {
            unread: None,
            launched: None,
            prompt,
            params,
            sampler,
            vocab,
            tokens: Vec::new(),
            text: String::new(),
            emitted: 0,
            next: None,
            last_unfed: false,
            context,
            cached: 0,
            finish: None,
            started,
            prefill_s: 0.0,
            ttft_s: 0.0,
            first_token_at: None,
            last_token_at: None,
        })
    }

    /// A sequence for `prompt` run alone in the caller's thread (no engine limit on the
    /// context), started now.
    pub(crate) fn alone(
        model: &Model,
        prompt: &[u32],
        params: &GenerateParams,
    ) -> Result<Sequence> {
        let start = Instant::now();
        let info = model.info();
        let context = context_limit(params, None, info.max_position_embeddings);
        check_prompt(prompt, context)?;
        Sequence::new(
            prompt.to_vec(),
            params.clone(),
            info.vocab_size,
            context,
            start,
        )
    }

    /// Records that `cache` holds the prompt's first tokens before prefill; refuses a cache
    /// holding the whole prompt (at least its last token must be computed for its logits).
    pub(crate) fn set_cached(&mut self, cache: &dyn KvCache) -> Result<()> {
        let cached = cache.offset();
        if cached >= self.prompt.len() {
            return Err(EngineError::InvalidParameter {
                name: "cache",
                message: format!(
                    "the cache holds {cached} tokens; at most prompt length - 1 = {} may be reused",
                    self.prompt.len() - 1
                ),
            });
        }
        self.cached = cached;
        Ok(())
    }

    /// Runs one prefill chunk (at most `max_chunk` tokens, and the request's own
    /// `prefill_chunk`) of what `cache` lacks. Returns the prompt tokens computed and, for
    /// the prompt's last chunk, its last position's logits.
    pub(crate) fn prefill_step(
        &mut self,
        model: &Model,
        cache: &mut dyn KvCache,
        max_chunk: usize,
    ) -> Result<(usize, Option<mlx::Array>)> {
        let held = cache.offset();
        let chunk = self.chunk_len(held, max_chunk);
        let rest = self.prompt.get(held..).unwrap_or_default();
        let t = Instant::now();
        let result = if rest.len() > chunk {
            model.prefill_chunk(&rest[..chunk], cache).map(|()| None)
        } else {
            model.forward(rest, cache).map(Some)
        };
        self.prefill_s += t.elapsed().as_secs_f64();
        Ok((rest.len().min(chunk), result?))
    }

    /// Tokens of the next prefill chunk after `held` prompt tokens: at most `max_chunk` and
    /// the request's own `prefill_chunk`, ending on a multiple of the latter.
    pub(crate) fn chunk_len(&self, held: usize, max_chunk: usize) -> usize {
        aligned_chunk(held, self.params.prefill_chunk.clamp(1, max_chunk.max(1)))
    }

    /// The first token, picked from the prompt's last `logits` and read now (it is the
    /// first thing the client sees: TTFT ends here).
    pub(crate) fn first_pick(&mut self, logits: &mlx::Array) -> Result<()> {
        let t = Instant::now();
        let mask = self.mask()?;
        let pick = self.sampler.select_masked(logits, mask.as_ref())?;
        pick.start()?;
        let first = pick.read()?;
        if let Some(c) = &mut self.params.constraint {
            c.commit(first.token)?;
        }
        self.next = Some(first);
        self.prefill_s += t.elapsed().as_secs_f64();
        let now = Instant::now();
        self.ttft_s = (now - self.started).as_secs_f64();
        self.first_token_at = Some(now);
        Ok(())
    }

    fn mask(&mut self) -> Result<Option<mlx::Array>> {
        let vocab = self.vocab;
        self.params
            .constraint
            .as_mut()
            .map(|c| c.device_mask(vocab))
            .transpose()
    }

    /// Whether the token waiting to be emitted will be followed by another: false when it
    /// is the last `max_tokens` or the context allow (no step is queued after it then).
    pub(crate) fn needs_step(&self) -> bool {
        // The waiting token is the n-th: emitted already (the first, not yet run) or not.
        let n = self.tokens.len() + usize::from(!self.last_unfed);
        self.finish.is_none() && n < self.params.max_tokens && self.prompt.len() + n < self.context
    }

    /// The token the next decode step runs: the last pick, still on the device (or a
    /// first token already read). A constrained sequence does not run ahead: its next mask
    /// needs this token on the host, so the pick is read (waiting for the step before) and
    /// committed to the grammar here.
    fn input(&mut self) -> Result<mlx::Array> {
        if let Some(c) = &mut self.params.constraint {
            if let Some(pick) = self.unread.take() {
                let sampled = pick.read()?;
                c.commit(sampled.token)?;
                self.next = Some(sampled);
            }
        }
        match (&self.unread, &self.next, self.tokens.last()) {
            (Some(pick), _, _) => Ok(pick.token.clone()),
            (None, Some(sampled), _) => Ok(mlx::Array::from_slice(&[sampled.token], &[1])?),
            // The first token, emitted already.
            (None, None, Some(&last)) if self.last_unfed => {
                Ok(mlx::Array::from_slice(&[last], &[1])?)
            }
            (None, None, _) => Err(EngineError::StepFailed(
                "a sequence has no token to decode".into(),
            )),
        }
    }

    /// The step being queued runs `token` (from [`Sequence::input`]): the sampler's
    /// penalties count it. Called once per queued step, after the forward pass was built
    /// (a mixed pass the model cannot run asks for the inputs again).
    fn feed(&mut self, token: &mlx::Array) -> Result<()> {
        // An emitted first token is not among the tokens before it.
        let before = self.tokens.len() - usize::from(self.last_unfed);
        self.sampler
            .observe(token, &self.prompt, &self.tokens[..before])?;
        Ok(())
    }

    /// Whether this sequence's next pick can join a batch of greedy picks: greedy with
    /// nothing else to compute, and no grammar.
    fn plain_greedy(&self) -> bool {
        self.params.constraint.is_none() && self.sampler.plain_greedy()
    }

    /// Queues this sequence's next pick from its row of the step's `logits`.
    fn pick(&mut self, logits: &mlx::Array) -> Result<()> {
        let mask = self.mask()?;
        self.launched = Some(self.sampler.select_masked(logits, mask.as_ref())?);
        Ok(())
    }

    /// After a step was queued (or not) and the previous pick emitted: the pick just
    /// queued becomes the one to read next.
    pub(crate) fn advance(&mut self) {
        // A queued step ran the emitted first token (input() may be asked again for a
        // step that was then not queued, so the flag clears here).
        if self.launched.is_some() {
            self.last_unfed = false;
        }
        self.unread = self.launched.take();
    }

    /// Emits the pending token, if any: reads it (waiting for its step), applies EOS, stop
    /// strings and the limits, and hands it with the text that became final to `deliver`,
    /// which returns false when nobody listens any more. A sequence found `cancelled`, or
    /// one at its `max_tokens` already, ends without emitting. Sets [`Sequence::finish`]
    /// when the sequence ends.
    pub(crate) fn emit(
        &mut self,
        tokenizer: &Tokenizer,
        cancelled: bool,
        deliver: &mut dyn FnMut(Sampled, String) -> bool,
    ) -> Result<()> {
        if self.finish.is_some() {
            return Ok(());
        }
        if cancelled {
            self.finish = Some(FinishReason::Cancelled);
            return Ok(());
        }
        if self.tokens.len() >= self.params.max_tokens {
            self.finish = Some(FinishReason::Length);
            return Ok(());
        }
        if self.next.is_none() {
            if let Some(pick) = self.unread.take() {
                self.next = Some(pick.read()?);
            }
        }
        let Some(sampled) = self.next.take() else {
            return Ok(());
        };
        self.tokens.push(sampled.token);
        self.last_token_at = Some(Instant::now());
        let is_eos = (self.params.stop_at_eos || self.params.constraint.is_some())
            && tokenizer.eos_ids().contains(&sampled.token);
        let at_limit = self.tokens.len() >= self.params.max_tokens
            || self.prompt.len() + self.tokens.len() >= self.context;
        let mut stream = TextStream {
            tokenizer,
            stop: &self.params.stop,
            emitted: self.emitted,
        };
        // The tokens are the engine's own: failing to decode them is not the request's
        // fault.
        let (delta, stopped, full) = stream
            .update(&self.tokens, is_eos || at_limit)
            .map_err(|e| EngineError::StepFailed(e.to_string()))?;
        self.emitted = stream.emitted;
        self.text = full;
        let delivered = deliver(sampled, delta);
        if is_eos || stopped {
            self.finish = Some(FinishReason::Stop);
        } else if !delivered {
            self.finish = Some(FinishReason::Cancelled);
        } else if at_limit {
            self.finish = Some(FinishReason::Length);
        }
        Ok(())
    }

    /// Emits the first token, read by [`Sequence::first_pick`], at once: the client gets it
    /// without waiting for the next decode step to be queued (on an H200 that launch alone
    /// is ~10 ms of host time at four rows, docs/benchmarks.md). That step still runs it
    /// ([`Sequence::input`]). Does nothing unless the first token waits.
    pub(crate) fn emit_first(
        &mut self,
        tokenizer: &Tokenizer,
        deliver: &mut dyn FnMut(Sampled, String) -> bool,
    ) -> Result<()> {
        if !self.tokens.is_empty() || self.unread.is_some() || self.next.is_none() {
            return Ok(());
        }
        self.emit(tokenizer, false, deliver)?;
        self.last_unfed = self.next.is_none() && self.tokens.len() == 1;
        Ok(())
    }

    /// Drops from `cache` the KV of a step queued before the sequence's end was read: it
    /// fed a token the sequence never emitted. Afterwards the cache holds the prompt and
    /// every emitted token but the last. Fails where a hybrid's layer state cannot go back.
    pub(crate) fn trim_run_ahead(&self, cache: &mut dyn KvCache) -> Result<()> {
        let emitted = self.prompt.len() + self.tokens.len();
        let fed = cache.offset();
        if fed > emitted {
            cache.trim(fed - emitted)?;
        }
        Ok(())
    }

    /// After the first pick: records the measured prefill speed for the tiers'
    /// restore-or-recompute estimate, and completes `report`'s prefill and TTFT (lookup +
    /// restore + prefill and first sample: what the client waited for once admitted).
    pub(crate) fn prefilled(&self, tiers: Option<&KvTiers>, report: &mut ReuseReport) {
        report.prefill_s = self.prefill_s;
        report.ttft_s = report.lookup_s + report.restore_s + report.prefill_s;
        if let Some(tiers) = tiers {
            tiers.record_prefill(self.prompt.len() - self.cached, self.cached, self.prefill_s);
        }
    }

    /// Publishes the prompt's full blocks from `cache` once its first token is picked, so
    /// that a concurrent request with the same prefix (an agent's parallel calls) hits
    /// while this one decodes (the engine's rows; a sequence run alone publishes once, at
    /// [`Sequence::retire`]).
    pub(crate) fn publish_prompt(
        &self,
        tiers: &KvTiers,
        chain: &mut Chain,
        cache: &mut PagedKvCache,
        report: &mut ReuseReport,
    ) {
        let trimmed_before = tiers.window_trimmed_bytes();
        match tiers.publish(chain, cache, &self.prompt) {
            Ok(n) => report.published_blocks += n,
            Err(e) => tracing::warn!(error = %e, "publishing the prompt failed"),
        }
        report.window_trimmed_bytes += tiers.window_trimmed_bytes() - trimmed_before;
    }

    /// At the end: drops the run-ahead step from `cache`, publishes what it holds and keeps
    /// it resident on the device for the next request sharing its prefix. A hybrid's cache
    /// whose state cannot go back that far is not kept.
    pub(crate) fn retire(
        &self,
        tiers: &KvTiers,
        chain: Chain,
        mut cache: PagedKvCache,
        report: &mut ReuseReport,
    ) -> Result<()> {
        if self.trim_run_ahead(&mut cache).is_err() {
            return Ok(());
        }
        let all: Vec<u32> = self.prompt.iter().chain(&self.tokens).copied().collect();
        let trimmed_before = tiers.window_trimmed_bytes();
        report.published_blocks += tiers.retire(chain, cache, &all)?;
        report.window_trimmed_bytes += tiers.window_trimmed_bytes() - trimmed_before;
        Ok(())
    }

    /// The timings of the sequence so far: TTFT and total from `started`.
    pub(crate) fn timings(&self) -> Result<Timings> {
        let end = self.last_token_at.unwrap_or_else(Instant::now);
        let decode_s = self.first_token_at.map_or(0.0, |f| (end - f).as_secs_f64());
        Ok(Timings {
            prompt_tokens: self.prompt.len(),
            cached_tokens: self.cached,
            generated_tokens: self.tokens.len(),
            ttft_s: self.ttft_s,
            prefill_tok_per_s: rate(self.prompt.len() - self.cached, self.prefill_s),
            decode_tok_per_s: rate(self.tokens.len().saturating_sub(1), decode_s),
            total_s: self.started.elapsed().as_secs_f64(),
            peak_memory_bytes: mlx::peak_memory()?,
            mask_s: self
                .params
                .constraint
                .as_ref()
                .map_or(0.0, |c| c.mask_stats().1.as_secs_f64()),
        })
    }
}

/// The tokens a new sequence's cache is made with room for: its prompt's, unless
/// `KVSTORE_PROMPT_ROOM=0` (read once: the cache then grows from its first pool through
/// the prefill, for measuring both).
pub(crate) fn prompt_room(prompt_tokens: usize) -> usize {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let on = *ON.get_or_init(|| std::env::var("KVSTORE_PROMPT_ROOM").map_or(true, |v| v != "0"));
    if on {
        prompt_tokens
    } else {
        0
    }
}

fn rate(n: usize, s: f64) -> f64 {
    if s > 0.0 && n > 0 {
        n as f64 / s
    } else {
        0.0
    }
}

/// Where a decode step's rows keep their KV.
pub(crate) enum StepKv<'a> {
    /// The engine's batch: row `b` is `seqs[b]`'s cache.
    Rows(&'a mut PagedKvRows),
    /// One sequence alone over a cache of any kind (the caller's, in [`crate::generate`]).
    One(&'a mut dyn KvCache),
}

/// Queues one decode step over `seqs`, fed with each sequence's latest token (the pick of
/// the previous step, still on the device, or a first token the prefill picked), so the
/// device computes while the host reads and emits the previous picks; each sequence's next
/// pick is computed on the device from its slice of the logits. Returns how long building
/// the step's graph took (the rest of the call waited as [`step_wait`] says and queued it);
/// when no sequence needs another token (every one is at its last), nothing is queued:
/// returns `None`.
///
/// A batch of one runs [`Model::forward_token`] on its cache (the step `generate` runs);
/// more rows run [`Model::forward_rows_tokens`] over the batch.
pub(crate) fn decode_step(
    model: &Model,
    seqs: &mut [&mut Sequence],
    kv: StepKv<'_>,
) -> Result<Option<Duration>> {
    if !seqs.iter().any(|s| s.needs_step()) {
        return Ok(None);
    }
    let started = Instant::now();
    let mut tokens = Vec::with_capacity(seqs.len());
    for s in seqs.iter_mut() {
        tokens.push(s.input()?);
    }
    let one = |cache: &mut dyn KvCache| -> Result<Vec<mlx::Array>> {
        match tokens.as_slice() {
            [token] => Ok(vec![model.forward_token(token, cache)?]),
            _ => Err(EngineError::StepFailed(format!(
                "one cache for {} sequences",
                tokens.len()
            ))),
        }
    };
    // Each row's logits alone, or one `[B, vocab]` array for the batch.
    let (each, batch) = match kv {
        StepKv::One(cache) => (one(cache)?, None),
        StepKv::Rows(rows) if rows.len() == 1 => match rows.row_mut(0)? {
            Some(cache) => (one(cache)?, None),
            None => (Vec::new(), None),
        },
        StepKv::Rows(rows) => {
            let refs: Vec<&mlx::Array> = tokens.iter().collect();
            let ids = mlx::ops::concatenate(&refs, 0)?;
            (Vec::new(), Some(model.forward_rows_tokens(&ids, rows)?))
        }
    };
    feed_all(seqs, &tokens)?;
    match batch {
        Some(all) => pick_rows(seqs, &all)?,
        None => pick_each(seqs, &each)?,
    }
    let arrays = launched_arrays(seqs)?;
    let shape = StepShape {
        rows: seqs.len(),
        prompts: 0,
    };
    crate::census::count_step(shape, &arrays)?;
    let built = started.elapsed();
    // The graph is built (lazily, while the previous step may still run); its writes into
    // the rows' KV are made when it is queued.
    wait_for_previous_step(seqs)?;
    mlx::async_eval(&arrays.iter().collect::<Vec<_>>())?;
    crate::host_probe::after_queued_step();
    Ok(Some(built))
}

/// Before a built step is queued, what [`step_wait`] says: nothing, the previous step's
/// picks, or the device drained of the previous step (its picks, then every kernel's
/// completion callback), so that MLX can write this step's keys and values in place.
fn wait_for_previous_step(seqs: &[&mut Sequence]) -> Result<()> {
    match step_wait() {
        StepWait::None => {}
        StepWait::Picks => wait_for_picks(seqs)?,
        StepWait::Drained => {
            wait_for_picks(seqs)?;
            mlx::synchronize()?;
        }
        StepWait::Adaptive => {
            if picks_available(seqs)? {
                mlx::synchronize()?;
            }
        }
    }
    Ok(())
}

/// Whether every pick of the step in flight is computed already (none in flight: yes).
fn picks_available(seqs: &[&mut Sequence]) -> Result<bool> {
    for pick in seqs.iter().filter_map(|s| s.unread.as_ref()) {
        if !pick.arrays()?.iter().all(mlx::Array::is_available) {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Computes the picks of the step in flight (the previous one), if any.
fn wait_for_picks(seqs: &[&mut Sequence]) -> Result<()> {
    if !seqs.iter().any(|s| s.unread.is_some()) {
        return Ok(());
    }
    let mut arrays = Vec::new();
    for pick in seqs.iter().filter_map(|s| s.unread.as_ref()) {
        arrays.extend(pick.arrays()?);
    }
    mlx::eval(&arrays.iter().collect::<Vec<_>>())?;
    Ok(())
}

/// What a decode step waits for before it is queued (its graph is built before, while the
/// previous step may still run).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum StepWait {
    /// Nothing: queued at once, overlapping the previous step.
    None,
    /// The previous step's picks.
    Picks,
    /// The previous step's picks and the completion of everything queued before
    /// (`mlx::synchronize`).
    Drained,
    /// Queued at once while the previous step still runs (the device is the bound: overlap
    /// pays more than the copies a write against kernels in flight makes); once it has
    /// finished (the host is the bound), drained first, which then costs next to nothing
    /// and makes every write in place.
    Adaptive,
}

/// [`StepWait`] for this process: `KVSTORE_DECODE_WAIT` (`none`, `picks`, `drained`,
/// `adaptive`), else [`default_step_wait`] on MLX's default device; decided once.
pub(crate) fn step_wait() -> StepWait {
    // Read once: it is asked at every step.
    static WAIT: std::sync::OnceLock<StepWait> = std::sync::OnceLock::new();
    *WAIT.get_or_init(
        || match std::env::var("KVSTORE_DECODE_WAIT").ok().as_deref() {
            Some("none") => StepWait::None,
            Some("picks") => StepWait::Picks,
            Some("drained") => StepWait::Drained,
            Some("adaptive") => StepWait::Adaptive,
            other => {
                if let Some(v) = other {
                    tracing::warn!(
                        "KVSTORE_DECODE_WAIT={v:?} is not none, picks, drained or adaptive: \
                         using the device's default"
                    );
                }
                default_step_wait(mlx::default_device().unwrap_or(mlx::Device::Cpu))
            }
        },
    )
}

/// On a GPU, [`StepWait::Adaptive`]. MLX updates a buffer in place only when nothing else
/// holds it, and its CUDA backend holds every input of a queued kernel until that kernel's
/// completion callback has run, which may be after its result is computed: a step queued
/// while the previous step's attention kernels are held copies each row's keys and values
/// of every layer (its whole context) to write one token. On the H200, one attention
/// layer's shape of the 8B model (`scripts/cuda/decode_copy_probe.py`): queued at once,
/// peak memory 1.7-8 arenas above the arenas and 1.7-2.8 ms a step at 64K tokens; after the
/// previous result, 0.2-1.5 arenas (copies in some steps); drained, none. Which wait pays
/// depends on the bound (docs/benchmarks.md, session 16): the 8B decoding one sequence
/// (device-bound) ran 5-10 % faster queued at once than drained; SmolLM2's shape under the
/// Mooncake trace at ~4 rows (host-bound) had its decode launch's CPU time at 9.4 ms
/// drained against 10.0 at once and TTFT P50 0.111 against 0.119 s. On the CPU,
/// [`StepWait::None`]: MLX runs a stream's work in order and decides a write's donation
/// when it runs, after the previous step's reads.
pub(crate) fn default_step_wait(device: mlx::Device) -> StepWait {
    match device {
        mlx::Device::Cpu => StepWait::None,
        _ => StepWait::Adaptive,
    }
}

/// Each sequence's input of the step being queued counts for its penalties.
fn feed_all(seqs: &mut [&mut Sequence], tokens: &[mlx::Array]) -> Result<()> {
    for (s, t) in seqs.iter_mut().zip(tokens) {
        s.feed(t)?;
    }
    Ok(())
}

/// The arrays of every pick a step launched, to evaluate: a step makes at most one batch
/// of greedy picks, whose arrays are queued once.
fn launched_arrays(seqs: &[&mut Sequence]) -> Result<Vec<mlx::Array>> {
    let mut arrays = Vec::new();
    let mut batch_queued = false;
    for s in seqs.iter() {
        if let Some(pick) = &s.launched {
            if pick.is_batched() && std::mem::replace(&mut batch_queued, true) {
                continue;
            }
            arrays.extend(pick.arrays()?);
        }
    }
    Ok(arrays)
}

/// A prefill chunk to run inside a decode step ([`decode_step_mixed`]): the next chunk (at
/// most `max_chunk` tokens) of `seq`'s prompt after what `cache` holds.
pub(crate) struct ChunkJob<'a> {
    pub(crate) seq: &'a mut Sequence,
    pub(crate) cache: &'a mut dyn KvCache,
    pub(crate) max_chunk: usize,
}

/// What one job's chunk of a [`decode_step_mixed`] ran: its prompt tokens and, when it
/// ended the prompt, the prompt's last logits.
pub(crate) type ChunkRan = (usize, Option<mlx::Array>);

/// [`decode_step`] over the engine's `rows` with the next prefill chunk of each of `jobs`
/// in the same forward pass ([`Model::forward_mixed`]: the weights read once, not once
/// per part). Returns, per job, the prompt tokens its chunk ran and, when it ended the
/// prompt, its last logits (the first pick is the caller's, as after
/// [`Sequence::prefill_step`]); `None` when no mixed step was queued (no row needs a step,
/// a job has nothing left to prefill, or the model has no mixed pass for these caches):
/// nothing changed, and the caller runs the steps apart.
pub(crate) fn decode_step_mixed(
    model: &Model,
    seqs: &mut [&mut Sequence],
    rows: &mut PagedKvRows,
    jobs: Vec<ChunkJob<'_>>,
) -> Result<Option<Vec<ChunkRan>>> {
    if jobs.is_empty() || seqs.len() != rows.len() || !seqs.iter().any(|s| s.needs_step()) {
        return Ok(None);
    }
    let Some((lens, mut prompts)) = chunks_of(jobs) else {
        return Ok(None);
    };
    let mut tokens = Vec::with_capacity(seqs.len());
    for s in seqs.iter_mut() {
        tokens.push(s.input()?);
    }
    let refs: Vec<&mlx::Array> = tokens.iter().collect();
    let ids = mlx::ops::concatenate(&refs, 0)?;
    let Some(step) = model.forward_mixed(&ids, rows, &mut prompts)? else {
        return Ok(None);
    };
    feed_all(seqs, &tokens)?;
    pick_rows(seqs, &step.rows_logits)?;
    let mut arrays = launched_arrays(seqs)?;
    // Each chunk's keys and values are computed with the step; its last logits only when
    // the first pick needs them.
    let out = chunks_ran(step.prompts, lens, &mut arrays);
    let shape = StepShape {
        rows: seqs.len(),
        prompts: out.len(),
    };
    crate::census::count_step(shape, &arrays)?;
    wait_for_previous_step(seqs)?;
    mlx::async_eval(&arrays.iter().collect::<Vec<_>>())?;
    // The chunks' time is charged by the caller, who sees the whole step: what it took
    // beyond a decode step, shared by tokens among the pass's prompts before any first
    // pick (`Worker::charge_mixed_pass`).
    Ok(Some(out))
}

/// The next prefill chunk of each of `jobs`, all in one forward pass with no decoding rows
/// ([`Model::forward_prompts`]), computed before it returns (the caller charges its time).
/// Returns what [`decode_step_mixed`] does; `None` (nothing changed) where a job has
/// nothing left to prefill or the model has no such pass.
pub(crate) fn prefill_packed(
    model: &Model,
    jobs: Vec<ChunkJob<'_>>,
) -> Result<Option<Vec<ChunkRan>>> {
    let Some((lens, mut prompts)) = chunks_of(jobs) else {
        return Ok(None);
    };
    let Some(parts) = model.forward_prompts(&mut prompts)? else {
        return Ok(None);
    };
    let mut arrays = Vec::with_capacity(lens.len());
    let out = chunks_ran(parts, lens, &mut arrays);
    let shape = StepShape {
        rows: 0,
        prompts: out.len(),
    };
    crate::census::count_step(shape, &arrays)?;
    mlx::eval(&arrays.iter().collect::<Vec<_>>())?;
    Ok(Some(out))
}

/// Each job's chunk ([`ChunkJob`]) as a [`PromptChunk`], with its length and whether it
/// ends the prompt; `None` when a job has nothing left to prefill.
#[allow(clippy::type_complexity)]
fn chunks_of(jobs: Vec<ChunkJob<'_>>) -> Option<(Vec<(usize, bool)>, Vec<PromptChunk<'_>>)> {
    let mut lens = Vec::with_capacity(jobs.len());
    let mut prompts = Vec::with_capacity(jobs.len());
    for job in jobs {
        let ChunkJob {
            seq,
            cache,
            max_chunk,
        } = job;
        let held = cache.offset();
        let rest = seq.prompt.get(held..).unwrap_or_default();
        if rest.is_empty() {
            return None;
        }
        let n = rest.len().min(seq.chunk_len(held, max_chunk));
        lens.push((n, n == rest.len()));
        prompts.push(PromptChunk {
            tokens: &rest[..n],
            cache,
        });
    }
    Some((lens, prompts))
}

/// What each chunk of a pass ran ([`ChunkRan`]), adding to `arrays` what evaluating it
/// takes: its last logits when it ends the prompt, else its hidden states.
fn chunks_ran(
    parts: Vec<crate::model::PromptPass>,
    lens: Vec<(usize, bool)>,
    arrays: &mut Vec<mlx::Array>,
) -> Vec<ChunkRan> {
    let mut out = Vec::with_capacity(lens.len());
    for (part, (n, ends_prompt)) in parts.into_iter().zip(lens) {
        let logits = ends_prompt.then_some(part.logits);
        arrays.push(logits.clone().unwrap_or(part.hidden));
        out.push((n, logits));
    }
    out
}

/// Queues each sequence's pick from its own `logits` (`[vocab]` each).
fn pick_each(seqs: &mut [&mut Sequence], logits: &[mlx::Array]) -> Result<()> {
    if logits.len() != seqs.len() {
        return Err(EngineError::StepFailed(format!(
            "a step of {} rows for {} sequences",
            logits.len(),
            seqs.len()
        )));
    }
    for (s, l) in seqs.iter_mut().zip(logits) {
        s.pick(l)?;
    }
    Ok(())
}

/// Queues every sequence's pick from its row of a batched step's `logits` (`[B, vocab]`):
/// the plain greedy rows together ([`GreedyBatch`]: one argmax, one read), the others each
/// from its own row.
fn pick_rows(seqs: &mut [&mut Sequence], logits: &mlx::Array) -> Result<()> {
    let shape = logits.shape();
    if shape.len() != 2 || shape[0] as usize != seqs.len() {
        return Err(EngineError::StepFailed(format!(
            "a step's logits {shape:?} for {} sequences",
            seqs.len()
        )));
    }
    let vocab = shape[1];
    let plain: Vec<bool> = seqs.iter().map(|s| s.plain_greedy()).collect();
    let together: Vec<i32> = (0..seqs.len() as i32)
        .filter(|&i| plain[i as usize])
        .collect();
    let batched = together.len() >= 2;
    if batched {
        let rows = if together.len() == seqs.len() {
            logits.clone()
        } else {
            let idx = mlx::Array::from_slice(&together, &[together.len() as i32])?;
            logits.take(&idx, 0)?
        };
        let batch = GreedyBatch::new(&rows)?;
        for (j, &i) in together.iter().enumerate() {
            seqs[i as usize].launched = Some(batch.selection(j)?);
        }
    }
    for (i, s) in seqs.iter_mut().enumerate() {
        if batched && plain[i] {
            continue;
        }
        let r = i as i32;
        let row = logits.slice(&[r, 0], &[r + 1, vocab])?.reshape(&[vocab])?;
        s.pick(&row)?;
    }
    Ok(())
}

/// Prefills `seq` alone over `cache`, chunk after chunk, and picks its first token: the
/// engine's prefill steps one after another, as the worker runs them while nothing
/// decodes and nothing else arrives.
pub(crate) fn prefill_alone(
    seq: &mut Sequence,
    model: &Model,
    cache: &mut dyn KvCache,
) -> Result<()> {
    loop {
        if let (_, Some(logits)) = seq.prefill_step(model, cache, usize::MAX)? {
            return seq.first_pick(&logits);
        }
    }
}

/// Decodes `seq` (prefilled, its first token picked) alone to its end over `cache`: the
/// engine's loop as a batch of one ([`decode_step`], [`Sequence::emit`],
/// [`Sequence::advance`]), handing each token to `deliver` (false: stop, as a client that
/// goes away). On return the run-ahead step is trimmed from the cache.
pub(crate) fn decode_alone(
    seq: &mut Sequence,
    model: &Model,
    tokenizer: &Tokenizer,
    cache: &mut dyn KvCache,
    deliver: &mut dyn FnMut(Sampled, String) -> bool,
) -> Result<()> {
    seq.emit_first(tokenizer, deliver)?;
    while seq.finish.is_none() {
        decode_step(model, &mut [&mut *seq], StepKv::One(&mut *cache))?;
        seq.emit(tokenizer, false, deliver)?;
        seq.advance();
    }
    seq.trim_run_ahead(cache)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> (Model, Tokenizer) {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/goldens/tiny-qwen3");
        crate::load(&dir, &crate::LoadOptions::default()).unwrap()
    }

    /// `prompt` prefilled and decoded greedily to `max_tokens` by hand: the first token
    /// emitted at once or with the first step's read (`first_at_once`), each step queued
    /// after the one before was computed or not (`wait`). The tokens and what the cache
    /// holds at the end.
    fn decode_by_hand(
        model: &Model,
        tok: &Tokenizer,
        prompt: &[u32],
        max_tokens: usize,
        first_at_once: bool,
        wait: bool,
    ) -> (Vec<u32>, usize) {
        let (mut seq, mut cache) = prefilled(model, prompt, max_tokens);
        let mut out = Vec::new();
        let mut deliver = |s: Sampled, _: String| {
            out.push(s.token);
            true
        };
        if first_at_once {
            seq.emit_first(tok, &mut deliver).unwrap();
        }
        while seq.finish.is_none() {
            if wait {
                // What StepWait::Drained does before a step is queued.
                wait_for_picks(&[&mut seq]).unwrap();
                mlx::synchronize().unwrap();
            }
            decode_step(model, &mut [&mut seq], StepKv::One(&mut cache)).unwrap();
            seq.emit(tok, false, &mut deliver).unwrap();
            seq.advance();
        }
        seq.trim_run_ahead(&mut cache).unwrap();
        (out, cache.offset())
    }

    /// A greedy sequence of `prompt`, prefilled alone over a fresh cache.
    fn prefilled(
        model: &Model,
        prompt: &[u32],
        max_tokens: usize,
    ) -> (Sequence, cache::PagedKvCache) {
        let mut seq = Sequence::alone(model, prompt, &greedy(max_tokens)).unwrap();
        let mut cache = model.new_cache();
        prefill_alone(&mut seq, model, &mut cache).unwrap();
        (seq, cache)
    }

    fn greedy(max_tokens: usize) -> GenerateParams {
        GenerateParams {
            max_tokens,
            stop_at_eos: false,
            ..GenerateParams::default()
        }
    }

    #[test]
    fn the_first_token_goes_out_before_the_step_that_runs_it_is_queued() {
        let (model, tok) = tiny();
        let prompt: Vec<u32> = (3..40).collect();
        let (mut seq, mut cache) = prefilled(&model, &prompt, 6);
        let mut out: Vec<u32> = Vec::new();
        seq.emit_first(&tok, &mut |s, _| {
            out.push(s.token);
            true
        })
        .unwrap();
        // Delivered with no decode step queued or pending, and not yet in the cache.
        assert_eq!(out, seq.tokens);
        assert_eq!(out.len(), 1);
        assert!(seq.launched.is_none() && seq.unread.is_none() && seq.next.is_none());
        assert_eq!(cache.offset(), prompt.len());
        assert!(seq.needs_step());
        // A second call has nothing to emit.
        seq.emit_first(&tok, &mut |_, _| panic!("emitted twice"))
            .unwrap();
        // The next step runs the emitted token; the rest follows as before.
        decode_alone(&mut seq, &model, &tok, &mut cache, &mut |s, _| {
            out.push(s.token);
            true
        })
        .unwrap();
        assert_eq!(out.len(), 6);
        assert_eq!(out, seq.tokens);
        assert_eq!(seq.finish, Some(FinishReason::Length));
        // The cache holds the prompt and every emitted token but the last.
        assert_eq!(cache.offset(), prompt.len() + 5);

        // The same prompt with its own first token read late (the path before): the same
        // tokens, so emitting early changes when the client sees the token, not what.
        let (again, _) = decode_by_hand(&model, &tok, &prompt, 6, false, false);
        assert_eq!(again, out);
    }

    #[test]
    fn a_step_waits_for_the_one_before_on_a_gpu_only() {
        assert_eq!(default_step_wait(mlx::Device::Cpu), StepWait::None);
        assert_eq!(default_step_wait(mlx::Device::Gpu), StepWait::Adaptive);
    }

    #[test]
    fn waiting_for_each_step_before_the_next_gives_the_same_tokens() {
        let (model, tok) = tiny();
        let prompt: Vec<u32> = (5..60).collect();
        let decode = |wait: bool| decode_by_hand(&model, &tok, &prompt, 12, true, wait);
        let (waited, held) = decode(true);
        assert_eq!(waited.len(), 12);
        assert_eq!((waited, held), decode(false));
    }

    #[test]
    fn the_previous_picks_read_as_available_once_computed() {
        let (model, tok) = tiny();
        let prompt: Vec<u32> = (5..40).collect();
        let (mut seq, mut cache) = prefilled(&model, &prompt, 4);
        assert!(picks_available(&[&mut seq]).unwrap(), "nothing in flight");
        seq.emit_first(&tok, &mut |_, _| true).unwrap();
        decode_step(&model, &mut [&mut seq], StepKv::One(&mut cache)).unwrap();
        seq.advance();
        assert!(seq.unread.is_some(), "a step is in flight");
        wait_for_picks(&[&mut seq]).unwrap();
        assert!(picks_available(&[&mut seq]).unwrap());
    }

    #[test]
    fn a_first_token_that_ends_the_sequence_queues_no_step() {
        let (model, tok) = tiny();
        let prompt: Vec<u32> = (3..20).collect();
        let (mut seq, mut cache) = prefilled(&model, &prompt, 1);
        let mut out = Vec::new();
        decode_alone(&mut seq, &model, &tok, &mut cache, &mut |s, _| {
            out.push(s.token);
            true
        })
        .unwrap();
        assert_eq!(out.len(), 1);
        assert_eq!(seq.finish, Some(FinishReason::Length));
        assert!(!seq.needs_step());
        assert_eq!(cache.offset(), prompt.len());
    }
}
