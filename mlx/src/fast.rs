//! MLX's fused kernels: RMS norm, rotary position embedding, scaled dot-product attention
//! (with a fused f32 attention of this crate on the CPU, [`crate::cpu_attention`]).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use crate::array::{list, Array};
use crate::cpu_attention::{self, Dims};
use crate::ffi::ffi;
use crate::{Device, Dtype, Error, Result};

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
///
/// On the CPU, f32 attention with no mask or the causal mask and more than one query runs
/// in [`crate::cpu_attention`] (q, k and v are evaluated first and the result is a new,
/// evaluated array); every other case, and every GPU call, is MLX's kernel
/// ([`mlx_scaled_dot_product_attention`]). docs/mlx.md, "Attention on the CPU", says why.
pub fn scaled_dot_product_attention(
    q: &Array,
    k: &Array,
    v: &Array,
    scale: f32,
    mask: AttentionMask<'_>,
) -> Result<Array> {
    if let Some((dims, causal)) = cpu_attention_case(q, k, v, mask)? {
        return attend_on_cpu(q, k, v, dims, scale, causal);
    }
    mlx_scaled_dot_product_attention(q, k, v, scale, mask)
}

/// MLX's own `scaled_dot_product_attention`, never the CPU path of this crate: the
/// reference the fused CPU attention is tested and measured against.
pub fn mlx_scaled_dot_product_attention(
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

/// Whether [`scaled_dot_product_attention`] may use the fused CPU attention (the
/// process-wide switch; on unless `KVSTORE_CPU_ATTENTION=0` at the first call).
static CPU_ATTENTION: OnceLock<AtomicBool> = OnceLock::new();

fn cpu_attention_switch() -> &'static AtomicBool {
    CPU_ATTENTION.get_or_init(|| {
        AtomicBool::new(std::env::var("KVSTORE_CPU_ATTENTION").map_or(true, |v| v != "0"))
    })
}

/// Switches the fused CPU attention on or off for the process (for measuring both paths);
/// returns whether it was on. Off, every call is MLX's kernel.
pub fn set_cpu_attention(on: bool) -> bool {
    cpu_attention_switch().swap(on, Ordering::Relaxed)
}

/// Whether the fused CPU attention is switched on (it still runs only in the cases
/// [`scaled_dot_product_attention`] lists).
pub fn cpu_attention() -> bool {
    cpu_attention_switch().load(Ordering::Relaxed)
}

/// The shape and causality of a call the CPU path handles, or `None` for MLX's kernel.
fn cpu_attention_case(
    q: &Array,
    k: &Array,
    v: &Array,
    mask: AttentionMask<'_>,
) -> Result<Option<(Dims, bool)>> {
    let causal = match mask {
        AttentionMask::None => false,
        AttentionMask::Causal => true,
        AttentionMask::Array(_) => return Ok(None),
    };
    if !cpu_attention() || crate::default_device()? != Device::Cpu {
        return Ok(None);
    }
    if [q, k, v].iter().any(|a| a.dtype() != Dtype::F32) {
        return Ok(None);
    }
    let (qs, ks, vs) = (q.shape(), k.shape(), v.shape());
    if qs.len() != 4 || ks != vs || ks.len() != 4 || qs[0] != ks[0] || qs[3] != ks[3] {
        return Ok(None);
    }
    let dims = Dims {
        batch: qs[0] as usize,
        q_heads: qs[1] as usize,
        kv_heads: ks[1] as usize,
        q_len: qs[2] as usize,
        kv_len: ks[2] as usize,
        head_dim: qs[3] as usize,
    };
    // One query (a decode step) stays in MLX's graph: the fused path evaluates q, k and v,
    // which would stall the engine's pipelined decode (docs/mlx.md).
    if dims.q_len < 2 || dims.check(causal).is_err() {
        return Ok(None);
    }
    Ok(Some((dims, causal)))
}

/// Evaluates q, k and v as row-major buffers and runs the fused CPU attention over them.
fn attend_on_cpu(
    q: &Array,
    k: &Array,
    v: &Array,
    dims: Dims,
    scale: f32,
    causal: bool,
) -> Result<Array> {
    const OP: &str = "scaled_dot_product_attention";
    let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
    crate::eval(&[&q, &k, &v])?;
    let (qb, kb, vb) = (
        host_f32(&q, dims.q_size())?,
        host_f32(&k, dims.kv_size())?,
        host_f32(&v, dims.kv_size())?,
    );
    let mut out = vec![0f32; dims.q_size()];
    cpu_attention::attend(qb, kb, vb, &mut out, dims, scale, causal)
        .map_err(|message| Error::InvalidArgument { op: OP, message })?;
    let shape = [dims.batch, dims.q_heads, dims.q_len, dims.head_dim].map(|x| x as i32);
    Array::from_slice(&out, &shape)
}

/// The elements of an evaluated, row-contiguous f32 array (the output of `contiguous`
/// after eval), borrowed from MLX's buffer for as long as `a` lives.
fn host_f32(a: &Array, len: usize) -> Result<&[f32]> {
    if a.size() != len || a.dtype() != Dtype::F32 {
        return Err(Error::InvalidArgument {
            op: "scaled_dot_product_attention",
            message: format!("expected {len} f32 elements, got {:?}", a),
        });
    }
    let addr = a.data_addr()?;
    // SAFETY: `a` is evaluated (data_addr checked) and the output of MLX's `contiguous`,
    // which is row-contiguous: `len` f32 elements from its first element's address, aligned
    // for f32 (MLX offsets are whole elements). The borrow of `a` keeps the buffer alive,
    // and an evaluated array's buffer is not written again (MLX arrays are immutable; a
    // donation only happens to inputs of a later op, which needs `a` dropped or moved).
    Ok(unsafe { std::slice::from_raw_parts(addr as *const f32, len) })
}
