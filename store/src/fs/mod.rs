//! The file system under the SSD tier: the few operations the tier performs on its files,
//! behind [`FileSystem`], so that tests can run the tier on a file system that fails.
//!
//! - [`RealFs`] is the operating system's (`std::fs` with `O_NOFOLLOW` opens, see
//!   `nofollow.rs`); the tier uses it unless told otherwise.
//! - [`SimFs`] keeps files in memory and separates what a process sees (the page cache) from
//!   what survives a power cut (what was fsync'd, and directory entries whose directory was
//!   fsync'd). It loses everything else on [`SimFs::power_loss`] and fails chosen calls on
//!   request ([`Fault`]): `fsync`, `rename`, `write` with ENOSPC or EIO, a write torn in the
//!   middle, a power cut at the Nth call.
//!
//! The tier is generic over the file system (`SsdTier<F = RealFs>`), so a block read or
//! write costs the same as direct `std::fs` calls: no trait object, no boxing, no copy.
//! Offline tools (`gc`, `inspect`) walk the directory with [`RealFs`] as well.

use std::io;
use std::path::Path;

mod real;
mod sim;

pub use real::RealFs;
pub use sim::{Fault, FaultCounts, FaultKind, Op, SimFs};

/// What a path names, links not followed (unless the call says it follows them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileKind {
    /// A regular file.
    File,
    /// A directory.
    Dir,
    /// A symbolic link, FIFO, socket or device: never opened by the store.
    Other,
}

/// What the tier needs to know about a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileStat {
    /// File, directory or something else.
    pub kind: FileKind,
    /// Length in bytes.
    pub len: u64,
    /// Bytes the file occupies on the device (allocated blocks); what the budget counts.
    pub physical_bytes: u64,
    /// Last modification, Unix milliseconds (0 when unknown).
    pub modified_unix_ms: u64,
}

impl FileStat {
    /// Whether this is a regular file.
    pub fn is_file(&self) -> bool {
        self.kind == FileKind::File
    }

    /// Whether this is a directory.
    pub fn is_dir(&self) -> bool {
        self.kind == FileKind::Dir
    }
}

/// One entry of a directory listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirEntry {
    /// The entry's name (lossily converted to UTF-8; the store's own names are ASCII).
    pub name: String,
    /// What it is, not following links.
    pub kind: FileKind,
}

/// A file open for reading at offsets, shared by the threads of one block read.
pub trait ReadAt: Send + Sync {
    /// The file's length now.
    fn len(&self) -> io::Result<u64>;
    /// Whether the file is empty now.
    fn is_empty(&self) -> io::Result<bool> {
        Ok(self.len()? == 0)
    }
    /// Fills `buf` from `offset`; a file that ends first is `UnexpectedEof`.
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
}

/// A file open for writing.
pub trait WritableFile: io::Write + Send {
    /// Makes the file's data and metadata durable (`fsync`).
    fn sync_all(&mut self) -> io::Result<()>;
    /// Makes the file's data durable (`fdatasync`).
    fn sync_data(&mut self) -> io::Result<()>;
}

/// Why the store's lock was not taken.
#[derive(Debug)]
pub enum LockError {
    /// Another writer holds it; what the lock file says about the holder.
    Held {
        /// The holder, as the lock file names it ("holder unknown" when it says nothing).
        holder: String,
    },
    /// The lock file could not be opened, locked or written.
    Io(io::Error),
}

/// The operations the SSD tier performs on its directory.
///
/// Paths are absolute or relative to the process's directory, as the tier was given them.
/// Implementations MUST: never follow a symbolic link in the last component of a path they
/// open, create, or stat with [`symlink_metadata`](FileSystem::symlink_metadata) (a link is
/// refused with an error, or reported as [`FileKind::Other`]); make a file's bytes durable
/// only through [`WritableFile::sync_all`]/[`sync_data`](WritableFile::sync_data), and a
/// created, renamed or removed directory entry durable only through
/// [`sync_dir`](FileSystem::sync_dir) of its directory; report a full device as
/// `ErrorKind::StorageFull` or `ENOSPC`.
pub trait FileSystem: Send + Sync + 'static {
    /// A file open for reading.
    type Reader: ReadAt;
    /// A file open for writing.
    type Writer: WritableFile;
    /// The store's exclusive lock, held while this value lives.
    type Lock: Send + Sync;

    /// Stat following links (used for the store root, which may be reached through one).
    fn metadata(&self, path: &Path) -> io::Result<FileStat>;
    /// Stat without following a link in the last component.
    fn symlink_metadata(&self, path: &Path) -> io::Result<FileStat>;
    /// The entries of a directory, sorted by name.
    fn read_dir(&self, path: &Path) -> io::Result<Vec<DirEntry>>;
    /// Creates one directory (mode 0700); `AlreadyExists` when something has the name.
    fn create_dir(&self, path: &Path) -> io::Result<()>;
    /// Creates a directory and its missing parents (mode 0700).
    fn create_dir_all(&self, path: &Path) -> io::Result<()>;
    /// Checks that `path` is a real directory, not a link to one; `Ok(false)` when missing.
    fn check_dir(&self, path: &Path) -> io::Result<bool>;
    /// Opens a regular file for reading, never following a link.
    fn open_read(&self, path: &Path) -> io::Result<Self::Reader>;
    /// Reads all of a regular file, never following a link; one longer than `cap` bytes is
    /// refused.
    fn read_capped(&self, path: &Path, cap: u64) -> io::Result<Vec<u8>>;
    /// Creates a new empty file (mode 0600); fails when the name exists.
    fn create_new(&self, path: &Path) -> io::Result<Self::Writer>;
    /// Creates or truncates a regular file (mode 0600), never following a link.
    fn create_truncate(&self, path: &Path) -> io::Result<Self::Writer>;
    /// Opens an existing regular file for appending, never following a link.
    fn open_append(&self, path: &Path) -> io::Result<Self::Writer>;
    /// Renames a file, replacing `to` if it exists.
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()>;
    /// Removes a file.
    fn remove_file(&self, path: &Path) -> io::Result<()>;
    /// Makes a directory's entries durable (`fsync` of the directory).
    fn sync_dir(&self, path: &Path) -> io::Result<()>;
    /// Takes the exclusive lock on the lock file at `path` (creating it) and records this
    /// process in it.
    fn lock(&self, path: &Path) -> Result<Self::Lock, LockError>;
}

/// ENOSPC or EDQUOT: the file system (or the user's quota) has no room.
pub(crate) fn is_storage_full(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::StorageFull
        || matches!(e.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT))
}
