//! Restores assembled ahead: a checked run of store blocks laid out on the host in each
//! layer part's final form by a thread other than the one that owns the cache (an engine's
//! I/O worker, while the request waits for admission), so that the owner only moves the
//! bytes to the device and installs them.
//!
//! [`PagedKvCache::stage_restore`](crate::PagedKvCache::stage_restore) makes a
//! [`StagedRestore`] and calls no MLX operation (host memory only: on the CPU from MLX's
//! allocator, which the arrays then take over without a copy; on CUDA page-locked, from a
//! bounded pool of reused buffers). [`PagedKvCache::restore_staged`](crate::PagedKvCache::restore_staged)
//! installs it where the cache is still in the state it was staged against, and otherwise
//! restores the blocks the ordinary way.

use std::ops::Range;
use std::sync::Mutex;

use mlx::host_upload::GatherRow;
use mlx::{Array, HostBuffer, PinnedBuffer, RowsWrite};
use rayon::prelude::*;
use store::Block;

use crate::block_memory::PinnedChunk;
use crate::host::RunPart;
use crate::CacheError;

/// Page-locked staging memory a process holds at most: what [`prewarm_staging`] page-locks.
/// Page-locking (`cuMemHostAlloc`) and unlocking (`cuMemFreeHost`, which waits for the
/// whole device) are driver calls that stalled the engine thread's launches for up to a
/// second under the trace's bursts of host-tier hits (docs/benchmarks.md, session 42): an
/// engine page-locks the pool's buffers before its first request and reuses them for the
/// life of the process, never freeing one; a run that finds none free is staged in
/// ordinary memory. (Without an engine's warm-up, buffers are page-locked as runs need
/// them, up to the same total.)
const PINNED_POOL_BYTES: usize = prewarm_bytes();

/// A run larger than this is not staged ([`stages_rows`]).
const MAX_PINNED_RUN: usize = 256 << 20;

/// A page-locked buffer is allocated with at least this many bytes, in powers of two, so
/// the pool's buffers fit the next runs of similar sizes.
const FIRST_PINNED_BYTES: usize = 16 << 20;

/// The sizes [`prewarm_staging`] page-locks: a burst's worth of small runs and a few large
/// ones.
const PREWARM_SIZES_MIB: [usize; 9] = [16, 16, 32, 32, 64, 64, 128, 128, 256];

/// The bytes of [`PREWARM_SIZES_MIB`] (736 MiB).
const fn prewarm_bytes() -> usize {
    let mut total = 0;
    let mut i = 0;
    while i < PREWARM_SIZES_MIB.len() {
        total += PREWARM_SIZES_MIB[i] << 20;
        i += 1;
    }
    total
}

/// Buffers of type `B` handed out best fit and taken back, allocated only while the pool
/// holds less than its cap and never freed: the policy of the page-locked staging pool,
/// generic so that it is tested with ordinary memory.
#[derive(Debug)]
struct BufferPool<B> {
    free: Vec<B>,
    allocated: usize,
    cap: usize,
}

impl<B: std::ops::Deref<Target = [u8]>> BufferPool<B> {
    const fn new(cap: usize) -> Self {
        Self {
            free: Vec::new(),
            allocated: 0,
            cap,
        }
    }

    /// The smallest free buffer of at least `len` bytes, else a new one of the size
    /// [`rounded`] gives from `alloc` while the pool stays within its cap, else `None`.
    fn take(&mut self, len: usize, alloc: impl FnOnce(usize) -> Option<B>) -> Option<B> {
        let best = self
            .free
            .iter()
            .enumerate()
            .filter(|(_, b)| b.len() >= len)
            .min_by_key(|(_, b)| b.len())
            .map(|(i, _)| i);
        if let Some(i) = best {
            return Some(self.free.swap_remove(i));
        }
        let size = rounded(len);
        if len > MAX_PINNED_RUN || self.allocated + size > self.cap {
            return None;
        }
        let b = alloc(size)?;
        self.allocated += b.len();
        Some(b)
    }

    /// Takes `b` back for the next run.
    fn give(&mut self, b: B) {
        self.free.push(b);
    }
}

/// Whether a run of `total` bytes of rows is staged (in the pool's page-locked memory, or in
/// ordinary memory when none is free): not past the largest pooled buffer. Under the trace
/// on the H100 an 803 MB run staged in ordinary memory took the I/O worker 0.28 s and the
/// engine thread's upload from it 0.18 s (4.5 GB/s; docs/benchmarks.md, session 42), where
/// the engine's own pipelined restore moves 1.5 GB at ~20 GB/s (session 19).
fn stages_rows(total: usize) -> bool {
    total <= MAX_PINNED_RUN
}

/// The size a new pooled buffer for a run of `len` bytes gets.
fn rounded(len: usize) -> usize {
    len.max(FIRST_PINNED_BYTES).next_power_of_two()
}

/// The page-locked buffers of every staging, free or not.
static PINNED: Mutex<BufferPool<PinnedBuffer>> = Mutex::new(BufferPool::new(PINNED_POOL_BYTES));

/// Page-locks the staging pool's first buffers now, before any request needs them (an
/// engine calls it as it starts); returns the bytes page-locked. Nothing where transfers do
/// not go through the driver (the CPU).
pub fn prewarm_staging() -> usize {
    let Ok(mut pool) = PINNED.lock() else {
        return 0;
    };
    let before = pool.allocated;
    let mut made = Vec::new();
    for mib in PREWARM_SIZES_MIB {
        match pool.take(mib << 20, PinnedBuffer::new) {
            Some(b) => made.push(b),
            None => break,
        }
    }
    for b in made {
        pool.give(b);
    }
    pool.allocated - before
}

/// One run's host bytes, laid out for the device.
enum Bytes {
    /// Per part, the whole array (zeros after the blocks included), in memory its array
    /// takes over on the CPU (uploaded on a GPU without direct transfers).
    Whole(Vec<HostBuffer>),
    /// Every part's blocks alone (no zeros), one range each of one buffer: written by the
    /// driver into arrays of zeros made on the device (CUDA).
    Rows {
        buffer: Staging,
        ranges: Vec<Range<usize>>,
    },
    /// Every block in page-locked block memory (cache/src/block_memory.rs): per part, a
    /// range of one table of rows ([`GatherRow`]) that a node reads where they lie (CUDA).
    Gather(Option<Gathered>),
}

/// What a gather's nodes read: the table (in page-locked block memory) and the blocks whose
/// planes its rows point into, held until the device has read them.
struct Gathered {
    table: PinnedChunk,
    rows: usize,
    ranges: Vec<Range<usize>>,
    _blocks: Vec<Block>,
}

impl Gathered {
    /// The table's rows.
    fn table(&self) -> &[GatherRow] {
        let bytes = &self.table.as_ref()[..self.rows * std::mem::size_of::<GatherRow>()];
        // SAFETY: the table was written as `rows` `GatherRow`s (plain `repr(C)` pairs of
        // u64) at the start of a chunk aligned to 256 bytes, which outlives the borrow.
        unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<GatherRow>(), self.rows) }
    }

    /// One gather node per part, each lent the table and the blocks until it has read them.
    fn upload(self, parts: &[Part]) -> Result<Vec<Array>, CacheError> {
        let owner = std::sync::Arc::new(self);
        let table = owner.table();
        parts
            .iter()
            .zip(&owner.ranges)
            .map(|(p, r)| {
                // SAFETY: the owner holds the table and the blocks whose planes its rows
                // point into (all in block memory, never freed), unchanged, until the node
                // gives it back.
                let a = unsafe {
                    mlx::host_upload::gather_rows(
                        &p.shape,
                        p.dtype,
                        owner.clone(),
                        &table[r.clone()],
                        p.block_rows,
                    )
                };
                Ok(a?)
            })
            .collect()
    }

    /// The table for `parts` of `blocks`, if every plane it reads lies in page-locked block
    /// memory and the block memory has room for the table; `None` otherwise (the run is
    /// staged the ordinary way).
    fn new<B: AsRef<Block>>(
        blocks: &[B],
        run_parts: &[RunPart<'_>],
    ) -> Result<Option<Self>, CacheError> {
        if !crate::block_memory::allowed() {
            return Ok(None);
        }
        // Every plane read, checked in one pass.
        let mut planes: Vec<&[u8]> = Vec::new();
        for p in run_parts {
            let (heads, _, _, block_rows) = p.layout()?;
            for (b, plane) in p.planes.iter().enumerate() {
                let Some(i) = plane else { continue };
                // The run was checked against these blocks; anything else is not gathered.
                let Some(found) = blocks.get(b).and_then(|x| x.as_ref().planes.get(*i)) else {
                    return Ok(None);
                };
                if found.data.len() < heads * block_rows {
                    return Ok(None);
                }
                planes.push(&found.data);
            }
        }
        if !crate::block_memory::all_in_block_memory(&planes) {
            return Ok(None);
        }
        let mut table: Vec<GatherRow> = Vec::new();
        let mut ranges = Vec::with_capacity(run_parts.len());
        for p in run_parts {
            let (heads, _, _, block_rows) = p.layout()?;
            let pitch = p.capacity() * block_rows;
            let first = table.len();
            for h in 0..heads {
                for (b, plane) in p.planes.iter().enumerate() {
                    let Some(i) = plane else { continue };
                    let data = &blocks[b].as_ref().planes[*i].data;
                    table.push(GatherRow {
                        src: data[h * block_rows..].as_ptr() as u64,
                        at: (h * pitch + b * block_rows) as u64,
                    });
                }
            }
            ranges.push(first..table.len());
        }
        let Some(mut chunk) = PinnedChunk::take_table(std::mem::size_of_val(table.as_slice()))
        else {
            return Ok(None);
        };
        for (dst, row) in chunk.as_mut().chunks_exact_mut(16).zip(&table) {
            dst[..8].copy_from_slice(&row.src.to_ne_bytes());
            dst[8..].copy_from_slice(&row.at.to_ne_bytes());
        }
        Ok(Some(Self {
            table: chunk,
            rows: table.len(),
            ranges,
            _blocks: blocks.iter().map(|b| b.as_ref().clone()).collect(),
        }))
    }
}

/// Host memory for [`Bytes::Rows`]: page-locked from the pool where the driver allows it.
enum Staging {
    Pinned(Option<PinnedBuffer>),
    Heap(Vec<u8>),
}

impl Staging {
    /// At least `len` bytes: a pooled page-locked buffer (a new one while the pool has
    /// room), or ordinary memory.
    fn take(len: usize) -> Self {
        let pinned = PINNED
            .lock()
            .ok()
            .and_then(|mut pool| pool.take(len, PinnedBuffer::new));
        match pinned {
            Some(b) => Staging::Pinned(Some(b)),
            None => Staging::Heap(vec![0u8; len]),
        }
    }

    fn bytes(&self) -> &[u8] {
        match self {
            Staging::Pinned(b) => b.as_deref().unwrap_or(&[]),
            Staging::Heap(v) => v,
        }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            Staging::Pinned(b) => b.as_deref_mut().unwrap_or(&mut []),
            Staging::Heap(v) => v,
        }
    }
}

impl std::ops::Deref for Staging {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.bytes()
    }
}

impl Drop for Staging {
    /// A page-locked buffer goes back to the pool (never freed: see [`PINNED_POOL_BYTES`]).
    fn drop(&mut self) {
        let Staging::Pinned(b) = self else {
            return;
        };
        if let (Some(b), Ok(mut pool)) = (b.take(), PINNED.lock()) {
            pool.give(b);
        }
    }
}

/// A layer part's array, as staged.
struct Part {
    shape: [i32; 4],
    dtype: mlx::Dtype,
    /// Rows of the blocks alone (for [`Bytes::Rows`]): width, height and pitch in bytes.
    rows: (usize, usize, usize),
    /// Bytes of one head's rows of one block (a row of [`Bytes::Gather`]).
    block_rows: usize,
}

/// The host half of a restore, done ahead ([`crate::PagedKvCache::stage_restore`]): the
/// outcome of checking the blocks and every layer part assembled, waiting to be installed
/// by [`crate::PagedKvCache::restore_staged`]. It owns host memory only, so it may be
/// made on one thread and installed on another.
pub struct StagedRestore {
    /// The cache's state it was checked and laid out against.
    pub(crate) base: crate::paged::RunBase,
    /// The blocks' check: how many are restored, and why the rest is not.
    pub(crate) plan: crate::paged::RunPlan,
    parts: Vec<Part>,
    bytes: Bytes,
    /// Seconds the staging took (checks and assembly).
    seconds: f64,
}

impl std::fmt::Debug for StagedRestore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StagedRestore")
            .field("blocks", &self.plan.valid)
            .field("parts", &self.parts.len())
            .field("seconds", &self.seconds)
            .finish()
    }
}

impl StagedRestore {
    /// Blocks it restores (the longest valid prefix of those staged).
    pub fn blocks(&self) -> usize {
        self.plan.valid
    }

    /// Seconds the staging took on its thread (checking the blocks and assembling them).
    pub fn seconds(&self) -> f64 {
        self.seconds
    }

    /// Whether the install reads the blocks where they lie (every plane in page-locked
    /// block memory: one gather node per layer part) rather than from an assembled copy.
    pub fn reads_in_place(&self) -> bool {
        matches!(self.bytes, Bytes::Gather(Some(_)))
    }

    /// Assembles every part of `parts` from `blocks`: whole arrays on the CPU (and on a GPU
    /// without direct transfers), the blocks' rows alone where the driver writes them
    /// into zeros on the device. Host memory only; large parts use the thread pool.
    /// `None` for rows past the largest page-locked buffer ([`stages_rows`]): the owner
    /// restores those the ordinary way, through its pipeline of two reused page-locked
    /// buffers, faster than one upload from ordinary memory.
    pub(crate) fn assemble<B: AsRef<Block> + Sync>(
        base: crate::paged::RunBase,
        plan: crate::paged::RunPlan,
        blocks: &[B],
        run_parts: &[RunPart<'_>],
        seconds_before: f64,
    ) -> Result<Option<Self>, CacheError> {
        let t = std::time::Instant::now();
        let mut parts = Vec::with_capacity(run_parts.len());
        let mut sizes = Vec::with_capacity(run_parts.len());
        for p in run_parts {
            let (heads, _, _, block_rows) = p.layout()?;
            parts.push(Part {
                shape: p.shape()?,
                dtype: crate::host::to_mlx_dtype(p.spec.dtype),
                rows: (
                    p.planes.len() * block_rows,
                    heads,
                    p.capacity() * block_rows,
                ),
                block_rows,
            });
            sizes.push(p.bytes(p.planes.len())?);
        }
        let rows = mlx::default_device()? != mlx::Device::Cpu && mlx::direct_transfers();
        if (rows && mlx::host_upload::upload_rows_on()) || crate::block_memory::stands_in() {
            if let Some(g) = Gathered::new(blocks, run_parts)? {
                return Ok(Some(Self {
                    base,
                    plan,
                    parts,
                    bytes: Bytes::Gather(Some(g)),
                    seconds: seconds_before + t.elapsed().as_secs_f64(),
                }));
            }
        }
        let total: usize = sizes.iter().sum();
        if rows && !stages_rows(total) {
            return Ok(None);
        }
        let bytes = if rows {
            let mut buffer = Staging::take(total);
            let mut ranges = Vec::with_capacity(sizes.len());
            let mut hosts = Vec::with_capacity(sizes.len());
            let mut rest = &mut buffer.bytes_mut()[..total];
            let mut at = 0;
            for &len in &sizes {
                let (part, after) = rest.split_at_mut(len);
                hosts.push(part);
                ranges.push(at..at + len);
                at += len;
                rest = after;
            }
            crate::transfer_pool::run(|| {
                hosts
                    .par_iter_mut()
                    .zip(run_parts)
                    .try_for_each(|(host, p)| p.assemble(blocks, host, p.planes.len()))
            })?;
            Bytes::Rows { buffer, ranges }
        } else {
            let whole = run_parts
                .par_iter()
                .map(|p| {
                    let mut buf = HostBuffer::new(p.bytes(p.capacity())?)?;
                    p.assemble(blocks, &mut buf, p.capacity())?;
                    Ok(buf)
                })
                .collect::<Result<Vec<_>, CacheError>>()?;
            Bytes::Whole(whole)
        };
        Ok(Some(Self {
            base,
            plan,
            parts,
            bytes,
            seconds: seconds_before + t.elapsed().as_secs_f64(),
        }))
    }

    /// Moves every part to the device: on the CPU the arrays take the buffers over. On CUDA,
    /// from page-locked staging, each part is a node that reads its rows when the graph
    /// that uses it runs ([`mlx::host_upload::upload_rows`]): nothing is waited for here,
    /// and the buffer goes back to the pool once the device has read it. Blocks in block
    /// memory are read where they lie, one gather node per part, in the same way. From ordinary
    /// memory, one driver copy per part into zeros made on the device, all waited for
    /// once. `None` where the driver found no buffer to write into (the caller restores
    /// the ordinary way).
    pub(crate) fn upload(&mut self) -> Result<Option<Vec<Array>>, CacheError> {
        if let Bytes::Rows { buffer, ranges } = &mut self.bytes {
            if matches!(buffer, Staging::Pinned(_)) && mlx::host_upload::upload_rows_on() {
                let owner =
                    std::sync::Arc::new(std::mem::replace(buffer, Staging::Heap(Vec::new())));
                let arrays = self
                    .parts
                    .iter()
                    .zip(ranges.iter())
                    .map(|(p, r)| {
                        let (width, height, pitch) = p.rows;
                        Ok(mlx::host_upload::upload_rows(
                            &p.shape,
                            p.dtype,
                            owner.clone(),
                            r.clone(),
                            width,
                            height,
                            pitch,
                        )?)
                    })
                    .collect::<Result<Vec<_>, CacheError>>()?;
                return Ok(Some(arrays));
            }
        }
        match &mut self.bytes {
            Bytes::Gather(g) => g.take().map(|g| g.upload(&self.parts)).transpose(),
            Bytes::Whole(bufs) => {
                let bufs = std::mem::take(bufs);
                let arrays = bufs
                    .into_iter()
                    .zip(&self.parts)
                    .map(|(b, p)| Ok(b.into_array(&p.shape, p.dtype)?))
                    .collect::<Result<Vec<_>, CacheError>>()?;
                Ok(Some(arrays))
            }
            Bytes::Rows { buffer, ranges } => {
                let shapes: Vec<(&[i32], mlx::Dtype)> = self
                    .parts
                    .iter()
                    .map(|p| (p.shape.as_slice(), p.dtype))
                    .collect();
                let dsts = mlx::zeroed_on_device(&shapes)?;
                let host = buffer.bytes();
                let writes: Vec<RowsWrite<'_>> = dsts
                    .iter()
                    .zip(&self.parts)
                    .zip(ranges.iter())
                    .map(|((dst, p), r)| RowsWrite {
                        dst,
                        src: &host[r.clone()],
                        width: p.rows.0,
                        height: p.rows.1,
                        pitch: p.rows.2,
                    })
                    .collect();
                Ok(mlx::write_rows_direct(&writes)?.then_some(dsts))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    /// An allocator of ordinary buffers that counts its calls.
    fn counting(calls: &mut usize) -> impl FnMut(usize) -> Option<Vec<u8>> + '_ {
        move |n| {
            *calls += 1;
            Some(vec![0u8; n])
        }
    }

    #[test]
    fn the_pool_reuses_best_fit_allocates_only_within_its_cap_and_never_frees() {
        let mut pool: BufferPool<Vec<u8>> = BufferPool::new(64 * MIB);
        let mut calls = 0;
        // A small run gets the first size, rounded up.
        let a = pool.take(3 * MIB, counting(&mut calls)).unwrap();
        assert_eq!((a.len(), calls), (FIRST_PINNED_BYTES, 1));
        // A run of 20 MiB gets 32 MiB (a power of two).
        let b = pool.take(20 * MIB, counting(&mut calls)).unwrap();
        assert_eq!((b.len(), calls), (32 * MIB, 2));
        // 48 MiB allocated: another 32 MiB would pass the 64 MiB cap, so nothing.
        assert!(pool.take(17 * MIB, counting(&mut calls)).is_none());
        assert_eq!(calls, 2);
        // Given back, both are reused best fit: the 16 MiB for a 10 MiB run, the 32 MiB for
        // a 17 MiB run, with no allocation.
        pool.give(b);
        pool.give(a);
        let c = pool.take(10 * MIB, counting(&mut calls)).unwrap();
        let d = pool.take(17 * MIB, counting(&mut calls)).unwrap();
        assert_eq!((c.len(), d.len(), calls), (16 * MIB, 32 * MIB, 2));
        // The 16 MiB left in the cap still serve a new small run.
        let e = pool.take(MIB, counting(&mut calls)).unwrap();
        assert_eq!((e.len(), calls, pool.allocated), (16 * MIB, 3, 64 * MIB));
        // Every buffer comes back; the pool frees none and stays at its cap.
        for x in [c, d, e] {
            pool.give(x);
        }
        assert_eq!((pool.free.len(), pool.allocated), (3, 64 * MIB));
    }

    #[test]
    fn runs_past_the_largest_pooled_size_and_refused_allocations_are_not_pooled() {
        let mut pool: BufferPool<Vec<u8>> = BufferPool::new(PINNED_POOL_BYTES);
        let mut calls = 0;
        assert!(pool
            .take(MAX_PINNED_RUN + 1, counting(&mut calls))
            .is_none());
        assert_eq!(calls, 0);
        // The driver refusing (None) leaves nothing counted.
        assert!(pool.take(MIB, |_| None::<Vec<u8>>).is_none());
        assert_eq!(pool.allocated, 0);
        let full = pool.take(MAX_PINNED_RUN, counting(&mut calls)).unwrap();
        assert_eq!(full.len(), MAX_PINNED_RUN);
    }

    #[test]
    fn rows_past_the_largest_pooled_buffer_are_left_to_the_owners_pipeline() {
        assert!(stages_rows(MIB));
        assert!(stages_rows(MAX_PINNED_RUN));
        assert!(!stages_rows(MAX_PINNED_RUN + 1));
        // The largest prewarmed buffer takes the largest staged run.
        assert_eq!(
            PREWARM_SIZES_MIB.iter().max().copied(),
            Some(MAX_PINNED_RUN / MIB)
        );
    }

    /// A cache of `layers` layers holding `n` blocks of `bs` tokens of distinct values
    /// (`heads` × `dim`, `dtype`), its config and its tokens.
    fn filled_cache(
        layers: usize,
        (bs, n, heads, dim): (usize, usize, usize, usize),
        dtype: mlx::Dtype,
    ) -> (crate::PagedConfig, crate::PagedKvCache, Vec<u32>) {
        use crate::KvCache;
        let config = crate::PagedConfig {
            block_size: bs,
            format: crate::KvFormat::Float,
            initial_blocks: 2,
            max_blocks: 16,
        };
        let mut cache = crate::PagedKvCache::new(layers, config).unwrap();
        let len = n * bs * heads * dim;
        let shape = [1, heads as i32, (n * bs) as i32, dim as i32];
        let vals = |at: usize| -> Vec<f32> { (0..len).map(|i| (at + i) as f32 * 0.25).collect() };
        for l in 0..layers {
            let k = Array::from_slice(&vals(l * 7), &shape)
                .unwrap()
                .astype(dtype)
                .unwrap();
            let v = Array::from_slice(&vals(l * 11 + 3), &shape)
                .unwrap()
                .astype(dtype)
                .unwrap();
            cache.update_and_fetch(l, &k, &v).unwrap();
        }
        (config, cache, (0..(n * bs) as u32).collect())
    }

    /// The in-place restore's table and nodes, run on the CPU with ordinary memory standing
    /// in for page-locked slabs: every layer part equals the batch restore's (the blocks'
    /// rows at each head's pitch, zeros after them), for float and bf16 arenas.
    #[test]
    fn blocks_in_block_memory_are_gathered_in_place_into_the_batch_restores_layout() {
        crate::block_memory::stand_in_for_tests();
        let (layers, bs, n) = (2, 4, 5);
        for dtype in [mlx::Dtype::F32, mlx::Dtype::BF16] {
            let (config, mut cache, tokens) = filled_cache(layers, (bs, n, 3, 8), dtype);
            let ns = store::NamespaceId([3; 32]);
            let blocks = cache
                .publish(&mut crate::Chain::new(ns, bs), &tokens)
                .unwrap();
            assert_eq!(blocks.len(), n);
            assert_in_place_equals_batch(layers, config, &blocks, &blocks, &dtype.to_string());
        }
    }

    /// Block files the store reads from the SSD land in block memory too (the store's
    /// registered buffers), so a restore from the SSD after a restart reads them in place
    /// and equals the batch restore.
    #[test]
    fn blocks_read_from_the_ssd_are_gathered_in_place_too() {
        use crate::{BlockShape, KvFormat};
        crate::block_memory::stand_in_for_tests();
        let (layers, bs, n, heads, dim) = (2, 4, 3, 2, 8);
        let (config, mut cache, tokens) =
            filled_cache(layers, (bs, n, heads, dim), mlx::Dtype::F32);
        let mut d = store::NamespaceDescription::new("in-place-ssd", store::Dtype::F32, bs as u32);
        d.layers = (0..layers).map(|_| "global".to_string()).collect();
        let block_shape = BlockShape {
            kv_heads: heads,
            block_size: bs,
            head_dim: dim,
            dtype: mlx::Dtype::F32,
        };
        d.planes = crate::plane_specs(layers, block_shape, KvFormat::Float).unwrap();
        let ns = d.id();
        let blocks = cache
            .publish(&mut crate::Chain::new(ns, bs), &tokens)
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let open = || store::Store::open(store::StoreConfig::default().root(dir.path())).unwrap();
        {
            let s = open();
            s.register_namespace(&d).unwrap();
            for b in &blocks {
                s.insert(std::sync::Arc::new(b.clone())).unwrap();
            }
            s.flush().unwrap();
        }
        let s = open();
        s.register_namespace(&d).unwrap();
        let keys: Vec<store::BlockKey> = blocks.iter().map(|b| b.meta.key).collect();
        let toks: Vec<&[u32]> = tokens.chunks(bs).collect();
        let loaded = s.load_prefix(ns, &keys, &toks);
        assert!(loaded.stopped.is_none(), "{:?}", loaded.stopped);
        assert!(loaded.blocks.iter().all(|(_, t)| *t == store::Tier::Ssd));
        let from_ssd: Vec<_> = loaded.blocks.into_iter().map(|(b, _)| b).collect();
        assert_in_place_equals_batch(layers, config, &from_ssd, &blocks, "from the SSD");
    }

    /// Stages `run` for an empty cache of `config`, requires it to be read in place,
    /// installs it and compares every arena, byte for byte, with the batch restore of
    /// `blocks` (the same blocks, as published).
    fn assert_in_place_equals_batch<B, C>(
        layers: usize,
        config: crate::PagedConfig,
        run: &[B],
        blocks: &[C],
        what: &str,
    ) where
        B: AsRef<Block> + Sync,
        C: AsRef<Block> + Sync,
    {
        let fresh = crate::PagedKvCache::new(layers, config).unwrap();
        let staged = fresh.stage_restore(run).unwrap().expect("stages");
        assert!(
            staged.reads_in_place(),
            "{what}: every plane is in block memory"
        );
        let installed = fresh.clone().restore_staged(staged, run).unwrap();
        let batch = fresh.restore_onto(blocks).unwrap();
        assert_eq!(
            (installed.blocks, batch.blocks),
            (run.len(), blocks.len()),
            "{what}"
        );
        for l in 0..layers {
            let (a, b) = (
                installed.cache.pool(l).unwrap(),
                batch.cache.pool(l).unwrap(),
            );
            assert_eq!(a.arrays().len(), b.arrays().len(), "{what}");
            for (x, y) in a.arrays().iter().zip(b.arrays()) {
                assert_eq!(x.shape(), y.shape(), "{what} layer {l}");
                assert_eq!(
                    x.to_bytes().unwrap(),
                    y.to_bytes().unwrap(),
                    "{what} layer {l}"
                );
            }
        }
    }

    #[test]
    fn prewarming_page_locks_within_the_pool_and_nothing_without_direct_transfers() {
        let total: usize = PREWARM_SIZES_MIB.iter().sum::<usize>() * MIB;
        assert_eq!((total, PINNED_POOL_BYTES), (736 * MIB, 736 * MIB));
        let made = prewarm_staging();
        if mlx::direct_transfers() {
            // Earlier stagings in this process may have page-locked some of it already.
            assert!(made <= total);
            assert!(PINNED.lock().unwrap().allocated <= PINNED_POOL_BYTES);
            // Done once: a second call finds the buffers free and makes none.
            assert_eq!(prewarm_staging(), 0);
        } else {
            assert_eq!(made, 0);
        }
    }
}
