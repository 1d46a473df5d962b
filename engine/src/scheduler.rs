//! [`Engine`]: the library entry point. One engine thread owns the model and MLX and runs
//! continuous batching; callers on any thread [`Engine::submit`] requests and read their
//! [`Event`]s from a [`RequestHandle`], or cancel them with a [`CancelHandle`].
//!
//! Each loop of the engine thread:
//! 1. takes new submissions into a FIFO queue;
//! 2. admits queued requests while the batch has room (`max_batch`, counting rows still
//!    prefilling) and their KV reservation fits the budget: prefix reuse restores the
//!    longest cached prefix into a fresh [`PagedKvCache`] and the request starts prefilling;
//! 3. queues one batched decode step over every decoding row ([`Model::forward_rows`]; a
//!    batch of one runs the single-sequence step), each row picking its next token on the
//!    device with its own sampler;
//! 4. emits each row's previous pick (text deltas held back, EOS, stop strings, limits) and
//!    drops rows that finished, were cancelled or lost their receiver; their caches are
//!    published to the prefix cache and freed;
//! 5. prefills one chunk (at most `prefill_chunk` tokens, fewer under a step budget,
//!    [`EngineConfig::itl_stretch`]) of the prefilling request [`EngineConfig::prefill_order`]
//!    puts first (the fewest tokens left by default; riders beside it), inside step 3's
//!    forward pass where the model has a mixed pass ([`EngineConfig::mixed_steps`]), else
//!    in a pass of its own; its last chunk picks the first token and the row joins the
//!    decode batch. So a long prompt delays running streams by one chunk per step, never by
//!    its whole prefill (as vLLM's and SGLang's chunked prefill). With no row decoding,
//!    each step runs a chunk of the request's own `prefill_chunk` (2,048 tokens on a GPU),
//!    so a request arriving meanwhile is admitted at the next chunk boundary.
//!
//! A row under a grammar ([`GenerateParams::constraint`]) does not run ahead: before step
//! 3 queues its next pick, its previous pick is read and committed to the grammar, whose
//! mask for the new pick then goes to the device with the step (docs/engine.md).
//!
//! Each row's generation state and rules (and the steps themselves) are a
//! [`Sequence`] (engine/src/sequence.rs), which [`crate::generate`] drives alone, as a batch
//! of one, in the caller's thread.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cache::{Chain, KvCache, PagedConfig, PagedKvCache, PagedKvRows};
use serde::Serialize;
use store::StoreStats;
use tokio::sync::mpsc as chan;

use crate::chunk_budget::ChunkBudget;
use crate::error::{EngineError, ErrorClass, Result};
use crate::generate::{FinishReason, GenerateParams, Timings};
use crate::model::{Model, ModelInfo};
use crate::pass_memory::DEFAULT_PASS_WORKSPACE;
use crate::prefill_order::PrefillOrder;
use crate::reuse::{HostPrefix, KvTiers, ReuseConfig, ReuseReport};
use crate::sampler::Sampled;
use crate::sequence::{
    check_prompt, context_limit, decode_step, decode_step_mixed, prefill_packed, prompt_room,
    ChunkJob, ChunkRan, Sequence, StepKv,
};
use crate::tokenizer::Tokenizer;

/// Settings of an [`Engine`].
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Most rows decoding together. Default: 8.
    pub max_batch: usize,
    /// Bytes of live KV the admitted requests may reserve together (each reserves its
    /// prompt plus `max_tokens`, capped by the context, in whole blocks). A request that
    /// does not fit waits in the queue; one that alone exceeds the budget is refused.
    /// Default: 2 GiB. [`EngineConfig::NO_KV_BUDGET`]: none (a one-request command
    /// without `--kv-budget`).
    pub kv_budget_bytes: u64,
    /// Requests waiting for admission before [`Engine::submit`] refuses more. Default: 256.
    pub max_queue: usize,
    /// Per-request context limit (prompt + output), capped by the model's. Default: None.
    pub context_limit: Option<usize>,
    /// Most prompt tokens prefilled in one engine step while other rows decode (a request's
    /// own `prefill_chunk` may be smaller). Default: [`crate::default_prefill_chunk`] (2,048
    /// tokens on a GPU, 512 on the CPU).
    pub prefill_chunk: usize,
    /// While rows decode, a step with a prefill chunk may take at most this multiple of a
    /// decode-only step: the chunk (at most `prefill_chunk`) is sized from the engine's
    /// measured step times (engine/src/chunk_budget.rs). `None` always runs the whole
    /// `prefill_chunk`. Default: None (a long prompt's TTFT before the streams' latency, as
    /// vLLM's and SGLang's fixed token budgets; [`SUGGESTED_ITL_STRETCH`] puts the streams
    /// first).
    pub itl_stretch: Option<f64>,
    /// Engine steps kept in [`Engine::step_log`] (the most recent; 0 keeps none). Default: 0.
    pub step_log: usize,
    /// Whether the decode batch may keep its KV in a batch arena (docs/cache.md): `None`
    /// follows `KVSTORE_BATCH_ARENA` (`0` off, `1` on) when set, else off (it lost
    /// throughput serving on the H200: docs/benchmarks.md, session 8). Default: None.
    pub batch_arena: Option<bool>,
    /// Whether a step that decodes rows runs the front prompt's prefill chunk in the same
    /// forward pass (the weights read once, not twice), where the model family has such a
    /// pass (llama, qwen2, qwen3): `None` follows `KVSTORE_MIXED_STEPS` (`0` off, `1` on)
    /// when set, else on where MLX computes on the CPU and off on a GPU (where it did not
    /// pay: docs/server.md, "Mixed steps"). Default: None.
    pub mixed_steps: Option<bool>,
    /// Which admitted prompt is prefilled next: the oldest, or the one with the fewest
    /// tokens left to compute (engine/src/prefill_order.rs). Default: [`PrefillOrder`]'s,
    /// fewest-new.
    pub prefill_order: PrefillOrder,
    /// I/O workers that look up and load queued requests' cached prefixes (with a prefix
    /// cache), each a load at a time, so that a slow load (an SSD read, a remote fetch)
    /// holds back only its own request. Default: [`DEFAULT_IO_WORKERS`].
    pub io_workers: usize,
    /// How long admission waits, at most, for loads that are about to end before a step
    /// with a prompt to prefill starts: a burst's later requests are often still being
    /// looked up (a fraction of a millisecond) when admission passes over them, and would
    /// otherwise wait for the whole prefill step that starts meanwhile instead of joining
    /// it. Only loads of requests submitted within the last five graces are waited for (a
    /// load that takes longer is a disk or network read, which admission passes over).
    /// Default: [`DEFAULT_LOAD_GRACE`]; zero never waits.
    pub load_grace: Duration,
    /// What one prefill pass may hold on a GPU at once: its layers' activations, and their
    /// attention scores where MLX materializes them (no fused attention for the model's
    /// dtype and head size: f32 on CUDA); the pass waits for the device between layers to
    /// stay within it (engine/src/pass_memory.rs). Default: [`DEFAULT_PASS_WORKSPACE`].
    pub pass_workspace: u64,
}

/// [`EngineConfig::load_grace`]'s default: a few lookups' time, small beside a prefill
/// step (tens of milliseconds on a GPU) and beside the decode step it delays.
pub const DEFAULT_LOAD_GRACE: Duration = Duration::from_millis(2);

/// [`EngineConfig::io_workers`]'s default: a few loads at once, as a burst of requests
/// needs; each load also reads its SSD blocks on the store's own readers.
pub const DEFAULT_IO_WORKERS: usize = 4;

impl EngineConfig {
    /// `kv_budget_bytes` of an engine with no KV budget: requests reserve nothing against one,
    /// and [`Engine::open`] has no budget to check against the GPU's memory.
    pub const NO_KV_BUDGET: u64 = u64::MAX;
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            max_batch: 8,
            kv_budget_bytes: 2 << 30,
            max_queue: 256,
            context_limit: None,
            prefill_chunk: crate::model::default_prefill_chunk(),
            itl_stretch: None,
            step_log: 0,
            batch_arena: None,
            mixed_steps: None,
            prefill_order: PrefillOrder::default(),
            io_workers: DEFAULT_IO_WORKERS,
            load_grace: DEFAULT_LOAD_GRACE,
            pass_workspace: DEFAULT_PASS_WORKSPACE,
        }
    }
}

/// An [`EngineConfig::itl_stretch`] that keeps the running streams' steps within 1.5 times
/// their length while a long prompt prefills (what `kvstore bench serve` measures it with).
pub const SUGGESTED_ITL_STRETCH: f64 = 1.5;

/// Why [`Engine::submit`] refused a request.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SubmitError {
    /// The request is invalid (empty or too long prompt, bad sampling parameters).
    #[error(transparent)]
    Invalid(#[from] EngineError),
    /// The admission queue is full.
    #[error("the server is busy: {0} requests are already waiting")]
    QueueFull(usize),
    /// The request alone needs more KV than the engine's budget.
    #[error("the request needs {need} bytes of KV cache; the budget is {budget}")]
    OverBudget {
        /// Bytes the request would reserve.
        need: u64,
        /// The engine's budget.
        budget: u64,
    },
    /// The engine is shutting down.
    #[error("the engine is shutting down")]
    ShuttingDown,
    /// The engine could not take the request: its thread stopped, or a lock was poisoned.
    #[error(transparent)]
    Failed(EngineError),
}

impl SubmitError {
    /// Whose fault the refusal is (see [`ErrorClass`]).
    pub fn class(&self) -> ErrorClass {
        match self {
            SubmitError::Invalid(e) | SubmitError::Failed(e) => e.class(),
            SubmitError::OverBudget { .. } => ErrorClass::Invalid,
            SubmitError::QueueFull(_) | SubmitError::ShuttingDown => ErrorClass::Unavailable,
        }
    }
}

/// A generation request: prompt token ids and how to generate after them.
#[derive(Clone, Debug)]
pub struct Request {
    /// The prompt (for chat, the rendered template's ids).
    pub prompt: Vec<u32>,
    /// Token budget, stop strings, sampling. `prefill_chunk` is honoured per request.
    pub params: GenerateParams,
    /// Requests with different cache salts never share cached blocks (tenants, users);
    /// `None` shares with every other unsalted request. At most
    /// [`MAX_CACHE_SALT_BYTES`](crate::reuse::MAX_CACHE_SALT_BYTES) bytes.
    pub cache_salt: Option<String>,
}

impl Request {
    /// A request for `prompt` without a cache salt.
    pub fn new(prompt: Vec<u32>, params: GenerateParams) -> Self {
        Self {
            prompt,
            params,
            cache_salt: None,
        }
    }
}

/// The final accounting of a request.
#[derive(Clone, Debug, Serialize)]
pub struct Completion {
    /// Why it ended.
    pub finish_reason: FinishReason,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Prompt tokens restored from the prefix cache instead of computed.
    pub cached_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// The whole generated text (without stop strings).
    pub text: String,
    /// The generated token ids (a trailing EOS included; the text stops before a stop
    /// string).
    pub tokens: Vec<u32>,
    /// Seconds waiting in the queue.
    pub queue_s: f64,
    /// Seconds from admission to the first token (restore + prefill + first sample).
    pub ttft_s: f64,
    /// Seconds from submission to the end.
    pub total_s: f64,
    /// The request's timings as [`crate::generate_with_reuse`] reports them: TTFT as the
    /// reuse report counts it (lookup + restore + prefill and first sample: what the
    /// client waited for once admitted; `queue_s` is the wait before), prefill and decode
    /// rates, MLX's peak memory when it ended (the process's peak since start or the last
    /// `mlx::reset_peak_memory`), grammar mask time; `total_s` from submission.
    pub timings: Timings,
    /// What prefix reuse did.
    pub reuse: ReuseReport,
}

/// What a request's stream carries, in order: `Started`, zero or more `Token`s, then
/// `Finished` or `Failed`.
#[derive(Debug)]
#[non_exhaustive]
// `Finished` comes once per request and carries its whole accounting; a `Token` event
// queued in the channel holds the same size, a few hundred bytes, until its reader takes it
// (at once, in every reader here). Boxing the completion would change every match on this
// public enum for that.
#[allow(clippy::large_enum_variant)]
pub enum Event {
    /// The request was admitted and its prompt prefilled.
    Started {
        /// Prompt tokens.
        prompt_tokens: usize,
        /// Prompt tokens restored from the prefix cache.
        cached_tokens: usize,
    },
    /// A generated token and the text that became final with it (may be empty).
    Token {
        /// The token and its log-probabilities (when asked for).
        sampled: Sampled,
        /// Text delta.
        text: String,
    },
    /// The request ended normally or by cancellation.
    Finished(Completion),
    /// The request failed inside the engine.
    Failed(EngineError),
}

/// Cancels a request from any thread; cloning is cheap.
#[derive(Clone, Debug, Default)]
pub struct CancelHandle(Arc<AtomicBool>);

impl CancelHandle {
    /// Asks the engine to stop the request at its next step boundary and free its blocks.
    pub fn cancel(&self) {
        self.0.store(true, Ordering::Relaxed);
    }

    /// Whether cancellation was asked for.
    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

/// A submitted request: its id, its event stream, and its cancellation handle. Dropping
/// the handle cancels the request.
#[derive(Debug)]
pub struct RequestHandle {
    id: u64,
    events: chan::UnboundedReceiver<Event>,
    cancel: CancelHandle,
}

impl RequestHandle {
    /// The engine-wide id of the request.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The next event, waiting on the current thread (not from inside an async runtime);
    /// `None` after the last one.
    pub fn recv_blocking(&mut self) -> Option<Event> {
        self.events.blocking_recv()
    }

    /// The next event; `None` after the last one.
    pub async fn recv(&mut self) -> Option<Event> {
        self.events.recv().await
    }

    /// A handle that cancels this request.
    pub fn cancel_handle(&self) -> CancelHandle {
        self.cancel.clone()
    }

    /// Cancels the request (see [`CancelHandle::cancel`]).
    pub fn cancel(&self) {
        self.cancel.cancel();
    }

    /// Reads events until the end and returns the completion (tokens are discarded).
    pub fn wait(mut self) -> Result<Completion> {
        while let Some(e) = self.recv_blocking() {
            match e {
                Event::Finished(c) => return Ok(c),
                Event::Failed(e) => return Err(e),
                _ => {}
            }
        }
        Err(engine_gone())
    }
}

impl Drop for RequestHandle {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

fn engine_gone() -> EngineError {
    EngineError::EngineStopped
}

/// TTFT histogram bucket bounds, in seconds (Prometheus `le`).
pub const TTFT_BUCKETS: [f64; 12] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// Counters of an engine (monotonic unless named a gauge).
#[derive(Debug, Default)]
struct Counters {
    submitted: AtomicU64,
    finished_stop: AtomicU64,
    finished_length: AtomicU64,
    cancelled: AtomicU64,
    failed: AtomicU64,
    prompt_tokens: AtomicU64,
    cached_tokens: AtomicU64,
    cached_device_tokens: AtomicU64,
    cached_ram_tokens: AtomicU64,
    cached_ssd_tokens: AtomicU64,
    cached_remote_tokens: AtomicU64,
    generated_tokens: AtomicU64,
    decode_steps: AtomicU64,
    decode_rows: AtomicU64,
    queue_depth: AtomicU64,
    active_rows: AtomicU64,
    kv_reserved_bytes: AtomicU64,
    kv_device_peak_bytes: AtomicU64,
    batch_arena_steps: AtomicU64,
    early_loads: AtomicU64,
    loads_not_waited: AtomicU64,
    ttft_buckets: [AtomicU64; TTFT_BUCKETS.len()],
    ttft_count: AtomicU64,
    ttft_sum_us: AtomicU64,
}

/// A snapshot of an engine's counters and gauges.
#[derive(Clone, Debug, Default, Serialize)]
pub struct EngineMetrics {
    /// Requests accepted by [`Engine::submit`].
    pub requests_submitted: u64,
    /// Requests that ended at EOS or a stop string.
    pub requests_finished_stop: u64,
    /// Requests that ended at their token budget or the context.
    pub requests_finished_length: u64,
    /// Requests cancelled (by a handle, a dropped receiver or shutdown).
    pub requests_cancelled: u64,
    /// Requests that failed inside the engine.
    pub requests_failed: u64,
    /// Prompt tokens of admitted requests.
    pub prompt_tokens: u64,
    /// Of those, restored from the prefix cache.
    pub cached_tokens: u64,
    /// Of those, found resident on the device (the device tier).
    pub cached_device_tokens: u64,
    /// Of those, from the RAM tier.
    pub cached_ram_tokens: u64,
    /// Of those, from the SSD tier.
    pub cached_ssd_tokens: u64,
    /// Of those, fetched from the remote tier.
    pub cached_remote_tokens: u64,
    /// Tokens generated.
    pub generated_tokens: u64,
    /// Batched decode steps run.
    pub decode_steps: u64,
    /// Rows over all decode steps (divide by steps for the mean batch).
    pub decode_rows: u64,
    /// Gauge: requests waiting for admission.
    pub queue_depth: u64,
    /// Gauge: rows decoding now.
    pub active_rows: u64,
    /// Gauge: KV bytes reserved by admitted requests.
    pub kv_reserved_bytes: u64,
    /// The most device KV bytes the engine held after any step: the decoding batch (its
    /// batch arena and its rows' caches), the caches of requests being prefilled, and the
    /// resident sequences of the device tier (not MLX's buffer cache, nor a step's
    /// transient copies).
    pub kv_device_peak_bytes: u64,
    /// Decode steps whose rows attended in a batch arena.
    pub batch_arena_steps: u64,
    /// Requests whose cached-prefix lookup and load the I/O workers started at submission
    /// (the queue was short), rather than once they neared the head of the queue.
    pub early_loads: u64,
    /// Requests admitted while their I/O worker's lookup was still running, because the
    /// store held nothing past the device tier's match (nothing it could have loaded).
    pub loads_not_waited: u64,
    /// TTFT histogram: cumulative counts per bucket of [`TTFT_BUCKETS`].
    pub ttft_buckets: Vec<u64>,
    /// TTFT observations.
    pub ttft_count: u64,
    /// Sum of TTFT, seconds.
    pub ttft_sum_s: f64,
}

enum Command {
    Submit(Box<Pending>),
    Shutdown {
        cancel: bool,
    },
    Fault(InjectedFault),
    /// Export what an exclusive device tier holds resident, then answer.
    ExportResident(std::sync::mpsc::Sender<()>),
}

/// A failure [`Engine::inject_fault`] makes happen. Not a stable API.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum InjectedFault {
    /// The next batched decode step fails (as when MLX raises an error).
    FailNextStep,
    /// The engine thread panics when it reads this command.
    PanicEngineThread,
    /// The next prefill chunk fails with an error whose type reads like a bad argument
    /// (as the model's checks on its inputs would raise on an engine bug).
    FailNextPrefill,
}

struct Pending {
    id: u64,
    request: Request,
    tx: chan::UnboundedSender<Event>,
    cancel: CancelHandle,
    submitted: Instant,
    reserve: u64,
    prefetch: Prefetch,
    /// How long admission has waited for its load (an idle engine with nothing else ready
    /// does): billed to its restore, not its queue.
    load_waited: std::time::Duration,
    /// Whether admission has asked, while its load ran, if the store could add anything
    /// (once: see [`KvTiers::host_half_if_empty`]).
    host_checked: bool,
}

/// The host half of a queued request's restore, loaded by the I/O workers.
enum Prefetch {
    /// No prefix cache, or the I/O workers are gone: the engine loads at admission.
    None,
    /// Not asked for yet (the request is far from the head of the queue).
    NotYet,
    /// Being loaded; the flag abandons the load (admission took the request without it).
    Waiting(mpsc::Receiver<Result<HostPrefix>>, Arc<AtomicBool>),
    /// Loaded (`None`: it failed; the engine loads again at admission, and reports why).
    Ready(Option<HostPrefix>),
}

impl Prefetch {
    /// Whether the load is over; with `block`, waits for it.
    fn ready(&mut self, block: bool) -> bool {
        let Prefetch::Waiting(rx, _) = self else {
            return true;
        };
        let got = if block {
            rx.recv().ok()
        } else {
            match rx.try_recv() {
                Ok(r) => Some(r),
                Err(mpsc::TryRecvError::Empty) => return false,
                Err(mpsc::TryRecvError::Disconnected) => None,
            }
        };
        *self = Prefetch::Ready(got.and_then(|r| r.ok()));
        true
    }

    fn take(&mut self) -> Option<HostPrefix> {
        match std::mem::replace(self, Prefetch::None) {
            Prefetch::Ready(h) => h,
            _ => None,
        }
    }
}

/// A job of the I/O workers: look up and load a queued request's cached prefix from the
/// store (RAM, SSD, remote), so that the engine thread never waits on disk or network
/// while other rows decode.
struct IoJob {
    salt: Option<String>,
    prompt: Vec<u32>,
    reply: mpsc::SyncSender<Result<HostPrefix>>,
    /// Set when admission took the request without this load: the worker then reads
    /// nothing more (a read counts as a use in the store's tiers).
    abandoned: Arc<AtomicBool>,
}

/// How many requests at the head of the queue have their cached prefix loaded ahead of
/// admission: two batches' worth (loaded host blocks stay in memory until admission, so a
/// long queue must not pin them all).
fn prefetch_depth(config: &EngineConfig) -> usize {
    2 * config.max_batch
}

/// [`KvTiers::host_half_if_empty`] for `request` (`None` on any error: the I/O worker's
/// answer then decides).
fn empty_host_half(prefix: &KvTiers, request: &Request) -> Option<HostPrefix> {
    let ns = prefix.namespace_for(request.cache_salt.as_deref()).ok()?;
    prefix
        .host_half_if_empty(ns, &request.prompt)
        .ok()
        .flatten()
}

/// Hands `request`'s lookup and load to the I/O workers: [`Prefetch::Waiting`] for its
/// answer, `None` when the thread is gone.
fn send_load(io: &mpsc::Sender<IoJob>, request: &Request) -> Option<Prefetch> {
    let (reply, done) = mpsc::sync_channel(1);
    let abandoned = Arc::new(AtomicBool::new(false));
    let job = IoJob {
        salt: request.cache_salt.clone(),
        prompt: request.prompt.clone(),
        reply,
        abandoned: abandoned.clone(),
    };
    io.send(job)
        .ok()
        .map(|()| Prefetch::Waiting(done, abandoned))
}

/// Counts what can let an idle engine admit a request whose load held it back: a load the
/// I/O workers finished (answered, failed or abandoned) and a command sent to the engine
/// (a submission, a shutdown). An idle engine whose admissible requests are all still
/// loading sleeps until the count moves.
#[derive(Debug, Default)]
struct Wakeups {
    count: Mutex<u64>,
    changed: std::sync::Condvar,
}

impl Wakeups {
    fn lock(&self) -> std::sync::MutexGuard<'_, u64> {
        self.count.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Events so far.
    fn count(&self) -> u64 {
        *self.lock()
    }

    /// Counts one event and wakes the engine if it sleeps.
    fn signal(&self) {
        *self.lock() += 1;
        self.changed.notify_all();
    }

    /// Waits until more than `seen` events have happened.
    fn wait_past(&self, seen: u64) {
        let mut n = self.lock();
        while *n <= seen {
            n = self.changed.wait(n).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// [`Self::wait_past`] until `deadline` at most; whether an event came.
    fn wait_past_until(&self, seen: u64, deadline: Instant) -> bool {
        let mut n = self.lock();
        while *n <= seen {
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                return false;
            };
            n = match self.changed.wait_timeout(n, left) {
                Ok((n, _)) => n,
                Err(e) => e.into_inner().0,
            };
        }
        true
    }
}

/// Counts a load as finished when dropped: after its answer is sent, or when its worker
/// unwinds (the answer's sender is dropped first, so a woken engine sees the load over).
struct LoadFinished<'a>(&'a Wakeups);

impl Drop for LoadFinished<'_> {
    fn drop(&mut self) {
        self.0.signal();
    }
}

/// An I/O worker's loop: takes the next job (in submission order) and runs it; the
/// workers share the queue, so while one waits on a slow load the others take the jobs
/// behind it. Ends when the engine drops the sending side.
fn io_loop(prefix: Arc<KvTiers>, jobs: Arc<Mutex<mpsc::Receiver<IoJob>>>, done: Arc<Wakeups>) {
    loop {
        let next = match jobs.lock() {
            Ok(rx) => rx.recv(),
            Err(_) => return,
        };
        let Ok(next) = next else {
            return;
        };
        // Declared after the counter, so dropped before it (also when unwinding).
        let _finished = LoadFinished(&done);
        let job = next;
        let result = prefix
            .namespace_for(job.salt.as_deref())
            .and_then(|ns| prefix.load_host(ns, &job.prompt, &job.abandoned));
        let _ = job.reply.send(result);
        drop(job);
    }
}

/// The I/O workers of an engine with a prefix cache: their job queue, their threads, and
/// the wake-ups they signal as their loads end.
struct IoWorkers {
    jobs: mpsc::Sender<IoJob>,
    threads: Vec<JoinHandle<()>>,
    done: Arc<Wakeups>,
}

/// Starts `workers` (at least one) I/O workers over one job queue.
fn spawn_io(prefix: &Arc<KvTiers>, workers: usize) -> Result<IoWorkers> {
    let (tx, rx) = mpsc::channel();
    let rx = Arc::new(Mutex::new(rx));
    let done = Arc::new(Wakeups::default());
    let mut threads = Vec::with_capacity(workers.max(1));
    for i in 0..workers.max(1) {
        let (pc, rx, done) = (prefix.clone(), rx.clone(), done.clone());
        let thread = std::thread::Builder::new()
            .name(format!("kvstore-io-{i}"))
            .spawn(move || io_loop(pc, rx, done))
            .map_err(|e| EngineError::io("kvstore-io thread", e))?;
        threads.push(thread);
    }
    Ok(IoWorkers {
        jobs: tx,
        threads,
        done,
    })
}

/// What one engine step computed (see [`EngineConfig::step_log`]).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct StepRecord {
    /// Requests whose rows ran in the step's batched decode (empty: no decode).
    pub decoded: Vec<u64>,
    /// The request prefilled in the step and how many prompt tokens it ran.
    pub prefilled: Option<(u64, usize)>,
    /// Requests whose whole remaining prompt ran in the same forward pass after
    /// `prefilled`'s chunk, within the step's prefill budget (the decode pass with mixed
    /// steps, else the step's prefill pass), and their token counts.
    pub riders: Vec<(u64, usize)>,
    /// Microseconds the engine thread spent queueing the batched decode step (building
    /// its graph and handing it to the device).
    pub launch_us: u64,
    /// Microseconds of the engine thread's own CPU time within `launch_us`; the rest of
    /// it the thread waited (for the device, a lock, a core).
    pub launch_cpu_us: u64,
    /// Microseconds of `launch_us` spent building the decode step's graph; the rest waited
    /// for the previous step as the step wait says and handed the graph to MLX (which
    /// encodes every kernel on this thread).
    pub build_us: u64,
    /// Microseconds spent reading the previous step's picks (waiting for the device),
    /// emitting them and retiring finished rows.
    pub emit_us: u64,
    /// Microseconds spent on the step's prefill chunk.
    pub prefill_us: u64,
    /// Microseconds spent admitting requests (restoring their cached prefixes included).
    pub admit_us: u64,
    /// Microseconds of the engine thread's own CPU time within `admit_us`; the rest of it
    /// the thread waited (for a load within the grace, a lock, the device, a core).
    pub admit_cpu_us: u64,
    /// Microseconds of `admit_us` inside the admissions themselves: checking each prompt,
    /// taking its device-tier hit (a hand-over, share or fork), restoring its host blocks
    /// and making its cache; the rest went to passing over the queue and waiting for loads.
    pub begin_us: u64,
    /// Microseconds spent publishing blocks to the prefix cache (taking device copies of
    /// new full blocks and handing them to the export thread, waiting when it is behind)
    /// and parking finished sequences on the device.
    pub publish_us: u64,
    /// Whether admission met a queued request whose cached prefix the I/O workers were
    /// still loading while a batch slot and the budget were free (it kept its place; ready
    /// requests behind it were admitted past it).
    pub admit_waited_load: bool,
    /// Microseconds of the whole step: taking commands, admission, the parts above and the
    /// bookkeeping after them (not the wait for work while the engine is idle).
    pub step_us: u64,
    /// Each prompt of the step's shared prefill pass (the chunk and its riders, in the
    /// decode pass or a pass of their own) and the microseconds of the pass charged to its
    /// prefill time: its tokens' share. Empty when no such pass ran.
    pub prefill_charged_us: Vec<(u64, u64)>,
    /// Microseconds from the engine's start ([`Engine::started`]) to the step's start.
    pub started_us: u64,
}

struct Shared {
    /// When the engine was made: the origin of [`StepRecord::started_us`].
    started: Instant,
    counters: Counters,
    accepting: AtomicBool,
    steps: Mutex<VecDeque<StepRecord>>,
}

/// The engine: a model on its own thread, continuous batching, prefix reuse. See the
/// module docs for the loop; docs/library.md for an example.
pub struct Engine {
    tx: Mutex<mpsc::Sender<Command>>,
    /// The I/O workers' queue (with a prefix cache), for [`Engine::submit`] to start a
    /// request's lookup and load at once; taken before the engine thread is stopped, which
    /// then ends the I/O workers.
    io: Mutex<Option<mpsc::Sender<IoJob>>>,
    /// Signalled with every command sent, so an engine sleeping on its loads wakes for it.
    wakeups: Option<Arc<Wakeups>>,
    /// The engine thread; it hands the model back when it ends.
    thread: Mutex<Option<JoinHandle<Model>>>,
    shared: Arc<Shared>,
    tokenizer: Arc<Tokenizer>,
    info: ModelInfo,
    prefix: Option<Arc<KvTiers>>,
    config: EngineConfig,
    bytes_per_token: u64,
    block_size: usize,
    next_id: AtomicU64,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("info", &self.info)
            .field("config", &self.config)
            .field("prefix_cache", &self.prefix.is_some())
            .finish()
    }
}

impl Engine {
    /// Starts the engine thread with `model` and, when given, prefix reuse through `prefix`.
    pub fn open(
        model: Model,
        tokenizer: Tokenizer,
        prefix: Option<KvTiers>,
        config: EngineConfig,
    ) -> Result<Engine> {
        if config.max_batch == 0 {
            return Err(EngineError::InvalidParameter {
                name: "max_batch",
                message: "must be at least 1".into(),
            });
        }
        let info = model.info().clone();
        let kv = info.kv;
        let paged = match &prefix {
            Some(p) => p.paged_config(),
            None => {
                let d = ReuseConfig::default();
                PagedConfig {
                    block_size: d.block_size,
                    format: d.kv_format,
                    initial_blocks: 16,
                    max_blocks: d.max_blocks,
                }
            }
        };
        // The reservation counts the KV format (float, kv8, kv4), like the arenas it bounds.
        let bytes_per_token = (kv.layers
            * 2
            * kv.kv_heads
            * paged
                .format
                .bytes_per_head_token(kv.head_dim, kv.dtype.size()))
            as u64;
        // Tiers handed back by an earlier engine ([`Engine::close`]) keep what is resident
        // when the budget stays: resizing empties the device tier.
        if let Some(p) = &prefix {
            if p.resident_stats().budget_bytes != config.kv_budget_bytes {
                p.set_kv_budget(config.kv_budget_bytes)?;
            }
        }
        let tokenizer = Arc::new(tokenizer);
        let prefix = prefix.map(Arc::new);
        if config.prefill_chunk == 0 {
            return Err(EngineError::InvalidParameter {
                name: "prefill_chunk",
                message: "must be at least 1".into(),
            });
        }
        if let Some(x) = config.itl_stretch.filter(|x| !(x.is_finite() && *x > 1.0)) {
            return Err(EngineError::InvalidParameter {
                name: "itl_stretch",
                message: format!("{x} is not a multiple above 1 (leave it unset for no budget)"),
            });
        }
        if mlx::default_device()? == mlx::Device::Gpu {
            if let Some(total) = mlx::device_memory_size()? {
                // What is live now besides the KV a reopened device tier still holds (inside
                // the budget already): the weights.
                let resident = prefix
                    .as_ref()
                    .map_or(0, |p| p.resident_stats().resident_buffer_bytes);
                crate::device_memory::check_fits(
                    total,
                    (mlx::active_memory()? as u64).saturating_sub(resident),
                    config.kv_budget_bytes,
                    config.pass_workspace,
                )
                .map_err(|message| EngineError::InvalidParameter {
                    name: "kv_budget",
                    message,
                })?;
            }
        }
        model.set_pass_workspace(config.pass_workspace);
        let shared = Arc::new(Shared {
            started: Instant::now(),
            counters: Counters::default(),
            accepting: AtomicBool::new(true),
            steps: Mutex::new(VecDeque::new()),
        });
        let (tx, rx) = mpsc::channel();
        // The I/O workers (with a prefix cache) end when the engine drops its senders.
        let (io, io_threads, wakeups) = match &prefix {
            Some(pc) => {
                let w = spawn_io(pc, config.io_workers)?;
                (Some(w.jobs), w.threads, Some(w.done))
            }
            None => (None, Vec::new(), None),
        };
        let engine_io = io.clone();
        let engine_wakeups = wakeups.clone();
        let mut worker = Worker {
            io,
            io_threads,
            wakeups,
            model,
            tokenizer: tokenizer.clone(),
            prefix: prefix.clone(),
            shared: shared.clone(),
            config: config.clone(),
            paged,
            bytes_per_token,
            rx,
            queue: VecDeque::new(),
            rows: new_rows(&config)?,
            active: Vec::new(),
            prefilling: VecDeque::new(),
            reserved: 0,
            arena_charged: 0,
            draining: None,
            fail_next_step: false,
            fail_next_prefill: false,
            chunk_budget: ChunkBudget::new(config.itl_stretch),
            chunk_cached: 0,
            mixed_steps: mixed_steps(&config),
            built_us: 0,
            published_us: 0,
            charged_us: Vec::new(),
            admit_waited_load: false,
            begin_time: Duration::ZERO,
            steps: 0,
        };
        let thread = std::thread::Builder::new()
            .name("kvstore-engine".into())
            .spawn(move || {
                worker.run();
                worker.stop_io();
                worker.model
            })
            .map_err(|e| EngineError::io("kvstore-engine thread", e))?;
        Ok(Engine {
            tx: Mutex::new(tx),
            io: Mutex::new(engine_io),
            wakeups: engine_wakeups,
            thread: Mutex::new(Some(thread)),
            shared,
            tokenizer,
            info,
            prefix,
            config,
            bytes_per_token,
            block_size: paged.block_size,
            next_id: AtomicU64::new(1),
        })
    }

    /// The model's tokenizer and chat template.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The model's family, sizes and KV layout.
    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    /// The settings.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// The context a request may fill (prompt + output).
    pub fn context_limit(&self) -> usize {
        self.config
            .context_limit
            .unwrap_or(usize::MAX)
            .min(self.info.max_position_embeddings)
    }

    /// When the engine was made: its step log's [`StepRecord::started_us`] count from here.
    pub fn started(&self) -> Instant {
        self.shared.started
    }

    /// The most recent engine steps, oldest first (kept when [`EngineConfig::step_log`] is
    /// set): which rows decoded and how many prompt tokens were prefilled in each.
    pub fn step_log(&self) -> Vec<StepRecord> {
        match self.shared.steps.lock() {
            Ok(s) => s.iter().cloned().collect(),
            Err(e) => e.into_inner().iter().cloned().collect(),
        }
    }

    /// The prefix cache, when the engine has one.
    pub fn kv_tiers(&self) -> Option<&KvTiers> {
        self.prefix.as_deref()
    }

    /// Bytes of KV a request with this prompt length and token budget reserves.
    pub fn reservation(&self, prompt_tokens: usize, max_tokens: usize) -> u64 {
        let tokens = (prompt_tokens + max_tokens).min(self.context_limit());
        let bs = self.block_size.max(1);
        (tokens.div_ceil(bs) * bs) as u64 * self.bytes_per_token
    }

    /// Queues a request. Its events arrive on the returned handle; dropping the handle
    /// cancels it.
    pub fn submit(&self, request: Request) -> std::result::Result<RequestHandle, SubmitError> {
        if !self.shared.accepting.load(Ordering::SeqCst) {
            return Err(SubmitError::ShuttingDown);
        }
        request.params.sampling.validate()?;
        if let Some(salt) = &request.cache_salt {
            crate::reuse::check_cache_salt(salt)?;
        }
        let context = self.context_limit();
        let prompt = &request.prompt;
        if prompt.is_empty() {
            return Err(EngineError::InvalidParameter {
                name: "prompt",
                message: "the prompt is empty".into(),
            }
            .into());
        }
        if prompt.len() >= context {
            return Err(EngineError::PromptTooLong {
                prompt: prompt.len(),
                context,
            }
            .into());
        }
        if let Some(&id) = prompt.iter().find(|&&t| t as usize >= self.info.vocab_size) {
            return Err(EngineError::TokenOutOfRange {
                id,
                vocab: self.info.vocab_size,
            }
            .into());
        }
        let reserve = self.reservation(prompt.len(), request.params.max_tokens);
        if reserve > self.config.kv_budget_bytes {
            return Err(SubmitError::OverBudget {
                need: reserve,
                budget: self.config.kv_budget_bytes,
            });
        }
        let c = &self.shared.counters;
        if c.queue_depth.load(Ordering::Relaxed) as usize >= self.config.max_queue {
            return Err(SubmitError::QueueFull(self.config.max_queue));
        }
        let (tx, rx) = chan::unbounded_channel();
        let cancel = CancelHandle::default();
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        // The request's cached prefix is looked up and loaded by the I/O workers from now,
        // while the engine runs its current step, when the queue is short; behind a long
        // queue the engine asks for it once the request nears the head (see
        // `Worker::prefetch`), so that waiting requests do not all hold loaded blocks.
        let prefetch = match self.prefix {
            Some(_)
                if (c.queue_depth.load(Ordering::Relaxed) as usize)
                    < prefetch_depth(&self.config) =>
            {
                self.start_load(&request)
            }
            Some(_) => Prefetch::NotYet,
            None => Prefetch::None,
        };
        let pending = Pending {
            id,
            request,
            tx,
            cancel: cancel.clone(),
            submitted: Instant::now(),
            reserve,
            prefetch,
            load_waited: std::time::Duration::ZERO,
            host_checked: false,
        };
        c.queue_depth.fetch_add(1, Ordering::Relaxed);
        let sent = self.send(Command::Submit(Box::new(pending)));
        if let Err(e) = sent {
            c.queue_depth.fetch_sub(1, Ordering::Relaxed);
            // A shutdown ends the thread on purpose; anything else is the engine's failure.
            return Err(if self.is_accepting() {
                SubmitError::Failed(e)
            } else {
                SubmitError::ShuttingDown
            });
        }
        c.submitted.fetch_add(1, Ordering::Relaxed);
        Ok(RequestHandle {
            id,
            events: rx,
            cancel,
        })
    }

    /// Hands `request`'s lookup and load to the I/O workers ([`Prefetch::NotYet`] when it is
    /// gone: the engine asks again later, or loads at admission).
    fn start_load(&self, request: &Request) -> Prefetch {
        let Ok(io) = self.io.lock() else {
            return Prefetch::NotYet;
        };
        let Some(io) = io.as_ref() else {
            return Prefetch::NotYet;
        };
        match send_load(io, request) {
            Some(waiting) => {
                self.shared
                    .counters
                    .early_loads
                    .fetch_add(1, Ordering::Relaxed);
                waiting
            }
            None => Prefetch::NotYet,
        }
    }

    /// Stops handing loads to the I/O workers, so that they end with the engine thread.
    fn close_io(&self) {
        if let Ok(mut io) = self.io.lock() {
            io.take();
        }
    }

    /// A snapshot of the counters.
    pub fn metrics(&self) -> EngineMetrics {
        let c = &self.shared.counters;
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        EngineMetrics {
            requests_submitted: g(&c.submitted),
            requests_finished_stop: g(&c.finished_stop),
            requests_finished_length: g(&c.finished_length),
            requests_cancelled: g(&c.cancelled),
            requests_failed: g(&c.failed),
            prompt_tokens: g(&c.prompt_tokens),
            cached_tokens: g(&c.cached_tokens),
            cached_device_tokens: g(&c.cached_device_tokens),
            cached_ram_tokens: g(&c.cached_ram_tokens),
            cached_ssd_tokens: g(&c.cached_ssd_tokens),
            cached_remote_tokens: g(&c.cached_remote_tokens),
            generated_tokens: g(&c.generated_tokens),
            decode_steps: g(&c.decode_steps),
            decode_rows: g(&c.decode_rows),
            queue_depth: g(&c.queue_depth),
            active_rows: g(&c.active_rows),
            kv_reserved_bytes: g(&c.kv_reserved_bytes),
            kv_device_peak_bytes: g(&c.kv_device_peak_bytes),
            batch_arena_steps: g(&c.batch_arena_steps),
            early_loads: g(&c.early_loads),
            loads_not_waited: g(&c.loads_not_waited),
            ttft_buckets: c.ttft_buckets.iter().map(g).collect(),
            ttft_count: g(&c.ttft_count),
            ttft_sum_s: g(&c.ttft_sum_us) as f64 / 1e6,
        }
    }

    /// The block store's counters, when the engine has a prefix cache.
    pub fn cache_stats(&self) -> Option<StoreStats> {
        self.prefix.as_ref().map(|p| p.stats())
    }

    /// Makes every published block durable; returns once it is (no-op without a cache).
    /// An exclusive device tier's resident sequences are exported first, by the engine
    /// thread while it runs (their device copies are MLX work), else here.
    pub fn flush(&self) -> Result<()> {
        let Some(p) = &self.prefix else {
            return Ok(());
        };
        if p.is_exclusive() {
            let (tx, rx) = std::sync::mpsc::channel();
            let sent = self.is_running() && self.send(Command::ExportResident(tx)).is_ok();
            // No answer: the engine thread ended (or never took it); no MLX work runs now.
            if !sent || rx.recv().is_err() {
                p.export_resident()?;
            }
        }
        p.flush_published()
    }

    /// Refuses new submissions from now on ([`SubmitError::ShuttingDown`]) while queued and
    /// running requests go on; [`Engine::shutdown`] then finishes or cancels them.
    pub fn stop_accepting(&self) {
        self.shared.accepting.store(false, Ordering::SeqCst);
    }

    /// Whether [`Engine::submit`] still accepts requests.
    pub fn is_accepting(&self) -> bool {
        self.shared.accepting.load(Ordering::SeqCst)
    }

    /// Whether the engine thread is running (false once it ended: after
    /// [`Engine::shutdown`], or when it panicked).
    pub fn is_running(&self) -> bool {
        self.thread
            .lock()
            .is_ok_and(|t| t.as_ref().is_some_and(|t| !t.is_finished()))
    }

    /// Makes the running engine fail as a bug or a device error would, so tests can check
    /// what clients are told. Not a stable API.
    #[doc(hidden)]
    pub fn inject_fault(&self, fault: InjectedFault) {
        let _ = self.send(Command::Fault(fault));
    }

    /// Sends `cmd` to the engine thread and wakes it where it sleeps waiting for loads.
    fn send(&self, cmd: Command) -> Result<()> {
        let sent = match self.tx.lock() {
            Ok(tx) => tx.send(cmd).map_err(|_| engine_gone()),
            Err(_) => Err(EngineError::Poisoned("submission")),
        };
        if let Some(w) = &self.wakeups {
            w.signal();
        }
        sent
    }

    /// Stops accepting requests, then either finishes (`cancel = false`) or cancels every
    /// queued and running request, waits for the engine thread, and flushes the store.
    /// Calling it again is a no-op.
    pub fn shutdown(&self, cancel: bool) -> Result<()> {
        self.stop(cancel);
        self.flush()
    }

    /// Finishes every queued and running request and stops the engine as
    /// [`Engine::shutdown`] does, but lets the tiers go without flushing the store: blocks
    /// only in RAM are not written to the SSD (those already queued for it are). For a
    /// scratch store, where the flush is only time (`bench trace --no-flush`).
    pub fn close_without_flush(mut self) {
        self.stop(false);
        // The worker and its I/O workers have ended; the tiers drop with the last share.
        self.prefix = None;
    }

    /// Stops accepting requests, finishes or cancels them, and waits for the engine thread.
    fn stop(&self, cancel: bool) {
        self.shared.accepting.store(false, Ordering::SeqCst);
        self.close_io();
        let _ = self.send(Command::Shutdown { cancel });
        let thread = self.thread.lock().ok().and_then(|mut t| t.take());
        if let Some(t) = thread {
            let _ = t.join();
        }
    }

    /// Finishes every queued and running request ([`Engine::shutdown`] without
    /// cancelling), then hands back the model, the tokenizer and the tiers, so that another
    /// engine can open on them without loading the model again (a benchmark's next arm, a
    /// command's next phase). Fails with [`EngineError::EngineStopped`] when the engine
    /// thread had panicked (the model went with it).
    pub fn close(mut self) -> Result<(Model, Tokenizer, Option<KvTiers>)> {
        self.shared.accepting.store(false, Ordering::SeqCst);
        self.close_io();
        let _ = self.send(Command::Shutdown { cancel: false });
        let thread = self.thread.lock().ok().and_then(|mut t| t.take());
        let model = thread
            .ok_or(EngineError::EngineStopped)?
            .join()
            .map_err(|_| EngineError::EngineStopped)?;
        self.flush()?;
        // The worker and its I/O workers have ended and dropped their shares; the engine's
        // own go with it (its `Drop` then finds nothing left to stop or flush).
        let tiers = self.prefix.take();
        let tokenizer = self.tokenizer.clone();
        drop(self);
        let tokenizer = Arc::try_unwrap(tokenizer).map_err(|_| EngineError::EngineStopped)?;
        let tiers = match tiers {
            Some(t) => Some(Arc::try_unwrap(t).map_err(|_| EngineError::EngineStopped)?),
            None => None,
        };
        Ok((model, tokenizer, tiers))
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        let _ = self.shutdown(true);
    }
}

/// A row of the batch: one admitted request. Its generation state (picks in flight, tokens,
/// text, limits, timings) is its [`Sequence`]; the rest is the engine's bookkeeping.
struct Row {
    seq: Sequence,
    id: u64,
    tx: chan::UnboundedSender<Event>,
    cancel: CancelHandle,
    reserve: u64,
    submitted: Instant,
    queue_s: f64,
    report: ReuseReport,
    /// The row's chain keys in its namespace (with a prefix cache): derived at admission,
    /// extended as its blocks are published.
    chain: Option<Chain>,
}

/// An admitted request whose prompt is being prefilled, a chunk per engine step.
struct Prefilling {
    p: Pending,
    seq: Sequence,
    queue_s: f64,
    cache: PagedKvCache,
    chain: Option<Chain>,
    report: ReuseReport,
    /// The engine step it was admitted at ([`PrefillOrder::next`] counts its wait).
    admitted_step: u64,
}

struct Worker {
    /// Jobs for the I/O workers, with a prefix cache.
    io: Option<mpsc::Sender<IoJob>>,
    /// The I/O workers, joined when the worker ends ([`Worker::stop_io`]).
    io_threads: Vec<JoinHandle<()>>,
    /// Their finished loads and the commands sent (with a prefix cache): what an idle
    /// engine waiting for loads sleeps on.
    wakeups: Option<Arc<Wakeups>>,
    model: Model,
    tokenizer: Arc<Tokenizer>,
    prefix: Option<Arc<KvTiers>>,
    shared: Arc<Shared>,
    config: EngineConfig,
    paged: PagedConfig,
    /// KV bytes of one token in the cache's format (what a reservation counts per token).
    bytes_per_token: u64,
    rx: mpsc::Receiver<Command>,
    queue: VecDeque<Pending>,
    rows: PagedKvRows,
    active: Vec<Row>,
    /// Admitted requests still prefilling, in admission order but for the one the prefill
    /// order brought to the front; one chunk per engine step.
    prefilling: VecDeque<Prefilling>,
    reserved: u64,
    /// Bytes of the batch arena beyond its rows' reservations, charged to the device
    /// tier's live bytes ([`Worker::charge_arena`]).
    arena_charged: u64,
    /// Set by a shutdown command: whether to cancel what is left.
    draining: Option<bool>,
    /// Set by [`InjectedFault::FailNextStep`].
    fail_next_step: bool,
    /// Set by [`InjectedFault::FailNextPrefill`].
    fail_next_prefill: bool,
    /// How many prompt tokens a step prefills while rows decode.
    chunk_budget: ChunkBudget,
    /// Tokens the request prefilled in this step held before its chunk.
    chunk_cached: usize,
    /// [`EngineConfig::mixed_steps`] as the environment resolved it.
    mixed_steps: bool,
    /// What building the last queued decode step's graph took, in microseconds, for its
    /// [`StepRecord`].
    built_us: u64,
    /// Publication time in this step so far, microseconds, for its [`StepRecord`].
    published_us: u64,
    /// The current step's prefill-pass charges (see [`StepRecord::prefill_charged_us`]).
    charged_us: Vec<(u64, u64)>,
    /// Set when admission met a request whose prefix was still loading.
    admit_waited_load: bool,
    /// Time inside [`Self::begin`] in this step so far, for its [`StepRecord::begin_us`].
    begin_time: Duration,
    /// Engine steps run so far.
    steps: u64,
}

/// A prefill chunk that ran inside the step's decode pass: the request (out of the
/// prefilling queue until the step is over), the tokens it ran and, when it ended the
/// prompt, its last logits. A step runs the front prompt's chunk first, then its riders.
struct MixedChunk {
    r: Prefilling,
    tokens: usize,
    logits: Option<mlx::Array>,
}

/// The chunk jobs of prompts [`Worker::take_chunks`] took: the front's next chunk within
/// `max_chunk`, each rider's whole rest (within the pass's `ceiling`).
fn chunk_jobs(
    taken: &mut [(usize, Prefilling)],
    max_chunk: usize,
    ceiling: usize,
) -> Vec<ChunkJob<'_>> {
    taken
        .iter_mut()
        .enumerate()
        .map(|(k, (_, r))| ChunkJob {
            seq: &mut r.seq,
            cache: &mut r.cache,
            max_chunk: if k == 0 { max_chunk } else { ceiling },
        })
        .collect()
}

/// Each taken prompt with what its chunk ran.
fn mixed_chunks(taken: Vec<(usize, Prefilling)>, parts: Vec<ChunkRan>) -> Vec<MixedChunk> {
    taken
        .into_iter()
        .zip(parts)
        .map(|((_, r), (tokens, logits))| MixedChunk { r, tokens, logits })
        .collect()
}

impl Worker {
    fn run(&mut self) {
        // Restores run on this thread: pay their one-off set-up now, not in a request's
        // TTFT (and measure the import's prior on the path it will take); then measure the
        // prefill's fixed and per-token cost as its estimate's prior.
        if let Some(prefix) = &self.prefix {
            if let Err(e) = prefix.warm_restore() {
                tracing::warn!(error = %e, "warming the restore path failed");
            }
            if let Err(e) = crate::warm_up::warm_prefill(&self.model, prefix) {
                tracing::warn!(error = %e, "measuring the prefill's cost failed");
            }
        }
        let mut open = true;
        loop {
            let mut top = Instant::now();
            // 1. Take submissions: wait when there is nothing to do.
            if open && self.active.is_empty() && self.prefilling.is_empty() && self.queue.is_empty()
            {
                if self.draining.is_some() {
                    break;
                }
                match self.rx.recv() {
                    Ok(cmd) => self.command(cmd),
                    Err(_) => open = false,
                }
                top = Instant::now();
            }
            while open {
                match self.rx.try_recv() {
                    Ok(cmd) => self.command(cmd),
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => open = false,
                }
            }
            if !open && self.draining.is_none() {
                self.draining = Some(true);
            }
            if self.draining == Some(true) {
                for p in std::mem::take(&mut self.queue) {
                    self.refuse_cancelled(p);
                }
                for r in &self.active {
                    r.cancel.cancel();
                }
                for r in &self.prefilling {
                    r.p.cancel.cancel();
                }
            }
            // 2. Admit, and bring the prompt to prefill next to the front.
            self.steps += 1;
            let mut record = StepRecord {
                started_us: micros(top.saturating_duration_since(self.shared.started)),
                ..StepRecord::default()
            };
            let (t, cpu) = (Instant::now(), thread_cpu_time());
            self.admit();
            self.order_prefilling();
            record.admit_us = micros(t.elapsed());
            record.admit_cpu_us = micros(thread_cpu_time().saturating_sub(cpu));
            record.begin_us = micros(std::mem::take(&mut self.begin_time));
            record.admit_waited_load = std::mem::take(&mut self.admit_waited_load);
            // 3. Queue one batched decode step, fed with the previous step's picks while
            //    they are still on the device.
            //    Where it can, the front prompt's next chunk runs in the same pass.
            let t = Instant::now();
            let cpu = thread_cpu_time();
            let mut mixed: Option<Vec<MixedChunk>> = None;
            if !self.active.is_empty() {
                let launched = match self.launch_mixed() {
                    Ok(Some(m)) => {
                        mixed = Some(m);
                        Ok(true)
                    }
                    Ok(None) => self.launch(),
                    Err(e) => Err(e),
                };
                match launched {
                    Ok(true) => record.decoded = self.active.iter().map(|r| r.id).collect(),
                    Ok(false) => {}
                    Err(e) => self.fail_all(e),
                }
            }
            let launched = Instant::now();
            record.launch_cpu_us = micros(thread_cpu_time().saturating_sub(cpu));
            record.build_us = std::mem::take(&mut self.built_us);
            // 4. Read the previous step's picks, emit them, retire finished rows; the step
            //    just queued becomes the one to read next.
            self.emit_and_retire();
            for row in &mut self.active {
                row.seq.advance();
            }
            let emitted = Instant::now();
            // 5. One chunk of the front prefill (the request's own while nothing decodes),
            //    unless it ran in the decode pass.
            record.prefilled = match mixed {
                Some(mut parts) => {
                    self.charge_mixed_pass(&mut parts, t);
                    let mut done = parts.into_iter().map(|m| self.mixed_chunk_done(m));
                    let first = done.next();
                    record.riders = done.collect();
                    first
                }
                None => match self.prefill_packed_step() {
                    Some(mut done) => {
                        record.riders = done.split_off(1);
                        done.pop()
                    }
                    None => self.prefill_step(),
                },
            };
            record.launch_us = micros(launched - t);
            record.emit_us = micros(emitted - launched);
            record.prefill_us = micros(emitted.elapsed());
            if !record.decoded.is_empty() {
                let seconds = t.elapsed().as_secs_f64();
                match record.prefilled {
                    None => self.chunk_budget.observe_decode(seconds),
                    Some((_, n)) => {
                        let riders: usize = record.riders.iter().map(|r| r.1).sum();
                        self.chunk_budget
                            .observe_chunk(n + riders, self.chunk_cached, seconds);
                    }
                }
            }
            self.observe_device_kv();
            record.publish_us = std::mem::take(&mut self.published_us);
            record.prefill_charged_us = std::mem::take(&mut self.charged_us);
            record.step_us = micros(top.elapsed());
            self.log_step(record);
            if self.draining.is_some()
                && self.active.is_empty()
                && self.prefilling.is_empty()
                && self.queue.is_empty()
            {
                break;
            }
        }
        self.set_gauges();
    }

    /// Ends the I/O workers and waits for them, so their share of the tiers is dropped.
    fn stop_io(&mut self) {
        self.io = None;
        for t in std::mem::take(&mut self.io_threads) {
            let _ = t.join();
        }
    }

    fn command(&mut self, cmd: Command) {
        match cmd {
            Command::Submit(p) => self.queue.push_back(*p),
            Command::Shutdown { cancel } => {
                let d = self.draining.unwrap_or(false) || cancel;
                self.draining = Some(d);
            }
            Command::ExportResident(done) => {
                if let Some(pc) = &self.prefix {
                    if let Err(e) = pc.export_resident() {
                        tracing::warn!(error = %e, "exporting the resident sequences failed");
                    }
                }
                let _ = done.send(());
            }
            Command::Fault(InjectedFault::FailNextStep) => self.fail_next_step = true,
            Command::Fault(InjectedFault::FailNextPrefill) => self.fail_next_prefill = true,
            Command::Fault(InjectedFault::PanicEngineThread) => {
                panic!("engine thread panicked: fault injected by a test")
            }
        }
    }

    fn counters(&self) -> &Counters {
        &self.shared.counters
    }

    fn set_gauges(&self) {
        let c = self.counters();
        c.queue_depth
            .store(self.queue.len() as u64, Ordering::Relaxed);
        c.active_rows
            .store(self.active.len() as u64, Ordering::Relaxed);
        c.kv_reserved_bytes.store(self.reserved, Ordering::Relaxed);
    }

    fn refuse_cancelled(&self, p: Pending) {
        let c = self.counters();
        c.cancelled.fetch_add(1, Ordering::Relaxed);
        let waited = p.submitted.elapsed().as_secs_f64();
        let _ = p.tx.send(Event::Finished(Completion {
            finish_reason: FinishReason::Cancelled,
            prompt_tokens: p.request.prompt.len(),
            cached_tokens: 0,
            completion_tokens: 0,
            text: String::new(),
            tokens: Vec::new(),
            queue_s: waited,
            ttft_s: 0.0,
            total_s: waited,
            timings: Timings {
                prompt_tokens: p.request.prompt.len(),
                total_s: waited,
                ..Timings::default()
            },
            reuse: ReuseReport::default(),
        }));
    }

    /// Admits queued requests, in queue order, while rows and KV bytes are free: a request
    /// whose cached prefix is still loading keeps its place (its row and bytes stay free
    /// for it) and the ready requests behind it are admitted past it, as vLLM passes over
    /// requests waiting for remote KV. The engine waits for a load only where it has
    /// nothing else to do (idle, nothing ready).
    fn admit(&mut self) {
        // Requests cancelled while queued leave without being prefilled.
        let (gone, keep): (Vec<Pending>, Vec<Pending>) = std::mem::take(&mut self.queue)
            .into_iter()
            .partition(|p| p.cancel.is_cancelled() || p.tx.is_closed());
        self.queue = keep.into();
        for p in gone {
            self.refuse_cancelled(p);
        }
        self.prefetch();
        // Idle, with every admissible request still loading: wait for any of their loads.
        self.admit_waiting(None);
        // A prompt about to prefill: wait briefly for just-submitted requests' loads.
        let grace = self.config.load_grace;
        if !grace.is_zero() && !self.prefilling.is_empty() {
            self.admit_waiting(Some(Instant::now() + grace));
        }
        self.set_gauges();
    }

    /// Admits what is ready, then sleeps until an I/O worker finishes a load (or a command
    /// arrives) and admits again. With no deadline (`until`), as long as nothing runs and
    /// an admissible request is still loading: an idle engine has nothing else to do.
    /// With one ([`EngineConfig::load_grace`] from now, before a step with a prompt to
    /// prefill), until then, while rows are free and a request submitted within the last
    /// five graces is loading: a burst's later prompts, passed over while their lookups
    /// ran, then join this step's prefill instead of waiting for all of it. The waits are
    /// billed to the loading requests' restore, not their queue.
    fn admit_waiting(&mut self, until: Option<Instant>) {
        let Some(done) = self.wakeups.clone() else {
            self.admit_ready();
            return;
        };
        let young = self.config.load_grace * 5;
        let waited_for = |p: &Pending| {
            matches!(p.prefetch, Prefetch::Waiting(..))
                && (until.is_none() || p.submitted.elapsed() < young)
        };
        loop {
            let seen = done.count();
            // A command's wake-up is counted after the command is queued, so every command
            // `seen` counts is in the channel now: taken here, before the wait, or the wait
            // past `seen` would sleep through a submission that came after the engine last
            // looked (an idle engine then missed it until some load ended).
            self.take_submissions();
            if self.draining == Some(true) {
                return;
            }
            self.prefetch();
            let admitted = self.admit_ready();
            let running = self.active.len() + self.prefilling.len();
            match until {
                None if admitted > 0 || running > 0 => return,
                Some(_) if running >= self.config.max_batch => return,
                Some(_) if admitted > 0 => continue,
                _ => {}
            }
            if !self.queue.iter().any(waited_for) {
                return;
            }
            let t = Instant::now();
            let woke = match until {
                None => {
                    done.wait_past(seen);
                    true
                }
                Some(deadline) => done.wait_past_until(seen, deadline),
            };
            let waited = t.elapsed();
            for p in self.queue.iter_mut().filter(|p| waited_for(p)) {
                p.load_waited += waited;
            }
            if !woke {
                return;
            }
        }
    }

    /// Takes the commands sent since the loop last looked (submissions into the queue),
    /// without waiting.
    fn take_submissions(&mut self) {
        while let Ok(cmd) = self.rx.try_recv() {
            self.command(cmd);
        }
    }

    /// One pass over the queue for [`Self::admit`]: admits every request that is loaded
    /// and fits, passing over those still loading (holding a row and their reservation for
    /// each), and stops at the first that does not fit (memory goes in queue order, so a
    /// large request is not passed over for ever). Returns how many it admitted.
    fn admit_ready(&mut self) -> usize {
        let (mut held_rows, mut held_bytes) = (0usize, 0u64);
        let mut admitted = 0;
        let mut i = 0;
        while self.active.len() + self.prefilling.len() + held_rows < self.config.max_batch {
            let empty = self.active.is_empty() && self.prefilling.is_empty() && held_rows == 0;
            let Some(p) = self.queue.get_mut(i) else {
                break;
            };
            // A request is always admitted into an empty engine, whatever its size.
            if !empty && self.reserved + held_bytes + p.reserve > self.config.kv_budget_bytes {
                break;
            }
            if !p.host_checked && !p.prefetch.ready(false) {
                // A load that can add nothing (the store holds nothing past the device
                // tier's match) is not waited for: the request goes in this step, as
                // without a cache, and its I/O worker's answer is dropped.
                p.host_checked = true;
                let empty = self
                    .prefix
                    .as_ref()
                    .and_then(|pc| empty_host_half(pc, &p.request));
                if let Some(h) = empty {
                    // Before this request takes its device-tier hit (a hand-over leaves the
                    // tier, and a worker peeking after it would load those blocks again).
                    if let Prefetch::Waiting(_, abandoned) = &p.prefetch {
                        abandoned.store(true, Ordering::SeqCst);
                    }
                    p.prefetch = Prefetch::Ready(Some(h));
                    self.shared
                        .counters
                        .loads_not_waited
                        .fetch_add(1, Ordering::Relaxed);
                }
            }
            if !p.prefetch.ready(false) {
                self.admit_waited_load = true;
                held_rows += 1;
                held_bytes += p.reserve;
                i += 1;
                continue;
            }
            let Some(p) = self.queue.remove(i) else {
                break;
            };
            // One budget: resident sequences leave the device to make room for live ones.
            if let Some(pc) = &self.prefix {
                if let Err(e) = pc.reserve(p.reserve) {
                    tracing::warn!(request = p.id, error = %e, "reserving device memory failed");
                }
            }
            self.set_gauges();
            let (id, tx) = (p.id, p.tx.clone());
            let reserve = p.reserve;
            let t = Instant::now();
            let begun = self.begin(p);
            self.begin_time += t.elapsed();
            match begun {
                Ok(mut r) => {
                    self.unreserve_shared(&mut r);
                    self.reserved += r.p.reserve;
                    self.prefilling.push_back(r);
                    admitted += 1;
                }
                Err(e) => self.fail_prefill(id, &tx, reserve, e),
            }
        }
        admitted
    }

    /// Asks the I/O workers for the cached prefix of the queued requests near the head of
    /// the queue ([`prefetch_depth`]) that [`Engine::submit`] did not hand it already.
    fn prefetch(&mut self) {
        let Some(io) = &self.io else {
            return;
        };
        for p in self.queue.iter_mut().take(prefetch_depth(&self.config)) {
            if !matches!(p.prefetch, Prefetch::NotYet) {
                continue;
            }
            p.prefetch = send_load(io, &p.request).unwrap_or(Prefetch::None);
        }
    }

    /// Admits `p`: checks its context, restores its cached prefix into a fresh cache, and
    /// returns it ready to prefill the rest. `p.load_waited` is how long admission waited
    /// for its prefetched host blocks (an idle engine with nothing else ready does): that
    /// load is billed to its restore, not to its queue.
    fn begin(&mut self, mut p: Pending) -> Result<Prefilling> {
        let now = Instant::now();
        let waited = p.load_waited;
        let admitted = now.checked_sub(waited).unwrap_or(now).max(p.submitted);
        let queue_s = (admitted - p.submitted).as_secs_f64();
        let namespace = match &self.prefix {
            Some(pc) => Some(pc.namespace_for(p.request.cache_salt.as_deref())?),
            None => None,
        };
        let info = self.model.info();
        let prompt = std::mem::take(&mut p.request.prompt);
        let params = std::mem::take(&mut p.request.params);
        let context = context_limit(
            &params,
            self.config.context_limit,
            info.max_position_embeddings,
        );
        check_prompt(&prompt, context)?;
        let mut seq = Sequence::new(prompt, params, info.vocab_size, context, admitted)?;
        let (cache, chain, report) = match (&self.prefix, namespace) {
            (Some(pc), Some(ns)) => {
                let host = p.prefetch.take();
                let done_at = host.as_ref().and_then(|h| h.done_at());
                let mut r = pc.prepare_with(ns, &seq.prompt, host)?;
                if r.report.prefetched {
                    r.report.restore_s += (now - admitted).as_secs_f64();
                    if let Some(done) = done_at {
                        r.report.prefetch_s =
                            done.saturating_duration_since(p.submitted).as_secs_f64();
                    }
                }
                (r.cache, Some(r.chain), r.report)
            }
            _ => (
                self.model
                    .empty_cache(self.paged.with_room_for(prompt_room(seq.prompt.len())))?,
                None,
                ReuseReport {
                    prompt_tokens: seq.prompt.len(),
                    ..ReuseReport::default()
                },
            ),
        };
        seq.set_cached(&cache)?;
        Ok(Prefilling {
            p,
            seq,
            queue_s,
            cache,
            chain,
            report,
            admitted_step: self.steps,
        })
    }

    /// One budget, the prefix counted once: a request whose cache reads a resident
    /// sequence's KV as a shared prefix (docs/cache.md, "Shared prefixes") holds no bytes of
    /// that prefix's whole blocks (the resident entry counts them), so its reservation,
    /// made before the lookup for the whole prompt, gives them back.
    fn unreserve_shared(&mut self, r: &mut Prefilling) {
        let Some((_, tokens)) = r.cache.shared_prefix() else {
            return;
        };
        let bs = self.paged.block_size.max(1);
        let bytes = ((tokens / bs * bs) as u64 * self.bytes_per_token).min(r.p.reserve);
        r.p.reserve -= bytes;
        if let Some(pc) = &self.prefix {
            if let Ok(mut pool) = pc.resident() {
                pool.release(bytes);
            }
        }
    }

    /// Moves the prompt [`EngineConfig::prefill_order`] prefills next to the front of the
    /// prefilling queue, where this step's chunk (and its riders) are taken from.
    fn order_prefilling(&mut self) {
        if self.prefilling.len() < 2 {
            return;
        }
        let steps = self.steps;
        let waiting = self.prefilling.iter().map(|r| {
            let left = r.seq.prompt.len().saturating_sub(r.cache.offset());
            (left, steps.saturating_sub(r.admitted_step))
        });
        let i = self
            .config
            .prefill_order
            .next(waiting, self.config.prefill_chunk);
        if i > 0 {
            if let Some(r) = self.prefilling.remove(i) {
                self.prefilling.push_front(r);
            }
        }
    }

    /// Runs one chunk of the front prefill. Returns the request and the prompt tokens
    /// computed. With no row decoding the chunk is the request's own (larger on a GPU); the
    /// engine still returns to its loop after each chunk, so a request that arrived
    /// meanwhile is admitted at the next chunk boundary and shares the next pass instead of
    /// waiting for the whole prompt (until session 29 an idle engine ran every chunk back to
    /// back, and a burst's requests whose loads ended after the first's admission waited
    /// for the first's whole prefill).
    fn prefill_step(&mut self) -> Option<(u64, usize)> {
        let mut r = self.prefilling.pop_front()?;
        let id = r.p.id;
        // A client that goes away stops the prefill at a chunk boundary; what was computed
        // is published and kept, so a retry of the same prompt reuses it.
        if r.p.cancel.is_cancelled() || r.p.tx.is_closed() {
            self.cut_off(r);
            return Some((id, 0));
        }
        let result = if std::mem::take(&mut self.fail_next_prefill) {
            Err(EngineError::InvalidParameter {
                name: "tokens",
                message: "fault injected by a test".into(),
            })
        } else {
            // While rows decode, a step prefills at most the engine's chunk; with none, the
            // request's own (larger on a GPU, where small steps leave it waiting on
            // launches).
            self.chunk_cached = r.cache.offset();
            let most = if self.active.is_empty() {
                usize::MAX
            } else {
                self.chunk_budget
                    .most(self.chunk_cached, self.config.prefill_chunk)
            };
            r.seq.prefill_step(&self.model, &mut r.cache, most)
        };
        match result {
            Ok((n, None)) => {
                self.prefilling.push_front(r);
                Some((id, n))
            }
            Ok((n, Some(logits))) => {
                let reserve = r.p.reserve;
                let tx = r.p.tx.clone();
                if let Err(e) = self.join_batch(r, &logits) {
                    self.fail_prefill(id, &tx, reserve, ours(e));
                    self.reserved = self.reserved.saturating_sub(reserve);
                }
                Some((id, n))
            }
            Err(e) => {
                let (reserve, tx) = (r.p.reserve, r.p.tx.clone());
                self.fail_prefill(id, &tx, reserve, ours(e));
                self.reserved = self.reserved.saturating_sub(reserve);
                Some((id, 0))
            }
        }
    }

    /// A request whose client went away while it prefilled: what was computed is
    /// published and kept for a retry, and the request ends as cancelled.
    fn cut_off(&mut self, r: Prefilling) {
        let Prefilling {
            p,
            seq,
            cache,
            chain,
            report,
            queue_s,
            ..
        } = r;
        self.reserved = self.reserved.saturating_sub(p.reserve);
        let prompt = &seq.prompt;
        if let Some(pc) = &self.prefix {
            if let Some(chain) = chain {
                let held = cache.offset().min(prompt.len());
                if let Err(e) = pc.retire(chain, cache, &prompt[..held]) {
                    tracing::warn!(request = p.id, error = %e, "publishing a cut-off prefill failed");
                }
            }
            if let Ok(mut r) = pc.resident() {
                r.release(p.reserve);
            }
        }
        tracing::debug!(request = p.id, "client gone during prefill: stopped");
        self.counters().cancelled.fetch_add(1, Ordering::Relaxed);
        let total_s = p.submitted.elapsed().as_secs_f64();
        let _ = p.tx.send(Event::Finished(Completion {
            finish_reason: FinishReason::Cancelled,
            prompt_tokens: prompt.len(),
            cached_tokens: seq.cached,
            completion_tokens: 0,
            text: String::new(),
            tokens: Vec::new(),
            queue_s,
            ttft_s: 0.0,
            total_s,
            timings: Timings {
                prompt_tokens: prompt.len(),
                cached_tokens: seq.cached,
                total_s,
                ..Timings::default()
            },
            reuse: report,
        }));
        self.set_gauges();
    }

    /// A request that failed before it decoded: its reservation is released and the
    /// client told why.
    fn fail_prefill(
        &self,
        id: u64,
        tx: &chan::UnboundedSender<Event>,
        reserve: u64,
        e: EngineError,
    ) {
        if let Some(pc) = &self.prefix {
            if let Ok(mut r) = pc.resident() {
                r.release(reserve);
            }
        }
        tracing::warn!(request = id, error = %e, "request failed at prefill");
        self.counters().failed.fetch_add(1, Ordering::Relaxed);
        let _ = tx.send(Event::Failed(e));
    }

    /// A finished prefill: picks the first token from `logits`, publishes the prompt's
    /// blocks, and adds the row to the decode batch.
    fn join_batch(&mut self, r: Prefilling, logits: &mlx::Array) -> Result<()> {
        let Prefilling {
            p,
            mut seq,
            queue_s,
            mut cache,
            mut chain,
            mut report,
            ..
        } = r;
        seq.first_pick(logits)?;
        seq.prefilled(self.prefix.as_deref(), &mut report);
        if let (Some(pc), Some(chain)) = (&self.prefix, chain.as_mut()) {
            let t = Instant::now();
            seq.publish_prompt(pc, chain, &mut cache, &mut report);
            self.published_us += micros(t.elapsed());
        }
        let (prompt_tokens, cached) = (seq.prompt.len(), seq.cached);
        let c = self.counters();
        c.prompt_tokens
            .fetch_add(prompt_tokens as u64, Ordering::Relaxed);
        c.cached_tokens.fetch_add(cached as u64, Ordering::Relaxed);
        c.cached_device_tokens
            .fetch_add(report.cached_device_tokens as u64, Ordering::Relaxed);
        c.cached_ram_tokens
            .fetch_add(report.cached_ram_tokens as u64, Ordering::Relaxed);
        c.cached_ssd_tokens
            .fetch_add(report.cached_ssd_tokens as u64, Ordering::Relaxed);
        c.cached_remote_tokens
            .fetch_add(report.cached_remote_tokens as u64, Ordering::Relaxed);
        observe_ttft(c, queue_s + seq.ttft_s);
        tracing::debug!(
            request = p.id,
            prompt = prompt_tokens,
            cached,
            ttft_s = seq.ttft_s,
            "request admitted"
        );
        let _ = p.tx.send(Event::Started {
            prompt_tokens,
            cached_tokens: cached,
        });
        // The first token goes out now, not after the next decode step is queued.
        let mut sent = 0u64;
        seq.emit_first(&self.tokenizer, &mut send_token(&p.tx, &mut sent))?;
        c.generated_tokens.fetch_add(sent, Ordering::Relaxed);
        // One KV budget: the batch arena holds the rows' reservations and charges its
        // padding to the device tier (`charge_arena`).
        self.rows.push_reserved(cache, p.reserve)?;
        self.charge_arena();
        self.active.push(Row {
            seq,
            id: p.id,
            tx: p.tx,
            cancel: p.cancel,
            reserve: p.reserve,
            submitted: p.submitted,
            queue_s,
            report,
            chain,
        });
        self.set_gauges();
        Ok(())
    }

    /// Keeps `record` in the step log when one is kept.
    fn log_step(&self, record: StepRecord) {
        let keep = self.config.step_log;
        if keep == 0 || (record.decoded.is_empty() && record.prefilled.is_none()) {
            return;
        }
        let mut steps = match self.shared.steps.lock() {
            Ok(s) => s,
            Err(e) => e.into_inner(),
        };
        if steps.len() == keep {
            steps.pop_front();
        }
        steps.push_back(record);
    }

    /// Emits every row's pending token ([`Sequence::emit`]: EOS, stop strings, limits),
    /// then removes the rows that ended and publishes their blocks.
    fn emit_and_retire(&mut self) {
        let mut failed: Vec<(usize, EngineError)> = Vec::new();
        let mut generated = 0u64;
        for (i, row) in self.active.iter_mut().enumerate() {
            let cancelled = row.cancel.is_cancelled() || row.tx.is_closed();
            let tx = &row.tx;
            let emitted = row.seq.emit(
                &self.tokenizer,
                cancelled,
                &mut send_token(tx, &mut generated),
            );
            if let Err(e) = emitted {
                failed.push((i, ours(e)));
            }
        }
        self.shared
            .counters
            .generated_tokens
            .fetch_add(generated, Ordering::Relaxed);
        for (i, e) in failed {
            self.shared.counters.failed.fetch_add(1, Ordering::Relaxed);
            let row = &mut self.active[i];
            row.seq.finish = Some(FinishReason::Cancelled);
            let _ = row.tx.send(Event::Failed(e));
            row.cancel.cancel();
        }
        self.retire();
    }

    fn retire(&mut self) {
        if self.active.iter().all(|r| r.seq.finish.is_none()) {
            return;
        }
        let keep: Vec<usize> = (0..self.active.len())
            .filter(|&i| self.active[i].seq.finish.is_none())
            .collect();
        let caches = match self.rows.filter(&keep) {
            Ok(c) => c,
            Err(e) => {
                self.fail_all(e.into());
                return;
            }
        };
        let mut rows = Vec::with_capacity(keep.len());
        let mut done = Vec::new();
        for r in std::mem::take(&mut self.active) {
            if r.seq.finish.is_none() {
                rows.push(r);
            } else {
                done.push(r);
            }
        }
        self.active = rows;
        self.charge_arena();
        for (row, cache) in done.into_iter().zip(caches) {
            self.finish(row, cache);
        }
        self.set_gauges();
    }

    fn finish(&mut self, row: Row, cache: PagedKvCache) {
        self.reserved = self.reserved.saturating_sub(row.reserve);
        let Row {
            mut seq,
            id,
            tx,
            submitted,
            queue_s,
            mut report,
            chain,
            reserve,
            ..
        } = row;
        if let Some(pc) = &self.prefix {
            if let Ok(mut r) = pc.resident() {
                r.release(reserve);
            }
        }
        match (&self.prefix, chain) {
            (Some(pc), Some(chain)) => {
                let t = Instant::now();
                if let Err(e) = seq.retire(pc, chain, cache, &mut report) {
                    tracing::warn!(request = id, error = %e, "publishing failed");
                }
                self.published_us += micros(t.elapsed());
            }
            // Freed before the client hears of the end: its next request finds the memory.
            _ => drop(cache),
        }
        let reason = seq.finish.unwrap_or(FinishReason::Cancelled);
        let c = self.counters();
        match reason {
            FinishReason::Stop => &c.finished_stop,
            FinishReason::Length => &c.finished_length,
            FinishReason::Cancelled => &c.cancelled,
        }
        .fetch_add(1, Ordering::Relaxed);
        let mut timings = match seq.timings() {
            Ok(t) => t,
            Err(e) => {
                tracing::warn!(request = id, error = %e, "reading MLX's peak memory failed");
                Timings::default()
            }
        };
        // One TTFT: the report's (lookup + restore + prefill), as `generate_with_reuse`
        // reports it; `queue_s` is the wait before admission.
        timings.ttft_s = report.ttft_s;
        timings.total_s = submitted.elapsed().as_secs_f64();
        let completion = Completion {
            finish_reason: reason,
            prompt_tokens: seq.prompt.len(),
            cached_tokens: report.cached_tokens,
            completion_tokens: seq.tokens.len(),
            queue_s,
            ttft_s: seq.ttft_s,
            total_s: submitted.elapsed().as_secs_f64(),
            timings,
            text: std::mem::take(&mut seq.text),
            tokens: std::mem::take(&mut seq.tokens),
            reuse: report,
        };
        drop(seq);
        tracing::debug!(
            request = id,
            reason = ?reason,
            tokens = completion.completion_tokens,
            "request finished"
        );
        let _ = tx.send(Event::Finished(completion));
    }

    /// Queues one decode step over every row ([`decode_step`]), unless every row is at its
    /// last token; returns whether it did.
    fn launch(&mut self) -> Result<bool> {
        if std::mem::take(&mut self.fail_next_step) {
            return Err(EngineError::StepFailed("fault injected by a test".into()));
        }
        self.allow_arena();
        let mut seqs: Vec<&mut Sequence> = self.active.iter_mut().map(|r| &mut r.seq).collect();
        let built = decode_step(&self.model, &mut seqs, StepKv::Rows(&mut self.rows))?;
        if let Some(built) = built {
            self.built_us = micros(built);
            self.count_step();
        } else {
            self.charge_arena();
            self.observe_device_kv();
        }
        Ok(built.is_some())
    }

    /// The batch arena may pad into what the live reservations leave of the budget.
    fn allow_arena(&mut self) {
        let left = self.config.kv_budget_bytes.saturating_sub(self.reserved);
        self.rows.set_arena_allowance(left);
    }

    /// Books a queued decode step: the arena's charge, the step counters, the device KV.
    fn count_step(&mut self) {
        self.charge_arena();
        let c = &self.shared.counters;
        c.decode_steps.fetch_add(1, Ordering::Relaxed);
        c.decode_rows
            .fetch_add(self.active.len() as u64, Ordering::Relaxed);
        if self.rows.has_arena() {
            c.batch_arena_steps.fetch_add(1, Ordering::Relaxed);
        }
        self.observe_device_kv();
    }

    /// Queues the decode step with the front prefill's next chunk in the same forward pass
    /// ([`decode_step_mixed`]), and after it, as riders, later prompts whose whole rest fits
    /// in what that chunk leaves of the step's prefill budget (many short prompts then
    /// share one pass instead of taking a step each); `None` where that does not apply
    /// (mixed steps off, a fault to inject, a request to cut off first, no mixed pass for
    /// the model): nothing changed.
    fn launch_mixed(&mut self) -> Result<Option<Vec<MixedChunk>>> {
        if !self.mixed_steps || self.fail_next_step || self.fail_next_prefill {
            return Ok(None);
        }
        let Some((mut taken, max_chunk, ceiling)) = self.take_chunks(false) else {
            return Ok(None);
        };
        self.allow_arena();
        let jobs = chunk_jobs(&mut taken, max_chunk, ceiling);
        let mut seqs: Vec<&mut Sequence> = self.active.iter_mut().map(|r| &mut r.seq).collect();
        let ran = decode_step_mixed(&self.model, &mut seqs, &mut self.rows, jobs);
        let parts = match ran {
            Ok(Some(parts)) => parts,
            other => {
                self.put_back(taken);
                return other.map(|_| None);
            }
        };
        self.count_step();
        Ok(Some(mixed_chunks(taken, parts)))
    }

    /// The front prompt's next chunk and, as riders, later prompts whose whole rest fits
    /// in what it leaves of the prefill budget, in one pass of their own
    /// ([`prefill_packed`]): the pass a step runs beside the decode pass (mixed steps off)
    /// or alone (nothing decoding), when at least one prompt rides. `None` when none rides
    /// or a fault is to be injected (nothing changed: [`Worker::prefill_step`] runs).
    fn prefill_packed_step(&mut self) -> Option<Vec<(u64, usize)>> {
        if self.fail_next_prefill {
            return None;
        }
        let (mut taken, max_chunk, ceiling) = self.take_chunks(true)?;
        let jobs = chunk_jobs(&mut taken, max_chunk, ceiling);
        let t = Instant::now();
        let parts = match prefill_packed(&self.model, jobs) {
            Ok(Some(parts)) => parts,
            Ok(None) => {
                self.put_back(taken);
                return None;
            }
            Err(e) => {
                // The pass failed as a whole: every prompt in it fails with the error.
                let msg = step_message(ours(e));
                let mut done = Vec::with_capacity(taken.len());
                for (_, r) in taken {
                    let (id, reserve, tx) = (r.p.id, r.p.reserve, r.p.tx.clone());
                    let e = EngineError::StepFailed(msg.clone());
                    self.fail_prefill(id, &tx, reserve, e);
                    self.reserved = self.reserved.saturating_sub(reserve);
                    done.push((id, 0));
                }
                return Some(done);
            }
        };
        // Each prompt's prefill time holds its tokens' share of the pass.
        let tokens: Vec<usize> = parts.iter().map(|p| p.0).collect();
        let shares = pass_shares(t.elapsed().as_secs_f64(), &tokens);
        for ((_, r), share) in taken.iter_mut().zip(shares) {
            r.seq.prefill_s += share;
            self.charged_us.push((r.p.id, micros_f64(share)));
        }
        let done = mixed_chunks(taken, parts);
        Some(done.into_iter().map(|m| self.mixed_chunk_done(m)).collect())
    }

    /// Takes the front prompt (if live) and the prompts that ride with its next chunk out
    /// of the queue (tried in [`PrefillOrder::rider_order`]), each with its place, the
    /// front's chunk budget and the pass's ceiling
    /// (the engine's chunk: no step prefills more). While rows decode the budget is the
    /// step's prefill budget, with none decoding the ceiling. With `need_riders`, `None`
    /// (nothing taken) when no prompt rides.
    #[allow(clippy::type_complexity)]
    fn take_chunks(
        &mut self,
        need_riders: bool,
    ) -> Option<(Vec<(usize, Prefilling)>, usize, usize)> {
        let live = |r: &Prefilling| !(r.p.cancel.is_cancelled() || r.p.tx.is_closed());
        let front = self.prefilling.front().filter(|r| live(r))?;
        let held = front.cache.offset();
        let ceiling = self.config.prefill_chunk;
        let max_chunk = if self.active.is_empty() {
            ceiling
        } else {
            self.chunk_budget.most(held, ceiling)
        };
        let rest = |r: &Prefilling| r.seq.prompt.len().saturating_sub(r.cache.offset());
        let first = rest(front).min(front.seq.chunk_len(held, max_chunk));
        let mut left = max_chunk.saturating_sub(first);
        let mut riders = Vec::new();
        let rests: Vec<usize> = self.prefilling.iter().skip(1).map(rest).collect();
        for k in self.config.prefill_order.rider_order(&rests) {
            if left == 0 {
                break;
            }
            let (i, n) = (k + 1, rests[k]);
            let r = &self.prefilling[i];
            if n == 0
                || n > left
                || !live(r)
                || r.cache.state_snapshot_every().is_some()
                || r.seq.chunk_len(r.cache.offset(), ceiling) < n
            {
                continue;
            }
            riders.push(i);
            left -= n;
        }
        // Taken out from the back, so that the places of the others hold.
        riders.sort_unstable();
        if need_riders && riders.is_empty() {
            return None;
        }
        // Out of the queue while the step runs: riders from the back, then the front.
        let mut taken: Vec<(usize, Prefilling)> = Vec::with_capacity(riders.len() + 1);
        for &i in riders.iter().rev() {
            if let Some(r) = self.prefilling.remove(i) {
                taken.push((i, r));
            }
        }
        let r = self.prefilling.pop_front()?;
        taken.push((0, r));
        taken.reverse();
        self.chunk_cached = held;
        Some((taken, max_chunk, ceiling))
    }

    /// Puts prompts [`Worker::take_chunks`] took back where they were, the front first.
    fn put_back(&mut self, taken: Vec<(usize, Prefilling)>) {
        for (i, r) in taken {
            self.prefilling.insert(i, r);
        }
    }

    /// Charges every prompt of a decode pass's prefill (the chunk and its riders) its
    /// tokens' share of what the step took beyond a decode-only step, the cost model's
    /// sample of its prefill. This runs before a prompt the pass finished picks its first
    /// token and records that sample, so the pass is waited for first (the pick would wait
    /// for it anyway); `t` is when the step's launch began.
    fn charge_mixed_pass(&mut self, parts: &mut [MixedChunk], t: Instant) {
        let finished: Vec<&mlx::Array> = parts.iter().filter_map(|m| m.logits.as_ref()).collect();
        if !finished.is_empty() {
            // A failure here is the pass's: each finished prompt's pick reads the same
            // arrays and fails its request with the error.
            let _ = mlx::eval(&finished);
        }
        let cost = self.chunk_budget.beyond_decode(t.elapsed().as_secs_f64());
        let tokens: Vec<usize> = parts.iter().map(|m| m.tokens).collect();
        for (m, share) in parts.iter_mut().zip(pass_shares(cost, &tokens)) {
            m.r.seq.prefill_s += share;
            self.charged_us.push((m.r.p.id, micros_f64(share)));
        }
    }

    /// After a step whose decode pass ran a prefill chunk: the request goes back to the
    /// front of the prefilling queue, or, when the chunk ended its prompt, picks its first
    /// token and joins the batch (as [`Worker::prefill_step`] does after its own chunk).
    fn mixed_chunk_done(&mut self, m: MixedChunk) -> (u64, usize) {
        let MixedChunk { r, tokens, logits } = m;
        let id = r.p.id;
        match logits {
            None => self.prefilling.push_front(r),
            Some(logits) => {
                let (reserve, tx) = (r.p.reserve, r.p.tx.clone());
                if let Err(e) = self.join_batch(r, &logits) {
                    self.fail_prefill(id, &tx, reserve, ours(e));
                    self.reserved = self.reserved.saturating_sub(reserve);
                }
            }
        }
        (id, tokens)
    }

    /// Charges the batch arena's bytes beyond its rows' reservations to the device tier's
    /// live bytes (it evicts resident sequences for them), releasing what it no longer
    /// takes: live reservations + arena padding + resident sequences stay within the budget.
    fn charge_arena(&mut self) {
        let excess = self.rows.arena_excess_bytes();
        if let Some(pc) = &self.prefix {
            if excess > self.arena_charged {
                if let Err(e) = pc.reserve(excess - self.arena_charged) {
                    tracing::warn!(error = %e, "charging the batch arena to the device budget failed");
                }
            } else if let Ok(mut r) = pc.resident() {
                r.release(self.arena_charged - excess);
            }
        }
        self.arena_charged = excess;
    }

    /// Records the device KV held now in [`EngineMetrics::kv_device_peak_bytes`].
    fn observe_device_kv(&self) {
        let resident = self
            .prefix
            .as_ref()
            .map_or(0, |pc| pc.resident_stats().resident_bytes);
        let prefilling: u64 = self.prefilling.iter().map(|r| r.cache.device_bytes()).sum();
        let held = self.rows.device_bytes() + prefilling + resident;
        self.counters()
            .kv_device_peak_bytes
            .fetch_max(held, Ordering::Relaxed);
    }

    /// An error in a batched step fails every row in it (the batch's caches may be
    /// partly updated, so none of them is published).
    fn fail_all(&mut self, e: EngineError) {
        tracing::error!(error = %e, rows = self.active.len(), "batched step failed");
        let msg = step_message(e);
        self.rows = new_rows(&self.config).unwrap_or_default();
        if let Some(pc) = &self.prefix {
            if let Ok(mut r) = pc.resident() {
                r.release(self.reserved + self.arena_charged);
            }
        }
        self.arena_charged = 0;
        for row in std::mem::take(&mut self.active) {
            self.counters().failed.fetch_add(1, Ordering::Relaxed);
            let _ = row
                .tx
                .send(Event::Failed(EngineError::StepFailed(msg.clone())));
        }
        self.reserved = 0;
        self.set_gauges();
    }
}

/// What a failed step tells each request it fails (a `StepFailed`'s own message, not
/// wrapped twice).
fn step_message(e: EngineError) -> String {
    match e {
        EngineError::StepFailed(m) => m,
        e => e.to_string(),
    }
}

/// An error of work the engine does for a request it admitted (a prefill chunk, the first
/// pick): the request was checked at submission and admission, so this is the engine's
/// failure even when its type reads like a bad argument (a model's check on its inputs).
fn ours(e: EngineError) -> EngineError {
    match e.class() {
        ErrorClass::Invalid => EngineError::StepFailed(e.to_string()),
        _ => e,
    }
}

/// [`EngineConfig::mixed_steps`], else `KVSTORE_MIXED_STEPS` (`0` off, `1` on), else
/// [`mixed_steps_by_default`] for MLX's default device.
fn mixed_steps(config: &EngineConfig) -> bool {
    let env = std::env::var("KVSTORE_MIXED_STEPS").ok();
    let device = mlx::default_device().unwrap_or(mlx::Device::Cpu);
    config.mixed_steps.unwrap_or_else(|| match env.as_deref() {
        Some("0") => false,
        Some(_) => true,
        // CUDA is the GPU off macOS; Metal keeps two passes (not measured there).
        None => mixed_steps_by_default(
            device,
            cfg!(target_os = "macos") || mlx::cuda_graphs_enabled(),
        ),
    })
}

/// Whether steps are mixed when nothing says, on `device`, where a GPU records its passes
/// as graphs or not (`gpu_graphs`: CUDA graphs, [`mlx::cuda_graphs_enabled`]; Metal is
/// counted as graphs, keeping the two passes it has always run). On the CPU a step is
/// bound by reading the weights, which a mixed pass reads once instead of twice (a chunk
/// step 10-15 % shorter, docs/benchmarks.md). On a GPU with graphs, no: each mixed pass
/// has new shapes and instantiates new graphs (TTFT P50 0.57 vs 0.46 s under the trace,
/// session 12); without graphs, yes (TTFT P50 0.16 vs 0.21 s, an 8,192-token prompt
/// stretching 8 streams' ITL P99 1.63x vs 2.23x: docs/benchmarks.md, "CUDA graphs").
fn mixed_steps_by_default(device: mlx::Device, gpu_graphs: bool) -> bool {
    device == mlx::Device::Cpu || !gpu_graphs
}

/// An empty decode batch, with the batch arena as `config` (or `KVSTORE_BATCH_ARENA`) says.
fn new_rows(config: &EngineConfig) -> Result<PagedKvRows> {
    let mut rows = PagedKvRows::new();
    let env = std::env::var("KVSTORE_BATCH_ARENA").ok();
    let choice = config.batch_arena.or(match env.as_deref() {
        Some("0") => Some(false),
        Some("1") => Some(true),
        _ => None,
    });
    if let Some(on) = choice {
        rows.set_batch_arena(on)?;
    }
    Ok(rows)
}

fn observe_ttft(c: &Counters, s: f64) {
    for (b, le) in c.ttft_buckets.iter().zip(TTFT_BUCKETS) {
        if s <= le {
            b.fetch_add(1, Ordering::Relaxed);
        }
    }
    c.ttft_count.fetch_add(1, Ordering::Relaxed);
    c.ttft_sum_us.fetch_add((s * 1e6) as u64, Ordering::Relaxed);
}

/// Hands each emitted token to a request's stream, counting it in `sent`; false once
/// nobody listens.
fn send_token<'a>(
    tx: &'a chan::UnboundedSender<Event>,
    sent: &'a mut u64,
) -> impl FnMut(Sampled, String) -> bool + 'a {
    move |sampled, text| {
        *sent += 1;
        tx.send(Event::Token { sampled, text }).is_ok()
    }
}

/// The calling thread's CPU time so far (zero where the clock cannot be read).
fn thread_cpu_time() -> std::time::Duration {
    cpu_time::ThreadTime::try_now().map_or(std::time::Duration::ZERO, |t| t.as_duration())
}

/// Whole microseconds of `d` (saturating).
fn micros(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// `seconds` in whole microseconds (negative or not finite: 0).
fn micros_f64(seconds: f64) -> u64 {
    if seconds.is_finite() && seconds > 0.0 {
        (seconds * 1e6).round() as u64
    } else {
        0
    }
}

/// The shares of a pass of `seconds` that computed `tokens` prompt tokens for each of its
/// prompts: proportional to their tokens (equal shares when none are counted).
fn pass_shares(seconds: f64, tokens: &[usize]) -> Vec<f64> {
    let total: usize = tokens.iter().sum();
    tokens
        .iter()
        .map(|&n| match total {
            0 => seconds / tokens.len() as f64,
            _ => seconds * n as f64 / total as f64,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pass_is_shared_by_tokens_and_equally_when_none_are_counted() {
        assert_eq!(pass_shares(0.8, &[1, 3]), vec![0.2, 0.6000000000000001]);
        assert_eq!(pass_shares(0.5, &[0, 0]), vec![0.25, 0.25]);
        assert!(pass_shares(1.0, &[]).is_empty());
        assert_eq!(micros_f64(0.0012345), 1235);
        assert_eq!(micros_f64(-1.0), 0);
        assert_eq!(micros_f64(f64::NAN), 0);
    }

    #[test]
    fn steps_are_mixed_by_default_unless_a_gpu_records_cuda_graphs_and_a_config_overrides_it() {
        for graphs in [false, true] {
            assert!(mixed_steps_by_default(mlx::Device::Cpu, graphs));
        }
        assert!(!mixed_steps_by_default(mlx::Device::Gpu, true));
        assert!(mixed_steps_by_default(mlx::Device::Gpu, false));
        for set in [false, true] {
            let config = EngineConfig {
                mixed_steps: Some(set),
                ..EngineConfig::default()
            };
            assert_eq!(mixed_steps(&config), set);
        }
    }
}
