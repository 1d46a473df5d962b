//! Full blocks between a live cache and the store's host bytes, in bulk.
//!
//! The store holds host bytes only ([`store::Block`]); this module is the one place where
//! device KV becomes host bytes and back. Both directions move a whole run of blocks with
//! one device transfer per layer part, and assemble or split the per-block planes on the
//! host, never one small array per block (per-block arrays made long restores several
//! times slower; figures in docs/cache.md).
//!
//! Planes of a block, per layer `i` in order: `layers.{i}.k`, then (quantized formats)
//! `layers.{i}.k_scales`, `layers.{i}.k_biases`, then the same for `v`. Each plane is
//! `[kv_heads, block_size, width]`: width is head_dim for float formats, head_dim·bits/32
//! (uint32) for packed values and head_dim/group_size for scales and biases. A layer's
//! arena part is `[kv_heads, n · block_size, width]`, so block `b` of a run is, per head,
//! the rows `b·bs .. (b+1)·bs`.
//!
//! A *snapshot block* of a hybrid model carries, after those, the state of every
//! non-attention layer `j` at the block's end: `states.{j}.{p}` for each part `p` of the
//! layer's state, shaped as the state without its batch axis (LFM2: `[K-1, hidden]`).
//!
//! A *window-trimmed block* of a model with sliding-window layers leaves out the planes of
//! every window layer (the global layers' planes keep their order): no continuation from a
//! restorable end can attend to its keys through a window ([`WindowPlan::keeps`] decides).
//! A restore fills the missing rows with zeros, which the window mask never reads.

use mlx::{Array, HostBuffer, RowsWrite};
use store::{Block, BlockMeta, Plane, PlaneSpec};

use crate::block_memory::PinnedChunk;
use crate::pool::BlockShape;
use rayon::prelude::*;

use crate::scratch::{with_scratch, with_scratch_pair, KEEP_BYTES};
use crate::transfer_pool;
use crate::{CacheError, KvFormat, LayerState};

/// What decides which published blocks carry their window layers' planes: a continuation
/// from a restorable end `e` (a token count on a block boundary) reads, through a window of
/// `w` keys (its own included), the positions `e + 1 - w .. e`; a block carries its window
/// planes when some end reads one of its positions and the cache holds real window keys
/// for all of it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct WindowPlan<'a> {
    /// Per attention layer, its window (`None`: global).
    pub windows: &'a [Option<usize>],
    /// The restorable ends a continuation may resume from (token counts).
    pub ends: &'a [usize],
    /// The first position whose window-layer keys the cache holds for real (0: all).
    pub floor: usize,
}

impl WindowPlan<'_> {
    /// The widest window of any layer; `None` without window layers, or without a global
    /// layer (a trimmed block would then hold no plane at all: nothing is trimmed).
    pub fn widest(&self) -> Option<usize> {
        if self.windows.iter().all(Option::is_some) {
            return None;
        }
        self.windows.iter().flatten().copied().max()
    }

    /// Whether the block of positions `start .. end` carries its window layers' planes.
    pub fn keeps(&self, start: usize, end: usize) -> bool {
        let Some(w) = self.widest() else {
            return true;
        };
        start >= self.floor
            && self
                .ends
                .iter()
                .any(|&e| e >= end && end > (e + 1).saturating_sub(w))
    }

    /// Whether a cache whose window layers hold real keys from `floor` on can continue
    /// after `end` tokens: every position a query at `end` sees is real.
    pub fn complete(windows: &[Option<usize>], floor: usize, end: usize) -> bool {
        match windows.iter().flatten().max() {
            Some(&w) => floor == 0 || (end + 1).saturating_sub(w) >= floor,
            None => true,
        }
    }
}

/// The plane name of part `part` of state layer `layer`.
fn state_plane_name(layer: usize, part: usize) -> String {
    format!("states.{layer}.{part}")
}

/// The state planes a snapshot block of states shaped like `states` carries (per state
/// layer, its parts; batch axis first, of size 1): what a namespace records.
pub fn state_plane_specs(states: &[LayerState]) -> Result<Vec<PlaneSpec>, CacheError> {
    let mut out = Vec::new();
    for (j, state) in states.iter().enumerate() {
        for (p, a) in state.iter().enumerate() {
            let shape = a.shape();
            if shape.first() != Some(&1) {
                return Err(CacheError::Shape(format!(
                    "state {j}.{p} of shape {shape:?} is not one sequence's"
                )));
            }
            out.push(PlaneSpec::new(
                state_plane_name(j, p),
                to_store_dtype(a.dtype())?,
                shape[1..].iter().map(|&d| d as u64).collect(),
            ));
        }
    }
    Ok(out)
}

pub(crate) fn to_store_dtype(d: mlx::Dtype) -> Result<store::Dtype, CacheError> {
    Ok(match d {
        mlx::Dtype::F32 => store::Dtype::F32,
        mlx::Dtype::F16 => store::Dtype::F16,
        mlx::Dtype::BF16 => store::Dtype::BF16,
        mlx::Dtype::U32 => store::Dtype::U32,
        mlx::Dtype::I32 => store::Dtype::I32,
        mlx::Dtype::U8 => store::Dtype::U8,
        other => {
            return Err(CacheError::Shape(format!(
                "the store cannot hold {other} planes"
            )))
        }
    })
}

pub(crate) fn to_mlx_dtype(d: store::Dtype) -> mlx::Dtype {
    match d {
        store::Dtype::F32 => mlx::Dtype::F32,
        store::Dtype::F16 => mlx::Dtype::F16,
        store::Dtype::BF16 => mlx::Dtype::BF16,
        store::Dtype::U32 => mlx::Dtype::U32,
        store::Dtype::I32 => mlx::Dtype::I32,
        store::Dtype::U8 => mlx::Dtype::U8,
    }
}

/// Plane names of one layer for a format, in order.
pub(crate) fn part_names(layer: usize, format: KvFormat) -> Vec<String> {
    ["k", "v"]
        .iter()
        .flat_map(|kv| {
            format
                .part_suffixes()
                .iter()
                .map(move |s| format!("layers.{layer}.{kv}{s}"))
        })
        .collect()
}

/// The plane layout every block of a model has: what a store namespace records so that
/// blocks of another shape are refused.
pub fn plane_specs(
    layers: usize,
    shape: BlockShape,
    format: KvFormat,
) -> Result<Vec<PlaneSpec>, CacheError> {
    format.validate(shape.head_dim)?;
    let probe = mlx::ops::zeros(&[1, shape.head_dim as i32], shape.dtype)?;
    let parts = format.encode(&probe)?;
    let mut out = Vec::new();
    for layer in 0..layers {
        for (name, part) in part_names(layer, format)
            .into_iter()
            .zip(parts.iter().chain(&parts))
        {
            out.push(PlaneSpec::new(
                name,
                to_store_dtype(part.dtype())?,
                vec![
                    shape.kv_heads as u64,
                    shape.block_size as u64,
                    part.shape()[1] as u64,
                ],
            ));
        }
    }
    Ok(out)
}

/// The plane layout of a window-trimmed block: [`plane_specs`] less the planes of every
/// layer with a window in `windows` (one entry per layer). Empty when no layer has one.
pub fn trimmed_plane_specs(
    windows: &[Option<usize>],
    shape: BlockShape,
    format: KvFormat,
) -> Result<Vec<PlaneSpec>, CacheError> {
    if windows.iter().all(Option::is_none) || windows.iter().all(Option::is_some) {
        return Ok(Vec::new());
    }
    let per = format.parts() * 2;
    Ok(plane_specs(windows.len(), shape, format)?
        .into_iter()
        .enumerate()
        .filter(|(i, _)| windows[i / per].is_none())
        .map(|(_, spec)| spec)
        .collect())
}

/// Splits one run part (`[H, n · bs, width]` as host bytes) into `n` block planes
/// `[H, bs, width]`.
fn split_run(
    bytes: &[u8],
    heads: usize,
    blocks: usize,
    bs: usize,
    row_bytes: usize,
) -> Vec<bytes::Bytes> {
    let block_rows = bs * row_bytes;
    let head_stride = blocks * block_rows;
    let rows = |b: usize, h: usize| {
        let start = h * head_stride + b * block_rows;
        &bytes[start..start + block_rows]
    };
    (0..blocks)
        .map(|b| {
            // In page-locked block memory where the engine allows it (a restore from RAM
            // then reads the plane where it lies), else ordinary memory.
            if let Some(mut chunk) = PinnedChunk::take(heads * block_rows) {
                for (h, dst) in chunk
                    .as_mut()
                    .chunks_exact_mut(block_rows.max(1))
                    .enumerate()
                {
                    dst.copy_from_slice(rows(b, h));
                }
                return bytes::Bytes::from_owner(chunk);
            }
            let mut out = Vec::with_capacity(heads * block_rows);
            for h in 0..heads {
                out.extend_from_slice(rows(b, h));
            }
            out.into()
        })
        .collect()
}

/// Builds host-byte blocks from the run parts of every layer (`parts[layer][part]`, each
/// `[1, H, n · bs, width]`, evaluated here in one batch), one block per entry of `metas`;
/// a block with an entry in `states` becomes a snapshot block carrying them, and a block
/// that `window` does not keep ([`WindowPlan::keeps`]) leaves its window layers' planes
/// out. A window layer's `parts` may be empty when no block of the run keeps them.
pub(crate) fn blocks_from_run(
    parts: Vec<Vec<Array>>,
    format: KvFormat,
    block_size: usize,
    metas: Vec<BlockMeta>,
    states: Vec<Option<Vec<LayerState>>>,
    window: WindowPlan<'_>,
) -> Result<Vec<Block>, CacheError> {
    let run = Run {
        format,
        block_size,
        metas,
        states,
    };
    read_run(parts, run, window, mlx::direct_transfers())
}

/// What [`blocks_from_run`] builds blocks of, beside the parts.
struct Run {
    format: KvFormat,
    block_size: usize,
    metas: Vec<BlockMeta>,
    states: Vec<Option<Vec<LayerState>>>,
}

/// [`blocks_from_run`], its layers read on rayon's threads when `parallel`.
fn read_run(
    parts: Vec<Vec<Array>>,
    run: Run,
    window: WindowPlan<'_>,
    parallel: bool,
) -> Result<Vec<Block>, CacheError> {
    let Run {
        format,
        block_size,
        metas,
        states,
    } = run;
    let n = metas.len();
    let keeps: Vec<bool> = metas
        .iter()
        .map(|m| {
            let start = m.position as usize * block_size;
            window.keeps(start, start + block_size)
        })
        .collect();
    let all: Vec<&Array> = parts
        .iter()
        .flatten()
        .chain(states.iter().flatten().flatten().flatten())
        .collect();
    mlx::eval(&all)?;
    // Where transfers go through the driver (CUDA), layers are read and split on the
    // transfer pool's threads (each keeps its page-locked scratch): one thread read back
    // ~1.4 GB/s on the H200 under the trace, below what the engine publishes, and every
    // core slowed the engine thread's launches (docs/benchmarks.md, sessions 22 and 35;
    // cache/src/transfer_pool.rs). On the CPU rayon's threads run MLX's kernels: one layer
    // after another there.
    // Either way the planes go to the blocks in layer order.
    let planes_of = |(layer, layer_parts): (usize, Vec<Array>)| {
        layer_planes(layer, layer_parts, format, n, block_size, &keeps, &window)
    };
    let per_layer: Vec<Vec<(usize, Plane)>> = if parallel {
        transfer_pool::run(|| {
            parts
                .into_par_iter()
                .enumerate()
                .map(planes_of)
                .collect::<Result<_, CacheError>>()
        })?
    } else {
        parts
            .into_iter()
            .enumerate()
            .map(planes_of)
            .collect::<Result<_, CacheError>>()?
    };
    assemble_blocks(metas, per_layer, states)
}

/// The blocks of `metas` from their planes, given per layer as (block index, plane) in layer
/// order, and the (evaluated) layer states a snapshot block carries after them.
pub(crate) fn assemble_blocks(
    metas: Vec<BlockMeta>,
    per_layer: Vec<Vec<(usize, Plane)>>,
    states: Vec<Option<Vec<LayerState>>>,
) -> Result<Vec<Block>, CacheError> {
    let mut planes: Vec<Vec<Plane>> = (0..metas.len()).map(|_| Vec::new()).collect();
    for layer in per_layer {
        for (b, plane) in layer {
            planes[b].push(plane);
        }
    }
    for (b, st) in states.into_iter().enumerate() {
        let Some(st) = st else { continue };
        let specs = state_plane_specs(&st)?;
        for (spec, a) in specs.into_iter().zip(st.iter().flatten()) {
            let data = a.to_bytes()?;
            planes[b].push(Plane::new(spec.name, spec.dtype, spec.shape, data));
        }
    }
    Ok(metas
        .into_iter()
        .zip(planes)
        .map(|(meta, planes)| Block { meta, planes })
        .collect())
}

/// The planes layer `layer`'s run parts give, each with the index of its block (blocks a
/// window layer does not keep left out): one read of each part into this thread's scratch,
/// split per block ([`blocks_from_run`]).
fn layer_planes(
    layer: usize,
    layer_parts: Vec<Array>,
    format: KvFormat,
    n: usize,
    block_size: usize,
    keeps: &[bool],
    window: &WindowPlan<'_>,
) -> Result<Vec<(usize, Plane)>, CacheError> {
    let windowed = window.windows.get(layer).is_some_and(Option::is_some);
    if layer_parts.is_empty() {
        if windowed && !keeps.contains(&true) {
            return Ok(Vec::new());
        }
        return Err(CacheError::Publish(format!(
            "layer {layer} was not read for a run whose blocks need it"
        )));
    }
    let mut out = Vec::new();
    for (name, a) in part_names(layer, format).into_iter().zip(&layer_parts) {
        let s = a.shape();
        if s.len() != 4 || s[0] != 1 || s[2] as usize != n * block_size {
            return Err(CacheError::Publish(format!(
                "a run of {n} blocks of {block_size} read as {s:?}"
            )));
        }
        let (heads, width) = (s[1] as usize, s[3] as usize);
        let dtype = to_store_dtype(a.dtype())?;
        let row_bytes = width * dtype.size() as usize;
        let split = with_scratch(a.nbytes(), |bytes| {
            a.read_into(bytes)?;
            Ok::<_, CacheError>(split_run(bytes, heads, n, block_size, row_bytes))
        })?;
        let shape = vec![heads as u64, block_size as u64, width as u64];
        for (b, data) in split.into_iter().enumerate() {
            if windowed && !keeps[b] {
                continue;
            }
            out.push((b, Plane::new(name.clone(), dtype, shape.clone(), data)));
        }
    }
    Ok(out)
}

/// The layer states a snapshot block carries after its `kv_planes` K/V planes, for a cache
/// of `state_layers` state layers: `None` for a block without state planes.
pub(crate) fn block_states(
    block: &Block,
    kv_planes: usize,
    state_layers: usize,
) -> Result<Option<Vec<LayerState>>, String> {
    let extra = block.planes.get(kv_planes..).unwrap_or(&[]);
    if extra.is_empty() {
        return Ok(None);
    }
    let mut states: Vec<LayerState> = vec![Vec::new(); state_layers];
    for plane in extra {
        let (j, p) = plane
            .name
            .strip_prefix("states.")
            .and_then(|r| r.split_once('.'))
            .and_then(|(j, p)| Some((j.parse::<usize>().ok()?, p.parse::<usize>().ok()?)))
            .ok_or_else(|| format!("plane {:?} is neither K/V nor a layer state", plane.name))?;
        match states.get_mut(j) {
            Some(parts) if parts.len() == p => {
                let mut shape = vec![1i32];
                shape.extend(plane.shape.iter().map(|&d| d as i32));
                let a = Array::from_bytes(&plane.data, &shape, to_mlx_dtype(plane.dtype))
                    .map_err(|e| e.to_string())?;
                parts.push(a);
            }
            _ => {
                return Err(format!(
                    "state plane {:?} is out of order or past the {state_layers} state layers",
                    plane.name
                ))
            }
        }
    }
    if let Some(j) = states.iter().position(Vec::is_empty) {
        return Err(format!("the snapshot has no state for state layer {j}"));
    }
    Ok(Some(states))
}

/// How a block's K/V planes sit: all of them, or (window-trimmed) the global layers' only.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct BlockLayout {
    /// The block shape the planes imply.
    pub shape: BlockShape,
    /// Whether the window layers' planes are left out.
    pub trimmed: bool,
    /// How many K/V planes the block has (state planes follow them).
    pub kv_planes: usize,
}

/// The layout of a block's planes under `format` and `block_size`, for a cache of
/// `windows.len()` layers: every layer has the parts the format needs, or (a window-trimmed
/// block, only when some layer has a window) every global layer does, and every plane has
/// the layout [`plane_specs`] gives for the shape; layer states come only after them.
pub(crate) fn block_shape(
    block: &Block,
    windows: &[Option<usize>],
    block_size: usize,
    format: KvFormat,
) -> Result<BlockLayout, String> {
    let layers = windows.len();
    let per = format.parts() * 2;
    let kv_planes = block
        .planes
        .iter()
        .position(|p| p.name.starts_with("states."))
        .unwrap_or(block.planes.len());
    let states_only_after = block.planes[kv_planes..]
        .iter()
        .all(|p| p.name.starts_with("states."));
    let global = windows.iter().filter(|w| w.is_none()).count();
    let trimmed = global < layers && kv_planes == global * per && global > 0;
    if !states_only_after || (kv_planes != layers * per && !trimmed) {
        return Err(format!(
            "it has {} planes, {layers} layers of {format:?} need {} (and layer states only \
             after them)",
            block.planes.len(),
            layers * per
        ));
    }
    if block.meta.tokens.len() != block_size {
        return Err(format!(
            "it holds {} tokens, the cache uses blocks of {block_size}",
            block.meta.tokens.len()
        ));
    }
    let first = &block.planes[0];
    if first.shape.len() != 3 || first.shape[1] as usize != block_size {
        return Err(format!("the first layer's keys are {:?}", first.shape));
    }
    let width = first.shape[2] as usize;
    let (head_dim, dtype) = match format {
        KvFormat::Float => (width, first.dtype),
        KvFormat::Quantized { bits, .. } => (width * 32 / bits as usize, block.planes[1].dtype),
    };
    let shape = BlockShape {
        kv_heads: first.shape[0] as usize,
        block_size,
        head_dim,
        dtype: to_mlx_dtype(dtype),
    };
    let specs = if trimmed {
        trimmed_plane_specs(windows, shape, format)
    } else {
        plane_specs(layers, shape, format)
    }
    .map_err(|e| e.to_string())?;
    for (plane, spec) in block.planes.iter().zip(&specs) {
        if plane.spec() != *spec {
            return Err(format!(
                "plane {} is {:?} {}, expected {:?} {}",
                spec.name, plane.shape, plane.dtype, spec.shape, spec.dtype
            ));
        }
        if Some(plane.data.len() as u64) != spec.byte_len() {
            return Err(format!(
                "plane {} holds {} bytes, its shape needs {:?}",
                spec.name,
                plane.data.len(),
                spec.byte_len()
            ));
        }
    }
    Ok(BlockLayout {
        shape,
        trimmed,
        kv_planes,
    })
}

/// One layer part of a run of blocks to restore: a `[1, H, capacity · bs, width]` array
/// (a pool's arena, see `pool.rs`), the blocks first and zeros after them (`capacity` ≥
/// the number of blocks).
pub(crate) struct RunPart<'a> {
    /// The part's plane layout in every block (checked by [`block_shape`]).
    pub spec: &'a PlaneSpec,
    /// Per block of the run, the index of the part's plane; `None` where the block leaves
    /// it out (a window-trimmed block): those rows are zeros too.
    pub planes: Vec<Option<usize>>,
    /// Blocks the array has room for.
    pub capacity: usize,
}

impl RunPart<'_> {
    /// `(heads, block_size, width, bytes of one head's rows in one block)`.
    pub(crate) fn layout(&self) -> Result<(usize, usize, usize, usize), CacheError> {
        match self.spec.shape[..] {
            [h, b, w] => {
                let (h, b, w) = (h as usize, b as usize, w as usize);
                Ok((h, b, w, b * w * self.spec.dtype.size() as usize))
            }
            _ => Err(CacheError::Shape(format!(
                "plane {} is {:?}, not [heads, block, width]",
                self.spec.name, self.spec.shape
            ))),
        }
    }

    /// Blocks the array has room for (at least the run's).
    pub(crate) fn capacity(&self) -> usize {
        self.capacity.max(self.planes.len())
    }

    /// Bytes of the part assembled with room for `cap` blocks a head.
    pub(crate) fn bytes(&self, cap: usize) -> Result<usize, CacheError> {
        let (heads, _, _, block_rows) = self.layout()?;
        Ok(heads * cap * block_rows)
    }

    /// Writes the part into `host` (exactly [`Self::bytes`]`(cap)` long): per head, each
    /// block's rows, then zeros up to `cap` blocks. Large parts are copied by several
    /// threads at once.
    pub(crate) fn assemble<B: AsRef<Block> + Sync>(
        &self,
        blocks: &[B],
        host: &mut [u8],
        cap: usize,
    ) -> Result<(), CacheError> {
        let (_, _, _, block_rows) = self.layout()?;
        let n = self.planes.len().min(blocks.len());
        // Slot `s` of the buffer is head `s / cap`'s rows of block `s % cap`.
        let fill = |first: usize, chunk: &mut [u8]| {
            for (i, dst) in chunk.chunks_exact_mut(block_rows).enumerate() {
                let (h, b) = ((first + i) / cap, (first + i) % cap);
                match (b < n).then(|| self.planes[b]).flatten() {
                    Some(p) => {
                        let data = &blocks[b].as_ref().planes[p].data;
                        dst.copy_from_slice(&data[h * block_rows..(h + 1) * block_rows]);
                    }
                    // The buffer is reused: rows without a block are cleared.
                    None => dst.fill(0),
                }
            }
        };
        if host.len() < PARALLEL_ASSEMBLY_BYTES || block_rows == 0 {
            fill(0, host);
        } else {
            let slots = host.len() / block_rows;
            transfer_pool::run(|| {
                let per = slots.div_ceil(rayon::current_num_threads().max(1) * 4);
                host.par_chunks_mut(per * block_rows)
                    .enumerate()
                    .for_each(|(c, chunk)| fill(c * per, chunk));
            });
        }
        Ok(())
    }

    /// The array's shape: `[1, heads, capacity · bs, width]`.
    pub(crate) fn shape(&self) -> Result<[i32; 4], CacheError> {
        let (heads, bs, width, _) = self.layout()?;
        Ok([1, heads as i32, (self.capacity() * bs) as i32, width as i32])
    }

    /// The array of the part assembled whole (with its zeros) in `host`.
    fn array(&self, host: &[u8]) -> Result<Array, CacheError> {
        let dtype = to_mlx_dtype(self.spec.dtype);
        Ok(Array::from_bytes(host, &self.shape()?, dtype)?)
    }

    /// The write of the part's blocks, assembled without zeros in `host` (`[heads, n · bs,
    /// width]`), into `dst` (zeros of [`Self::shape`] in device memory): per head, its rows
    /// at the start of the head's room.
    pub(crate) fn rows_write<'a>(
        &self,
        dst: &'a Array,
        host: &'a [u8],
    ) -> Result<RowsWrite<'a>, CacheError> {
        let (heads, _, _, block_rows) = self.layout()?;
        Ok(RowsWrite {
            dst,
            src: host,
            width: self.planes.len() * block_rows,
            height: heads,
            pitch: self.capacity() * block_rows,
        })
    }
}

/// A run of blocks assembled as they arrive, straight into the layer parts' final memory:
/// one [`HostBuffer`] per part, `[1, heads, capacity · bs, width]`, which the part's array
/// takes over (host compute only; see `PagedKvCache::restore_streaming`).
pub(crate) struct RunAssembly {
    /// Per part (plane order of an untrimmed block): its layout and buffer.
    parts: Vec<(PlaneSpec, HostBuffer)>,
    capacity: usize,
}

impl RunAssembly {
    /// Zeroed parts for `capacity` blocks whose planes are `specs` (each
    /// `[heads, block_size, width]`).
    pub fn new(specs: Vec<PlaneSpec>, capacity: usize) -> Result<Self, CacheError> {
        let parts = specs
            .into_iter()
            .map(|spec| {
                let len = spec.byte_len().and_then(|b| usize::try_from(b).ok());
                let bytes = len.and_then(|b| b.checked_mul(capacity)).ok_or_else(|| {
                    CacheError::Shape(format!("plane {} is too large", spec.name))
                })?;
                Ok((spec, HostBuffer::new(bytes)?))
            })
            .collect::<Result<_, CacheError>>()?;
        Ok(Self { parts, capacity })
    }

    /// Copies `block`'s planes (checked against the specs by [`block_shape`]) into slot
    /// `slot` of every part: per head, the block's rows.
    pub fn put(&mut self, slot: usize, block: &Block) -> Result<(), CacheError> {
        if slot >= self.capacity || block.planes.len() < self.parts.len() {
            return Err(CacheError::Shape(format!(
                "block {slot} of {} planes for a run of {} blocks of {} parts",
                block.planes.len(),
                self.capacity,
                self.parts.len()
            )));
        }
        for ((spec, buf), plane) in self.parts.iter_mut().zip(&block.planes) {
            let heads = spec.shape.first().copied().unwrap_or(0) as usize;
            let rows = plane.data.len() / heads.max(1);
            if plane.spec() != *spec || rows * heads != plane.data.len() {
                return Err(CacheError::Shape(format!(
                    "plane {} is {:?} {}, the run's parts are {:?} {}",
                    plane.name, plane.shape, plane.dtype, spec.shape, spec.dtype
                )));
            }
            for (h, src) in plane.data.chunks_exact(rows.max(1)).enumerate() {
                let at = (h * self.capacity + slot) * rows;
                buf[at..at + rows].copy_from_slice(src);
            }
        }
        Ok(())
    }

    /// Every part as an array, in order (the rows of slots no block was put in are zeros).
    pub fn into_arrays(self) -> Result<Vec<Array>, CacheError> {
        let capacity = self.capacity;
        self.parts
            .into_iter()
            .map(|(spec, buf)| {
                let s: Vec<i32> = spec.shape.iter().map(|&d| d as i32).collect();
                let shape = [1, s[0], s[1] * capacity as i32, s[2]];
                Ok(buf.into_array(&shape, to_mlx_dtype(spec.dtype))?)
            })
            .collect()
    }
}

/// Parts from this size on are assembled by several threads (below it, handing the copy
/// out costs more than it saves).
const PARALLEL_ASSEMBLY_BYTES: usize = 4 << 20;

/// Assembles every part of `parts` from the run `blocks` on the host and moves each to the
/// device with one transfer. On CUDA with direct transfers, the parts' arrays are zeros made
/// on the device in one evaluation, and each part's blocks alone cross the bus (a driver copy
/// writes each head's rows at the start of its room): a run that fits one reused,
/// page-locked host buffer is assembled there whole, a part per task, and its copies are
/// queued together; a larger one is pipelined, the calling thread copying part `i` while the
/// thread pool assembles part `i + 1` in the other of two buffers. Elsewhere each part is
/// assembled whole, zeros included: on the CPU straight into the memory its array takes
/// over, on other GPUs in the two buffers, pipelined.
pub(crate) fn upload_run<B: AsRef<Block> + Sync>(
    blocks: &[B],
    parts: &[RunPart<'_>],
) -> Result<Vec<Array>, CacheError> {
    if mlx::default_device()? == mlx::Device::Cpu {
        // No transfer to overlap: each part is assembled straight into the memory its
        // array takes over.
        return parts
            .iter()
            .map(|part| {
                let mut buf = HostBuffer::new(part.bytes(part.capacity())?)?;
                part.assemble(blocks, &mut buf, part.capacity())?;
                Ok(buf.into_array(&part.shape()?, to_mlx_dtype(part.spec.dtype))?)
            })
            .collect();
    }
    if parts.is_empty() {
        return Ok(Vec::new());
    }
    if !mlx::direct_transfers() {
        return pipelined(blocks, parts, None);
    }
    let mut shapes = Vec::with_capacity(parts.len());
    for p in parts {
        shapes.push((p.shape()?, to_mlx_dtype(p.spec.dtype)));
    }
    let shapes: Vec<(&[i32], mlx::Dtype)> =
        shapes.iter().map(|(s, d)| (s.as_slice(), *d)).collect();
    let dsts = mlx::zeroed_on_device(&shapes)?;
    let mut sizes = Vec::with_capacity(parts.len());
    for p in parts {
        sizes.push(p.bytes(p.planes.len())?);
    }
    let total: usize = sizes.iter().sum();
    if total > KEEP_BYTES {
        return pipelined(blocks, parts, Some(dsts));
    }
    let written = with_scratch(total, |buf| {
        let mut hosts = Vec::with_capacity(parts.len());
        let mut rest = buf;
        for &len in &sizes {
            let (part, after) = rest.split_at_mut(len);
            hosts.push(part);
            rest = after;
        }
        transfer_pool::run(|| {
            hosts
                .par_iter_mut()
                .zip(parts)
                .try_for_each(|(host, p)| p.assemble(blocks, host, p.planes.len()))
        })?;
        let writes = parts
            .iter()
            .zip(&hosts)
            .zip(&dsts)
            .map(|((p, host), dst)| p.rows_write(dst, host))
            .collect::<Result<Vec<_>, _>>()?;
        Ok::<_, CacheError>(mlx::write_rows_direct(&writes)?)
    })?;
    match written {
        true => Ok(dsts),
        // No buffer to write into (not seen): the ordinary path.
        false => pipelined(blocks, parts, None),
    }
}

/// [`upload_run`] a part at a time: part `i` is moved (written into its array of `dsts`,
/// or made an array of its own with its zeros) while the thread pool assembles part
/// `i + 1` in the other of two reused host buffers.
fn pipelined<B: AsRef<Block> + Sync>(
    blocks: &[B],
    parts: &[RunPart<'_>],
    dsts: Option<Vec<Array>>,
) -> Result<Vec<Array>, CacheError> {
    // Rows assembled on the host: the blocks alone where they are written into zeros.
    let into_zeros = dsts.is_some();
    let cap = |p: &RunPart<'_>| match into_zeros {
        true => p.planes.len(),
        false => p.capacity(),
    };
    let mut sizes = Vec::with_capacity(parts.len());
    for p in parts {
        sizes.push(p.bytes(cap(p))?);
    }
    let largest = sizes.iter().copied().max().unwrap_or(0);
    let mut dsts = dsts.map(Vec::into_iter);
    with_scratch_pair(largest, |a, b| {
        let mut out = Vec::with_capacity(parts.len());
        let (mut cur, mut next) = (a, b);
        parts[0].assemble(blocks, &mut cur[..sizes[0]], cap(&parts[0]))?;
        for (i, part) in parts.iter().enumerate() {
            let following = parts.get(i + 1).map(|p| (p, sizes[i + 1]));
            let mut assembled = Ok(());
            let moved = transfer_pool::in_place_scope(|s| {
                if let Some((p, len)) = following {
                    let (next, assembled) = (&mut next[..len], &mut assembled);
                    s.spawn(move |_| *assembled = p.assemble(blocks, next, cap(p)));
                }
                let host = &cur[..sizes[i]];
                match dsts.as_mut().and_then(Iterator::next) {
                    Some(dst) => match mlx::write_rows_direct(&[part.rows_write(&dst, host)?])? {
                        true => Ok(dst),
                        false => Err(CacheError::Mlx(mlx::Error::InvalidArgument {
                            op: "restore",
                            message: format!("no buffer to restore part {} into", part.spec.name),
                        })),
                    },
                    None => part.array(host),
                }
            });
            out.push(moved?);
            assembled?;
            std::mem::swap(&mut cur, &mut next);
        }
        Ok(out)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Blocks of two planes `[heads, bs, width]` of f32, every byte from a counter.
    fn counted_blocks(n: usize, heads: usize, bs: usize, width: usize) -> Vec<Block> {
        let bytes = heads * bs * width * 4;
        let mut counter = 0u32;
        (0..n)
            .map(|b| {
                let planes = ["layers.0.k", "layers.0.v"]
                    .iter()
                    .map(|name| {
                        let data: Vec<u8> = (0..bytes)
                            .map(|_| {
                                counter = counter.wrapping_mul(1_103_515_245).wrapping_add(12_345);
                                (counter >> 16) as u8
                            })
                            .collect();
                        let shape = vec![heads as u64, bs as u64, width as u64];
                        Plane::new(*name, store::Dtype::F32, shape, data)
                    })
                    .collect();
                let meta =
                    BlockMeta::new(store::NamespaceId([1; 32]), [0; 32], b as u32, vec![0; bs]);
                Block { meta, planes }
            })
            .collect()
    }

    /// A run of 3 layers × K/V read back with its layers on rayon's threads and one after
    /// another gives the same blocks, each plane the block's rows of every head (against
    /// the host data the parts were made of).
    #[test]
    fn a_run_read_in_parallel_or_in_turn_splits_into_the_same_blocks() {
        let (layers, heads, n, bs, width) = (3usize, 2usize, 4usize, 2usize, 3usize);
        let tokens = n * bs;
        let data = |layer: usize, part: usize| -> Vec<f32> {
            (0..heads * tokens * width)
                .map(|i| (1000 * layer + 100 * part + i) as f32)
                .collect()
        };
        let parts = || -> Vec<Vec<Array>> {
            (0..layers)
                .map(|l| {
                    (0..2)
                        .map(|p| {
                            let shape = [1, heads as i32, tokens as i32, width as i32];
                            Array::from_slice(&data(l, p), &shape).unwrap()
                        })
                        .collect()
                })
                .collect()
        };
        let metas: Vec<BlockMeta> = (0..n)
            .map(|b| BlockMeta::new(store::NamespaceId([1; 32]), [0; 32], b as u32, vec![0; bs]))
            .collect();
        let run = || Run {
            format: KvFormat::Float,
            block_size: bs,
            metas: metas.clone(),
            states: vec![None; n],
        };
        let windows = vec![None; layers];
        let window = || WindowPlan {
            windows: &windows,
            ends: &[],
            floor: 0,
        };
        let parallel = read_run(parts(), run(), window(), true).unwrap();
        let in_turn = read_run(parts(), run(), window(), false).unwrap();
        assert_eq!(parallel, in_turn);
        assert_eq!(parallel.len(), n);
        for (b, block) in parallel.iter().enumerate() {
            assert_eq!(block.planes.len(), 2 * layers);
            for (i, plane) in block.planes.iter().enumerate() {
                let (l, p) = (i / 2, i % 2);
                let all = data(l, p);
                let want: Vec<u8> = (0..heads)
                    .flat_map(|h| {
                        let start = (h * tokens + b * bs) * width;
                        all[start..start + bs * width].to_vec()
                    })
                    .flat_map(f32::to_le_bytes)
                    .collect();
                assert_eq!(&plane.data[..], &want[..], "block {b}, plane {i}");
            }
        }
    }

    /// What a part must hold, written the plain way: per head, each block's rows or zeros.
    fn naive_part(blocks: &[Block], part: &RunPart<'_>) -> Vec<u8> {
        let (heads, _, _, rows) = part.layout().unwrap();
        let mut out = Vec::new();
        for h in 0..heads {
            let cap = part.capacity.max(part.planes.len());
            let planes = part.planes.iter().copied().chain(std::iter::repeat(None));
            for (block, plane) in blocks
                .iter()
                .map(Some)
                .chain(std::iter::repeat(None))
                .zip(planes)
                .take(cap)
            {
                match (block, plane) {
                    (Some(block), Some(p)) => {
                        out.extend_from_slice(&block.planes[p].data[h * rows..(h + 1) * rows])
                    }
                    _ => out.extend(std::iter::repeat_n(0u8, rows)),
                }
            }
        }
        out
    }

    #[test]
    fn a_pipelined_run_holds_each_blocks_rows_per_head_and_zeros_where_none() {
        // 4 heads × 16 tokens × 64 f32 = 4 KiB of rows per head and block: 300 blocks
        // with room for 400 make parts of 6.25 MiB, assembled by several threads.
        let (heads, bs, width) = (4, 16, 64);
        let blocks = counted_blocks(300, heads, bs, width);
        let spec = PlaneSpec::new(
            "layers.0.k",
            store::Dtype::F32,
            vec![heads as u64, bs as u64, width as u64],
        );
        let every = |p: usize| (0..blocks.len()).map(|_| Some(p)).collect::<Vec<_>>();
        let gaps: Vec<Option<usize>> = (0..blocks.len())
            .map(|b| (b % 7 != 3).then_some(1))
            .collect();
        let parts = vec![
            RunPart {
                spec: &spec,
                planes: every(0),
                capacity: 400,
            },
            RunPart {
                spec: &spec,
                planes: gaps,
                capacity: 300,
            },
            RunPart {
                spec: &spec,
                planes: every(1)[..5].to_vec(),
                capacity: 5,
            },
            RunPart {
                spec: &spec,
                planes: every(1),
                capacity: 400,
            },
        ];
        assert!(parts[0].bytes(parts[0].capacity()).unwrap() >= PARALLEL_ASSEMBLY_BYTES);
        // Twice: the second run reuses buffers the first left full of other bytes.
        for _ in 0..2 {
            let arrays = upload_run(&blocks, &parts).unwrap();
            assert_eq!(arrays.len(), parts.len());
            for (a, part) in arrays.iter().zip(&parts) {
                let cap = part.capacity.max(part.planes.len());
                assert_eq!(
                    a.shape(),
                    vec![1, heads as i32, (cap * bs) as i32, width as i32]
                );
                assert!(a.to_bytes().unwrap() == naive_part(&blocks, part));
            }
        }
        assert!(upload_run(&blocks, &[]).unwrap().is_empty());
        // Assembled without zeros (what crosses the bus on CUDA before the rows are written
        // into zeros on the device): the same rows, each head's room cut to the run's blocks.
        for part in &parts {
            let n = part.planes.len();
            let mut dense = vec![0xAAu8; part.bytes(n).unwrap()];
            part.assemble(&blocks, &mut dense, n).unwrap();
            let cut = RunPart {
                spec: part.spec,
                planes: part.planes.clone(),
                capacity: n,
            };
            assert!(dense == naive_part(&blocks, &cut));
        }
    }

    #[test]
    fn a_block_keeps_its_window_planes_only_where_a_continuation_reads_them() {
        // Window 8 over 4-token blocks; a continuation from 24 reads positions 17..23.
        let windows = [None, Some(8)];
        let plan = WindowPlan {
            windows: &windows,
            ends: &[24],
            floor: 0,
        };
        let kept: Vec<bool> = (0..6).map(|b| plan.keeps(b * 4, b * 4 + 4)).collect();
        assert_eq!(kept, [false, false, false, false, true, true]);
        // Position 16 is not read from 24 (24 + 1 - 8 = 17), position 19 is.
        assert!(!plan.keeps(12, 16) && plan.keeps(16, 20));
        // A second end (a prompt's) keeps its own window; blocks after an end are not its.
        let two = WindowPlan {
            ends: &[8, 24],
            ..plan
        };
        let kept: Vec<bool> = (0..6).map(|b| two.keeps(b * 4, b * 4 + 4)).collect();
        assert_eq!(kept, [true, true, false, false, true, true]);
        // Window keys the cache does not hold for real are never published.
        let floor = WindowPlan { floor: 20, ..plan };
        assert!(!floor.keeps(16, 20) && floor.keeps(20, 24));
        // Without window layers every block keeps everything.
        let global = WindowPlan {
            windows: &[None, None],
            ..plan
        };
        assert!(global.keeps(0, 4));
    }

    #[test]
    fn a_continuation_needs_real_window_keys_from_its_window_on() {
        let w = [None, Some(8)];
        assert!(WindowPlan::complete(&w, 0, 3));
        assert!(WindowPlan::complete(&w, 16, 23));
        assert!(!WindowPlan::complete(&w, 16, 22));
        assert!(!WindowPlan::complete(&w, 4, 7));
        assert!(WindowPlan::complete(&[None], 16, 1));
    }

    #[test]
    fn split_run_takes_each_heads_rows_of_each_block() {
        // 2 heads, 3 blocks of 2 rows, 1 byte per row: head h, token t holds 10·h + t.
        let bytes: Vec<u8> = (0..2u8)
            .flat_map(|h| (0..6u8).map(move |t| 10 * h + t))
            .collect();
        let blocks = split_run(&bytes, 2, 3, 2, 1);
        let blocks: Vec<&[u8]> = blocks.iter().map(|b| b.as_ref()).collect();
        assert_eq!(
            blocks,
            [&[0, 1, 10, 11][..], &[2, 3, 12, 13], &[4, 5, 14, 15]]
        );
    }
}
