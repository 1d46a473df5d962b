//! [`BlockTier`]: the contract every tier of the store keeps (host RAM, the SSD, Redis),
//! checked for each by one conformance suite (`store/tests/it/tier_contract.rs`).
//!
//! A tier maps (namespace, key) to a block. Implementations MUST:
//!
//! - **serve only what was put, verified**: [`get`](BlockTier::get) returns a block equal
//!   (metadata and plane bytes) to one [`put`](BlockTier::put) under that name, or a miss;
//!   bytes that fail verification (checksum, or a name that is not the one asked for) are
//!   [`TierRead::Corrupt`], never a hit, and are not served again;
//! - **put atomically**: a failed or interrupted put leaves the tier as it was or holding
//!   the whole block, never part of it; putting a block the tier holds changes nothing;
//! - **keep the budget**: when [`budget`](BlockTier::budget) is `Some(b)`,
//!   [`used_bytes`](BlockTier::used_bytes) is at most `b` whenever no call is running
//!   (room is made by evicting, least recently used first);
//! - **forget what is removed**: after [`remove`](BlockTier::remove) returns, `get` and
//!   [`contains`](BlockTier::contains) miss; removing an absent block returns `false`;
//! - **list what they hold**: [`keys`](BlockTier::keys) is exactly the set `get` would hit
//!   when no other call runs (a remote tier may lose keys to its own expiry at any time).
//!
//! The [`crate::Store`] facade composes the tiers with more than this contract (write-behind,
//! chain recency, promotion); the contract is what each tier guarantees on its own.

use std::sync::{Arc, Mutex};

use crate::block::Block;
use crate::codec::DecodeError;
use crate::error::WriteError;
use crate::fs::FileSystem;
use crate::key::{BlockKey, NamespaceId};
use crate::ram::RamTier;
use crate::remote::RemoteTier;
use crate::ssd::{ReadOutcome, SsdTier};

/// What a tier's read found.
#[derive(Debug)]
pub enum TierRead {
    /// The block, verified.
    Hit(Arc<Block>),
    /// The tier does not hold it.
    Miss,
    /// The tier held bytes under that name that failed verification; they are not served
    /// (an SSD file is quarantined).
    Corrupt(DecodeError),
    /// The tier could not be asked (a remote tier that is down); nothing is known.
    Unavailable,
}

/// One tier of the block store. See the module docs for the rules implementations keep.
pub trait BlockTier: Send + Sync {
    /// The tier's name in messages: `ram`, `ssd`, `remote`.
    fn name(&self) -> &'static str;
    /// Whether the tier holds the block, without reading it or changing its recency.
    fn contains(&self, ns: NamespaceId, key: BlockKey) -> bool;
    /// The block, verified, marked as just used.
    fn get(&self, ns: NamespaceId, key: BlockKey) -> TierRead;
    /// Stores `block` under its own namespace and key, evicting for the budget.
    fn put(&self, block: Arc<Block>) -> Result<(), WriteError>;
    /// Forgets a block; whether the tier held it.
    fn remove(&self, ns: NamespaceId, key: BlockKey) -> Result<bool, WriteError>;
    /// Every block held.
    fn keys(&self) -> Result<Vec<(NamespaceId, BlockKey)>, WriteError>;
    /// Bytes the blocks take in this tier (RAM: plane bytes; SSD: file bytes; Redis: value
    /// bytes).
    fn used_bytes(&self) -> u64;
    /// The most bytes the tier keeps, if it enforces a budget (Redis leaves it to its own
    /// `maxmemory` policy).
    fn budget(&self) -> Option<u64>;
}

fn lock(m: &Mutex<RamTier>) -> std::sync::MutexGuard<'_, RamTier> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl BlockTier for Mutex<RamTier> {
    fn name(&self) -> &'static str {
        "ram"
    }

    fn contains(&self, ns: NamespaceId, key: BlockKey) -> bool {
        lock(self).contains(ns, key)
    }

    fn get(&self, ns: NamespaceId, key: BlockKey) -> TierRead {
        match lock(self).get(ns, key) {
            Some(b) => TierRead::Hit(b),
            None => TierRead::Miss,
        }
    }

    fn put(&self, block: Arc<Block>) -> Result<(), WriteError> {
        let mut ram = lock(self);
        let budget = ram.budget();
        if block.data_len() > budget {
            return Err(WriteError::TooLarge {
                bytes: block.data_len(),
                budget,
            });
        }
        // What leaves to make room is dropped: the store spills it to the next tier.
        ram.insert(block);
        Ok(())
    }

    fn remove(&self, ns: NamespaceId, key: BlockKey) -> Result<bool, WriteError> {
        Ok(lock(self).remove(ns, key).is_some())
    }

    fn keys(&self) -> Result<Vec<(NamespaceId, BlockKey)>, WriteError> {
        Ok(lock(self)
            .snapshot()
            .iter()
            .map(|b| (b.meta.namespace, b.meta.key))
            .collect())
    }

    fn used_bytes(&self) -> u64 {
        lock(self).used_bytes()
    }

    fn budget(&self) -> Option<u64> {
        Some(lock(self).budget())
    }
}

impl<F: FileSystem> BlockTier for SsdTier<F> {
    fn name(&self) -> &'static str {
        "ssd"
    }

    fn contains(&self, ns: NamespaceId, key: BlockKey) -> bool {
        SsdTier::contains(self, ns, key)
    }

    fn get(&self, ns: NamespaceId, key: BlockKey) -> TierRead {
        match SsdTier::get(self, ns, key) {
            ReadOutcome::Hit(b) => TierRead::Hit(Arc::new(b)),
            ReadOutcome::Miss => TierRead::Miss,
            ReadOutcome::Corrupt { error, .. } => TierRead::Corrupt(error),
        }
    }

    fn put(&self, block: Arc<Block>) -> Result<(), WriteError> {
        SsdTier::put(self, &block).map(|_| ())
    }

    fn remove(&self, ns: NamespaceId, key: BlockKey) -> Result<bool, WriteError> {
        SsdTier::remove(self, ns, key)
    }

    fn keys(&self) -> Result<Vec<(NamespaceId, BlockKey)>, WriteError> {
        Ok(self
            .entries()
            .iter()
            .map(|e| (e.namespace, e.key))
            .collect())
    }

    fn used_bytes(&self) -> u64 {
        SsdTier::used_bytes(self)
    }

    fn budget(&self) -> Option<u64> {
        Some(SsdTier::budget(self))
    }
}

impl BlockTier for RemoteTier {
    fn name(&self) -> &'static str {
        "remote"
    }

    fn contains(&self, ns: NamespaceId, key: BlockKey) -> bool {
        self.exists(ns, &[key])
            .and_then(|v| v.first().copied())
            .unwrap_or(false)
    }

    fn get(&self, ns: NamespaceId, key: BlockKey) -> TierRead {
        let Some(values) = RemoteTier::get(self, ns, &[key]) else {
            return TierRead::Unavailable;
        };
        let Some(Some(bytes)) = values.into_iter().next() else {
            return TierRead::Miss;
        };
        match crate::codec::decode(bytes.into()) {
            Ok(b) if b.meta.namespace == ns && b.meta.key == key => TierRead::Hit(Arc::new(b)),
            Ok(b) => TierRead::Corrupt(DecodeError::Planes(format!(
                "the value holds block {} of namespace {}, not the one its name says",
                b.meta.key, b.meta.namespace
            ))),
            Err(e) => TierRead::Corrupt(e),
        }
    }

    fn put(&self, block: Arc<Block>) -> Result<(), WriteError> {
        let bytes = crate::codec::encode(&block).map_err(|e| WriteError::Invalid {
            key: block.meta.key,
            reason: e.to_string(),
        })?;
        if RemoteTier::put(self, block.meta.namespace, block.meta.key, &bytes, None) {
            Ok(())
        } else {
            Err(WriteError::Remote(
                "Redis did not take the block (unreachable, or refused it)".into(),
            ))
        }
    }

    fn remove(&self, ns: NamespaceId, key: BlockKey) -> Result<bool, WriteError> {
        self.delete(ns, key)
            .ok_or_else(|| WriteError::Remote("Redis is unreachable".into()))
    }

    fn keys(&self) -> Result<Vec<(NamespaceId, BlockKey)>, WriteError> {
        self.scan()
            .map(|v| v.into_iter().map(|(ns, key, _)| (ns, key)).collect())
            .map_err(|e| WriteError::Remote(e.to_string()))
    }

    fn used_bytes(&self) -> u64 {
        self.scan()
            .map(|v| v.iter().map(|(_, _, len)| len).sum())
            .unwrap_or(0)
    }

    fn budget(&self) -> Option<u64> {
        None
    }
}

/// The remote tier of `config` on its own, as a [`BlockTier`] (the store builds its own).
pub fn remote_tier(config: crate::RemoteConfig) -> Result<impl BlockTier, WriteError> {
    RemoteTier::new(config, Arc::new(crate::stats::Counters::default()))
        .map_err(|e| WriteError::Remote(e.to_string()))
}
