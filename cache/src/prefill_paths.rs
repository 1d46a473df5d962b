//! Process-wide counts of the paths a 16-bit causal prefill chunk's attention took: padded
//! to a few shapes ([`mlx::padded_attention`], on by default on CUDA) or at its own shape,
//! so a benchmark can say which its GPU run used (docs/cache.md, "Attention shapes on
//! CUDA").

use std::sync::atomic::{AtomicU64, Ordering};

static PADDED: AtomicU64 = AtomicU64::new(0);
static UNPADDED: AtomicU64 = AtomicU64::new(0);

/// Layer-chunks of 16-bit causal prefill attention over the process that padding could
/// take (float KV in blocks of the layer's own, two queries or more): padded to a few
/// shapes, and attended at their own shape (padding off, or no room to pad there).
pub fn prefill_attention_totals() -> (u64, u64) {
    (
        PADDED.load(Ordering::Relaxed),
        UNPADDED.load(Ordering::Relaxed),
    )
}

/// Counts one layer-chunk in [`prefill_attention_totals`].
pub(crate) fn count_prefill_attention(padded: bool) {
    let counter = if padded { &PADDED } else { &UNPADDED };
    counter.fetch_add(1, Ordering::Relaxed);
}
