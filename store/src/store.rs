//! The [`Store`] facade: RAM tier over SSD tier, joined by a write-behind worker, with an
//! optional remote tier (Redis) behind both, fed by a publisher thread.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::block::{now_unix_ms, Block, BlockMeta, LayoutError};
use crate::clock::{UseClock, UsedAt};
use crate::codec::DecodeError;
use crate::error::{InsertError, OpenError, RegisterError, WriteError};
use crate::eviction::EvictionPolicy;
use crate::fs::{FileSystem, RealFs};
use crate::key::{block_key, BlockKey, NamespaceId};
use crate::namespace::NamespaceDescription;
use crate::pins::{PinnedBytes, Pins};
use crate::queued_bytes::QueuedBytes;
use crate::ram::{Evicted, RamTier};
use crate::read_ahead::{ReadAhead, SsdReaders};
use crate::remote::{RemoteConfig, RemoteTier};
use crate::ssd::{is_storage_full, PutJob, ReadOutcome, SsdOptions, SsdTier};
use crate::stats::{Counters, StoreStats};

/// When blocks reach the SSD tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum WritePolicy {
    /// Blocks are written when the RAM tier evicts them, and on [`Store::flush`].
    #[default]
    WriteBack,
    /// Blocks are queued for writing as soon as they are inserted.
    WriteThrough,
}

/// Configuration of a [`Store`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct StoreConfig {
    /// Directory of the SSD tier; `None` keeps blocks in RAM only.
    pub root: Option<PathBuf>,
    /// RAM tier budget in bytes.
    pub ram_budget: u64,
    /// SSD tier budget in physical bytes.
    pub ssd_budget: u64,
    /// When blocks are written to SSD.
    pub write_policy: WritePolicy,
    /// Jobs the write-behind queue holds (writes and recency updates) before further spills
    /// are skipped (and counted).
    pub queue_capacity: usize,
    /// Bytes of blocks the write-behind queue holds, on top of the RAM budget (blocks that
    /// left RAM and wait for the SSD), before further spills are skipped (and counted). A
    /// prompt's blocks leave RAM in a burst when the next prompt is published: the bound
    /// must hold a burst, or the disk idles between bursts while spills are lost.
    pub queue_bytes: u64,
    /// Open the SSD tier read-only (no lock, no writes); the RAM tier still works.
    pub read_only: bool,
    /// A remote tier (Redis) behind RAM and SSD; `None` keeps the store local.
    pub remote: Option<RemoteConfig>,
    /// The store's threads that read and verify SSD block files ahead of prefix loads,
    /// shared by all loads; 1 reads them one at a time on the loading thread.
    pub ssd_readers: usize,
    /// Which block the RAM and SSD tiers give up when full, and whether a new block may
    /// take its place.
    pub eviction: EvictionPolicy,
}

/// Default bound on the bytes of blocks waiting in the write-behind queue: 1 GiB. At 64
/// jobs, bursts of 1.5 MB blocks (a 4K-token prompt of SmolLM2 leaving RAM at once) dropped
/// 62 % of spills on the H200 while the writer averaged 150 MB/s, a quarter of what it
/// reached at shutdown (docs/benchmarks.md, session 25).
pub const DEFAULT_QUEUE_BYTES: u64 = 1 << 30;

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            root: None,
            ram_budget: 1 << 30,
            ssd_budget: 16 << 30,
            write_policy: WritePolicy::WriteBack,
            queue_capacity: 4096,
            queue_bytes: DEFAULT_QUEUE_BYTES,
            read_only: false,
            remote: None,
            ssd_readers: crate::read_ahead::SSD_READERS,
            eviction: EvictionPolicy::default(),
        }
    }
}

impl StoreConfig {
    /// Directory of the SSD tier. Default: none (RAM only).
    pub fn root(mut self, root: impl AsRef<Path>) -> Self {
        self.root = Some(root.as_ref().to_owned());
        self
    }

    /// RAM tier budget in bytes. Default: 1 GiB.
    pub fn ram_budget(mut self, bytes: u64) -> Self {
        self.ram_budget = bytes;
        self
    }

    /// SSD tier budget in physical bytes. Default: 16 GiB.
    pub fn ssd_budget(mut self, bytes: u64) -> Self {
        self.ssd_budget = bytes;
        self
    }

    /// When blocks are written to SSD. Default: [`WritePolicy::WriteBack`].
    pub fn write_policy(mut self, policy: WritePolicy) -> Self {
        self.write_policy = policy;
        self
    }

    /// Capacity of the write-behind queue, in jobs (at least 1). Default: 4096.
    pub fn queue_capacity(mut self, jobs: usize) -> Self {
        self.queue_capacity = jobs;
        self
    }

    /// Bytes of blocks the write-behind queue holds (one block at least, whatever its
    /// size). Default: [`DEFAULT_QUEUE_BYTES`].
    pub fn queue_bytes(mut self, bytes: u64) -> Self {
        self.queue_bytes = bytes;
        self
    }

    /// Threads reading SSD block files ahead of prefix loads, started with the store and
    /// shared by its loads (at least 1; 1 reads on the loading thread, one file at a time, as
    /// a rotating disk prefers). Default: 8.
    pub fn ssd_readers(mut self, threads: usize) -> Self {
        self.ssd_readers = threads.max(1);
        self
    }

    /// The eviction policy of the RAM and SSD tiers (docs/prefix-reuse.md, "Eviction").
    /// Default: [`EvictionPolicy::FreqAdmit`].
    pub fn eviction(mut self, policy: EvictionPolicy) -> Self {
        self.eviction = policy;
        self
    }

    /// Open the SSD tier read-only. Default: false.
    pub fn read_only(mut self, read_only: bool) -> Self {
        self.read_only = read_only;
        self
    }

    /// A remote tier behind RAM and SSD. Default: none.
    pub fn remote(mut self, remote: Option<RemoteConfig>) -> Self {
        self.remote = remote;
        self
    }
}

/// Where a block was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Tier {
    /// The RAM tier (or the write-behind queue).
    Ram,
    /// The SSD tier.
    Ssd,
    /// The remote tier (Redis).
    Remote,
}

/// The longest run of consecutive requested keys that are present.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrefixHit {
    /// Blocks of the run found in RAM.
    pub ram_blocks: usize,
    /// Blocks of the run found only on SSD.
    pub ssd_blocks: usize,
    /// Blocks of the run found only in the remote tier (not yet fetched nor verified).
    pub remote_blocks: usize,
    /// The tier of each block of the run, in order.
    pub tiers: Vec<Tier>,
}

impl PrefixHit {
    /// Length of the run.
    pub fn blocks(&self) -> usize {
        self.tiers.len()
    }
}

/// Why a block failed validation on load.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BlockProblem {
    /// The file (or remote value) failed verification (checksum, header, truncation); a
    /// file was quarantined.
    #[error("corrupt file: {0}")]
    Corrupt(DecodeError),
    /// The block belongs to another namespace.
    #[error("belongs to namespace {0}")]
    Namespace(NamespaceId),
    /// The block has another key.
    #[error("has key {0}")]
    Key(BlockKey),
    /// The block's tokens are not the requested ones.
    #[error("holds other token ids")]
    Tokens,
    /// The block's parent is not the previous block.
    #[error("parent is not the previous block")]
    Parent,
    /// The block's position does not follow the previous block's.
    #[error("position {found}, expected {expected}")]
    Position {
        /// Expected position.
        expected: u32,
        /// Found position.
        found: u32,
    },
    /// The planes do not match the namespace's layout.
    #[error(transparent)]
    Layout(LayoutError),
}

/// Why a load stopped before the last requested key.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum StopReason {
    /// The block at `index` is in neither tier.
    Missing {
        /// Index into the requested keys.
        index: usize,
    },
    /// The block at `index` failed validation.
    Invalid {
        /// Index into the requested keys.
        index: usize,
        /// Where it was read from.
        tier: Tier,
        /// What was wrong.
        problem: BlockProblem,
    },
    /// Fewer token lists than keys were passed.
    NoTokens {
        /// Index of the first key without tokens.
        index: usize,
    },
    /// The namespace is neither registered nor described on disk.
    UnknownNamespace,
}

/// What [`Store::load_in_order`] walks over and where it puts the blocks.
struct Walk<'a, T> {
    keys: &'a [BlockKey],
    tokens_per_block: &'a [T],
    ahead: &'a mut ReadAhead,
    out: &'a mut LoadedPrefix,
    each: &'a mut dyn FnMut(usize, &Arc<Block>, Tier),
}

/// The valid prefix a load returned.
pub struct LoadedPrefix {
    /// Validated blocks in order, each with the tier it came from.
    pub blocks: Vec<(Arc<Block>, Tier)>,
    /// Why the load stopped early; `None` when every requested block was returned.
    pub stopped: Option<StopReason>,
    /// Seconds spent fetching from the remote tier (the pipelined round trip and the
    /// codec's verification); 0 when nothing was asked of it.
    pub remote_s: f64,
}

impl std::fmt::Debug for LoadedPrefix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadedPrefix")
            .field(
                "blocks",
                &self.blocks.iter().map(|(_, t)| *t).collect::<Vec<_>>(),
            )
            .field("stopped", &self.stopped)
            .finish()
    }
}

/// Jobs of the write-behind worker. A block's [`UsedAt`] is its last use in the RAM tier:
/// the SSD tier ranks it by that use's stamp, not as its newest block
/// ([`SsdTier::put_at`]), and records that use's time as its last access.
enum Job {
    Write(Arc<Block>, UsedAt),
    /// A block to write in place of the SSD's copy of its key when that holds other planes
    /// ([`SsdTier::replace`]); written like [`Job::Write`] when the SSD has none.
    Replace(Arc<Block>, UsedAt),
    /// A block that left the RAM tier while the SSD held it: written only if the SSD no
    /// longer does when the job runs (its SSD recency is left as it is). The worker decides,
    /// not the evicting thread: the SSD copy seen at eviction time may be evicted by writes
    /// still queued before this job, and the block would be lost from both tiers.
    Spill(Arc<Block>, UsedAt),
    /// A stored block published again (then): a use of it (recency, and its count under
    /// the frequency policies).
    Touch(NamespaceId, BlockKey, UsedAt),
    /// Re-applies a chain's recency (each key with its stamp) after the writes queued
    /// before it.
    TouchChain(NamespaceId, Vec<(BlockKey, UsedAt)>),
    Flush(SyncSender<()>),
}

enum RemoteJob {
    Put(Arc<Block>),
    /// Pinned keys of a namespace that Redis must keep at least this long.
    Extend(NamespaceId, Vec<BlockKey>, Duration),
    Flush(SyncSender<()>),
}

#[derive(Default)]
struct Failures {
    count: u64,
    last: Option<String>,
}

struct Shared<F: FileSystem> {
    config: StoreConfig,
    ram: Mutex<RamTier>,
    ssd: Option<Arc<SsdTier<F>>>,
    remote: Option<RemoteTier>,
    /// Keys no tier evicts before their pin expires.
    pins: Arc<Pins>,
    namespaces: RwLock<HashMap<NamespaceId, NamespaceDescription>>,
    /// Blocks queued for the SSD tier and not yet written; served as RAM hits meanwhile.
    pending: Mutex<HashMap<(NamespaceId, BlockKey), Arc<Block>>>,
    failures: Mutex<Failures>,
    counters: Arc<Counters>,
    /// When "write-behind queue full" was last logged (unix ms): at most one line per 10 s.
    queue_full_logged_ms: AtomicU64,
    /// Bytes of the blocks in write jobs queued or being written (bounded by
    /// `config.queue_bytes` for spills; flushes wait instead).
    queued: QueuedBytes,
    /// Bytes of the blocks queued for the remote tier or being published (bounded by
    /// `RemoteConfig::queue_bytes`).
    remote_queued: QueuedBytes,
    /// Held by the write-behind worker for each job, and by [`Store::pause_writes`].
    write_gate: Mutex<()>,
    /// Stamps recency in the RAM and SSD tiers (the SSD tier's when there is one).
    clock: UseClock,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The SSD writer held between jobs; see [`Store::pause_writes`].
pub struct WritesPaused<'a> {
    _gate: MutexGuard<'a, ()>,
}

/// The block store: a byte-bounded RAM tier of `Arc<Block>` over an optional SSD tier, with a
/// write-behind worker between them. All methods take `&self`; share it across threads.
///
/// The SSD tier runs on the file system `F` ([`RealFs`] unless a test opens the store with
/// [`Store::open_in`] on a `SimFs`).
pub struct Store<F: FileSystem = RealFs> {
    shared: Arc<Shared<F>>,
    /// Threads reading SSD files ahead of prefix loads.
    readers: SsdReaders<F>,
    tx: Option<SyncSender<Job>>,
    worker: Option<JoinHandle<()>>,
    remote_tx: Option<SyncSender<RemoteJob>>,
    remote_worker: Option<JoinHandle<()>>,
}

impl Store<RealFs> {
    /// Opens the store: the SSD tier at `config.root` (created if missing unless read-only),
    /// enforcing its budget, loading namespace descriptions, and starting the write-behind
    /// worker.
    pub fn open(config: StoreConfig) -> Result<Self, OpenError> {
        Self::open_in(RealFs, config)
    }
}

impl<F: FileSystem> Store<F> {
    /// [`Store::open`] with the SSD tier on the file system `fs`.
    pub fn open_in(fs: F, config: StoreConfig) -> Result<Self, OpenError> {
        let counters = Arc::new(Counters::default());
        let mut pins = Arc::new(Pins::new());
        let ssd = match &config.root {
            None => None,
            Some(root) => {
                let mut ssd = SsdTier::open_with(
                    fs,
                    root,
                    SsdOptions {
                        read_only: config.read_only,
                        budget: config.ssd_budget,
                    },
                    counters.clone(),
                    true,
                )?;
                // Before the budget is enforced: a restart must not evict a 24 h pin.
                pins = Arc::new(if config.read_only {
                    Pins::read_only(root)
                } else {
                    Pins::open(root)
                });
                ssd.set_pins(pins.clone());
                ssd.set_eviction(config.eviction);
                if !config.read_only {
                    let path = root.clone();
                    let to_open = |e: WriteError| OpenError::Io {
                        path: path.clone(),
                        source: std::io::Error::other(e.to_string()),
                    };
                    match ssd.set_budget(config.ssd_budget) {
                        Ok(()) => {}
                        // The budget holds in memory; only the marker's record of it is stale.
                        Err(WriteError::Io { path, source }) if is_storage_full(&source) => {
                            tracing::warn!(path = %crate::escape_path(&path), error = %source, "the file system is full: the store marker keeps the old budget");
                        }
                        Err(e) => return Err(to_open(e)),
                    }
                    ssd.enforce_budget().map_err(to_open)?;
                }
                Some(ssd)
            }
        };
        let remote = match &config.remote {
            None => None,
            Some(rc) => Some(RemoteTier::new(rc.clone(), counters.clone()).map_err(|e| {
                OpenError::RemoteUrl {
                    url: redact(&rc.url),
                    message: e.to_string(),
                }
            })?),
        };
        let namespaces = ssd
            .as_ref()
            .map(|s| s.namespaces().into_iter().map(|d| (d.id(), d)).collect())
            .unwrap_or_default();
        let clock = ssd.as_ref().map(|s| s.clock().clone()).unwrap_or_default();
        let queued = QueuedBytes::new(config.queue_bytes);
        let remote_queued = QueuedBytes::new(config.remote.as_ref().map_or(0, |r| r.queue_bytes));
        let shared = Arc::new(Shared {
            ram: Mutex::new({
                let mut ram =
                    RamTier::with_clock(config.ram_budget, config.eviction, clock.clone());
                ram.set_pins(pins.clone());
                ram
            }),
            pins,
            ssd: ssd.map(Arc::new),
            remote,
            namespaces: RwLock::new(namespaces),
            pending: Mutex::new(HashMap::new()),
            failures: Mutex::new(Failures::default()),
            counters,
            config,
            queue_full_logged_ms: AtomicU64::new(0),
            queued,
            remote_queued,
            write_gate: Mutex::new(()),
            clock,
        });
        let (tx, worker) = if shared.ssd.is_some() && !shared.config.read_only {
            let (tx, rx) = mpsc::sync_channel(shared.config.queue_capacity.max(1));
            let s = shared.clone();
            let worker = std::thread::Builder::new()
                .name("kvstore-write-behind".into())
                .spawn(move || worker_loop(s, rx))
                .map_err(OpenError::Worker)?;
            (Some(tx), Some(worker))
        } else {
            (None, None)
        };
        let (remote_tx, remote_worker) = match &shared.remote {
            Some(_) => {
                let (tx, rx) = mpsc::sync_channel(crate::remote::REMOTE_QUEUE_JOBS);
                let s = shared.clone();
                let worker = std::thread::Builder::new()
                    .name("kvstore-remote-publish".into())
                    .spawn(move || remote_loop(s, rx))
                    .map_err(OpenError::Worker)?;
                (Some(tx), Some(worker))
            }
            None => (None, None),
        };
        // Readers only where there is a disk to read.
        let readers = SsdReaders::start(if shared.ssd.is_some() {
            shared.config.ssd_readers
        } else {
            0
        })
        .map_err(OpenError::Worker)?;
        Ok(Store {
            shared,
            readers,
            tx,
            worker,
            remote_tx,
            remote_worker,
        })
    }

    /// The configuration the store was opened with.
    pub fn config(&self) -> &StoreConfig {
        &self.shared.config
    }

    /// The SSD tier, if configured.
    pub fn ssd(&self) -> Option<&SsdTier<F>> {
        self.shared.ssd.as_deref()
    }

    /// Pins `keys` of `ns` for `ttl` in every tier ([`Pins::pin`]), the remote tier
    /// included: there a key published with a TTL (`RemoteConfig::ttl_secs`) is kept at
    /// least as long as its pin (`EXPIRE … GT` for keys already there, a longer `EX` for
    /// keys published later). Redis's own `maxmemory` eviction is not under a client's
    /// control. Returns how many keys were newly pinned or extended.
    pub fn pin(&self, ns: NamespaceId, keys: &[BlockKey], ttl: Duration, durable: bool) -> usize {
        let n = self.shared.pins.pin(ns, keys, ttl, durable);
        if let Some(tx) = &self.remote_tx {
            if tx
                .try_send(RemoteJob::Extend(ns, keys.to_vec(), ttl))
                .is_err()
            {
                Counters::inc(&self.shared.counters.remote_queue_full);
            }
        }
        n
    }

    /// The pins every tier of this store spares from eviction (share them with the
    /// device tier, which lives outside the store).
    pub fn pins(&self) -> &Arc<Pins> {
        &self.shared.pins
    }

    /// What is pinned now, and the bytes of it each tier holds.
    pub fn pinned_bytes(&self) -> PinnedBytes {
        PinnedBytes {
            keys: self.shared.pins.len(),
            ram_bytes: lock(&self.shared.ram).pinned_bytes(),
            ssd_bytes: self.shared.ssd.as_deref().map_or(0, SsdTier::pinned_bytes),
        }
    }

    /// Registers a namespace (writing `<root>/<ns>/namespace.json` when writable) and
    /// returns its id. Idempotent.
    pub fn register_namespace(
        &self,
        desc: &NamespaceDescription,
    ) -> Result<NamespaceId, RegisterError> {
        if desc.block_size == 0 {
            return Err(RegisterError::Invalid("block_size is 0".into()));
        }
        if desc.planes.is_empty() {
            return Err(RegisterError::Invalid("no planes".into()));
        }
        let mut seen = std::collections::HashSet::new();
        for p in desc.planes.iter().chain(&desc.state_planes) {
            if p.name.is_empty() || p.name.contains(',') || !seen.insert(&p.name) {
                return Err(RegisterError::Invalid(format!(
                    "plane name {:?} is empty, contains ',' or repeats",
                    p.name
                )));
            }
            if p.byte_len().is_none() {
                return Err(RegisterError::Invalid(format!(
                    "plane {:?} shape overflows",
                    p.name
                )));
            }
        }
        // Trimmed blocks leave planes out; they never add or reorder any.
        let mut rest = desc.planes.iter();
        if !desc
            .trimmed_planes
            .iter()
            .all(|t| rest.by_ref().any(|p| p == t))
        {
            return Err(RegisterError::Invalid(
                "trimmed planes are not a subsequence of the planes".into(),
            ));
        }
        let id = match &self.shared.ssd {
            Some(ssd) => ssd.write_namespace(desc)?,
            None => desc.id(),
        };
        self.shared
            .namespaces
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, desc.clone());
        Ok(id)
    }

    /// The description of a known namespace.
    pub fn namespace(&self, id: NamespaceId) -> Option<NamespaceDescription> {
        self.shared
            .namespaces
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&id)
            .cloned()
    }

    /// Inserts a published block into the RAM tier. Checks the namespace, key derivation,
    /// token count and plane layout first. RAM evictions are queued for the SSD tier
    /// without blocking; with [`WritePolicy::WriteThrough`] the block itself is queued too.
    /// In a namespace with window-trimmed blocks (docs/cache.md, "Window layers"), a
    /// trimmed block whose key is stored already is not inserted (the stored copy may
    /// carry window planes a tail needs), and a whole block replaces a stored trimmed copy
    /// as [`Store::insert_replacing`] does.
    pub fn insert(&self, payload: Arc<Block>) -> Result<(), InsertError> {
        self.insert_or_replace(payload, false)
    }

    /// Inserts `payload` as [`Store::insert`] does, in place of a stored block of the same
    /// key that carries other planes: a window-trimmed copy of a block whose window planes
    /// no continuation reads any more, or a whole block where a trimmed copy is stored
    /// (docs/cache.md, "Window layers"). The RAM tier holds the new copy at once; the SSD
    /// copy is rewritten by the write-behind worker (atomically, renamed over the old
    /// file), whatever the write policy; the remote tier's is overwritten.
    pub fn insert_replacing(&self, payload: Arc<Block>) -> Result<(), InsertError> {
        self.insert_or_replace(payload, true)
    }

    fn insert_or_replace(&self, payload: Arc<Block>, replace: bool) -> Result<(), InsertError> {
        let meta = &payload.meta;
        let (ns, key) = (meta.namespace, meta.key);
        let desc = self
            .namespace(ns)
            .ok_or(InsertError::UnknownNamespace(ns))?;
        let computed = block_key(&meta.parent, &meta.tokens);
        if computed != key {
            return Err(InsertError::Key { key, computed });
        }
        if meta.tokens.len() != desc.block_size as usize {
            return Err(InsertError::Layout {
                key,
                source: Box::new(LayoutError::ByteLength {
                    name: "tokens".into(),
                    expected: desc.block_size as u64,
                    found: meta.tokens.len() as u64,
                }),
            });
        }
        let specs = payload.plane_specs();
        desc.check_planes(&specs)
            .map_err(|source| InsertError::Layout {
                key,
                source: Box::new(source),
            })?;
        let stored = || {
            lock(&self.shared.pending).contains_key(&(ns, key))
                || self
                    .shared
                    .ssd
                    .as_ref()
                    .is_some_and(|s| s.contains(ns, key))
        };
        let mut replace = replace;
        if !replace && !desc.trimmed_planes.is_empty() {
            if desc.is_trimmed(&specs) {
                // A stored copy of the key may carry the window planes another sequence's
                // tail needs: a trimmed one never displaces it.
                if lock(&self.shared.ram).contains(ns, key) || stored() {
                    return Ok(());
                }
            } else {
                // A whole copy replaces a trimmed one wherever one is stored (a tier
                // holding the same planes only refreshes it).
                replace = true;
            }
        }
        let evicted = lock(&self.shared.ram).insert(payload.clone());
        // Written through, the block is queued after the spills below (see there).
        let through = self.shared.config.write_policy == WritePolicy::WriteThrough;
        if !through && replace && stored() {
            // The SSD copy (or the one queued) is another layout: replace it now, as a
            // later spill of the RAM copy would find the key stored and skip it.
            self.enqueue(payload.clone(), true, self.use_now());
        } else if let Some(tx) = self.tx.as_ref().filter(|_| !through) {
            if stored() {
                // Re-published while stored or queued: the SSD copy is recent again.
                // Recency only, so a full queue just skips it; if the SSD copy is evicted
                // meanwhile, the RAM copy is spilled again on eviction or flush.
                let _ = tx.try_send(Job::Touch(ns, key, self.use_now()));
            }
        }
        let displaced = !evicted.is_empty();
        self.spill(evicted);
        if through {
            // The worker writes it, or only refreshes its recency if it is stored by then,
            // stamped after the blocks it displaced (their spills above): the insert is the
            // later event, and its SSD copy must not rank below theirs, or a full SSD gives
            // up the newest insert first (found by `store_under_freq_admit_matches_a_map_model`:
            // Put 3, 19, 14, 0, Get 14, Put 8, Get 14, reopen lost 8).
            self.enqueue(payload.clone(), replace, self.use_now());
        }
        if displaced {
            // The blocks it displaced were stamped as they left, after this insert's use:
            // the insert is the later event, and a write-back flush must not write its block
            // as older than them (the SSD would then give it up first).
            let used = self.use_now();
            lock(&self.shared.ram).touch_at(ns, key, used);
        }
        self.publish_remote(payload);
        Ok(())
    }

    /// Queues a block for the remote tier without blocking; a queue without room for its
    /// bytes (`RemoteConfig::queue_bytes`) or jobs skips it. Its bytes count until the
    /// publisher has put it.
    fn publish_remote(&self, p: Arc<Block>) {
        if let Some(tx) = &self.remote_tx {
            let bytes = p.data_len();
            let queued = self.shared.remote_queued.try_add(bytes);
            if queued && tx.try_send(RemoteJob::Put(p)).is_ok() {
                return;
            }
            if queued {
                self.shared.remote_queued.release(bytes);
            }
            Counters::inc(&self.shared.counters.remote_skipped);
            Counters::inc(&self.shared.counters.remote_queue_full);
        }
    }

    fn spill(&self, evicted: Vec<Evicted>) {
        // An eviction reaches the SSD as of the time it left RAM, as a victim cache takes
        // it (the SSD keeps what RAM let go, newest first); its RAM recency would rank it
        // below blocks the SSD took long ago, and freq-admit's evictions (RAM's least
        // valuable, not its oldest) would then never be written (docs/benchmarks.md, "With
        // the store-wide use clock": 1.07x the hits). Blocks leave leaves first, so the
        // stamps keep a chain's root no older than its leaves. Write-back flushes keep
        // RAM's recency (`flush`): RAM still holds those blocks. Either way the SSD records
        // the block's last use in RAM as its last access (what `gc --older-than` reads).
        for Evicted { block: p, used } in evicted {
            let used = UsedAt {
                stamp: self.shared.clock.tick(),
                unix_ms: used.unix_ms,
            };
            Counters::inc(&self.shared.counters.ram_evictions);
            let m = &p.meta;
            // A block already on SSD keeps its SSD recency: every use (load, touch_chain,
            // re-insert) has refreshed it there too, and touching it now, leaves first,
            // would rank a chain's evicted leaves above its ancestors. Whether it is still
            // there is for the worker to see when the job runs (`Job::Spill`).
            let on_ssd = self
                .shared
                .ssd
                .as_ref()
                .is_some_and(|s| s.contains(m.namespace, m.key));
            if on_ssd {
                self.enqueue_spill_check(p, used);
            } else if self.enqueue(p, false, used) {
                Counters::inc(&self.shared.counters.spills);
            }
        }
    }

    /// A use of a block now: the store clock's next stamp and the wall-clock time.
    fn use_now(&self) -> UsedAt {
        UsedAt::now(self.shared.clock.tick())
    }

    /// Queues a [`Job::Spill`] without blocking: the block left RAM while the SSD held it,
    /// and the worker writes it only if the SSD no longer does when the job runs. It is not
    /// served from `pending` meanwhile (the SSD copy serves it); a full queue skips it.
    fn enqueue_spill_check(&self, p: Arc<Block>, used: UsedAt) {
        let bytes = p.data_len();
        self.try_queue(Job::Spill(p, used), bytes);
    }

    /// Queues a write (in place of the SSD's copy when `replace`) of a block last used at
    /// `used` without blocking; returns whether it was queued.
    fn enqueue(&self, p: Arc<Block>, replace: bool, used: UsedAt) -> bool {
        if self.tx.is_none() {
            return false;
        }
        let k = (p.meta.namespace, p.meta.key);
        let bytes = p.data_len();
        // In `pending` before the worker can take the job (it removes it once written).
        lock(&self.shared.pending).insert(k, p.clone());
        let job = if replace {
            Job::Replace(p, used)
        } else {
            Job::Write(p, used)
        };
        let queued = self.try_queue(job, bytes);
        if !queued {
            lock(&self.shared.pending).remove(&k);
        }
        queued
    }

    /// Queues a write job of a block of `bytes` without blocking if the write-behind queue
    /// has room for it, by bytes (a block always fits an empty queue) and by jobs; counts it
    /// as skipped (or, without a worker, as a write error) if not. Returns whether it was
    /// queued; its bytes count until the worker has written it.
    fn try_queue(&self, job: Job, bytes: u64) -> bool {
        let Some(tx) = &self.tx else {
            return false;
        };
        if !self.shared.queued.try_add(bytes) {
            self.skipped_for_a_full_queue();
            return false;
        }
        let Err(e) = tx.try_send(job) else {
            return true;
        };
        self.shared.queued.release(bytes);
        match e {
            TrySendError::Full(_) => self.skipped_for_a_full_queue(),
            TrySendError::Disconnected(_) => Counters::inc(&self.shared.counters.write_errors),
        }
        false
    }

    /// Counts a write skipped because the queue was full, and says so at most every 10 s.
    fn skipped_for_a_full_queue(&self) {
        Counters::inc(&self.shared.counters.skipped_queue_full);
        let now = crate::block::now_unix_ms();
        let last = self.shared.queue_full_logged_ms.load(Ordering::Relaxed);
        if now.saturating_sub(last) >= 10_000
            && self
                .shared
                .queue_full_logged_ms
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            tracing::warn!(
                dropped_total = Counters::get(&self.shared.counters.skipped_queue_full),
                "write-behind queue full: blocks leaving RAM are dropped instead of written to SSD (the disk is slower than publication); logged at most every 10 s"
            );
        }
    }

    /// Marks a chain as just used in both tiers, from its last block back to its first, so
    /// that its root is the most recent block and eviction (RAM, SSD, `gc --max-bytes`)
    /// takes the chain's leaves before their ancestors. Call it after inserting a turn's new
    /// blocks, with the conversation's whole chain (`keys` root first, as
    /// [`chain_keys`](crate::chain_keys) returns them); absent keys are skipped.
    /// [`Store::load_prefix`] does the same for what it loads.
    pub fn touch_chain(&self, ns: NamespaceId, keys: &[BlockKey]) {
        // One stamp per key for both tiers, so the root is the most recent of the chain
        // wherever its blocks are (a tier touched after the other would rank all its
        // copies above the other's).
        let now = now_unix_ms();
        let stamped: Vec<(BlockKey, UsedAt)> = keys
            .iter()
            .rev()
            .map(|&k| {
                let used = UsedAt {
                    stamp: self.shared.clock.tick(),
                    unix_ms: now,
                };
                (k, used)
            })
            .collect();
        {
            let mut ram = lock(&self.shared.ram);
            for &(key, used) in &stamped {
                ram.touch_at(ns, key, used);
            }
        }
        let Some(ssd) = &self.shared.ssd else {
            return;
        };
        if ssd.is_read_only() {
            return;
        }
        for &(key, used) in &stamped {
            ssd.touch_at(ns, key, used);
        }
        let queued = {
            let pending = lock(&self.shared.pending);
            keys.iter().any(|k| pending.contains_key(&(ns, *k)))
        };
        if let (true, Some(tx)) = (queued, &self.tx) {
            // Blocks still queued land on SSD with their older RAM stamps: redo the chain
            // after them. Recency only, so a full queue just skips it.
            let _ = tx.try_send(Job::TouchChain(ns, stamped));
        }
    }

    /// Whether a remote tier is configured: a lookup then asks it over the network.
    pub fn has_remote(&self) -> bool {
        self.shared.remote.is_some()
    }

    /// The longest run of consecutive `keys` present (RAM, then SSD, then the remote tier),
    /// without reading payloads or changing recency. The keys after the local run are
    /// asked of the remote tier in one pipelined round trip (EXISTS); an unreachable remote
    /// tier adds nothing.
    pub fn lookup(&self, ns: NamespaceId, keys: &[BlockKey]) -> PrefixHit {
        let mut hit = PrefixHit::default();
        let ram = lock(&self.shared.ram);
        let pending = lock(&self.shared.pending);
        for &key in keys {
            if ram.contains(ns, key) || pending.contains_key(&(ns, key)) {
                hit.ram_blocks += 1;
                hit.tiers.push(Tier::Ram);
            } else if self
                .shared
                .ssd
                .as_ref()
                .is_some_and(|s| s.contains(ns, key))
            {
                hit.ssd_blocks += 1;
                hit.tiers.push(Tier::Ssd);
            } else {
                break;
            }
        }
        drop((ram, pending));
        if let Some(remote) = &self.shared.remote {
            let rest = &keys[hit.blocks()..];
            if let Some(present) = remote.exists(ns, rest) {
                let run = present.iter().take_while(|p| **p).count();
                hit.remote_blocks = run;
                hit.tiers.extend(std::iter::repeat_n(Tier::Remote, run));
            }
        }
        hit
    }

    /// Loads the longest valid prefix of `keys`: each block is validated (namespace, key,
    /// tokens against `tokens_per_block[i]`, parent chain, position, plane layout; SSD
    /// blocks also checksum) and the load stops at the first missing or invalid one. SSD
    /// hits are promoted into RAM. The loaded blocks are then marked used as by
    /// [`Store::touch_chain`], so the chain's root is the last of them to be evicted.
    pub fn load_prefix<T: AsRef<[u32]>>(
        &self,
        ns: NamespaceId,
        keys: &[BlockKey],
        tokens_per_block: &[T],
    ) -> LoadedPrefix {
        self.load_prefix_each(ns, keys, tokens_per_block, |_, _, _| {})
    }

    /// [`load_prefix`](Self::load_prefix), handing each block to `each` as soon as it is
    /// validated (and promoted), in chain order: `each(index, block, tier)` for index 0,
    /// 1, … up to the block before the one the load stops at, so a consumer can import
    /// the first blocks while the later ones are still being read. `each` runs on the
    /// calling thread and cannot stop the load; the returned [`LoadedPrefix`] holds the
    /// same blocks and the same stop reason as `load_prefix` would.
    pub fn load_prefix_each<T, E>(
        &self,
        ns: NamespaceId,
        keys: &[BlockKey],
        tokens_per_block: &[T],
        mut each: E,
    ) -> LoadedPrefix
    where
        T: AsRef<[u32]>,
        E: FnMut(usize, &Arc<Block>, Tier),
    {
        let mut out = LoadedPrefix {
            blocks: Vec::with_capacity(keys.len()),
            stopped: None,
            remote_s: 0.0,
        };
        let Some(desc) = self.namespace(ns) else {
            out.stopped = (!keys.is_empty()).then_some(StopReason::UnknownNamespace);
            return out;
        };
        let c = &self.shared.counters;
        let since = |t: Instant, counter: &AtomicU64| {
            Counters::add(counter, t.elapsed().as_micros() as u64);
            Instant::now()
        };
        let started = Instant::now();
        // The SSD files this load will read, in order: every key up to the first that no
        // local tier holds, less those in RAM. Readers fetch and verify them in parallel.
        let plan = self.ssd_read_plan(ns, keys);
        let t = since(started, &c.load_plan_us);
        let mut ahead = self
            .readers
            .start_load(self.shared.ssd.as_ref(), ns, keys, &plan);
        since(t, &c.load_start_us);
        let mut walk = Walk {
            keys,
            tokens_per_block,
            ahead: &mut ahead,
            out: &mut out,
            each: &mut each,
        };
        self.load_in_order(ns, &desc, &mut walk);
        let t = Instant::now();
        // Readers finish the file in hand and take no other.
        drop(ahead);
        let t = since(t, &c.load_join_us);
        self.touch_chain(ns, &keys[..out.blocks.len()]);
        since(t, &c.load_touch_us);
        since(started, &c.load_us);
        out
    }

    /// Indices of the `keys` a load will read from SSD: those not in RAM, up to the first
    /// key in no local tier.
    fn ssd_read_plan(&self, ns: NamespaceId, keys: &[BlockKey]) -> Vec<usize> {
        let Some(ssd) = &self.shared.ssd else {
            return Vec::new();
        };
        let mut plan = Vec::new();
        for (index, &key) in keys.iter().enumerate() {
            let in_ram = lock(&self.shared.ram).contains(ns, key)
                || lock(&self.shared.pending).contains_key(&(ns, key));
            if in_ram {
                continue;
            }
            if !ssd.contains(ns, key) {
                break;
            }
            plan.push(index);
        }
        plan
    }

    /// [`load_prefix`](Self::load_prefix)'s walk over the chain: each block from RAM, the
    /// read-ahead (SSD) or the remote tier, checked in order, promoted into RAM.
    fn load_in_order<T: AsRef<[u32]>>(
        &self,
        ns: NamespaceId,
        desc: &NamespaceDescription,
        walk: &mut Walk<'_, T>,
    ) {
        let Walk {
            keys,
            tokens_per_block,
            ahead,
            out,
            each,
        } = walk;
        let keys: &[BlockKey] = keys;
        let c = &self.shared.counters;
        let mut first_position = None;
        let mut remote_batch = None;
        for (index, &key) in keys.iter().enumerate() {
            let Some(tokens) = tokens_per_block.get(index) else {
                out.stopped = Some(StopReason::NoTokens { index });
                break;
            };
            let tokens = tokens.as_ref();
            let prev = index.checked_sub(1).map(|i| keys[i]);
            let check = |meta: &BlockMeta, specs: &[crate::PlaneSpec]| {
                validate(
                    meta,
                    ns,
                    key,
                    tokens,
                    prev,
                    first_position.map(|p: u32| p + index as u32),
                )
                .and_then(|()| desc.check_planes(specs).map_err(BlockProblem::Layout))
            };
            let in_ram = lock(&self.shared.ram)
                .get(ns, key)
                .or_else(|| lock(&self.shared.pending).get(&(ns, key)).cloned());
            if let Some(p) = in_ram {
                if let Err(problem) = check(&p.meta, &p.plane_specs()) {
                    lock(&self.shared.ram).remove(ns, key);
                    out.stopped = Some(StopReason::Invalid {
                        index,
                        tier: Tier::Ram,
                        problem,
                    });
                    break;
                }
                Counters::inc(&c.ram_hits);
                first_position.get_or_insert(p.meta.position);
                each(index, &p, Tier::Ram);
                out.blocks.push((p, Tier::Ram));
                continue;
            }
            Counters::inc(&c.ram_misses);
            let waited = Instant::now();
            let local = match (ahead.take(index), &self.shared.ssd) {
                (Some(outcome), _) => outcome,
                (None, Some(ssd)) => ssd.read(ns, key, false),
                (None, None) => ReadOutcome::Miss,
            };
            Counters::add(&c.load_wait_us, waited.elapsed().as_micros() as u64);
            let (block, tier) = match local {
                ReadOutcome::Hit(b) => (b, Tier::Ssd),
                ReadOutcome::Miss => {
                    match self.fetch_remote(ns, keys, index, &mut remote_batch, &mut out.remote_s) {
                        Some(Ok(b)) => (b, Tier::Remote),
                        Some(Err(problem)) => {
                            out.stopped = Some(StopReason::Invalid {
                                index,
                                tier: Tier::Remote,
                                problem,
                            });
                            break;
                        }
                        None => {
                            out.stopped = Some(StopReason::Missing { index });
                            break;
                        }
                    }
                }
                ReadOutcome::Corrupt { error, .. } => {
                    out.stopped = Some(StopReason::Invalid {
                        index,
                        tier: Tier::Ssd,
                        problem: BlockProblem::Corrupt(error),
                    });
                    break;
                }
            };
            let specs: Vec<_> = block.planes.iter().map(|p| p.spec()).collect();
            if let Err(problem) = check(&block.meta, &specs) {
                if tier == Tier::Remote {
                    Counters::inc(&c.remote_verify_failures);
                    Counters::inc(&c.remote_misses);
                    tracing::warn!(%key, %problem, "remote block refused");
                }
                out.stopped = Some(StopReason::Invalid {
                    index,
                    tier,
                    problem,
                });
                break;
            }
            if tier == Tier::Remote {
                Counters::inc(&c.remote_hits);
                Counters::add(&c.remote_bytes_read, block.data_len());
            }
            let position = block.meta.position;
            let p = Arc::new(block);
            first_position.get_or_insert(position);
            let promoted = Instant::now();
            let evicted = lock(&self.shared.ram).insert(p.clone());
            Counters::inc(&c.promotions);
            self.spill(evicted);
            Counters::add(&c.load_promote_us, promoted.elapsed().as_micros() as u64);
            each(index, &p, tier);
            out.blocks.push((p, tier));
        }
    }

    /// The verified-by-codec block `keys[index]` from the remote tier, fetching every key
    /// from `index` on in one pipelined round trip the first time (kept in `batch`).
    /// `None` is a miss (absent or unreachable); `Some(Err)` a value that failed
    /// verification. The caller still checks namespace, key, tokens and layout.
    fn fetch_remote(
        &self,
        ns: NamespaceId,
        keys: &[BlockKey],
        index: usize,
        batch: &mut Option<(usize, Vec<Option<Vec<u8>>>)>,
        seconds: &mut f64,
    ) -> Option<Result<crate::Block, BlockProblem>> {
        let t = std::time::Instant::now();
        let r = self.fetch_remote_timed(ns, keys, index, batch);
        *seconds += t.elapsed().as_secs_f64();
        r
    }

    fn fetch_remote_timed(
        &self,
        ns: NamespaceId,
        keys: &[BlockKey],
        index: usize,
        batch: &mut Option<(usize, Vec<Option<Vec<u8>>>)>,
    ) -> Option<Result<crate::Block, BlockProblem>> {
        let remote = self.shared.remote.as_ref()?;
        let c = &self.shared.counters;
        let (base, values) = batch.get_or_insert_with(|| {
            let t = std::time::Instant::now();
            let values = remote.get(ns, &keys[index..]);
            if values.is_some() {
                Counters::inc(&c.remote_fetches);
                Counters::add(&c.remote_fetch_us, t.elapsed().as_micros() as u64);
            }
            (index, values.unwrap_or_default())
        });
        let Some(bytes) = index
            .checked_sub(*base)
            .and_then(|i| values.get_mut(i))
            .and_then(Option::take)
        else {
            Counters::inc(&c.remote_misses);
            return None;
        };
        match crate::codec::decode(bytes::Bytes::from(bytes)) {
            Ok(b) => Some(Ok(b)),
            Err(e) => {
                Counters::inc(&c.remote_verify_failures);
                Counters::inc(&c.remote_misses);
                tracing::warn!(key = %keys[index], error = %e, "remote block failed verification; not served");
                Some(Err(BlockProblem::Corrupt(e)))
            }
        }
    }

    /// Stops the write-behind worker between two jobs until the guard is dropped: once this
    /// returns no SSD write is in progress and none starts, so the store directory can be
    /// copied consistently (call [`flush`](Self::flush) first for a complete copy). Inserts
    /// and lookups go on; new writes queue, and those beyond the queue are skipped and
    /// counted as with a slow disk. A [`flush`](Self::flush) made while paused waits for
    /// the guard.
    pub fn pause_writes(&self) -> WritesPaused<'_> {
        WritesPaused {
            _gate: lock(&self.shared.write_gate),
        }
    }

    /// Returns once everything accepted so far is durable on SSD: with write-back, every
    /// RAM block not yet on SSD is queued (this may block), then the queue is drained and
    /// the access journal synced. Fails if any write since the previous flush failed.
    /// Without an SSD tier (or read-only) there is nothing to persist and it returns `Ok`.
    pub fn flush(&self) -> Result<(), WriteError> {
        if let Some(tx) = &self.remote_tx {
            // Publication is best effort: waiting for the queue just makes it observable.
            let (ack_tx, ack_rx) = mpsc::sync_channel(1);
            if tx.send(RemoteJob::Flush(ack_tx)).is_ok() {
                let _ = ack_rx.recv();
            }
        }
        let (Some(tx), Some(ssd)) = (&self.tx, &self.shared.ssd) else {
            return Ok(());
        };
        if self.shared.config.write_policy == WritePolicy::WriteBack {
            // Each block with its RAM recency (a chain's blocks no older than those below
            // them), in the RAM tier's eviction order (leaves before their root, so equal
            // stamps rank the root more recent): the SSD tier ranks them among its own
            // blocks by when they were used, not as newer than everything it holds.
            let resident = lock(&self.shared.ram).snapshot_stamped();
            for Evicted { block: p, used } in resident.into_iter().rev() {
                let k = (p.meta.namespace, p.meta.key);
                // The worker decides: it is the only thread that writes or evicts, so it
                // sees whether the block is still stored when the job runs.
                lock(&self.shared.pending).insert(k, p.clone());
                // A flush waits for room instead of skipping: counted, not bounded.
                self.shared.queued.add(p.data_len());
                let job = Job::Write(p, used);
                if tx.send(job).is_err() {
                    return Err(WriteError::WorkerGone);
                }
            }
        }
        let (ack_tx, ack_rx) = mpsc::sync_channel(1);
        tx.send(Job::Flush(ack_tx))
            .map_err(|_| WriteError::WorkerGone)?;
        ack_rx.recv().map_err(|_| WriteError::WorkerGone)?;
        let failures = std::mem::take(&mut *lock(&self.shared.failures));
        ssd.sync()?;
        if failures.count > 0 {
            return Err(WriteError::Incomplete {
                failed: failures.count,
                last: failures.last.unwrap_or_default(),
            });
        }
        Ok(())
    }

    /// Flushes, then stops the worker.
    pub fn close(mut self) -> Result<(), WriteError> {
        let r = self.flush();
        self.shutdown();
        r
    }

    fn shutdown(&mut self) {
        self.readers.shutdown();
        self.remote_tx = None;
        if let Some(w) = self.remote_worker.take() {
            let _ = w.join();
        }
        self.tx = None;
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }

    /// The cost model saved for namespace `ns` by [`Store::save_costs`] (opaque bytes);
    /// `None` without an SSD tier or when none was saved.
    pub fn costs(&self, ns: NamespaceId) -> Option<Vec<u8>> {
        self.shared.ssd.as_ref()?.read_costs(ns)
    }

    /// Saves namespace `ns`'s cost model so that later processes start from it; a no-op
    /// without an SSD tier.
    pub fn save_costs(&self, ns: NamespaceId, bytes: &[u8]) -> std::io::Result<()> {
        match &self.shared.ssd {
            Some(ssd) => ssd.write_costs(ns, bytes).map(|_| ()),
            None => Ok(()),
        }
    }

    /// A snapshot of sizes and counters.
    pub fn stats(&self) -> StoreStats {
        let mut s = StoreStats::from_counters(&self.shared.counters);
        {
            let ram = lock(&self.shared.ram);
            s.ram_blocks = ram.len() as u64;
            s.ram_bytes = ram.used_bytes();
            s.ram_budget = ram.budget();
            s.ram_not_admitted = ram.not_admitted();
        }
        if let Some(ssd) = &self.shared.ssd {
            s.ssd_blocks = ssd.len() as u64;
            s.ssd_bytes = ssd.used_bytes();
            s.ssd_budget = ssd.budget();
        }
        s.remote_enabled = self.shared.remote.is_some();
        s
    }
}

impl<F: FileSystem> Drop for Store<F> {
    /// Drains the queue (blocks already accepted for writing are written) and joins the
    /// worker. RAM-only blocks are not written: call [`Store::flush`] first to keep them.
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn validate(
    meta: &BlockMeta,
    ns: NamespaceId,
    key: BlockKey,
    tokens: &[u32],
    prev: Option<BlockKey>,
    position: Option<u32>,
) -> Result<(), BlockProblem> {
    if meta.namespace != ns {
        return Err(BlockProblem::Namespace(meta.namespace));
    }
    if meta.key != key {
        return Err(BlockProblem::Key(meta.key));
    }
    if meta.tokens != tokens || block_key(&meta.parent, &meta.tokens) != key {
        return Err(BlockProblem::Tokens);
    }
    match prev {
        Some(prev) if meta.parent != prev.0 => return Err(BlockProblem::Parent),
        None if meta.position == 0 && meta.parent != ns.0 => return Err(BlockProblem::Parent),
        _ => {}
    }
    if let Some(expected) = position {
        if meta.position != expected {
            return Err(BlockProblem::Position {
                expected,
                found: meta.position,
            });
        }
    }
    Ok(())
}

fn worker_loop<F: FileSystem>(shared: Arc<Shared<F>>, rx: Receiver<Job>) {
    let Some(ssd) = &shared.ssd else {
        return;
    };
    let mut next: Option<Job> = None;
    loop {
        let job = match next.take() {
            Some(j) => j,
            None => match rx.recv() {
                Ok(j) => j,
                Err(_) => return,
            },
        };
        let _gate = lock(&shared.write_gate);
        let first = match job {
            Job::Write(p, used) => Write::new(p, used, true, false),
            Job::Replace(p, used) => Write::new(p, used, true, true),
            Job::Spill(p, used) => Write::new(p, used, false, false),
            Job::Touch(ns, key, used) => {
                ssd.reuse(ns, key, used);
                continue;
            }
            Job::TouchChain(ns, stamped) => {
                for (key, used) in stamped {
                    ssd.touch_at(ns, key, used);
                }
                continue;
            }
            Job::Flush(ack) => {
                let _ = ack.send(());
                continue;
            }
        };
        // The writes queued right behind it go in the same group commit (one flush of the
        // disk for all of them). A recency refresh of blocks outside the group is applied
        // at once (re-published blocks come between spills under load, and each would
        // otherwise end the group: groups of a few blocks, a disk flush each); a flush, or
        // a refresh of a block in the group, waits until the group is written. A key
        // already in the group ends it: its second job runs after the first is written.
        let mut group = vec![first];
        while group.len() < GROUP_WRITES {
            let Ok(job) = rx.try_recv() else {
                break;
            };
            let in_group =
                |ns: NamespaceId, key: BlockKey| group.iter().any(|w| w.id() == (ns, key));
            let write = match &job {
                Job::Write(p, used) => Write::new(p.clone(), *used, true, false),
                Job::Replace(p, used) => Write::new(p.clone(), *used, true, true),
                Job::Spill(p, used) => Write::new(p.clone(), *used, false, false),
                Job::Touch(ns, key, used) if !in_group(*ns, *key) => {
                    ssd.reuse(*ns, *key, *used);
                    continue;
                }
                Job::TouchChain(ns, stamped) if !stamped.iter().any(|(k, _)| in_group(*ns, *k)) => {
                    for &(key, used) in stamped {
                        ssd.touch_at(*ns, key, used);
                    }
                    continue;
                }
                _ => {
                    next = Some(job);
                    break;
                }
            };
            if group.iter().any(|w| w.id() == write.id()) {
                next = Some(job);
                break;
            }
            group.push(write);
        }
        let bytes: u64 = group.iter().map(|w| w.block.data_len()).sum();
        let t = std::time::Instant::now();
        write_group(&shared, ssd, group);
        Counters::add(
            &shared.counters.write_busy_us,
            t.elapsed().as_micros() as u64,
        );
        shared.queued.release(bytes);
    }
}

/// Writes the write-behind worker takes into one group commit at most.
const GROUP_WRITES: usize = 64;

/// A write job of the write-behind worker.
struct Write {
    block: Arc<Block>,
    /// Its last use in the RAM tier.
    used: UsedAt,
    /// A Write or Replace job (its block is in `pending`); a Spill job is not.
    refresh: bool,
    replace: bool,
}

impl Write {
    fn new(block: Arc<Block>, used: UsedAt, refresh: bool, replace: bool) -> Self {
        Write {
            block,
            used,
            refresh,
            replace,
        }
    }

    fn id(&self) -> (NamespaceId, BlockKey) {
        (self.block.meta.namespace, self.block.meta.key)
    }
}

/// Writes `group` (distinct keys) to the SSD tier as one group commit
/// ([`SsdTier::put_many`]); a block the SSD holds already is only touched (a Write job) or
/// left alone (a Spill job), as one at a time.
fn write_group<F: FileSystem>(shared: &Shared<F>, ssd: &SsdTier<F>, group: Vec<Write>) {
    let mut todo: Vec<Write> = Vec::with_capacity(group.len());
    for w in group {
        let k = w.id();
        if !w.replace && ssd.contains(k.0, k.1) {
            if w.refresh {
                ssd.touch_at(k.0, k.1, w.used);
                lock(&shared.pending).remove(&k);
            }
            continue;
        }
        todo.push(w);
    }
    let jobs: Vec<PutJob<'_>> = todo
        .iter()
        .map(|w| PutJob {
            block: &w.block,
            replace: w.replace,
            used: Some(w.used),
        })
        .collect();
    if !jobs.is_empty() {
        Counters::inc(&shared.counters.group_commits);
    }
    let results = ssd.put_many(&jobs);
    for (w, result) in todo.iter().zip(results) {
        let k = w.id();
        if w.refresh {
            lock(&shared.pending).remove(&k);
        }
        if let Err(e) = result {
            Counters::inc(&shared.counters.write_errors);
            tracing::warn!(key = %k.1, error = %e, "write-behind failed");
            let mut f = lock(&shared.failures);
            f.count += 1;
            f.last = Some(e.to_string());
        }
    }
}

/// Publishes queued blocks to the remote tier. While Redis is unreachable (in backoff) the
/// puts fail fast and are counted as skipped; nothing waits for Redis but this thread.
fn remote_loop<F: FileSystem>(shared: Arc<Shared<F>>, rx: Receiver<RemoteJob>) {
    let Some(remote) = &shared.remote else {
        return;
    };
    let c = &shared.counters;
    for job in rx {
        match job {
            RemoteJob::Put(p) => {
                publish(&shared, remote, &p);
                shared.remote_queued.release(p.data_len());
            }
            RemoteJob::Extend(ns, keys, ttl) => {
                if !remote.extend(ns, &keys, ttl.as_secs() + 1) {
                    Counters::inc(&c.remote_publish_errors);
                }
            }
            RemoteJob::Flush(ack) => {
                let _ = ack.send(());
            }
        }
    }
}

/// Puts one block in the remote tier for the publisher thread, counting what happened.
fn publish<F: FileSystem>(shared: &Shared<F>, remote: &RemoteTier, p: &Block) {
    let c = &shared.counters;
    let m = &p.meta;
    let bytes = match crate::codec::encode(p) {
        Ok(bytes) => bytes,
        Err(e) => {
            tracing::warn!(key = %m.key, error = %e, "block not encodable for the remote tier");
            Counters::inc(&c.remote_skipped);
            Counters::inc(&c.remote_publish_errors);
            return;
        }
    };
    let pinned = shared.pins.remaining(m.namespace, m.key);
    if remote.put(m.namespace, m.key, &bytes, pinned) {
        Counters::inc(&c.remote_blocks_written);
        Counters::add(&c.remote_bytes_written, bytes.len() as u64);
    } else {
        Counters::inc(&c.remote_skipped);
        Counters::inc(&c.remote_publish_errors);
    }
}

/// `url` without its credentials (`redis://user:secret@host` → `redis://***@host`), for
/// messages and reports.
pub fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => format!("{}://***@{}", &url[..s], &url[at + 1..]),
        _ => url.to_string(),
    }
}
