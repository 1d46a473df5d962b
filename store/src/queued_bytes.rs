//! [`QueuedBytes`]: the bytes of the blocks waiting for one background worker, bounded.
//!
//! The write-behind queue (to the SSD tier) and the publication queue (to the remote tier)
//! both take whole blocks in bursts: a published prompt's blocks enter RAM together, and as
//! many leave a full RAM tier at once. A bound in jobs lets a burst of large blocks
//! overflow while a queue of small ones could hold far more memory than meant; so each
//! queue counts the bytes of its blocks from queueing until its worker is done with them,
//! and a block that does not fit is skipped (and counted by the caller).

use std::sync::atomic::{AtomicU64, Ordering};

/// Bytes of the blocks queued for one background worker (or being worked on), and their
/// bound.
#[derive(Debug)]
pub(crate) struct QueuedBytes {
    bytes: AtomicU64,
    bound: u64,
}

impl QueuedBytes {
    /// An empty queue of at most `bound` bytes.
    pub(crate) fn new(bound: u64) -> Self {
        QueuedBytes {
            bytes: AtomicU64::new(0),
            bound,
        }
    }

    /// Counts a block of `bytes` in if it fits the bound; a block always fits an empty
    /// queue, so a bound below one block still lets blocks through one at a time. Returns
    /// whether it was counted.
    pub(crate) fn try_add(&self, bytes: u64) -> bool {
        self.bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |q| {
                (q == 0 || q.saturating_add(bytes) <= self.bound).then(|| q.saturating_add(bytes))
            })
            .is_ok()
    }

    /// Counts `bytes` in whatever the bound (for a caller that waits for room instead of
    /// skipping, as a flush does).
    pub(crate) fn add(&self, bytes: u64) {
        let _ = self
            .bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |q| {
                Some(q.saturating_add(bytes))
            });
    }

    /// Takes `bytes` of blocks written (or given up) out of the count.
    pub(crate) fn release(&self, bytes: u64) {
        let _ = self
            .bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |q| {
                Some(q.saturating_sub(bytes))
            });
    }

    /// Bytes counted now.
    #[cfg(test)]
    pub(crate) fn get(&self) -> u64 {
        self.bytes.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_fit_up_to_the_bound_and_room_comes_back_on_release() {
        let q = QueuedBytes::new(10);
        assert!(q.try_add(4));
        assert!(q.try_add(6));
        assert!(
            !q.try_add(1),
            "10 of 10 bytes queued: one more byte does not fit"
        );
        assert_eq!(q.get(), 10);
        q.release(6);
        assert!(!q.try_add(7));
        assert!(q.try_add(6));
        assert_eq!(q.get(), 10);
    }

    #[test]
    fn a_lone_block_larger_than_the_bound_fits_an_empty_queue_only() {
        let q = QueuedBytes::new(10);
        assert!(q.try_add(25));
        assert!(!q.try_add(1));
        q.release(25);
        assert_eq!(q.get(), 0);
        assert!(q.try_add(1));
        assert!(!q.try_add(25));
    }

    #[test]
    fn a_forced_add_passes_the_bound_and_later_adds_wait_for_room() {
        let q = QueuedBytes::new(10);
        assert!(q.try_add(8));
        q.add(8);
        assert_eq!(q.get(), 16);
        assert!(!q.try_add(1));
        q.release(8);
        assert!(!q.try_add(3));
        assert!(q.try_add(2));
        q.release(100);
        assert_eq!(q.get(), 0, "releases never go below zero");
    }
}
