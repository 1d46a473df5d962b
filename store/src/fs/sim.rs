//! [`SimFs`]: an in-memory file system that separates what a process sees from what is
//! durable, and fails chosen calls.
//!
//! Model (the worst a POSIX file system may do on a power cut, ext4 `data=ordered` and XFS
//! included):
//!
//! - A file's bytes reach the durable copy only on a successful `fsync`/`fdatasync` of that
//!   file. Bytes appended after the last sync may survive a power cut in part (a random
//!   prefix: a torn tail); anything else written since the last sync is lost.
//! - A directory entry (a created file or directory, a rename, a removal) becomes durable
//!   only when its directory is fsync'd. After a power cut the namespace is the durable one;
//!   an entry whose parent directory did not durably exist is gone.
//! - A failed `fsync` leaves the durable copy as it was and marks the dirty bytes clean, as
//!   Linux does: a later `fsync` of the same file returns success without writing them. A
//!   writer that retries after a failed `fsync` therefore loses data, and tests see it.
//!
//! Paths are absolute (`/store/...`); the root `/` always exists. There are no links.

use std::collections::{BTreeMap, HashMap};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use super::{DirEntry, FileKind, FileStat, FileSystem, LockError, ReadAt, WritableFile};
use crate::block::now_unix_ms;

/// A file system call that a [`Fault`] can target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Op {
    /// Any call below (for [`FaultKind::PowerLoss`] at the Nth call).
    Any,
    /// `metadata`, `symlink_metadata`, `check_dir`.
    Stat,
    /// `read_dir`.
    ReadDir,
    /// `create_dir`, `create_dir_all`.
    Mkdir,
    /// `open_read`, `read_capped`.
    Open,
    /// A read at an offset from an open file.
    Read,
    /// `create_new`, `create_truncate`, `open_append`.
    Create,
    /// A write to an open file.
    Write,
    /// `sync_all`/`sync_data` of a file.
    SyncFile,
    /// `sync_dir`.
    SyncDir,
    /// `rename`.
    Rename,
    /// `remove_file`.
    Remove,
    /// `lock`.
    Lock,
}

/// How an injected fault fails the call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FaultKind {
    /// `ENOSPC`: the device is full. Nothing is done.
    NoSpace,
    /// `EIO`: the device failed. Nothing is done (for a sync: see the module docs).
    Eio,
    /// Only the first half of the write's buffer reaches the page cache, then the power
    /// goes (as [`PowerLoss`](FaultKind::PowerLoss)). Other calls: like `PowerLoss`.
    TornWrite,
    /// The power goes before the call: it and every later call fail with `EIO` until
    /// [`SimFs::power_loss`] brings the machine back.
    PowerLoss,
}

/// One planned fault: the `nth` call (0: the next one) of `op` from now fails as `kind`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault {
    /// Which calls count.
    pub op: Op,
    /// How many matching calls pass before the one that fails.
    pub nth: u64,
    /// How it fails.
    pub kind: FaultKind,
}

/// Faults that fired, by call and kind.
pub type FaultCounts = BTreeMap<(Op, FaultKind), u64>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Entry {
    Dir,
    File(u64),
}

#[derive(Debug, Default)]
struct Node {
    live: Vec<u8>,
    durable: Vec<u8>,
    /// An fsync failed: the dirty bytes were dropped from the page cache's books.
    sync_failed: bool,
    modified_unix_ms: u64,
}

#[derive(Debug)]
struct State {
    live: BTreeMap<PathBuf, Entry>,
    durable: BTreeMap<PathBuf, Entry>,
    nodes: HashMap<u64, Node>,
    next_ino: u64,
    /// Pending faults with the matching calls still to pass.
    faults: Vec<Fault>,
    injected: FaultCounts,
    calls: u64,
    /// The power is off: every call fails.
    off: bool,
    locks: Vec<PathBuf>,
    /// Most live bytes all files together may hold (ENOSPC beyond).
    capacity: Option<u64>,
    /// Paths `open_read` opened, in order, once a test asked ([`SimFs::record_opens`]).
    opened: Option<Vec<PathBuf>>,
}

/// An in-memory file system with power loss and injected faults. Clones share the files.
#[derive(Debug, Clone)]
pub struct SimFs {
    state: Arc<Mutex<State>>,
    removals: Arc<CallGate>,
    syncs: Arc<CallGate>,
    opens: Arc<CallGate>,
}

/// Holds calls of one kind back while a test asks (see [`SimFs::hold_removals`],
/// [`SimFs::hold_syncs`], [`SimFs::hold_opens`]).
#[derive(Debug, Default)]
struct CallGate {
    /// Whether calls are held, and how many wait.
    state: Mutex<(bool, usize)>,
    released: Condvar,
}

impl CallGate {
    fn lock(&self) -> MutexGuard<'_, (bool, usize)> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Holds (`true`) or lets through (`false`) this gate's calls from now on.
    fn set_held(&self, held: bool) {
        self.lock().0 = held;
        if !held {
            self.released.notify_all();
        }
    }

    /// How many calls wait now.
    fn waiting(&self) -> usize {
        self.lock().1
    }

    /// Waits while calls are held.
    fn pass(&self) {
        let mut st = self.lock();
        st.1 += 1;
        while st.0 {
            st = self.released.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        st.1 -= 1;
    }
}

fn err(kind: FaultKind) -> io::Error {
    match kind {
        FaultKind::NoSpace => io::Error::from_raw_os_error(libc::ENOSPC),
        _ => io::Error::from_raw_os_error(libc::EIO),
    }
}

fn not_found(path: &Path) -> io::Error {
    io::Error::new(
        io::ErrorKind::NotFound,
        format!("{}: no such file or directory", path.display()),
    )
}

/// splitmix64: the power-cut tails come from the seed alone.
fn next_random(seed: &mut u64) -> u64 {
    *seed = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *seed;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl State {
    /// Counts a call of `op`, fires the fault planned for it if any.
    fn call(&mut self, op: Op) -> Result<Option<FaultKind>, io::Error> {
        if self.off {
            return Err(err(FaultKind::PowerLoss));
        }
        self.calls += 1;
        let mut fired = None;
        let mut i = 0;
        while i < self.faults.len() {
            let f = &mut self.faults[i];
            if f.op == op || f.op == Op::Any {
                if f.nth == 0 {
                    let f = self.faults.remove(i);
                    if fired.is_none() {
                        fired = Some(f.kind);
                    }
                    continue;
                }
                f.nth -= 1;
            }
            i += 1;
        }
        let Some(kind) = fired else {
            return Ok(None);
        };
        *self.injected.entry((op, kind)).or_default() += 1;
        match kind {
            FaultKind::TornWrite if op == Op::Write => Ok(Some(kind)),
            FaultKind::TornWrite | FaultKind::PowerLoss => {
                self.off = true;
                Err(err(kind))
            }
            _ => Err(err(kind)),
        }
    }

    fn fail_call(&mut self, op: Op) -> io::Result<()> {
        self.call(op).map(|_| ())
    }

    fn dir_exists(&self, path: &Path) -> bool {
        path == Path::new("/") || self.live.get(path) == Some(&Entry::Dir)
    }

    fn parent_exists(&self, path: &Path) -> io::Result<()> {
        match path.parent() {
            Some(p) if self.dir_exists(p) => Ok(()),
            _ => Err(not_found(path)),
        }
    }

    fn file(&self, path: &Path) -> io::Result<u64> {
        match self.live.get(path) {
            Some(Entry::File(ino)) => Ok(*ino),
            Some(Entry::Dir) => Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{} is a directory", path.display()),
            )),
            None => Err(not_found(path)),
        }
    }

    fn live_bytes(&self) -> u64 {
        let mut seen = std::collections::HashSet::new();
        self.live
            .values()
            .filter_map(|e| match e {
                Entry::File(ino) if seen.insert(*ino) => self.nodes.get(ino),
                _ => None,
            })
            .map(|n| n.live.len() as u64)
            .sum()
    }

    fn stat(&self, path: &Path) -> io::Result<FileStat> {
        if path == Path::new("/") {
            return Ok(dir_stat());
        }
        match self.live.get(path) {
            Some(Entry::Dir) => Ok(dir_stat()),
            Some(Entry::File(ino)) => {
                let n = &self.nodes[ino];
                let len = n.live.len() as u64;
                Ok(FileStat {
                    kind: FileKind::File,
                    len,
                    physical_bytes: len.div_ceil(PAGE) * PAGE,
                    modified_unix_ms: n.modified_unix_ms,
                })
            }
            None => Err(not_found(path)),
        }
    }

    fn create_file(&mut self, path: &Path, exclusive: bool) -> io::Result<u64> {
        self.parent_exists(path)?;
        match self.live.get(path) {
            Some(Entry::File(ino)) if !exclusive => {
                let ino = *ino;
                let n = self.nodes.get_mut(&ino).ok_or_else(|| not_found(path))?;
                n.live.clear();
                n.modified_unix_ms = now_unix_ms();
                return Ok(ino);
            }
            Some(_) => {
                return Err(io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    format!("{} exists", path.display()),
                ))
            }
            None => {}
        }
        let ino = self.next_ino;
        self.next_ino += 1;
        self.nodes.insert(
            ino,
            Node {
                modified_unix_ms: now_unix_ms(),
                ..Node::default()
            },
        );
        self.live.insert(path.to_owned(), Entry::File(ino));
        Ok(ino)
    }
}

/// Allocation unit of [`FileStat::physical_bytes`].
const PAGE: u64 = 4096;

fn dir_stat() -> FileStat {
    FileStat {
        kind: FileKind::Dir,
        len: 0,
        physical_bytes: PAGE,
        modified_unix_ms: 0,
    }
}

impl Default for SimFs {
    fn default() -> Self {
        Self::new()
    }
}

impl SimFs {
    /// An empty file system (only `/`) with no fault planned and no capacity limit.
    pub fn new() -> SimFs {
        SimFs {
            state: Arc::new(Mutex::new(State {
                live: BTreeMap::new(),
                durable: BTreeMap::new(),
                nodes: HashMap::new(),
                next_ino: 1,
                faults: Vec::new(),
                injected: FaultCounts::new(),
                calls: 0,
                off: false,
                locks: Vec::new(),
                capacity: None,
                opened: None,
            })),
            removals: Arc::default(),
            syncs: Arc::default(),
            opens: Arc::default(),
        }
    }

    /// From now on `remove_file` waits (before doing anything) until
    /// [`release_removals`](Self::release_removals): a test can then look at what other
    /// threads do while a removal is in progress.
    pub fn hold_removals(&self) {
        self.removals.set_held(true);
    }

    /// Lets held and later `remove_file` calls run.
    pub fn release_removals(&self) {
        self.removals.set_held(false);
    }

    /// How many `remove_file` calls are waiting now.
    pub fn removals_waiting(&self) -> usize {
        self.removals.waiting()
    }

    /// From now on every fsync (a file's `sync_all` / `sync_data`, `sync_dir`) waits, before
    /// doing anything, until [`release_syncs`](Self::release_syncs): a test can then look at
    /// what other threads do while a slow disk flush is in progress.
    pub fn hold_syncs(&self) {
        self.syncs.set_held(true);
    }

    /// Lets held and later fsyncs run.
    pub fn release_syncs(&self) {
        self.syncs.set_held(false);
    }

    /// How many fsyncs are waiting now.
    pub fn syncs_waiting(&self) -> usize {
        self.syncs.waiting()
    }

    /// From now on every `open_read` (the SSD tier's block reads) waits, before doing
    /// anything, until [`release_opens`](Self::release_opens).
    pub fn hold_opens(&self) {
        self.opens.set_held(true);
    }

    /// Lets held and later `open_read` calls run.
    pub fn release_opens(&self) {
        self.opens.set_held(false);
    }

    /// How many `open_read` calls are waiting now.
    pub fn opens_waiting(&self) -> usize {
        self.opens.waiting()
    }

    /// From now on the paths `open_read` opens are recorded, in order ([`opened`](Self::opened)).
    pub fn record_opens(&self) {
        self.state().opened.get_or_insert_with(Vec::new);
    }

    /// The paths `open_read` opened since [`record_opens`](Self::record_opens), in order.
    pub fn opened(&self) -> Vec<PathBuf> {
        self.state().opened.clone().unwrap_or_default()
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Limits the live bytes of all files together; a write past it fails with ENOSPC.
    pub fn set_capacity(&self, bytes: Option<u64>) {
        self.state().capacity = bytes;
    }

    /// Plans a fault.
    pub fn inject(&self, fault: Fault) {
        self.state().faults.push(fault);
    }

    /// Drops every planned fault that has not fired.
    pub fn clear_faults(&self) {
        self.state().faults.clear();
    }

    /// Faults that fired so far.
    pub fn injected(&self) -> FaultCounts {
        self.state().injected.clone()
    }

    /// Calls made so far (all operations, failed ones included; none while the power is off).
    pub fn calls(&self) -> u64 {
        self.state().calls
    }

    /// Whether a planned power cut happened and [`power_loss`](Self::power_loss) has not
    /// yet brought the machine back.
    pub fn is_off(&self) -> bool {
        self.state().off
    }

    /// Cuts the power and brings the machine back: everything not durable is lost, except
    /// that a file may keep a prefix (chosen from `seed`) of bytes appended since its last
    /// sync. Locks are released; planned faults are dropped. Handles opened before keep
    /// failing (the process that held them is gone).
    pub fn power_loss(&self, seed: u64) {
        let mut st = self.state();
        let mut seed = seed;
        let durable = st.durable.clone();
        // An entry survives only if every ancestor durably exists as a directory.
        let reachable = |p: &Path| {
            p.ancestors()
                .skip(1)
                .all(|a| a == Path::new("/") || durable.get(a) == Some(&Entry::Dir))
        };
        let survivors: BTreeMap<PathBuf, Entry> = durable
            .iter()
            .filter(|(p, _)| reachable(p))
            .map(|(p, e)| (p.clone(), *e))
            .collect();
        let kept: std::collections::HashSet<u64> = survivors
            .values()
            .filter_map(|e| match e {
                Entry::File(ino) => Some(*ino),
                Entry::Dir => None,
            })
            .collect();
        let mut nodes = HashMap::new();
        let mut inos: Vec<u64> = kept.into_iter().collect();
        inos.sort_unstable();
        for ino in inos {
            let Some(mut n) = st.nodes.remove(&ino) else {
                continue;
            };
            let appended =
                !n.sync_failed && n.live.len() > n.durable.len() && n.live.starts_with(&n.durable);
            let mut after = n.durable.clone();
            if appended {
                let extra = (n.live.len() - n.durable.len()) as u64;
                let keep = next_random(&mut seed) % (extra + 1);
                after.extend_from_slice(&n.live[n.durable.len()..n.durable.len() + keep as usize]);
            }
            n.live = after.clone();
            n.durable = after;
            n.sync_failed = false;
            nodes.insert(ino, n);
        }
        st.nodes = nodes;
        st.live = survivors.clone();
        st.durable = survivors;
        st.faults.clear();
        st.locks.clear();
        st.off = false;
        // Handles from before the cut point at nodes by number; new numbers never reuse them.
        st.next_ino += 1 << 32;
    }

    /// Creates (`exclusive`: only if absent) or truncates a file, open for writing.
    fn create(&self, path: &Path, exclusive: bool) -> io::Result<SimWriter> {
        let mut st = self.state();
        st.fail_call(Op::Create)?;
        let ino = st.create_file(path, exclusive)?;
        Ok(SimWriter {
            fs: self.clone(),
            ino,
            pos: 0,
            append: false,
        })
    }

    /// Every regular file's live bytes, by path (for tests that damage or inspect files).
    pub fn files(&self) -> BTreeMap<PathBuf, Vec<u8>> {
        let st = self.state();
        st.live
            .iter()
            .filter_map(|(p, e)| match e {
                Entry::File(ino) => Some((p.clone(), st.nodes[ino].live.clone())),
                Entry::Dir => None,
            })
            .collect()
    }

    /// Replaces a file's bytes, live and durable, as a failing disk would.
    pub fn damage(&self, path: &Path, bytes: Vec<u8>) -> io::Result<()> {
        let mut st = self.state();
        let ino = st.file(path)?;
        let n = st.nodes.get_mut(&ino).ok_or_else(|| not_found(path))?;
        n.live = bytes.clone();
        n.durable = bytes;
        Ok(())
    }
}

/// A file of a [`SimFs`] open for reading.
#[derive(Debug)]
pub struct SimReader {
    fs: SimFs,
    ino: u64,
}

impl ReadAt for SimReader {
    fn len(&self) -> io::Result<u64> {
        let st = self.fs.state();
        if st.off {
            return Err(err(FaultKind::PowerLoss));
        }
        Ok(st.nodes.get(&self.ino).map_or(0, |n| n.live.len() as u64))
    }

    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let mut st = self.fs.state();
        st.fail_call(Op::Read)?;
        let data = st.nodes.get(&self.ino).map_or(&[][..], |n| &n.live[..]);
        let start = usize::try_from(offset).unwrap_or(usize::MAX);
        match start.checked_add(buf.len()) {
            Some(end) if end <= data.len() => {
                buf.copy_from_slice(&data[start..end]);
                Ok(())
            }
            _ => Err(io::ErrorKind::UnexpectedEof.into()),
        }
    }
}

/// A file of a [`SimFs`] open for writing.
#[derive(Debug)]
pub struct SimWriter {
    fs: SimFs,
    ino: u64,
    pos: usize,
    append: bool,
}

impl Write for SimWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let mut st = self.fs.state();
        let fault = st.call(Op::Write)?;
        let torn = fault == Some(FaultKind::TornWrite);
        let buf = if torn { &buf[..buf.len() / 2] } else { buf };
        let len = st.nodes.get(&self.ino).map_or(0, |n| n.live.len());
        let pos = if self.append { len } else { self.pos };
        let grows = (pos + buf.len()).saturating_sub(len) as u64;
        if let Some(cap) = st.capacity {
            if st.live_bytes() + grows > cap {
                return Err(err(FaultKind::NoSpace));
            }
        }
        let n = st
            .nodes
            .get_mut(&self.ino)
            .ok_or_else(|| not_found(Path::new("?")))?;
        if n.live.len() < pos + buf.len() {
            n.live.resize(pos + buf.len(), 0);
        }
        n.live[pos..pos + buf.len()].copy_from_slice(buf);
        n.modified_unix_ms = now_unix_ms();
        self.pos = pos + buf.len();
        if torn {
            st.off = true;
            return Err(err(FaultKind::TornWrite));
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl SimWriter {
    fn sync(&mut self) -> io::Result<()> {
        self.fs.syncs.pass();
        let mut st = self.fs.state();
        let fault = st.call(Op::SyncFile);
        let n = st
            .nodes
            .get_mut(&self.ino)
            .ok_or_else(|| not_found(Path::new("?")))?;
        match fault {
            Ok(_) => {
                if !n.sync_failed {
                    n.durable = n.live.clone();
                }
                Ok(())
            }
            Err(e) => {
                n.sync_failed = true;
                Err(e)
            }
        }
    }
}

impl WritableFile for SimWriter {
    fn sync_all(&mut self) -> io::Result<()> {
        self.sync()
    }

    fn sync_data(&mut self) -> io::Result<()> {
        self.sync()
    }
}

/// The lock of a [`SimFs`] store, released on drop.
#[derive(Debug)]
pub struct SimLock {
    fs: SimFs,
    path: PathBuf,
}

impl Drop for SimLock {
    fn drop(&mut self) {
        self.fs.state().locks.retain(|p| p != &self.path);
    }
}

impl FileSystem for SimFs {
    type Reader = SimReader;
    type Writer = SimWriter;
    type Lock = SimLock;

    fn metadata(&self, path: &Path) -> io::Result<FileStat> {
        let mut st = self.state();
        st.fail_call(Op::Stat)?;
        st.stat(path)
    }

    fn symlink_metadata(&self, path: &Path) -> io::Result<FileStat> {
        self.metadata(path)
    }

    fn read_dir(&self, path: &Path) -> io::Result<Vec<DirEntry>> {
        let mut st = self.state();
        st.fail_call(Op::ReadDir)?;
        if !st.dir_exists(path) {
            return Err(not_found(path));
        }
        Ok(st
            .live
            .iter()
            .filter(|(p, _)| p.parent() == Some(path))
            .map(|(p, e)| DirEntry {
                name: p
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default(),
                kind: match e {
                    Entry::Dir => FileKind::Dir,
                    Entry::File(_) => FileKind::File,
                },
            })
            .collect())
    }

    fn create_dir(&self, path: &Path) -> io::Result<()> {
        let mut st = self.state();
        st.fail_call(Op::Mkdir)?;
        st.parent_exists(path)?;
        if st.dir_exists(path) || st.live.contains_key(path) {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!("{} exists", path.display()),
            ));
        }
        st.live.insert(path.to_owned(), Entry::Dir);
        Ok(())
    }

    fn create_dir_all(&self, path: &Path) -> io::Result<()> {
        let mut st = self.state();
        st.fail_call(Op::Mkdir)?;
        let missing: Vec<PathBuf> = path
            .ancestors()
            .take_while(|a| !st.dir_exists(a))
            .map(Path::to_owned)
            .collect();
        for p in missing.into_iter().rev() {
            if st.live.contains_key(&p) {
                return Err(io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    format!("{} is a file", p.display()),
                ));
            }
            st.live.insert(p, Entry::Dir);
        }
        Ok(())
    }

    fn check_dir(&self, path: &Path) -> io::Result<bool> {
        match self.metadata(path) {
            Ok(s) if s.is_dir() => Ok(true),
            Ok(_) => Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{} is not a directory", path.display()),
            )),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(e),
        }
    }

    fn open_read(&self, path: &Path) -> io::Result<SimReader> {
        self.opens.pass();
        let mut st = self.state();
        st.fail_call(Op::Open)?;
        let ino = st.file(path)?;
        if let Some(opened) = &mut st.opened {
            opened.push(path.to_owned());
        }
        Ok(SimReader {
            fs: self.clone(),
            ino,
        })
    }

    fn read_capped(&self, path: &Path, cap: u64) -> io::Result<Vec<u8>> {
        let mut st = self.state();
        st.fail_call(Op::Open)?;
        let ino = st.file(path)?;
        let data = &st.nodes[&ino].live;
        if data.len() as u64 > cap {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{} is longer than {cap} bytes", path.display()),
            ));
        }
        Ok(data.clone())
    }

    fn create_new(&self, path: &Path) -> io::Result<SimWriter> {
        self.create(path, true)
    }

    fn create_truncate(&self, path: &Path) -> io::Result<SimWriter> {
        self.create(path, false)
    }

    fn open_append(&self, path: &Path) -> io::Result<SimWriter> {
        let mut st = self.state();
        st.fail_call(Op::Create)?;
        let ino = st.file(path)?;
        Ok(SimWriter {
            fs: self.clone(),
            ino,
            pos: 0,
            append: true,
        })
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        let mut st = self.state();
        st.fail_call(Op::Rename)?;
        let ino = st.file(from)?;
        st.parent_exists(to)?;
        if st.live.get(to) == Some(&Entry::Dir) {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!("{} is a directory", to.display()),
            ));
        }
        st.live.remove(from);
        st.live.insert(to.to_owned(), Entry::File(ino));
        Ok(())
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        self.removals.pass();
        let mut st = self.state();
        st.fail_call(Op::Remove)?;
        st.file(path)?;
        st.live.remove(path);
        Ok(())
    }

    fn sync_dir(&self, path: &Path) -> io::Result<()> {
        self.syncs.pass();
        let mut st = self.state();
        st.fail_call(Op::SyncDir)?;
        if !st.dir_exists(path) {
            return Err(not_found(path));
        }
        let State { live, durable, .. } = &mut *st;
        durable.retain(|p, _| p.parent() != Some(path) || live.contains_key(p));
        for (p, e) in live.iter().filter(|(p, _)| p.parent() == Some(path)) {
            durable.insert(p.clone(), *e);
        }
        Ok(())
    }

    fn lock(&self, path: &Path) -> Result<SimLock, LockError> {
        let mut st = self.state();
        st.fail_call(Op::Lock).map_err(LockError::Io)?;
        if st.locks.iter().any(|p| p == path) {
            return Err(LockError::Held {
                holder: "another handle in this process".into(),
            });
        }
        if !st.live.contains_key(path) {
            st.create_file(path, true).map_err(LockError::Io)?;
        }
        st.locks.push(path.to_owned());
        Ok(SimLock {
            fs: self.clone(),
            path: path.to_owned(),
        })
    }
}
