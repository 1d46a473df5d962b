//! Error types, one per operation. Messages say what happened, to which file, and what to do.

use std::io;
use std::path::PathBuf;

use crate::block::LayoutError;
use crate::key::{BlockKey, NamespaceId};

/// Opening a store failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OpenError {
    /// A read-only open of a directory that does not exist.
    #[error("store directory {path} does not exist; check --store / $KVSTORE_DIR, or open it once for writing to create it")]
    NotFound {
        /// The root.
        path: PathBuf,
    },
    /// The root exists but is not a directory.
    #[error("{path} is not a directory; point the store at a directory")]
    NotADirectory {
        /// The root.
        path: PathBuf,
    },
    /// A non-empty directory without a store marker.
    #[error("{path} is not empty and has no {marker}, so it is not a kvstore store; use an empty or new directory")]
    NotAStore {
        /// The root.
        path: PathBuf,
        /// Name of the marker file looked for.
        marker: &'static str,
    },
    /// A store written by an incompatible format version, or an unreadable marker.
    #[error("store marker {path} says {found}; this build reads format version {expected}. Use a matching kvstore build or another directory (or delete this store)")]
    IncompatibleFormat {
        /// The marker file.
        path: PathBuf,
        /// What the marker says.
        found: String,
        /// The version this build reads.
        expected: u32,
    },
    /// Another process holds the writer lock.
    #[error("store {path} is already open for writing by another process ({holder}); stop it, or open this one read-only")]
    Locked {
        /// The lock file.
        path: PathBuf,
        /// What the lock file says about its holder.
        holder: String,
    },
    /// The remote tier's URL does not parse, or its CA file is unreadable (nothing is
    /// connected at open).
    #[error("remote tier {url:?} cannot be used: {message}; expected redis://[user:password@]host:port[/db], rediss://… (TLS) or redis+cluster://host:port,host:port,…")]
    RemoteUrl {
        /// The URL, password removed.
        url: String,
        /// Why it was refused.
        message: String,
    },
    /// An I/O error on a named path.
    #[error("I/O error on {path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
    /// The write-behind worker thread could not start.
    #[error("could not start the write-behind thread: {0}")]
    Worker(io::Error),
}

/// Writing to the SSD tier (or flushing to it) failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WriteError {
    /// The store was opened read-only.
    #[error("store {path} is open read-only; open it for writing to change it")]
    ReadOnly {
        /// The root.
        path: PathBuf,
    },
    /// An earlier fsync or rename failed; the writer refuses further work.
    #[error("store writer is poisoned by an earlier I/O failure ({cause}); no further writes until the store is reopened, check the disk")]
    Poisoned {
        /// The failure that poisoned the writer.
        cause: String,
    },
    /// A block larger than the whole SSD budget.
    #[error("block of {bytes} bytes exceeds the SSD budget of {budget} bytes; raise the budget or use smaller blocks")]
    TooLarge {
        /// Estimated physical size.
        bytes: u64,
        /// The budget.
        budget: u64,
    },
    /// The block does not fit beside the pinned blocks, which are never evicted to make
    /// room ([`crate::Pins`]). The block was not stored.
    #[error("block of {bytes} bytes does not fit beside {pinned} pinned bytes in the SSD budget of {budget} bytes; pins are never evicted before they expire")]
    Pinned {
        /// Estimated physical size.
        bytes: u64,
        /// Physical bytes pinned now.
        pinned: u64,
        /// The budget.
        budget: u64,
    },
    /// An I/O error on a named path (for example ENOSPC). The block was not stored.
    #[error("I/O error on {path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
    /// The block cannot be encoded (bad plane lengths, duplicate names, wrong key).
    #[error("invalid block {key}: {reason}")]
    Invalid {
        /// The block's key.
        key: BlockKey,
        /// What is wrong.
        reason: String,
    },
    /// The remote tier did not take or answer a write.
    #[error("remote tier: {0}")]
    Remote(String),
    /// The store has no SSD tier (no root configured).
    #[error("the store has no SSD tier; set a root directory to persist blocks")]
    NoSsdTier,
    /// A flush found that some accepted writes failed since the previous flush.
    #[error("{failed} block write(s) failed since the last flush; last error: {last}")]
    Incomplete {
        /// Writes that failed.
        failed: u64,
        /// The last failure.
        last: String,
    },
    /// The write-behind worker has stopped.
    #[error("the write-behind worker has stopped; reopen the store")]
    WorkerGone,
}

/// Inserting a block into the store was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InsertError {
    /// The block's namespace was never registered with this store.
    #[error("namespace {0} is not registered; call register_namespace first")]
    UnknownNamespace(NamespaceId),
    /// The block's planes do not match the namespace's layout.
    #[error("block {key} does not match its namespace's plane layout: {source}")]
    Layout {
        /// The block's key.
        key: BlockKey,
        /// The mismatch.
        source: Box<LayoutError>,
    },
    /// The block's key is not `blake3(parent || tokens)`.
    #[error("block key {key} is not derived from its parent and tokens (expected {computed})")]
    Key {
        /// Key given.
        key: BlockKey,
        /// Key derived.
        computed: BlockKey,
    },
}

/// Registering a namespace failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RegisterError {
    /// Writing the namespace description failed.
    #[error("could not write namespace description {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
    /// The description cannot be used (e.g. block size 0 or no planes).
    #[error("invalid namespace description: {0}")]
    Invalid(String),
}
