//! Parallel SSD reads for one prefix load: a few scoped threads read and verify the block
//! files a load will need, in chain order, while the loading thread checks and promotes the
//! blocks that have arrived.
//!
//! Why: a block file is a few hundred KB to a few MB, so one thread reading them one after
//! another leaves the disk at queue depth 1 and hashes on one core; a 32K-token prefix is
//! about a thousand files. Readers keep several reads in flight and spread the checksums
//! over cores. Verification stays per block and complete ([`SsdTier::read`]); the loading
//! thread still checks chain, tokens and layout in order and stops at the first failure,
//! after which the readers stop taking new files.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver};
use std::thread::Scope;

use crate::fs::FileSystem;
use crate::key::{BlockKey, NamespaceId};
use crate::ssd::{ReadOutcome, SsdTier};

/// Default reader threads of one load: enough to keep an NVMe drive busy and the checksums
/// on several cores, few enough that a short chain does not pay for idle threads.
pub(crate) const SSD_READERS: usize = 8;

/// The SSD reads of one load and the readers' shared state.
pub(crate) struct ReadPlan {
    /// Indices into the load's keys, ascending.
    indices: Vec<usize>,
    readers: usize,
    /// Next position in `indices` a reader takes.
    next: AtomicUsize,
    /// Set when the load is over: readers take no further file.
    stop: AtomicBool,
}

impl ReadPlan {
    /// Reads of `keys[i]` for each `i` in `indices` (ascending) on up to `readers` threads.
    pub(crate) fn new(indices: Vec<usize>, readers: usize) -> Self {
        ReadPlan {
            indices,
            readers,
            next: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
        }
    }
}

/// Reads of the planned keys, started in chain order, arriving out of order.
pub(crate) struct ReadAhead<'scope> {
    rx: Option<Receiver<(usize, ReadOutcome)>>,
    arrived: HashMap<usize, ReadOutcome>,
    planned: HashSet<usize>,
    stop: &'scope AtomicBool,
}

impl<'scope> ReadAhead<'scope> {
    /// Starts `plan`'s reads of `keys` on threads of `scope`. With fewer than two planned
    /// reads or one reader no thread is started and [`take`](Self::take) reads nothing
    /// ahead; so does `ssd: None`.
    pub(crate) fn start<'env, F: FileSystem>(
        scope: &'scope Scope<'scope, 'env>,
        ssd: Option<&'scope SsdTier<F>>,
        ns: NamespaceId,
        keys: &'scope [BlockKey],
        plan: &'scope ReadPlan,
    ) -> Self {
        let idle = ReadAhead {
            rx: None,
            arrived: HashMap::new(),
            planned: HashSet::new(),
            stop: &plan.stop,
        };
        let Some(ssd) = ssd else {
            return idle;
        };
        if plan.indices.len() < 2 || plan.readers < 2 {
            return idle;
        }
        let (tx, rx) = channel();
        for _ in 0..plan.readers.min(plan.indices.len()) {
            let tx = tx.clone();
            scope.spawn(move || loop {
                if plan.stop.load(Ordering::Relaxed) {
                    return;
                }
                let Some(&index) = plan.indices.get(plan.next.fetch_add(1, Ordering::Relaxed))
                else {
                    return;
                };
                let outcome = ssd.read(ns, keys[index], false);
                if tx.send((index, outcome)).is_err() {
                    return;
                }
            });
        }
        let mut ahead = idle;
        ahead.rx = Some(rx);
        ahead.planned = plan.indices.iter().copied().collect();
        ahead
    }

    /// The read of `keys[index]` if it was planned (waiting for it to arrive), `None` if it
    /// was not: the caller reads it itself.
    pub(crate) fn take(&mut self, index: usize) -> Option<ReadOutcome> {
        if !self.planned.remove(&index) {
            return None;
        }
        let rx = self.rx.as_ref()?;
        loop {
            if let Some(outcome) = self.arrived.remove(&index) {
                return Some(outcome);
            }
            match rx.recv() {
                Ok((i, outcome)) => {
                    self.arrived.insert(i, outcome);
                }
                // Every reader gone without it: read it on the caller's thread.
                Err(_) => return None,
            }
        }
    }
}

impl Drop for ReadAhead<'_> {
    /// Readers finish the file in hand and take no other.
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}
