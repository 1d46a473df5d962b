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

use mlx::{Array, HostBuffer, PinnedBuffer, RowsWrite};
use rayon::prelude::*;
use store::Block;

use crate::host::RunPart;
use crate::CacheError;

/// Page-locked staging memory kept for reuse between restores, at most (a few runs'
/// worth: page-locking is a driver call that costs more than the copy it speeds up).
const KEPT_PINNED_BYTES: usize = 1 << 30;

/// A page-locked buffer is allocated with at least this many bytes (small runs share the
/// sizes, so the pool's buffers fit the next run).
const FIRST_PINNED_BYTES: usize = 16 << 20;

/// Page-locked buffers returned by finished restores, waiting for the next.
static PINNED: Mutex<Vec<PinnedBuffer>> = Mutex::new(Vec::new());

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
}

/// Host memory for [`Bytes::Rows`]: page-locked from the pool where the driver allows it.
enum Staging {
    Pinned(Option<PinnedBuffer>),
    Heap(Vec<u8>),
}

impl Staging {
    /// At least `len` bytes: the smallest pooled page-locked buffer that fits, a new one,
    /// or (no page-locked memory) the heap.
    fn take(len: usize) -> Self {
        let pooled = PINNED.lock().ok().and_then(|mut pool| {
            let best = pool
                .iter()
                .enumerate()
                .filter(|(_, b)| b.len() >= len)
                .min_by_key(|(_, b)| b.len())
                .map(|(i, _)| i)?;
            Some(pool.swap_remove(best))
        });
        match pooled.or_else(|| PinnedBuffer::new(len.max(FIRST_PINNED_BYTES))) {
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

impl Drop for Staging {
    /// A page-locked buffer goes back to the pool while the pool keeps less than
    /// [`KEPT_PINNED_BYTES`]; else it is freed.
    fn drop(&mut self) {
        let Staging::Pinned(b) = self else {
            return;
        };
        let (Some(b), Ok(mut pool)) = (b.take(), PINNED.lock()) else {
            return;
        };
        let kept: usize = pool.iter().map(|p| p.len()).sum();
        if kept + b.len() <= KEPT_PINNED_BYTES {
            pool.push(b);
        }
    }
}

/// A layer part's array, as staged.
struct Part {
    shape: [i32; 4],
    dtype: mlx::Dtype,
    /// Rows of the blocks alone (for [`Bytes::Rows`]): width, height and pitch in bytes.
    rows: (usize, usize, usize),
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

    /// Assembles every part of `parts` from `blocks`: whole arrays on the CPU (and on a GPU
    /// without direct transfers), the blocks' rows alone where the driver writes them
    /// into zeros on the device. Host memory only; large parts use the thread pool.
    pub(crate) fn assemble<B: AsRef<Block> + Sync>(
        base: crate::paged::RunBase,
        plan: crate::paged::RunPlan,
        blocks: &[B],
        run_parts: &[RunPart<'_>],
        seconds_before: f64,
    ) -> Result<Self, CacheError> {
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
            });
            sizes.push(p.bytes(p.planes.len())?);
        }
        let rows = mlx::default_device()? != mlx::Device::Cpu && mlx::direct_transfers();
        let bytes = if rows {
            let total: usize = sizes.iter().sum();
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
        Ok(Self {
            base,
            plan,
            parts,
            bytes,
            seconds: seconds_before + t.elapsed().as_secs_f64(),
        })
    }

    /// Moves every part to the device: on the CPU the arrays take the buffers over; on
    /// CUDA one driver copy per part into zeros made on the device, all waited for once.
    /// `None` where the driver found no buffer to write into (the caller restores the
    /// ordinary way).
    pub(crate) fn upload(&mut self) -> Result<Option<Vec<Array>>, CacheError> {
        match &mut self.bytes {
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
