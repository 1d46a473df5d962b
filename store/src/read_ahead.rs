//! Parallel SSD reads for prefix loads: the store's reader threads read and verify the block
//! files a load will need, in chain order, while the loading thread checks and promotes the
//! blocks that have arrived.
//!
//! Why: a block file is a few hundred KB to a few MB, so one thread reading them one after
//! another leaves the disk at queue depth 1 and hashes on one core; a 32K-token prefix is
//! about a thousand files. Readers keep several reads in flight and spread the checksums
//! over cores. Verification stays per block and complete ([`SsdTier::read`]); the loading
//! thread still checks chain, tokens and layout in order and stops at the first failure,
//! after which the readers stop taking new files.
//!
//! Why the threads live as long as the store ([`SsdReaders`]): until session 55 each load
//! started its own scoped threads, and on the GPU machine starting two of them took 95-132
//! ms (`StoreStats::load_phases.start_us`, the 13-turn session's SSD probe: 132 of a 139 ms
//! load of two blocks whose reads took ~3 ms), where the CPU VM takes microseconds. A load
//! now only queues its reads.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crate::fs::FileSystem;
use crate::key::{BlockKey, NamespaceId};
use crate::ssd::{ReadOutcome, SsdTier};

/// Default reader threads of a store: enough to keep an NVMe drive busy and the checksums
/// on several cores.
pub(crate) const SSD_READERS: usize = 8;

/// The SSD reads of one load, shared by the readers that work on it.
struct ReadJob<F: FileSystem> {
    ssd: Arc<SsdTier<F>>,
    ns: NamespaceId,
    /// (index into the load's keys, key), ascending by index.
    reads: Vec<(usize, BlockKey)>,
    /// Next position in `reads` a reader takes.
    next: AtomicUsize,
    /// Set when the load is over: readers take no further file.
    stop: Arc<AtomicBool>,
    /// Where each read's outcome goes. The job is the only owner of the sender, so once
    /// every reader has let go of the job the loading thread's receiver reports it.
    tx: Sender<(usize, ReadOutcome)>,
}

impl<F: FileSystem> ReadJob<F> {
    /// Reads the job's next file; whether the job may have more to read.
    fn read_one(&self) -> bool {
        if self.stop.load(Ordering::Relaxed) {
            return false;
        }
        let Some(&(index, key)) = self.reads.get(self.next.fetch_add(1, Ordering::Relaxed)) else {
            return false;
        };
        let outcome = self.ssd.read(self.ns, key, false);
        self.tx.send((index, outcome)).is_ok()
            && self.next.load(Ordering::Relaxed) < self.reads.len()
    }
}

/// What the reader threads take from their queue.
enum ReaderMessage<F: FileSystem> {
    /// A file of this load to read; the reader queues the job again while it has more.
    Read(Arc<ReadJob<F>>),
    /// The store is closing: the thread ends.
    Quit,
}

/// The store's SSD reader threads, started when the store opens and shared by every load:
/// a load queues its job once for each reader it may use (as many as it has files, up to
/// all), and a reader that takes it reads one file and queues it again behind the other
/// loads' jobs while it has more. So loads at once share the readers file by file: a short
/// load is not held behind a long one's thousand files.
pub(crate) struct SsdReaders<F: FileSystem> {
    tx: Option<Sender<ReaderMessage<F>>>,
    threads: Vec<JoinHandle<()>>,
}

impl<F: FileSystem> SsdReaders<F> {
    /// `count` reader threads; none for fewer than two (loads then read on their own thread).
    pub(crate) fn start(count: usize) -> std::io::Result<Self> {
        let mut readers = SsdReaders {
            tx: None,
            threads: Vec::new(),
        };
        if count < 2 {
            return Ok(readers);
        }
        let (tx, rx) = channel::<ReaderMessage<F>>();
        let rx = Arc::new(Mutex::new(rx));
        readers.tx = Some(tx.clone());
        for i in 0..count {
            let rx = rx.clone();
            let again = tx.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("kvstore-ssd-read-{i}"))
                .spawn(move || loop {
                    // The lock is held only while waiting for a message, not while reading.
                    let message = rx.lock().unwrap_or_else(|e| e.into_inner()).recv();
                    let Ok(ReaderMessage::Read(job)) = message else {
                        return;
                    };
                    if job.read_one() && again.send(ReaderMessage::Read(job)).is_err() {
                        return;
                    }
                });
            match spawned {
                Ok(thread) => readers.threads.push(thread),
                Err(e) => {
                    readers.shutdown();
                    return Err(e);
                }
            }
        }
        Ok(readers)
    }

    /// Starts the reads of `keys[i]` for each `i` in `indices` (ascending) on up to every
    /// reader. With fewer than two reads, no readers, or no SSD tier nothing is read ahead
    /// and [`ReadAhead::take`] leaves each read to the caller.
    pub(crate) fn start_load(
        &self,
        ssd: Option<&Arc<SsdTier<F>>>,
        ns: NamespaceId,
        keys: &[BlockKey],
        indices: &[usize],
    ) -> ReadAhead {
        let stop = Arc::new(AtomicBool::new(false));
        let idle = ReadAhead {
            rx: None,
            arrived: HashMap::new(),
            planned: HashSet::new(),
            stop: stop.clone(),
        };
        let (Some(ssd), Some(pool)) = (ssd, &self.tx) else {
            return idle;
        };
        if indices.len() < 2 {
            return idle;
        }
        let (tx, rx) = channel();
        let job = Arc::new(ReadJob {
            ssd: ssd.clone(),
            ns,
            reads: indices.iter().map(|&i| (i, keys[i])).collect(),
            next: AtomicUsize::new(0),
            stop,
            tx,
        });
        for _ in 0..self.threads.len().min(indices.len()) {
            if pool.send(ReaderMessage::Read(job.clone())).is_err() {
                break;
            }
        }
        // Only the readers hold the job now: when the last lets go, `take` sees the end.
        drop(job);
        let mut ahead = idle;
        ahead.rx = Some(rx);
        ahead.planned = indices.iter().copied().collect();
        ahead
    }

    /// Ends the threads (each finishes the file in hand). Called when the store closes, so
    /// no load is waiting: jobs still queued are dropped with the queue.
    pub(crate) fn shutdown(&mut self) {
        if let Some(tx) = self.tx.take() {
            for _ in 0..self.threads.len() {
                let _ = tx.send(ReaderMessage::Quit);
            }
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl<F: FileSystem> Drop for SsdReaders<F> {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Reads of one load's planned keys, started in chain order, arriving out of order.
pub(crate) struct ReadAhead {
    rx: Option<Receiver<(usize, ReadOutcome)>>,
    arrived: HashMap<usize, ReadOutcome>,
    planned: HashSet<usize>,
    stop: Arc<AtomicBool>,
}

impl ReadAhead {
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
                // Every reader done with the job without it: read it on the caller's thread.
                Err(_) => return None,
            }
        }
    }
}

impl Drop for ReadAhead {
    /// Readers finish the file in hand and take no other.
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}
