//! [`QueuedBytes`]: the bytes of the blocks waiting for one background worker, bounded.
//!
//! The write-behind queue (to the SSD tier) and the publication queue (to the remote tier)
//! both take whole blocks in bursts: a published prompt's blocks enter RAM together, and as
//! many leave a full RAM tier at once. A bound in jobs lets a burst of large blocks
//! overflow while a queue of small ones could hold far more memory than meant; so each
//! queue counts the bytes of its blocks from queueing until its worker is done with them,
//! and a block that does not fit is skipped (and counted by the caller).
//!
//! Once a block was skipped, the queue skips every block until it has drained to half its
//! bound ([`QUEUE_RESUME_SHARE`]). Without that mark a queue kept full by a faster producer takes
//! a block each time its worker frees room for one, so its losses fall one by one all
//! over the chains that pass through it, and a chain with one block lost is useless past
//! it: on the Mooncake trace, a quarter of the spills dropped one at a time left the SSD
//! tier 0.1 % of the prompt tokens against 3.4 % for the same share dropped in runs of
//! 300 (docs/benchmarks.md, "Where the tiers' hits go"). Skipping in runs costs the worker
//! nothing: it keeps writing what it holds meanwhile.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// The share of its bound a write-behind or remote publication queue that skipped a block
/// drains to before it takes blocks again (`kvstore bench trace --simulate --writer`
/// models the same mark).
pub const QUEUE_RESUME_SHARE: f64 = 0.5;

/// Bytes of the blocks queued for one background worker (or being worked on), and their
/// bound.
#[derive(Debug)]
pub(crate) struct QueuedBytes {
    bytes: AtomicU64,
    bound: u64,
    /// Bytes the queue drains to after a skip ([`QUEUE_RESUME_SHARE`] of the bound).
    resume: u64,
    /// A block was skipped: skip until the queue has drained to `resume`.
    shedding: AtomicBool,
}

impl QueuedBytes {
    /// An empty queue of at most `bound` bytes.
    pub(crate) fn new(bound: u64) -> Self {
        QueuedBytes {
            bytes: AtomicU64::new(0),
            bound,
            resume: (bound as f64 * QUEUE_RESUME_SHARE) as u64,
            shedding: AtomicBool::new(false),
        }
    }

    /// Counts a block of `bytes` in if it fits the bound and the queue is not draining
    /// after a skip (to [`QUEUE_RESUME_SHARE`] of its bound); a block always fits an empty queue,
    /// so a bound below one block still lets blocks through one at a time. Returns whether
    /// it was counted.
    pub(crate) fn try_add(&self, bytes: u64) -> bool {
        if self.shedding.load(Ordering::Acquire) {
            if self.bytes.load(Ordering::Acquire) > self.resume {
                return false;
            }
            self.shedding.store(false, Ordering::Release);
        }
        let added = self
            .bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |q| {
                (q == 0 || q.saturating_add(bytes) <= self.bound).then(|| q.saturating_add(bytes))
            })
            .is_ok();
        if !added {
            self.shedding.store(true, Ordering::Release);
        }
        added
    }

    /// Counts `bytes` in whatever the bound and the mark (for a caller that waits for room
    /// instead of skipping, as a flush does).
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
    fn a_queue_that_skipped_a_block_takes_blocks_again_once_drained_to_half() {
        let q = QueuedBytes::new(10);
        assert!(q.try_add(5));
        assert!(q.try_add(5));
        assert!(!q.try_add(1), "full");
        q.release(2);
        // Room for 2 bytes, but 8 queued is above the mark of 5: skipped, as every block
        // until the queue has drained.
        assert!(!q.try_add(1));
        assert!(!q.try_add(2));
        q.release(3);
        assert!(q.try_add(1), "5 queued: at the mark");
        assert!(q.try_add(4));
        assert_eq!(q.get(), 10);
        // A block that does not fit skips again, and the mark holds as before.
        assert!(!q.try_add(1));
        q.release(4);
        assert!(!q.try_add(1));
        q.release(1);
        assert!(q.try_add(1));
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
        // 8 queued: above half the bound since the skip.
        assert!(!q.try_add(2));
        q.release(3);
        assert!(!q.try_add(6));
        assert!(q.try_add(5));
        q.release(100);
        assert_eq!(q.get(), 0, "releases never go below zero");
    }
}
