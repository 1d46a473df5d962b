//! The SSD tier: one safetensors file per block under `<root>/<namespace>/<k0k1>/<key>`,
//! a physical byte budget with eviction by the store's [`EvictionPolicy`], an access journal
//! that persists the recency order, quarantine for files that fail verification, and one
//! writer per root.
//!
//! Recency is a stamp of the store's [`UseClock`], shared with the RAM tier: a block the
//! store writes for RAM (a spill, a flush: [`SsdTier::put_at`]) keeps the stamp of its last
//! use there, and blocks are ordered by stamp (an ordered set, O(log n) per use), which the
//! access journal persists. Under LRU and freq-admit the least recently used block leaves
//! first. Under LFU a write, a read hit and a re-publication are uses the policy counts (a
//! touch only refreshes recency) and the least used block leaves first, ties by recency;
//! the counts live in memory, so after a restart every block counts 0 and the order starts
//! as LRU's.
//!
//! The SSD tier has no gate of its own: it is the last local tier, so a block it refused
//! would be lost to this machine, and it sees only what leaves the RAM tier (a block's hits
//! in RAM never reach it), too little to judge a newcomer by. Freq-admit's gate is the RAM
//! tier's; behind it the SSD keeps recency order, so the most recently used blocks (those
//! just refused by RAM among them) are the last to go, and a flush keeps the most recent
//! block. In recency order a block older than every block it would displace is the first
//! to go, so it is not written ([`WriteOutcome::NotAdmitted`]); under LFU every block is.
//! Counting uses on SSD too (LFU's order) got the same hits in the CPU replay of
//! docs/benchmarks.md and lost just-refused blocks to older popular ones at the next
//! flush.
//!
//! Write path (crash cases in docs/store-format.md): encode into `tmp/`, fsync the file,
//! rename into place, fsync the directory. A failed fsync or rename poisons the writer.
//!
//! Every file operation goes through the tier's [`FileSystem`] (`RealFs` unless a test
//! opens it on a `SimFs` with [`SsdTier::open_in`]).

use std::collections::{BTreeSet, HashMap};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use serde::{Deserialize, Serialize};

use crate::block::{now_unix_ms, Block};
use crate::clock::{UseClock, UsedAt};
use crate::codec::{self, DecodeError, EncodeError};
use crate::error::{OpenError, RegisterError, WriteError};
use crate::eviction::{EvictionPolicy, PolicyState, Rank};
use crate::format;
use crate::fs::{FileKind, FileStat, FileSystem, LockError, ReadAt, RealFs, WritableFile};
use crate::journal::{self, Journal, Record};
use crate::key::{BlockKey, NamespaceId};
use crate::namespace::NamespaceDescription;
use crate::pins::Pins;
use crate::stats::{Counters, StoreStats};

/// How to open an SSD tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SsdOptions {
    /// Open without the writer lock; never modifies anything on disk.
    pub read_only: bool,
    /// Physical byte budget for block files. Not enforced by `open` itself: call
    /// [`SsdTier::enforce_budget`] (the [`Store`](crate::Store) does).
    pub budget: u64,
}

/// One block file known to the tier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SsdEntry {
    /// Namespace.
    pub namespace: NamespaceId,
    /// Key.
    pub key: BlockKey,
    /// Physical bytes (allocated blocks) of the file.
    pub physical_bytes: u64,
    /// Last write or read, Unix milliseconds (from the journal, else the file's mtime).
    pub last_access_unix_ms: u64,
    /// Path of the file.
    pub path: PathBuf,
}

/// What a read found.
#[derive(Debug)]
pub enum ReadOutcome {
    /// The block, verified.
    Hit(Block),
    /// No such block.
    Miss,
    /// The file failed verification; it was quarantined (unless read-only) and is a miss.
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What was wrong.
        error: DecodeError,
    },
}

/// What a write did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteOutcome {
    /// The block was written.
    Written {
        /// Physical bytes of the new file.
        physical_bytes: u64,
    },
    /// A file for this key already existed; only its recency was updated.
    AlreadyPresent,
    /// The tier is full of more recent blocks (and pinned ones): written with its stamp
    /// ([`SsdTier::put_at`]) the block would be the first evicted, so it was not written.
    NotAdmitted,
}

#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Marker {
    pub format: String,
    pub version: u32,
    #[serde(default)]
    pub ssd_budget_bytes: Option<u64>,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    phys: u64,
    last_ms: u64,
    /// Recency: the [`UseClock`] stamp of the last write, read or touch (the journal's
    /// sequence number). A block written by a spill or flush keeps its RAM stamp.
    seq: u64,
    /// Breaks ties between equal stamps: later writes and touches count as more recent.
    tie: u64,
    /// The eviction policy's count (0 after a restart).
    count: u64,
    /// The eviction policy's use clock at the last write or read hit.
    last_use: u64,
}

impl Entry {
    fn new(phys: u64, last_ms: u64, seq: u64) -> Entry {
        Entry {
            phys,
            last_ms,
            seq,
            tie: 0,
            count: 0,
            last_use: 0,
        }
    }
}

type Id = (NamespaceId, BlockKey);

struct State<W: WritableFile> {
    index: HashMap<Id, Entry>,
    /// Every block by recency, least recent first: (stamp, tie, block).
    recency: BTreeSet<(u64, u64, Id)>,
    used: u64,
    journal: Option<Journal<W>>,
    /// While a compaction writes its file without this lock: the records appended since its
    /// snapshot, for the new journal ([`SsdTier::compact_journal`]).
    compacting: Option<Vec<Record>>,
    next_tie: u64,
    /// The eviction policy's counts and use clock.
    policy: PolicyState<Id>,
    /// Every block by the policy's rank, for the policies other than LRU (LRU evicts in
    /// `recency` order).
    ranked: BTreeSet<(Rank, u64, Id)>,
}

impl<W: WritableFile> State<W> {
    fn new(policy: EvictionPolicy) -> Self {
        State {
            index: HashMap::new(),
            recency: BTreeSet::new(),
            used: 0,
            journal: None,
            compacting: None,
            next_tie: 1,
            policy: PolicyState::new(policy),
            ranked: BTreeSet::new(),
        }
    }

    fn is_lru(&self) -> bool {
        self.policy.policy() == EvictionPolicy::Lru
    }

    fn rank(&self, e: &Entry) -> Rank {
        self.policy.rank(e.count, e.seq)
    }

    /// Adds `k`, after every block of its stamp; returns the entry it replaces, if any
    /// (the caller adjusts `used`).
    fn add(&mut self, k: Id, mut e: Entry) -> Option<Entry> {
        let old = self.forget(&k);
        e.tie = self.next_tie;
        self.next_tie += 1;
        if !self.is_lru() {
            self.ranked.insert((self.rank(&e), e.tie, k));
        }
        self.recency.insert((e.seq, e.tie, k));
        self.index.insert(k, e);
        old
    }

    /// Forgets `k` (the caller adjusts `used`).
    fn forget(&mut self, k: &Id) -> Option<Entry> {
        let e = self.index.remove(k)?;
        self.recency.remove(&(e.seq, e.tie, *k));
        if !self.is_lru() {
            let r = self.rank(&e);
            self.ranked.remove(&(r, e.tie, *k));
        }
        Some(e)
    }

    /// Applies `f` to `k`'s entry and ranks it again.
    fn update(&mut self, k: &Id, f: impl FnOnce(&mut Entry)) -> bool {
        let Some(mut e) = self.forget(k) else {
            return false;
        };
        f(&mut e);
        self.add(*k, e);
        true
    }

    /// Ranks every block again (after a policy change or freq-admit's halving).
    fn rerank_all(&mut self) {
        self.ranked = if self.is_lru() {
            BTreeSet::new()
        } else {
            self.index
                .iter()
                .map(|(k, e)| (self.policy.rank(e.count, e.seq), e.tie, *k))
                .collect()
        };
    }

    /// Blocks the tier holds when full: `budget` over the mean block file (over `size`
    /// while empty).
    fn capacity(&self, budget: u64, size: u64) -> u64 {
        let mean = match self.index.len() as u64 {
            0 => size,
            n => self.used / n,
        };
        budget / mean.max(1)
    }

    /// Counts a use of `k` (a write or a read hit); ranks every block again when
    /// freq-admit halved its counts.
    fn record_use(&mut self, k: Id, capacity: u64) -> crate::eviction::Use {
        let cached = self.index.get(&k).map(|e| e.count);
        let u = self.policy.record_use(k, cached, capacity);
        if u.halved {
            let policy = &self.policy;
            for (k, e) in self.index.iter_mut() {
                e.count = policy.count(*k);
            }
            self.rerank_all();
        }
        if let Some(mut e) = self.index.get(&k).copied() {
            if !self.is_lru() {
                let r = self.rank(&e);
                self.ranked.remove(&(r, e.tie, k));
            }
            e.count = u.count;
            e.last_use = u.at;
            if !self.is_lru() {
                self.ranked.insert((self.rank(&e), e.tie, k));
            }
            self.index.insert(k, e);
        }
        u
    }

    /// The block eviction takes next, passing over `keep` and pinned blocks (which keep
    /// their place), with its stamp.
    fn victim(&self, keep: Option<Id>, pins: &Pins) -> Option<(Id, u64)> {
        let eligible = |k: &Id| Some(*k) != keep && !pins.is_pinned(k.0, k.1);
        if self.is_lru() {
            self.recency
                .iter()
                .find(|(_, _, k)| eligible(k))
                .map(|&(seq, _, k)| (k, seq))
        } else {
            self.ranked
                .iter()
                .find(|(_, _, k)| eligible(k))
                .and_then(|&(_, _, k)| Some((k, self.index.get(&k)?.seq)))
        }
    }

    /// Every block, least recent first.
    fn by_recency(&self) -> impl Iterator<Item = (Id, &Entry)> + '_ {
        self.recency
            .iter()
            .filter_map(|(_, _, k)| Some((*k, self.index.get(k)?)))
    }
}

/// One block for [`SsdTier::put_many`]: as [`SsdTier::put_at`] (`stamp`) or
/// [`SsdTier::replace_at`] (`replace`).
#[derive(Clone, Copy, Debug)]
pub struct PutJob<'a> {
    /// The block.
    pub block: &'a Block,
    /// Written in place of a stored file of its key that holds other planes.
    pub replace: bool,
    /// Its last use: the stamp it is ranked by and the time recorded as its last access
    /// (`None`: now, the newest block).
    pub used: Option<UsedAt>,
}

/// What staging a block gave: its temp file written, an outcome without one, or nothing
/// done until the blocks staged before it are committed.
enum Staging<W> {
    Staged(Staged<W>),
    Done(WriteOutcome),
    NeedsCommit,
}

/// A block admitted and written to its temp file, not yet synced or renamed.
struct Staged<W> {
    id: Id,
    tmp: PathBuf,
    final_path: PathBuf,
    shard_dir: PathBuf,
    file: W,
    file_len: u64,
    estimate: u64,
    seq: u64,
    /// Its last access, Unix milliseconds.
    last_ms: u64,
    count: u64,
    last_use: u64,
}

impl<W> Staged<W> {
    /// The same, its file closed (after the rename).
    fn without_file(self) -> Staged<()> {
        Staged {
            id: self.id,
            tmp: self.tmp,
            final_path: self.final_path,
            shard_dir: self.shard_dir,
            file: (),
            file_len: self.file_len,
            estimate: self.estimate,
            seq: self.seq,
            last_ms: self.last_ms,
            count: self.count,
            last_use: self.last_use,
        }
    }
}

/// Threads a group commit fsyncs on at most: concurrent fsyncs let the file system (ext4's
/// journal, XFS's log) and the disk merge their flushes into one.
const SYNC_THREADS: usize = 8;

/// `f` over `items` on up to [`SYNC_THREADS`] threads (on this one for a single item);
/// the results in order.
fn parallel<T: Send, R: Send>(items: &mut [T], f: impl Fn(&mut T) -> R + Sync) -> Vec<R> {
    if items.len() <= 1 {
        return items.iter_mut().map(&f).collect();
    }
    let per = items.len().div_ceil(SYNC_THREADS);
    std::thread::scope(|scope| {
        let handles: Vec<_> = items
            .chunks_mut(per)
            .map(|chunk| {
                let f = &f;
                scope.spawn(move || chunk.iter_mut().map(f).collect::<Vec<R>>())
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    })
}

/// The SSD tier over the file system `F`. All methods take `&self`; writes are serialized
/// internally.
pub struct SsdTier<F: FileSystem = RealFs> {
    fs: F,
    root: PathBuf,
    read_only: bool,
    budget: AtomicU64,
    _lock: Option<F::Lock>,
    state: Mutex<State<F::Writer>>,
    write_lock: Mutex<()>,
    poison: Mutex<Option<String>>,
    counters: Arc<Counters>,
    tmp_seq: AtomicU64,
    /// Keys eviction skips ([`crate::Pins`]); empty until the store sets its pins.
    pins: Arc<Pins>,
    /// Stamps recency; the store shares it with its RAM tier.
    clock: UseClock,
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> OpenError + '_ {
    move |source| OpenError::Io {
        path: path.to_owned(),
        source,
    }
}

pub(crate) use crate::fs::is_storage_full;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding the lock leaves plain data behind; keep serving.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Largest marker or `namespace.json` file read: both are a few hundred bytes.
const MAX_SMALL_FILE: u64 = 1024 * 1024;

/// Creates `path` (mode 0700) if missing and fsyncs its parent; returns whether it created.
/// An existing `path` that is not a real directory (a symlink to one included) is an error.
fn ensure_dir<F: FileSystem>(fs: &F, path: &Path) -> io::Result<bool> {
    match fs.create_dir(path) {
        Ok(()) => {
            if let Some(parent) = path.parent() {
                fs.sync_dir(parent)?;
            }
            Ok(true)
        }
        // Already there: it must be a directory itself, not a link to one elsewhere.
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => fs.check_dir(path).map(|_| false),
        Err(e) => Err(e),
    }
}

/// Creates `root` and its missing parents, then fsyncs the parent of each one created so
/// the new directories survive a power cut.
fn create_root<F: FileSystem>(fs: &F, root: &Path) -> io::Result<()> {
    let missing: Vec<&Path> = root
        .ancestors()
        .take_while(|a| !a.as_os_str().is_empty() && fs.symlink_metadata(a).is_err())
        .collect();
    fs.create_dir_all(root)?;
    for dir in missing.into_iter().rev() {
        match dir.parent() {
            // A relative root's parent is the working directory.
            Some(p) if p.as_os_str().is_empty() => fs.sync_dir(Path::new("."))?,
            Some(p) => fs.sync_dir(p)?,
            None => {}
        }
    }
    Ok(())
}

/// Parses a lowercase-hex directory or file stem into a 32-byte id, canonically.
pub(crate) fn parse_canonical<T: std::str::FromStr + std::fmt::Display>(s: &str) -> Option<T> {
    let v: T = s.parse().ok()?;
    (v.to_string() == s).then_some(v)
}

/// Result of walking a store directory.
#[derive(Debug, Default)]
pub(crate) struct Scan {
    /// Block files: namespace, key, metadata, path.
    pub blocks: Vec<(NamespaceId, BlockKey, FileStat, PathBuf)>,
    /// Temporary files anywhere in the tree.
    pub temps: Vec<PathBuf>,
    /// Files that do not belong to the layout (inside namespace directories).
    pub foreign: Vec<PathBuf>,
    /// Entries at the root that the store does not know.
    pub unknown_root: Vec<PathBuf>,
    /// Namespace directories.
    pub namespaces: Vec<(NamespaceId, PathBuf)>,
    /// Files in quarantine.
    pub quarantined: Vec<PathBuf>,
}

/// Walks the store layout under `root`.
pub(crate) fn scan<F: FileSystem>(fs: &F, root: &Path) -> io::Result<Scan> {
    let mut s = Scan::default();
    for e in fs.read_dir(root)? {
        let name = e.name.as_str();
        let path = root.join(name);
        let is_dir = e.kind == FileKind::Dir;
        match name {
            format::STORE_FILE | format::LOCK_FILE | format::JOURNAL_FILE | format::PINS_FILE => {
                continue
            }
            format::TMP_DIR if is_dir => {
                for t in fs.read_dir(&path)? {
                    s.temps.push(path.join(t.name));
                }
                continue;
            }
            format::QUARANTINE_DIR if is_dir => {
                for q in fs.read_dir(&path)? {
                    s.quarantined.push(path.join(q.name));
                }
                continue;
            }
            _ => {}
        }
        let Some(ns) = parse_canonical::<NamespaceId>(name).filter(|_| is_dir) else {
            s.unknown_root.push(path);
            continue;
        };
        s.namespaces.push((ns, path.clone()));
        for shard in fs.read_dir(&path)? {
            let sname = shard.name;
            let spath = path.join(&sname);
            if (sname == format::NAMESPACE_FILE || sname == format::COSTS_FILE)
                && shard.kind == FileKind::File
            {
                continue;
            }
            let is_shard = shard.kind == FileKind::Dir
                && sname.len() == 2
                && sname
                    .bytes()
                    .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
            if !is_shard {
                if sname.ends_with(&format!(".{}", format::TMP_EXT)) {
                    s.temps.push(spath);
                } else {
                    s.foreign.push(spath);
                }
                continue;
            }
            for f in fs.read_dir(&spath)? {
                let fname = f.name;
                let fpath = spath.join(&fname);
                if fname.ends_with(&format!(".{}", format::TMP_EXT)) {
                    s.temps.push(fpath);
                    continue;
                }
                let key = fname
                    .strip_suffix(&format!(".{}", format::BLOCK_EXT))
                    .and_then(parse_canonical::<BlockKey>)
                    .filter(|k| k.to_string()[..2] == sname);
                // Not followed: a symlink under a block name is foreign, never read.
                let meta = fs.symlink_metadata(&fpath)?;
                match key {
                    Some(key) if meta.is_file() => s.blocks.push((ns, key, meta, fpath)),
                    _ => s.foreign.push(fpath),
                }
            }
        }
    }
    Ok(s)
}

/// Reads the marker file; `Ok(None)` if absent.
pub(crate) fn read_marker<F: FileSystem>(fs: &F, root: &Path) -> Result<Option<Marker>, OpenError> {
    let path = root.join(format::STORE_FILE);
    let bytes = match fs.read_capped(&path, MAX_SMALL_FILE) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(OpenError::Io { path, source: e }),
    };
    let marker: Marker =
        serde_json::from_slice(&bytes).map_err(|e| OpenError::IncompatibleFormat {
            path: path.clone(),
            found: format!("something unreadable ({e})"),
            expected: format::FORMAT_VERSION,
        })?;
    if marker.format != format::STORE_FORMAT_NAME || marker.version != format::FORMAT_VERSION {
        return Err(OpenError::IncompatibleFormat {
            path,
            found: format!("format {:?} version {}", marker.format, marker.version),
            expected: format::FORMAT_VERSION,
        });
    }
    Ok(Some(marker))
}

/// Writes `bytes` to `dir/name` atomically: temp file in `tmp_dir`, fsync, rename, fsync dir.
pub(crate) fn write_atomic<F: FileSystem>(
    fs: &F,
    tmp_dir: &Path,
    dir: &Path,
    name: &str,
    bytes: &[u8],
) -> io::Result<()> {
    let tmp = tmp_dir.join(format!(
        "{name}.{}.{}.{}",
        std::process::id(),
        now_unix_ms(),
        format::TMP_EXT
    ));
    let result = (|| {
        let mut f = fs.create_new(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        fs.rename(&tmp, &dir.join(name))?;
        fs.sync_dir(dir)
    })();
    if result.is_err() {
        let _ = fs.remove_file(&tmp);
    }
    result
}

impl SsdTier<RealFs> {
    /// Opens (creating when writable) the store at `root`.
    ///
    /// A writer takes the exclusive lock, sweeps orphaned temporary files and compacts the
    /// access journal; a read-only open touches nothing. Fails with a clear error when the
    /// directory belongs to something else, has another format version, or already has a
    /// writer.
    pub fn open(root: impl AsRef<Path>, options: SsdOptions) -> Result<SsdTier, OpenError> {
        Self::open_with(
            RealFs,
            root.as_ref(),
            options,
            Arc::new(Counters::default()),
            true,
        )
    }
}

impl<F: FileSystem> SsdTier<F> {
    /// [`SsdTier::open`] on the file system `fs` (tests use a `SimFs` to inject faults).
    pub fn open_in(fs: F, root: impl AsRef<Path>, options: SsdOptions) -> Result<Self, OpenError> {
        Self::open_with(
            fs,
            root.as_ref(),
            options,
            Arc::new(Counters::default()),
            true,
        )
    }

    pub(crate) fn open_with(
        fs: F,
        root: &Path,
        options: SsdOptions,
        counters: Arc<Counters>,
        sweep: bool,
    ) -> Result<Self, OpenError> {
        let root = root.to_owned();
        match fs.metadata(&root) {
            Ok(m) if !m.is_dir() => return Err(OpenError::NotADirectory { path: root }),
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                if options.read_only {
                    return Err(OpenError::NotFound { path: root });
                }
                create_root(&fs, &root).map_err(io_err(&root))?;
            }
            Err(e) => return Err(io_err(&root)(e)),
        }
        let marker = read_marker(&fs, &root)?;
        if marker.is_none() {
            let empty = fs.read_dir(&root).map_err(io_err(&root))?.is_empty();
            if !empty || options.read_only {
                return Err(OpenError::NotAStore {
                    path: root,
                    marker: format::STORE_FILE,
                });
            }
        }

        let lock = if options.read_only {
            None
        } else {
            let path = root.join(format::LOCK_FILE);
            Some(fs.lock(&path).map_err(|e| match e {
                LockError::Held { holder } => OpenError::Locked { path, holder },
                LockError::Io(source) => OpenError::Io { path, source },
            })?)
        };
        let tmp_dir = root.join(format::TMP_DIR);
        if !options.read_only {
            for dir in [&tmp_dir, &root.join(format::QUARANTINE_DIR)] {
                ensure_dir(&fs, dir).map_err(io_err(dir))?;
            }
            if marker.is_none() {
                let m = Marker {
                    format: format::STORE_FORMAT_NAME.into(),
                    version: format::FORMAT_VERSION,
                    ssd_budget_bytes: Some(options.budget),
                };
                let bytes = serde_json::to_vec_pretty(&m).unwrap_or_default();
                write_atomic(&fs, &tmp_dir, &root, format::STORE_FILE, &bytes)
                    .map_err(io_err(&root.join(format::STORE_FILE)))?;
            }
        }

        let scan = scan(&fs, &root).map_err(io_err(&root))?;
        if !options.read_only && sweep {
            for t in &scan.temps {
                match fs.remove_file(t) {
                    Ok(()) => Counters::inc(&counters.orphans_swept),
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                    Err(e) => return Err(io_err(t)(e)),
                }
            }
        }

        let journal_path = root.join(format::JOURNAL_FILE);
        let read = journal::read(&fs, &journal_path).map_err(io_err(&journal_path))?;
        if read.damaged && !scan.blocks.is_empty() {
            tracing::info!(path = %crate::escape_path(&journal_path), "access journal missing or torn; recency of unlisted blocks comes from file times");
        }
        // A block's last record is its recency. Its sequence number (a use-clock stamp)
        // orders it; a later record of an equal stamp is the more recent. A spill or flush
        // may append a stamp older than an earlier record of another block, never an older
        // state of the same block, so "last record" and not "largest stamp" is the state
        // (journals written before stamps had both in file order: they read the same).
        let mut last: HashMap<(NamespaceId, BlockKey), (usize, Record)> = HashMap::new();
        for (i, r) in read.records.into_iter().enumerate() {
            last.insert((r.ns, r.key), (i, r));
        }
        let mut entries: Vec<((NamespaceId, BlockKey), usize, Entry)> = scan
            .blocks
            .iter()
            .map(|(ns, key, meta, _)| {
                let (seq, at, last_ms) = match last.get(&(*ns, *key)) {
                    Some((i, r)) => (r.seq, *i, r.unix_ms),
                    None => (0, 0, meta.modified_unix_ms),
                };
                let e = Entry::new(meta.physical_bytes, last_ms, seq);
                ((*ns, *key), at, e)
            })
            .collect();
        // Journal order first; files the journal does not know are older, by mtime.
        entries.sort_by_key(|(k, at, e)| (e.seq, *at, e.last_ms, *k));
        let mut state = State::new(EvictionPolicy::Lru);
        let mut records = Vec::with_capacity(entries.len());
        for (i, (k, _, mut e)) in entries.into_iter().enumerate() {
            e.seq = i as u64 + 1;
            state.used += e.phys;
            records.push(Record {
                ns: k.0,
                key: k.1,
                seq: e.seq,
                unix_ms: e.last_ms,
            });
            state.add(k, e);
        }
        state.journal = if options.read_only {
            None
        } else {
            match Journal::rewrite(&fs, &journal_path, &tmp_dir, &records) {
                Ok(j) => Some(j),
                // A full file system must not keep a store of valid blocks from opening:
                // serve without the journal (recency falls back to file times next open).
                Err(e) if is_storage_full(&e) => {
                    tracing::warn!(path = %crate::escape_path(&journal_path), error = %e, "the file system is full: no access journal this session");
                    None
                }
                Err(e) => return Err(io_err(&journal_path)(e)),
            }
        };
        Ok(SsdTier {
            fs,
            root,
            read_only: options.read_only,
            budget: AtomicU64::new(options.budget),
            _lock: lock,
            state: Mutex::new(state),
            write_lock: Mutex::new(()),
            poison: Mutex::new(None),
            counters,
            tmp_seq: AtomicU64::new(0),
            pins: Arc::new(Pins::new()),
            clock: UseClock::starting_after(records.len() as u64),
        })
    }

    /// The clock that stamps this tier's recency (blocks are numbered 1..n at open, so
    /// its next stamp is n + 1). The store stamps its RAM tier's recency with it too.
    pub fn clock(&self) -> &UseClock {
        &self.clock
    }

    /// The store's root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Whether this handle was opened read-only.
    pub fn is_read_only(&self) -> bool {
        self.read_only
    }

    /// The physical byte budget.
    pub fn budget(&self) -> u64 {
        self.budget.load(Ordering::Relaxed)
    }

    /// Physical bytes of the block files known to the index.
    pub fn used_bytes(&self) -> u64 {
        lock(&self.state).used
    }

    /// Number of block files known to the index.
    pub fn len(&self) -> usize {
        lock(&self.state).index.len()
    }

    /// Whether the tier holds no block.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A snapshot of the SSD sizes and of the counters this tier shares.
    pub fn stats(&self) -> StoreStats {
        let mut s = StoreStats::from_counters(&self.counters);
        let st = lock(&self.state);
        s.ssd_blocks = st.index.len() as u64;
        s.ssd_bytes = st.used;
        s.ssd_budget = self.budget();
        s
    }

    /// The path a block's file has (whether or not it exists).
    pub fn block_path(&self, ns: NamespaceId, key: BlockKey) -> PathBuf {
        block_path(&self.root, ns, key)
    }

    /// Every known block, least recently used first.
    pub fn entries(&self) -> Vec<SsdEntry> {
        let st = lock(&self.state);
        st.by_recency()
            .map(|((ns, key), e)| SsdEntry {
                namespace: ns,
                key,
                physical_bytes: e.phys,
                last_access_unix_ms: e.last_ms,
                path: block_path(&self.root, ns, key),
            })
            .collect()
    }

    /// Whether a block is present, without reading it or changing its recency. A read-only
    /// handle also looks for files written after it opened.
    pub fn contains(&self, ns: NamespaceId, key: BlockKey) -> bool {
        if lock(&self.state).index.contains_key(&(ns, key)) {
            return true;
        }
        self.read_only
            && self
                .fs
                .symlink_metadata(&self.block_path(ns, key))
                .is_ok_and(|m| m.is_file())
    }

    /// Reads and verifies a block and marks it as just used. A file that fails verification
    /// is moved to quarantine (writers only), counted, and reported as
    /// [`ReadOutcome::Corrupt`].
    pub fn get(&self, ns: NamespaceId, key: BlockKey) -> ReadOutcome {
        self.read(ns, key, true)
    }

    /// [`SsdTier::get`], leaving recency to the caller when `touch` is false (a chain load
    /// refreshes the whole chain at the end, root last).
    pub(crate) fn read(&self, ns: NamespaceId, key: BlockKey, touch: bool) -> ReadOutcome {
        let path = self.block_path(ns, key);
        let known = lock(&self.state).index.contains_key(&(ns, key));
        if !known && !self.read_only {
            Counters::inc(&self.counters.ssd_misses);
            return ReadOutcome::Miss;
        }
        let started = std::time::Instant::now();
        let file = match self.fs.open_read(&path) {
            Ok(f) => f,
            Err(e) => {
                if e.kind() != io::ErrorKind::NotFound {
                    tracing::warn!(path = %crate::escape_path(&path), error = %e, "block file not read");
                }
                // Deleted behind our back (GC by another handle) or never there. Any other
                // failure (EIO) says nothing about the file: keep it and its bytes counted.
                if known && e.kind() == io::ErrorKind::NotFound {
                    let mut st = lock(&self.state);
                    if let Some(e) = st.forget(&(ns, key)) {
                        st.used -= e.phys;
                    }
                }
                Counters::inc(&self.counters.ssd_misses);
                return ReadOutcome::Miss;
            }
        };
        let len = file.len();
        let read = match len.and_then(|len| codec::read_file(&file, len)) {
            Ok(r) => r,
            Err(e) => {
                // Not evidence of corruption (e.g. EIO): a miss, file kept.
                tracing::warn!(path = %crate::escape_path(&path), error = %e, "could not read block file");
                Counters::inc(&self.counters.ssd_misses);
                return ReadOutcome::Miss;
            }
        };
        match read.and_then(|b| {
            if b.meta.namespace == ns && b.meta.key == key {
                Ok(b)
            } else {
                Err(DecodeError::Planes(format!(
                    "file holds block {} of namespace {}, not the one its path names",
                    b.meta.key, b.meta.namespace
                )))
            }
        }) {
            Ok(block) => {
                Counters::inc(&self.counters.ssd_hits);
                Counters::add(
                    &self.counters.ssd_read_us,
                    started.elapsed().as_micros() as u64,
                );
                {
                    let mut st = lock(&self.state);
                    let capacity = st.capacity(self.budget(), format::ASSUMED_FS_BLOCK);
                    st.record_use((ns, key), capacity);
                }
                if touch {
                    self.touch(ns, key);
                }
                ReadOutcome::Hit(block)
            }
            Err(error) => {
                Counters::inc(&self.counters.verify_failures);
                Counters::inc(&self.counters.ssd_misses);
                tracing::warn!(path = %crate::escape_path(&path), %error, "block failed verification");
                let path = if self.read_only {
                    path
                } else {
                    self.quarantine(ns, key, &path).unwrap_or(path)
                };
                ReadOutcome::Corrupt { path, error }
            }
        }
    }

    /// Moves a block file to quarantine and forgets it; returns the new path.
    fn quarantine(&self, ns: NamespaceId, key: BlockKey, path: &Path) -> Option<PathBuf> {
        let qdir = self.root.join(format::QUARANTINE_DIR);
        let dest = qdir.join(format!(
            "{ns}.{key}.{}.{}",
            now_unix_ms(),
            format::QUARANTINE_EXT
        ));
        let moved = self.fs.rename(path, &dest);
        {
            let mut st = lock(&self.state);
            if let Some(e) = st.forget(&(ns, key)) {
                st.used -= e.phys;
            }
        }
        match moved {
            Ok(()) => {
                Counters::inc(&self.counters.quarantined);
                Some(dest)
            }
            Err(e) => {
                tracing::warn!(path = %crate::escape_path(path), error = %e, "could not quarantine; deleting");
                let _ = self.fs.remove_file(path);
                None
            }
        }
    }

    /// Marks a block as just used (journal append; compacts the journal when it grows past
    /// four records per block).
    pub fn touch(&self, ns: NamespaceId, key: BlockKey) {
        self.touch_at(ns, key, UsedAt::now(self.clock.tick()));
    }

    /// Makes a block at least as recent as `used` (a [`UseClock`] stamp and its time, such
    /// as its last use in the RAM tier); a block already more recent keeps its place. Its
    /// last access becomes that use's time unless it records a later one.
    pub(crate) fn touch_at(&self, ns: NamespaceId, key: BlockKey, used: UsedAt) {
        let mut st = lock(&self.state);
        let Some(last_ms) = st
            .index
            .get(&(ns, key))
            .and_then(|e| (e.seq <= used.stamp).then_some(e.last_ms.max(used.unix_ms)))
        else {
            return;
        };
        let seq = used.stamp;
        st.update(&(ns, key), |e| {
            e.seq = seq;
            e.last_ms = last_ms;
        });
        let due = self.journal_append(
            &mut st,
            Record {
                ns,
                key,
                seq,
                unix_ms: last_ms,
            },
        );
        drop(st);
        if due {
            self.compact_journal();
        }
    }

    /// Counts a use of a stored block that was not read (it was published again) and marks
    /// it as just used.
    pub(crate) fn reuse(&self, ns: NamespaceId, key: BlockKey, stamp: UsedAt) {
        {
            let mut st = lock(&self.state);
            if st.index.contains_key(&(ns, key)) {
                let capacity = st.capacity(self.budget(), format::ASSUMED_FS_BLOCK);
                st.record_use((ns, key), capacity);
            }
        }
        self.touch_at(ns, key, stamp);
    }

    /// Marks the stored blocks of a chain as used, from the last key back to the first, so
    /// the root is the most recent and eviction takes the chain's leaves before its
    /// ancestors. `keys` runs root first; absent keys are skipped. No-op when read-only.
    pub fn touch_chain(&self, ns: NamespaceId, keys: &[BlockKey]) {
        if self.read_only {
            return;
        }
        for &key in keys.iter().rev() {
            self.touch(ns, key);
        }
    }

    /// Appends a record to the access journal (and to a running compaction's list).
    /// Returns whether the journal has grown past four records per block: the caller then
    /// runs [`compact_journal`](Self::compact_journal) once it has released the lock.
    #[must_use = "a due compaction runs after the lock is released"]
    fn journal_append(&self, st: &mut State<F::Writer>, r: Record) -> bool {
        let Some(j) = st.journal.as_mut() else {
            return false;
        };
        if let Err(e) = j.append(&r) {
            tracing::warn!(path = %crate::escape_path(j.path()), error = %e, "access journal append failed");
        }
        let records = j.records;
        match st.compacting.as_mut() {
            Some(later) => {
                later.push(r);
                false
            }
            None => records > 4 * st.index.len() as u64 + 1024,
        }
    }

    /// Rewrites the access journal as one record per block, in recency order. Only the
    /// snapshot and the swap take the tier's lock: the temp file's write and fsync and the
    /// directory's fsync run without it, so lookups and reads never wait for a disk flush
    /// here.
    /// Records appended meanwhile go to the old journal and, at the swap, to the new one.
    /// A failure leaves the old journal in place (the next due append tries again).
    fn compact_journal(&self) {
        let records: Vec<Record> = {
            let mut st = lock(&self.state);
            if st.journal.is_none() || st.compacting.is_some() {
                return;
            }
            st.compacting = Some(Vec::new());
            st.by_recency()
                .map(|((ns, key), e)| Record {
                    ns,
                    key,
                    seq: e.seq,
                    unix_ms: e.last_ms,
                })
                .collect()
        };
        let path = self.root.join(format::JOURNAL_FILE);
        let tmp_dir = self.root.join(format::TMP_DIR);
        let written = Journal::write_compacted(&self.fs, &path, &tmp_dir, &records);
        let installed = {
            let mut st = lock(&self.state);
            let later = st.compacting.take().unwrap_or_default();
            let installed = written.and_then(|c| {
                // No journal any more (the file system filled up meanwhile): stay without.
                if st.journal.is_none() {
                    c.discard(&self.fs);
                    return Err(io::Error::other(
                        "the access journal was given up meanwhile",
                    ));
                }
                c.install(&self.fs, &later)
            });
            installed.map(|j| st.journal = Some(j))
        };
        // The journal lives in the tier's root: its rename is durable once that is synced.
        let synced = installed.and_then(|()| self.fs.sync_dir(&self.root));
        if let Err(e) = synced {
            tracing::warn!(path = %crate::escape_path(&path), error = %e, "journal compaction failed");
        }
    }

    fn check_writable(&self) -> Result<(), WriteError> {
        if self.read_only {
            return Err(WriteError::ReadOnly {
                path: self.root.clone(),
            });
        }
        if let Some(cause) = lock(&self.poison).clone() {
            return Err(WriteError::Poisoned { cause });
        }
        Ok(())
    }

    /// The file system is full although the budget is not: lowers the budget (in memory,
    /// not in the marker) to the bytes held minus room for one more block of `need` bytes,
    /// and evicts down to it. Returns whether anything was freed (worth a retry).
    fn shrink_to_fit(&self, need: u64) -> Result<bool, WriteError> {
        let used = self.used_bytes();
        if used == 0 {
            return Ok(false);
        }
        // At least one block's room: below that the block just made room for would be over
        // the budget the moment it is written.
        let budget = used.saturating_sub(need).max(need);
        // Evict first: if a removal fails, the bytes held still fit the budget in force.
        let evicted = self.evict_until(budget.saturating_sub(need), None, None)?;
        let old = self.budget.fetch_min(budget, Ordering::Relaxed);
        if budget < old {
            tracing::warn!(
                root = %self.root.display(),
                budget,
                configured = old,
                "the file system is full: the SSD tier now keeps at most this many bytes of blocks (until restart)"
            );
        }
        Ok(evicted > 0)
    }

    fn poison(&self, what: &str, path: &Path, e: &io::Error) -> WriteError {
        let cause = format!("{what} {}: {e}", path.display());
        tracing::error!(%cause, "SSD tier writer poisoned");
        *lock(&self.poison) = Some(cause.clone());
        WriteError::Poisoned { cause }
    }

    /// Creates a directory the writer needs (see [`ensure_dir`]). A failed fsync of its
    /// parent poisons the writer: the new entry may not be durable, and the next call would
    /// find the directory and not sync again, so blocks acknowledged under it could vanish
    /// on a power cut.
    fn make_dir(&self, path: &Path) -> Result<bool, WriteError> {
        match self.fs.create_dir(path) {
            Ok(()) => {
                if let Some(parent) = path.parent() {
                    if let Err(e) = self.fs.sync_dir(parent) {
                        return Err(self.poison("fsync of directory", parent, &e));
                    }
                }
                Ok(true)
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                self.fs.check_dir(path).map(|_| false)
            }
            Err(e) => Err(e),
        }
        .map_err(|source| WriteError::Io {
            path: path.to_owned(),
            source,
        })
    }

    /// Sets the pins eviction spares (the store's, shared with its other tiers).
    pub(crate) fn set_pins(&mut self, pins: Arc<Pins>) {
        self.pins = pins;
    }

    /// Physical bytes of the blocks pinned now.
    pub fn pinned_bytes(&self) -> u64 {
        let pinned = self.pins.pinned();
        let st = lock(&self.state);
        pinned
            .iter()
            .filter_map(|k| st.index.get(k))
            .map(|e| e.phys)
            .sum()
    }

    /// Evicts blocks in the policy's order until `used <= limit`, sparing `keep` and
    /// pinned blocks (which keep their place in the order), and stopping at a victim more
    /// recent than `newcomer` (the stamp of a block about to be written in recency order).
    ///
    /// The victims leave the index under the lock and their files are removed after it is
    /// released: a removal takes about a millisecond while the writer's fsyncs run (more in
    /// a burst of them), and every request's lookup reads this index. Every caller holds
    /// the write lock (writes, removals and evictions run one at a time) and the files go
    /// before this returns, so no path is written again while its removal is pending. A
    /// removal that fails puts its block and the victims after it back, as if eviction had
    /// stopped there.
    fn evict_until(
        &self,
        limit: u64,
        keep: Option<(NamespaceId, BlockKey)>,
        newcomer: Option<u64>,
    ) -> Result<u64, WriteError> {
        let victims = {
            let mut st = lock(&self.state);
            let mut victims = Vec::new();
            while st.used > limit {
                let Some((k, seq)) = st.victim(keep, &self.pins) else {
                    break;
                };
                if newcomer.is_some_and(|n| seq > n) {
                    break;
                }
                let Some(e) = st.forget(&k) else {
                    break;
                };
                st.used -= e.phys;
                victims.push((k, e));
            }
            victims
        };
        let mut evicted = 0;
        let mut victims = victims.into_iter();
        while let Some((k, e)) = victims.next() {
            let path = block_path(&self.root, k.0, k.1);
            match self.fs.remove_file(&path) {
                Ok(()) => {}
                Err(err) if err.kind() == io::ErrorKind::NotFound => {}
                Err(source) => {
                    let mut st = lock(&self.state);
                    for (k, e) in std::iter::once((k, e)).chain(victims) {
                        st.used += e.phys;
                        if let Some(old) = st.add(k, e) {
                            st.used -= old.phys;
                        }
                    }
                    return Err(WriteError::Io { path, source });
                }
            }
            evicted += 1;
            Counters::inc(&self.counters.ssd_evictions);
        }
        Ok(evicted)
    }

    /// Sets the eviction policy (the store's). Freq-admit's part is the RAM tier's gate:
    /// here it keeps LRU's order. Under LFU counts start at 0, so until blocks are used
    /// again it evicts in recency order.
    pub fn set_eviction(&mut self, policy: EvictionPolicy) {
        let st = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        let order = match policy {
            EvictionPolicy::Lfu => EvictionPolicy::Lfu,
            EvictionPolicy::Lru | EvictionPolicy::FreqAdmit => EvictionPolicy::Lru,
        };
        st.policy = PolicyState::new(order);
        st.rerank_all();
    }

    /// Evicts least recently used blocks until the physical bytes fit the budget; returns
    /// how many were evicted.
    pub fn enforce_budget(&self) -> Result<u64, WriteError> {
        self.check_writable()?;
        let _w = lock(&self.write_lock);
        self.evict_until(self.budget(), None, None)
    }

    /// Changes the budget and records it in the store marker (for `kvstore inspect`).
    pub fn set_budget(&self, budget: u64) -> Result<(), WriteError> {
        self.check_writable()?;
        self.budget.store(budget, Ordering::Relaxed);
        let m = Marker {
            format: format::STORE_FORMAT_NAME.into(),
            version: format::FORMAT_VERSION,
            ssd_budget_bytes: Some(budget),
        };
        let bytes = serde_json::to_vec_pretty(&m).unwrap_or_default();
        write_atomic(
            &self.fs,
            &self.root.join(format::TMP_DIR),
            &self.root,
            format::STORE_FILE,
            &bytes,
        )
        .map_err(|source| WriteError::Io {
            path: self.root.join(format::STORE_FILE),
            source,
        })
    }

    /// Writes a block durably (temp file, fsync, rename, fsync directory), evicting least
    /// recently used blocks first so the budget holds. On `Ok` the block survives a crash.
    pub fn put(&self, block: &Block) -> Result<WriteOutcome, WriteError> {
        self.put_or_replace(block, false, None)
    }

    /// [`SsdTier::put`] of a block last used at `used` (a stamp of this tier's
    /// [`clock`](Self::clock) and its time, such as its last use in the RAM tier), ranked
    /// by that stamp rather than as the newest block, with that time as its last access.
    /// In recency order (`lru`, `freq-admit`) a full tier makes room only from blocks no
    /// more recent than it: when the rest of the room would have to come from more recent
    /// ones, the block is the first to go, so it is not written
    /// ([`WriteOutcome::NotAdmitted`], counted as an eviction). A stored block is only made
    /// at least that recent.
    pub fn put_at(&self, block: &Block, used: UsedAt) -> Result<WriteOutcome, WriteError> {
        self.put_or_replace(block, false, Some(used))
    }

    /// Writes `block` in place of the stored file of its key when that file holds other
    /// planes (a window-trimmed copy of the block replacing the whole one, or the whole one
    /// replacing a trimmed copy): the new file is written and renamed over the old one,
    /// so a reader sees one or the other, never a mix, and a crash leaves one of them.
    /// A file of the same length class (the same planes) is only touched; an absent key
    /// is put.
    pub fn replace(&self, block: &Block) -> Result<WriteOutcome, WriteError> {
        self.put_or_replace(block, true, None)
    }

    fn put_or_replace(
        &self,
        block: &Block,
        replace: bool,
        used: Option<UsedAt>,
    ) -> Result<WriteOutcome, WriteError> {
        let job = PutJob {
            block,
            replace,
            used,
        };
        self.put_many(std::slice::from_ref(&job))
            .pop()
            .unwrap_or(Ok(WriteOutcome::AlreadyPresent))
    }

    /// Writes `jobs` durably in groups (the write-behind worker's batches): each block is
    /// admitted and written to its temp file in turn, then the group's temp files are
    /// fsynced together, renamed into place in order, their directories fsynced together,
    /// and the blocks indexed in order. A block is durable, and indexed, only after its
    /// file and its directory were fsynced, as for a single [`SsdTier::put`]; what a group
    /// saves is the disk's flush latency, paid once for the group instead of twice a block
    /// (docs/store-format.md, "Group commit"). A block that needs room made for it starts
    /// a new group, after the blocks before it are indexed, so eviction and admission
    /// decide exactly as one put at a time would. One result per job, in order.
    pub fn put_many(&self, jobs: &[PutJob<'_>]) -> Vec<Result<WriteOutcome, WriteError>> {
        if self.check_writable().is_err() {
            return jobs.iter().map(|_| Err(self.group_error())).collect();
        }
        let _w = lock(&self.write_lock);
        let mut results: Vec<Option<Result<WriteOutcome, WriteError>>> =
            jobs.iter().map(|_| None).collect();
        let mut staged: Vec<(usize, Staged<F::Writer>)> = Vec::new();
        for (i, job) in jobs.iter().enumerate() {
            let floor = staged.iter().map(|(_, st)| st.seq).min();
            let staged_bytes = staged.iter().map(|(_, st)| st.estimate).sum();
            let mut outcome = self.stage(job, staged_bytes, floor);
            if matches!(outcome, Ok(Staging::NeedsCommit)) {
                // Room for it is decided against the blocks staged so far, as one put at a
                // time would: the group so far is committed first.
                for (j, outcome) in self.commit(std::mem::take(&mut staged)) {
                    results[j] = Some(outcome);
                }
                if self.is_poisoned() {
                    break;
                }
                outcome = self.stage(job, 0, None);
            }
            match outcome {
                Ok(Staging::NeedsCommit) => {
                    // Not given for an empty group.
                    results[i] = Some(Err(self.group_error()));
                }
                Ok(Staging::Done(outcome)) => results[i] = Some(Ok(outcome)),
                Ok(Staging::Staged(st)) => {
                    staged.push((i, st));
                }
                Err(e) => {
                    results[i] = Some(Err(e));
                    if self.is_poisoned() {
                        // Nothing more is written: the staged files go, every job fails.
                        for (j, st) in staged.drain(..) {
                            let _ = self.fs.remove_file(&st.tmp);
                            results[j] = Some(Err(self.group_error()));
                        }
                        break;
                    }
                }
            }
        }
        for (i, outcome) in self.commit(staged) {
            results[i] = Some(outcome);
        }
        results
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Err(self.group_error())))
            .collect()
    }

    /// The error of a job its group gave up after another job's failure poisoned the writer.
    fn group_error(&self) -> WriteError {
        self.check_writable()
            .err()
            .unwrap_or_else(|| WriteError::Poisoned {
                cause: "the write was abandoned after a failure in its group".into(),
            })
    }

    /// Whether an earlier failure poisoned the writer.
    fn is_poisoned(&self) -> bool {
        lock(&self.poison).is_some()
    }

    /// Admits `job`'s block and writes its temp file (not yet synced), evicting to make
    /// room beside the `staged` bytes of blocks staged before it in the same group; or
    /// finishes it at once (already present, not admitted). `floor`: the least recent
    /// stamp of those blocks. Where one put at a time could decide otherwise (room must be
    /// made and the recency order of the staged blocks, which are not indexed yet, would
    /// matter), it changes nothing and asks for the group to be committed first
    /// ([`Staging::NeedsCommit`]): under LRU, victims less recent than every staged block
    /// are evicted first, as they would be then.
    fn stage(
        &self,
        job: &PutJob<'_>,
        staged: u64,
        floor: Option<u64>,
    ) -> Result<Staging<F::Writer>, WriteError> {
        let PutJob {
            block,
            replace,
            used,
        } = *job;
        let ns = block.meta.namespace;
        let key = block.meta.key;
        if lock(&self.state).index.contains_key(&(ns, key)) {
            // The same planes give a file of at least their bytes and at most the estimate.
            let same = !replace
                || self
                    .fs
                    .symlink_metadata(&self.block_path(ns, key))
                    .is_ok_and(|m| {
                        (block.data_len()..=codec::estimate_file_len(block)).contains(&m.len)
                    });
            if same {
                self.touch_at(
                    ns,
                    key,
                    used.unwrap_or_else(|| UsedAt::now(self.clock.tick())),
                );
                return Ok(Staging::Done(WriteOutcome::AlreadyPresent));
            }
        }
        codec::check_encodable(block).map_err(|e| WriteError::Invalid {
            key,
            reason: e.to_string(),
        })?;
        let estimate = codec::estimate_file_len(block).div_ceil(format::ASSUMED_FS_BLOCK)
            * format::ASSUMED_FS_BLOCK;
        let budget = self.budget();
        if estimate > budget {
            return Err(WriteError::TooLarge {
                bytes: estimate,
                budget,
            });
        }
        let (recency_order, stored_seq, stored_ms) = {
            let st = lock(&self.state);
            let stored = st.index.get(&(ns, key));
            (
                st.is_lru(),
                stored.map_or(0, |e| e.seq),
                stored.map_or(0, |e| e.last_ms),
            )
        };
        // A copy of another layout replaced keeps its place if it was more recent.
        let last = used.unwrap_or_else(|| UsedAt::now(self.clock.tick()));
        let seq = last.stamp.max(stored_seq);
        // A pinned block is always admitted, as in the RAM tier.
        let newcomer = (recency_order && !self.pins.is_pinned(ns, key)).then_some(seq);
        if let Some(floor) = floor {
            let needs_room = || lock(&self.state).used + staged + estimate > budget;
            if needs_room() {
                if !recency_order {
                    return Ok(Staging::NeedsCommit);
                }
                // Victims less recent than every staged block (and than this one) go first
                // whatever the order of the group; past them, the group must be indexed.
                let stop = floor.saturating_sub(1).min(newcomer.unwrap_or(u64::MAX));
                self.evict_until(budget.saturating_sub(estimate + staged), None, Some(stop))?;
                if needs_room() {
                    return Ok(Staging::NeedsCommit);
                }
            }
        }
        let u = {
            let mut st = lock(&self.state);
            let capacity = st.capacity(budget, estimate);
            st.record_use((ns, key), capacity)
        };
        self.evict_until(budget.saturating_sub(estimate + staged), None, newcomer)?;
        let (used, more_recent_left) = {
            let st = lock(&self.state);
            let left = newcomer.is_some()
                && st
                    .victim(None, &self.pins)
                    .is_some_and(|(_, victim)| victim > seq);
            (st.used + staged, left)
        };
        if used + estimate > budget && more_recent_left {
            // Written, it would be the least recent block: the first to go.
            Counters::inc(&self.counters.ssd_evictions);
            return Ok(Staging::Done(WriteOutcome::NotAdmitted));
        }
        if used + estimate > budget {
            // Only pinned blocks (or a write racing this one) are left: refuse rather than
            // evict a pin or overrun the budget.
            return Err(WriteError::Pinned {
                bytes: estimate,
                pinned: self.pinned_bytes(),
                budget,
            });
        }

        let ns_dir = self.root.join(ns.to_string());
        let final_path = block_path(&self.root, ns, key);
        let shard_dir = final_path.parent().unwrap_or(&ns_dir).to_owned();
        for dir in [&ns_dir, &shard_dir] {
            match self.make_dir(dir) {
                Ok(_) => {}
                Err(WriteError::Io { source, .. })
                    if !self.fs.metadata(&self.root).is_ok_and(|m| m.is_dir()) =>
                {
                    // Deleted under us: recreating it could race a new owner of the path.
                    return Err(self.poison("the store directory is gone:", &self.root, &source));
                }
                Err(e) => return Err(e),
            }
        }
        let tmp = self.root.join(format::TMP_DIR).join(format!(
            "{key}.{}.{}.{}",
            std::process::id(),
            self.tmp_seq.fetch_add(1, Ordering::Relaxed),
            format::TMP_EXT
        ));
        // 1. Create and fill the temp file. Failures here (ENOSPC, EIO on write) leave
        //    nothing behind and do not poison: the temp file is removed and never renamed.
        //    A full file system shrinks the budget to what fits and retries once.
        let mut retried = false;
        let (file, file_len) = loop {
            let written = (|| -> Result<(F::Writer, u64), EncodeError> {
                let mut f = self.fs.create_new(&tmp)?;
                let len = codec::write_to(block, &mut f)?;
                Ok((f, len))
            })();
            match written {
                Ok(f) => break f,
                Err(e) => {
                    let _ = self.fs.remove_file(&tmp);
                    if let EncodeError::Io(source) = &e {
                        if floor.is_some() && is_storage_full(source) {
                            // The group's own temp files may be what fills the disk: it is
                            // committed first, then this block is written as one put would
                            // (its use counted again: a frequency count one high at worst).
                            return Ok(Staging::NeedsCommit);
                        }
                        if !retried
                            && is_storage_full(source)
                            && self.shrink_to_fit(estimate + staged)?
                        {
                            retried = true;
                            continue;
                        }
                    }
                    return Err(match e {
                        EncodeError::Io(source) => WriteError::Io { path: tmp, source },
                        EncodeError::Invalid(reason) => WriteError::Invalid { key, reason },
                    });
                }
            }
        };
        Ok(Staging::Staged(Staged {
            id: (ns, key),
            tmp,
            final_path,
            shard_dir,
            file,
            file_len,
            estimate,
            seq,
            last_ms: last.unix_ms.max(stored_ms),
            count: u.count,
            last_use: u.at,
        }))
    }

    /// Makes `staged` durable and indexes it: 2. fsync every temp file (together), 3.
    /// rename each into place (in order), 4. fsync their directories (together), 5. index
    /// and journal each. A failed fsync or rename poisons the writer (the page cache's
    /// state is unknown): the group's blocks not yet renamed are removed.
    fn commit(
        &self,
        mut staged: Vec<(usize, Staged<F::Writer>)>,
    ) -> Vec<(usize, Result<WriteOutcome, WriteError>)> {
        let mut out = Vec::with_capacity(staged.len());
        if staged.is_empty() {
            return out;
        }
        let budget = self.budget();
        // 2. fsync the data.
        let t = std::time::Instant::now();
        let synced = parallel(&mut staged, |(_, st)| st.file.sync_all());
        Counters::add(&self.counters.write_sync_us, t.elapsed().as_micros() as u64);
        let first_failure = synced
            .into_iter()
            .enumerate()
            .find_map(|(k, r)| r.err().map(|e| (k, e)));
        if let Some((k, e)) = first_failure {
            let mut err = Some(self.poison("fsync of", &staged[k].1.tmp, &e));
            for (i, st) in staged {
                let _ = self.fs.remove_file(&st.tmp);
                out.push((i, Err(err.take().unwrap_or_else(|| self.group_error()))));
            }
            return out;
        }
        // 3. rename into place, in order; a failure stops the group there.
        let mut renamed = Vec::with_capacity(staged.len());
        let mut failed = false;
        for (i, st) in staged {
            if failed {
                let _ = self.fs.remove_file(&st.tmp);
                out.push((i, Err(self.group_error())));
                continue;
            }
            let st = st.without_file();
            if let Err(e) = self.fs.rename(&st.tmp, &st.final_path) {
                let _ = self.fs.remove_file(&st.tmp);
                out.push((i, Err(self.poison("rename to", &st.final_path, &e))));
                failed = true;
                continue;
            }
            renamed.push((i, st));
        }
        // 4. fsync each directory once.
        let mut dirs: Vec<PathBuf> = renamed.iter().map(|(_, r)| r.shard_dir.clone()).collect();
        dirs.sort();
        dirs.dedup();
        let t = std::time::Instant::now();
        let dir_results = parallel(&mut dirs, |d| self.fs.sync_dir(d));
        Counters::add(&self.counters.write_sync_us, t.elapsed().as_micros() as u64);
        let mut bad_dirs: Vec<(PathBuf, Option<WriteError>)> = Vec::new();
        for (d, r) in dirs.iter().zip(dir_results) {
            if let Err(e) = r {
                bad_dirs.push((d.clone(), Some(self.poison("fsync of directory", d, &e))));
            }
        }
        // 5. index and journal, in order.
        let mut recheck = false;
        let mut compact = false;
        let mut last_written = None;
        for (i, r) in renamed {
            if let Some((_, err)) = bad_dirs.iter_mut().find(|(d, _)| *d == r.shard_dir) {
                out.push((i, Err(err.take().unwrap_or_else(|| self.group_error()))));
                continue;
            }
            let phys = self
                .fs
                .symlink_metadata(&r.final_path)
                .map(|m| m.physical_bytes)
                .unwrap_or(r.estimate);
            {
                let mut st = lock(&self.state);
                let replaced = st.add(
                    r.id,
                    Entry {
                        phys,
                        last_ms: r.last_ms,
                        seq: r.seq,
                        tie: 0,
                        count: r.count,
                        last_use: r.last_use,
                    },
                );
                if let Some(old) = replaced {
                    st.used -= old.phys;
                }
                st.used += phys;
                compact |= self.journal_append(
                    &mut st,
                    Record {
                        ns: r.id.0,
                        key: r.id.1,
                        seq: r.seq,
                        unix_ms: r.last_ms,
                    },
                );
            }
            Counters::add(&self.counters.bytes_written, r.file_len);
            Counters::inc(&self.counters.blocks_written);
            recheck |= phys > r.estimate;
            last_written = Some(r.id);
            out.push((
                i,
                Ok(WriteOutcome::Written {
                    physical_bytes: phys,
                }),
            ));
        }
        if recheck || self.budget() < budget {
            // Files larger than estimated (or a budget shrunk meanwhile): back to the
            // budget, sparing the group's last block as a single put spares its own.
            if let Err(e) = self.evict_until(self.budget(), last_written, None) {
                tracing::warn!(error = %e, "evicting after a group commit failed");
            }
        }
        if compact {
            self.compact_journal();
        }
        out
    }

    /// Deletes a block file (GC); returns whether it existed.
    pub fn remove(&self, ns: NamespaceId, key: BlockKey) -> Result<bool, WriteError> {
        self.check_writable()?;
        let _w = lock(&self.write_lock);
        let path = self.block_path(ns, key);
        let existed = match self.fs.remove_file(&path) {
            Ok(()) => true,
            Err(e) if e.kind() == io::ErrorKind::NotFound => false,
            Err(source) => return Err(WriteError::Io { path, source }),
        };
        let mut st = lock(&self.state);
        if let Some(e) = st.forget(&(ns, key)) {
            st.used -= e.phys;
        }
        Ok(existed)
    }

    /// Makes the access journal durable. Block files are already durable when `put` returns.
    pub fn sync(&self) -> Result<(), WriteError> {
        self.check_writable()?;
        let mut st = lock(&self.state);
        if let Some(j) = st.journal.as_mut() {
            if let Err(source) = j.sync() {
                if is_storage_full(&source) {
                    // The journal is a recency hint, not data: give it up rather than fail.
                    tracing::warn!(path = %crate::escape_path(j.path()), error = %source, "the file system is full: no access journal until restart");
                    st.journal = None;
                    return Ok(());
                }
                return Err(WriteError::Io {
                    path: j.path().to_owned(),
                    source,
                });
            }
        }
        Ok(())
    }

    /// Writes `<root>/<ns>/namespace.json` (atomically) unless an identical one exists.
    pub fn write_namespace(
        &self,
        desc: &NamespaceDescription,
    ) -> Result<NamespaceId, RegisterError> {
        let id = desc.id();
        let dir = self.root.join(id.to_string());
        let path = dir.join(format::NAMESPACE_FILE);
        let json = serde_json::to_vec_pretty(desc).unwrap_or_default();
        if self.fs.read_capped(&path, MAX_SMALL_FILE).ok().as_deref() == Some(&json[..]) {
            return Ok(id);
        }
        if self.read_only {
            return Ok(id);
        }
        let res = self.make_dir(&dir).map_err(into_io).and_then(|_| {
            write_atomic(
                &self.fs,
                &self.root.join(format::TMP_DIR),
                &dir,
                format::NAMESPACE_FILE,
                &json,
            )
        });
        res.map_err(|source| RegisterError::Io { path, source })?;
        Ok(id)
    }

    /// The cost model saved for namespace `ns` (`<root>/<ns>/costs.json`), if there is one,
    /// it is a regular file (never a symlink) and at most [`format::MAX_COSTS_LEN`] bytes.
    pub fn read_costs(&self, ns: NamespaceId) -> Option<Vec<u8>> {
        let path = self.root.join(ns.to_string()).join(format::COSTS_FILE);
        self.fs.read_capped(&path, format::MAX_COSTS_LEN).ok()
    }

    /// Saves namespace `ns`'s cost model atomically (temp file, fsync, rename); a no-op on a
    /// read-only store.
    pub fn write_costs(&self, ns: NamespaceId, bytes: &[u8]) -> io::Result<()> {
        if self.read_only {
            return Ok(());
        }
        let dir = self.root.join(ns.to_string());
        self.make_dir(&dir).map_err(into_io)?;
        write_atomic(
            &self.fs,
            &self.root.join(format::TMP_DIR),
            &dir,
            format::COSTS_FILE,
            bytes,
        )
    }

    /// Every namespace description found on disk whose id matches its directory.
    pub fn namespaces(&self) -> Vec<NamespaceDescription> {
        read_namespaces(&self.fs, &self.root)
            .into_iter()
            .filter_map(|(_, _, d)| d.ok())
            .collect()
    }
}

/// The I/O error inside a [`WriteError`] (for callers that report `io::Error`).
fn into_io(e: WriteError) -> io::Error {
    match e {
        WriteError::Io { source, .. } => source,
        other => io::Error::other(other.to_string()),
    }
}

/// `<root>/<ns hex>/<first 2 key hex>/<key hex>.safetensors`.
pub(crate) fn block_path(root: &Path, ns: NamespaceId, key: BlockKey) -> PathBuf {
    let k = key.to_string();
    root.join(ns.to_string())
        .join(&k[..2])
        .join(format!("{k}.{}", format::BLOCK_EXT))
}

/// Reads `namespace.json` of every namespace directory: (id, path, description or why not).
pub(crate) fn read_namespaces<F: FileSystem>(
    fs: &F,
    root: &Path,
) -> Vec<(NamespaceId, PathBuf, Result<NamespaceDescription, String>)> {
    let Ok(entries) = fs.read_dir(root) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in entries {
        let Some(id) = parse_canonical::<NamespaceId>(&e.name) else {
            continue;
        };
        let path = root.join(&e.name).join(format::NAMESPACE_FILE);
        let desc = fs
            .read_capped(&path, MAX_SMALL_FILE)
            .map_err(|e| e.to_string())
            .and_then(|b| {
                serde_json::from_slice::<NamespaceDescription>(&b).map_err(|e| e.to_string())
            })
            .and_then(|d| {
                if d.id() == id {
                    Ok(d)
                } else {
                    Err(format!("describes namespace {}, not {id}", d.id()))
                }
            });
        out.push((id, path, desc));
    }
    out
}
