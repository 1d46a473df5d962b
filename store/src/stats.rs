//! Counters shared by the tiers, and the [`StoreStats`] snapshot.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

/// Live counters (relaxed atomics; a snapshot is not a consistent cut).
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub ram_hits: AtomicU64,
    pub ram_misses: AtomicU64,
    pub ssd_hits: AtomicU64,
    pub ssd_misses: AtomicU64,
    pub ram_evictions: AtomicU64,
    pub ssd_evictions: AtomicU64,
    pub spills: AtomicU64,
    pub promotions: AtomicU64,
    pub bytes_written: AtomicU64,
    pub blocks_written: AtomicU64,
    pub write_errors: AtomicU64,
    pub verify_failures: AtomicU64,
    pub quarantined: AtomicU64,
    pub skipped_queue_full: AtomicU64,
    pub group_commits: AtomicU64,
    pub write_busy_us: AtomicU64,
    pub write_sync_us: AtomicU64,
    pub ssd_read_us: AtomicU64,
    pub load_plan_us: AtomicU64,
    pub load_start_us: AtomicU64,
    pub load_wait_us: AtomicU64,
    pub load_promote_us: AtomicU64,
    pub load_join_us: AtomicU64,
    pub load_touch_us: AtomicU64,
    pub load_us: AtomicU64,
    pub orphans_swept: AtomicU64,
    pub remote_hits: AtomicU64,
    pub remote_misses: AtomicU64,
    pub remote_bytes_read: AtomicU64,
    pub remote_bytes_written: AtomicU64,
    pub remote_blocks_written: AtomicU64,
    pub remote_errors: AtomicU64,
    pub remote_verify_failures: AtomicU64,
    pub remote_skipped: AtomicU64,
    pub remote_queue_full: AtomicU64,
    pub remote_publish_errors: AtomicU64,
    pub remote_fetch_us: AtomicU64,
    pub remote_fetches: AtomicU64,
}

impl Counters {
    pub fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }

    pub fn inc(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }

    pub fn get(c: &AtomicU64) -> u64 {
        c.load(Ordering::Relaxed)
    }
}

/// Microseconds of `load_prefix` calls by phase, summed over loads, on the loading thread's
/// clock. The phases run one after the other, so they sum to at most `loads_us`; the rest
/// is the walk's checks of each block (namespace, key, tokens, layout) and the calls'
/// bookkeeping.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadPhases {
    /// Planning the SSD reads: the index lookups of every key (RAM, pending writes, SSD).
    pub plan_us: u64,
    /// Handing the reads to the store's reader threads (before session 55: starting a load's
    /// own threads, 95-132 ms on the GPU machine).
    pub start_us: u64,
    /// Waiting for SSD blocks: for a reader's result, or a read on the loading thread (the
    /// remote tier's round trips are `remote_fetch_us`).
    pub wait_us: u64,
    /// Promoting SSD and remote hits into RAM (and queueing what that evicts).
    pub promote_us: u64,
    /// Ending the read-ahead after the walk (telling the readers to take no further file of
    /// the load; before session 55, joining the load's own reader threads).
    pub join_us: u64,
    /// Marking the loaded chain as used ([`Store::touch_chain`](crate::Store::touch_chain)).
    pub touch_us: u64,
    /// The loads' whole wall time.
    pub loads_us: u64,
}

/// A snapshot of the store's sizes and counters.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoreStats {
    /// Blocks in the RAM tier.
    pub ram_blocks: u64,
    /// Bytes in the RAM tier (sum of `Block::data_len`).
    pub ram_bytes: u64,
    /// RAM budget in bytes.
    pub ram_budget: u64,
    /// Blocks in the SSD tier.
    pub ssd_blocks: u64,
    /// Physical bytes of the SSD tier's block files.
    pub ssd_bytes: u64,
    /// SSD budget in bytes (physical).
    pub ssd_budget: u64,
    /// Blocks served from RAM by `load_prefix`.
    pub ram_hits: u64,
    /// Blocks `load_prefix` did not find in RAM.
    pub ram_misses: u64,
    /// Blocks read and verified from SSD.
    pub ssd_hits: u64,
    /// Blocks found neither in RAM nor on SSD (including corrupt files).
    pub ssd_misses: u64,
    /// Blocks evicted from RAM.
    pub ram_evictions: u64,
    /// Block files deleted by the SSD budget, and blocks not written because, older than
    /// everything they would displace, they would have been the first to go
    /// ([`WriteOutcome::NotAdmitted`](crate::WriteOutcome::NotAdmitted)).
    pub ssd_evictions: u64,
    /// New blocks the RAM tier's eviction policy did not admit (freq-admit), handed to the
    /// SSD tier as evicted blocks are.
    pub ram_not_admitted: u64,
    /// RAM evictions queued for writing to SSD.
    pub spills: u64,
    /// SSD hits promoted into RAM.
    pub promotions: u64,
    /// Bytes written to block files.
    pub bytes_written: u64,
    /// Block files written.
    pub blocks_written: u64,
    /// Block writes that failed (I/O, budget).
    pub write_errors: u64,
    /// Reads whose verification failed (checksum, header, truncation).
    pub verify_failures: u64,
    /// Files moved to quarantine.
    pub quarantined: u64,
    /// Blocks not written because the write queue was full.
    pub skipped_queue_full: u64,
    /// Group commits of the write-behind worker that wrote blocks (one disk flush each).
    pub group_commits: u64,
    /// Microseconds the write-behind worker spent writing its groups (busy against the
    /// wall clock: near 100 % the disk path is the bound, and spills queue up).
    pub write_busy_us: u64,
    /// Of that time, microseconds spent in the group commits' fsyncs (block files and
    /// their directories): the disk's flushes against encoding, writing and indexing.
    pub write_sync_us: u64,
    /// Microseconds spent opening, reading and verifying the block files that were SSD hits,
    /// summed over the reading threads (÷ `ssd_hits`: a file's mean read): against a load's
    /// wall time, what of it the disk and the checksums took.
    #[serde(default)]
    pub ssd_read_us: u64,
    /// Where `load_prefix`'s wall time went, summed over loads ([`LoadPhases`]): against
    /// `ssd_read_us`, what a load spent outside its file reads.
    #[serde(default)]
    pub load_phases: LoadPhases,
    /// Orphaned temporary files removed at open.
    pub orphans_swept: u64,
    /// Whether a remote tier is configured.
    pub remote_enabled: bool,
    /// Blocks fetched from the remote tier and verified.
    pub remote_hits: u64,
    /// Blocks `load_prefix` asked the remote tier for and did not get (absent, unreachable
    /// or invalid).
    pub remote_misses: u64,
    /// Bytes of verified values fetched from the remote tier.
    pub remote_bytes_read: u64,
    /// Bytes published to the remote tier.
    pub remote_bytes_written: u64,
    /// Blocks published to the remote tier.
    pub remote_blocks_written: u64,
    /// Failed Redis operations (connection refused, timeouts, errors).
    pub remote_errors: u64,
    /// Fetched values that failed verification (corrupt or foreign) and were not served.
    pub remote_verify_failures: u64,
    /// Publications skipped: the queue was full or Redis was unreachable.
    pub remote_skipped: u64,
    /// Of those, skipped because the publication queue was full.
    pub remote_queue_full: u64,
    /// Of those, failed or skipped in the publisher (Redis unreachable, in backoff, or the
    /// block not encodable).
    pub remote_publish_errors: u64,
    /// Pipelined `GET` round trips (chain fetches) sent to the remote tier.
    pub remote_fetches: u64,
    /// Microseconds spent in those round trips (÷ `remote_fetches` = mean fetch latency).
    pub remote_fetch_us: u64,
}

impl StoreStats {
    pub(crate) fn from_counters(c: &Counters) -> StoreStats {
        let g = Counters::get;
        StoreStats {
            ram_hits: g(&c.ram_hits),
            ram_misses: g(&c.ram_misses),
            ssd_hits: g(&c.ssd_hits),
            ssd_misses: g(&c.ssd_misses),
            ram_evictions: g(&c.ram_evictions),
            ssd_evictions: g(&c.ssd_evictions),
            spills: g(&c.spills),
            promotions: g(&c.promotions),
            bytes_written: g(&c.bytes_written),
            blocks_written: g(&c.blocks_written),
            write_errors: g(&c.write_errors),
            verify_failures: g(&c.verify_failures),
            quarantined: g(&c.quarantined),
            skipped_queue_full: g(&c.skipped_queue_full),
            group_commits: g(&c.group_commits),
            write_busy_us: g(&c.write_busy_us),
            write_sync_us: g(&c.write_sync_us),
            ssd_read_us: g(&c.ssd_read_us),
            load_phases: LoadPhases {
                plan_us: g(&c.load_plan_us),
                start_us: g(&c.load_start_us),
                wait_us: g(&c.load_wait_us),
                promote_us: g(&c.load_promote_us),
                join_us: g(&c.load_join_us),
                touch_us: g(&c.load_touch_us),
                loads_us: g(&c.load_us),
            },
            orphans_swept: g(&c.orphans_swept),
            remote_hits: g(&c.remote_hits),
            remote_misses: g(&c.remote_misses),
            remote_bytes_read: g(&c.remote_bytes_read),
            remote_bytes_written: g(&c.remote_bytes_written),
            remote_blocks_written: g(&c.remote_blocks_written),
            remote_errors: g(&c.remote_errors),
            remote_verify_failures: g(&c.remote_verify_failures),
            remote_skipped: g(&c.remote_skipped),
            remote_queue_full: g(&c.remote_queue_full),
            remote_publish_errors: g(&c.remote_publish_errors),
            remote_fetches: g(&c.remote_fetches),
            remote_fetch_us: g(&c.remote_fetch_us),
            ..StoreStats::default()
        }
    }
}
