//! [`BlockPool`]: one layer's K and V arenas of fixed-size blocks, with a LIFO free list.

use mlx::{Array, Dtype};

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

/// One layer's K and V arenas, each `[blocks, kv_heads, block_size, width]` per part (see
/// [`KvFormat`]), and the allocation state over them.
///
/// Blocks are handed out lowest id first from a fresh pool and reused last-freed first
/// (LIFO), so the layout is deterministic. `Clone` copies the allocation metadata and
/// shares the arena buffers; a later write on either side makes MLX copy before writing
/// (a shared buffer is never donated), so clones never see each other's writes.
#[derive(Clone, Debug)]
pub struct BlockPool {
    shape: BlockShape,
    format: KvFormat,
    /// K parts followed by V parts.
    arenas: Vec<Array>,
    capacity: usize,
    max_blocks: usize,
    free: Vec<u32>,
}

/// Zeros of `[blocks, H, bs, width]` for each part of `format`, K parts then V parts.
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
                    blocks as i32,
                    shape.kv_heads as i32,
                    shape.block_size as i32,
                    width,
                ],
                p.dtype(),
            )?);
        }
    }
    Ok(out)
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
            arenas,
            capacity: initial,
            max_blocks,
            free: (0..initial as u32).rev().collect(),
        })
    }

    /// Rebuilds a pool from saved arenas (K parts then V parts, each `[n, H, bs, width]`)
    /// whose first `occupied` blocks are in use; the rest are free.
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
        let capacity = arrays[0].shape().first().copied().unwrap_or(0) as usize;
        for (a, e) in arrays.iter().zip(&expected) {
            let (sa, se) = (a.shape(), e.shape());
            if sa.len() != 4
                || sa[0] as usize != capacity
                || sa[1..] != se[1..]
                || a.dtype() != e.dtype()
            {
                return Err(CacheError::Shape(format!(
                    "arena {:?} {} does not match [{capacity}, {:?}] {}",
                    sa,
                    a.dtype(),
                    &se[1..],
                    e.dtype()
                )));
            }
        }
        if occupied > capacity || capacity > max_blocks.max(capacity) {
            return Err(CacheError::Shape(format!(
                "{occupied} occupied blocks in an arena of {capacity}"
            )));
        }
        Ok(Self {
            shape,
            format,
            arenas: arrays,
            capacity,
            max_blocks: max_blocks.max(capacity),
            free: (occupied as u32..capacity as u32).rev().collect(),
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
        let new_capacity = (self.capacity + self.capacity.div_ceil(2)).min(self.max_blocks);
        let extra = arena_parts(self.shape, self.format, new_capacity - self.capacity)?;
        for (arena, more) in self.arenas.iter_mut().zip(extra) {
            *arena = mlx::ops::concatenate(&[arena, &more], 0)?;
        }
        // New ids go under the existing free ones so the lowest new id is handed out first.
        let fresh: Vec<u32> = (self.capacity as u32..new_capacity as u32).rev().collect();
        self.free.splice(0..0, fresh);
        self.capacity = new_capacity;
        Ok(())
    }

    /// Writes encoded K and V parts (each `[1, H, n, width]`) into `block` at token `start`.
    pub fn write(
        &mut self,
        block: u32,
        start: usize,
        k_parts: &[Array],
        v_parts: &[Array],
    ) -> Result<(), CacheError> {
        let (b, s) = (block as i32, start as i32);
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
        for (arena, part) in self.arenas.iter().zip(&parts) {
            let (ps, as_) = (part.shape(), arena.shape());
            if ps.len() != 4
                || ps[0] != 1
                || ps[1] != heads
                || ps[3] != as_[3]
                || s + ps[2] > as_[2]
                || part.dtype() != arena.dtype()
            {
                return Err(CacheError::Shape(format!(
                    "cannot write {:?} {} at token {s} of a block {:?} {}",
                    ps,
                    part.dtype(),
                    &as_[1..],
                    arena.dtype()
                )));
            }
        }
        let old = std::mem::take(&mut self.arenas);
        for (arena, part) in old.into_iter().zip(parts) {
            let ps = part.shape();
            // The arena is moved into slice_update so MLX can update it in place.
            self.arenas.push(arena.slice_update(
                part,
                &[b, 0, s, 0],
                &[b + 1, heads, s + ps[2], ps[3]],
            )?);
        }
        Ok(())
    }

    /// Copies of the given blocks: K parts then V parts, each `[blocks.len(), H, bs, width]`.
    /// The result owns fresh buffers (a gather), so later writes to the pool cannot reach it.
    pub fn gather(&self, blocks: &[u32]) -> Result<Vec<Array>, CacheError> {
        let ids = Array::from_slice(blocks, &[blocks.len() as i32])?;
        self.arenas.iter().map(|a| Ok(a.take(&ids, 0)?)).collect()
    }

    /// The arenas (K parts then V parts).
    pub fn arrays(&self) -> &[Array] {
        &self.arenas
    }
}
