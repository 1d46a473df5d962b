//! `kvstore bench serve`: the serving engine under concurrent load, in process (the engine
//! `kvstore serve` runs, without HTTP). Two parts, each against a baseline in the same run:
//!
//! - **interleave**: `--streams` requests decode while one `--long-prompt`-token prompt
//!   arrives (a second round, after one that compiles every shape). Reports the streams' inter-token latency (ITL) P50/P99 before the long prompt
//!   and while it is prefilled: with the chunk sized to the step budget (`--itl-stretch`,
//!   the engine's default), with a fixed chunk (`--prefill-chunk`), and with the whole
//!   prompt prefilled in one step (the engine before chunked prefill): the ratio of the
//!   two P99s is how much a long prompt stalls running streams.
//! - **sessions**: `--sessions` concurrent multi-turn sessions of `--turns` turns; each turn
//!   sends the previous prompt, its reply and `--new-tokens` new tokens. Reports throughput,
//!   TTFT and ITL P50/P99 and the share of prompt tokens served from the prefix cache from
//!   turn 2 on.
//!
//! - **http sessions** (with `--peer-python`): the sessions part over HTTP, against a
//!   `kvstore serve` and mlx-lm's `mlx_lm.server` started as child processes on the same
//!   model, one after the other, with the same text prompts: the peer comparison.
//!
//! Prompts are token ids (deterministic, distinct per stream and session), not chat text:
//! the load shape is what is measured, not a template. Over HTTP they are sent as the text
//! those ids decode to (mlx_lm.server takes no token ids), to `/v1/completions` (no chat
//! template on either side).

use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use engine::{Engine, EngineConfig, Event, GenerateParams, Request};
use serde::Serialize;

use super::child_server::ChildServer;
use super::step_rows::DecodeRowsCost;
use super::trace::http::HttpTarget;
use crate::cache_args::CacheArgs;
use crate::generate::ModelArgs;

/// Arguments of `kvstore bench serve`.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    cache: CacheArgs,
    /// Decoding streams of the interleave part.
    #[arg(long, default_value_t = 8)]
    streams: usize,
    /// Tokens each stream decodes.
    #[arg(long, default_value_t = 128)]
    stream_tokens: usize,
    /// Prompt tokens of the request that arrives while the streams decode.
    #[arg(long, default_value_t = 8192)]
    long_prompt: usize,
    /// Prompt tokens prefilled per engine step while rows decode (the chunked arm)
    /// [default: as `serve`: 2048 on a GPU, 512 on the CPU].
    #[arg(long, value_name = "N", value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    prefill_chunk: Option<usize>,
    /// The engine's step budget, as `kvstore serve --itl-stretch` (the sessions part and
    /// the interleave's first arm); the interleave's budgeted arm takes it, or 1.5 with
    /// `none`.
    #[arg(long, value_name = "X|none", default_value = "none", value_parser = crate::serve::parse_itl_stretch)]
    itl_stretch: crate::serve::ItlStretch,
    /// Concurrent sessions of the sessions part (0 skips it).
    #[arg(long, default_value_t = 16)]
    sessions: usize,
    /// Turns per session.
    #[arg(long, default_value_t = 4)]
    turns: usize,
    /// Tokens of a session's first prompt.
    #[arg(long, default_value_t = 256)]
    first_prompt: usize,
    /// New tokens each later turn adds after the previous reply.
    #[arg(long, default_value_t = 64)]
    new_tokens: usize,
    /// Tokens each turn's reply decodes.
    #[arg(long, default_value_t = 32)]
    reply_tokens: usize,
    /// Rows decoding together.
    #[arg(long, default_value_t = 16)]
    max_batch: usize,
    /// Write the report as JSON here.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Python with mlx-lm: also run the sessions part over HTTP against `kvstore serve` and
    /// `mlx_lm.server` (the peer), same model, same prompts.
    #[arg(long, value_name = "PYTHON")]
    peer_python: Option<String>,
    /// The model folder mlx_lm.server loads (Hugging Face layout). Default: --model.
    #[arg(long, value_name = "DIR")]
    peer_model: Option<PathBuf>,
    /// Skip the in-process parts (interleave and sessions): only the HTTP peer comparison.
    #[arg(long, requires = "peer_python")]
    http_only: bool,
}

impl Args {
    /// The prefill chunk: `--prefill-chunk`, or the device's default.
    fn prefill_chunk(&self) -> usize {
        self.prefill_chunk
            .unwrap_or_else(engine::default_prefill_chunk)
    }
}

/// P50 and P99 of a sample, seconds (not a number for an empty sample).
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub(crate) struct Quantiles {
    n: usize,
    p50: f64,
    p99: f64,
}

/// Nearest-rank quantiles of `xs` (`bench trace`'s percentiles) with the sample size.
fn quantiles(xs: &[f64]) -> Quantiles {
    let p = super::trace::report::Percentiles::of(xs);
    Quantiles {
        n: xs.len(),
        p50: p.p50,
        p99: p.p99,
    }
}

/// Engine steps an in-process run keeps in its step log.
pub(crate) const STEP_LOG: usize = 200_000;

/// One interleave arm.
#[derive(Debug, Serialize)]
struct InterleaveArm {
    prefill_chunk: usize,
    /// The engine's step budget ([`EngineConfig::itl_stretch`]); null: a fixed chunk.
    itl_stretch: Option<f64>,
    /// Whether the chunk ran in the decode pass ([`EngineConfig::mixed_steps`]).
    mixed_steps: bool,
    /// ITL of the streams without the long prompt: before it arrived and after its first
    /// token.
    itl_without: Quantiles,
    /// ITL of the streams' tokens that arrived while the long prompt was prefilled.
    itl_during: Quantiles,
    /// itl_during.p99 / itl_without.p99.
    p99_ratio: f64,
    /// TTFT of the long prompt, seconds.
    long_ttft_s: f64,
}

/// The sessions part.
#[derive(Debug, Serialize)]
struct Sessions {
    sessions: usize,
    turns: usize,
    wall_s: f64,
    completion_tok_per_s: f64,
    ttft: Quantiles,
    itl: Quantiles,
    /// Prompt tokens served from the prefix cache / prompt tokens, turns 2 and later.
    hit_share: f64,
    /// Where the engine thread's time went (in process only).
    #[serde(skip_serializing_if = "Option::is_none")]
    steps: Option<StepSummary>,
}

/// The engine steps of an in-process sessions run, from the engine's step log: how many
/// decoded only, how many also ran a prefill chunk, and where each kind's time went.
#[derive(Debug, Serialize)]
pub(crate) struct StepSummary {
    /// Steps that decoded and ran no prefill chunk.
    decode_only: usize,
    /// Steps that decoded and ran a prefill chunk.
    decode_and_prefill: usize,
    /// Steps that only prefilled (nothing was decoding).
    prefill_only: usize,
    /// Mean rows of a decoding step.
    mean_rows: f64,
    /// Wall time of a decode-only step, seconds.
    decode_only_s: Quantiles,
    /// Wall time of a step that decoded and prefilled, seconds.
    decode_and_prefill_s: Quantiles,
    /// Means over decoding steps, seconds: queueing the decode step, reading its picks
    /// (waiting for the device) and emitting, and the prefill chunk.
    mean_launch_s: f64,
    /// The engine thread's CPU time within the mean launch, seconds (the rest it waited).
    mean_launch_cpu_s: f64,
    /// Mean launch and its CPU time over decode-only steps, seconds.
    decode_only_launch_s: f64,
    decode_only_launch_cpu_s: f64,
    mean_emit_s: f64,
    mean_prefill_s: f64,
    /// Means over all steps, seconds: admitting requests (restores included) and
    /// publishing blocks to the prefix cache.
    mean_admit_s: f64,
    mean_publish_s: f64,
    /// Steps whose admission stopped at a request whose cached prefix was still loading.
    admit_waited_load: usize,
    /// Decode-only steps by their rows: launch CPU and graph building per bucket, and
    /// what a row adds.
    decode_only_by_rows: DecodeRowsCost,
}

impl StepSummary {
    pub(crate) fn of(steps: &[engine::StepRecord]) -> StepSummary {
        let secs = |us: u64| us as f64 * 1e-6;
        let total = |s: &engine::StepRecord| secs(s.launch_us + s.emit_us + s.prefill_us);
        let decoding: Vec<_> = steps.iter().filter(|s| !s.decoded.is_empty()).collect();
        let (mixed, alone): (Vec<&engine::StepRecord>, Vec<&engine::StepRecord>) =
            decoding.iter().partition(|s| s.prefilled.is_some());
        let mean_of = |steps: &[&engine::StepRecord], f: &dyn Fn(&engine::StepRecord) -> u64| {
            steps.iter().map(|s| secs(f(s))).sum::<f64>() / steps.len().max(1) as f64
        };
        let mean = |f: &dyn Fn(&engine::StepRecord) -> u64| mean_of(&decoding, f);
        let every: Vec<&engine::StepRecord> = steps.iter().collect();
        let all_mean = |f: &dyn Fn(&engine::StepRecord) -> u64| mean_of(&every, f);
        let n = decoding.len().max(1) as f64;
        StepSummary {
            decode_only: alone.len(),
            decode_and_prefill: mixed.len(),
            prefill_only: steps.len() - decoding.len(),
            mean_rows: decoding.iter().map(|s| s.decoded.len()).sum::<usize>() as f64 / n,
            decode_only_s: quantiles(&alone.iter().map(|s| total(s)).collect::<Vec<_>>()),
            decode_and_prefill_s: quantiles(&mixed.iter().map(|s| total(s)).collect::<Vec<_>>()),
            mean_launch_s: mean(&|s| s.launch_us),
            mean_launch_cpu_s: mean(&|s| s.launch_cpu_us),
            decode_only_launch_s: mean_of(&alone, &|s| s.launch_us),
            decode_only_launch_cpu_s: mean_of(&alone, &|s| s.launch_cpu_us),
            mean_emit_s: mean(&|s| s.emit_us),
            mean_prefill_s: mean(&|s| s.prefill_us),
            mean_admit_s: all_mean(&|s| s.admit_us),
            mean_publish_s: all_mean(&|s| s.publish_us),
            admit_waited_load: steps.iter().filter(|s| s.admit_waited_load).count(),
            decode_only_by_rows: DecodeRowsCost::of(
                &alone
                    .iter()
                    .map(|s| (s.decoded.len(), s.launch_us, s.launch_cpu_us, s.build_us))
                    .collect::<Vec<_>>(),
            ),
        }
    }

    /// One line: what a row adds to a decode-only step's launch.
    pub(crate) fn by_rows(&self) -> String {
        self.decode_only_by_rows.summary()
    }

    /// One line: step counts and times.
    pub(crate) fn summary(&self) -> String {
        format!(
            "steps: {} decode-only (P50 {:.1} ms), {} decode+prefill (P50 {:.1} ms), {} prefill-only; {:.1} rows a step; mean launch {:.1} ms (engine thread CPU {:.1} ms; decode-only {:.1} ms, CPU {:.1} ms), read+emit {:.1} ms, prefill {:.1} ms; admit {:.2} ms, publish {:.2} ms a step; {} steps met a prefix still loading (admitted past it)",
            self.decode_only,
            self.decode_only_s.p50 * 1e3,
            self.decode_and_prefill,
            self.decode_and_prefill_s.p50 * 1e3,
            self.prefill_only,
            self.mean_rows,
            self.mean_launch_s * 1e3,
            self.mean_launch_cpu_s * 1e3,
            self.decode_only_launch_s * 1e3,
            self.decode_only_launch_cpu_s * 1e3,
            self.mean_emit_s * 1e3,
            self.mean_prefill_s * 1e3,
            self.mean_admit_s * 1e3,
            self.mean_publish_s * 1e3,
            self.admit_waited_load,
        )
    }
}

/// The sessions part over HTTP against one server.
#[derive(Debug, Serialize)]
struct HttpSessions {
    /// `kvstore serve` or `mlx_lm.server`.
    server: &'static str,
    #[serde(flatten)]
    sessions: Sessions,
    /// Completion tokens the server reported.
    completion_tokens: usize,
    /// Requests sent again because the server refused or reset their connection.
    retries: usize,
}

impl Sessions {
    /// One line: sessions, wall time, throughput, TTFT and ITL.
    pub(crate) fn summary(&self) -> String {
        format!(
            "{} x {} turns in {:.1} s: {:.1} completion tok/s, TTFT P50 {:.3} s P99 {:.3} s, ITL P50 {:.1} ms P99 {:.1} ms",
            self.sessions,
            self.turns,
            self.wall_s,
            self.completion_tok_per_s,
            self.ttft.p50,
            self.ttft.p99,
            self.itl.p50 * 1e3,
            self.itl.p99 * 1e3,
        )
    }
}

#[derive(Debug, Serialize)]
struct Report {
    model: String,
    interleave: Vec<InterleaveArm>,
    sessions: Option<Sessions>,
    http_sessions: Vec<HttpSessions>,
    /// kvstore's completion tok/s over mlx_lm.server's, same load.
    http_throughput_ratio: Option<f64>,
}

/// Deterministic token ids for stream or session `seed`, distinct from every other seed's
/// from the first token on.
fn ids(n: usize, seed: u32, vocab: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| {
            let x = (i ^ seed.wrapping_mul(0x9E37_79B9))
                .wrapping_mul(2_654_435_761)
                .rotate_left(13)
                .wrapping_add(seed);
            // Ids above 3 leave the usual special tokens alone.
            x % (vocab - 4) + 4
        })
        .collect()
}

/// What one request gave: its token arrival times and completion.
struct Timed {
    submitted: Instant,
    arrivals: Vec<Instant>,
    tokens: Vec<u32>,
    /// Tokens generated (as the server counted them over HTTP).
    completion_tokens: usize,
    cached_tokens: usize,
    prompt_tokens: usize,
    /// Times the request was sent again (over HTTP: connection refused or reset).
    retries: usize,
}

fn run_request(
    engine: &Engine,
    prompt: Vec<u32>,
    max_tokens: usize,
    prefill_chunk: usize,
) -> Result<Timed> {
    run_request_with(engine, prompt, max_tokens, prefill_chunk, |_| {})
}

/// [`run_request`] that calls `on_token(n)` after the n-th token arrives.
fn run_request_with(
    engine: &Engine,
    prompt: Vec<u32>,
    max_tokens: usize,
    prefill_chunk: usize,
    mut on_token: impl FnMut(usize),
) -> Result<Timed> {
    let params = GenerateParams {
        max_tokens,
        stop_at_eos: false,
        prefill_chunk,
        ..GenerateParams::default()
    };
    let submitted = Instant::now();
    let mut h = engine
        .submit(Request::new(prompt, params))
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut t = Timed {
        submitted,
        arrivals: Vec::new(),
        tokens: Vec::new(),
        completion_tokens: 0,
        cached_tokens: 0,
        prompt_tokens: 0,
        retries: 0,
    };
    while let Some(e) = h.recv_blocking() {
        match e {
            Event::Token { sampled, .. } => {
                t.arrivals.push(Instant::now());
                t.tokens.push(sampled.token);
                on_token(t.tokens.len());
            }
            Event::Finished(c) => {
                t.completion_tokens = t.tokens.len();
                t.cached_tokens = c.cached_tokens;
                t.prompt_tokens = c.prompt_tokens;
                return Ok(t);
            }
            Event::Failed(e) => bail!("request failed: {e}"),
            _ => {}
        }
    }
    bail!("the engine ended the request without finishing it")
}

/// How an interleave arm's engine schedules prefill among decoding rows.
#[derive(Clone, Copy, Debug)]
struct Schedule {
    prefill_chunk: usize,
    itl_stretch: Option<f64>,
    /// `None`: the engine's default (`KVSTORE_MIXED_STEPS` when set, else on the CPU only).
    mixed_steps: Option<bool>,
}

impl Schedule {
    /// What `kvstore serve` does with these arguments.
    fn served(args: &Args) -> Self {
        Schedule {
            prefill_chunk: args.prefill_chunk(),
            itl_stretch: args.itl_stretch,
            mixed_steps: None,
        }
    }

    fn name(&self) -> String {
        let pass = match self.mixed_steps {
            Some(false) => "in passes of its own",
            Some(true) => "in the decode pass",
            None => "as the engine runs it",
        };
        match (self.prefill_chunk, self.itl_stretch) {
            (usize::MAX, _) => "whole prompt".into(),
            (c, Some(x)) => format!("at most {c} {pass}, steps within {x}x"),
            (c, None) => format!("{c} {pass}"),
        }
    }
}

fn open_engine(args: &Args, schedule: Schedule, max_batch: usize) -> Result<(Engine, u32)> {
    let Schedule {
        prefill_chunk,
        itl_stretch,
        mixed_steps,
    } = schedule;
    let (model, tokenizer) = args.model.load()?;
    let prefix = args.cache.open(&model, &tokenizer)?;
    let engine = Engine::open(
        model,
        tokenizer,
        prefix,
        EngineConfig {
            max_batch,
            kv_budget_bytes: args.cache.kv_budget_bytes()?,
            prefill_chunk,
            itl_stretch,
            mixed_steps,
            // Where the engine thread's time goes ([`StepSummary`]).
            step_log: STEP_LOG,
            ..EngineConfig::default()
        },
    )?;
    let vocab = engine
        .info()
        .vocab_size
        .min(engine.tokenizer().vocab_size()) as u32;
    // Kernels compiled and weights paged in before anything is timed.
    run_request(&engine, ids(64, 0xFFFF, vocab), 4, prefill_chunk)?;
    Ok((engine, vocab))
}

/// Streams decode; once each has produced a few tokens the long prompt arrives. The round
/// runs twice in one engine and the first is thrown away: every batch size and prefill
/// shape is compiled by then (MLX compiles kernels on first use of a shape).
fn interleave(args: &Args, schedule: Schedule, arm: u32) -> Result<InterleaveArm> {
    let (engine, vocab) = open_engine(args, schedule, args.streams + 1)?;
    let engine = Arc::new(engine);
    // The arms share the store: their prompts must differ, or a later arm restores what an
    // earlier one prefilled.
    round(args, &engine, vocab, schedule, 2 * arm)?;
    let arm = round(args, &engine, vocab, schedule, 2 * arm + 1)?;
    if let Ok(engine) = Arc::try_unwrap(engine) {
        engine.shutdown(false).context("shutting the engine down")?;
    }
    Ok(arm)
}

/// One interleave round; `round` makes its prompts distinct from other rounds'.
fn round(
    args: &Args,
    engine: &Arc<Engine>,
    vocab: u32,
    schedule: Schedule,
    round: u32,
) -> Result<InterleaveArm> {
    let prefill_chunk = schedule.prefill_chunk;
    // Streams count themselves in at their eighth token and read on without waiting (a
    // stream that waited would record the wait as a gap); the long prompt comes once all
    // have.
    let warm = Arc::new((Mutex::new(0usize), Condvar::new()));
    let mut threads = Vec::new();
    for s in 0..args.streams {
        let (engine, warm) = (engine.clone(), warm.clone());
        let n = args.stream_tokens;
        let seed = 1 + s as u32 + 100 * round;
        threads.push(std::thread::spawn(move || -> Result<Timed> {
            let count_in = || {
                let (count, cv) = &*warm;
                *count.lock().unwrap_or_else(|e| e.into_inner()) += 1;
                cv.notify_all();
            };
            let mut counted = false;
            let t = run_request_with(&engine, ids(64, seed, vocab), n, prefill_chunk, |k| {
                if k == 8 {
                    count_in();
                    counted = true;
                }
            });
            if !counted {
                count_in();
            }
            t
        }));
    }
    {
        let (count, cv) = &*warm;
        let mut n = count.lock().unwrap_or_else(|e| e.into_inner());
        while *n < args.streams {
            n = cv.wait(n).unwrap_or_else(|e| e.into_inner());
        }
    }
    let long = run_request(
        engine,
        ids(args.long_prompt, 0xABCD + round, vocab),
        1,
        prefill_chunk,
    )?;
    let (start, end) = (long.submitted, long.arrivals.first().copied());
    let Some(end) = end else {
        bail!("the long prompt produced no token");
    };
    let (mut without, mut during) = (Vec::new(), Vec::new());
    for t in threads {
        let t = t
            .join()
            .map_err(|_| anyhow::anyhow!("a stream thread panicked"))??;
        // From the third token on: the first gaps include the other streams' admission.
        // Gaps wholly before the long prompt arrived or after its first token are the
        // streams without it; the others overlap its prefill.
        for w in t.arrivals.windows(2).skip(2) {
            let gap = (w[1] - w[0]).as_secs_f64();
            if w[1] <= start || w[0] >= end {
                without.push(gap);
            } else {
                during.push(gap);
            }
        }
    }
    if without.is_empty() || during.is_empty() {
        bail!(
            "the streams' tokens did not cover the long prompt's prefill and a time without \
             it: raise --stream-tokens"
        );
    }
    let (itl_without, itl_during) = (quantiles(&without), quantiles(&during));
    Ok(InterleaveArm {
        prefill_chunk,
        itl_stretch: schedule.itl_stretch,
        mixed_steps: schedule.mixed_steps.unwrap_or(true),
        itl_without,
        itl_during,
        p99_ratio: itl_during.p99 / itl_without.p99.max(1e-9),
        long_ttft_s: (end - start).as_secs_f64(),
    })
}

/// Concurrent multi-turn sessions, after one unmeasured session of the same shape (compiles
/// the kernels of the shapes it meets).
fn sessions(args: &Args) -> Result<Sessions> {
    let (engine, vocab) = open_engine(args, Schedule::served(args), args.max_batch)?;
    let engine = Arc::new(engine);
    let mut prompt = ids(args.first_prompt, 999, vocab);
    for turn in 0..args.turns {
        let t = run_request(
            &engine,
            prompt.clone(),
            args.reply_tokens,
            args.prefill_chunk(),
        )?;
        prompt.extend(&t.tokens);
        prompt.extend(ids(args.new_tokens, 998 - turn as u32, vocab));
    }
    let logged_before = engine.step_log().len();
    let t0 = Instant::now();
    let mut threads = Vec::new();
    for s in 0..args.sessions {
        let engine = engine.clone();
        let (turns, first, new, reply, chunk) = (
            args.turns,
            args.first_prompt,
            args.new_tokens,
            args.reply_tokens,
            args.prefill_chunk(),
        );
        threads.push(std::thread::spawn(move || -> Result<Vec<Timed>> {
            let seed = 1000 + s as u32;
            let mut prompt = ids(first, seed, vocab);
            let mut out = Vec::new();
            for turn in 0..turns {
                let t = run_request(&engine, prompt.clone(), reply, chunk)?;
                prompt.extend(&t.tokens);
                prompt.extend(ids(new, seed + 7919 * (turn as u32 + 1), vocab));
                out.push(t);
            }
            Ok(out)
        }));
    }
    let mut all = Vec::new();
    for t in threads {
        all.push(
            t.join()
                .map_err(|_| anyhow::anyhow!("a session thread panicked"))??,
        );
    }
    let wall_s = t0.elapsed().as_secs_f64();
    let log = engine.step_log();
    // The warm-up's steps come first (a log that filled up lost them already).
    let skip = if log.len() < STEP_LOG {
        logged_before
    } else {
        0
    };
    let steps = StepSummary::of(&log[skip.min(log.len())..]);
    if let Ok(engine) = Arc::try_unwrap(engine) {
        engine.shutdown(false).context("shutting the engine down")?;
    }
    let mut out = summarize(args, &all, wall_s);
    out.steps = Some(steps);
    Ok(out)
}

/// Throughput, TTFT, ITL and hit share of finished sessions.
fn summarize(args: &Args, all: &[Vec<Timed>], wall_s: f64) -> Sessions {
    let (mut ttft, mut itl) = (Vec::new(), Vec::new());
    let (mut completion, mut cached, mut prompted) = (0usize, 0usize, 0usize);
    for session in all {
        for (turn, t) in session.iter().enumerate() {
            completion += t.completion_tokens;
            if let Some(first) = t.arrivals.first() {
                ttft.push((*first - t.submitted).as_secs_f64());
            }
            itl.extend(t.arrivals.windows(2).map(|w| (w[1] - w[0]).as_secs_f64()));
            if turn > 0 {
                cached += t.cached_tokens;
                prompted += t.prompt_tokens;
            }
        }
    }
    Sessions {
        sessions: args.sessions,
        turns: args.turns,
        wall_s,
        completion_tok_per_s: completion as f64 / wall_s,
        ttft: quantiles(&ttft),
        itl: quantiles(&itl),
        hit_share: cached as f64 / prompted.max(1) as f64,
        steps: None,
    }
}

/// The text prompts of the HTTP sessions: what the in-process part's token ids decode to.
struct SessionTexts {
    /// Per session (the first is the unmeasured warm-up session): its first prompt, then
    /// the new text each later turn adds.
    sessions: Vec<(String, Vec<String>)>,
}

impl SessionTexts {
    fn new(args: &Args, tokenizer: &engine::Tokenizer) -> Result<SessionTexts> {
        let vocab = tokenizer.vocab_size() as u32;
        let text = |n: usize, seed: u32| -> Result<String> {
            tokenizer
                .decode(&ids(n, seed, vocab), true)
                .map_err(|e| anyhow::anyhow!("decoding a synthetic prompt: {e}"))
        };
        let mut sessions = Vec::new();
        for s in 0..=args.sessions {
            let seed = if s == 0 { 999 } else { 1000 + s as u32 - 1 };
            let first = text(args.first_prompt, seed)?;
            let news = (0..args.turns)
                .map(|turn| text(args.new_tokens, seed + 7919 * (turn as u32 + 1)))
                .collect::<Result<Vec<_>>>()?;
            sessions.push((first, news));
        }
        Ok(SessionTexts { sessions })
    }
}

/// One session over HTTP: each turn sends the previous prompt, its reply and new text.
fn http_session(
    target: &HttpTarget,
    first: &str,
    news: &[String],
    reply_tokens: usize,
) -> Result<Vec<Timed>> {
    let mut prompt = first.to_string();
    let mut out = Vec::new();
    for new in news {
        let s = target.stream_completion(serde_json::json!(prompt), reply_tokens, false)?;
        prompt.push_str(&s.text);
        prompt.push_str(new);
        out.push(Timed {
            submitted: s.sent,
            arrivals: s.arrivals,
            tokens: Vec::new(),
            completion_tokens: s.outcome.completion_tokens,
            cached_tokens: s.outcome.cached_tokens,
            prompt_tokens: s.outcome.prompt_tokens,
            retries: s.retries,
        });
    }
    Ok(out)
}

/// The sessions part over HTTP against the server at `url`, after one unmeasured session.
fn http_sessions(
    args: &Args,
    server: &'static str,
    url: &str,
    texts: &SessionTexts,
) -> Result<HttpSessions> {
    let target = HttpTarget::new(url, None, None)?;
    let (first, news) = &texts.sessions[0];
    http_session(&target, first, news, args.reply_tokens)
        .with_context(|| format!("the warm-up session against {server}"))?;
    let t0 = Instant::now();
    let all = std::thread::scope(|scope| -> Result<Vec<Vec<Timed>>> {
        let threads: Vec<_> = texts.sessions[1..]
            .iter()
            .map(|(first, news)| {
                let target = &target;
                scope.spawn(move || http_session(target, first, news, args.reply_tokens))
            })
            .collect();
        threads
            .into_iter()
            .map(|t| {
                t.join()
                    .map_err(|_| anyhow::anyhow!("a session thread panicked"))?
            })
            .collect()
    })
    .with_context(|| format!("the sessions against {server}"))?;
    let wall_s = t0.elapsed().as_secs_f64();
    let completion_tokens = all.iter().flatten().map(|t| t.completion_tokens).sum();
    Ok(HttpSessions {
        server,
        sessions: summarize(args, &all, wall_s),
        completion_tokens,
        retries: all.iter().flatten().map(|t| t.retries).sum(),
    })
}

/// The peer comparison: the same HTTP sessions against `kvstore serve` and mlx_lm.server,
/// each started here, one after the other (never both loaded at once).
fn peer_comparison(args: &Args, python: &str) -> Result<Vec<HttpSessions>> {
    let model = args.model.path()?;
    let (peer_model, tokenizer) =
        ChildServer::mlx_lm_folder(model.clone(), args.peer_model.clone())?;
    let texts = SessionTexts::new(args, &tokenizer)?;
    let store = tempfile::tempdir().context("creating a scratch store for kvstore serve")?;
    let mut serve_args = vec![
        "--store".to_string(),
        store.path().display().to_string(),
        "--max-batch".into(),
        args.max_batch.to_string(),
        "--prefill-chunk".into(),
        args.prefill_chunk().to_string(),
        "--itl-stretch".into(),
        args.itl_stretch.map_or("none".into(), |x| x.to_string()),
        "--kv-budget".into(),
        args.cache.kv_budget.clone(),
    ];
    if args.model.keep_quantized {
        serve_args.push("--keep-quantized".into());
    }
    let mut out = Vec::new();
    for server in ["kvstore serve", "mlx_lm.server"] {
        let child = if server == "kvstore serve" {
            ChildServer::kvstore(&model, &serve_args)?
        } else {
            ChildServer::mlx_lm(python, &peer_model, 2 * (args.sessions + 1), None)?
        };
        let arm = http_sessions(args, server, &child.url, &texts)?;
        eprintln!(
            "http sessions, {server}: {}, {} requests resent",
            arm.sessions.summary(),
            arm.retries
        );
        out.push(arm);
        drop(child);
    }
    Ok(out)
}

/// Runs the benchmark.
pub fn run(mut args: Args) -> Result<()> {
    if args.streams == 0 || args.stream_tokens < 8 || args.long_prompt == 0 {
        bail!("--streams must be at least 1, --stream-tokens at least 8, --long-prompt at least 1");
    }
    // A fresh store unless one is named, removed at the end: every run starts cold.
    let scratch = tempfile::tempdir().context("creating a scratch store directory")?;
    if args.cache.store.is_none() {
        args.cache.store = Some(scratch.path().to_path_buf());
    }
    let model = args.model.path()?.display().to_string();
    // Arms: what `serve` does, the chunk in the decode pass sized to a step budget, the
    // fixed chunk in passes of its own (the engine before mixed steps), and the whole
    // prompt in one step (before chunked prefill).
    let mut interleave_arms = Vec::new();
    let mut in_process = Vec::new();
    if !args.http_only {
        let served = Schedule::served(&args);
        let fixed = Schedule {
            itl_stretch: None,
            mixed_steps: Some(true),
            ..served
        };
        in_process.push(served);
        in_process.push(Schedule {
            itl_stretch: Some(args.itl_stretch.unwrap_or(engine::SUGGESTED_ITL_STRETCH)),
            ..fixed
        });
        in_process.push(Schedule {
            mixed_steps: Some(false),
            ..fixed
        });
        in_process.push(Schedule {
            prefill_chunk: usize::MAX,
            mixed_steps: Some(false),
            ..fixed
        });
    }
    for (i, schedule) in in_process.into_iter().enumerate() {
        let arm = interleave(&args, schedule, i as u32)?;
        let name = schedule.name();
        eprintln!(
            "interleave, prefill chunk {}: {} streams' ITL P99 {:.1} ms without it, {:.1} ms while a {}-token prompt prefills ({:.2}x); its TTFT {:.2} s",
            name,
            args.streams,
            arm.itl_without.p99 * 1e3,
            arm.itl_during.p99 * 1e3,
            args.long_prompt,
            arm.p99_ratio,
            arm.long_ttft_s
        );
        interleave_arms.push(arm);
    }
    let sessions = if args.sessions > 0 && !args.http_only {
        let s = sessions(&args)?;
        eprintln!(
            "sessions: {}, cached {:.1} % of prompt tokens from turn 2",
            s.summary(),
            s.hit_share * 100.0
        );
        if let Some(steps) = &s.steps {
            eprintln!("sessions: {}", steps.summary());
            eprintln!("sessions: {}", steps.by_rows());
        }
        Some(s)
    } else {
        None
    };
    let http_sessions = match (&args.peer_python, args.sessions) {
        (Some(python), 1..) => peer_comparison(&args, python)?,
        _ => Vec::new(),
    };
    let http_throughput_ratio = match http_sessions.as_slice() {
        [ours, peer] => {
            Some(ours.sessions.completion_tok_per_s / peer.sessions.completion_tok_per_s)
        }
        _ => None,
    };
    if let Some(r) = http_throughput_ratio {
        eprintln!("http sessions: kvstore serve / mlx_lm.server completion throughput {r:.2}x");
    }
    let report = Report {
        model,
        interleave: interleave_arms,
        sessions,
        http_sessions,
        http_throughput_ratio,
    };
    let text = serde_json::to_string_pretty(&report)?;
    match &args.json {
        Some(path) => {
            std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?
        }
        None => println!("{text}"),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_summary_splits_decode_only_mixed_and_prefill_only_steps() {
        let step =
            |decoded: &[u64], prefilled: Option<(u64, usize)>, us: [u64; 3]| engine::StepRecord {
                decoded: decoded.to_vec(),
                prefilled,
                riders: Vec::new(),
                launch_us: us[0],
                launch_cpu_us: us[0] / 2,
                build_us: us[0] / 4,
                emit_us: us[1],
                prefill_us: us[2],
                admit_us: us[0] / 10,
                admit_cpu_us: us[0] / 20,
                begin_us: us[0] / 40,
                publish_us: us[1] / 10,
                admit_waited_load: us[2] == 0,
                step_us: us.iter().sum(),
                prefill_charged_us: Vec::new(),
                started_us: 0,
            };
        let log = [
            step(&[1, 2], None, [1000, 3000, 0]),
            step(&[1, 2, 3, 4], Some((5, 64)), [2000, 4000, 6000]),
            step(&[], Some((6, 128)), [0, 0, 9000]),
        ];
        let s = StepSummary::of(&log);
        // Admission and publication: means over all three steps.
        assert!((s.mean_admit_s - 0.0001).abs() < 1e-12);
        assert!((s.mean_publish_s - 0.0007 / 3.0).abs() < 1e-12);
        assert_eq!(s.admit_waited_load, 1);
        assert_eq!(
            (s.decode_only, s.decode_and_prefill, s.prefill_only),
            (1, 1, 1)
        );
        assert!((s.mean_rows - 3.0).abs() < 1e-12);
        assert!((s.decode_only_s.p50 - 0.004).abs() < 1e-12);
        assert!((s.decode_and_prefill_s.p50 - 0.012).abs() < 1e-12);
        assert!((s.mean_launch_s - 0.0015).abs() < 1e-12);
        assert!((s.mean_launch_cpu_s - 0.00075).abs() < 1e-12);
        // Decode-only: the first step alone.
        assert!((s.decode_only_launch_s - 0.001).abs() < 1e-12);
        assert!((s.decode_only_launch_cpu_s - 0.0005).abs() < 1e-12);
        assert!((s.mean_emit_s - 0.0035).abs() < 1e-12);
        // The prefill-only step is not a decoding step: its chunk is not in the mean.
        assert!((s.mean_prefill_s - 0.003).abs() < 1e-12);
    }

    #[test]
    fn quantiles_are_nearest_rank() {
        let xs: Vec<f64> = (1..=100).map(f64::from).collect();
        let q = quantiles(&xs);
        assert_eq!((q.n, q.p50, q.p99), (100, 50.0, 99.0));
        let q = quantiles(&[3.0, 1.0, 2.0]);
        assert_eq!((q.p50, q.p99), (2.0, 3.0));
        assert_eq!(quantiles(&[]).n, 0);
    }

    #[test]
    fn prompts_of_different_seeds_differ_from_the_first_token() {
        for (a, b) in [(1, 2), (0xABCD, 1), (1000, 1001)] {
            assert_ne!(ids(8, a, 49152)[0], ids(8, b, 49152)[0], "{a} {b}");
        }
        assert!(ids(500, 3, 300).iter().all(|&t| (4..300).contains(&t)));
        assert_eq!(ids(16, 5, 1000), ids(16, 5, 1000));
    }
}
