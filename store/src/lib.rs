//! Content-addressed store for published KV blocks: named, typed byte planes in a RAM
//! tier and an SSD tier. This crate never depends on MLX.
//!
//! # Overview
//!
//! - A [`Block`] is one block of tokens across all layers: ordered [`Plane`]s (name,
//!   [`Dtype`], shape, bytes) plus [`BlockMeta`] (namespace, key, parent, position, tokens,
//!   creation time).
//! - A [`NamespaceDescription`] names everything that changes the bytes of a block (weights,
//!   tokenizer, KV dtype, block size, plane layout, ...); its [`NamespaceId`] is a blake3
//!   hash over a canonical, versioned encoding. A [`BlockKey`] is
//!   `blake3(parent || token ids)` with the namespace id as the root parent, so a block is
//!   named by its whole prefix: [`chain_keys`] turns token ids into the keys to look up.
//! - [`Store`] is the facade: a [`RamTier`] (byte-bounded cache of host-byte blocks; the
//!   store never calls MLX) over an [`SsdTier`] (one safetensors file per
//!   block, checksummed, crash safe, byte-budgeted, recency persisted), joined by a
//!   write-behind worker, and optionally a [`remote`] tier on Redis shared between engines
//!   (lookups in one pipelined round trip, verified fetches, asynchronous publication).
//! - Both tiers evict by one [`EvictionPolicy`] ([`eviction`]: LRU, LFU, or frequency-gated
//!   admission into RAM, the default); the RAM tier's order
//!   ([`ChainOrder`](eviction::ChainOrder)) is the code `kvstore bench trace --simulate` runs.
//! - [`Pins`] keep chosen blocks out of eviction in every tier until they expire (prompt
//!   caching's breakpoints and retention); durable pins survive a restart.
//! - [`gc`] and [`inspect`] look after a store directory offline; the `kvstore` binary
//!   wraps them.
//!
//! # Example
//!
//! ```
//! use std::sync::Arc;
//! use store::{chain_keys, Block, BlockMeta, Dtype, NamespaceDescription, Plane, PlaneSpec,
//!             Store, StoreConfig};
//!
//! let dir = tempfile::tempdir().unwrap();
//! let store: Store = Store::open(
//!     StoreConfig::default().root(dir.path()).ram_budget(1 << 20).ssd_budget(1 << 24),
//! ).unwrap();
//! let mut desc = NamespaceDescription::new("tiny", Dtype::F32, 4);
//! desc.planes = vec![PlaneSpec::new("k", Dtype::F32, vec![4, 2])];
//! let ns = store.register_namespace(&desc).unwrap();
//!
//! let tokens = [1u32, 2, 3, 4];
//! let keys = chain_keys(ns, &tokens, 4);
//! let meta = BlockMeta::new(ns, *ns.as_bytes(), 0, tokens.to_vec());
//! assert_eq!(meta.key, keys[0]);
//! let plane = Plane::new("k", Dtype::F32, vec![4, 2], vec![0u8; 32]);
//! store.insert(Arc::new(Block { meta, planes: vec![plane] })).unwrap();
//!
//! assert_eq!(store.lookup(ns, &keys).blocks(), 1);
//! let loaded = store.load_prefix(ns, &keys, &[tokens]);
//! assert_eq!(loaded.blocks.len(), 1);
//! store.flush().unwrap();
//! ```
#![deny(unsafe_code)]

mod block;
mod block_buffers;
mod clock;
mod codec;
mod error;
pub mod eviction;
pub mod format;
pub mod fs;
#[doc(hidden)]
pub mod fuzzing;
pub mod gc;
pub mod inspect;
mod journal;
mod key;
mod namespace;
mod nofollow;
mod pins;
mod queued_bytes;
mod ram;
mod read_ahead;
pub mod remote;
mod ssd;
mod stats;
mod store;
mod text;
pub mod tier;

pub use block::{Block, BlockMeta, Dtype, LayoutError, Plane, PlaneSpec};
pub use block_buffers::{set_block_buffers, BlockBuffer, BlockBuffers};
pub use clock::{UseClock, UsedAt};
pub use codec::{BlockHeader, DecodeError};
pub use error::{InsertError, OpenError, RegisterError, WriteError};
pub use eviction::EvictionPolicy;
pub use key::{block_key, chain_keys, BlockKey, NamespaceId, ParseKeyError};
pub use namespace::{KvQuantization, NamespaceDescription};
pub use pins::{PinnedBytes, Pins, PERSIST_SLACK};
pub use queued_bytes::QUEUE_RESUME_SHARE;
pub use ram::{Evicted, RamTier};
pub use remote::RemoteConfig;
pub use ssd::{PutJob, ReadOutcome, SsdEntry, SsdOptions, SsdTier, WriteOutcome};
pub use stats::{LoadPhases, StoreStats};
pub use store::{
    redact, BlockProblem, LoadedPrefix, PrefixHit, StopReason, Store, StoreConfig, Tier,
    WritePolicy, WritesPaused,
};
pub use text::{escape_control, escape_path};
pub use tier::{remote_tier, BlockTier, TierRead};
