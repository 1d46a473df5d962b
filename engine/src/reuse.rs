//! Prefix reuse across turns and restarts: the engine ⇄ cache ⇄ store loop.
//!
//! For every request: tokenize → the chain keys of the prompt's full blocks (at most
//! `prompt.len() - 1` tokens, so at least one token is computed), derived once → the
//! longest resident prefix in the device tier ([`ResidentPool`], token-granular, handed
//! over without a copy) → the blocks after it from the store (RAM, SSD, remote), restored
//! in bulk, all or nothing per block → prefill the rest → generate → publish every new
//! full block (prompt and reply) to the store as host bytes, and keep the sequence
//! resident on the device so the next turn, which contains this reply, hits there.
//!
//! The store namespace is derived from everything that changes a block's bytes: the weight
//! fingerprint, the config, the tokenizer, the KV dtype and format, the block size, the
//! layer layout, RoPE, and an optional salt; a model never sees another model's blocks.
//!
//! Restoring is not always cheaper than recomputing (a small model on a fast GPU prefills
//! faster than a disk reads). [`KvTiers`] keeps fits of the prefill cost and of the restore
//! cost by tier, each with a fixed and a per-unit term (engine/src/cost_model.rs), and
//! restores the prefix of the cached run with the largest estimated net saving (prefill
//! time saved minus restore time). The samples are saved in the store per namespace and
//! device, so a new process starts from them.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use cache::{
    plane_specs, state_plane_specs, trimmed_plane_specs, BlockShape, Chain, EvictedSequence,
    KvCache, KvFormat, PagedConfig, PagedKvCache, ResidentPool, ResidentStats, StagedRestore,
};
use serde::Serialize;
use store::{
    Block, BlockKey, NamespaceDescription, NamespaceId, Store, StoreConfig, StoreStats, Tier,
};

use crate::cost_model::{plan_with_probes, CostSamples, Costs, Fit, RestoreEstimates, RestorePlan};
use crate::device_tier::DeviceTier;
use crate::error::{EngineError, Result};
use crate::export::{ExportStats, Exporter};
use crate::generate::{decode_streaming, GenerateParams, Generation, TokenEvent};
use crate::load_gate::LoadGate;
use crate::model::{LayerKind, Model};
use crate::sequence::{prefill_alone, Sequence};
use crate::staging_budget::{StagingBudget, StagingCharge, DEFAULT_STAGING_BYTES};
use crate::tokenizer::Tokenizer;

/// Settings of prefix reuse.
#[derive(Clone, Debug)]
pub struct ReuseConfig {
    /// The block store: directory and budgets. Default: [`StoreConfig::default`].
    pub store: StoreConfig,
    /// Tokens per block. Default: 32.
    pub block_size: usize,
    /// How KV is kept in the live cache and in blocks. Default: [`KvFormat::Float`].
    pub kv_format: KvFormat,
    /// Mixed into the namespace (tenant, adapter, …): different salts never share blocks.
    /// Default: none.
    pub salt: Option<String>,
    /// Blocks a layer's live pool may grow to. Default: 8192.
    pub max_blocks: usize,
    /// Device bytes for all KV, live and resident (the device tier). Default: 2 GiB.
    pub kv_budget_bytes: u64,
    /// Restore every cached block found, even where the cost model estimates recomputing
    /// faster (for checking the tiers; users want the estimate). Default: false.
    pub restore_always: bool,
    /// Blocks between snapshots of a hybrid model's non-attention layer states, which a
    /// restore resumes from (0: only where a sequence ended). `None`: the fewest blocks whose
    /// K/V takes at least the bytes of one snapshot ([`auto_state_every`]). Default: `None`
    /// (docs/cache.md).
    pub state_every: Option<usize>,
    /// Models with sliding-window layers: leave the window layers' planes out of blocks
    /// that no continuation from a restorable end reads through a window (docs/cache.md,
    /// "Window layers"); `false` stores every plane of every block, in the namespace such
    /// stores had before (for comparison). Default: true.
    pub window_trim: bool,
    /// The fewest tokens a device hit that is not a handover shares (the request reads the
    /// resident arenas as a prefix, no copy) rather than forks (one device copy per layer
    /// at its first write); `usize::MAX` never shares. Default:
    /// [`default_share_min_tokens`] (docs/cache.md, "Shared prefixes").
    pub share_min_tokens: usize,
    /// Whether the device tier holds copies of the host tiers' blocks (blocks exported as
    /// they are published) or not (exported as their sequences leave the device). Default:
    /// [`DeviceTier::Inclusive`].
    pub device_tier: DeviceTier,
    /// Host bytes that restores staged ahead of admission may hold at once (an I/O worker
    /// assembles a loaded prefix in the device layout while its request waits; past this,
    /// the engine thread assembles it at admission; 0 never stages). Default:
    /// [`DEFAULT_STAGING_BYTES`] (docs/prefix-reuse.md, step 6).
    pub staging_bytes: u64,
}

/// The fewest tokens a device hit shares on the CPU: [`SHARE_MIN_TOKENS_CPU`].
/// On cpu-vm a decode step and a prefill chunk over a shared prefix cost what they cost
/// over a forked copy (docs/benchmarks.md, "Shared prefixes"), and the copy is saved.
pub const SHARE_MIN_TOKENS_CPU: usize = 256;

/// [`ReuseConfig::share_min_tokens`]'s default for the device MLX computes on:
/// [`SHARE_MIN_TOKENS_CPU`] on the CPU; never on a GPU, where sharing is not measured yet
/// and every shared row's attention adds graph nodes to a step that is bound by the host
/// building it (docs/benchmarks.md, "Where a serving step goes").
pub fn default_share_min_tokens() -> usize {
    match mlx::default_device() {
        Ok(mlx::Device::Cpu) => SHARE_MIN_TOKENS_CPU,
        _ => cache::DEFAULT_SHARE_MIN_TOKENS,
    }
}

impl Default for ReuseConfig {
    fn default() -> Self {
        Self {
            store: StoreConfig::default(),
            block_size: 32,
            kv_format: KvFormat::Float,
            salt: None,
            max_blocks: 8192,
            kv_budget_bytes: 2 << 30,
            restore_always: false,
            state_every: None,
            window_trim: true,
            share_min_tokens: default_share_min_tokens(),
            device_tier: DeviceTier::Inclusive,
            staging_bytes: DEFAULT_STAGING_BYTES,
        }
    }
}

/// What prefix reuse did for one request (all times in seconds).
#[derive(Clone, Debug, Default, Serialize)]
pub struct ReuseReport {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Prompt tokens restored instead of computed.
    pub cached_tokens: usize,
    /// Of those, found resident on the device (no transfer).
    pub cached_device_tokens: usize,
    /// Whether the device hit took over a resident sequence's KV as is (no copy at all)
    /// rather than sharing it as a prefix or forking it.
    pub device_handover: bool,
    /// Whether the device hit reads the resident sequence's KV as a shared prefix (no
    /// copy, now or later) rather than a copy-on-write fork.
    pub device_shared: bool,
    /// Whether the host blocks were loaded by the I/O workers while the request waited for
    /// admission (their load time is then not part of `restore_s`, unless the engine had
    /// nothing else to do and admission waited for the load: that wait is).
    pub prefetched: bool,
    /// Of those, restored from the RAM tier.
    pub cached_ram_tokens: usize,
    /// Of those, restored from the SSD tier.
    pub cached_ssd_tokens: usize,
    /// Of those, fetched (and verified) from the remote tier.
    pub cached_remote_tokens: usize,
    /// Token index where the prompt left the longest prefix this engine has published
    /// recently (equal to the prompt length when it extends one entirely); `None` when
    /// nothing was published before. A value far below `prompt_tokens` on a later turn
    /// means the conversation's earlier text changed (template drift, edited history).
    pub diverged_at: Option<usize>,
    /// Finding the cached prefix (hashing keys and the index lookup) after admission: the
    /// device tier's match, and the store's lookup when the engine loaded the prefix
    /// itself. A prefetched load's store lookup ran on an I/O worker before admission
    /// (within `prefetch_s`), not here.
    pub lookup_s: f64,
    /// Reading, verifying and restoring the cached blocks.
    pub restore_s: f64,
    /// Of `restore_s`, moving the loaded blocks into device memory on the engine thread
    /// (assembly on the host unless staged, the transfers); the rest is the store's load.
    /// Copies into a pool the request already holds (after a device-tier hit) run with its
    /// first prefill step, on the device's queue, not here.
    pub import_s: f64,
    /// Checking and assembling the loaded blocks for the device, done on an I/O worker
    /// while the request waited for admission (a staged restore; not in `restore_s`, and
    /// not on the engine thread); 0 where the engine thread assembled them.
    pub staged_s: f64,
    /// With `prefetched`: seconds from the request's submission until the I/O workers had
    /// looked up and loaded its cached prefix (queued behind other requests' loads
    /// included). Admission cannot pass a queued request before then, so a `queue_s` near
    /// it was the I/O workers'; 0 when the engine loaded at admission.
    pub prefetch_s: f64,
    /// Prefilling the uncached rest (and sampling the first token).
    pub prefill_s: f64,
    /// Time to first token: lookup + restore + prefill (what a user waits for).
    pub ttft_s: f64,
    /// Host-RAM blocks left on the host because recomputing them was estimated faster than
    /// moving them to the device.
    pub ram_blocks_skipped: usize,
    /// Cached SSD blocks left unread because recomputing them was estimated faster.
    pub ssd_blocks_skipped: usize,
    /// Remote-tier blocks left unfetched because recomputing them was estimated faster.
    pub remote_blocks_skipped: usize,
    /// Why the cached prefix ended early (a corrupt or refused block), if it did.
    pub stopped: Option<String>,
    /// Hybrid models: of the cached tokens, those whose non-attention layer states
    /// (convolution, recurrent) were restored with the attention layers' K/V (from a
    /// snapshot block, or resident on the device). A hybrid resumes only where its states
    /// are known, so this is `cached_tokens` for hybrids and 0 for attention-only models.
    pub state_restored_tokens: usize,
    /// Hybrid models: tokens of cached blocks found in the store whose K/V was not restored
    /// because no state snapshot follows them (`--state-every`): every layer recomputes
    /// them, from the last snapshot on.
    pub state_recomputed_tokens: usize,
    /// Models with sliding-window layers: tokens of cached blocks found in the store whose
    /// K/V was not restored because a window after them would read a window-trimmed block
    /// (docs/cache.md, "Window layers"): every layer recomputes them.
    pub window_recomputed_tokens: usize,
    /// New full blocks published after the request.
    pub published_blocks: usize,
    /// Bytes of window-layer planes that blocks published after the request left out
    /// (window-trimmed blocks, and trimmed copies replacing blocks the sequence moved past).
    pub window_trimmed_bytes: u64,
}

/// At most one save of the cost model per this interval (each is an fsync'd file).
const COSTS_SAVE_EVERY: Duration = Duration::from_secs(5);

/// The device the estimates apply to: MLX's default device and backend.
fn device_name() -> String {
    let device = mlx::default_device().map_or_else(|_| "unknown".into(), |d| format!("{d:?}"));
    let backend = if mlx::gpu_available().unwrap_or(false) {
        "gpu"
    } else {
        "cpu-only"
    };
    format!("{device}/{backend}")
}

/// Merges `costs` under `device` into the namespace's saved estimates (read, merged,
/// written back); a failure is logged.
fn save_costs_to(store: &Store, namespace: NamespaceId, device: String, costs: Costs) {
    let Some(json) = costs.merged_into(store.costs(namespace).as_deref(), &device) else {
        return;
    };
    if let Err(e) = store.save_costs(namespace, &json) {
        tracing::warn!(error = %e, "saving the restore-or-recompute estimates failed");
    }
}

/// Bytes of one block of `description` (every plane, layer states included), at least 1.
fn block_bytes(description: &NamespaceDescription) -> u64 {
    description
        .planes
        .iter()
        .chain(&description.state_planes)
        .filter_map(|p| p.byte_len())
        .sum::<u64>()
        .max(1)
}

/// SSD blocks a background measurement reads at most ([`probe_ssd`]): loads of 1, 2, 4
/// and 8 blocks, four samples of four sizes.
const BACKGROUND_PROBE_BLOCKS: usize = 15;

/// Measures the SSD off any request's path (on the export thread), where the cost model
/// has no estimate of it yet or is due to measure it again ([`plan_with_probes`]): loads
/// `keys` (a run of SSD blocks) in loads of 1, 2, 4 and 8 blocks while they last and
/// records each as an SSD sample, so that the fit tells the fixed cost from the per-block
/// one with more than two points (one noisy load of two would price the SSD for every
/// request after it). The blocks are promoted into RAM as any load's are.
fn probe_ssd(
    store: &Store,
    namespace: NamespaceId,
    keys: &[BlockKey],
    tokens: &[Vec<u32>],
    costs: &Mutex<Costs>,
) {
    let mut from = 0;
    for size in [1, 2, 4, 8] {
        let to = (from + size).min(keys.len());
        if to <= from {
            return;
        }
        let t = Instant::now();
        let loaded = store.load_prefix(namespace, &keys[from..to], &tokens[from..to]);
        let seconds = t.elapsed().as_secs_f64();
        let ssd = loaded
            .blocks
            .iter()
            .filter(|(_, t)| *t == Tier::Ssd)
            .count();
        if ssd > 0 {
            if let Ok(mut c) = costs.lock() {
                c.ssd.record(ssd, 0, seconds);
            }
        }
        if loaded.blocks.len() < to - from {
            return;
        }
        from = to;
    }
}

/// The engine's connection to its KV tiers for one model: the device tier (resident
/// sequences, one budget) and the block store (host RAM, SSD, remote; host bytes only).
pub struct KvTiers {
    /// Finishes publications off the engine thread; dropped (joined) before the store.
    exporter: Exporter,
    store: Arc<Store>,
    namespace: NamespaceId,
    description: NamespaceDescription,
    /// The engine's configured salt ([`ReuseConfig::salt`]), combined with each request's.
    salt: Option<String>,
    /// Namespaces of per-request cache salts, registered on first use.
    salted: Mutex<HashMap<String, NamespaceId>>,
    layers: usize,
    /// A hybrid's non-attention layers, whose states live in the caches beside the KV and
    /// in snapshot blocks.
    state_layers: usize,
    state_every: usize,
    /// Per attention layer, its sliding window (`None`: global); empty when the model
    /// has none, and then nothing is window-trimmed.
    windows: Vec<Option<usize>>,
    /// Window-layer bytes left out of published blocks so far.
    window_trimmed_bytes: AtomicU64,
    paged: PagedConfig,
    resident: Mutex<ResidentPool>,
    /// Token ids of the sequences published most recently (for `diverged_at`), newest first.
    recent: Mutex<Vec<(NamespaceId, Vec<u32>)>>,
    costs: Arc<Mutex<Costs>>,
    /// Whether a background measurement of the SSD ([`probe_ssd`]) is queued or running.
    ssd_probe_queued: Arc<AtomicBool>,
    device: String,
    costs_saved: Mutex<Option<Instant>>,
    restore_always: bool,
    /// Whether any host tier can hold a block (RAM or SSD budget above 0, or a remote
    /// tier): without one, publication copies nothing off the device.
    host_tiers: bool,
    /// Blocks reach the host tiers as their sequences leave the device
    /// ([`DeviceTier::Exclusive`], with host tiers).
    exclusive: bool,
    /// Test support: loads held until released ([`Self::hold_loads`]).
    load_gate: LoadGate,
    /// Loads that stopped before reading because admission took their request without
    /// them ([`Self::loads_abandoned`]).
    loads_abandoned: AtomicU64,
    /// Bounds the host bytes of restores staged ahead of admission.
    staging: StagingBudget,
}

const RECENT_SEQUENCES: usize = 8;

/// Pinned bytes per tier ([`KvTiers::pinned`]).
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct PinnedTiers {
    /// Device bytes of resident sequences holding a pinned block.
    pub device_bytes: u64,
    /// Pinned keys, and the pinned bytes in host RAM and on SSD.
    #[serde(flatten)]
    pub store: store::PinnedBytes,
}

/// A device tier of `bytes` whose eviction spares `store`'s pins, sharing hits of
/// `share_min_tokens` tokens or more and forking the others with the room `paged` gives
/// their prompts.
fn pinned_pool(
    bytes: u64,
    store: &Store,
    (share_min_tokens, paged): (usize, PagedConfig),
    exclusive: bool,
) -> ResidentPool {
    let mut pool = ResidentPool::new(bytes);
    pool.set_pins(store.pins().clone());
    pool.set_share_min_tokens(share_min_tokens);
    pool.set_fork_config(paged);
    pool.set_keep_evicted(exclusive);
    pool
}

/// The host half of a restore ([`KvTiers::load_host`]): verified host blocks of a
/// prompt's chain from block `first` on, loaded without touching the device.
#[derive(Debug)]
pub struct HostPrefix {
    /// The prompt's chain keys (derived once, here).
    chain: Chain,
    /// Block index of the first loaded block: where the device hit ended when loading.
    first: usize,
    blocks: Vec<std::sync::Arc<Block>>,
    tiers: Vec<Tier>,
    stopped: Option<String>,
    ram_skipped: usize,
    ssd_skipped: usize,
    remote_skipped: usize,
    lookup_s: f64,
    load_s: f64,
    remote_s: f64,
    /// When the I/O workers finished it.
    done_at: Option<Instant>,
    /// The blocks checked and assembled for the device ahead of admission (a model
    /// without layer states, within the staging budget): the engine thread installs it.
    staged: Option<Box<(StagedRestore, StagingCharge)>>,
}

impl HostPrefix {
    /// When the I/O workers finished looking it up and loading it.
    pub(crate) fn done_at(&self) -> Option<Instant> {
        self.done_at
    }

    fn new(chain: Chain) -> Self {
        Self {
            chain,
            first: 0,
            blocks: Vec::new(),
            tiers: Vec::new(),
            stopped: None,
            ram_skipped: 0,
            ssd_skipped: 0,
            remote_skipped: 0,
            lookup_s: 0.0,
            load_s: 0.0,
            remote_s: 0.0,
            done_at: None,
            staged: None,
        }
    }

    /// Drops the blocks before block `first` (now held by the device).
    fn skip_to(&mut self, first: usize) {
        let n = first.saturating_sub(self.first).min(self.blocks.len());
        self.blocks.drain(..n);
        self.tiers.drain(..n);
        self.first += n;
        if n > 0 {
            // Staged from the old first block: the engine restores the rest itself.
            self.staged = None;
        }
    }
}

/// What [`KvTiers::prepare_in`] returns: a cache holding the reused prefix, the
/// prompt's chain keys (derived once, extended at publication) and the report.
#[derive(Debug)]
pub struct Prepared {
    /// The live cache, holding `report.cached_tokens` tokens.
    pub cache: PagedKvCache,
    /// The prompt's chain keys.
    pub chain: Chain,
    /// What was found and how long it took.
    pub report: ReuseReport,
}

/// Longest per-request cache salt accepted, in bytes.
pub const MAX_CACHE_SALT_BYTES: usize = 256;

/// Per-request salts registered before new ones are refused (each is a store namespace).
const MAX_SALTED_NAMESPACES: usize = 4096;

/// Refuses a per-request cache salt that is empty or longer than [`MAX_CACHE_SALT_BYTES`].
pub fn check_cache_salt(salt: &str) -> Result<()> {
    if salt.is_empty() || salt.len() > MAX_CACHE_SALT_BYTES {
        return Err(EngineError::InvalidParameter {
            name: "cache_salt",
            message: format!(
                "a cache salt must be 1 to {MAX_CACHE_SALT_BYTES} bytes, got {}",
                salt.len()
            ),
        });
    }
    Ok(())
}

/// The salt field of the namespace of a request salted `request` on an engine configured
/// with salt `configured`: `None` when neither is set (the model's plain namespace), else an
/// unambiguous encoding of the pair, `kvstore.salt/2;server=F;request=F` where each `F` is
/// `-` (absent) or `<byte length>:<salt>`. Distinct pairs never give the same string, so a
/// server configured with a salt that looks like an encoded request salt cannot share a
/// namespace with that request on another server (docs/store-format.md, "Salts").
pub fn combined_salt(configured: Option<&str>, request: Option<&str>) -> Option<String> {
    if configured.is_none() && request.is_none() {
        return None;
    }
    let field = |salt: Option<&str>| match salt {
        None => "-".to_string(),
        Some(s) => format!("{}:{s}", s.len()),
    };
    Some(format!(
        "{SALT_ENCODING};server={};request={}",
        field(configured),
        field(request)
    ))
}

/// Domain tag and version of [`combined_salt`]'s encoding; version 1 put a configured salt
/// in verbatim.
const SALT_ENCODING: &str = "kvstore.salt/2";

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn store_dtype(d: mlx::Dtype) -> Result<store::Dtype> {
    Ok(match d {
        mlx::Dtype::F32 => store::Dtype::F32,
        mlx::Dtype::F16 => store::Dtype::F16,
        mlx::Dtype::BF16 => store::Dtype::BF16,
        other => {
            return Err(EngineError::InvalidParameter {
                name: "kv dtype",
                message: format!("the store cannot hold {other} keys and values"),
            })
        }
    })
}

/// Per attention layer of `model`, its sliding window (`None`: global attention); empty
/// when no layer has a window (or the kinds do not list one entry per attention layer).
pub fn attention_windows(model: &Model) -> Vec<Option<usize>> {
    let windows: Vec<Option<usize>> = model
        .layer_kinds()
        .iter()
        .filter_map(|k| match k {
            LayerKind::Global => Some(None),
            LayerKind::Window(n) => Some(Some(*n)),
            _ => None,
        })
        .collect();
    if windows.len() != model.info().kv.layers || windows.iter().all(Option::is_none) {
        return Vec::new();
    }
    windows
}

/// Everything that changes the bytes of a block of `model`'s KV under `config`.
pub fn namespace_description(
    model: &Model,
    tokenizer: &Tokenizer,
    config: &ReuseConfig,
) -> Result<NamespaceDescription> {
    let info = model.info();
    let kv = info.kv;
    let name = model
        .files()
        .first()
        .and_then(|f| f.file_stem())
        .map_or_else(|| "model".to_string(), |s| s.to_string_lossy().into_owned());
    let mut d = NamespaceDescription::new(name, store_dtype(kv.dtype)?, config.block_size as u32);
    d.weights_fingerprint = hex(&model.fingerprint()?);
    let config_json =
        serde_json::to_vec(model.config()).map_err(|e| EngineError::InvalidParameter {
            name: "config",
            message: e.to_string(),
        })?;
    d.config_hash = blake3::hash(&config_json).to_hex().to_string();
    d.tokenizer_hash = tokenizer.fingerprint().to_hex().to_string();
    if let KvFormat::Quantized { bits, group_size } = config.kv_format {
        d.kv_quantization = Some(store::KvQuantization {
            bits: bits as u32,
            group_size: group_size as u32,
        });
    }
    d.layers = model.layer_kinds().iter().map(|k| k.to_string()).collect();
    d.rope = format!("theta={} arch={}", info.rope_theta, info.architecture);
    d.salt = combined_salt(config.salt.as_deref(), None);
    let shape = BlockShape {
        kv_heads: kv.kv_heads,
        block_size: config.block_size,
        head_dim: kv.head_dim,
        dtype: kv.dtype,
    };
    d.planes = plane_specs(kv.layers, shape, config.kv_format)?;
    if config.window_trim {
        d.trimmed_planes = trimmed_plane_specs(&attention_windows(model), shape, config.kv_format)?;
    }
    let states: Vec<Vec<mlx::Array>> = model
        .state_shapes()
        .iter()
        .map(|parts| {
            parts
                .iter()
                .map(|s| {
                    let s: Vec<i32> = s.iter().map(|&d| d as i32).collect();
                    mlx::ops::zeros(&s, kv.dtype)
                })
                .collect::<std::result::Result<_, _>>()
        })
        .collect::<std::result::Result<_, _>>()?;
    d.state_planes = state_plane_specs(&states)?;
    Ok(d)
}

/// The `--state-every auto` choice for a namespace: the fewest blocks whose K/V planes take
/// at least the bytes of one snapshot's state planes, so snapshots at most double what a
/// hybrid stores, and a restore recomputes fewer than that many blocks after the last one.
/// LFM2 (a few convolution inputs per layer) gets 1; a large recurrent state (Qwen3-Next's
/// DeltaNet matrices) gets tens. 0 for attention-only namespaces.
pub fn auto_state_every(d: &NamespaceDescription) -> usize {
    let bytes =
        |specs: &[store::PlaneSpec]| -> u64 { specs.iter().filter_map(|p| p.byte_len()).sum() };
    let (state, block) = (bytes(&d.state_planes), bytes(&d.planes).max(1));
    state.div_ceil(block) as usize
}

impl KvTiers {
    /// Opens (or creates) the store and registers `model`'s namespace in it.
    pub fn open(model: &Model, tokenizer: &Tokenizer, config: ReuseConfig) -> Result<Self> {
        let description = namespace_description(model, tokenizer, &config)?;
        let state_every = config
            .state_every
            .unwrap_or_else(|| auto_state_every(&description));
        let store = match Store::open(config.store.clone()) {
            Ok(s) => s,
            // A store on a read-only file system (a pre-warmed volume) or one this user may
            // not write still serves its blocks: open it read-only; new blocks stay in RAM.
            Err(store::OpenError::Io { path, source })
                if !config.store.read_only && not_writable(&source) =>
            {
                match Store::open(config.store.clone().read_only(true)) {
                    Ok(s) => {
                        tracing::warn!(
                            path = %store::escape_path(&path),
                            error = %source,
                            "the block store is not writable: serving it read-only; new blocks stay in RAM"
                        );
                        s
                    }
                    // Nothing to serve read-only: the writer's error says why (a parent
                    // directory this user may not write), not "does not exist".
                    Err(store::OpenError::NotFound { .. }) => {
                        return Err(store::OpenError::Io { path, source }.into())
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            Err(e) => return Err(e.into()),
        };
        let namespace = store.register_namespace(&description)?;
        let device = device_name();
        let mut costs = store
            .costs(namespace)
            .map(|b| Costs::from_saved(&b, &device))
            .unwrap_or_default();
        costs.price_unmeasured_ssd(block_bytes(&description));
        let host_tiers = {
            let c = store.config();
            c.ram_budget > 0 || (store.ssd().is_some() && c.ssd_budget > 0) || c.remote.is_some()
        };
        let exclusive = host_tiers && config.device_tier == DeviceTier::Exclusive;
        // An exclusive tier exports a sequence from its own arenas as it leaves: a cache
        // reading another entry's arenas as its prefix would have to export blocks it does
        // not hold, so hits fork instead.
        let share_min_tokens = match exclusive {
            true => usize::MAX,
            false => config.share_min_tokens,
        };
        let paged = PagedConfig {
            block_size: config.block_size,
            format: config.kv_format,
            initial_blocks: 16,
            max_blocks: config.max_blocks,
        };
        let resident = pinned_pool(
            config.kv_budget_bytes,
            &store,
            (share_min_tokens, paged),
            exclusive,
        );
        let store = Arc::new(store);
        let exporter = Exporter::start(store.clone())
            .map_err(|e| EngineError::io("kvstore-export thread", e))?;
        Ok(Self {
            exporter,
            store,
            namespace,
            description,
            salt: config.salt.clone(),
            salted: Mutex::new(HashMap::new()),
            layers: model.info().kv.layers,
            state_layers: model.info().kv.state_layers,
            state_every,
            windows: match config.window_trim {
                true => attention_windows(model),
                false => Vec::new(),
            },
            window_trimmed_bytes: AtomicU64::new(0),
            paged,
            resident: Mutex::new(resident),
            recent: Mutex::new(Vec::new()),
            costs: Arc::new(Mutex::new(costs)),
            ssd_probe_queued: Arc::default(),
            staging: StagingBudget::new(config.staging_bytes),
            device,
            costs_saved: Mutex::new(None),
            restore_always: config.restore_always,
            host_tiers,
            exclusive,
            load_gate: LoadGate::default(),
            loads_abandoned: Default::default(),
        })
    }

    /// Test support: from now on [`Self::load_host`] of a prompt starting with `prefix` (an
    /// I/O worker's load of a queued request) waits before it starts until
    /// [`Self::release_loads`], as a slow disk or remote tier would. Not a stable API.
    #[doc(hidden)]
    pub fn hold_loads(&self, prefix: Vec<u32>) {
        self.load_gate.hold(prefix);
    }

    /// Lets every held load run (see [`Self::hold_loads`]).
    #[doc(hidden)]
    pub fn release_loads(&self) {
        self.load_gate.release();
    }

    /// Loads by the I/O workers that stopped before reading anything because admission took
    /// their request without them (the store could add nothing when it looked).
    pub fn loads_abandoned(&self) -> u64 {
        self.loads_abandoned.load(Ordering::SeqCst)
    }

    /// How many loads wait at [`Self::hold_loads`]'s gate now.
    #[doc(hidden)]
    pub fn loads_waiting(&self) -> usize {
        self.load_gate.waiting()
    }

    /// The device tier, locked.
    pub fn resident(&self) -> Result<MutexGuard<'_, ResidentPool>> {
        self.resident.lock().map_err(|_| poisoned())
    }

    /// Counters and gauges of the device tier.
    pub fn resident_stats(&self) -> ResidentStats {
        self.resident.lock().map(|r| r.stats()).unwrap_or_default()
    }

    /// Sets the device budget (live and resident KV together).
    /// Resizing drops what is resident: call it at start-up, before any request.
    pub fn set_kv_budget(&self, bytes: u64) -> Result<()> {
        self.export_resident()?;
        let mut resident = self.resident()?;
        *resident = pinned_pool(
            bytes,
            &self.store,
            (resident.share_min_tokens(), self.paged),
            self.exclusive,
        );
        Ok(())
    }

    /// Reserves `bytes` of the device budget for a live sequence
    /// ([`ResidentPool::reserve`]), evicting resident sequences for them; an exclusive tier
    /// exports what they held. Returns whether resident and live bytes fit the budget.
    pub fn reserve(&self, bytes: u64) -> Result<bool> {
        let (fits, evicted) = {
            let mut r = self.resident()?;
            let fits = r.reserve(bytes);
            (fits, r.take_evicted())
        };
        self.export_evicted(evicted);
        Ok(fits)
    }

    /// Exports the blocks sequences held as they left an exclusive device tier (the host
    /// tiers lack them); a failure is logged, as a skipped export is counted.
    fn export_evicted(&self, evicted: Vec<EvictedSequence>) {
        for mut e in evicted {
            if let Err(err) = self.export(&mut e.chain, &mut e.cache, &e.tokens) {
                tracing::warn!(error = %err, "exporting a sequence leaving the device failed");
            }
        }
    }

    /// Whether the device tier is exclusive of the host tiers ([`DeviceTier::Exclusive`]
    /// with a host tier to export to).
    pub fn is_exclusive(&self) -> bool {
        self.exclusive
    }

    /// An exclusive device tier: exports what every resident sequence holds that the host
    /// tiers lack (they stay resident), so a flush makes it durable. Nothing to do
    /// otherwise. It makes device copies: call it on the thread that runs the engine's MLX
    /// work, or with no engine running.
    pub fn export_resident(&self) -> Result<()> {
        if !self.exclusive {
            return Ok(());
        }
        self.resident()?.for_each_resident(|chain, cache, tokens| {
            if let Err(err) = self.export(chain, cache, tokens) {
                tracing::warn!(error = %err, "exporting a resident sequence failed");
            }
        });
        Ok(())
    }

    /// Blocks between a hybrid's state snapshots (`auto` resolved; 0 for attention-only
    /// models under `auto`).
    pub fn state_every(&self) -> usize {
        self.state_every
    }

    /// The model's namespace in the store (requests without a cache salt).
    pub fn namespace(&self) -> NamespaceId {
        self.namespace
    }

    /// The namespace of requests carrying cache salt `salt` (`None`: [`Self::namespace`]).
    /// Requests with different salts never share a block: the salt is part of the
    /// namespace id, and every block key is chained from it.
    pub fn namespace_for(&self, salt: Option<&str>) -> Result<NamespaceId> {
        let Some(salt) = salt else {
            return Ok(self.namespace);
        };
        check_cache_salt(salt)?;
        let mut salted = self.salted.lock().map_err(|_| poisoned())?;
        if let Some(ns) = salted.get(salt) {
            return Ok(*ns);
        }
        if salted.len() >= MAX_SALTED_NAMESPACES {
            return Err(EngineError::InvalidParameter {
                name: "cache_salt",
                message: format!(
                    "this engine already serves {MAX_SALTED_NAMESPACES} cache salts; restart it \
                     or reuse salts"
                ),
            });
        }
        let mut d = self.description.clone();
        d.salt = combined_salt(self.salt.as_deref(), Some(salt));
        let ns = self.store.register_namespace(&d)?;
        salted.insert(salt.to_string(), ns);
        Ok(ns)
    }

    /// What the namespace is made of.
    pub fn description(&self) -> &NamespaceDescription {
        &self.description
    }

    /// The paged cache settings requests get.
    pub fn paged_config(&self) -> PagedConfig {
        self.paged
    }

    /// The store.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Pins the full blocks of `tokens` (a prompt's first tokens, up to a cache breakpoint)
    /// in the namespace of cache salt `salt` for `ttl`, in every tier: the device tier, host
    /// RAM and SSD spare them from eviction until then (see [`store::Pins`]); `durable` pins
    /// also survive a restart. Blocks not cached yet are protected once published. Returns
    /// the number of blocks pinned (a partial last block is never pinned: it is not
    /// published).
    pub fn pin_prefix(
        &self,
        salt: Option<&str>,
        tokens: &[u32],
        ttl: std::time::Duration,
        durable: bool,
    ) -> Result<usize> {
        let ns = self.namespace_for(salt)?;
        let keys = store::chain_keys(ns, tokens, self.paged.block_size);
        self.store.pin(ns, &keys, ttl, durable);
        Ok(keys.len())
    }

    /// What is pinned now: keys, and the bytes of them each tier holds.
    pub fn pinned(&self) -> PinnedTiers {
        PinnedTiers {
            device_bytes: self.resident().map_or(0, |r| r.pinned_bytes()),
            store: self.store.pinned_bytes(),
        }
    }

    /// The prefill cost estimate (this device's fit of the recent prefills, saved in the
    /// store and read back at open, or the prior the engine measured at its start), if any.
    pub fn prefill_estimate(&self) -> Option<Fit> {
        self.costs.lock().ok()?.prefill()
    }

    /// How many recent measurements the cost model's fits are made of, per measure.
    pub fn cost_samples(&self) -> CostSamples {
        self.costs.lock().map(|c| c.samples()).unwrap_or_default()
    }

    /// The SSD measure's recent samples, oldest first: blocks read and seconds taken by
    /// each load (a request's restore or a background probe's), as the SSD's fit saw them.
    pub fn ssd_samples(&self) -> Vec<(usize, f64)> {
        self.costs
            .lock()
            .map(|c| c.ssd.sizes_and_seconds())
            .unwrap_or_default()
    }

    /// The device name the cost model is saved under in costs.json (MLX's default device
    /// and backend).
    pub fn cost_device(&self) -> &str {
        &self.device
    }

    /// The restore cost estimates of this device: host → device import, SSD read and remote
    /// fetch, each for n blocks, if measured.
    pub fn restore_estimates(&self) -> RestoreEstimates {
        let Ok(c) = self.costs.lock() else {
            return RestoreEstimates::default();
        };
        RestoreEstimates {
            import: c.import(),
            ssd: c.ssd(),
            remote: c.remote(),
        }
    }

    /// Counters of the export thread (publications finished off the engine thread).
    pub fn export_stats(&self) -> ExportStats {
        self.exporter.stats()
    }

    /// Counters of the store.
    pub fn stats(&self) -> StoreStats {
        self.store.stats()
    }

    /// Makes everything published so far durable on SSD, the cost model included; with an
    /// exclusive device tier, what is resident first ([`Self::export_resident`]: call it
    /// where the engine's MLX work runs, or with no engine running; [`crate::Engine::flush`]
    /// does).
    pub fn flush(&self) -> Result<()> {
        self.export_resident()?;
        self.flush_published()
    }

    /// [`Self::flush`] without the resident sequences' export: no MLX work, any thread.
    pub(crate) fn flush_published(&self) -> Result<()> {
        self.save_costs(true);
        self.exporter.wait_idle();
        Ok(self.store.flush()?)
    }

    /// Saves the cost model under this device's name (at most every [`COSTS_SAVE_EVERY`]
    /// unless `now`), on the export thread: reading and writing the file never blocks the
    /// engine thread. A failure is logged: the estimates are an optimization.
    fn save_costs(&self, now: bool) {
        let Ok(mut saved_at) = self.costs_saved.lock() else {
            return;
        };
        if !now && saved_at.is_some_and(|t| t.elapsed() < COSTS_SAVE_EVERY) {
            return;
        }
        *saved_at = Some(Instant::now());
        let (namespace, device) = (self.namespace, self.device.clone());
        // Read when the save runs: what the export thread measured before it is included.
        let costs = self.costs.clone();
        self.exporter.run(move |store| {
            if let Ok(costs) = costs.lock().map(|c| c.clone()) {
                save_costs_to(store, namespace, device, costs);
            }
        });
    }

    /// A fresh live cache holding the longest usable cached prefix of `prompt` (at most
    /// `prompt.len() - 1` tokens), its chain and the report of what was found.
    pub fn prepare(&self, prompt: &[u32]) -> Result<Prepared> {
        self.prepare_in(self.namespace, prompt)
    }

    /// [`Self::prepare`] in namespace `namespace` (see [`Self::namespace_for`]): the
    /// resident prefix on the device first, then the store's blocks after it, restored in
    /// bulk when the cost model says restoring beats recomputing.
    pub fn prepare_in(&self, namespace: NamespaceId, prompt: &[u32]) -> Result<Prepared> {
        self.prepare_with(namespace, prompt, None)
    }

    /// The host half of a restore, for an I/O worker: the prompt's chain keys, what the
    /// device tier holds of it now, and the store's blocks after that (lookup, SSD reads,
    /// remote fetches, verification; the cost model decides how far). No MLX call.
    ///
    /// `abandoned`: set when the request no longer waits for this load. It is checked after
    /// the device-tier peek (admission sets it before the request takes its device hit)
    /// and before each read, so an abandoned load reads nothing: a read counts as a use in
    /// the store's tiers and would keep blocks that the request never took.
    pub fn load_host(
        &self,
        namespace: NamespaceId,
        prompt: &[u32],
        abandoned: &AtomicBool,
    ) -> Result<HostPrefix> {
        self.load_gate.pass(prompt);
        let t = Instant::now();
        let (chain, first) = self.device_match(namespace, prompt)?;
        let mut host = self.load_host_from(chain, prompt, first, Some(abandoned))?;
        host.lookup_s = t.elapsed().as_secs_f64() - host.load_s;
        host.staged = self.stage(&host, prompt.len());
        host.done_at = Some(Instant::now());
        Ok(host)
    }

    /// `prompt`'s chain keys (of all but its last token, the most a restore reuses) and the
    /// whole blocks of it the device tier holds now, without taking them.
    fn device_match(&self, namespace: NamespaceId, prompt: &[u32]) -> Result<(Chain, usize)> {
        let reusable = prompt.len().saturating_sub(1);
        let chain = Chain::of(namespace, self.paged.block_size, &prompt[..reusable]);
        let first = self.resident()?.peek(&chain, prompt, reusable) / self.paged.block_size;
        Ok((chain, first))
    }

    /// The host half of `prompt`'s restore where it is known without I/O to be empty: the
    /// store holds none of the blocks after the device tier's match now (RAM, the SSD
    /// index, the write-behind queue) and no export in flight brings the first of them,
    /// there is no remote tier to ask, and no test holds the prompt's loads. Then the
    /// request need not wait for an I/O worker to say so (admission took it a step later,
    /// ~2 ms on a GPU under the trace: docs/benchmarks.md, session 51). `None` where only a
    /// lookup by an I/O worker can tell. No MLX call; a lock of the device tier and of the
    /// store's indexes, a few microseconds.
    pub(crate) fn host_half_if_empty(
        &self,
        namespace: NamespaceId,
        prompt: &[u32],
    ) -> Result<Option<HostPrefix>> {
        if self.store.has_remote() || self.load_gate.holds(prompt) {
            return Ok(None);
        }
        let (chain, first) = self.device_match(namespace, prompt)?;
        let next = &chain.keys()[first.min(chain.keys().len())..];
        let next = &next[..next.len().min(1)];
        if self.exporter.holds_any(namespace, next)
            || self.store.lookup(namespace, next).blocks() > 0
        {
            return Ok(None);
        }
        Ok(Some(HostPrefix {
            first,
            done_at: Some(Instant::now()),
            ..HostPrefix::new(chain)
        }))
    }

    /// The host half of restoring `host`'s blocks, done on the loading thread: checked and
    /// assembled in each layer part's device layout, for the cache admission will append
    /// them to (empty, or the device-tier hit the load started after, cut to its whole
    /// blocks with pools of its own; a hit that arrives in another form restores the
    /// ordinary way). `None` where there is nothing to stage, the model has layer states,
    /// the staging budget is spent, or staging failed (the engine thread then restores the
    /// blocks itself and reports any error).
    fn stage(
        &self,
        host: &HostPrefix,
        prompt_tokens: usize,
    ) -> Option<Box<(StagedRestore, StagingCharge)>> {
        if host.blocks.is_empty() || self.state_layers > 0 {
            return None;
        }
        // The blocks' bytes: what the staged parts hold, zeros after them aside.
        let bytes: u64 = host
            .blocks
            .iter()
            .flat_map(|b| &b.planes)
            .map(|p| p.data.len() as u64)
            .sum();
        let charge = self.staging.try_charge(bytes)?;
        let hit = host.first * self.paged.block_size;
        // The cache admission will have: made with room for the prompt where nothing is
        // resident, else the device-tier hit's (prepare_with).
        let base = match hit {
            0 => self.empty_cache_for(prompt_tokens),
            _ => self.empty_cache(),
        };
        let staged = base.ok()?.stage_restore_after(hit, &host.blocks);
        staged
            .inspect_err(|e| tracing::debug!("staging a restore failed: {e}"))
            .ok()
            .flatten()
            .map(|s| Box::new((s, charge)))
    }

    /// The store's blocks of `chain` from block `first` on (see [`Self::load_host`]). An
    /// SSD without a speed estimate is probed with a few blocks first, then the estimate
    /// decides about the rest.
    fn load_host_from(
        &self,
        chain: Chain,
        prompt: &[u32],
        first: usize,
        abandoned: Option<&AtomicBool>,
    ) -> Result<HostPrefix> {
        let gone = || {
            let gone = abandoned.is_some_and(|a| a.load(Ordering::SeqCst));
            if gone {
                self.loads_abandoned.fetch_add(1, Ordering::SeqCst);
            }
            gone
        };
        let bs = self.paged.block_size;
        let namespace = chain.namespace();
        let mut host = HostPrefix {
            first,
            ..HostPrefix::new(chain)
        };
        let rest = &host.chain.keys()[first.min(host.chain.keys().len())..];
        if rest.is_empty() || gone() {
            return Ok(host);
        }
        let t = Instant::now();
        // What earlier requests published is looked up only once it is in the store.
        self.exporter.wait_for(namespace, rest);
        let hit = self.store.lookup(namespace, rest);
        host.lookup_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let mut done = 0;
        // Three rounds at most: an unmeasured SSD is probed first, in two loads of different
        // sizes (its first block, then the rest of the probe), so that its first samples tell
        // its fixed cost from its per-block one; then the estimate decides about the rest.
        let mut probe_end = None;
        for _ in 0..3 {
            // Before planning: an abandoned load neither reads nor queues an SSD probe.
            if gone() {
                break;
            }
            let tiers = &hit.tiers[done..];
            let probe_rest = probe_end.take();
            let (mut plan, had_ssd_estimate, measure_ssd) = if let Some(end) = probe_rest {
                (RestorePlan::first(tiers, end - done), false, false)
            } else if self.restore_always {
                (RestorePlan::first(tiers, tiers.len()), true, false)
            } else {
                let mut costs = self.costs.lock().map_err(|_| poisoned())?;
                let start = (first + done) * bs;
                let (plan, measure) = plan_with_probes(tiers, &mut costs, start, bs);
                (plan, !costs.ssd.is_unknown(), measure)
            };
            let first_ssd = tiers[..plan.usable].iter().position(|t| *t == Tier::Ssd);
            if measure_ssd || (!had_ssd_estimate && first_ssd.is_none() && plan.ssd_skipped > 0) {
                // The plan leaves the SSD alone (unmeasured, where a slow disk would not
                // pay, or cut by its estimate on a request due to measure it again):
                // measure it in the background, for the requests after this one.
                let at = done + plan.usable;
                self.queue_ssd_probe(namespace, &rest[at..], &hit.tiers[at..], prompt, first + at);
            }
            if let (false, None, Some(s)) = (had_ssd_estimate, probe_rest, first_ssd) {
                if s + 1 < plan.usable {
                    probe_end = Some(done + plan.usable);
                    plan = RestorePlan::first(tiers, s + 1);
                }
            }
            host.ram_skipped = plan.ram_skipped;
            host.ssd_skipped = plan.ssd_skipped;
            host.remote_skipped = plan.remote_skipped;
            if plan.usable == 0 {
                break;
            }
            let start = first + done;
            let tokens: Vec<&[u32]> = prompt[start * bs..].chunks(bs).take(plan.usable).collect();
            let t_load = Instant::now();
            let loaded =
                self.store
                    .load_prefix(namespace, &rest[done..done + plan.usable], &tokens);
            let load_s = t_load.elapsed().as_secs_f64();
            host.remote_s += loaded.remote_s;
            let n = loaded.blocks.len();
            let count = |tier: Tier| loaded.blocks.iter().filter(|(_, t)| *t == tier).count();
            let (ssd, remote) = (count(Tier::Ssd), count(Tier::Remote));
            {
                let mut costs = self.costs.lock().map_err(|_| poisoned())?;
                if ssd > 0 {
                    costs
                        .ssd
                        .record(ssd, 0, (load_s - loaded.remote_s).max(0.0));
                }
                if remote > 0 {
                    costs.remote.record(remote, 0, loaded.remote_s);
                }
            }
            for (b, tier) in loaded.blocks {
                host.blocks.push(b);
                host.tiers.push(tier);
            }
            done += n;
            if let Some(reason) = &loaded.stopped {
                host.stopped = Some(format!("{reason:?}"));
                break;
            }
            // Only a probe (an SSD measured just now) goes round again.
            if had_ssd_estimate || done >= hit.tiers.len() || n < plan.usable {
                break;
            }
        }
        host.load_s = t.elapsed().as_secs_f64();
        Ok(host)
    }

    /// Queues [`probe_ssd`] on the export thread for the first run of SSD blocks in
    /// `tiers` (the store's blocks `keys`, the first at block `at` of `prompt`), unless a
    /// probe is queued already; the estimates are saved after it.
    fn queue_ssd_probe(
        &self,
        namespace: NamespaceId,
        keys: &[BlockKey],
        tiers: &[Tier],
        prompt: &[u32],
        at: usize,
    ) {
        let Some(s) = tiers.iter().position(|t| *t == Tier::Ssd) else {
            return;
        };
        let n = tiers[s..]
            .iter()
            .take(BACKGROUND_PROBE_BLOCKS)
            .take_while(|t| **t == Tier::Ssd)
            .count();
        if self.ssd_probe_queued.swap(true, Ordering::AcqRel) {
            return;
        }
        let bs = self.paged.block_size;
        let keys = keys[s..s + n].to_vec();
        let tokens: Vec<Vec<u32>> = prompt[(at + s) * bs..]
            .chunks(bs)
            .take(n)
            .map(<[u32]>::to_vec)
            .collect();
        let (costs, queued) = (self.costs.clone(), self.ssd_probe_queued.clone());
        self.exporter.run(move |store| {
            probe_ssd(store, namespace, &keys, &tokens, &costs);
            queued.store(false, Ordering::Release);
        });
        // Saved after it, so that a restart finds the SSD measured.
        self.save_costs(true);
    }

    /// [`Self::prepare_in`] with the host half already loaded by [`Self::load_host`] (on
    /// an I/O worker while the request waited for admission). If the device tier changed
    /// since, the loaded blocks are cut to fit, or loaded again from where the device hit
    /// ends.
    pub fn prepare_with(
        &self,
        namespace: NamespaceId,
        prompt: &[u32],
        prefetched: Option<HostPrefix>,
    ) -> Result<Prepared> {
        let mut report = ReuseReport {
            prompt_tokens: prompt.len(),
            diverged_at: self.diverged_at(namespace, prompt),
            ..ReuseReport::default()
        };
        let bs = self.paged.block_size;
        let t = Instant::now();
        let reusable = prompt.len().saturating_sub(1);
        let chain = match &prefetched {
            Some(h) if h.chain.namespace() == namespace => h.chain.clone(),
            _ => Chain::of(namespace, bs, &prompt[..reusable]),
        };
        let resident = self.resident()?.take(&chain, prompt, reusable)?;
        let device_tokens = resident.as_ref().map_or(0, |h| h.tokens);
        let first = device_tokens / bs;
        report.lookup_s = t.elapsed().as_secs_f64();
        let mut host = match prefetched {
            Some(mut h) if h.chain.namespace() == namespace && h.first <= first => {
                // Its store lookup ran on an I/O worker while the request was queued (or
                // while admission waited for the load, which `restore_s` bills): adding it
                // here would count that time twice in the TTFT's parts.
                report.prefetched = true;
                h.skip_to(first);
                h
            }
            _ => {
                let h = self.load_host_from(chain, prompt, first, None)?;
                report.lookup_s += h.lookup_s;
                report.restore_s += h.load_s;
                h
            }
        };
        report.ram_blocks_skipped = host.ram_skipped;
        report.ssd_blocks_skipped = host.ssd_skipped;
        report.remote_blocks_skipped = host.remote_skipped;
        report.stopped = host.stopped.clone();

        let t = Instant::now();
        let mut cache = match resident {
            Some(h) => {
                report.device_handover = h.handed_over;
                report.device_shared = h.shared;
                h.cache
            }
            None => self.empty_cache_for(prompt.len())?,
        };
        // Where this request could be resumed from later: its prompt's last full block (an
        // agent's next turn replaces the reply), and a point it resumed from whose window
        // the store holds trimmed (published whole again below).
        let mut ends = vec![prompt.len() / bs * bs];
        let store_end = (first + host.blocks.len()) * bs;
        let mut tiers = host.tiers;
        // The store holds more than the device: continue from the device's last whole
        // block (its partial block, if any, is dropped and comes back from the store). A
        // hybrid's device hit that kept no layer state at that block keeps the device hit.
        if (first + host.blocks.len()) * bs > device_tokens
            && cache.trim(device_tokens - first * bs).is_ok()
        {
            // Staged by the I/O worker for the cache it expected (restore_staged checks that
            // this is it), or assembled here.
            let restored = match host.staged.take() {
                Some(staged) => {
                    let (staged, _charge) = *staged;
                    let staged_s = staged.seconds();
                    let restored = cache.restore_staged(staged, &host.blocks)?;
                    if restored.staged {
                        report.staged_s = staged_s;
                    }
                    restored
                }
                None => cache.restore_onto(&host.blocks)?,
            };
            if let Some(e) = &restored.stopped {
                report.stopped = Some(e.to_string());
            }
            report.state_recomputed_tokens = restored.state_cut * bs;
            report.window_recomputed_tokens = restored.window_cut * bs;
            if restored.window_cut > 0 {
                // The store's run ended where a window reads trimmed blocks: the blocks
                // recomputed up to there are published whole, replacing them.
                ends.push(store_end);
            }
            tiers.truncate(restored.blocks);
            let restored_blocks = restored.blocks;
            cache = restored.cache;
            report.cached_device_tokens = first * bs;
            // No wait for the device here. The restored blocks are already in device memory
            // (the upload waited for its own copies, on a stream of its own), and a run that
            // continues a pool the request already holds (its device-tier hit: under the
            // Mooncake trace nearly every request's first blocks) is appended by ops that
            // join the request's first prefill step. Evaluating those here queued them on
            // the default stream behind the decode step computed ahead, and the engine
            // thread waited for that step and any prefill pass before it: 0.2-1.3 s stalls
            // of every decoding row at bursts of RAM hits (docs/benchmarks.md, session 41).
            if restored_blocks > 0 {
                let seconds = t.elapsed().as_secs_f64();
                report.import_s = seconds;
                // The fit is of the import's cost on the engine thread: an I/O worker staged
                // the host half (staged_s) while the request waited for admission, which is
                // passed over it until the load is done, so the rows decoding and the
                // requests behind it never wait for that half. Billing it here priced
                // restores at about 3x their engine cost on the H200 (16.5 + 7.7 ms against
                // 7.7 at the medians) and had 11 % of the prompt tokens recomputed though
                // cached (docs/benchmarks.md, session 31).
                let mut costs = self.costs.lock().map_err(|_| poisoned())?;
                costs.import.record(restored_blocks, 0, seconds);
            }
        } else {
            tiers.clear();
            report.cached_device_tokens = device_tokens;
            // Resumed here: if the store may hold the window before it trimmed (a fork
            // from the inside of a sequence), it is published again, whole.
            if cache.republish_window(device_tokens) {
                ends.push(device_tokens / bs * bs);
            }
        }
        // A device hit handed over keeps the capacity of its earlier, shorter prompt: grown
        // once here for this one, not chunk by chunk in the prefill's steps.
        cache.reserve_room(crate::sequence::prompt_room(prompt.len()))?;
        cache.set_restorable_ends(&ends);
        report.restore_s += t.elapsed().as_secs_f64();
        let count = |tier: Tier| tiers.iter().filter(|t| **t == tier).count();
        report.cached_ram_tokens = count(Tier::Ram) * bs;
        report.cached_ssd_tokens = count(Tier::Ssd) * bs;
        report.cached_remote_tokens = count(Tier::Remote) * bs;
        report.cached_tokens = cache.offset();
        if self.state_layers > 0 {
            report.state_restored_tokens = report.cached_tokens;
        }
        Ok(Prepared {
            cache,
            chain: host.chain,
            report,
        })
    }

    /// Publishes the full blocks `cache` holds that are not yet published to the store as
    /// host bytes; `tokens` are the token ids it holds (prompt and generated), `chain` the
    /// keys from [`Self::prepare_in`] (extended here). Returns how many blocks were
    /// published. The device copies are taken here; reading them to the host and inserting
    /// them finishes on the export thread (engine/src/export.rs), before the next lookup.
    pub fn publish(
        &self,
        chain: &mut Chain,
        cache: &mut PagedKvCache,
        tokens: &[u32],
    ) -> Result<usize> {
        let held = &tokens[..cache.offset().min(tokens.len())];
        let n = if self.host_tiers && !self.exclusive {
            self.export(chain, cache, held)?
        } else {
            // Nothing on the host could keep a block (the device tier is the whole cache),
            // or an exclusive device tier exports it when its sequence leaves: the device
            // tier's index needs only the chain's keys.
            chain.extend(held);
            0
        };
        let namespace = chain.namespace();
        let mut recent = self.recent.lock().map_err(|_| poisoned())?;
        recent.retain(|(ns, s)| *ns != namespace || !held.starts_with(s));
        recent.insert(0, (namespace, held.to_vec()));
        recent.truncate(RECENT_SEQUENCES);
        Ok(n)
    }

    /// The device half of [`Self::publish`]: device copies of the new full blocks (and of
    /// window-trimmed replacements) handed to the export thread; returns how many blocks.
    fn export(&self, chain: &mut Chain, cache: &mut PagedKvCache, held: &[u32]) -> Result<usize> {
        let per_block = self.description.trimmed_bytes_per_block() as usize;
        let mut trimmed = 0;
        // An export the export thread has no room for is skipped (counted there): the
        // engine thread never waits for host copies.
        let n = match cache.export(chain, held)? {
            Some(export) => {
                let (n, t) = (export.blocks(), export.window_trimmed_blocks());
                if self.exporter.submit(export) {
                    trimmed += t;
                    n
                } else {
                    0
                }
            }
            None => 0,
        };
        // Blocks this sequence stored whole and moved past: trimmed copies replace them.
        if let Some(export) = cache.window_trimmed(chain, held)? {
            let t = export.blocks();
            if self.exporter.submit(export) {
                trimmed += t;
            }
        }
        self.window_trimmed_bytes
            .fetch_add((trimmed * per_block) as u64, Ordering::Relaxed);
        Ok(n)
    }

    /// Runs the restore path once on synthetic blocks, on the calling thread, and sets the
    /// import estimate's prior from it when this device has none. Call it where restores
    /// will run (the engine does, on its thread, before its first request): the first
    /// restore of a process otherwise pays the thread pool's start, the page-locked host
    /// buffers of the calling thread and MLX's first kernels of the path (on the H200, the
    /// 13-turn session's worst turn was that first restore: 2.2x of recomputing it).
    /// Two runs of each size are made; the second of each is timed, as a real restore is
    /// (assembled, moved and made real on the device). Returns the prior it measured.
    /// With host tiers it first page-locks the staging pool's buffers
    /// ([`cache::prewarm_staging`]) and the calling thread's two transfer buffers
    /// ([`cache::prewarm_scratch`]; CUDA only), and the block memory the host tiers' budgets
    /// size (or `KVSTORE_PINNED_BLOCKS_MIB`; [`cache::prewarm_block_memory`]), so that no
    /// request pays a page-locking driver call, which can hold up the engine thread's
    /// launches while it runs.
    pub fn warm_restore(&self) -> Result<Option<Fit>> {
        if self.host_tiers {
            if mlx::direct_transfers() {
                let c = self.store.config();
                let queue = if self.store.ssd().is_some() {
                    c.queue_bytes
                } else {
                    0
                };
                cache::allow_block_memory(cache::block_memory_for(
                    cache::requested_block_memory(),
                    c.ram_budget,
                    queue,
                ));
            }
            let locked = cache::prewarm_staging()
                + cache::prewarm_scratch(2)
                + cache::prewarm_block_memory();
            if locked > 0 {
                tracing::debug!(
                    bytes = locked,
                    "page-locked the restore staging and transfer buffers"
                );
            }
        }
        // Every block a snapshot block (a hybrid's restore keeps only runs that end in one).
        let specs: Vec<&store::PlaneSpec> = self
            .description
            .planes
            .iter()
            .chain(&self.description.state_planes)
            .collect();
        let block_bytes = block_bytes(&self.description);
        // A run large enough that each layer part is assembled by several threads on a GPU
        // (cache/src/host.rs: 4 MiB a part), as a long prefix's restore is.
        let run: u64 = if mlx::gpu_available().unwrap_or(false) {
            256 << 20
        } else {
            16 << 20
        };
        // Within the device KV budget (two of them are held at once while the next is made).
        let budget = self.resident.lock().map_err(|_| poisoned())?.budget();
        let run = run.min(budget / 4);
        let n = (run / block_bytes).clamp(2, 1024) as usize;
        let bs = self.paged.block_size;
        // One chain, linked as a real one is (the restore checks the links).
        let mut parent = *self.namespace.as_bytes();
        let blocks: Vec<Block> = (0..n)
            .map(|i| {
                let meta = store::BlockMeta::new(self.namespace, parent, i as u32, vec![0; bs]);
                parent = *meta.key.as_bytes();
                meta
            })
            .map(|meta| Block {
                meta,
                planes: specs
                    .iter()
                    .map(|p| {
                        let len = p.byte_len().unwrap_or(0) as usize;
                        // Small non-zero values (untouched zero pages read faster than
                        // any block does), the same bit pattern in every element type.
                        store::Plane::new(&p.name, p.dtype, p.shape.clone(), vec![1u8; len])
                    })
                    .collect(),
            })
            .collect();
        let restore = |count: usize| -> Result<(usize, f64)> {
            let t = Instant::now();
            let restored = self.empty_cache()?.restore_onto(&blocks[..count])?;
            self.eval_pools(&restored.cache)?;
            Ok((restored.blocks, t.elapsed().as_secs_f64()))
        };
        restore(n)?;
        restore(1)?;
        let (many, t_many) = restore(n)?;
        let (one, t_one) = restore(1)?;
        // A restore that kept fewer blocks than it was given says nothing about a real one.
        if one != 1 || many != n {
            return Ok(None);
        }
        let per_block = ((t_many - t_one) / (many - 1) as f64).max(0.0);
        let prior = Fit {
            fixed_s: (t_one - per_block).max(0.0),
            per_unit_s: per_block,
            per_position_s: 0.0,
        };
        let mut costs = self.costs.lock().map_err(|_| poisoned())?;
        if costs.import.is_unknown() {
            costs.import.set_prior(prior);
        }
        Ok(Some(prior))
    }

    /// Whether restores decide by the estimates (not `restore_always`) and the estimate
    /// knows nothing of prefill yet (no sample saved or measured, no prior): what
    /// [`crate::warm_up::warm_prefill`] is for.
    pub(crate) fn prefill_is_unknown(&self) -> bool {
        !self.restore_always && self.costs.lock().is_ok_and(|c| c.prefill.is_unknown())
    }

    /// Sets the prefill estimate's prior (used until requests measure it) where nothing is
    /// known of it yet.
    pub(crate) fn set_prefill_prior(&self, prior: Fit) {
        if let Ok(mut c) = self.costs.lock() {
            if c.prefill.is_unknown() {
                c.prefill.set_prior(prior);
            }
        }
    }

    /// Evaluates every layer's pool of `cache` (a restore's arrays made real on the device).
    fn eval_pools(&self, cache: &PagedKvCache) -> Result<()> {
        for l in 0..self.layers {
            if let Some(pool) = cache.pool(l) {
                let arrays: Vec<&mlx::Array> = pool.arrays().iter().collect();
                mlx::eval(&arrays)?;
            }
        }
        Ok(())
    }

    /// A fresh cache for this model's sequences: its layers, state layers, snapshots and
    /// windows.
    pub(crate) fn empty_cache(&self) -> Result<PagedKvCache> {
        self.cache_with(self.paged)
    }

    /// [`Self::empty_cache`] for a sequence whose prompt is `tokens` long: its pools are
    /// made at once with room for the prompt ([`cache::PagedConfig::with_room_for`],
    /// [`crate::sequence::prompt_room`]), not grown step by step through the prefill.
    pub(crate) fn empty_cache_for(&self, tokens: usize) -> Result<PagedKvCache> {
        self.cache_with(
            self.paged
                .with_room_for(crate::sequence::prompt_room(tokens)),
        )
    }

    fn cache_with(&self, config: cache::PagedConfig) -> Result<PagedKvCache> {
        let cache = PagedKvCache::new(self.layers, config)?
            .with_state_layers(self.state_layers)
            .with_state_snapshots(self.state_every);
        Ok(match self.windows.is_empty() {
            true => cache,
            false => cache.with_windows(&self.windows)?,
        })
    }

    /// Window-layer bytes that blocks published so far left out (window-trimmed blocks and
    /// trimmed copies of blocks a sequence moved past).
    pub fn window_trimmed_bytes(&self) -> u64 {
        self.window_trimmed_bytes.load(Ordering::Relaxed)
    }

    /// Publishes what `cache` holds (as [`Self::publish`]) and keeps it resident on the
    /// device for the next request that shares its prefix. Returns how many blocks were
    /// published.
    pub fn retire(
        &self,
        mut chain: Chain,
        mut cache: PagedKvCache,
        tokens: &[u32],
    ) -> Result<usize> {
        let held = &tokens[..cache.offset().min(tokens.len())];
        let n = self.publish(&mut chain, &mut cache, held)?;
        let evicted = {
            let mut r = self.resident()?;
            r.park(chain, held.to_vec(), cache);
            r.take_evicted()
        };
        self.export_evicted(evicted);
        self.save_costs(false);
        Ok(n)
    }

    /// Records a measured prefill for the restore-or-recompute estimate: `tokens` new tokens
    /// after `cached` ones took `seconds` (the request's fixed part included: the fit
    /// separates it).
    pub fn record_prefill(&self, tokens: usize, cached: usize, seconds: f64) {
        if let Ok(mut c) = self.costs.lock() {
            c.prefill.record(tokens, cached, seconds);
        }
    }

    fn diverged_at(&self, namespace: NamespaceId, prompt: &[u32]) -> Option<usize> {
        let recent = self.recent.lock().ok()?;
        recent
            .iter()
            .filter(|(ns, _)| *ns == namespace)
            .map(|(_, s)| s.iter().zip(prompt).take_while(|(a, b)| a == b).count())
            .max()
    }
}

fn not_writable(e: &std::io::Error) -> bool {
    use std::io::ErrorKind;
    matches!(
        e.kind(),
        ErrorKind::ReadOnlyFilesystem | ErrorKind::PermissionDenied
    )
}

fn poisoned() -> EngineError {
    EngineError::Poisoned("prefix cache")
}

/// Generates after `prompt` reusing cached prefixes: restore, prefill the rest, generate,
/// publish, in the caller's thread, through the engine's steps and publication (as the
/// [`Engine`](crate::Engine)'s worker runs a row; alone, the sequence publishes once, when
/// it ends). Without a prefix cache it runs cold on a fresh paged cache (same code path).
pub fn generate_with_reuse(
    model: &Model,
    tokenizer: &Tokenizer,
    prefix: Option<&KvTiers>,
    prompt: &[u32],
    params: &GenerateParams,
    on_token: &mut dyn FnMut(TokenEvent<'_>) -> bool,
) -> Result<(Generation, ReuseReport)> {
    let mut seq = Sequence::alone(model, prompt, params)?;
    let (mut cache, chain, mut report) = match prefix {
        Some(p) => {
            let p = p.prepare(prompt)?;
            (p.cache, Some(p.chain), p.report)
        }
        None => {
            let cfg = ReuseConfig::default();
            let paged = PagedConfig {
                block_size: cfg.block_size,
                format: cfg.kv_format,
                initial_blocks: 16,
                max_blocks: cfg.max_blocks,
            };
            let cache = model.empty_cache(paged)?;
            let report = ReuseReport {
                prompt_tokens: prompt.len(),
                ..ReuseReport::default()
            };
            (cache, None, report)
        }
    };
    seq.set_cached(&cache)?;
    mlx::reset_peak_memory()?;
    prefill_alone(&mut seq, model, &mut cache)?;
    seq.prefilled(prefix, &mut report);
    let mut generation = decode_streaming(&mut seq, model, tokenizer, &mut cache, on_token)?;
    // One TTFT: the report's, what the user waited for (lookup and restore included).
    generation.timings.ttft_s = report.ttft_s;
    if let (Some(p), Some(chain)) = (prefix, chain) {
        seq.retire(p, chain, cache, &mut report)?;
    }
    Ok((generation, report))
}
