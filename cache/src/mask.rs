//! Attention masks for a forward step over a cache: none, causal, sliding window, or an
//! explicit array.

use mlx::fast::AttentionMask;
use mlx::{Array, Dtype};

use crate::CacheError;

/// The mask of one attention call, owning its array when it has one.
#[derive(Clone, Debug)]
pub enum Mask {
    /// Every query sees every key.
    None,
    /// Query i sees keys up to its own position (MLX's bottom-right aligned causal mode).
    Causal,
    /// An explicit mask: boolean (true = attend) or additive, broadcastable to
    /// `[B, H, L_q, L_k]`.
    Array(Array),
}

impl Mask {
    /// The mask as MLX's SDPA takes it.
    pub fn as_attention(&self) -> AttentionMask<'_> {
        match self {
            Mask::None => AttentionMask::None,
            Mask::Causal => AttentionMask::Causal,
            Mask::Array(a) => AttentionMask::Array(a),
        }
    }
}

/// Whether a query at absolute position `q` may see the key at position `k`: causal, and
/// within the last `window` positions (the query's own included) when windowed.
pub(crate) fn visible(q: usize, k: usize, window: Option<usize>) -> bool {
    k <= q && window.is_none_or(|w| k + w > q)
}

/// The mask for `queries` new tokens attending over `offset` cached tokens plus
/// themselves, with an optional sliding window (in tokens, the query itself included).
///
/// Uses MLX's fused modes where they are exact (no mask for one query, causal when no
/// query's window excludes a key), else a boolean `[queries, offset + queries]` array.
pub fn attention_mask(
    offset: usize,
    queries: usize,
    window: Option<usize>,
) -> Result<Mask, CacheError> {
    if window == Some(0) {
        return Err(CacheError::Config(
            "a sliding window must hold at least one token".into(),
        ));
    }
    let keys = offset + queries;
    let window_bites = window.is_some_and(|w| keys > w);
    match (queries, window_bites) {
        (0 | 1, false) => Ok(Mask::None),
        (_, false) => Ok(Mask::Causal),
        (_, true) => {
            let mut allowed = Vec::with_capacity(queries * keys);
            for i in 0..queries {
                for k in 0..keys {
                    allowed.push(visible(offset + i, k, window) as u8);
                }
            }
            Ok(Mask::Array(Array::from_bytes(
                &allowed,
                &[queries as i32, keys as i32],
                Dtype::Bool,
            )?))
        }
    }
}
