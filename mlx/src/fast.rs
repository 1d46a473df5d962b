//! MLX's fused kernels: RMS norm, rotary position embedding, scaled dot-product attention
//! (with a fused f32 attention of this crate on the CPU, [`crate::cpu_attention`]).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use crate::array::{list, unlist, Array};
use crate::cpu_attention::{self, Dims};
use crate::error::check;
use crate::ffi::ffi;
use crate::{Device, Dtype, Error, Result};

/// RMS normalization over the last axis: `x / sqrt(mean(x²) + eps) * weight`.
pub fn rms_norm(x: &Array, weight: Option<&Array>, eps: f32) -> Result<Array> {
    let w = list("rms_norm", weight.as_slice())?;
    Array::wrap("rms_norm", ffi::rms_norm(x.inner(), &w, eps))
}

/// `silu(gate) · up` as one fused node (MLX `compile`, shapeless): the gated MLP's
/// activation of llama and qwen, one kernel instead of three. `gate` and `up` must have one
/// shape and dtype.
pub fn silu_mul(gate: &Array, up: &Array) -> Result<Array> {
    Array::wrap(
        "silu_mul",
        ffi::gated_activation(ffi::UnaryOp::Silu, gate.inner(), up.inner()),
    )
}

pub use crate::cpu_activation::Gate;

/// `act(y[.., :n]) · y[.., n:]` for `y` `[.., 2n]`, the stacked output of a gated MLP's gate
/// and up projections, `act` the `gate`'s activation. On the CPU, f32 is one graph node
/// that runs [`crate::cpu_activation`] when MLX evaluates it (vectorized on all cores; MLX's
/// own CPU ops take ~10x longer, docs/mlx.md), for a decode step's row as for a prefill
/// chunk; elsewhere, and with the fused CPU paths switched off ([`set_cpu_attention`]), the
/// halves go through [`gated_mul`].
pub fn gated_mul_stacked(gate: Gate, y: &Array) -> Result<Array> {
    const OP: &str = "gated_mul_stacked";
    let shape = y.shape();
    let width = shape.last().copied().unwrap_or(0);
    if width <= 0 || width % 2 != 0 {
        return Err(Error::InvalidArgument {
            op: OP,
            message: format!("a stacked gate and up need an even last axis, got {shape:?}"),
        });
    }
    if y.dtype() == Dtype::F32 && cpu_attention() && crate::default_device()? == Device::Cpu {
        return Array::wrap(
            OP,
            ffi::gated_mul_stacked_cpu(y.inner(), gate == Gate::Silu),
        );
    }
    let n = width / 2;
    let last = shape.len() - 1;
    let (mut start, mut stop) = (vec![0; shape.len()], shape.clone());
    stop[last] = n;
    let g = y.slice(&start, &stop)?;
    (start[last], stop[last]) = (n, width);
    let up = y.slice(&start, &stop)?;
    gated_mul(gate, &g, &up)
}

/// `x · wᵀ` for `x` `[.., k]` and a weight `w` `[n, k]` (a linear layer's product, as
/// checkpoints store the weight). On the CPU, f32 with at most
/// [`crate::cpu_row_product::max_rows`] rows (a decode step's) is one graph node that runs
/// [`crate::cpu_row_product`] on all cores when MLX evaluates it (MLX's CPU matmul reads the
/// weights on one thread); elsewhere, and with the fused CPU paths switched off
/// ([`set_cpu_attention`]), MLX's matmul over a transposed view.
pub fn matmul_weight_t(x: &Array, w: &Array) -> Result<Array> {
    let shape = w.shape();
    let k = shape.last().copied().unwrap_or(0) as usize;
    if shape.len() == 2
        && k > 0
        && x.size() > 0
        && x.size() / k <= crate::cpu_row_product::max_rows()
        && x.dtype() == Dtype::F32
        && w.dtype() == Dtype::F32
        && cpu_attention()
        && crate::default_device()? == Device::Cpu
    {
        return Array::wrap(
            "matmul_weight_t",
            ffi::rows_times_weight_t(x.inner(), w.inner(), crate::cpu_row_product::max_rows()),
        );
    }
    x.matmul(&w.transpose(&[1, 0])?)
}

/// `act(gate) · up` as one fused node: [`silu_mul`] or [`gelu_tanh_mul`] as `gate` says.
pub fn gated_mul(gate: Gate, g: &Array, up: &Array) -> Result<Array> {
    match gate {
        Gate::Silu => silu_mul(g, up),
        Gate::GeluTanh => gelu_tanh_mul(g, up),
    }
}

/// `gelu_tanh(gate) · up` as one fused node (MLX `compile`, shapeless): Gemma's gated MLP
/// activation, one kernel instead of ten. `gate` and `up` must have one shape and dtype.
pub fn gelu_tanh_mul(gate: &Array, up: &Array) -> Result<Array> {
    Array::wrap(
        "gelu_tanh_mul",
        ffi::gated_activation(ffi::UnaryOp::GeluTanh, gate.inner(), up.inner()),
    )
}

/// The cosines and sines of RoPE angles for a set of positions ([`rope_angles`]): made once,
/// they serve every [`rope_with_angles`] over the same positions, e.g. every layer of a step.
#[derive(Clone, Debug)]
pub struct RopeAngles {
    cos: Array,
    sin: Array,
}

impl RopeAngles {
    /// The cosines and the sines, `[T, dims/2]` (one offset) or `[B, 1, T, dims/2]` (one
    /// per row).
    pub fn parts(&self) -> (&Array, &Array) {
        (&self.cos, &self.sin)
    }
}

/// The angles [`rope`] uses for positions `offset .. offset + t` under `cfg`, in `dtype`
/// (the input's), made by the ops and in the order MLX's own RoPE on the CPU uses, so
/// that [`rope_with_angles`] gives what [`rope`] gives there, bit for bit. On a GPU
/// [`rope`] is one fused kernel and needs none of this.
pub fn rope_angles(
    cfg: &Rope<'_>,
    offset: RopeOffset<'_>,
    t: i32,
    dtype: Dtype,
) -> Result<RopeAngles> {
    let scalar;
    let offset = match offset {
        RopeOffset::Scalar(o) => {
            scalar = Array::from_slice(&[o], &[])?;
            &scalar
        }
        RopeOffset::PerRow(o) => o,
    };
    let freqs = list("rope_angles", cfg.freqs.as_slice())?;
    let l = check(
        "rope_angles",
        ffi::rope_angles(
            t,
            offset.inner(),
            cfg.dims,
            cfg.base,
            cfg.freqs.is_none(),
            cfg.scale,
            &freqs,
            dtype.code(),
        ),
    )?;
    let mut parts = unlist("rope_angles", &l)?.into_iter();
    match (parts.next(), parts.next()) {
        (Some(cos), Some(sin)) => Ok(RopeAngles { cos, sin }),
        _ => Err(Error::InvalidArgument {
            op: "rope_angles",
            message: "MLX returned no angles".into(),
        }),
    }
}

/// [`rope`] of `x` `[B, H, T, D]` with angles from [`rope_angles`] made for `x`'s positions
/// and dtype under the same `cfg`. f32 on the CPU is one graph node ([`crate::cpu_rope`]),
/// unless the fused CPU paths are switched off ([`set_cpu_attention`]); elsewhere MLX's ops
/// in the order of its CPU fallback. Either way the result equals [`rope`]'s on the CPU bit
/// for bit.
pub fn rope_with_angles(x: &Array, cfg: &Rope<'_>, angles: &RopeAngles) -> Result<Array> {
    let one_node = x.dtype() == Dtype::F32
        && angles.cos.dtype() == Dtype::F32
        && cpu_attention()
        && crate::default_device()? == Device::Cpu;
    let rotate = if one_node {
        ffi::rope_rotate
    } else {
        ffi::rope_apply
    };
    Array::wrap(
        "rope_with_angles",
        rotate(
            x.inner(),
            angles.cos.inner(),
            angles.sin.inner(),
            cfg.dims,
            cfg.traditional,
        ),
    )
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
/// evaluated array), and one query (a decode step) stays in MLX's graph: f32 as one node of
/// [`one_query_attention`], other dtypes as a product per kv head, a softmax and a product
/// with the values; every other case, and
/// every GPU call, is MLX's kernel ([`mlx_scaled_dot_product_attention`]). docs/mlx.md,
/// "Attention on the CPU", says why.
pub fn scaled_dot_product_attention(
    q: &Array,
    k: &Array,
    v: &Array,
    scale: f32,
    mask: AttentionMask<'_>,
) -> Result<Array> {
    // The CPU paths: the switch on, no mask array, the CPU as the device (asked once).
    let cpu = !matches!(mask, AttentionMask::Array(_))
        && cpu_attention()
        && crate::default_device()? == Device::Cpu;
    if cpu {
        if let Some(dims) = cpu_attention_case(q, k, v, mask) {
            return attend_on_cpu(q, k, v, dims, scale, matches!(mask, AttentionMask::Causal));
        }
        if one_query_case(q, k, v) {
            if [q, k, v].iter().all(|a| a.dtype() == Dtype::F32) {
                return one_query_attention(q, k, v, scale);
            }
            return one_query_over_parts(q, &[(k, v)], scale);
        }
    }
    mlx_scaled_dot_product_attention(q, k, v, scale, mask)
}

/// `softmax(q kᵀ · scale) v` for f32 q `[B, Hq, 1, D]` and k, v `[B, Hkv, S, D]` on the CPU:
/// one graph node that runs [`crate::cpu_decode_attention`] on all cores when MLX evaluates
/// it, reading k and v in place (an arena's slice included).
pub fn one_query_attention(q: &Array, k: &Array, v: &Array, scale: f32) -> Result<Array> {
    Array::wrap(
        "one_query_attention",
        ffi::one_query_attention(q.inner(), k.inner(), v.inner(), scale),
    )
}

/// Whether a call on the CPU is a decode step (one query per head) that
/// [`one_query_over_parts`] computes in MLX's graph: scores as one product per kv head, a
/// softmax, a product with the values. MLX's CPU kernel for it measured slower
/// (docs/benchmarks.md, "Shared prefixes": a decode step over one part, 4K-16K keys).
fn one_query_case(q: &Array, k: &Array, v: &Array) -> bool {
    let (qs, ks, vs) = (q.shape(), k.shape(), v.shape());
    qs.len() == 4
        && ks.len() == 4
        && vs.len() == 4
        && vs[..3] == ks[..3]
        && qs[2] == 1
        && ks[2] > 0
        && ks[1] > 0
        && qs[1] % ks[1] == 0
        && qs[0] == ks[0]
        && qs[3] == ks[3]
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

/// The shape of a call on the CPU that the fused attention handles, or `None`.
fn cpu_attention_case(q: &Array, k: &Array, v: &Array, mask: AttentionMask<'_>) -> Option<Dims> {
    let causal = matches!(mask, AttentionMask::Causal);
    if [q, k, v].iter().any(|a| a.dtype() != Dtype::F32) {
        return None;
    }
    let (qs, ks, vs) = (q.shape(), k.shape(), v.shape());
    if qs.len() != 4 || ks != vs || ks.len() != 4 || qs[0] != ks[0] || qs[3] != ks[3] {
        return None;
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
        return None;
    }
    Some(dims)
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
    attend_parts_on_cpu(q, &[(k, v)], dims, scale, causal)
}

/// Evaluates q and every part's k and v as row-major buffers and runs the fused CPU
/// attention over the union of the parts (`dims.kv_len` keys in all).
fn attend_parts_on_cpu(
    q: &Array,
    parts: &[(&Array, &Array)],
    dims: Dims,
    scale: f32,
    causal: bool,
) -> Result<Array> {
    const OP: &str = "scaled_dot_product_attention";
    let q = q.contiguous()?;
    let kv: Vec<(Array, Array)> = parts
        .iter()
        .map(|(k, v)| Ok((k.contiguous()?, v.contiguous()?)))
        .collect::<Result<_>>()?;
    let mut all: Vec<&Array> = vec![&q];
    all.extend(kv.iter().flat_map(|(k, v)| [k, v]));
    crate::eval(&all)?;
    let qb = host_f32(OP, &q, dims.q_size())?;
    let per_token = dims.batch * dims.kv_heads * dims.head_dim;
    let mut host_parts = Vec::with_capacity(kv.len());
    for (k, v) in &kv {
        let len = k.shape().get(2).copied().unwrap_or(0) as usize;
        host_parts.push(cpu_attention::KvPart {
            k: host_f32(OP, k, len * per_token)?,
            v: host_f32(OP, v, len * per_token)?,
            len,
        });
    }
    let mut out = vec![0f32; dims.q_size()];
    cpu_attention::attend_parts(qb, &host_parts, &mut out, dims, scale, causal)
        .map_err(|message| Error::InvalidArgument { op: OP, message })?;
    let shape = [dims.batch, dims.q_heads, dims.q_len, dims.head_dim].map(|x| x as i32);
    Array::from_slice(&out, &shape)
}

/// Scores of one log-sum-exp slice stay below this many bytes (f32 `[B, Hq, rows, Lk]`).
const LSE_SLICE_BYTES: usize = 64 << 20;

/// Exact `softmax(q kᵀ · scale + mask) v` over the union of the key/value `parts` (each
/// `[B, Hkv, L_i, D]`, in sequence order), without concatenating them: the attention of a
/// sequence whose KV lives in several arrays (a shared prefix and a cache's own blocks).
/// With `causal_last` the causal mask applies to the last part only, bottom-right aligned
/// with it (its keys must number at least q's length); every query sees all keys of the
/// earlier parts. Parts of 0 keys are skipped. The output is shaped and typed like q.
///
/// One query (a decode step, any device) joins its scores against every part and
/// soft-maxes them once. On the CPU, f32 with more than one query runs the fused CPU
/// attention over the parts' blocks in turn ([`crate::cpu_attention::attend_parts`]).
/// Elsewhere each part goes through [`scaled_dot_product_attention`] with its log-sum-exp
/// (`q·kᵀ·scale`, then `logsumexp` over keys, in query slices of at most 64 MiB of
/// scores), merged as `o = Σ o_i · exp(lse_i − lse)`.
pub fn attention_over_parts(
    q: &Array,
    parts: &[(&Array, &Array)],
    scale: f32,
    causal_last: bool,
) -> Result<Array> {
    const OP: &str = "attention_over_parts";
    let bad = |message: String| Error::InvalidArgument { op: OP, message };
    let qs = q.shape();
    if qs.len() != 4 {
        return Err(bad(format!("q must be [B, Hq, L, D], got {qs:?}")));
    }
    for (i, (k, v)) in parts.iter().enumerate() {
        let (ks, vs) = (k.shape(), v.shape());
        if ks.len() != 4
            || vs.len() != 4
            || ks[..3] != vs[..3]
            || ks[0] != qs[0]
            || ks[3] != qs[3]
            || ks[1] == 0
            || qs[1] % ks[1] != 0
            || ks[1] != parts[0].0.shape()[1]
        {
            return Err(bad(format!(
                "part {i}: keys {ks:?} and values {vs:?} do not fit queries {qs:?}"
            )));
        }
    }
    let last_len = parts.last().map_or(0, |(k, _)| k.shape()[2]);
    if causal_last && last_len < qs[2] {
        return Err(bad(format!(
            "causal attention of {} queries needs a last part of as many keys, not {last_len}",
            qs[2]
        )));
    }
    let last = parts.len().saturating_sub(1);
    let live: Vec<(usize, &Array, &Array)> = parts
        .iter()
        .enumerate()
        .filter(|(_, (k, _))| k.shape()[2] > 0)
        .map(|(i, (k, v))| (i, *k, *v))
        .collect();
    let mask_of = |i: usize| match causal_last && i == last {
        true => AttentionMask::Causal,
        false => AttentionMask::None,
    };
    match live.as_slice() {
        [] => return Err(bad("no part holds a key".into())),
        [(i, k, v)] => return scaled_dot_product_attention(q, k, v, scale, mask_of(*i)),
        _ => {}
    }
    let pairs: Vec<(&Array, &Array)> = live.iter().map(|(_, k, v)| (*k, *v)).collect();
    if qs[2] == 1 {
        // A decode step: its one query sees every key of every part (a causal last part
        // included, bottom-right aligned), so one softmax over the joined scores does it.
        return one_query_over_parts(q, &pairs, scale);
    }
    if let Some(dims) = cpu_parts_case(q, &pairs)? {
        return attend_parts_on_cpu(q, &pairs, dims, scale, causal_last);
    }
    let mut outs = Vec::with_capacity(live.len());
    let mut lses = Vec::with_capacity(live.len());
    for (i, k, v) in &live {
        let causal = matches!(mask_of(*i), AttentionMask::Causal);
        outs.push(scaled_dot_product_attention(q, k, v, scale, mask_of(*i))?.astype(Dtype::F32)?);
        lses.push(log_sum_exp(q, k, scale, causal, LSE_SLICE_BYTES)?);
    }
    // lse = m + log Σ exp(lse_i − m), m the largest; o = Σ o_i · exp(lse_i − lse).
    let mut m = lses[0].clone();
    for l in &lses[1..] {
        m = m.maximum(l)?;
    }
    let mut total: Option<Array> = None;
    for l in &lses {
        let e = l.sub(&m)?.exp()?;
        total = Some(match total {
            Some(t) => t.add(&e)?,
            None => e,
        });
    }
    let Some(total) = total else {
        return Err(bad("no part holds a key".into()));
    };
    let lse = m.add(&total.log()?)?;
    let mut o: Option<Array> = None;
    for (oi, l) in outs.iter().zip(&lses) {
        let w = oi.mul(&l.sub(&lse)?.exp()?)?;
        o = Some(match o {
            Some(acc) => acc.add(&w)?,
            None => w,
        });
    }
    let o = o.ok_or_else(|| bad("no part holds a key".into()))?;
    o.astype(q.dtype())
}

/// [`attention_over_parts`] for one query per head (a decode step): the scores against
/// every part are joined (`[B, Hkv, G, 1, Σ S]`: scores only, no key or value is copied),
/// soft-maxed once in f32 and applied to each part's values. Exact like one attention over
/// the concatenated KV, in fewer graph nodes than a merge by log-sum-exp and reading each
/// part's keys once. The products run in the inputs' dtype, as MLX's unfused attention
/// does.
fn one_query_over_parts(q: &Array, parts: &[(&Array, &Array)], scale: f32) -> Result<Array> {
    let qs = q.shape();
    let (b, hq, d) = (qs[0], qs[1], qs[3]);
    let hkv = parts[0].0.shape()[1];
    let group = hq / hkv;
    let dv = parts[0].1.shape()[3];
    // The G q heads that read kv head h are G rows of one product: [B, Hkv, G, D] against
    // [B, Hkv, D, S] (no batch broadcast, which would copy the keys G times).
    let q = q.reshape(&[b, hkv, group, d])?.mul_scalar(scale as f64)?;
    let mut scores = Vec::with_capacity(parts.len());
    for (k, _) in parts {
        scores.push(q.matmul(&k.transpose(&[0, 1, 3, 2])?)?);
    }
    let refs: Vec<&Array> = scores.iter().collect();
    let p = crate::ops::concatenate(&refs, 3)?.softmax(-1, true)?;
    let mut o: Option<Array> = None;
    let mut start = 0;
    for (k, v) in parts {
        let n = k.shape()[2];
        let oi = p
            .slice(&[0, 0, 0, start], &[b, hkv, group, start + n])?
            .matmul(v)?;
        o = Some(match o {
            Some(acc) => acc.add(&oi)?,
            None => oi,
        });
        start += n;
    }
    let o = o.ok_or_else(|| Error::InvalidArgument {
        op: "attention_over_parts",
        message: "no part holds a key".into(),
    })?;
    o.reshape(&[b, hq, 1, dv])
}

/// `log Σ_j exp(q·k_jᵀ · scale)` over the keys each query sees (all of them, or with
/// `causal` those up to its bottom-right aligned position), f32 `[B, Hq, Lq, 1]`. Computed
/// in query slices so that no slice's scores exceed `slice_bytes` (at least one query per
/// slice).
fn log_sum_exp(
    q: &Array,
    k: &Array,
    scale: f32,
    causal: bool,
    slice_bytes: usize,
) -> Result<Array> {
    let (qs, ks) = (q.shape(), k.shape());
    let (b, hq, lq, d) = (qs[0], qs[1], qs[2], qs[3]);
    let (hkv, lk) = (ks[1], ks[2]);
    let group = hq / hkv;
    // q heads h·G .. (h+1)·G read kv head h: [B, Hkv, G, Lq, D] against [B, Hkv, 1, D, Lk].
    let q = q
        .astype(Dtype::F32)?
        .reshape(&[b, hkv, group, lq, d])?
        .mul_scalar(scale as f64)?;
    let kt = k
        .astype(Dtype::F32)?
        .transpose(&[0, 1, 3, 2])?
        .expand_dims(2)?;
    let row_bytes = (b * hq) as usize * lk as usize * 4;
    let rows = (slice_bytes / row_bytes.max(1)).clamp(1, lq.max(1) as usize) as i32;
    let shift = (lk - lq) as f64;
    let mut slices = Vec::new();
    let mut start = 0;
    while start < lq {
        let end = (start + rows).min(lq);
        let qslice = q.slice(&[0, 0, 0, start, 0], &[b, hkv, group, end, d])?;
        let mut scores = qslice.matmul(&kt)?;
        if causal {
            let qi = crate::ops::arange(start as f64 + shift, end as f64 + shift, 1.0, Dtype::F32)?
                .reshape(&[end - start, 1])?;
            let kj = crate::ops::arange(0.0, lk as f64, 1.0, Dtype::F32)?.reshape(&[1, lk])?;
            let zero = crate::ops::zeros(&[1], Dtype::F32)?;
            let hidden = crate::ops::full(&[1], f64::NEG_INFINITY, Dtype::F32)?;
            let mask = crate::ops::where_(&kj.le(&qi)?, &zero, &hidden)?;
            scores = scores.add(&mask)?;
        }
        slices.push(scores.logsumexp(-1, true)?);
        start = end;
    }
    let refs: Vec<&Array> = slices.iter().collect();
    let lse = match refs.as_slice() {
        [one] => (*one).clone(),
        _ => crate::ops::concatenate(&refs, 3)?,
    };
    lse.reshape(&[b, hq, lq, 1])
}

/// The shape of an [`attention_over_parts`] call the fused CPU attention handles (f32 on
/// the CPU, more than one query, switched on), or `None`.
fn cpu_parts_case(q: &Array, parts: &[(&Array, &Array)]) -> Result<Option<Dims>> {
    if !cpu_attention() || crate::default_device()? != Device::Cpu {
        return Ok(None);
    }
    if q.dtype() != Dtype::F32
        || parts
            .iter()
            .any(|(k, v)| k.dtype() != Dtype::F32 || v.dtype() != Dtype::F32)
    {
        return Ok(None);
    }
    let qs = q.shape();
    let ks = parts[0].0.shape();
    let dims = Dims {
        batch: qs[0] as usize,
        q_heads: qs[1] as usize,
        kv_heads: ks[1] as usize,
        q_len: qs[2] as usize,
        kv_len: parts.iter().map(|(k, _)| k.shape()[2] as usize).sum(),
        head_dim: qs[3] as usize,
    };
    // One query (a decode step) stays in MLX's graph, as in scaled_dot_product_attention.
    if dims.q_len < 2 || dims.check(false).is_err() {
        return Ok(None);
    }
    Ok(Some(dims))
}

/// The elements of an evaluated, row-contiguous f32 array (the output of `contiguous`
/// after eval), borrowed from MLX's buffer for as long as `a` lives.
fn host_f32<'a>(op: &'static str, a: &'a Array, len: usize) -> Result<&'a [f32]> {
    if a.size() != len || a.dtype() != Dtype::F32 {
        return Err(Error::InvalidArgument {
            op,
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether `got` equals `want` bit for bit on the CPU, where the fused CPU paths
    /// compute what MLX's own ops compute. Elsewhere MLX's kernels differ from the fused
    /// paths in rounding (reduction order, the device's sin and cos): there each element
    /// must be within a few units of `dtype`'s last place, which a wrong formula misses.
    fn same_bits_on_the_cpu(got: &[f32], want: &[f32], dtype: Dtype) -> bool {
        if crate::default_device().unwrap() == Device::Cpu {
            return got
                .iter()
                .zip(want)
                .all(|(a, b)| a.to_bits() == b.to_bits());
        }
        let rel = match dtype {
            Dtype::BF16 => 1.6e-2,
            Dtype::F16 => 2e-3,
            _ => 1e-5,
        };
        got.iter()
            .zip(want)
            .all(|(a, b)| (a - b).abs() <= rel * (1.0 + b.abs()))
    }

    #[test]
    fn rope_with_shared_angles_equals_rope_on_the_cpu_bit_for_bit() {
        let key = crate::random::key(5).unwrap();
        let periods = Array::from_slice(&[1.0f32, 3.5, 40.0, 900.0], &[4]).unwrap();
        for (dtype, traditional, dims, freqs, scale, offset, t) in [
            (Dtype::F32, false, 16, None, 1.0, 7, 1),
            (Dtype::F32, false, 16, None, 1.0, 0, 5),
            (Dtype::F32, true, 16, None, 0.5, 511, 3),
            (Dtype::F32, false, 8, Some(&periods), 1.0, 100, 1),
            (Dtype::BF16, false, 16, None, 1.0, 4095, 2),
            (Dtype::BF16, true, 8, None, 1.0, 33, 1),
        ] {
            let x = crate::random::normal(&[2, 3, t, 16], Dtype::F32, &key)
                .unwrap()
                .astype(dtype)
                .unwrap();
            let cfg = Rope {
                dims,
                traditional,
                base: 10000.0,
                scale,
                freqs,
            };
            let want = rope(&x, &cfg, RopeOffset::Scalar(offset)).unwrap();
            let angles = rope_angles(&cfg, RopeOffset::Scalar(offset), t, dtype).unwrap();
            let got = rope_with_angles(&x, &cfg, &angles).unwrap();
            let bits = |a: &Array| a.astype(Dtype::F32).unwrap().to_vec::<f32>().unwrap();
            assert_eq!(got.shape(), want.shape());
            assert_eq!(got.dtype(), dtype);
            let (g, w) = (bits(&got), bits(&want));
            assert!(
                same_bits_on_the_cpu(&g, &w, dtype),
                "{dtype:?} traditional {traditional} dims {dims} offset {offset} t {t}"
            );
            // Per-row positions (a decode step of two rows).
            if t == 1 {
                let rows = Array::from_slice(&[offset, offset + 9], &[2]).unwrap();
                let want = rope(&x, &cfg, RopeOffset::PerRow(&rows)).unwrap();
                let angles = rope_angles(&cfg, RopeOffset::PerRow(&rows), 1, dtype).unwrap();
                let got = rope_with_angles(&x, &cfg, &angles).unwrap();
                let (g, w) = (bits(&got), bits(&want));
                assert!(same_bits_on_the_cpu(&g, &w, dtype), "{dtype:?} per row");
            }
        }
        let x = Array::from_slice(&[0.0f32; 8], &[2, 4]).unwrap();
        let cfg = Rope {
            dims: 4,
            traditional: false,
            base: 10000.0,
            scale: 1.0,
            freqs: None,
        };
        let angles = rope_angles(&cfg, RopeOffset::Scalar(0), 2, Dtype::F32).unwrap();
        assert!(
            rope_with_angles(&x, &cfg, &angles).is_err(),
            "not [B, H, T, D]"
        );
    }

    #[test]
    fn rms_norm_on_the_cpu_is_a_few_nodes_and_checks_its_weight() {
        let x = crate::random::normal(&[2, 3, 64], Dtype::F32, &crate::random::key(3).unwrap())
            .unwrap();
        let w = Array::from_slice(&[0.5f32; 64], &[64]).unwrap();
        crate::eval(&[&x, &w]).unwrap();
        let y = rms_norm(&x, Some(&w), 1e-5).unwrap();
        let nodes = crate::pending_primitives(&[&y]).unwrap();
        assert!(nodes.len() <= 4, "{nodes:?}");
        // Against the formula on the host, row by row.
        let (xs, ys) = (x.to_vec::<f32>().unwrap(), y.to_vec::<f32>().unwrap());
        for (xr, yr) in xs.chunks(64).zip(ys.chunks(64)) {
            let ms = xr.iter().map(|v| v * v).sum::<f32>() / 64.0;
            let inv = 1.0 / (ms + 1e-5).sqrt();
            for (a, b) in xr.iter().zip(yr) {
                assert!(
                    (a * inv * 0.5 - b).abs() <= 1e-5 * (1.0 + b.abs()),
                    "{a} {b}"
                );
            }
        }
        let short = Array::from_slice(&[1.0f32; 8], &[8]).unwrap();
        assert!(
            rms_norm(&x, Some(&short), 1e-5).is_err(),
            "weight of the wrong length"
        );
        let unweighted = rms_norm(&x, None, 1e-5).unwrap().to_vec::<f32>().unwrap();
        assert!(unweighted
            .iter()
            .zip(&ys)
            .all(|(u, y)| (u * 0.5 - y).abs() < 1e-6));
    }

    #[test]
    fn rms_norm_on_the_cpu_gives_the_bits_of_its_unfused_ops() {
        // MLX's own CPU RMSNorm, op by op: in f32, then the output dtype times the weight.
        let unfused = |x: &Array, w: &Array, eps: f32| -> Array {
            let xf = x.astype(Dtype::F32).unwrap();
            let ms = xf.square().unwrap().mean(-1, true).unwrap();
            let eps = Array::from_slice(&[eps], &[]).unwrap();
            let y = xf.mul(&ms.add(&eps).unwrap().rsqrt().unwrap()).unwrap();
            y.astype(w.dtype()).unwrap().mul(w).unwrap()
        };
        for (dtype, shape) in [
            (Dtype::F32, vec![3, 7, 576]),
            (Dtype::BF16, vec![2, 5, 1, 128]),
            (Dtype::F16, vec![1, 1, 64]),
        ] {
            let key = crate::random::key(11).unwrap();
            let x = crate::random::normal(&shape, Dtype::F32, &key)
                .unwrap()
                .mul_scalar(3.0)
                .unwrap()
                .astype(dtype)
                .unwrap();
            let n = *shape.last().unwrap();
            let w = crate::random::normal(&[n], Dtype::F32, &crate::random::key(12).unwrap())
                .unwrap()
                .astype(dtype)
                .unwrap();
            crate::eval(&[&x, &w]).unwrap();
            let bits = |a: &Array| a.astype(Dtype::F32).unwrap().to_vec::<f32>().unwrap();
            let (got, want) = (
                bits(&rms_norm(&x, Some(&w), 1e-5).unwrap()),
                bits(&unfused(&x, &w, 1e-5)),
            );
            assert!(same_bits_on_the_cpu(&got, &want, dtype), "{dtype:?}");
        }
    }

    /// The stacked activations: on the CPU one lazy node of the kernel for any rows, within
    /// 2e-6 of MLX's ops (relative above 1, absolute below).
    #[test]
    fn the_stacked_gated_activations_equal_their_halves_through_mlx() {
        for gate in [Gate::Silu, Gate::GeluTanh] {
            for rows in [1, 15, 16, 40] {
                let key = crate::random::key(rows as u64).unwrap();
                let y = crate::random::normal(&[1, rows, 2 * 24], Dtype::F32, &key)
                    .unwrap()
                    .mul_scalar(4.0)
                    .unwrap();
                y.eval().unwrap();
                let g = y.slice(&[0, 0, 0], &[1, rows, 24]).unwrap();
                let up = y.slice(&[0, 0, 24], &[1, rows, 48]).unwrap();
                let want = match gate {
                    Gate::Silu => silu_mul(&g, &up),
                    Gate::GeluTanh => gelu_tanh_mul(&g, &up),
                };
                let want = want.unwrap().to_vec::<f32>().unwrap();
                let got = gated_mul_stacked(gate, &y).unwrap();
                assert_eq!(got.shape(), vec![1, rows, 24]);
                if crate::default_device().unwrap() == Device::Cpu && cpu_attention() {
                    let names = crate::pending_primitives(&[&got]).unwrap();
                    assert_eq!(names, vec!["GatedMulStacked".to_string()], "{rows} rows");
                }
                let got = got.to_vec::<f32>().unwrap();
                for (a, b) in got.iter().zip(&want) {
                    // MLX's tanh GELU, 0.5·x·(1 + tanh z), cancels where tanh z is near −1:
                    // below 1 the bound is absolute (the kernel is checked against f64 in
                    // cpu_activation's own tests).
                    assert!(
                        (a - b).abs() <= 2e-6 * b.abs().max(1.0),
                        "{gate:?}: {a} vs {b}"
                    );
                }
            }
        }
        let odd = Array::from_slice(&[1.0f32; 3], &[1, 3]).unwrap();
        assert!(gated_mul_stacked(Gate::Silu, &odd).is_err());
    }

    #[test]
    fn fused_gated_activations_equal_their_unfused_graphs_in_one_node() {
        let g = Array::from_slice(&[-3.0f32, -0.5, 0.0, 0.25, 1.0, 4.0], &[2, 3]).unwrap();
        let u = Array::from_slice(&[1.0f32, 2.0, -1.0, 0.5, -2.0, 3.0], &[2, 3]).unwrap();
        for dtype in [Dtype::F32, Dtype::BF16] {
            let (g, u) = (g.astype(dtype).unwrap(), u.astype(dtype).unwrap());
            crate::eval(&[&g, &u]).unwrap();
            let fused = silu_mul(&g, &u).unwrap();
            let nodes = crate::pending_primitives(&[&fused]).unwrap();
            assert_eq!(nodes.len(), 1, "{dtype:?}: {nodes:?}");
            let want = g.silu().unwrap().mul(&u).unwrap();
            let close = |a: &Array, b: &Array| {
                let (a, b) = (a.astype(Dtype::F32).unwrap(), b.astype(Dtype::F32).unwrap());
                let (a, b) = (a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
                let tol = if dtype == Dtype::F32 { 1e-6 } else { 2e-2 };
                a.iter()
                    .zip(&b)
                    .all(|(x, y)| (x - y).abs() <= tol * (1.0 + y.abs()))
            };
            assert!(close(&fused, &want), "silu_mul {dtype:?}");
            assert_eq!(fused.shape(), [2, 3]);
            assert_eq!(fused.dtype(), dtype);
            let fused = gelu_tanh_mul(&g, &u).unwrap();
            let want = g.gelu_tanh().unwrap().mul(&u).unwrap();
            assert!(close(&fused, &want), "gelu_tanh_mul {dtype:?}");
        }
        // Halves of one product, as the stacked gate/up projection gives them (strided views).
        let both =
            Array::from_slice(&[-1.0f32, 0.5, 2.0, 3.0, -4.0, 1.5, 0.0, 2.5], &[2, 4]).unwrap();
        let (g2, u2) = (
            both.slice(&[0, 0], &[2, 2]).unwrap(),
            both.slice(&[0, 2], &[2, 4]).unwrap(),
        );
        let got = silu_mul(&g2, &u2).unwrap().to_vec::<f32>().unwrap();
        let want = g2
            .silu()
            .unwrap()
            .mul(&u2)
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        assert!(
            got.iter().zip(&want).all(|(a, b)| (a - b).abs() < 1e-6),
            "{got:?} {want:?}"
        );
        // Another shape after the first trace (shapeless): still right.
        let g3 = Array::from_slice(&[2.0f32; 4], &[4]).unwrap();
        let got = silu_mul(&g3, &g3).unwrap().to_vec::<f32>().unwrap();
        let want = 2.0 * 2.0 / (1.0 + (-2.0f32).exp());
        assert!(got.iter().all(|x| (x - want).abs() < 1e-5), "{got:?}");
        assert!(silu_mul(&g, &g3).is_err(), "shapes differ");
        assert!(
            silu_mul(&g, &g.astype(Dtype::BF16).unwrap()).is_err(),
            "dtypes differ"
        );
    }

    #[test]
    fn log_sum_exp_in_query_slices_equals_one_slice() {
        let (kq, kk) = crate::random::split(&crate::random::key(7).unwrap()).unwrap();
        let q = crate::random::normal(&[1, 6, 37, 16], Dtype::F32, &kq).unwrap();
        let k = crate::random::normal(&[1, 2, 45, 16], Dtype::F32, &kk).unwrap();
        for causal in [false, true] {
            let whole = log_sum_exp(&q, &k, 0.25, causal, usize::MAX).unwrap();
            // One row of scores per slice, then a few: 1 × 6 × 45 × 4 bytes each.
            for rows in [1, 5] {
                let sliced = log_sum_exp(&q, &k, 0.25, causal, rows * 6 * 45 * 4).unwrap();
                assert_eq!(sliced.shape(), vec![1, 6, 37, 1]);
                let (a, b) = (
                    whole.to_vec::<f32>().unwrap(),
                    sliced.to_vec::<f32>().unwrap(),
                );
                for (x, y) in a.iter().zip(&b) {
                    assert!((x - y).abs() <= 1e-5 * x.abs().max(1.0), "{x} vs {y}");
                }
            }
        }
    }
}
