//! The store-wide use clock: one monotonic counter that stamps every use and recency
//! refresh of a block in both host tiers, so that the RAM tier's recency and the SSD tier's
//! are one order. A block the RAM tier gives up (evicted, not admitted, or written by a
//! flush) reaches the SSD tier with the stamp of its last use in RAM, not "now", and the
//! SSD tier ranks it among its own blocks by that stamp (docs/prefix-reuse.md, "Eviction").
//!
//! The SSD tier persists stamps as the access journal's sequence numbers and numbers its
//! blocks 1..n again when it opens; the clock of a store then starts after n.
//!
//! A stamp orders uses but tells no time. [`UsedAt`] pairs it with the wall-clock time of
//! the same use, so a block written to the SSD tier long after its last use (a spill, the
//! flush at close) records when it was used, which `inspect` shows and `gc --older-than`
//! reads, not when it was written.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// A shared monotonic counter of block uses; clones share it. Stamps are never 0.
#[derive(Debug, Clone, Default)]
pub struct UseClock(Arc<AtomicU64>);

impl UseClock {
    /// A clock whose first stamp is `last + 1`.
    pub fn starting_after(last: u64) -> Self {
        UseClock(Arc::new(AtomicU64::new(last)))
    }

    /// A new stamp, larger than every stamp handed out before.
    pub fn tick(&self) -> u64 {
        self.0.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// The last stamp handed out (0 before the first).
    pub fn last(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// One use of a block: its [`UseClock`] stamp (the order among uses) and the wall-clock
/// time it happened (Unix milliseconds).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UsedAt {
    /// The use's stamp.
    pub stamp: u64,
    /// When it happened, Unix milliseconds.
    pub unix_ms: u64,
}

impl UsedAt {
    /// A use stamped `stamp` that happens now.
    pub fn now(stamp: u64) -> Self {
        UsedAt {
            stamp,
            unix_ms: crate::block::now_unix_ms(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clones_share_one_increasing_count() {
        let a = UseClock::starting_after(41);
        let b = a.clone();
        assert_eq!(a.tick(), 42);
        assert_eq!(b.tick(), 43);
        assert_eq!(a.last(), 43);
        assert_eq!(UseClock::default().tick(), 1);
    }
}
