//! The live side of kvstore: paged KV caches over MLX arrays, and the conversion of their
//! full blocks into immutable store blocks and back.
//!
//! Main types:
//! - [`KvCache`]: the verbs a model's forward pass uses (append and fetch per layer).
//! - [`ContiguousKvCache`]: the plain reference every paged variant is parity-gated against.
//! - [`BlockPool`]: one layer's K/V arenas `[blocks, kv_heads, block_size, width]`.
//! - [`PagedKvCache`]: a sequence in blocks; [`PagedKvCache::publish`] yields its new full
//!   blocks as host bytes ([`store::Block`]), [`PagedKvCache::restore`] rebuilds a cache from
//!   them in bulk (one transfer per layer part).
//! - [`Chain`]: a sequence's block keys, derived once.
//! - [`ResidentPool`]: the device tier: finished sequences' KV kept on the device under one
//!   byte budget, matched token-granularly and handed over (or forked) on a hit.
//! - [`PagedKvRows`]: a batch of sequences decoding together.
//! - [`LayerStates`]: the state of non-attention layers (short convolutions, recurrent
//!   layers) a sequence carries beside its KV, and how far it can be rewound.
//! - [`KvFormat`]: float or affine-quantized (KV4/KV8) storage.
//! - [`attention_mask`]: causal and sliding-window masks for a step.

mod batch_arena;
mod block_memory;
mod chain;
mod contiguous;
mod error;
mod export;
mod export_to_block_memory;
mod format;
mod host;
mod mask;
mod paged;
mod pool;
mod prefill_paths;
mod resident;
mod rows;
mod scratch;
mod share;
mod staged;
mod state;
mod transfer_pool;

pub use block_memory::{
    allow_block_memory, block_memory, block_memory_for, prewarm_block_memory,
    requested_block_memory, BlockMemory,
};
pub use chain::Chain;
pub use contiguous::ContiguousKvCache;
pub use error::CacheError;
pub use export::Export;
pub use format::KvFormat;
pub use host::{plane_specs, state_plane_specs, trimmed_plane_specs};
pub use mask::{attention_mask, Mask};
pub use paged::{PagedConfig, PagedKvCache, Restored};
pub use pool::{ladder_capacity, BlockPool, BlockShape, CUDNN_ARENA_FROM, CUDNN_KV_STEP};
pub use prefill_paths::prefill_attention_totals;
pub use resident::{
    EvictedSequence, ResidentHit, ResidentPool, ResidentStats, ShareCount, DEFAULT_SHARE_MIN_TOKENS,
};
pub use rows::{decode_path_totals, PagedKvRows};
pub use scratch::prewarm_scratch;
pub use share::ShareHandle;
pub use staged::{prewarm_staging, StagedRestore};
pub use state::{LayerState, LayerStates, DEFAULT_STATE_HISTORY};
pub use transfer_pool::transfer_threads;

use mlx::fast::AttentionMask;
use mlx::Array;

/// The KV cache of one sequence across all layers of a model, as a forward pass uses it.
///
/// Contract: the caller appends every layer once per forward step, in any order, with keys
/// and values of shape `[1, kv_heads, L, head_dim]` (the same `L` for every layer). The
/// implementation returns, for that layer, every key and value held so far (including the
/// new ones) as contiguous `[1, kv_heads, offset + L, head_dim]` arrays in the dtype of the
/// inputs, and MUST NOT let a later append change arrays it returned earlier.
pub trait KvCache {
    /// Number of layers.
    fn layers(&self) -> usize;

    /// Tokens held by layer `layer`. Read [`KvCache::offset`] before a forward step for the
    /// RoPE position of its first token.
    fn layer_offset(&self, layer: usize) -> usize;

    /// Tokens held by every layer: the position of the next token to compute.
    fn offset(&self) -> usize {
        (0..self.layers())
            .map(|l| self.layer_offset(l))
            .min()
            .unwrap_or(0)
    }

    /// Appends `keys` and `values` to `layer` and returns all keys and values it holds.
    fn update_and_fetch(
        &mut self,
        layer: usize,
        keys: &Array,
        values: &Array,
    ) -> Result<(Array, Array), CacheError>;

    /// Appends `keys` and `values` to `layer` and returns the attention of `queries`
    /// (`[1, Hq, L, D]`) over everything the layer holds: `softmax(q kᵀ · scale + mask) v`.
    /// The default fetches the layer's KV ([`KvCache::update_and_fetch`]) and runs the
    /// fused attention; a cache whose KV lives in several arrays (a shared prefix and its
    /// own blocks) attends over them without concatenating them.
    fn update_and_attend(
        &mut self,
        layer: usize,
        queries: &Array,
        keys: &Array,
        values: &Array,
        scale: f32,
        mask: AttentionMask<'_>,
    ) -> Result<Array, CacheError> {
        fetch_and_attend(self, layer, queries, keys, values, scale, mask)
    }

    /// Drops the last `tokens` tokens of every layer (all of them if fewer are held) and
    /// returns how many were dropped; the next append goes where they began. A generation
    /// loop that computed one step ahead uses it to forget a step it did not need. A cache
    /// with state layers can only go back to a state it kept ([`LayerStates::rewind`]):
    /// otherwise it MUST refuse with [`CacheError::Rewind`] and change nothing.
    fn trim(&mut self, tokens: usize) -> Result<usize, CacheError>;

    /// Non-attention layers ("state layers", numbered `0..` in model order apart from the
    /// attention layers) whose state the cache carries; 0 for an attention-only cache.
    fn state_layers(&self) -> usize {
        0
    }

    /// Tokens between the state snapshots the cache keeps, if it keeps any: a forward pass
    /// ends a step at every multiple of it (see [`LayerStates::with_snapshots`]).
    fn state_snapshot_every(&self) -> Option<usize> {
        None
    }

    /// The state of state layer `layer` (array handles, no copy); `None` before its first
    /// token.
    fn layer_state(&self, layer: usize) -> Result<Option<LayerState>, CacheError> {
        Err(CacheError::NoSuchLayer { layer, layers: 0 })
    }

    /// Sets the state of state layer `layer` after a forward step of `tokens` tokens. The
    /// caller sets every state layer once per step, as it appends every attention layer.
    fn set_layer_state(
        &mut self,
        layer: usize,
        tokens: usize,
        state: LayerState,
    ) -> Result<(), CacheError> {
        let _ = (tokens, state);
        Err(CacheError::NoSuchLayer { layer, layers: 0 })
    }
}

/// [`KvCache::update_and_attend`] through [`KvCache::update_and_fetch`] and the fused
/// attention over what it returns.
pub(crate) fn fetch_and_attend<C: KvCache + ?Sized>(
    cache: &mut C,
    layer: usize,
    queries: &Array,
    keys: &Array,
    values: &Array,
    scale: f32,
    mask: AttentionMask<'_>,
) -> Result<Array, CacheError> {
    let (k, v) = cache.update_and_fetch(layer, keys, values)?;
    Ok(mlx::fast::scaled_dot_product_attention(
        queries, &k, &v, scale, mask,
    )?)
}
