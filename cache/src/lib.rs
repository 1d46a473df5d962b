//! The live side of kvstore: KV caches over MLX arrays, and the conversion of their full
//! blocks into immutable store blocks and back.
//!
//! Main types: [`KvCache`] (the verbs a model's forward pass uses), [`ContiguousKvCache`]
//! (the plain reference every paged variant is parity-gated against).

mod contiguous;
mod error;

pub use contiguous::ContiguousKvCache;
pub use error::CacheError;

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
}
