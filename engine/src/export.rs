//! The export thread (`kvstore-export`): turns the device copies of newly full blocks into
//! host-byte blocks and inserts them into the store, so that neither the device → host
//! transfer nor the hashing runs on the engine thread (cache/src/export.rs has the device
//! half; docs/architecture.md the thread model).
//!
//! Exports are finished in submission order. [`Exporter::wait_for`] waits until no export
//! submitted so far holds any of the given blocks: a lookup calls it first with the keys it
//! is about to look up, so a block published by one request is found by the next exactly as
//! when publication was synchronous, while a lookup of other blocks (most of them, under a
//! load of unrelated prompts) never waits for the device → host copies and hashing of
//! exports it does not need. [`Exporter::wait_idle`] waits for everything (a flush). The
//! device copies in flight are bounded ([`MAX_PENDING_BYTES`]): an export beyond it is
//! skipped (dropped and counted), so a burst of long prompts can neither hold unbounded
//! device memory nor stall the engine thread, whose rows would all wait (docs/benchmarks.md,
//! session 22: 21 stalls of ~0.5 s in a 219 s trace run when submissions waited). A skipped
//! export's blocks stay in the device tier while their sequence is resident; the host
//! tiers do not get them, as a full write-behind queue drops SSD writes.

use std::collections::HashMap;
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cache::Export;
use store::{BlockKey, NamespaceId, Store};

/// Submissions the thread takes at once at most (one wait for the device for all).
const MAX_BATCH: usize = 64;

/// Device bytes of exports submitted but not yet read back, beyond which an export is
/// skipped (a single larger export is still accepted when nothing else is in flight).
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
    /// Exports skipped because the in-flight bound was reached (the thread was behind).
    pub skipped_exports: u64,
    /// Blocks of the skipped exports (not inserted into the host tiers).
    pub skipped_blocks: u64,
    /// Lookups that waited for an export holding one of their blocks.
    pub lookup_waits: u64,
    /// Times the thread waited for the device copies of the exports it took at once.
    pub batches: u64,
    /// Device bytes of the exports finished.
    pub bytes: u64,
    /// Microseconds lookups waited for exports holding their blocks.
    pub lookup_wait_us: u64,
    /// Microseconds the thread spent reading exports back from the device (and splitting
    /// them into blocks).
    pub read_us: u64,
    /// Microseconds the thread spent inserting blocks into the store (hashing included).
    pub insert_us: u64,
}

#[derive(Default)]
struct Pending {
    /// Exports submitted so far.
    submitted: u64,
    /// Exports finished so far (in submission order).
    finished: u64,
    bytes: u64,
    /// The blocks of exports in flight, each with the number of the last submission that
    /// holds it (submissions are numbered from 1 and finish in order).
    keys: HashMap<(NamespaceId, BlockKey), u64>,
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

    /// Waits, holding `p` between wake-ups, until the first `target` submissions finished;
    /// returns the lock.
    fn wait_finished<'a>(
        &self,
        mut p: MutexGuard<'a, Pending>,
        target: u64,
    ) -> MutexGuard<'a, Pending> {
        while p.finished < target {
            p = self.changed.wait(p).unwrap_or_else(|e| e.into_inner());
        }
        p
    }

    /// Waits once for the device copies of every export in `batch` (their read-back then
    /// finds them computed); the time counts as read-back. A failure is left to each
    /// export's own read, which reports it.
    fn wait_for_device(&self, batch: &[Submission]) {
        let arrays: Vec<&mlx::Array> = batch
            .iter()
            .filter_map(|s| match &s.job {
                Job::Export(e) => Some(e.device_arrays()),
                Job::Task(_) => None,
            })
            .flatten()
            .collect();
        if arrays.is_empty() {
            return;
        }
        let t = Instant::now();
        let _ = mlx::eval(&arrays);
        let mut p = self.lock();
        p.stats.read_us += micros(t.elapsed());
        p.stats.batches += 1;
    }

    /// Runs submission `s` and counts it finished, waking those waiting.
    fn complete(&self, store: &Store, s: Submission) {
        let Submission {
            job,
            bytes,
            id,
            keys,
        } = s;
        let export = matches!(job, Job::Export(_));
        let ran = job.run(store);
        let mut p = self.lock();
        p.finished += 1;
        p.bytes -= bytes;
        for k in keys {
            if p.keys.get(&k) == Some(&id) {
                p.keys.remove(&k);
            }
        }
        p.stats.exports += u64::from(export);
        p.stats.blocks += ran.inserted;
        p.stats.failed_blocks += ran.blocks - ran.inserted;
        if export {
            p.stats.bytes += bytes;
        }
        p.stats.read_us += ran.read_us;
        p.stats.insert_us += ran.insert_us;
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
    /// The blocks the job inserts.
    fn keys(&self) -> Vec<(NamespaceId, BlockKey)> {
        match self {
            Job::Export(export) => export.keys().collect(),
            Job::Task(_) => Vec::new(),
        }
    }

    fn run(self, store: &Store) -> Ran {
        match self {
            Job::Export(export) => finish(store, export),
            Job::Task(task) => {
                task(store);
                Ran::default()
            }
        }
    }
}

/// What a job did.
#[derive(Default)]
struct Ran {
    /// Blocks it held.
    blocks: u64,
    /// Blocks it inserted.
    inserted: u64,
    /// Microseconds reading back from the device.
    read_us: u64,
    /// Microseconds inserting.
    insert_us: u64,
}

/// A job on its way to the thread.
struct Submission {
    job: Job,
    /// Device bytes it holds until it is read back.
    bytes: u64,
    /// Its number (from 1, in submission order).
    id: u64,
    /// The blocks it inserts (indexed in [`Pending::keys`] while it is in flight).
    keys: Vec<(NamespaceId, BlockKey)>,
}

/// The export thread and its queue.
pub struct Exporter {
    tx: Option<Sender<Submission>>,
    store: Arc<Store>,
    shared: Arc<Shared>,
    worker: Option<JoinHandle<()>>,
    /// Device bytes in flight beyond which an export is skipped.
    max_pending: u64,
}

impl Exporter {
    /// Starts the thread; it inserts into `store`.
    pub fn start(store: Arc<Store>) -> std::io::Result<Self> {
        Self::start_bounded(store, MAX_PENDING_BYTES)
    }

    /// [`Self::start`] with `max_pending` bytes in flight at most instead of
    /// [`MAX_PENDING_BYTES`].
    fn start_bounded(store: Arc<Store>, max_pending: u64) -> std::io::Result<Self> {
        let (tx, rx) = channel::<Submission>();
        let shared = Arc::new(Shared {
            pending: Mutex::new(Pending::default()),
            changed: Condvar::new(),
        });
        let s = shared.clone();
        let thread_store = store.clone();
        let worker = std::thread::Builder::new()
            .name("kvstore-export".into())
            .spawn(move || {
                // This thread's transfer buffer, page-locked once now rather than at a
                // publication that needs more than it has (CUDA only; cache/src/scratch.rs).
                cache::prewarm_scratch(1);
                while let Ok(first) = rx.recv() {
                    // Everything submitted meanwhile is read back after one wait for the
                    // device: an export's copies are queued behind the engine's step, so
                    // waiting for each in turn costs a step each and falls behind a busy
                    // engine (docs/architecture.md, "The data path of a request").
                    let mut batch = vec![first];
                    while batch.len() < MAX_BATCH {
                        match rx.try_recv() {
                            Ok(more) => batch.push(more),
                            Err(_) => break,
                        }
                    }
                    s.wait_for_device(&batch);
                    for submission in batch {
                        s.complete(&thread_store, submission);
                    }
                }
            })?;
        Ok(Self {
            tx: Some(tx),
            store,
            shared,
            worker: Some(worker),
            max_pending,
        })
    }

    /// Hands `export` to the thread and returns `true`; or, when more than
    /// [`MAX_PENDING_BYTES`] of device copies would be in flight, drops it, counts it
    /// ([`ExportStats::skipped_exports`]) and returns `false`. Never waits.
    pub fn submit(&self, export: Export) -> bool {
        let bytes = export.device_bytes();
        {
            let mut p = self.shared.lock();
            if p.in_flight() && p.bytes + bytes > self.max_pending {
                p.stats.skipped_exports += 1;
                p.stats.skipped_blocks += export.blocks() as u64;
                return false;
            }
        }
        self.enqueue(Job::Export(export), bytes);
        true
    }

    /// Runs `task` on the thread after what was submitted before it (a store write that
    /// must not block the engine thread).
    pub fn run(&self, task: impl FnOnce(&Store) + Send + 'static) {
        self.enqueue(Job::Task(Box::new(task)), 0);
    }

    fn enqueue(&self, job: Job, bytes: u64) {
        let mut p = self.shared.lock();
        p.submitted += 1;
        p.bytes += bytes;
        let id = p.submitted;
        let keys = job.keys();
        for k in &keys {
            p.keys.insert(*k, id);
        }
        drop(p);
        let submission = Submission {
            job,
            bytes,
            id,
            keys,
        };
        let unsent = match &self.tx {
            Some(tx) => tx.send(submission).err().map(|e| e.0),
            None => None,
        };
        if let Some(submission) = unsent {
            // The thread is gone (it never exits before `Drop`): finish here, counted alike.
            tracing::error!("the export thread is gone; publishing on the caller's thread");
            self.shared.complete(&self.store, submission);
        }
    }

    /// Whether an export in flight holds any of `keys` in `namespace` (a lookup of them
    /// would wait for it: [`Self::wait_for`]). Never waits.
    pub fn holds_any(&self, namespace: NamespaceId, keys: &[BlockKey]) -> bool {
        let p = self.shared.lock();
        keys.iter().any(|k| p.keys.contains_key(&(namespace, *k)))
    }

    /// Waits until no export submitted before this call holds any of `keys` in
    /// `namespace` (each such export is in the store, or failed); returns at once when
    /// none does, whatever else is in flight.
    pub fn wait_for(&self, namespace: NamespaceId, keys: &[BlockKey]) {
        let mut p = self.shared.lock();
        let last = keys
            .iter()
            .filter_map(|k| p.keys.get(&(namespace, *k)).copied())
            .max();
        let Some(target) = last else {
            return;
        };
        p.stats.lookup_waits += 1;
        let t = Instant::now();
        let mut p = self.shared.wait_finished(p, target);
        p.stats.lookup_wait_us += micros(t.elapsed());
    }

    /// Waits until every export submitted before this call is in the store (or failed);
    /// exports submitted meanwhile are not waited for, so a busy engine cannot starve it.
    pub fn wait_idle(&self) {
        let p = self.shared.lock();
        let target = p.submitted;
        drop(self.shared.wait_finished(p, target));
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
fn finish(store: &Store, export: Export) -> Ran {
    let replaces = export.replaces();
    let mut ran = Ran {
        blocks: export.blocks() as u64,
        ..Ran::default()
    };
    let t = Instant::now();
    let read = export.into_blocks();
    ran.read_us = micros(t.elapsed());
    let blocks = match read {
        Ok(b) => b,
        Err(e) => {
            tracing::warn!(error = %e, "reading published blocks back from the device failed");
            return ran;
        }
    };
    let t = Instant::now();
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
        ran.inserted += 1;
    }
    ran.insert_us = micros(t.elapsed());
    ran
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    use cache::{plane_specs, BlockShape, Chain, KvFormat, PagedConfig, PagedKvCache};
    use store::{NamespaceDescription, StoreConfig};

    use super::*;

    const BLOCK: usize = 4;

    /// A RAM-only store with a namespace for one-layer, one-head f32 caches.
    fn store() -> (Arc<Store>, NamespaceId) {
        let store = Store::open(StoreConfig::default().ram_budget(16 << 20)).unwrap();
        let mut desc = NamespaceDescription::new("export-test", store::Dtype::F32, BLOCK as u32);
        desc.layers = vec!["global".into()];
        let shape = BlockShape {
            kv_heads: 1,
            block_size: BLOCK,
            head_dim: 8,
            dtype: mlx::Dtype::F32,
        };
        desc.planes = plane_specs(1, shape, KvFormat::Float).unwrap();
        let ns = store.register_namespace(&desc).unwrap();
        (Arc::new(store), ns)
    }

    /// The export of two full blocks of `tokens` and their keys.
    fn export(ns: NamespaceId, tokens: &[u32]) -> (Export, Vec<BlockKey>) {
        let config = PagedConfig {
            block_size: BLOCK,
            ..PagedConfig::default()
        };
        let mut cache = PagedKvCache::new(1, config).unwrap();
        let n = tokens.len() as i32;
        let data: Vec<f32> = (0..n * 8).map(|i| i as f32).collect();
        let kv = mlx::Array::from_slice(&data, &[1, 1, n, 8]).unwrap();
        cache.append(0, &kv, &kv).unwrap();
        let mut chain = Chain::new(ns, BLOCK);
        let export = cache.export(&mut chain, tokens).unwrap().unwrap();
        let keys = chain.keys().to_vec();
        (export, keys)
    }

    /// Holds the thread in a task it took alone (what is submitted next queues behind it)
    /// until the returned sender sends, or a minute passes.
    fn hold(exporter: &Exporter) -> std::sync::mpsc::Sender<()> {
        let (open, gate) = std::sync::mpsc::channel::<()>();
        let (started_tx, started) = std::sync::mpsc::channel::<()>();
        exporter.run(move |_| {
            let _ = started_tx.send(());
            let _ = gate.recv_timeout(Duration::from_secs(60));
        });
        started.recv().unwrap();
        open
    }

    /// Exports submitted while the thread is busy are taken together: one wait for the
    /// device covers all of them, and each is still inserted whole and in order.
    #[test]
    fn exports_queued_behind_a_busy_thread_share_one_wait_for_the_device() {
        let (store, ns) = store();
        let exporter = Exporter::start(store.clone()).unwrap();
        let open = hold(&exporter);
        let mut keys = Vec::new();
        for t in 0..3u32 {
            let (exp, k) = export(ns, &[t, 1, 2, 3, 4, 5, 6, t]);
            exporter.submit(exp);
            keys.push(k);
        }
        open.send(()).unwrap();
        exporter.wait_idle();
        let stats = exporter.stats();
        assert_eq!(
            (stats.exports, stats.blocks, stats.failed_blocks),
            (3, 6, 0)
        );
        assert_eq!(
            stats.batches, 1,
            "three queued exports, one wait: {stats:?}"
        );
        for k in &keys {
            assert_eq!(store.lookup(ns, k).tiers.len(), 2);
        }
    }

    /// With the thread behind, an export past the in-flight bound is skipped at once and
    /// counted, never waited for; once the thread catches up, exports are taken again.
    #[test]
    fn an_export_past_the_in_flight_bound_is_skipped_not_waited_for() {
        let (store, ns) = store();
        let (first, first_keys) = export(ns, &[1, 2, 3, 4, 5, 6, 7, 8]);
        // Room for one export in flight.
        let exporter = Exporter::start_bounded(store.clone(), first.device_bytes()).unwrap();
        let open = hold(&exporter);
        assert!(exporter.submit(first));
        let (second, second_keys) = export(ns, &[9, 2, 3, 4, 5, 6, 7, 8]);
        assert!(!exporter.submit(second), "taken past the bound");
        let stats = exporter.stats();
        assert_eq!((stats.skipped_exports, stats.skipped_blocks), (1, 2));
        open.send(()).unwrap();
        exporter.wait_idle();
        assert_eq!(store.lookup(ns, &first_keys).tiers.len(), 2);
        assert_eq!(
            store.lookup(ns, &second_keys).tiers.len(),
            0,
            "a skipped export"
        );
        let (third, third_keys) = export(ns, &[7, 2, 3, 4, 5, 6, 7, 8]);
        assert!(exporter.submit(third), "refused with nothing in flight");
        exporter.wait_idle();
        assert_eq!(store.lookup(ns, &third_keys).tiers.len(), 2);
        assert_eq!(exporter.stats().blocks, 4);
    }

    /// A lookup waits for the export that holds its blocks, and only for it: while the
    /// thread is held up, a lookup of other blocks returns at once, and one of the
    /// export's blocks returns once they are in the store.
    #[test]
    fn a_lookup_waits_only_for_the_exports_holding_its_blocks() {
        let (store, ns) = store();
        let exporter = Exporter::start(store.clone()).unwrap();
        // Hold the thread up until the gate opens (or a watchdog opens it: a failure).
        let (open, gate) = std::sync::mpsc::channel::<()>();
        exporter.run(move |_| {
            let _ = gate.recv();
        });
        let watchdog_opened = Arc::new(AtomicBool::new(false));
        let (w, o) = (watchdog_opened.clone(), open.clone());
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(60));
            w.store(true, Ordering::SeqCst);
            let _ = o.send(());
        });

        let (exp, keys) = export(ns, &[1, 2, 3, 4, 5, 6, 7, 8]);
        // Two blocks of 4 tokens, K and V, one head of 8 f32s a token.
        assert_eq!(exp.device_bytes(), 2 * 2 * 4 * 8 * 4);
        exporter.submit(exp);
        let (_, other) = export(ns, &[9, 9, 9, 9, 9, 9, 9, 9]);
        exporter.wait_for(ns, &other);
        assert!(
            !watchdog_opened.load(Ordering::SeqCst),
            "waited for an unrelated export"
        );
        assert_eq!(exporter.stats().lookup_waits, 0);
        assert_eq!(
            store.lookup(ns, &keys).tiers.len(),
            0,
            "inserted while held up"
        );

        let exporter = Arc::new(exporter);
        let (e, s, k) = (exporter.clone(), store.clone(), keys.clone());
        let done = Arc::new(AtomicBool::new(false));
        let d = done.clone();
        let waiter = std::thread::spawn(move || {
            e.wait_for(ns, &k[1..]);
            d.store(true, Ordering::SeqCst);
            s.lookup(ns, &k).tiers.len()
        });
        // Once the waiter counts its wait it is blocked: the thread cannot finish meanwhile.
        while exporter.stats().lookup_waits == 0 && !done.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(
            !done.load(Ordering::SeqCst),
            "returned before the export finished"
        );
        std::thread::sleep(Duration::from_millis(20));
        open.send(()).unwrap();
        assert_eq!(
            waiter.join().unwrap(),
            2,
            "the export's blocks after the wait"
        );
        assert!(!watchdog_opened.load(Ordering::SeqCst));
        let stats = exporter.stats();
        assert_eq!((stats.exports, stats.blocks, stats.lookup_waits), (1, 2, 1));
        assert_eq!(
            stats.bytes,
            2 * 2 * 4 * 8 * 4,
            "the finished export's device bytes"
        );
        assert!(
            stats.lookup_wait_us >= 20_000,
            "the lookup waited {} µs, at least the 20 ms the thread was held after it began",
            stats.lookup_wait_us
        );
        assert_eq!(stats.skipped_exports, 0);
    }
}
