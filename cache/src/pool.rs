//! [`BlockPool`]: one layer's K and V arenas of fixed-size blocks, with a LIFO free list.
//!
//! Logically a pool is `[blocks, kv_heads, block_size, head_dim]`: block `b` is the
//! `[kv_heads, block_size, head_dim]` slab of tokens `b·bs .. (b+1)·bs`. Physically each
//! arena is stored heads-major, `[1, kv_heads, blocks · block_size, head_dim]`, so that a
//! run of consecutive blocks is one strided view per head: attention reads a sequence's
//! keys through a slice, with no gather (a gather over the block-major layout made decode
//! steps several times slower than a contiguous cache; figures in docs/cache.md). The
//! leading axis of one is the batch axis attention takes: a step writes its `[1, H, n, D]`
//! keys and reads its view without a reshape, the two graph nodes a contiguous cache's step
//! has (docs/cache.md, "Four-dimensional arenas").

use mlx::{Array, Dtype};
use std::sync::Arc;

use crate::{CacheError, KvFormat};

/// Shape of the blocks of one layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockShape {
    /// KV heads.
    pub kv_heads: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Features per head.
    pub head_dim: usize,
    /// Float dtype of keys and values as appended (and as fetched).
    pub dtype: Dtype,
}

/// One layer's K and V arenas, each `[1, kv_heads, blocks · block_size, width]` per part
/// (see [`KvFormat`] and the module docs), and the allocation state over them.
///
/// Blocks are handed out lowest id first from a fresh pool and reused last-freed first
/// (LIFO), so the layout is deterministic. `Clone` copies the allocation metadata and
/// shares the arena buffers; a later write on either side makes MLX copy before writing
/// (a shared buffer is never donated), so clones never see each other's writes.
#[derive(Debug)]
pub struct BlockPool {
    shape: BlockShape,
    format: KvFormat,
    /// K parts followed by V parts.
    arenas: Vec<Array>,
    /// Each arena's row width and dtype (fixed for the pool's life): the hot paths read
    /// them here instead of asking MLX for every step's write and read.
    parts: Vec<(i32, Dtype)>,
    capacity: usize,
    max_blocks: usize,
    free: Vec<u32>,
    /// Whether the arenas' buffers are this pool's own: true after MLX last wrote them (a
    /// slice update or a growth makes a buffer no other array holds), false for fresh
    /// zeros (a broadcast), restored arrays and clones.
    own_buffers: bool,
    /// Held by every clone of this pool and every prefix view taken of it
    /// ([`Self::view_token`]): while another holder is alive the buffers are shared.
    holders: Arc<()>,
}

impl Clone for BlockPool {
    /// Shares the arenas (no copy); neither side may then write them in place until MLX
    /// has written its own buffers again.
    fn clone(&self) -> Self {
        Self {
            shape: self.shape,
            format: self.format,
            arenas: self.arenas.clone(),
            parts: self.parts.clone(),
            capacity: self.capacity,
            max_blocks: self.max_blocks,
            free: self.free.clone(),
            own_buffers: false,
            holders: Arc::clone(&self.holders),
        }
    }
}

/// Zeros of `[1, H, blocks · bs, width]` for each part of `format`, K parts then V parts.
fn arena_parts(
    shape: BlockShape,
    format: KvFormat,
    blocks: usize,
) -> Result<Vec<Array>, CacheError> {
    // Encoding one zero row gives each part's width and dtype without special cases.
    let probe = mlx::ops::zeros(&[1, shape.head_dim as i32], shape.dtype)?;
    let parts = format.encode(&probe)?;
    let mut out = Vec::with_capacity(parts.len() * 2);
    for _ in 0..2 {
        for p in &parts {
            let width = p.shape()[1];
            out.push(mlx::ops::zeros(
                &[
                    1,
                    shape.kv_heads as i32,
                    (blocks * shape.block_size) as i32,
                    width,
                ],
                p.dtype(),
            )?);
        }
    }
    Ok(out)
}

/// Each arena's row width (its last dimension) and dtype.
fn part_layouts(arenas: &[Array]) -> Vec<(i32, Dtype)> {
    arenas
        .iter()
        .map(|a| (a.shape().last().copied().unwrap_or(0), a.dtype()))
        .collect()
}

/// Whether `blocks` is a run of consecutive ids, and where it starts.
pub(crate) fn run_start(blocks: &[u32]) -> Option<u32> {
    let first = *blocks.first()?;
    blocks
        .iter()
        .enumerate()
        .all(|(i, &b)| b == first + i as u32)
        .then_some(first)
}

/// Tokens that a KV buffer's length must be a multiple of for MLX's CUDA attention to run a
/// decode step through cuDNN (mlx-lm's cache step); over any other buffer MLX 0.32 runs its
/// own vector kernel (docs/cache.md, "Arena lengths and the GPU's decode attention").
pub const CUDNN_KV_STEP: usize = 256;

/// Arena length, in tokens, from which the growth ladder keeps to whole [`CUDNN_KV_STEP`]s.
/// One layer of an 8B model's decode on the H200 (scripts/cuda/cudnn_decode_probe.py): MLX's
/// vector kernel 24 / 27 / 52 / 234 µs at 512 / 2K / 8K / 32K tokens, cuDNN's 36 / 37 / 42 /
/// 57 µs; shorter arenas stay off the steps, where the vector kernel is the faster.
pub const CUDNN_ARENA_FROM: usize = 4096;

/// Blocks of `block_size` tokens in the smallest whole number of [`CUDNN_KV_STEP`]s.
fn step_blocks(block_size: usize) -> usize {
    let (mut a, mut b) = (CUDNN_KV_STEP, block_size.max(1));
    while b != 0 {
        (a, b) = (b, a % b);
    }
    CUDNN_KV_STEP / a
}

/// The capacity a pool of `capacity` blocks of `block_size` tokens grows to: ×1.5, rounded
/// up, and up again to whole [`CUDNN_KV_STEP`]s past [`CUDNN_ARENA_FROM`] tokens.
fn next_capacity(capacity: usize, block_size: usize) -> usize {
    let grown = capacity + capacity.div_ceil(2).max(1);
    if grown * block_size > CUDNN_ARENA_FROM {
        grown.next_multiple_of(step_blocks(block_size))
    } else {
        grown
    }
}

/// The capacity, in blocks of `block_size` tokens, of a pool that must hold `blocks` blocks:
/// the first step of the growth ladder from `initial` (`initial`, then [`next_capacity`]
/// again and again) that holds them, at most `max_blocks` (but never below `blocks`). Every
/// pool's capacity is a step of this ladder, fresh or restored, so arenas of the same
/// content length have the same strides: MLX's CUDA attention builds a cuDNN graph per
/// shape *and strides* (docs/cache.md).
pub fn ladder_capacity(
    initial: usize,
    max_blocks: usize,
    block_size: usize,
    blocks: usize,
) -> usize {
    let mut c = initial.max(1);
    while c < blocks && c < max_blocks {
        c = next_capacity(c, block_size);
    }
    c.min(max_blocks).max(blocks)
}

impl BlockPool {
    /// A pool of `initial` blocks (grown ×1.5 on demand up to `max_blocks`).
    pub fn new(
        shape: BlockShape,
        format: KvFormat,
        initial: usize,
        max_blocks: usize,
    ) -> Result<Self, CacheError> {
        format.validate(shape.head_dim)?;
        if shape.block_size == 0 || max_blocks == 0 {
            return Err(CacheError::Config(
                "block size and maximum blocks must be positive".into(),
            ));
        }
        let initial = initial.clamp(1, max_blocks);
        let arenas = arena_parts(shape, format, initial)?;
        Ok(Self {
            shape,
            format,
            parts: part_layouts(&arenas),
            arenas,
            capacity: initial,
            max_blocks,
            free: (0..initial as u32).rev().collect(),
            own_buffers: false,
            holders: Arc::new(()),
        })
    }

    /// Rebuilds a pool from saved arenas (K parts then V parts, each
    /// `[1, H, n · block_size, width]`) whose first `occupied` blocks are in use; the rest
    /// are free.
    pub fn restore_arrays(
        shape: BlockShape,
        format: KvFormat,
        arrays: Vec<Array>,
        occupied: usize,
        max_blocks: usize,
    ) -> Result<Self, CacheError> {
        let expected = arena_parts(shape, format, 1)?;
        if arrays.len() != expected.len() {
            return Err(CacheError::Shape(format!(
                "{} arena arrays given, {format:?} needs {}",
                arrays.len(),
                expected.len()
            )));
        }
        let tokens = arrays[0].shape().get(2).copied().unwrap_or(0) as usize;
        let capacity = tokens / shape.block_size;
        for (a, e) in arrays.iter().zip(&expected) {
            let (sa, se) = (a.shape(), e.shape());
            if sa.len() != 4
                || sa[0] != 1
                || sa[1] != se[1]
                || sa[2] as usize != tokens
                || sa[3] != se[3]
                || a.dtype() != e.dtype()
            {
                return Err(CacheError::Shape(format!(
                    "arena {:?} {} does not match [1, {}, {tokens}, {}] {}",
                    sa,
                    a.dtype(),
                    se[1],
                    se[3],
                    e.dtype()
                )));
            }
        }
        if !tokens.is_multiple_of(shape.block_size) || occupied > capacity {
            return Err(CacheError::Shape(format!(
                "{occupied} occupied blocks in an arena of {tokens} tokens (blocks of {})",
                shape.block_size
            )));
        }
        Ok(Self {
            shape,
            format,
            parts: part_layouts(&arrays),
            arenas: arrays,
            capacity,
            max_blocks: max_blocks.max(capacity),
            free: (occupied as u32..capacity as u32).rev().collect(),
            own_buffers: false,
            holders: Arc::new(()),
        })
    }

    /// The block shape.
    pub fn shape(&self) -> BlockShape {
        self.shape
    }

    /// The storage format.
    pub fn format(&self) -> KvFormat {
        self.format
    }

    /// The key and value arenas of a float pool (`[1, H, capacity · bs, D]` each), or
    /// `None` for a quantized one (whose parts are codes, scales and biases).
    pub(crate) fn float_arenas(&self) -> Option<(&Array, &Array)> {
        match (self.format, self.arenas.as_slice()) {
            (KvFormat::Float, [k, v]) => Some((k, v)),
            _ => None,
        }
    }

    /// Whether a kernel may write the arenas' buffers in place: MLX made them for this pool
    /// alone and no clone or prefix view of them is alive.
    pub(crate) fn writable_in_place(&self) -> bool {
        self.own_buffers && Arc::strong_count(&self.holders) == 1
    }

    /// A token for a view of the arenas that outlives this call (a shared prefix): while it
    /// is alive the buffers count as shared.
    pub(crate) fn view_token(&self) -> Arc<()> {
        Arc::clone(&self.holders)
    }

    /// MLX has just made fresh buffers for the arenas: they are this pool's alone.
    fn own_new_buffers(&mut self) {
        self.own_buffers = true;
        self.holders = Arc::new(());
    }

    /// Blocks in the arenas.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Blocks not in use.
    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    /// Bytes of one block across K and V and all parts.
    pub fn block_bytes(&self) -> usize {
        self.arenas
            .iter()
            .map(|a| a.nbytes() / self.capacity.max(1))
            .sum()
    }

    /// Takes a free block, growing the arenas ×1.5 when none is left.
    pub fn alloc(&mut self) -> Result<u32, CacheError> {
        if self.free.is_empty() {
            self.grow()?;
        }
        self.free.pop().ok_or(CacheError::PoolExhausted {
            capacity: self.capacity,
            max_blocks: self.max_blocks,
            block_size: self.shape.block_size,
        })
    }

    /// Returns a block to the free list.
    pub fn free(&mut self, block: u32) {
        debug_assert!(!self.free.contains(&block), "block {block} freed twice");
        self.free.push(block);
    }

    fn grow(&mut self) -> Result<(), CacheError> {
        if self.capacity >= self.max_blocks {
            return Err(CacheError::PoolExhausted {
                capacity: self.capacity,
                max_blocks: self.max_blocks,
                block_size: self.shape.block_size,
            });
        }
        let new_capacity = next_capacity(self.capacity, self.shape.block_size).min(self.max_blocks);
        self.grow_to(new_capacity)
    }

    /// Grows the arenas at once to the step of the growth ladder that holds `blocks`
    /// blocks (at most `max_blocks`): one copy per part where growing block by block would
    /// copy at every step the ladder climbs. Nothing where they hold them already.
    pub fn reserve(&mut self, blocks: usize) -> Result<(), CacheError> {
        let bs = self.shape.block_size;
        let target = ladder_capacity(
            self.capacity,
            self.max_blocks,
            bs,
            blocks.min(self.max_blocks),
        );
        match target > self.capacity {
            true => self.grow_to(target),
            false => Ok(()),
        }
    }

    fn grow_to(&mut self, new_capacity: usize) -> Result<(), CacheError> {
        let extra = arena_parts(self.shape, self.format, new_capacity - self.capacity)?;
        for (arena, more) in self.arenas.iter_mut().zip(extra) {
            *arena = mlx::ops::concatenate(&[arena, &more], 2)?;
        }
        // New ids go under the existing free ones so the lowest new id is handed out first.
        let fresh: Vec<u32> = (self.capacity as u32..new_capacity as u32).rev().collect();
        self.free.splice(0..0, fresh);
        self.capacity = new_capacity;
        self.own_new_buffers();
        Ok(())
    }

    /// Writes encoded K and V parts (each `[1, H, n, width]`) into `block` at token `start`.
    /// A write longer than the rest of the block runs on into the blocks with the next ids
    /// (`block + 1`, ...), which the caller must hold: the arena stores them contiguously.
    pub fn write(
        &mut self,
        block: u32,
        start: usize,
        k_parts: &[Array],
        v_parts: &[Array],
    ) -> Result<(), CacheError> {
        let bs = self.shape.block_size;
        let heads = self.shape.kv_heads as i32;
        let parts: Vec<&Array> = k_parts.iter().chain(v_parts).collect();
        if parts.len() != self.arenas.len() || block as usize >= self.capacity {
            return Err(CacheError::Shape(format!(
                "write of {} parts into block {block} of a pool with {} parts and {} blocks",
                parts.len(),
                self.arenas.len(),
                self.capacity
            )));
        }
        // Check every part before consuming the arenas, so a rejected write changes nothing.
        let mut shapes = Vec::with_capacity(parts.len());
        for (&(width, dtype), part) in self.parts.iter().zip(&parts) {
            let ps = part.shape();
            if ps.len() != 4
                || ps[0] != 1
                || ps[1] != heads
                || ps[3] != width
                || (block as usize * bs + start + ps[2] as usize) > self.capacity * bs
                || part.dtype() != dtype
            {
                return Err(CacheError::Shape(format!(
                    "cannot write {:?} {} at token {start} of block {block} of a pool of {} blocks [{heads}, {bs}, {width}] {dtype}",
                    ps,
                    part.dtype(),
                    self.capacity,
                )));
            }
            shapes.push(ps);
        }
        let t0 = (block as usize * bs + start) as i32;
        let old = std::mem::take(&mut self.arenas);
        for ((arena, part), ps) in old.into_iter().zip(parts).zip(shapes) {
            // The arena is moved into slice_update so MLX can update it in place.
            self.arenas.push(arena.slice_update(
                part,
                &[0, 0, t0, 0],
                &[1, heads, t0 + ps[2], ps[3]],
            )?);
        }
        // A slice update hands back the input's buffer only when nothing else held it, and
        // writes a fresh one otherwise.
        self.own_new_buffers();
        Ok(())
    }

    /// The first `len` tokens of the blocks `table` (in order), as `[1, H, len, width]`
    /// per part, K parts then V parts. A run of consecutive blocks is read through a view
    /// of the arena (no copy); any other table is gathered.
    pub fn read(&self, table: &[u32], len: usize) -> Result<Vec<Array>, CacheError> {
        let bs = self.shape.block_size;
        if len > table.len() * bs {
            return Err(CacheError::Shape(format!(
                "{len} tokens read from {} blocks of {bs}",
                table.len()
            )));
        }
        match run_start(table) {
            // A view that starts past the arena's first token is gathered instead when
            // MLX's CUDA attention could take it for a cuDNN decode: that path assumes its
            // keys start at their buffer's first byte (mlx/backend/cuda/
            // scaled_dot_product_attention.cpp, `unslice_kv`; docs/cache.md).
            Some(first) if first == 0 || !self.cudnn_decodable() => {
                let t0 = first as usize * bs;
                self.views(t0, t0 + len)
            }
            None if len == 0 => self.read(&[0], 0),
            _ => self.copy_run(table, len),
        }
    }

    /// Arena positions `lo..hi` of every part, as views `[1, H, hi − lo, width]`.
    fn views(&self, lo: usize, hi: usize) -> Result<Vec<Array>, CacheError> {
        let heads = self.shape.kv_heads as i32;
        self.arenas
            .iter()
            .zip(&self.parts)
            .map(|(a, &(width, _))| {
                Ok(a.slice(&[0, 0, lo as i32, 0], &[1, heads, hi as i32, width])?)
            })
            .collect()
    }

    /// A pool of its own holding the blocks `table` in its first blocks, copied once (one
    /// copy per part), with the capacity the growth ladder from `initial` gives them: what a
    /// fork keeps of a longer sequence, instead of a copy-on-write clone whose first write
    /// copies this pool's whole capacity.
    pub fn compact(&self, table: &[u32], initial: usize) -> Result<BlockPool, CacheError> {
        let tokens = table.len() * self.shape.block_size;
        let held = self.read(table, tokens)?;
        BlockPool::from_parts(
            self.shape,
            self.format,
            &held,
            tokens,
            initial,
            self.max_blocks,
        )
    }

    /// A pool holding `parts` (the pool's encoded parts in order, each `[1, H, tokens,
    /// width]`) in its first blocks, zeros after them up to the capacity the growth ladder
    /// from `initial` gives them: one write per part.
    pub(crate) fn from_parts(
        shape: BlockShape,
        format: KvFormat,
        parts: &[Array],
        tokens: usize,
        initial: usize,
        max_blocks: usize,
    ) -> Result<BlockPool, CacheError> {
        let bs = shape.block_size;
        let blocks = tokens.div_ceil(bs);
        let capacity = ladder_capacity(initial, max_blocks, bs, blocks);
        let tail = (capacity * bs - tokens) as i32;
        let arrays = parts
            .iter()
            .map(|p| {
                let s = p.shape();
                let zeros = mlx::ops::zeros(&[1, s[1], tail, s[3]], p.dtype())?;
                Ok(mlx::ops::concatenate(&[p, &zeros], 2)?)
            })
            .collect::<Result<Vec<_>, CacheError>>()?;
        BlockPool::restore_arrays(shape, format, arrays, blocks, max_blocks.max(capacity))
    }

    /// The arenas from the first token of the blocks `table` (one run of consecutive
    /// blocks) to the pool's end, views of every part: what a padded attention reads past
    /// the `table`'s tokens (mlx::padded_attention). `None` where the blocks are not one run.
    pub fn read_room(&self, table: &[u32]) -> Result<Option<Vec<Array>>, CacheError> {
        let Some(first) = run_start(table) else {
            return Ok(None);
        };
        let bs = self.shape.block_size;
        let (t0, end) = (first as usize * bs, self.capacity * bs);
        let heads = self.shape.kv_heads as i32;
        let parts = self
            .arenas
            .iter()
            .zip(&self.parts)
            .map(|(a, &(width, _))| {
                Ok(a.slice(&[0, 0, t0 as i32, 0], &[1, heads, end as i32, width])?)
            })
            .collect::<Result<Vec<_>, CacheError>>()?;
        Ok(Some(parts))
    }

    /// Whether MLX's CUDA attention may run a decode step over views of these arenas through
    /// cuDNN: float16 or bfloat16 keys in an arena of a whole number of [`CUDNN_KV_STEP`]s
    /// (the CPU never does, but the test is cheaper than asking for the device).
    fn cudnn_decodable(&self) -> bool {
        let tokens = self.capacity * self.shape.block_size;
        matches!(
            self.parts.first().map(|p| p.1),
            Some(Dtype::F16 | Dtype::BF16)
        ) && tokens.is_multiple_of(CUDNN_KV_STEP)
    }

    /// The first `len` tokens of the blocks `table` as [`Self::read`] gives them, but in
    /// fresh buffers (a gather), so later writes to the pool cannot reach them and the
    /// arenas stay free to be updated in place.
    pub fn copy_run(&self, table: &[u32], len: usize) -> Result<Vec<Array>, CacheError> {
        self.copy_range(table, 0, len)
    }

    /// Tokens `start..end` of the blocks `table` (in order), as [`Self::copy_run`] gives
    /// them: `[1, H, end − start, width]` per part, in fresh buffers.
    ///
    /// Where the blocks are a run, the parts are copied by one node
    /// ([`mlx::copy_runs::copy_token_runs`], which [`Self::token_runs`] feeds; a publication
    /// takes every layer's parts through one such node). Otherwise a gather by token index
    /// (`take`), whose index array comes from the host: on CUDA, MLX puts such a small host
    /// array in managed memory, which costs the engine thread an allocation (and a device
    /// page fault) per layer, and a device-wide synchronization when it is freed past MLX's
    /// cache limit (docs/cache.md, "Publication").
    pub fn copy_range(
        &self,
        table: &[u32],
        start: usize,
        end: usize,
    ) -> Result<Vec<Array>, CacheError> {
        let bs = self.shape.block_size;
        if end > table.len() * bs || start > end {
            return Err(CacheError::Shape(format!(
                "tokens {start}..{end} copied from {} blocks of {bs}",
                table.len()
            )));
        }
        if let Some(runs) = self.token_runs(table, start, end) {
            return Ok(mlx::copy_runs::copy_token_runs(&runs)?);
        }
        let idx: Vec<u32> = (start..end)
            .map(|t| table[t / bs] * bs as u32 + (t % bs) as u32)
            .collect();
        let idx = Array::from_slice(&idx, &[(end - start) as i32])?;
        self.arenas.iter().map(|a| Ok(a.take(&idx, 2)?)).collect()
    }

    /// Each part's arena with the arena positions of tokens `start..end` of the blocks
    /// `table`, when those tokens lie in consecutive blocks (a run) and are at least one:
    /// what [`mlx::copy_runs::copy_token_runs`] copies. `None` otherwise (or out of range).
    pub fn token_runs(
        &self,
        table: &[u32],
        start: usize,
        end: usize,
    ) -> Option<Vec<mlx::copy_runs::TokenRun<'_>>> {
        let bs = self.shape.block_size;
        if start >= end || end > table.len() * bs {
            return None;
        }
        let first = run_start(&table[start / bs..end.div_ceil(bs)])?;
        let lo = first as usize * bs + start % bs;
        let hi = lo + (end - start);
        Some(
            self.arenas
                .iter()
                .map(|source| mlx::copy_runs::TokenRun { source, lo, hi })
                .collect(),
        )
    }

    /// Copies of one block: K parts then V parts, each `[H, block_size, width]`, in fresh
    /// buffers (a gather), so later writes to the pool cannot reach them.
    pub fn copy_block(&self, block: u32) -> Result<Vec<Array>, CacheError> {
        let bs = self.shape.block_size as u32;
        let idx: Vec<u32> = (block * bs..(block + 1) * bs).collect();
        let idx = Array::from_slice(&idx, &[bs as i32])?;
        self.arenas
            .iter()
            .map(|a| Ok(a.take(&idx, 2)?.squeeze(0)?))
            .collect()
    }

    /// The arenas (K parts then V parts).
    pub fn arrays(&self) -> &[Array] {
        &self.arenas
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool() -> BlockPool {
        let shape = BlockShape {
            kv_heads: 2,
            block_size: 4,
            head_dim: 8,
            dtype: Dtype::F32,
        };
        BlockPool::new(shape, KvFormat::Float, 1, 8).unwrap()
    }

    fn write_one(p: &mut BlockPool, block: u32) {
        let k =
            mlx::random::normal(&[1, 2, 1, 8], Dtype::F32, &mlx::random::key(3).unwrap()).unwrap();
        p.write(block, 0, std::slice::from_ref(&k), std::slice::from_ref(&k))
            .unwrap();
    }

    #[test]
    fn arenas_are_writable_in_place_only_when_mlx_made_them_for_this_pool_alone() {
        let mut p = pool();
        // Fresh zeros are a broadcast of one scalar: never written in place.
        assert!(!p.writable_in_place());
        let b = p.alloc().unwrap();
        write_one(&mut p, b);
        assert!(p.writable_in_place());

        // A clone shares the buffers: neither side may write them in place...
        let mut twin = p.clone();
        assert!(!p.writable_in_place() && !twin.writable_in_place());
        // ...until MLX writes one side (a copy, as the buffer is shared): that side's
        // buffers are its own, the other's are still held by nobody else but the old token.
        write_one(&mut twin, b);
        assert!(twin.writable_in_place());
        drop(twin);
        assert!(p.writable_in_place());

        // A view token (a shared prefix) keeps the pool from writing in place while alive.
        let token = p.view_token();
        assert!(!p.writable_in_place());
        drop(token);
        assert!(p.writable_in_place());

        // Growth concatenates into fresh buffers: writable, and old view tokens no longer
        // refer to them.
        let token = p.view_token();
        while p.capacity() == 1 {
            p.alloc().unwrap();
        }
        assert!(p.writable_in_place());
        drop(token);

        // A restored pool's arrays came from outside: not writable until MLX writes them.
        let restored =
            BlockPool::restore_arrays(p.shape(), KvFormat::Float, p.arrays().to_vec(), 1, 8)
                .unwrap();
        assert!(!restored.writable_in_place());
    }

    /// Bytes of tokens `start..end` of blocks `table`, from the arenas on the host (the
    /// naive reference of a copy).
    fn naive_range(p: &BlockPool, table: &[u32], start: usize, end: usize) -> Vec<Vec<f32>> {
        let bs = p.shape().block_size;
        let (h, d) = (p.shape().kv_heads, p.shape().head_dim);
        let cap = p.capacity() * bs;
        p.arrays()
            .iter()
            .map(|a| {
                let all: Vec<f32> = a.to_vec().unwrap();
                let mut out = Vec::new();
                for head in 0..h {
                    for t in start..end {
                        let at = table[t / bs] as usize * bs + t % bs;
                        let row = (head * cap + at) * d;
                        out.extend_from_slice(&all[row..row + d]);
                    }
                }
                out
            })
            .collect()
    }

    #[test]
    fn range_copies_equal_the_arenas_in_one_node_for_a_run_and_a_gather_otherwise() {
        for heads in [2usize, 1] {
            let shape = BlockShape {
                kv_heads: heads,
                block_size: 4,
                head_dim: 8,
                dtype: Dtype::F32,
            };
            let mut p = BlockPool::new(shape, KvFormat::Float, 4, 8).unwrap();
            for step in 0..4u64 {
                let b = p.alloc().unwrap();
                let key = mlx::random::key(10 + step).unwrap();
                for t in 0..4 {
                    let k = mlx::random::normal(&[1, heads as i32, 1, 8], Dtype::F32, &key)
                        .unwrap()
                        .add_scalar(t as f64)
                        .unwrap();
                    p.write(b, t, std::slice::from_ref(&k), std::slice::from_ref(&k))
                        .unwrap();
                }
            }
            for (table, start, end) in [
                (vec![0u32, 1, 2, 3], 2, 14),
                (vec![0, 1, 2, 3], 0, 16),
                (vec![1, 2], 1, 7),
                (vec![2, 0], 0, 8),
            ] {
                let copies = p.copy_range(&table, start, end).unwrap();
                let names = mlx::pending_primitives(&copies.iter().collect::<Vec<_>>()).unwrap();
                let gathered = names.iter().any(|n| n == "Gather");
                let run = crate::pool::run_start(&table).is_some();
                let nodes = names.iter().filter(|n| *n == "CopyTokenRuns").count();
                assert_eq!(
                    (gathered, nodes),
                    (!run, usize::from(run)),
                    "{heads} heads, table {table:?}, {start}..{end}: {names:?}"
                );
                let want = naive_range(&p, &table, start, end);
                for (c, w) in copies.iter().zip(&want) {
                    assert_eq!(c.shape(), vec![1, heads as i32, (end - start) as i32, 8]);
                    assert_eq!(&c.to_vec::<f32>().unwrap(), w);
                    // A fresh buffer: not a view of the arena.
                    assert!(p
                        .arrays()
                        .iter()
                        .all(|a| a.data_addr().unwrap() != c.data_addr().unwrap()));
                }
                // A later in-place write leaves the copies as they were.
                let k = mlx::ops::full(&[1, heads as i32, 1, 8], 7.0, Dtype::F32).unwrap();
                p.write(
                    table[0],
                    0,
                    std::slice::from_ref(&k),
                    std::slice::from_ref(&k),
                )
                .unwrap();
                for (c, w) in copies.iter().zip(&want) {
                    assert_eq!(&c.to_vec::<f32>().unwrap(), w);
                }
            }
        }
    }
}
