//! MLX's fused kernels: RMS norm, rotary position embedding, scaled dot-product attention.

use crate::array::{list, Array};
use crate::ffi::ffi;
use crate::Result;

/// RMS normalization over the last axis: `x / sqrt(mean(x²) + eps) * weight`.
pub fn rms_norm(x: &Array, weight: Option<&Array>, eps: f32) -> Result<Array> {
    let w = list("rms_norm", weight.as_slice())?;
    Array::wrap("rms_norm", ffi::rms_norm(x.inner(), &w, eps))
}

/// Where a rotary embedding starts counting positions.
#[derive(Clone, Copy, Debug)]
pub enum RopeOffset<'a> {
    /// The same offset for every row.
    Scalar(i32),
    /// One offset per batch row (an int32 array of shape `[B]`).
    PerRow(&'a Array),
}

/// Rotary position embedding settings.
#[derive(Clone, Copy, Debug)]
pub struct Rope<'a> {
    /// Feature dimensions rotated (from the front of the last axis).
    pub dims: i32,
    /// Rotate interleaved pairs (x0,x1),(x2,x3)… instead of the two halves.
    pub traditional: bool,
    /// The base of the frequencies; ignored when `freqs` is given.
    pub base: f32,
    /// Positions are multiplied by this.
    pub scale: f32,
    /// Explicit inverse frequencies (e.g. Llama 3 rope scaling), `[dims / 2]`.
    pub freqs: Option<&'a Array>,
}

/// Applies rotary embedding to `x` of shape `[B, H, L, D]` for positions
/// `offset .. offset + L`.
pub fn rope(x: &Array, cfg: &Rope<'_>, offset: RopeOffset<'_>) -> Result<Array> {
    let freqs = list("rope", cfg.freqs.as_slice())?;
    let has_base = cfg.freqs.is_none();
    match offset {
        RopeOffset::Scalar(o) => Array::wrap(
            "rope",
            ffi::rope(
                x.inner(),
                cfg.dims,
                cfg.traditional,
                cfg.base,
                has_base,
                cfg.scale,
                o,
                &freqs,
            ),
        ),
        RopeOffset::PerRow(o) => Array::wrap(
            "rope",
            ffi::rope_offsets(
                x.inner(),
                cfg.dims,
                cfg.traditional,
                cfg.base,
                has_base,
                cfg.scale,
                o.inner(),
                &freqs,
            ),
        ),
    }
}

/// The mask of an attention call.
#[derive(Clone, Copy, Debug)]
pub enum AttentionMask<'a> {
    /// Every query sees every key.
    None,
    /// Query i sees keys up to i + (keys − queries) (bottom-right aligned).
    Causal,
    /// A boolean mask (true = attend) or an additive float mask, broadcastable to
    /// `[B, H, L_q, L_k]`.
    Array(&'a Array),
}

/// Fused `softmax(q kᵀ · scale + mask) v` for q `[B, Hq, Lq, D]` and k, v
/// `[B, Hkv, Lk, D]`; grouped-query attention when Hq is a multiple of Hkv.
pub fn scaled_dot_product_attention(
    q: &Array,
    k: &Array,
    v: &Array,
    scale: f32,
    mask: AttentionMask<'_>,
) -> Result<Array> {
    let (mode, arrays): (&str, Vec<&Array>) = match mask {
        AttentionMask::None => ("", vec![]),
        AttentionMask::Causal => ("causal", vec![]),
        AttentionMask::Array(m) => ("array", vec![m]),
    };
    let m = list("scaled_dot_product_attention", &arrays)?;
    Array::wrap(
        "scaled_dot_product_attention",
        ffi::sdpa(q.inner(), k.inner(), v.inner(), scale, mode, &m),
    )
}
