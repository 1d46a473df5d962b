//! A bound on host memory held by restores staged ahead of admission.
//!
//! An I/O worker stages a loaded prefix (cache::StagedRestore: its blocks assembled in the
//! device layout, page-locked on CUDA) while the request waits for admission, so every
//! request loaded ahead holds a second copy of its prefix's bytes until the engine thread
//! installs it. Under a long queue of long prompts those copies add up (a 50K-token prefix
//! of SmolLM2 in f32 is 2.3 GB); past this budget a load is not staged and the engine
//! thread assembles it at admission, as before staging existed.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Host bytes staged restores may hold at once, by default.
pub const DEFAULT_STAGING_BYTES: u64 = 4 << 30;

/// Bytes held by staged restores, against a limit.
#[derive(Debug, Clone)]
pub(crate) struct StagingBudget {
    held: Arc<AtomicU64>,
    limit: u64,
}

/// Bytes charged to a [`StagingBudget`], given back when dropped.
#[derive(Debug)]
pub(crate) struct StagingCharge {
    held: Arc<AtomicU64>,
    bytes: u64,
}

impl StagingBudget {
    /// A budget of `limit` bytes.
    pub(crate) fn new(limit: u64) -> Self {
        Self {
            held: Arc::default(),
            limit,
        }
    }

    /// Charges `bytes` if they fit beside what is held.
    pub(crate) fn try_charge(&self, bytes: u64) -> Option<StagingCharge> {
        self.held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                held.checked_add(bytes).filter(|&t| t <= self.limit)
            })
            .ok()?;
        Some(StagingCharge {
            held: self.held.clone(),
            bytes,
        })
    }

    /// Bytes held now.
    #[cfg(test)]
    pub(crate) fn held(&self) -> u64 {
        self.held.load(Ordering::Acquire)
    }
}

impl Drop for StagingCharge {
    fn drop(&mut self) {
        self.held.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charges_fit_the_limit_and_are_given_back_when_dropped() {
        let budget = StagingBudget::new(100);
        let a = budget.try_charge(60).expect("60 of 100 fits");
        assert!(budget.try_charge(41).is_none(), "60 + 41 is over 100");
        let b = budget.try_charge(40).expect("60 + 40 fits");
        assert_eq!(budget.held(), 100);
        drop(a);
        assert_eq!(budget.held(), 40);
        assert!(budget.try_charge(u64::MAX).is_none(), "no overflow");
        drop(b);
        assert_eq!(budget.held(), 0);
    }
}
