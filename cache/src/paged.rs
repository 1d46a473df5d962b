//! [`PagedKvCache`]: one sequence's keys and values in fixed-size blocks, per layer, with
//! publication of full blocks as host bytes and restore from them, in bulk.

use mlx::fast::AttentionMask;
use mlx::{Array, Dtype};
use std::sync::Arc;

use store::{Block, BlockMeta};

use crate::block_memory;
use crate::export::{Export, WindowExport};
use crate::export_to_block_memory::BlockMemoryRun;
use crate::host;
use crate::pool::{ladder_capacity, BlockPool, BlockShape};
use crate::share::{LayerPrefix, ShareHandle};
use crate::staged::StagedRestore;
use crate::state::{LayerState, LayerStates, DEFAULT_STATE_HISTORY};
use crate::{CacheError, Chain, KvCache, KvFormat};

/// Settings of a paged cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PagedConfig {
    /// Tokens per block. Default: 32.
    pub block_size: usize,
    /// How K and V are held. Default: [`KvFormat::Float`].
    pub format: KvFormat,
    /// Blocks each layer's pool starts with. Default: 8.
    pub initial_blocks: usize,
    /// Blocks a layer's pool may grow to; beyond it appends fail with
    /// [`CacheError::PoolExhausted`]. Default: 4096.
    pub max_blocks: usize,
}

impl Default for PagedConfig {
    fn default() -> Self {
        Self {
            block_size: 32,
            format: KvFormat::Float,
            initial_blocks: 8,
            max_blocks: 4096,
        }
    }
}

impl PagedConfig {
    /// This config for a cache that will hold `tokens` tokens: its pools start at the step
    /// of the growth ladder from `initial_blocks` that holds them ([`ladder_capacity`]), so
    /// the arenas have their shapes and strides as if grown, without growing through every
    /// step on the way (each growth is a new arena and a copy per layer part: graph nodes on
    /// the thread that runs the model and a copy of everything held so far).
    pub fn with_room_for(self, tokens: usize) -> Self {
        let blocks = tokens.div_ceil(self.block_size.max(1));
        Self {
            initial_blocks: ladder_capacity(
                self.initial_blocks,
                self.max_blocks,
                self.block_size,
                blocks,
            ),
            ..self
        }
    }
}

#[derive(Clone, Debug, Default)]
struct Layer {
    pool: Option<BlockPool>,
    table: Vec<u32>,
    len: usize,
    /// While a batch arena holds this layer's KV ([`PagedKvCache::lend`]): the shape of the
    /// pool it gave up (`pool` is then `None` and `table` empty; `len` counts the tokens
    /// the arena holds for it).
    lent: Option<BlockShape>,
    /// A shared prefix this layer starts with: `len` and the pool then count the tokens
    /// after it (the pool's first block starts where the prefix ends).
    prefix: Option<LayerPrefix>,
}

impl Layer {
    /// Tokens the layer holds: its shared prefix's and its own.
    fn held(&self) -> usize {
        self.prefix.as_ref().map_or(0, |p| p.len) + self.len
    }

    /// Tokens of its shared prefix.
    fn prefix_len(&self) -> usize {
        self.prefix.as_ref().map_or(0, |p| p.len)
    }

    /// Its parts' token runs for the sequence's tokens `a..b`, when they lie in one run of
    /// its pool past any shared prefix (what one node copies or writes out); `None` otherwise.
    fn token_runs(&self, a: usize, b: usize) -> Option<Vec<mlx::copy_runs::TokenRun<'_>>> {
        let m = self.prefix_len();
        self.pool
            .as_ref()
            .filter(|_| a >= m)
            .and_then(|pool| pool.token_runs(&self.table, a - m, b - m))
    }

    /// The block shape of its shared prefix, if it has one.
    fn prefix_shape(&self) -> Option<BlockShape> {
        self.prefix.as_ref().map(|p| p.shape)
    }

    /// The block shape, from its pool, its shared prefix or what it lent.
    fn shape(&self) -> Option<BlockShape> {
        self.pool
            .as_ref()
            .map(|p| p.shape())
            .or(self.prefix.as_ref().map(|p| p.shape))
            .or(self.lent)
    }

    /// Every token's encoded parts (K parts then V parts, `[1, H, held, width]`): a view of
    /// the pool, the shared prefix, or both concatenated. `None` before the first keys.
    fn read(&self) -> Result<Option<Vec<Array>>, CacheError> {
        let own = match &self.pool {
            Some(pool) => Some(pool.read(&self.table, self.len)?),
            None => None,
        };
        Ok(match (&self.prefix, own) {
            (None, own) => own,
            (Some(p), None) => Some(p.parts.clone()),
            (Some(p), Some(_)) if self.len == 0 => Some(p.parts.clone()),
            (Some(p), Some(own)) => Some(
                p.parts
                    .iter()
                    .zip(&own)
                    .map(|(a, b)| mlx::ops::concatenate(&[a, b], 2))
                    .collect::<Result<_, _>>()?,
            ),
        })
    }
}

/// A sequence's KV cache in blocks: per layer, a [`BlockPool`] created lazily from the
/// first keys and values (their shape and dtype), a block table and a length; beside it,
/// for hybrid models, the state of each non-attention layer ([`LayerStates`]).
///
/// `Clone` is cheap and gives an independent cache (shared buffers, copy on write).
#[derive(Clone, Debug)]
pub struct PagedKvCache {
    config: PagedConfig,
    layers: Vec<Layer>,
    published: usize,
    states: LayerStates,
    window: WindowState,
    /// The resident entry a shared prefix of some layer reads from (docs/cache.md,
    /// "Shared prefixes"); held while any layer has one.
    share: Option<ShareHandle>,
}

/// What a cache knows about its sliding-window layers (docs/cache.md, "Window layers").
#[derive(Clone, Debug, Default)]
struct WindowState {
    /// Per layer, its window (`None`: global); empty when the model's layers are unknown,
    /// and then every block is published whole and trimmed blocks are refused.
    windows: Vec<Option<usize>>,
    /// The first position whose window-layer keys are real; before it a restore left
    /// zeros (0: all real).
    floor: usize,
    /// Restorable ends besides the sequence's last full block (a request's prompt end)
    /// whose windows publication keeps.
    ends: Vec<usize>,
    /// The first block this cache may have stored with its window planes (published, or
    /// restored with them) that no trimmed copy has replaced since.
    kept_from: usize,
}

/// The outcome of [`PagedKvCache::restore`].
#[derive(Debug)]
pub struct Restored {
    /// A cache holding the restored blocks; its next append continues after them.
    pub cache: PagedKvCache,
    /// How many of the given blocks it holds (the longest valid prefix).
    pub blocks: usize,
    /// Why restoring stopped before the end, if it did.
    pub stopped: Option<CacheError>,
    /// Valid blocks after the last snapshot block that a hybrid's cache left out (their
    /// tokens are recomputed, which also recomputes the layer states); 0 otherwise.
    pub state_cut: usize,
    /// Valid blocks left out because a continuation after them would read window-layer
    /// keys that a window-trimmed block before them does not carry (their tokens are
    /// recomputed); 0 otherwise.
    pub window_cut: usize,
    /// Whether the run's host half was staged ahead ([`PagedKvCache::restore_staged`]
    /// installed it) rather than assembled here.
    pub staged: bool,
}

/// The state of a cache that a run appended to it is checked and laid out against: a
/// staged run is installed only into a cache still in this state.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct RunBase {
    config: PagedConfig,
    offset: usize,
    held: Vec<usize>,
    pooled: Vec<bool>,
    shape: Option<BlockShape>,
    windows: Vec<Option<usize>>,
    floor: usize,
    state_layers: usize,
}

/// A run of blocks checked against a cache ([`PagedKvCache::plan_run`]).
#[derive(Debug)]
pub(crate) struct RunPlan {
    /// Blocks restored: the longest valid prefix, cut where states or window keys lack.
    pub valid: usize,
    /// Why the blocks after the valid prefix were refused.
    stopped: Option<CacheError>,
    state_cut: usize,
    window_cut: usize,
    /// The blocks' shape (or the cache's, before any block).
    shape: Option<BlockShape>,
    /// A hybrid's layer states at the run's end.
    states: Option<Vec<LayerState>>,
    /// The run's last window-trimmed block.
    last_trimmed: Option<usize>,
    /// Blocks a fresh pool's arrays have room for.
    capacity: usize,
    /// Per restored block, whether it is window-trimmed.
    trimmed: Vec<bool>,
}

impl RunPlan {
    /// The outcome where no block is restored: `cache` unchanged, and why.
    fn nothing(self, cache: PagedKvCache) -> Restored {
        Restored {
            cache,
            blocks: 0,
            stopped: self.stopped,
            state_cut: self.state_cut,
            window_cut: self.window_cut,
            staged: false,
        }
    }
}

impl RunBase {
    /// Per layer its window, every layer global where the cache knows none.
    fn windows_or_global(&self) -> Vec<Option<usize>> {
        match self.windows.is_empty() {
            true => vec![None; self.held.len()],
            false => self.windows.clone(),
        }
    }

    /// Checks `blocks` as the continuation of this cache (chain links, layouts, shapes)
    /// and cuts the run where a hybrid's layer states or a window layer's keys would be
    /// missing: what [`restore_onto`](Self::restore_onto) appends and why it stops.
    fn plan_run<B: AsRef<Block> + Sync>(&self, blocks: &[B]) -> Result<RunPlan, CacheError> {
        let bs = self.config.block_size;
        let offset = self.offset;
        if !offset.is_multiple_of(bs) || self.held.iter().any(|&h| h != offset) {
            return Err(CacheError::Restore {
                position: offset / bs,
                reason: format!("the cache holds {offset} tokens, not whole blocks of {bs}"),
            });
        }
        let first = offset / bs;
        let mut valid = 0;
        let mut stopped = None;
        let mut shape = self.shape;
        // Without known windows every layer is global: trimmed blocks are then refused.
        let windows = self.windows_or_global();
        let mut layouts = Vec::with_capacity(blocks.len());
        for (i, b) in blocks.iter().enumerate() {
            let b = b.as_ref();
            let position = first + i;
            let prev = i.checked_sub(1).map(|p| &blocks[p].as_ref().meta);
            match check_link(b, position, prev)
                .and_then(|()| host::block_shape(b, &windows, bs, self.config.format))
                .and_then(|l| match shape {
                    Some(e) if e != l.shape => Err(format!(
                        "its shape {:?} differs from the blocks before it ({e:?})",
                        l.shape
                    )),
                    _ => Ok(l),
                }) {
                Ok(l) => {
                    shape = Some(l.shape);
                    layouts.push(l);
                    valid += 1;
                }
                Err(reason) => {
                    stopped = Some(CacheError::Restore { position, reason });
                    break;
                }
            }
        }
        // A hybrid resumes only where a block carries its layer states, and a model with
        // window layers only where every key a window still reads is real (not left out by
        // a trimmed block): the run is cut after the last block where both hold; the
        // blocks after it are recomputed.
        let mut states_at: Vec<Option<Vec<LayerState>>> = Vec::with_capacity(valid);
        for (i, b) in blocks[..valid].iter().enumerate() {
            if self.state_layers == 0 {
                states_at.push(None);
                continue;
            }
            match host::block_states(b.as_ref(), layouts[i].kv_planes, self.state_layers) {
                Ok(s) => states_at.push(s),
                Err(reason) => {
                    stopped = Some(CacheError::Restore {
                        position: first + i,
                        reason,
                    });
                    valid = i;
                    break;
                }
            }
        }
        let mut floor = self.floor;
        let (mut keep, mut state_keep) = (0, 0);
        for (i, layout) in layouts[..valid].iter().enumerate() {
            if layout.trimmed {
                floor = (first + i + 1) * bs;
            }
            let snapshot = self.state_layers == 0 || states_at[i].is_some();
            if snapshot {
                state_keep = i + 1;
            }
            if snapshot && host::WindowPlan::complete(&windows, floor, (first + i + 1) * bs) {
                keep = i + 1;
            }
        }
        let state_cut = valid - state_keep;
        let window_cut = valid - keep - state_cut;
        valid = keep;
        let states = valid
            .checked_sub(1)
            .and_then(|i| states_at.swap_remove(i))
            .filter(|_| self.state_layers > 0);
        let capacity = ladder_capacity(
            self.config.initial_blocks,
            self.config.max_blocks,
            self.config.block_size,
            valid,
        );
        let last_trimmed = layouts[..valid].iter().rposition(|l| l.trimmed);
        layouts.truncate(valid);
        Ok(RunPlan {
            valid,
            stopped,
            state_cut,
            window_cut,
            shape,
            states,
            last_trimmed,
            capacity,
            trimmed: layouts.iter().map(|l| l.trimmed).collect(),
        })
    }

    /// Every layer part of a planned run, layer by layer: which plane of each block it
    /// takes (a window-trimmed block leaves a window layer's out) and the blocks its array
    /// has room for (a fresh pool gets the capacity a pool grown to these blocks would have;
    /// on CUDA the zeros after the blocks are made on the device, host.rs; blocks appended
    /// to a pool arrive as arrays of their own size).
    fn run_parts<'a>(
        &self,
        plan: &RunPlan,
        specs: &'a [store::PlaneSpec],
    ) -> Vec<host::RunPart<'a>> {
        if specs.is_empty() {
            return Vec::new();
        }
        let per = self.config.format.parts() * 2;
        let windows = self.windows_or_global();
        let global_rank: Vec<Option<usize>> = windows
            .iter()
            .scan(0, |n, w| {
                let r = w.is_none().then_some(*n);
                *n += usize::from(w.is_none());
                Some(r)
            })
            .collect();
        let mut run_parts = Vec::with_capacity(self.pooled.len() * per);
        for (li, &pooled) in self.pooled.iter().enumerate() {
            for p in 0..per {
                let planes = plan
                    .trimmed
                    .iter()
                    .map(|&trimmed| match (trimmed, global_rank[li]) {
                        (false, _) => Some(li * per + p),
                        (true, Some(r)) => Some(r * per + p),
                        (true, None) => None,
                    })
                    .collect();
                run_parts.push(host::RunPart {
                    spec: &specs[li * per + p],
                    planes,
                    capacity: match pooled {
                        false => plan.capacity,
                        true => plan.valid,
                    },
                });
            }
        }
        run_parts
    }
}

fn seq_shape(op: &str, keys: &Array, values: &Array) -> Result<(usize, usize, usize), CacheError> {
    let (ks, vs) = (keys.shape(), values.shape());
    if ks.len() != 4 || ks[0] != 1 || ks != vs || keys.dtype() != values.dtype() {
        return Err(CacheError::Shape(format!(
            "{op}: keys {ks:?} {} and values {vs:?} {} must both be [1, kv_heads, L, head_dim] of one dtype",
            keys.dtype(),
            values.dtype()
        )));
    }
    if !keys.dtype().is_float() {
        return Err(CacheError::Shape(format!(
            "{op}: keys must be floating point, not {}",
            keys.dtype()
        )));
    }
    Ok((ks[1] as usize, ks[2] as usize, ks[3] as usize))
}

/// Appends encoded parts (each `[1, H, n, width]`) after the `len` tokens of `table`,
/// splitting them along block boundaries. Every block needed is taken before anything is
/// written, and a failed write frees them again: on error the table is unchanged.
fn append_parts(
    pool: &mut BlockPool,
    table: &mut Vec<u32>,
    len: usize,
    bs: usize,
    k_parts: &[Array],
    v_parts: &[Array],
) -> Result<(), CacheError> {
    let count = k_parts.first().map_or(0, |p| p.shape()[2] as usize);
    let needed = (len + count).div_ceil(bs).saturating_sub(table.len());
    let mut fresh = Vec::with_capacity(needed);
    for _ in 0..needed {
        match pool.alloc() {
            Ok(b) => fresh.push(b),
            Err(e) => {
                for b in fresh.into_iter().rev() {
                    pool.free(b);
                }
                return Err(e);
            }
        }
    }
    let table_before = table.len();
    table.extend(fresh);
    let mut written = 0;
    while written < count {
        let pos = len + written;
        let (first, start) = (pos / bs, pos % bs);
        // Blocks with consecutive ids are one run of the arena: one write covers them all
        // (a fresh sequence's blocks are consecutive, so a prefill chunk is one write).
        let mut last = first;
        while (last + 1 - first) * bs - start < count - written
            && table.get(last + 1) == Some(&(table[last] + 1))
        {
            last += 1;
        }
        let block = table[first];
        let n = ((last + 1 - first) * bs - start).min(count - written);
        let cut = |parts: &[Array]| -> Result<Vec<Array>, CacheError> {
            parts
                .iter()
                .map(|p| {
                    let s = p.shape();
                    Ok(p.slice(
                        &[0, 0, written as i32, 0],
                        &[1, s[1], (written + n) as i32, s[3]],
                    )?)
                })
                .collect()
        };
        // The whole input in one write (every decode step): the parts as they are.
        let result = if written == 0 && n == count {
            pool.write(block, start, k_parts, v_parts)
        } else {
            cut(k_parts)
                .and_then(|k| Ok((k, cut(v_parts)?)))
                .and_then(|(k, v)| pool.write(block, start, &k, &v))
        };
        if let Err(e) = result {
            for b in table.drain(table_before..).rev() {
                pool.free(b);
            }
            return Err(e);
        }
        written += n;
    }
    Ok(())
}

/// Fresh copies of positions `a..b` of a layer (encoded parts, `[1, H, b − a, width]`):
/// from its shared prefix (views of a resident entry's arenas, which are never written while
/// shared, and never donated to an in-place write while a view holds them) and its own pool
/// (a copy: `BlockPool::copy_range`), concatenated where the range straddles the prefix's end.
fn copy_positions(l: &Layer, a: usize, b: usize) -> Result<Vec<Array>, CacheError> {
    let m = l.prefix_len();
    let mut pieces: Vec<Vec<Array>> = Vec::with_capacity(2);
    if let Some(p) = l.prefix.as_ref().filter(|_| a < m) {
        pieces.push(p.range(a, b.min(m))?);
    }
    if b > m {
        let pool = l
            .pool
            .as_ref()
            .ok_or_else(|| CacheError::Publish("a layer has no pool".into()))?;
        pieces.push(pool.copy_range(&l.table, a.max(m) - m, b - m)?);
    }
    match pieces.len() {
        2 => Ok(pieces[0]
            .iter()
            .zip(&pieces[1])
            .map(|(x, y)| mlx::ops::concatenate(&[x, y], 2))
            .collect::<Result<_, _>>()?),
        _ => pieces
            .pop()
            .ok_or_else(|| CacheError::Publish(format!("positions {a}..{b} of an empty layer"))),
    }
}

/// Checks that `block` can sit at `position` of a chain, after `prev`. The key's derivation
/// (`blake3(parent ‖ tokens)`) is verified once, by the store, where the bytes enter
/// (`Store::load_prefix`); here only the links between blocks are.
fn check_link(block: &Block, position: usize, prev: Option<&BlockMeta>) -> Result<(), String> {
    let meta = &block.meta;
    if meta.position as usize != position {
        return Err(format!("it is block {} of its chain", meta.position));
    }
    match prev {
        None if position == 0 && meta.parent != *meta.namespace.as_bytes() => {
            Err("the first block's parent is not its namespace".into())
        }
        Some(p) if meta.parent != *p.key.as_bytes() || p.namespace != meta.namespace => {
            Err("its parent is not the block before it".into())
        }
        _ => Ok(()),
    }
}

impl PagedKvCache {
    /// An empty cache for `layers` layers.
    pub fn new(layers: usize, config: PagedConfig) -> Result<Self, CacheError> {
        if config.block_size == 0 || config.max_blocks == 0 {
            return Err(CacheError::Config(
                "block size and maximum blocks must be positive".into(),
            ));
        }
        Ok(Self {
            config,
            layers: vec![Layer::default(); layers],
            published: 0,
            states: LayerStates::default(),
            window: WindowState::default(),
            share: None,
        })
    }

    /// An empty cache for `layers` layers with [`PagedConfig::default`].
    pub fn with_default_config(layers: usize) -> Self {
        Self {
            config: PagedConfig::default(),
            layers: vec![Layer::default(); layers],
            published: 0,
            states: LayerStates::default(),
            window: WindowState::default(),
            share: None,
        }
    }

    /// This empty cache with `layers` state layers (a hybrid model's non-attention
    /// layers), each keeping [`DEFAULT_STATE_HISTORY`] earlier states for trimming.
    pub fn with_state_layers(mut self, layers: usize) -> Self {
        let every = self.states.snapshot_every().unwrap_or(0);
        self.states = LayerStates::new(layers, DEFAULT_STATE_HISTORY).with_snapshots(every);
        self
    }

    /// This cache keeping a snapshot of every state layer each `blocks` blocks (none for
    /// 0), so the device tier can resume it at those points ([`LayerStates`]).
    pub fn with_state_snapshots(mut self, blocks: usize) -> Self {
        let every = blocks * self.config.block_size;
        self.states = std::mem::take(&mut self.states).with_snapshots(every);
        self
    }

    /// This cache knowing each layer's sliding window (`None`: global attention), one entry
    /// per layer: publication then leaves out the window layers' planes of blocks no
    /// continuation can attend to through a window, and restore accepts such blocks.
    pub fn with_windows(mut self, windows: &[Option<usize>]) -> Result<Self, CacheError> {
        if windows.len() != self.layers.len() || windows.contains(&Some(0)) {
            return Err(CacheError::Config(format!(
                "{} windows given for {} layers (a window holds at least one token)",
                windows.len(),
                self.layers.len()
            )));
        }
        self.window.windows = windows.to_vec();
        Ok(self)
    }

    /// The restorable ends (token counts; typically where a request's prompt ends, rounded
    /// down to a block) whose windows the next publications keep besides the sequence's
    /// last full block, so a later request that shares only up to one of them restores it.
    /// Replaces the ends set before.
    pub fn set_restorable_ends(&mut self, ends: &[usize]) {
        self.window.ends = ends.to_vec();
    }

    /// The first position whose window-layer keys are real (0: all): a restore from
    /// window-trimmed blocks leaves zeros before it, which no window mask reads.
    pub fn window_floor(&self) -> usize {
        self.window.floor
    }

    /// Whether a continuation after `len` tokens sees only real window-layer keys.
    fn window_complete(&self, len: usize) -> bool {
        len == 0 || host::WindowPlan::complete(&self.window.windows, self.window.floor, len)
    }

    /// The states of the non-attention layers.
    pub fn states(&self) -> &LayerStates {
        &self.states
    }

    /// The most tokens, at most `max`, this cache can be trimmed back to: `max` for an
    /// attention-only cache, else the latest point where every state layer kept its state;
    /// and 0 where window layers would read keys a restore left out (before
    /// [`Self::window_floor`]).
    pub fn rewind_point(&self, max: usize) -> usize {
        let point = self.states.rewind_point(max.min(self.offset()));
        if self.window_complete(point) {
            point
        } else {
            0
        }
    }

    /// Whether any layer is a sliding-window layer.
    pub fn has_windows(&self) -> bool {
        self.window.windows.iter().any(Option::is_some)
    }

    /// A cache that starts with the first `tokens` tokens of `source` as a read-only
    /// shared prefix: per layer, views of `source`'s arenas (no copy), kept alive and
    /// counted by `handle` (docs/cache.md, "Shared prefixes"). Its own pools hold the tokens
    /// appended after them. Only an attention-only cache without sliding windows, holding
    /// its KV (not lent) and no shared prefix of its own, can be a source.
    pub fn share_prefix(
        source: &PagedKvCache,
        tokens: usize,
        handle: ShareHandle,
    ) -> Result<Self, CacheError> {
        if !source.can_share() || tokens == 0 || tokens > source.offset() {
            return Err(CacheError::Config(format!(
                "cannot share {tokens} tokens of a cache holding {} (sources: attention-only, \
                 no windows, not lent, no shared prefix)",
                source.offset()
            )));
        }
        let mut layers = Vec::with_capacity(source.layers.len());
        for l in &source.layers {
            let pool = l
                .pool
                .as_ref()
                .ok_or_else(|| CacheError::Config("a layer of the source holds no keys".into()))?;
            layers.push(Layer {
                prefix: Some(LayerPrefix {
                    parts: pool.read(&l.table, tokens)?,
                    len: tokens,
                    shape: pool.shape(),
                    _holds: pool.view_token(),
                }),
                ..Layer::default()
            });
        }
        Ok(Self {
            config: source.config,
            layers,
            published: source.published.min(tokens / source.config.block_size),
            states: LayerStates::default(),
            window: WindowState::default(),
            share: Some(handle),
        })
    }

    /// Whether [`Self::share_prefix`] can take a prefix of this cache.
    pub fn can_share(&self) -> bool {
        self.states.layers() == 0
            && !self.has_windows()
            && self.share.is_none()
            && self
                .layers
                .iter()
                .all(|l| l.pool.is_some() && l.lent.is_none())
    }

    /// The resident entry this cache shares a prefix of and the prefix's tokens (the
    /// longest over its layers), if it shares one.
    pub fn shared_prefix(&self) -> Option<(u64, usize)> {
        let share = self.share.as_ref()?;
        let tokens = self.layers.iter().map(Layer::prefix_len).max()?;
        Some((share.entry(), tokens))
    }

    /// The views of a resident entry's arenas that `layer`'s shared prefix reads (K parts
    /// then V parts), if it has one: their buffers are the entry's.
    pub fn prefix_parts(&self, layer: usize) -> Option<&[Array]> {
        Some(&self.layers.get(layer)?.prefix.as_ref()?.parts)
    }

    /// Lets the resident entry go once no layer reads a shared prefix any more.
    fn release_unused_share(&mut self) {
        if self.layers.iter().all(|l| l.prefix.is_none()) {
            self.share = None;
        }
    }

    /// The settings.
    pub fn config(&self) -> &PagedConfig {
        &self.config
    }

    /// Blocks of `block_size` tokens at the front already published.
    pub fn published_blocks(&self) -> usize {
        self.published
    }

    /// The block table of a layer (pool block ids in token order).
    pub fn block_table(&self, layer: usize) -> &[u32] {
        self.layers.get(layer).map_or(&[], |l| &l.table)
    }

    /// The pool of a layer, once its first keys arrived.
    pub fn pool(&self, layer: usize) -> Option<&BlockPool> {
        self.layers.get(layer).and_then(|l| l.pool.as_ref())
    }

    /// Takes a block for one more token of `layer` if its last block is full, as an append
    /// of one token would (the batched decode attention writes the token itself). False
    /// when the layer has no pool yet or is lent: the step then appends as usual.
    pub(crate) fn reserve_decode_token(&mut self, layer: usize) -> Result<bool, CacheError> {
        let bs = self.config.block_size;
        let l = self.layer_mut(layer)?;
        let Some(pool) = l.pool.as_mut() else {
            return Ok(false);
        };
        if l.lent.is_some() {
            return Ok(false);
        }
        if (l.len + 1).div_ceil(bs) > l.table.len() {
            l.table.push(pool.alloc()?);
        }
        Ok(true)
    }

    /// Where the batched decode attention finds `layer` of this row after
    /// [`Self::reserve_decode_token`]: its float arenas, where its own tokens start, how many
    /// it holds and its shared prefix. `None` when the kernel cannot write it in place: a
    /// quantized format, blocks that are not one run of the arena, or arenas whose buffers
    /// another array shares (a clone or a prefix view still alive, or buffers MLX has not
    /// written for this pool: [`crate::pool::BlockPool::writable_in_place`]).
    pub(crate) fn decode_row(&self, layer: usize) -> Option<mlx::rows_attention::RowKv<'_>> {
        let l = self.layers.get(layer)?;
        let pool = l.pool.as_ref()?;
        if !pool.writable_in_place() {
            return None;
        }
        let (keys, values) = pool.float_arenas()?;
        let first = crate::pool::run_start(&l.table)?;
        let prefix = match &l.prefix {
            Some(p) => match p.parts.as_slice() {
                [pk, pv] => Some((pk, pv)),
                _ => return None,
            },
            None => None,
        };
        Some(mlx::rows_attention::RowKv {
            keys,
            values,
            start: first as usize * self.config.block_size,
            len: l.len,
            prefix,
        })
    }

    /// Counts the token the batched decode attention wrote into `layer`.
    pub(crate) fn advance_decode(&mut self, layer: usize) -> Result<(), CacheError> {
        self.layer_mut(layer)?.len += 1;
        Ok(())
    }

    fn layer_mut(&mut self, layer: usize) -> Result<&mut Layer, CacheError> {
        let layers = self.layers.len();
        self.layers
            .get_mut(layer)
            .ok_or(CacheError::NoSuchLayer { layer, layers })
    }

    /// Appends `[1, H, L, D]` keys and values to `layer`, splitting them along block
    /// boundaries. All blocks needed are taken before anything is written: on
    /// [`CacheError::PoolExhausted`] the layer is unchanged.
    pub fn append(&mut self, layer: usize, keys: &Array, values: &Array) -> Result<(), CacheError> {
        let (heads, count, head_dim) = seq_shape("append", keys, values)?;
        let config = self.config;
        let l = self.layer_mut(layer)?;
        if l.lent.is_some() {
            return Err(lent_error(layer));
        }
        if l.pool.is_none() {
            let shape = BlockShape {
                kv_heads: heads,
                block_size: config.block_size,
                head_dim,
                dtype: keys.dtype(),
            };
            l.pool = Some(BlockPool::new(
                shape,
                config.format,
                config.initial_blocks,
                config.max_blocks,
            )?);
        }
        let Some(pool) = l.pool.as_mut() else {
            return Err(CacheError::Config("pool missing after creation".into()));
        };
        let shape = pool.shape();
        if (shape.kv_heads, shape.head_dim, shape.dtype) != (heads, head_dim, keys.dtype()) {
            return Err(CacheError::Shape(format!(
                "layer {layer} holds {} heads × {} dims of {}; got {heads} × {head_dim} of {}",
                shape.kv_heads,
                shape.head_dim,
                shape.dtype,
                keys.dtype()
            )));
        }
        if count == 0 {
            return Ok(());
        }
        let k_parts = config.format.encode(keys)?;
        let v_parts = config.format.encode(values)?;
        append_parts(
            pool,
            &mut l.table,
            l.len,
            config.block_size,
            &k_parts,
            &v_parts,
        )?;
        l.len += count;
        Ok(())
    }

    /// Whether `layer` can take a chunk of `queries` padded ([`Self::attend_padded`]): float
    /// KV in blocks of its own (no shared prefix, none lent) and two queries or more.
    fn paddable(&self, layer: usize, queries: &Array) -> bool {
        let own = self
            .layers
            .get(layer)
            .is_some_and(|l| l.prefix.is_none() && l.lent.is_none());
        self.config.format == KvFormat::Float
            && own
            && queries.shape().get(2).is_some_and(|&l| l >= 2)
    }

    /// A causal prefill chunk of a float layer without a shared prefix, attended with its
    /// queries and keys padded to a few shapes (mlx::padded_attention: MLX's CUDA backend
    /// then reuses its cuDNN graphs); the keys past the chunk are read from the arena, never
    /// written. Appends the chunk's keys and values; `None` (nothing appended) where the layer
    /// is not such a layer.
    fn attend_padded(
        &mut self,
        layer: usize,
        queries: &Array,
        keys: &Array,
        values: &Array,
        scale: f32,
    ) -> Result<Option<Array>, CacheError> {
        if !self.paddable(layer, queries) {
            return Ok(None);
        }
        self.append(layer, keys, values)?;
        let l = &self.layers[layer];
        if let Some(pool) = &l.pool {
            if let Some(room) = pool.read_room(&l.table)? {
                if let [k, v] = room.as_slice() {
                    let held = l.len as i32;
                    if let Some(out) =
                        mlx::padded_attention::causal_attention_padded(queries, k, v, held, scale)?
                    {
                        crate::prefill_paths::count_prefill_attention(true);
                        return Ok(Some(out));
                    }
                }
            }
        }
        // Nothing to pad here (blocks out of order, keys past the room): what the layer holds.
        crate::prefill_paths::count_prefill_attention(false);
        let (k, v) = self.fetch(layer)?.ok_or_else(|| {
            CacheError::Config(format!("layer {layer} has no pool after an append"))
        })?;
        Ok(Some(mlx::fast::scaled_dot_product_attention(
            queries,
            &k,
            &v,
            scale,
            AttentionMask::Causal,
        )?))
    }

    /// Every key and value `layer` holds, as contiguous float `[1, H, len, D]` arrays
    /// (gathered from the blocks and dequantized). `None` before the layer's first append.
    pub fn fetch(&self, layer: usize) -> Result<Option<(Array, Array)>, CacheError> {
        let layers = self.layers.len();
        let l = self
            .layers
            .get(layer)
            .ok_or(CacheError::NoSuchLayer { layer, layers })?;
        if l.lent.is_some() {
            return Err(lent_error(layer));
        }
        let Some(shape) = l.shape() else {
            return Ok(None);
        };
        if l.held() == 0 {
            let s = shape;
            let empty = mlx::ops::zeros(&[1, s.kv_heads as i32, 0, s.head_dim as i32], s.dtype)?;
            return Ok(Some((empty.clone(), empty)));
        }
        let Some(seq) = l.read()? else {
            return Ok(None);
        };
        let per = self.config.format.parts();
        let k = self.config.format.decode(&seq[..per])?;
        let v = self.config.format.decode(&seq[per..])?;
        Ok(Some((k, v)))
    }

    /// An independent cache holding this one's first `tokens` tokens (a fork of a resident
    /// sequence): each global layer's own blocks are copied once into a pool sized for
    /// them (`BlockPool::compact`), so the fork neither keeps nor, at its first write,
    /// copies the whole capacity of a longer sequence's arenas. Window layers and shared
    /// prefixes stay copy-on-write clones (a window bounds them; a prefix is read, never
    /// written).
    ///
    /// `initial_blocks`: the fork's own [`PagedConfig::initial_blocks`], a step of the same
    /// growth ladder: with room for the prompt it was forked for
    /// ([`PagedConfig::with_room_for`] on the engine's configuration), its pools need not
    /// grow during the prefill after it (growing copies every arena); this cache's own
    /// value keeps the room of the prompt it was made for, which may be far longer.
    pub fn fork(&self, tokens: usize, initial_blocks: usize) -> Result<PagedKvCache, CacheError> {
        let mut c = self.clone();
        c.trim(self.offset().saturating_sub(tokens))?;
        c.config.initial_blocks = initial_blocks;
        let initial = c.config.initial_blocks;
        for (i, l) in c.layers.iter_mut().enumerate() {
            let windowed = c.window.windows.get(i).is_some_and(Option::is_some);
            if windowed || l.prefix.is_some() || l.lent.is_some() {
                continue;
            }
            if let Some(pool) = &l.pool {
                l.pool = Some(pool.compact(&l.table, initial)?);
                l.table = (0..l.table.len() as u32).collect();
            }
        }
        Ok(c)
    }

    /// Makes room for `tokens` tokens in all (its shared prefix included) before they are
    /// appended: each layer's pool grows at once to the capacity that holds them (one copy
    /// per part, where appending chunk by chunk would grow it ×1.5 at a time, copying at
    /// each step), and layers without a pool yet get one that size. Window layers are left
    /// alone (a window bounds them). A cache handed over from the device tier with the
    /// capacity of an earlier, shorter prompt is what this is for.
    pub fn reserve_room(&mut self, tokens: usize) -> Result<(), CacheError> {
        self.check_not_lent()?;
        self.config = self.config.with_room_for(tokens);
        let bs = self.config.block_size;
        for (i, l) in self.layers.iter_mut().enumerate() {
            if self.window.windows.get(i).is_some_and(Option::is_some) {
                continue;
            }
            let own = tokens.saturating_sub(l.prefix_len());
            if let Some(pool) = l.pool.as_mut() {
                pool.reserve(own.div_ceil(bs))?;
            }
        }
        Ok(())
    }

    /// Drops the last `tokens` tokens of every layer and frees blocks no longer needed.
    /// Published blocks are not affected (they own their buffers). State layers go back to
    /// the state they kept there; where one kept none, the trim is refused with
    /// [`CacheError::Rewind`] and nothing changes (see [`PagedKvCache::rewind_point`]). A
    /// trim to where a window would read keys a restore left out (before
    /// [`Self::window_floor`]) is refused with [`CacheError::WindowRewind`], likewise.
    pub fn trim(&mut self, tokens: usize) -> Result<usize, CacheError> {
        self.check_not_lent()?;
        let held = self.offset();
        if !self.window_complete(held.saturating_sub(tokens)) {
            return Err(CacheError::WindowRewind {
                tokens,
                held,
                floor: self.window.floor,
                window: self
                    .window
                    .windows
                    .iter()
                    .flatten()
                    .copied()
                    .max()
                    .unwrap_or(0),
            });
        }
        self.states.rewind(tokens)?;
        let bs = self.config.block_size;
        let mut trimmed = 0;
        for l in &mut self.layers {
            let n = tokens.min(l.held());
            trimmed = trimmed.max(n);
            // Past its own tokens, a layer cuts its shared prefix (a shorter view; its own
            // pool is then empty and starts where the cut prefix ends).
            let into_prefix = n.saturating_sub(l.len);
            l.len -= n - into_prefix;
            if let Some(p) = l.prefix.as_ref().filter(|_| into_prefix > 0) {
                let left = p.len - into_prefix;
                l.prefix = (left > 0).then(|| p.cut(left)).transpose()?;
            }
            let keep = l.len.div_ceil(bs);
            if let Some(pool) = l.pool.as_mut() {
                for b in l.table.drain(keep..).rev() {
                    pool.free(b);
                }
            }
        }
        self.release_unused_share();
        self.published = self.published.min(self.offset() / bs);
        self.window.kept_from = self.window.kept_from.min(self.published);
        if self.offset() == 0 {
            self.window.floor = 0;
        }
        Ok(trimmed)
    }

    /// Bytes the cache would take for `tokens` tokens (whole blocks, all layers), once the
    /// first keys fixed the block shape; `None` before.
    pub fn projected_bytes(&self, tokens: usize) -> Option<usize> {
        let blocks = tokens.div_ceil(self.config.block_size);
        let format = self.config.format;
        let per_block: usize = self
            .layers
            .iter()
            .map(|l| match (&l.pool, l.lent.or(l.prefix_shape())) {
                (Some(p), _) => Some(p.block_bytes()),
                (None, Some(s)) => Some(
                    2 * s.kv_heads
                        * s.block_size
                        * format.bytes_per_head_token(s.head_dim, s.dtype.size()),
                ),
                (None, None) => None,
            })
            .sum::<Option<usize>>()?;
        Some(blocks * per_block)
    }

    /// The cache's state as named planes: per layer, every token it holds
    /// (`layers.{i}.k`, `layers.{i}.v`, plus `_scales`/`_biases` when quantized), each
    /// `[1, H, len, width]` in the storage format.
    pub fn state(&self) -> Result<Vec<(String, Array)>, CacheError> {
        self.check_not_lent()?;
        let suffixes = self.config.format.part_suffixes();
        let mut out = Vec::new();
        for (i, l) in self.layers.iter().enumerate() {
            let Some(parts) = l.read()? else { continue };
            for (j, p) in parts.into_iter().enumerate() {
                let kv = if j < suffixes.len() { "k" } else { "v" };
                out.push((
                    format!("layers.{i}.{kv}{}", suffixes[j % suffixes.len()]),
                    p,
                ));
            }
        }
        Ok(out)
    }

    /// Publishes the full blocks not yet published, as host-byte blocks of `chain`'s
    /// namespace, and extends `chain` with their keys: [`Self::export`], then
    /// [`Export::into_blocks`] on this thread.
    ///
    /// `tokens` are the token ids the cache holds (`tokens.len() == offset()`). The new
    /// blocks are read from the device in one transfer per layer part and split on the
    /// host; the partial last block stays private.
    pub fn publish(&mut self, chain: &mut Chain, tokens: &[u32]) -> Result<Vec<Block>, CacheError> {
        match self.export(chain, tokens)? {
            Some(export) => export.into_blocks(),
            None => Ok(Vec::new()),
        }
    }

    /// The device half of [`Self::publish`]: marks the full blocks not yet published as
    /// published, extends `chain`, and returns device copies of them, already computing,
    /// for [`Export::into_blocks`] to finish on another thread (crate::export). `None`
    /// when no block is new.
    pub fn export(
        &mut self,
        chain: &mut Chain,
        tokens: &[u32],
    ) -> Result<Option<Export>, CacheError> {
        self.check_not_lent()?;
        let offset = self.offset();
        if tokens.len() != offset {
            return Err(CacheError::Publish(format!(
                "{} token ids given for a cache holding {offset} tokens",
                tokens.len()
            )));
        }
        if self.layers.iter().any(|l| l.held() != offset) {
            return Err(CacheError::Publish(
                "layers hold different token counts (a forward step is half done)".into(),
            ));
        }
        let bs = self.config.block_size;
        if chain.block_size() != bs {
            return Err(CacheError::Publish(format!(
                "a chain of {}-token blocks for a cache of {bs}-token blocks",
                chain.block_size()
            )));
        }
        chain.extend(tokens);
        let full = offset / bs;
        if full <= self.published {
            return Ok(None);
        }
        let (from, n) = (self.published, full - self.published);
        let ends = self.window_ends(full * bs);
        let plan = self.window_plan(&ends);
        let keeps: Vec<bool> = (from..full)
            .map(|p| plan.keeps(p * bs, (p + 1) * bs))
            .collect();
        // Straight into block memory where it has room for the whole run (and no layer
        // keeps a window, whose planes some blocks leave out); else device copies that the
        // export thread reads back and splits.
        let written = if keeps.iter().all(|&k| k)
            && block_memory::allowed()
            && crate::export_to_block_memory::publish_in_place()
        {
            self.write_run_to_block_memory(from, full)?
        } else {
            None
        };
        let parts = match written {
            Some(_) => Vec::new(),
            None => self.copy_run(from, full, keeps.contains(&true))?,
        };
        let metas = (from..full)
            .map(|p| chain.meta(p, &tokens[p * bs..(p + 1) * bs]))
            .collect();
        // A hybrid's block whose end is a snapshot point carries the layer states there.
        let states: Vec<Option<Vec<LayerState>>> = (from..full)
            .map(|p| {
                let at = (p + 1) * bs;
                (self.states.layers() > 0)
                    .then(|| {
                        (0..self.states.layers())
                            .map(|j| self.states.state_at(j, at).cloned())
                            .collect::<Option<Vec<_>>>()
                    })
                    .flatten()
            })
            .collect();
        // The states are shared with this cache's history: computed now, so the export
        // thread only reads them. The copies are the export's own: computed in the
        // background (crossing 4 at `unsafe impl Send for Array`).
        let shared: Vec<&Array> = states.iter().flatten().flatten().flatten().collect();
        if !shared.is_empty() {
            mlx::eval(&shared)?;
        }
        let copies: Vec<&Array> = parts
            .iter()
            .flatten()
            .chain(written.as_ref().map(BlockMemoryRun::done))
            .collect();
        mlx::async_eval(&copies)?;
        if self.window.kept_from >= from {
            self.window.kept_from = from + keeps.iter().position(|&k| k).unwrap_or(n);
        }
        self.published = full;
        Ok(Some(Export {
            parts,
            format: self.config.format,
            block_size: bs,
            metas,
            states,
            window: self.window_export(ends),
            replaces: false,
            written,
        }))
    }

    fn window_export(&self, ends: Vec<usize>) -> Box<WindowExport> {
        Box::new(WindowExport {
            windows: self.window.windows.clone(),
            ends,
            floor: self.window.floor,
        })
    }

    /// The restorable ends publication keeps windows for: the ends set by
    /// [`Self::set_restorable_ends`] and `last` (the sequence's last full block), each with
    /// the block boundary before it too (a prompt resent whole restores up to its last
    /// full block short of its last token, which may be one block less).
    fn window_ends(&self, last: usize) -> Vec<usize> {
        let bs = self.config.block_size;
        self.window
            .ends
            .iter()
            .chain([&last])
            .flat_map(|&e| [e, e.saturating_sub(bs)])
            .collect()
    }

    /// Makes the next publication publish again the blocks a continuation from `end`
    /// reads through a window (those the cache holds real window keys for), so that
    /// stored copies of them that are window-trimmed are replaced by whole ones: a
    /// request resumed at `end`, which makes it a point worth restoring from. Nothing
    /// happens (and `false` is returned) when this cache stored those blocks whole itself.
    /// Add `end` to [`Self::set_restorable_ends`] when it returns `true`, or the blocks are
    /// published trimmed again.
    pub fn republish_window(&mut self, end: usize) -> bool {
        let Some(w) = self.window_plan(&[]).widest() else {
            return false;
        };
        let bs = self.config.block_size;
        let e = end.min(self.offset()) / bs * bs;
        let first = ((e + 1).saturating_sub(w + bs) / bs).max(self.window.floor.div_ceil(bs));
        // Blocks `kept_from..published` were stored whole by this cache (as far as it
        // knows: a block between two restorable ends' windows may be trimmed; a fork there
        // then recomputes once more).
        if first >= self.window.kept_from && e / bs <= self.published {
            return false;
        }
        self.published = self.published.min(first);
        self.window.kept_from = self.window.kept_from.min(self.published);
        true
    }
    fn window_plan<'a>(&'a self, ends: &'a [usize]) -> host::WindowPlan<'a> {
        host::WindowPlan {
            windows: &self.window.windows,
            ends,
            floor: self.window.floor,
        }
    }

    /// The planes of blocks `from..to` written by the device straight into block memory
    /// (one node: [`BlockMemoryRun`]), where every layer holds them as runs of its pool's
    /// blocks and block memory has room; `None` otherwise (nothing queued). Only for a
    /// cache without window layers (every plane of every block is written).
    fn write_run_to_block_memory(
        &self,
        from: usize,
        to: usize,
    ) -> Result<Option<BlockMemoryRun>, CacheError> {
        if self.window.windows.iter().any(Option::is_some) {
            return Ok(None);
        }
        let bs = self.config.block_size;
        let (a, b) = (from * bs, to * bs);
        let Some(layers) = self
            .layers
            .iter()
            .map(|l| l.token_runs(a, b))
            .collect::<Option<Vec<_>>>()
        else {
            return Ok(None);
        };
        BlockMemoryRun::write(&layers, self.config.format, to - from, bs)
    }

    /// Device copies of every layer's parts of blocks `from..to` (`[1, H, n · bs, width]`
    /// each, not yet computed); window layers' only when `windows` (else an empty list).
    /// The layers whose blocks lie in one run of their pool (all of them, unless a shared
    /// prefix or a fork's table splits the range) are copied by one node together
    /// ([`mlx::copy_runs::copy_token_runs`]): a publication costs the engine thread one
    /// node instead of one per layer part.
    fn copy_run(
        &self,
        from: usize,
        to: usize,
        windows: bool,
    ) -> Result<Vec<Vec<Array>>, CacheError> {
        let bs = self.config.block_size;
        let (a, b) = (from * bs, to * bs);
        // Per layer: its copies, or how many of `runs` are its parts.
        let mut layers: Vec<Result<Vec<Array>, usize>> = Vec::with_capacity(self.layers.len());
        let mut runs = Vec::new();
        for (i, l) in self.layers.iter().enumerate() {
            if !windows && self.window.windows.get(i).is_some_and(Option::is_some) {
                layers.push(Ok(Vec::new()));
                continue;
            }
            match l.token_runs(a, b) {
                Some(r) => {
                    layers.push(Err(r.len()));
                    runs.extend(r);
                }
                None => layers.push(Ok(copy_positions(l, a, b)?)),
            }
        }
        let mut copies = mlx::copy_runs::copy_token_runs(&runs)?.into_iter();
        Ok(layers
            .into_iter()
            .map(|l| l.unwrap_or_else(|n| copies.by_ref().take(n).collect()))
            .collect())
    }

    /// Window-trimmed copies of the blocks this cache stored earlier with their window
    /// planes (published, or restored with them) that no restorable end reads any more
    /// because the sequence moved on by more than a window, as an [`Export`] that
    /// [`Export::replaces`] them: inserted under their keys in place of the stored blocks
    /// ([`store::Store::insert_replacing`]), they free the window layers' bytes there. Call
    /// it after [`Self::export`] (or [`Self::publish`]) with the same `chain` and `tokens`.
    /// `None` for a cache without window layers or with state layers (whose snapshot
    /// planes the copies would lack), or when there is nothing to trim.
    pub fn window_trimmed(
        &mut self,
        chain: &Chain,
        tokens: &[u32],
    ) -> Result<Option<Export>, CacheError> {
        self.check_not_lent()?;
        let bs = self.config.block_size;
        let upto = self.published;
        let from = self.window.kept_from.max(self.window.floor.div_ceil(bs));
        let ends = self.window_ends(upto * bs);
        let plan = self.window_plan(&ends);
        if from >= upto || plan.widest().is_none() || self.states.layers() > 0 {
            return Ok(None);
        }
        let to = (from..upto)
            .find(|&p| plan.keeps(p * bs, (p + 1) * bs))
            .unwrap_or(upto);
        if to == from {
            return Ok(None);
        }
        if tokens.len() < to * bs || chain.keys().len() < to {
            return Err(CacheError::Publish(format!(
                "{} token ids and {} chain keys for blocks up to {to}",
                tokens.len(),
                chain.keys().len()
            )));
        }
        let parts = self.copy_run(from, to, false)?;
        let copies: Vec<&Array> = parts.iter().flatten().collect();
        mlx::async_eval(&copies)?;
        let metas = (from..to)
            .map(|p| chain.meta(p, &tokens[p * bs..(p + 1) * bs]))
            .collect();
        self.window.kept_from = to;
        Ok(Some(Export {
            parts,
            format: self.config.format,
            block_size: bs,
            metas,
            states: vec![None; to - from],
            window: self.window_export(ends),
            replaces: true,
            written: None,
        }))
    }

    /// Builds a cache holding `blocks` (positions 0, 1, … of one chain) whose next append
    /// continues after them. Blocks are checked before the cache sees them: the cache
    /// holds the longest valid prefix and `stopped` says why the rest was refused.
    pub fn restore<B: AsRef<Block> + Sync>(
        layers: usize,
        config: PagedConfig,
        blocks: &[B],
    ) -> Result<Restored, CacheError> {
        PagedKvCache::new(layers, config)?.restore_onto(blocks)
    }

    /// Appends `blocks` (the blocks of this cache's chain from position `offset() /
    /// block_size` on; the cache must end on a block boundary) in bulk: each layer part is
    /// assembled on the host and moved to the device in one transfer. Blocks are checked
    /// first; the longest valid prefix is appended and `stopped` says why the rest was not.
    pub fn restore_onto<B: AsRef<Block> + Sync>(
        self,
        blocks: &[B],
    ) -> Result<Restored, CacheError> {
        let base = self.run_base();
        let plan = base.plan_run(blocks)?;
        let Some(shape) = plan.shape.filter(|_| plan.valid > 0) else {
            return Ok(plan.nothing(self));
        };
        let specs = host::plane_specs(self.layers.len(), shape, self.config.format)?;
        let run_parts = base.run_parts(&plan, &specs);
        let uploaded = host::upload_run(&blocks[..plan.valid], &run_parts)?;
        self.install_planned(uploaded, shape, plan, false)
    }

    /// Installs the arrays of a planned run ([`Self::install_run`]) and says what was
    /// restored (`staged`: whether its host half was done ahead).
    fn install_planned(
        mut self,
        uploaded: Vec<Array>,
        shape: BlockShape,
        plan: RunPlan,
        staged: bool,
    ) -> Result<Restored, CacheError> {
        self.install_run(
            uploaded,
            shape,
            plan.valid,
            plan.capacity,
            plan.states,
            plan.last_trimmed,
        )?;
        Ok(Restored {
            cache: self,
            blocks: plan.valid,
            stopped: plan.stopped,
            state_cut: plan.state_cut,
            window_cut: plan.window_cut,
            staged,
        })
    }

    /// The host half of [`restore_onto`](Self::restore_onto), done ahead on any thread:
    /// `blocks` checked against this cache's state and every layer part assembled on the
    /// host, ready for [`restore_staged`](Self::restore_staged) to install (an engine's
    /// I/O worker stages a load this way while its request waits for admission, so the
    /// engine thread only moves the bytes). No MLX operation runs (host memory comes from
    /// MLX's allocator or the driver). `None` for a cache with layer states (a hybrid): its
    /// states become arrays while checked, so it restores the ordinary way; `None` too on
    /// CUDA for a run of more than 256 MiB, which the ordinary way moves faster (a pipeline
    /// of two reused page-locked buffers; docs/cache.md, "Staged restore").
    pub fn stage_restore<B: AsRef<Block> + Sync>(
        &self,
        blocks: &[B],
    ) -> Result<Option<StagedRestore>, CacheError> {
        self.stage_on(self.run_base(), blocks)
    }

    /// [`stage_restore`](Self::stage_restore) against the state this (empty) cache's
    /// model has after a device-tier hit of `hit_tokens` tokens (a whole number of
    /// blocks): every layer holding them in a pool of its own, as a hit handed over or
    /// forked is once cut back to its last whole block. `blocks` continue the chain there.
    /// A hit that arrives in another form (a shared prefix, another length) does not match
    /// it, and [`restore_staged`](Self::restore_staged) restores the ordinary way.
    pub fn stage_restore_after<B: AsRef<Block> + Sync>(
        &self,
        hit_tokens: usize,
        blocks: &[B],
    ) -> Result<Option<StagedRestore>, CacheError> {
        let mut base = self.run_base();
        if hit_tokens > 0 {
            let layers = base.held.len();
            let windows = base.windows_or_global();
            let (bs, format) = (self.config.block_size, self.config.format);
            base.offset = hit_tokens;
            base.held = vec![hit_tokens; layers];
            base.pooled = vec![true; layers];
            base.shape = blocks
                .first()
                .and_then(|b| host::block_shape(b.as_ref(), &windows, bs, format).ok())
                .map(|l| l.shape);
        }
        self.stage_on(base, blocks)
    }

    /// Stages `blocks` against `base` (see [`stage_restore`](Self::stage_restore)).
    fn stage_on<B: AsRef<Block> + Sync>(
        &self,
        base: RunBase,
        blocks: &[B],
    ) -> Result<Option<StagedRestore>, CacheError> {
        if base.state_layers > 0 {
            return Ok(None);
        }
        let t = std::time::Instant::now();
        let plan = base.plan_run(blocks)?;
        let specs = match plan.shape.filter(|_| plan.valid > 0) {
            Some(shape) => host::plane_specs(base.held.len(), shape, self.config.format)?,
            None => Vec::new(),
        };
        let run_parts = base.run_parts(&plan, &specs);
        let checked = t.elapsed().as_secs_f64();
        let valid = plan.valid;
        StagedRestore::assemble(base, plan, &blocks[..valid], &run_parts, checked)
    }

    /// Installs a restore staged by [`stage_restore`](Self::stage_restore): the parts
    /// move to the device (the arrays take the host memory over on the CPU; one driver copy
    /// per part on CUDA) and the cache holds the run, as [`restore_onto`](Self::restore_onto)
    /// of the same `blocks` would. Where the cache is no longer in the state the run was
    /// staged against (a device-tier hit arrived meanwhile, another layout), or the driver
    /// cannot write the parts, `blocks` (those staged) are restored by `restore_onto`;
    /// [`Restored::staged`] says which happened.
    pub fn restore_staged<B: AsRef<Block> + Sync>(
        self,
        mut staged: StagedRestore,
        blocks: &[B],
    ) -> Result<Restored, CacheError> {
        if staged.base != self.run_base() || blocks.len() < staged.plan.valid {
            return self.restore_onto(blocks);
        }
        let Some(shape) = staged.plan.shape.filter(|_| staged.plan.valid > 0) else {
            let mut restored = staged.plan.nothing(self);
            restored.staged = true;
            return Ok(restored);
        };
        let Some(uploaded) = staged.upload()? else {
            return self.restore_onto(blocks);
        };
        self.install_planned(uploaded, shape, staged.plan, true)
    }

    /// What a run appended to this cache is checked and laid out against.
    fn run_base(&self) -> RunBase {
        RunBase {
            config: self.config,
            offset: self.offset(),
            held: self.layers.iter().map(Layer::held).collect(),
            pooled: self.layers.iter().map(|l| l.pool.is_some()).collect(),
            shape: self
                .layers
                .iter()
                .find_map(|l| l.pool.as_ref().map(|p| p.shape()).or(l.prefix_shape())),
            windows: self.window.windows.clone(),
            floor: self.window.floor,
            state_layers: self.states.layers(),
        }
    }

    /// [`restore_onto`](Self::restore_onto) fed block by block: `feed` is called once with
    /// a function that takes the blocks of the run in chain order, as a store load hands
    /// them over ([`store::Store::load_prefix_each`]), so the run is assembled while the
    /// later blocks are still being read instead of after the load. `expected` is how many
    /// blocks the feed may bring (it sizes the arenas).
    ///
    /// The outcome is the one `restore_onto` gives for the blocks fed. Where the cache
    /// computes on the host and starts empty, without layer states or window layers, each
    /// block is checked as it arrives and copied at once into the layer arenas (memory the
    /// arrays then take over, no further copy); a block refused stops the run there, and
    /// the later blocks are ignored. Otherwise (a GPU, a cache that already holds tokens, a
    /// hybrid or windowed model, or a run cut short to a smaller arena) the blocks are kept
    /// and restored by `restore_onto` once the feed returns.
    pub fn restore_streaming<F>(self, expected: usize, feed: F) -> Result<Restored, CacheError>
    where
        F: FnOnce(&mut dyn FnMut(&Arc<Block>)),
    {
        let layers = self.layers.len();
        let PagedConfig {
            block_size: bs,
            format,
            initial_blocks,
            max_blocks,
        } = self.config;
        let direct = mlx::default_device()? == mlx::Device::Cpu
            && self.states.layers() == 0
            && self.window.windows.iter().all(Option::is_none)
            && self
                .layers
                .iter()
                .all(|l| l.held() == 0 && l.shape().is_none());
        let capacity = ladder_capacity(initial_blocks, max_blocks, bs, expected);
        let globals = vec![None; layers];
        let mut blocks: Vec<Arc<Block>> = Vec::with_capacity(expected);
        let mut refused = None;
        let mut shape = None;
        let mut assembly: Option<Result<host::RunAssembly, CacheError>> = None;
        feed(&mut |block: &Arc<Block>| {
            if !direct {
                blocks.push(block.clone());
                return;
            }
            if refused.is_some() {
                return;
            }
            let position = blocks.len();
            let checked = check_link(block, position, blocks.last().map(|b| &b.meta))
                .and_then(|()| host::block_shape(block, &globals, bs, format))
                .and_then(|l| match shape {
                    Some(e) if e != l.shape => Err(format!(
                        "its shape {:?} differs from the blocks before it ({e:?})",
                        l.shape
                    )),
                    _ => Ok(l.shape),
                });
            match checked {
                Ok(s) => {
                    shape = Some(s);
                    let run = assembly.get_or_insert_with(|| {
                        host::RunAssembly::new(host::plane_specs(layers, s, format)?, capacity)
                    });
                    // A failed copy (never expected: the block was checked) leaves the run
                    // to `restore_onto`, which reports it properly.
                    let put = match run {
                        Ok(run) => run.put(position, block),
                        Err(_) => Ok(()),
                    };
                    if let Err(e) = put {
                        assembly = Some(Err(e));
                    }
                    blocks.push(block.clone());
                }
                Err(reason) => refused = Some(CacheError::Restore { position, reason }),
            }
        });
        let valid = blocks.len();
        let assembled = match (assembly, shape) {
            (Some(Ok(run)), Some(shape))
                if ladder_capacity(initial_blocks, max_blocks, bs, valid) == capacity =>
            {
                Some((run, shape))
            }
            _ => None,
        };
        let Some((run, shape)) = assembled else {
            let mut restored = self.restore_onto(&blocks)?;
            if restored.stopped.is_none() {
                restored.stopped = refused;
            }
            return Ok(restored);
        };
        let mut this = self;
        this.install_run(run.into_arrays()?, shape, valid, capacity, None, None)?;
        Ok(Restored {
            cache: this,
            blocks: valid,
            stopped: refused,
            state_cut: 0,
            window_cut: 0,
            staged: false,
        })
    }

    /// Puts the arrays of a checked run of `valid` blocks (`uploaded`: per layer, its
    /// parts) after what each layer holds: a fresh layer's pool becomes them (each made
    /// with room for `capacity` blocks, zeros after the run), an existing pool appends them. Then
    /// the layer `states` of the run's end and the window bookkeeping (`last_trimmed`: the
    /// run's last window-trimmed block).
    fn install_run(
        &mut self,
        uploaded: Vec<Array>,
        shape: BlockShape,
        valid: usize,
        capacity: usize,
        states: Option<Vec<LayerState>>,
        last_trimmed: Option<usize>,
    ) -> Result<(), CacheError> {
        let config = self.config;
        let bs = config.block_size;
        let per = config.format.parts() * 2;
        let offset = self.offset();
        let first = offset / bs;
        let mut uploaded = uploaded.into_iter();
        for layer in self.layers.iter_mut() {
            let fresh = layer.pool.is_none();
            let parts: Vec<Array> = uploaded.by_ref().take(per).collect();
            let room = |a: &Array| a.shape().get(2).map_or(0, |&t| t as usize / bs);
            if let Some(a) = parts.iter().find(|a| fresh && room(a) != capacity) {
                return Err(CacheError::Shape(format!(
                    "a restored part holds {} blocks, its pool {capacity}",
                    room(a)
                )));
            }
            match layer.pool.as_mut() {
                None => {
                    layer.pool = Some(BlockPool::restore_arrays(
                        shape,
                        config.format,
                        parts,
                        valid,
                        config.max_blocks.max(valid),
                    )?);
                    layer.table = (0..valid as u32).collect();
                }
                Some(pool) => {
                    let (k, v) = parts.split_at(per / 2);
                    append_parts(pool, &mut layer.table, layer.len, bs, k, v)?;
                }
            }
            layer.len += valid * bs;
        }
        if let Some(states) = states {
            self.states.restore(offset + valid * bs, states)?;
        }
        let floor = last_trimmed.map_or(self.window.floor, |i| (first + i + 1) * bs);
        if self.window.kept_from >= self.published {
            self.window.kept_from = first.max(floor / bs);
        }
        self.window.floor = floor;
        self.published = first + valid;
        Ok(())
    }

    /// The float dtype keys are fetched in, once known.
    pub fn dtype(&self) -> Option<Dtype> {
        self.layers.iter().find_map(Layer::shape).map(|s| s.dtype)
    }

    /// Device bytes the cache holds: its pools' arenas (capacity, not just the tokens
    /// held) and a hybrid's layer states and snapshots. A layer lent to a batch arena
    /// holds none.
    pub fn device_bytes(&self) -> u64 {
        self.arena_sum(Array::nbytes) + self.states.nbytes()
    }

    /// The allocator buffers behind [`Self::device_bytes`]: an evaluated arena's whole
    /// buffer, which MLX's buffer cache may have made larger than the arena (a freed buffer
    /// less than two pages, and less than twice the size, larger than asked for is handed
    /// over whole: [`mlx::Array::buffer_bytes`]); an unevaluated one's bytes. What MLX's
    /// active memory counts for the cache; the budget counts [`Self::device_bytes`], which
    /// does not depend on what the buffer cache held when the arenas were made.
    pub fn buffer_bytes(&self) -> u64 {
        self.arena_sum(|a| a.nbytes().max(a.buffer_bytes())) + self.states.nbytes()
    }

    /// `bytes` of every pool arena, summed.
    fn arena_sum(&self, bytes: impl Fn(&Array) -> usize) -> u64 {
        self.layers
            .iter()
            .filter_map(|l| l.pool.as_ref())
            .flat_map(|p| p.arrays())
            .map(|a| bytes(a) as u64)
            .sum()
    }

    /// Whether a batch arena holds the KV of any layer (the cache is a row of a decoding
    /// [`crate::PagedKvRows`]; `PagedKvRows::row` shows it so): such a layer has no pool
    /// and [`Self::fetch`], appends, trims, publication and [`Self::state`] refuse it.
    pub fn is_lent(&self) -> bool {
        self.layers.iter().any(|l| l.lent.is_some())
    }

    /// Whether `layer`'s KV is lent to a batch arena.
    pub(crate) fn layer_lent(&self, layer: usize) -> bool {
        self.layers.get(layer).is_some_and(|l| l.lent.is_some())
    }

    /// Gives `layer`'s pool up to a batch arena that has taken a copy of its KV (from
    /// [`Self::fetch`]): the pool and block table go, the layer keeps its length (which
    /// [`Self::lent_grew`] advances), its block shape, and the cache everything else
    /// (settings, publication marks, window floors and ends, layer states).
    pub(crate) fn lend(&mut self, layer: usize) -> Result<(), CacheError> {
        let l = self.layer_mut(layer)?;
        let Some(pool) = l.pool.take() else {
            return Err(CacheError::Config(format!(
                "layer {layer} has no pool to lend (lent already, or empty)"
            )));
        };
        l.lent = Some(pool.shape());
        l.table.clear();
        // The arena's copy holds the shared prefix too: the layer no longer reads it.
        l.len = l.held();
        l.prefix = None;
        self.release_unused_share();
        Ok(())
    }

    /// Counts `tokens` more tokens the batch arena holds for lent `layer`.
    pub(crate) fn lent_grew(&mut self, layer: usize, tokens: usize) -> Result<(), CacheError> {
        let l = self.layer_mut(layer)?;
        if l.lent.is_none() {
            return Err(CacheError::Config(format!("layer {layer} is not lent")));
        }
        l.len += tokens;
        Ok(())
    }

    /// Takes lent `layer`'s KV back from a batch arena: `keys` and `values` (float
    /// `[1, H, len, D]`, every token the layer holds) become a fresh pool at the capacity
    /// the growth ladder gives `len` tokens (one write per part: the tokens, then zeros).
    pub(crate) fn take_back(
        &mut self,
        layer: usize,
        keys: &Array,
        values: &Array,
    ) -> Result<(), CacheError> {
        let (_, count, _) = seq_shape("take back", keys, values)?;
        let config = self.config;
        let l = self.layer_mut(layer)?;
        let Some(shape) = l.lent else {
            return Err(CacheError::Config(format!("layer {layer} is not lent")));
        };
        if count != l.len {
            return Err(CacheError::Shape(format!(
                "layer {layer} holds {} tokens; {count} given back",
                l.len
            )));
        }
        let mut parts = Vec::with_capacity(config.format.parts() * 2);
        for x in [keys, values] {
            parts.extend(config.format.encode(x)?);
        }
        let pool = BlockPool::from_parts(
            shape,
            config.format,
            &parts,
            count,
            config.initial_blocks,
            config.max_blocks,
        )?;
        l.pool = Some(pool);
        l.table = (0..count.div_ceil(config.block_size) as u32).collect();
        l.lent = None;
        Ok(())
    }

    /// An error when a batch arena holds any layer's KV.
    fn check_not_lent(&self) -> Result<(), CacheError> {
        match self.layers.iter().position(|l| l.lent.is_some()) {
            Some(layer) => Err(lent_error(layer)),
            None => Ok(()),
        }
    }
}

/// The error for an operation on a layer whose KV a batch arena holds.
fn lent_error(layer: usize) -> CacheError {
    CacheError::Config(format!(
        "layer {layer}'s KV is held by a batch arena (take the row out of its PagedKvRows \
         first)"
    ))
}

impl KvCache for PagedKvCache {
    fn layers(&self) -> usize {
        self.layers.len()
    }

    fn layer_offset(&self, layer: usize) -> usize {
        self.layers.get(layer).map_or(0, Layer::held)
    }

    fn update_and_fetch(
        &mut self,
        layer: usize,
        keys: &Array,
        values: &Array,
    ) -> Result<(Array, Array), CacheError> {
        self.append(layer, keys, values)?;
        self.fetch(layer)?
            .ok_or_else(|| CacheError::Config(format!("layer {layer} has no pool after an append")))
    }

    fn update_and_attend(
        &mut self,
        layer: usize,
        queries: &Array,
        keys: &Array,
        values: &Array,
        scale: f32,
        mask: AttentionMask<'_>,
    ) -> Result<Array, CacheError> {
        // One query and no mask (a decode step of an unwindowed layer): where the node is
        // usable (a CUDA GPU; the CPU for f32) the key and value are written in place and
        // attended in one node, as for a batch
        // (`PagedKvRows`, docs/cache.md "Batched decode attention in one node").
        let one_query = matches!(mask, AttentionMask::None)
            && queries.shape().first() == Some(&1)
            && queries.shape().get(2) == Some(&1);
        if one_query && mlx::rows_attention::rows_kernel_usable() {
            let out = crate::rows::attend_in_one_node(
                std::slice::from_mut(self),
                layer,
                queries,
                keys,
                values,
                scale,
            )?;
            crate::rows::count_decode_path(out.is_some(), 1);
            if let Some(out) = out {
                return Ok(out);
            }
        }
        let shared = self.layers.get(layer).is_some_and(|l| l.prefix.is_some());
        // 16-bit floats only: there MLX's CUDA attention is cuDNN's, built per shape.
        if matches!(mask, AttentionMask::Causal)
            && matches!(queries.dtype(), Dtype::F16 | Dtype::BF16)
            && self.paddable(layer, queries)
        {
            if !mlx::padded_attention::padded_attention_enabled() {
                crate::prefill_paths::count_prefill_attention(false);
            } else if let Some(out) = self.attend_padded(layer, queries, keys, values, scale)? {
                return Ok(out);
            }
        }
        if !shared || matches!(mask, AttentionMask::Array(_)) {
            return crate::fetch_and_attend(self, layer, queries, keys, values, scale, mask);
        }
        // The shared prefix and the layer's own tokens are two parts of one softmax: the
        // prefix is read through its views, never copied (docs/cache.md, "Shared prefixes").
        self.append(layer, keys, values)?;
        let l = &self.layers[layer];
        let (Some(prefix), Some(pool)) = (&l.prefix, &l.pool) else {
            return Err(CacheError::Config(format!(
                "layer {layer} has no pool after an append"
            )));
        };
        let format = self.config.format;
        let per = format.parts();
        let own = pool.read(&l.table, l.len)?;
        let (pk, pv) = (
            format.decode(&prefix.parts[..per])?,
            format.decode(&prefix.parts[per..])?,
        );
        let (ok, ov) = (format.decode(&own[..per])?, format.decode(&own[per..])?);
        let causal = matches!(mask, AttentionMask::Causal);
        Ok(mlx::fast::attention_over_parts(
            queries,
            &[(&pk, &pv), (&ok, &ov)],
            scale,
            causal,
        )?)
    }

    fn trim(&mut self, tokens: usize) -> Result<usize, CacheError> {
        PagedKvCache::trim(self, tokens)
    }

    fn state_layers(&self) -> usize {
        self.states.layers()
    }

    fn state_snapshot_every(&self) -> Option<usize> {
        self.states.snapshot_every()
    }

    fn layer_state(&self, layer: usize) -> Result<Option<LayerState>, CacheError> {
        Ok(self.states.get(layer)?.cloned())
    }

    fn set_layer_state(
        &mut self,
        layer: usize,
        tokens: usize,
        state: LayerState,
    ) -> Result<(), CacheError> {
        self.states.update(layer, tokens, state)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::share::ShareHandle;

    fn cache(tokens: i32) -> PagedKvCache {
        let config = PagedConfig {
            block_size: 16,
            initial_blocks: 2,
            ..PagedConfig::default()
        };
        let mut c = PagedKvCache::new(1, config).unwrap();
        let k = mlx::random::normal(
            &[1, 2, tokens, 32],
            Dtype::F32,
            &mlx::random::key(5).unwrap(),
        )
        .unwrap();
        c.append(0, &k, &k).unwrap();
        c
    }

    /// A cache made with room for its prompt holds it in the arena it started with, of the
    /// capacity a cache grown to the prompt's length reaches (same shapes and strides).
    #[test]
    fn a_cache_with_room_for_its_prompt_never_grows_through_the_prefill() {
        let base = PagedConfig {
            block_size: 16,
            initial_blocks: 2,
            ..PagedConfig::default()
        };
        let roomy = base.with_room_for(600);
        assert_eq!(
            roomy.initial_blocks,
            ladder_capacity(2, base.max_blocks, 16, 38)
        );
        assert!(roomy.initial_blocks >= 38);
        assert_eq!(base.with_room_for(0), base);
        let (mut grown, mut made) = (
            PagedKvCache::new(1, base).unwrap(),
            PagedKvCache::new(1, roomy).unwrap(),
        );
        let key = mlx::random::key(9).unwrap();
        let mut start = None;
        for _ in 0..6 {
            let k = mlx::random::normal(&[1, 2, 100, 8], Dtype::F32, &key).unwrap();
            grown.append(0, &k, &k).unwrap();
            made.append(0, &k, &k).unwrap();
            let pool = made.layers[0].pool.as_ref().unwrap();
            let at = (pool.capacity(), pool.arrays()[0].shape());
            assert_eq!(
                *start.get_or_insert(at.clone()),
                at,
                "the arena was regrown"
            );
        }
        let (g, m) = (
            grown.layers[0].pool.as_ref().unwrap(),
            made.layers[0].pool.as_ref().unwrap(),
        );
        assert_eq!(g.capacity(), m.capacity());
        assert_eq!(g.arrays()[0].shape(), m.arrays()[0].shape());
        let (gk, _) = grown.fetch(0).unwrap().unwrap();
        let (mk, _) = made.fetch(0).unwrap().unwrap();
        assert_eq!(gk.to_vec::<f32>().unwrap(), mk.to_vec::<f32>().unwrap());
    }

    /// Room made for a longer prompt grows the pool once, to a step of its growth ladder
    /// that holds the prompt, keeps what it held, and the prompt's chunks then append
    /// without growing it again; the keys equal those of a cache grown chunk by chunk.
    #[test]
    fn room_for_a_longer_prompt_grows_the_pool_once() {
        let (mut roomy, mut grown) = (cache(40), cache(40));
        let (before, _) = roomy.fetch(0).unwrap().unwrap();
        let small = roomy.layers[0].pool.as_ref().unwrap().capacity();
        roomy.reserve_room(600).unwrap();
        let cap = roomy.layers[0].pool.as_ref().unwrap().capacity();
        let max = roomy.config.max_blocks;
        assert_eq!(cap, ladder_capacity(small, max, 16, 38));
        assert_eq!(
            cap,
            ladder_capacity(2, max, 16, 38),
            "a step of the same ladder"
        );
        let (after, _) = roomy.fetch(0).unwrap().unwrap();
        assert_eq!(
            before.to_vec::<f32>().unwrap(),
            after.to_vec::<f32>().unwrap()
        );
        let key = mlx::random::key(11).unwrap();
        for _ in 0..5 {
            let k = mlx::random::normal(&[1, 2, 100, 32], Dtype::F32, &key).unwrap();
            roomy.append(0, &k, &k).unwrap();
            grown.append(0, &k, &k).unwrap();
            assert_eq!(roomy.layers[0].pool.as_ref().unwrap().capacity(), cap);
        }
        assert!(grown.layers[0].pool.as_ref().unwrap().capacity() > small);
        let (r, _) = roomy.fetch(0).unwrap().unwrap();
        let (g, _) = grown.fetch(0).unwrap().unwrap();
        assert_eq!(r.to_vec::<f32>().unwrap(), g.to_vec::<f32>().unwrap());
        // Room already there: nothing changes.
        roomy.reserve_room(100).unwrap();
        assert_eq!(roomy.layers[0].pool.as_ref().unwrap().capacity(), cap);
    }

    /// A fork gets a pool with room for the prompt it was made for at once: more than its
    /// blocks need, less than its longer source holds.
    #[test]
    fn a_fork_has_room_for_the_prompt_it_was_made_for() {
        let source = cache(600);
        let roomy = source.config.with_room_for(300).initial_blocks;
        let fork = source.fork(40, roomy).unwrap();
        let pool = fork.layers[0].pool.as_ref().unwrap();
        assert_eq!(
            pool.capacity(),
            ladder_capacity(2, source.config.max_blocks, 16, 19)
        );
        assert!(pool.capacity() < source.layers[0].pool.as_ref().unwrap().capacity());
        assert_eq!(fork.config.initial_blocks, pool.capacity());
        assert_eq!(fork.offset(), 40);
    }

    /// A publication's copies of every layer are one node (`CopyTokenRuns`) and hold each
    /// layer's tokens of the blocks published, read from the layer's own keys and values.
    #[test]
    fn every_layer_of_a_publication_is_copied_by_one_node() {
        let config = PagedConfig {
            block_size: 8,
            initial_blocks: 2,
            ..PagedConfig::default()
        };
        let layers = 3;
        let mut c = PagedKvCache::new(layers, config).unwrap();
        let mut written = Vec::new();
        for l in 0..layers {
            let key = mlx::random::key(40 + l as u64).unwrap();
            let k = mlx::random::normal(&[1, 2, 37, 16], Dtype::F32, &key).unwrap();
            let v = k.add_scalar(l as f64 + 1.0).unwrap();
            c.append(l, &k, &v).unwrap();
            written.push((k, v));
        }
        // Blocks 1..4: tokens 8..32 of every layer.
        let parts = c.copy_run(1, 4, true).unwrap();
        let all: Vec<&Array> = parts.iter().flatten().collect();
        let names = mlx::pending_primitives(&all).unwrap();
        assert_eq!(
            names.iter().filter(|n| *n == "CopyTokenRuns").count(),
            1,
            "{names:?}"
        );
        for (l, (k, v)) in written.iter().enumerate() {
            assert_eq!(parts[l].len(), 2);
            for (got, src) in parts[l].iter().zip([k, v]) {
                let want = src.slice(&[0, 0, 8, 0], &[1, 2, 32, 16]).unwrap();
                assert_eq!(got.shape(), vec![1, 2, 24, 16]);
                assert_eq!(
                    got.to_vec::<f32>().unwrap(),
                    want.to_vec::<f32>().unwrap(),
                    "layer {l}"
                );
            }
        }
    }

    /// A fork keeps only the matched blocks, in a pool sized for them, and leaves its
    /// source as it was when it writes.
    #[test]
    fn a_fork_copies_its_blocks_into_a_pool_of_their_size() {
        let source = cache(600);
        let (sk, sv) = source.fetch(0).unwrap().unwrap();
        let big = source.layers[0].pool.as_ref().unwrap().capacity();
        assert!(big >= 38, "600 tokens in blocks of 16: {big} blocks");
        let mut fork = source.fork(40, 2).unwrap();
        assert_eq!(fork.offset(), 40);
        let pool = fork.layers[0].pool.as_ref().unwrap();
        assert_eq!(
            pool.capacity(),
            3,
            "the ladder from 2 blocks for 3 blocks, not {big}"
        );
        let (fk, fv) = fork.fetch(0).unwrap().unwrap();
        let first = |a: &Array, n: i32| {
            let s = a.shape();
            a.slice(&[0, 0, 0, 0], &[1, s[1], n, s[3]])
                .unwrap()
                .to_vec::<f32>()
                .unwrap()
        };
        assert_eq!(fk.to_vec::<f32>().unwrap(), first(&sk, 40));
        assert_eq!(fv.to_vec::<f32>().unwrap(), first(&sv, 40));
        // The fork's writes (into its own blocks, the partial third included) leave the
        // source's tokens as they were.
        let x = mlx::ops::full(&[1, 2, 30, 32], 9.0, Dtype::F32).unwrap();
        fork.append(0, &x, &x).unwrap();
        assert_eq!(fork.offset(), 70);
        let (sk2, _) = source.fetch(0).unwrap().unwrap();
        assert_eq!(sk2.to_vec::<f32>().unwrap(), sk.to_vec::<f32>().unwrap());
        let (fk2, _) = fork.fetch(0).unwrap().unwrap();
        assert_eq!(first(&fk2, 40), first(&sk, 40));
    }

    /// A padded prefill chunk (mlx::padded_attention) attends and stores what the plain
    /// path does: its real queries' outputs within float noise, the same keys and values.
    #[test]
    fn a_padded_chunk_attends_and_stores_what_the_plain_path_does() {
        let normal = |shape: &[i32], seed: u64| {
            mlx::random::normal(shape, Dtype::F32, &mlx::random::key(seed).unwrap()).unwrap()
        };
        // 40 tokens held (capacity 48 after growth), then chunks that fit and that grow it.
        for (held, chunk) in [(40, 23), (40, 8), (0, 37), (40, 100)] {
            let (mut padded, mut plain) = (cache(held), cache(held));
            if held == 0 {
                padded = PagedKvCache::new(1, padded.config).unwrap();
                plain = PagedKvCache::new(1, plain.config).unwrap();
            }
            let q = normal(&[1, 4, chunk, 32], 11);
            let (k, v) = (
                normal(&[1, 2, chunk, 32], 12),
                normal(&[1, 2, chunk, 32], 13),
            );
            let got = padded
                .attend_padded(0, &q, &k, &v, 0.2)
                .unwrap()
                .expect("a float layer without a prefix")
                .to_vec::<f32>()
                .unwrap();
            let want =
                crate::fetch_and_attend(&mut plain, 0, &q, &k, &v, 0.2, AttentionMask::Causal)
                    .unwrap()
                    .to_vec::<f32>()
                    .unwrap();
            let worst = got
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            assert_eq!(got.len(), want.len());
            // Two attention shapes: on CUDA their f32 products (TF32) round differently,
            // by up to ~6u (docs/cuda.md, "Tolerances on the GPU"); u is 2^-24 on the CPU.
            let u = mlx::f32_matmul_unit_roundoff().unwrap();
            assert!(worst < 1e-5 + 6.0 * u, "({held}, {chunk}): {worst}");
            let (pk, pv) = padded.fetch(0).unwrap().unwrap();
            let (wk, wv) = plain.fetch(0).unwrap().unwrap();
            assert_eq!(pk.to_vec::<f32>().unwrap(), wk.to_vec::<f32>().unwrap());
            assert_eq!(pv.to_vec::<f32>().unwrap(), wv.to_vec::<f32>().unwrap());
        }
        let padded_before = crate::prefill_attention_totals().0;
        let mut c = cache(40);
        c.attend_padded(
            0,
            &normal(&[1, 4, 9, 32], 16),
            &normal(&[1, 2, 9, 32], 17),
            &normal(&[1, 2, 9, 32], 18),
            0.2,
        )
        .unwrap()
        .expect("a float layer without a prefix");
        assert!(
            crate::prefill_attention_totals().0 > padded_before,
            "a padded chunk is counted as padded"
        );
        // One query (a decode step) is not this path's: nothing appended.
        let mut c = cache(40);
        let one = normal(&[1, 4, 1, 32], 14);
        let kv = normal(&[1, 2, 1, 32], 15);
        assert!(c.attend_padded(0, &one, &kv, &kv, 0.2).unwrap().is_none());
        assert_eq!(c.offset(), 40);
    }

    /// A 16-bit causal chunk is counted on the path it took: padded where padding is on
    /// (CUDA's default, or `KVSTORE_PADDED_ATTENTION=1`), at its own shape where it is off.
    #[test]
    fn a_16_bit_causal_chunk_is_counted_on_the_path_it_took() {
        let bf16 = |shape: &[i32], seed: u64| {
            mlx::random::normal(shape, Dtype::F32, &mlx::random::key(seed).unwrap())
                .unwrap()
                .astype(Dtype::BF16)
                .unwrap()
        };
        let mut c = PagedKvCache::new(1, PagedConfig::default()).unwrap();
        let (q, k, v) = (
            bf16(&[1, 4, 20, 32], 21),
            bf16(&[1, 2, 20, 32], 22),
            bf16(&[1, 2, 20, 32], 23),
        );
        let (padded, plain) = crate::prefill_attention_totals();
        c.update_and_attend(0, &q, &k, &v, 0.2, AttentionMask::Causal)
            .unwrap();
        let (padded_after, plain_after) = crate::prefill_attention_totals();
        // Other tests count too, in parallel: the counters only grow, so the path taken
        // must have grown by at least this chunk.
        if mlx::padded_attention::padded_attention_enabled() {
            assert!(padded_after > padded, "padding on: counted as padded");
        } else {
            assert!(plain_after > plain, "padding off: counted at its own shape");
        }
        assert_eq!(c.offset(), 20);
    }

    /// The batched decode attention writes a row's arenas in place only while nothing else
    /// holds them: a prefix shared from the row or a clone of it keeps it row by row.
    #[test]
    fn a_row_is_written_in_place_only_while_no_sharer_or_clone_holds_its_arenas() {
        let source = cache(40);
        assert!(
            source.decode_row(0).is_some(),
            "the append gave it arenas of its own"
        );

        let sharer = PagedKvCache::share_prefix(&source, 32, ShareHandle::new(1)).unwrap();
        assert!(
            source.decode_row(0).is_none(),
            "a shared prefix views its arenas"
        );
        // The sharer's own layer has no pool yet; its first append makes one of its own.
        drop(sharer);
        assert!(source.decode_row(0).is_some());

        let twin = source.clone();
        assert!(source.decode_row(0).is_none() && twin.decode_row(0).is_none());
        drop(twin);
        assert!(source.decode_row(0).is_some());

        // Reserving a token past the last block takes a block (growing the arenas into
        // buffers of their own) and the row stays writable, its length unchanged until the
        // node's token is counted.
        let mut row = cache(48);
        assert!(row.reserve_decode_token(0).unwrap());
        let r = row.decode_row(0).unwrap();
        assert_eq!((r.start, r.len), (0, 48));
        assert!(r.keys.shape()[2] >= 64, "room for token 48");
        row.advance_decode(0).unwrap();
        assert_eq!(row.offset(), 49);
    }
}
