//! The export thread (`kvstore-export`): turns the device copies of newly full blocks into
//! host-byte blocks and inserts them into the store, so that neither the device → host
//! transfer nor the hashing runs on the engine thread (cache/src/export.rs has the device
//! half; docs/architecture.md the thread model).
//!
//! Exports are finished in submission order. [`Exporter::wait_idle`] waits until every
//! export submitted so far is in the store: a lookup calls it first, so a block published
//! by one request is found by the next exactly as when publication was synchronous. The
//! device copies in flight are bounded ([`MAX_PENDING_BYTES`]): a submission beyond it
//! waits for the thread, so a burst of long prompts cannot hold unbounded device memory.

use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use cache::Export;
use store::Store;

/// Device bytes of exports submitted but not yet read back, beyond which a submission
/// waits (a single larger export is still accepted when nothing else is in flight).
pub const MAX_PENDING_BYTES: u64 = 1 << 30;

/// Counters of the export thread.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct ExportStats {
    /// Exports finished (each a run of blocks of one publication).
    pub exports: u64,
    /// Blocks inserted into the store.
    pub blocks: u64,
    /// Blocks lost to an error (logged): a failed device read or a refused insert.
    pub failed_blocks: u64,
    /// Times a submission waited for the thread (the in-flight bound was reached).
    pub waits: u64,
}

#[derive(Default)]
struct Pending {
    /// Exports submitted so far.
    submitted: u64,
    /// Exports finished so far (in submission order).
    finished: u64,
    bytes: u64,
    stats: ExportStats,
}

impl Pending {
    fn in_flight(&self) -> bool {
        self.finished < self.submitted
    }
}

struct Shared {
    pending: Mutex<Pending>,
    changed: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Pending> {
        // A panic while holding the lock cannot leave the counters inconsistent enough to
        // matter: keep going with them.
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `job` and counts it finished, waking those waiting.
    fn complete(&self, store: &Store, job: Job, bytes: u64) {
        let export = matches!(job, Job::Export(_));
        let (n, inserted) = job.run(store);
        let mut p = self.lock();
        p.finished += 1;
        p.bytes -= bytes;
        p.stats.exports += u64::from(export);
        p.stats.blocks += inserted;
        p.stats.failed_blocks += n - inserted;
        drop(p);
        self.changed.notify_all();
    }
}

/// Work for the export thread, done in submission order.
enum Job {
    /// A publication: read back, split, hash, insert.
    Export(Export),
    /// A small write to the store that must not run on the engine thread (the cost model).
    Task(Box<dyn FnOnce(&Store) + Send>),
}

impl Job {
    fn run(self, store: &Store) -> (u64, u64) {
        match self {
            Job::Export(export) => {
                let n = export.blocks() as u64;
                (n, finish(store, export))
            }
            Job::Task(task) => {
                task(store);
                (0, 0)
            }
        }
    }
}

/// The export thread and its queue.
pub struct Exporter {
    tx: Option<Sender<(Job, u64)>>,
    store: Arc<Store>,
    shared: Arc<Shared>,
    worker: Option<JoinHandle<()>>,
}

impl Exporter {
    /// Starts the thread; it inserts into `store`.
    pub fn start(store: Arc<Store>) -> std::io::Result<Self> {
        let (tx, rx) = channel::<(Job, u64)>();
        let shared = Arc::new(Shared {
            pending: Mutex::new(Pending::default()),
            changed: Condvar::new(),
        });
        let s = shared.clone();
        let thread_store = store.clone();
        let worker = std::thread::Builder::new()
            .name("kvstore-export".into())
            .spawn(move || {
                for (job, bytes) in rx {
                    s.complete(&thread_store, job, bytes);
                }
            })?;
        Ok(Self {
            tx: Some(tx),
            store,
            shared,
            worker: Some(worker),
        })
    }

    /// Hands `export` to the thread; waits first while more than [`MAX_PENDING_BYTES`] of
    /// device copies are in flight.
    pub fn submit(&self, export: Export) {
        let bytes = export.device_bytes();
        self.enqueue(Job::Export(export), bytes);
    }

    /// Runs `task` on the thread after what was submitted before it (a store write that
    /// must not block the engine thread).
    pub fn run(&self, task: impl FnOnce(&Store) + Send + 'static) {
        self.enqueue(Job::Task(Box::new(task)), 0);
    }

    fn enqueue(&self, job: Job, bytes: u64) {
        let mut p = self.shared.lock();
        if p.in_flight() && p.bytes + bytes > MAX_PENDING_BYTES {
            p.stats.waits += 1;
            while p.in_flight() && p.bytes + bytes > MAX_PENDING_BYTES {
                p = self
                    .shared
                    .changed
                    .wait(p)
                    .unwrap_or_else(|e| e.into_inner());
            }
        }
        p.submitted += 1;
        p.bytes += bytes;
        drop(p);
        let sent = self.tx.as_ref().map(|tx| tx.send((job, bytes)));
        if let Some(Err(std::sync::mpsc::SendError((job, bytes)))) = sent {
            // The thread is gone (it never exits before `Drop`): finish here, counted alike.
            tracing::error!("the export thread is gone; publishing on the caller's thread");
            self.shared.complete(&self.store, job, bytes);
        }
    }

    /// Waits until every export submitted before this call is in the store (or failed);
    /// exports submitted meanwhile are not waited for, so a busy engine cannot starve it.
    pub fn wait_idle(&self) {
        let mut p = self.shared.lock();
        let target = p.submitted;
        while p.finished < target {
            p = self
                .shared
                .changed
                .wait(p)
                .unwrap_or_else(|e| e.into_inner());
        }
    }

    /// The counters so far.
    pub fn stats(&self) -> ExportStats {
        self.shared.lock().stats
    }
}

impl Drop for Exporter {
    fn drop(&mut self) {
        // Closing the channel lets the thread finish what is queued and exit.
        self.tx.take();
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

/// Reads `export` back and inserts its blocks in chain order; returns how many went in. A
/// refused block ends the run (its successors would have no parent in the store).
fn finish(store: &Store, export: Export) -> u64 {
    let replaces = export.replaces();
    let blocks = match export.into_blocks() {
        Ok(b) => b,
        Err(e) => {
            tracing::warn!(error = %e, "reading published blocks back from the device failed");
            return 0;
        }
    };
    let mut inserted = 0;
    for b in blocks {
        let b = Arc::new(b);
        // Window-trimmed copies of blocks a sequence moved past take their keys' place.
        let result = match replaces {
            true => store.insert_replacing(b),
            false => store.insert(b),
        };
        if let Err(e) = result {
            tracing::warn!(error = %e, "the store refused a published block");
            break;
        }
        inserted += 1;
    }
    inserted
}
