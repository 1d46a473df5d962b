//! Layers shared by every architecture: linear (dense or quantized), embedding (with the tied
//! LM head), RMS norm, SwiGLU MLP, rotary embedding settings (incl. Llama 3 scaling) and
//! attention over a [`KvCache`].

use cache::{KvCache, PagedKvRows};
use mlx::fast::{self, AttentionMask, Rope, RopeAngles, RopeOffset};
use mlx::{Array, Dtype, Quantized};
use serde::Deserialize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

use crate::error::{EngineError, Result};
use crate::pass_memory::{
    holds_activations, layer_activation_bytes, layer_score_bytes, materializes_scores, LayerWidths,
    PassMemory,
};

/// A linear layer `y = x Wᵀ (+ b)`, with W either a dense matrix or MLX-affine quantized.
#[derive(Debug)]
pub(crate) struct Linear {
    weight: LinearWeight,
    bias: Option<Array>,
}

#[derive(Debug)]
enum LinearWeight {
    Dense(Array),
    Quantized(Quantized),
}

impl LinearWeight {
    fn arrays(&self) -> Vec<&Array> {
        match self {
            LinearWeight::Dense(w) => vec![w],
            LinearWeight::Quantized(q) => vec![&q.packed, &q.scales, &q.biases],
        }
    }
}

impl Linear {
    pub(crate) fn dense(w: Array, bias: Option<Array>) -> Self {
        Linear {
            weight: LinearWeight::Dense(w),
            bias,
        }
    }

    pub(crate) fn quantized(q: Quantized, bias: Option<Array>) -> Self {
        Linear {
            weight: LinearWeight::Quantized(q),
            bias,
        }
    }

    /// Output features (rows of the weight).
    pub(crate) fn out_features(&self) -> Option<i32> {
        match &self.weight {
            LinearWeight::Dense(w) => w.shape().first().copied(),
            LinearWeight::Quantized(q) => q.packed.shape().first().copied(),
        }
    }

    /// `x` `[.., in]` → `[.., out]`.
    pub(crate) fn forward(&self, x: &Array) -> Result<Array> {
        let y = match &self.weight {
            LinearWeight::Dense(w) => fast::matmul_weight_t(x, w)?,
            LinearWeight::Quantized(q) => mlx::quantized_matmul(x, q, true)?,
        };
        Ok(match &self.bias {
            Some(b) => y.add(b)?,
            None => y,
        })
    }
}

/// Several linear layers over the same input computed as one: their weights stacked along
/// the output axis, one matmul, the result split back per layer (q/k/v, gate/up, as vLLM
/// merges them). A decode step reads the same weight bytes in fewer, larger kernels.
/// Layers that cannot be stacked (dense beside quantized, different quantization or
/// dtype, a bias on some only) stay separate and run one by one.
#[derive(Debug)]
pub(crate) struct FusedLinear {
    parts: FusedParts,
}

#[derive(Debug)]
enum FusedParts {
    /// The stacked layer and each part's output width, in order.
    Stacked(Linear, Vec<i32>),
    Separate(Vec<Linear>),
}

impl FusedLinear {
    /// The width of the parts' outputs together (`None` for a weight whose shape is
    /// unknown).
    pub(crate) fn out_width(&self) -> Option<usize> {
        let w: Option<i32> = match &self.parts {
            FusedParts::Stacked(_, widths) => Some(widths.iter().sum()),
            FusedParts::Separate(parts) => parts.iter().map(Linear::out_features).sum(),
        };
        w.map(|w| w as usize)
    }

    /// Stacks `parts` when their weights allow it (see the type's docs) and the process
    /// stacks projections ([`stack_projections`]).
    pub(crate) fn new(parts: Vec<Linear>) -> Result<Self> {
        Self::stacked_if(parts, stack_projections())
    }

    /// [`FusedLinear::new`] with stacking asked for (`stack`) or not.
    fn stacked_if(parts: Vec<Linear>, stack: bool) -> Result<Self> {
        let Some(widths) = parts
            .iter()
            .map(Linear::out_features)
            .collect::<Option<Vec<i32>>>()
            .filter(|_| stack && parts.len() > 1 && stackable(&parts))
        else {
            return Ok(FusedLinear {
                parts: FusedParts::Separate(parts),
            });
        };
        let bias = match parts[0].bias {
            Some(_) => {
                let b: Vec<&Array> = parts.iter().filter_map(|p| p.bias.as_ref()).collect();
                Some(mlx::ops::concatenate(&b, 0)?)
            }
            None => None,
        };
        let weight = match &parts[0].weight {
            LinearWeight::Dense(_) => {
                let w: Vec<&Array> = parts
                    .iter()
                    .filter_map(|p| match &p.weight {
                        LinearWeight::Dense(w) => Some(w),
                        LinearWeight::Quantized(_) => None,
                    })
                    .collect();
                LinearWeight::Dense(mlx::ops::concatenate(&w, 0)?)
            }
            LinearWeight::Quantized(q0) => {
                let qs: Vec<&Quantized> = parts
                    .iter()
                    .filter_map(|p| match &p.weight {
                        LinearWeight::Quantized(q) => Some(q),
                        LinearWeight::Dense(_) => None,
                    })
                    .collect();
                let cat = |f: fn(&Quantized) -> &Array| {
                    let a: Vec<&Array> = qs.iter().map(|q| f(q)).collect();
                    mlx::ops::concatenate(&a, 0)
                };
                LinearWeight::Quantized(Quantized {
                    packed: cat(|q| &q.packed)?,
                    scales: cat(|q| &q.scales)?,
                    biases: cat(|q| &q.biases)?,
                    spec: q0.spec,
                })
            }
        };
        let stacked = Linear { weight, bias };
        // Stack now, at load, not inside the first forward pass; the parts' buffers go.
        let mut arrays = stacked.weight.arrays();
        arrays.extend(stacked.bias.iter());
        mlx::eval(&arrays)?;
        Ok(FusedLinear {
            parts: FusedParts::Stacked(stacked, widths),
        })
    }

    /// `x` `[.., in]` → one `[.., out_i]` per part, in order, for a layer of `N` parts.
    pub(crate) fn forward<const N: usize>(&self, x: &Array) -> Result<[Array; N]> {
        let out = self.forward_all(x)?;
        let n = out.len() as i32;
        out.try_into().map_err(|_| EngineError::ShapeMismatch {
            name: "outputs of a fused linear layer".into(),
            expected: vec![N as i32],
            actual: vec![n],
        })
    }

    /// `act(gate(x)) · up(x)` of a layer of two parts, gate then up: over their stacked
    /// product when they are stacked with one width (on the CPU this crate's kernel,
    /// [`mlx::fast::gated_mul_stacked`]), else over the two outputs.
    pub(crate) fn gated(&self, x: &Array, gate: mlx::fast::Gate) -> Result<Array> {
        if let FusedParts::Stacked(linear, widths) = &self.parts {
            if widths.len() == 2 && widths[0] == widths[1] {
                return Ok(mlx::fast::gated_mul_stacked(gate, &linear.forward(x)?)?);
            }
        }
        let [g, u] = self.forward(x)?;
        Ok(mlx::fast::gated_mul(gate, &g, &u)?)
    }

    fn forward_all(&self, x: &Array) -> Result<Vec<Array>> {
        match &self.parts {
            FusedParts::Separate(parts) => parts.iter().map(|p| p.forward(x)).collect(),
            FusedParts::Stacked(linear, widths) => {
                let y = linear.forward(x)?;
                let shape = y.shape().to_vec();
                let last = shape.len() - 1;
                let mut start = vec![0; shape.len()];
                let mut stop = shape.clone();
                let mut out = Vec::with_capacity(widths.len());
                for w in widths {
                    stop[last] = start[last] + w;
                    out.push(y.slice(&start, &stop)?);
                    start[last] = stop[last];
                }
                Ok(out)
            }
        }
    }
}

/// Whether this process stacks the projections that share an input: yes unless
/// `KVSTORE_STACK_PROJECTIONS=0` when the first model loads. The switch is for measuring
/// whether separate products, which MLX's CUDA graphs might run side by side, decode faster:
/// on the H100 they did not (docs/engine.md, session 50).
fn stack_projections() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("KVSTORE_STACK_PROJECTIONS").map_or(true, |v| v != "0"))
}

/// Whether linear layers can be stacked into one: all dense of one dtype, or all quantized
/// alike; a bias on all or on none.
fn stackable(parts: &[Linear]) -> bool {
    let first = &parts[0];
    parts.iter().all(|p| {
        p.bias.is_some() == first.bias.is_some()
            && match (&p.weight, &first.weight) {
                (LinearWeight::Dense(a), LinearWeight::Dense(b)) => {
                    a.dtype() == b.dtype() && a.shape()[1..] == b.shape()[1..]
                }
                (LinearWeight::Quantized(a), LinearWeight::Quantized(b)) => {
                    a.spec == b.spec
                        && a.scales.dtype() == b.scales.dtype()
                        && a.packed.shape()[1..] == b.packed.shape()[1..]
                }
                _ => false,
            }
    })
}

/// A token embedding table `[vocab, hidden]`, dense or quantized; doubles as the LM head when
/// the model ties its embeddings.
#[derive(Debug)]
pub(crate) enum Embedding {
    Dense(Array),
    Quantized(Quantized),
}

impl Embedding {
    /// `ids` (uint32, any shape) → `[.., hidden]`.
    pub(crate) fn forward(&self, ids: &Array) -> Result<Array> {
        Ok(match self {
            Embedding::Dense(t) => t.take(ids, 0)?,
            Embedding::Quantized(q) => {
                let rows = Quantized {
                    packed: q.packed.take(ids, 0)?,
                    scales: q.scales.take(ids, 0)?,
                    biases: q.biases.take(ids, 0)?,
                    spec: q.spec,
                };
                mlx::dequantize(&rows)?
            }
        })
    }

    /// The tied LM head: `x` `[.., hidden]` → logits `[.., vocab]`.
    pub(crate) fn as_linear(&self, x: &Array) -> Result<Array> {
        Ok(match self {
            Embedding::Dense(t) => fast::matmul_weight_t(x, t)?,
            Embedding::Quantized(q) => mlx::quantized_matmul(x, q, true)?,
        })
    }

    /// The dtype activations take after the lookup.
    pub(crate) fn dtype(&self) -> Dtype {
        match self {
            Embedding::Dense(t) => t.dtype(),
            Embedding::Quantized(q) => q.scales.dtype(),
        }
    }
}

/// RMS normalization with a learned scale.
#[derive(Debug)]
pub(crate) struct RmsNorm {
    pub(crate) weight: Array,
    pub(crate) eps: f32,
}

impl RmsNorm {
    pub(crate) fn forward(&self, x: &Array) -> Result<Array> {
        Ok(fast::rms_norm(x, Some(&self.weight), self.eps)?)
    }
}

/// The gated MLP of llama and qwen: `down(silu(gate(x)) · up(x))`.
#[derive(Debug)]
pub(crate) struct Mlp {
    /// gate_proj and up_proj, stacked.
    pub(crate) gate_up: FusedLinear,
    pub(crate) down_proj: Linear,
}

impl Mlp {
    /// The MLP of `gate_proj`, `up_proj` and `down_proj`.
    pub(crate) fn new(gate_proj: Linear, up_proj: Linear, down_proj: Linear) -> Result<Self> {
        Ok(Mlp {
            gate_up: FusedLinear::new(vec![gate_proj, up_proj])?,
            down_proj,
        })
    }

    pub(crate) fn forward(&self, x: &Array) -> Result<Array> {
        let h = self.gate_up.gated(x, mlx::fast::Gate::Silu)?;
        self.down_proj.forward(&h)
    }
}

/// `rope_scaling` of a Hugging Face config (`type` or `rope_type`).
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct RopeScaling {
    /// `llama3`, `linear` or `default`.
    #[serde(alias = "type")]
    pub rope_type: String,
    /// The scaling factor.
    #[serde(default)]
    pub factor: Option<f64>,
    /// Llama 3: wavelengths above `original / low_freq_factor` are scaled fully.
    #[serde(default)]
    pub low_freq_factor: Option<f64>,
    /// Llama 3: wavelengths below `original / high_freq_factor` are kept.
    #[serde(default)]
    pub high_freq_factor: Option<f64>,
    /// Llama 3: the context the model was pre-trained with.
    #[serde(default)]
    pub original_max_position_embeddings: Option<f64>,
}

/// Rotary embedding of one model: the fused kernel's settings.
#[derive(Debug)]
pub(crate) struct RotaryEmbedding {
    dims: i32,
    traditional: bool,
    base: f32,
    scale: f32,
    freqs: Option<Array>,
    /// On the CPU, the angles of the positions rotated last (`None` on a GPU).
    angles: Option<AngleCache>,
}

/// The positions a rotation was made for: one offset, or one per row (that very array).
#[derive(Debug)]
enum AngleKey {
    Scalar(i32),
    PerRow(Array),
}

impl AngleKey {
    fn matches(&self, offset: RopeOffset<'_>) -> bool {
        match (self, offset) {
            (AngleKey::Scalar(a), RopeOffset::Scalar(b)) => *a == b,
            // The key holds its array, so no other array can take over its node meanwhile.
            (AngleKey::PerRow(a), RopeOffset::PerRow(b)) => a.same_node(b),
            _ => false,
        }
    }
}

/// The last angles a CPU rotation made: MLX's CPU RoPE computes the frequencies, cosines
/// and sines again at every call (29 graph nodes a call on a decode step), though every
/// layer of a step rotates its queries and keys at the same positions. Kept, they are made
/// once a step and each call is the rotation alone (docs/engine.md, "Forward pass").
#[derive(Debug, Default)]
struct AngleCache(Mutex<Option<(AngleKey, i32, Dtype, RopeAngles)>>);

impl AngleCache {
    /// The angles for `offset` and `t` positions in `dtype`, made now or kept.
    fn get(
        &self,
        cfg: &Rope<'_>,
        offset: RopeOffset<'_>,
        t: i32,
        dtype: Dtype,
    ) -> Result<RopeAngles> {
        let mut kept = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((key, kt, kd, angles)) = kept.as_ref() {
            if key.matches(offset) && *kt == t && *kd == dtype {
                return Ok(angles.clone());
            }
        }
        let angles = fast::rope_angles(cfg, offset, t, dtype)?;
        let key = match offset {
            RopeOffset::Scalar(o) => AngleKey::Scalar(o),
            RopeOffset::PerRow(a) => AngleKey::PerRow(a.clone()),
        };
        *kept = Some((key, t, dtype, angles.clone()));
        Ok(angles)
    }
}

impl RotaryEmbedding {
    /// Settings from `rope_theta` and `rope_scaling`; unknown scaling types are rejected.
    pub(crate) fn new(
        dims: usize,
        theta: f64,
        traditional: bool,
        scaling: Option<&RopeScaling>,
        source: &str,
    ) -> Result<Self> {
        let mut rope = RotaryEmbedding {
            dims: dims as i32,
            traditional,
            base: theta as f32,
            scale: 1.0,
            freqs: None,
            angles: (mlx::default_device()? == mlx::Device::Cpu).then(AngleCache::default),
        };
        let Some(s) = scaling else { return Ok(rope) };
        let need = |v: Option<f64>, name: &str| {
            v.ok_or_else(|| EngineError::config(source, format!("rope_scaling needs {name}")))
        };
        match s.rope_type.as_str() {
            "default" => {}
            "linear" => rope.scale = (1.0 / need(s.factor, "factor")?) as f32,
            "llama3" => {
                let factor = need(s.factor, "factor")?;
                let low = need(s.low_freq_factor, "low_freq_factor")?;
                let high = need(s.high_freq_factor, "high_freq_factor")?;
                let old = need(
                    s.original_max_position_embeddings,
                    "original_max_position_embeddings",
                )?;
                let (low_wl, high_wl) = (old / low, old / high);
                // MLX's kernel takes the per-pair periods base^(2i/d), as mlx-lm computes them.
                let freqs: Vec<f32> = (0..dims / 2)
                    .map(|i| {
                        let f = theta.powf((2 * i) as f64 / dims as f64);
                        let wavelen = 2.0 * std::f64::consts::PI * f;
                        let scaled = if wavelen > low_wl { f * factor } else { f };
                        if wavelen > high_wl && wavelen < low_wl {
                            let smooth = (old / wavelen - low) / (high - low);
                            (scaled / ((1.0 - smooth) / factor + smooth)) as f32
                        } else {
                            scaled as f32
                        }
                    })
                    .collect();
                rope.freqs = Some(Array::from_slice(&freqs, &[freqs.len() as i32])?);
            }
            other => {
                return Err(EngineError::config(
                    source,
                    format!("rope_scaling type {other:?} is not supported (llama3, linear)"),
                ))
            }
        }
        Ok(rope)
    }

    /// Rotates `x` `[1, H, L, D]` for positions `offset..offset + L`.
    pub(crate) fn forward(&self, x: &Array, offset: usize) -> Result<Array> {
        self.rotate(x, RopeOffset::Scalar(offset as i32))
    }

    /// Rotates `x` `[B, H, 1, D]`, row b at position `offsets[b]` (int32 `[B]`).
    pub(crate) fn forward_rows(&self, x: &Array, offsets: &Array) -> Result<Array> {
        self.rotate(x, RopeOffset::PerRow(offsets))
    }

    fn rotate(&self, x: &Array, offset: RopeOffset<'_>) -> Result<Array> {
        let cfg = Rope {
            dims: self.dims,
            traditional: self.traditional,
            base: self.base,
            scale: self.scale,
            freqs: self.freqs.as_ref(),
        };
        let shape = x.shape();
        match &self.angles {
            Some(cache) if shape.len() == 4 => {
                let angles = cache.get(&cfg, offset, shape[2], x.dtype())?;
                Ok(fast::rope_with_angles(x, &cfg, &angles)?)
            }
            _ => Ok(fast::rope(x, &cfg, offset)?),
        }
    }
}

/// Multi-head (grouped-query) self-attention: q/k/v/o projections, optional per-head q/k
/// RMS norms (qwen3), rotary embedding, the KV cache and fused SDPA.
#[derive(Debug)]
pub(crate) struct Attention {
    /// q_proj, k_proj and v_proj, stacked.
    pub(crate) qkv: FusedLinear,
    pub(crate) o_proj: Linear,
    pub(crate) q_norm: Option<RmsNorm>,
    pub(crate) k_norm: Option<RmsNorm>,
    pub(crate) num_heads: i32,
    pub(crate) num_kv_heads: i32,
    pub(crate) head_dim: i32,
    pub(crate) scale: f32,
}

impl Attention {
    /// Projections of `x` `[B, L, hidden]`, split into heads, normalized (qwen3) and moved
    /// to `[B, H, L, D]`, before RoPE.
    pub(crate) fn heads(&self, x: &Array) -> Result<(Array, Array, Array)> {
        let (b, l) = (x.shape()[0], x.shape()[1]);
        // 1. Projections (one matmul).
        let [q, k, v] = self.qkv.forward(x)?;
        self.split_heads(&q, &k, &v, b, l)
    }

    /// Projected `q`, `k`, `v` of `[B, L]` tokens (any shape holding them in that order)
    /// split into heads, normalized (qwen3) and moved to `[B, H, L, D]`, before RoPE.
    fn split_heads(
        &self,
        q: &Array,
        k: &Array,
        v: &Array,
        b: i32,
        l: i32,
    ) -> Result<(Array, Array, Array)> {
        // (B, L, H·D) -> (B, L, H, D); one token a row goes straight to (B, H, 1, D), the
        // same values in the same order, one view instead of two (a decode step's heads).
        let heads = |a: &Array, h: i32| match l {
            1 => a.reshape(&[b, h, 1, self.head_dim]),
            _ => a.reshape(&[b, l, h, self.head_dim]),
        };
        let q = heads(q, self.num_heads)?;
        let k = heads(k, self.num_kv_heads)?;
        let v = heads(v, self.num_kv_heads)?;
        // 2. qwen3 normalizes each head's q and k before rotating them.
        let q = match &self.q_norm {
            Some(n) => n.forward(&q)?,
            None => q,
        };
        let k = match &self.k_norm {
            Some(n) => n.forward(&k)?,
            None => k,
        };
        // 3. (B, L, H, D) -> (B, H, L, D).
        if l == 1 {
            return Ok((q, k, v));
        }
        Ok((
            q.transpose(&[0, 2, 1, 3])?,
            k.transpose(&[0, 2, 1, 3])?,
            v.transpose(&[0, 2, 1, 3])?,
        ))
    }

    /// Attention output `[B, H, L, D]` -> `[B, L, H·D]` -> output projection.
    pub(crate) fn output(&self, o: &Array) -> Result<Array> {
        let (b, l) = (o.shape()[0], o.shape()[2]);
        self.o_proj.forward(&self.merge_heads(o, b, l)?)
    }

    /// Heads `[B, H, L, D]` -> `[B, L, H·D]`; with one token a row a reshape alone.
    fn merge_heads(&self, o: &Array, b: i32, l: i32) -> Result<Array> {
        let width = self.num_heads * self.head_dim;
        Ok(match l {
            1 => o.reshape(&[b, 1, width])?,
            _ => o.transpose(&[0, 2, 1, 3])?.reshape(&[b, l, width])?,
        })
    }

    /// `x` `[1, L, hidden]` at position `offset` → `[1, L, hidden]`.
    pub(crate) fn forward(
        &self,
        x: &Array,
        layer: usize,
        offset: usize,
        rope: &RotaryEmbedding,
        cache: &mut dyn KvCache,
    ) -> Result<Array> {
        let (q, k, v) = self.heads(x)?;
        let o = self.attend_sequence(q, k, v, layer, offset, rope, cache)?;
        self.output(&o)
    }

    /// Heads `[1, H, L, D]` of `L` tokens at `offset`: rotated, appended to `cache`, and
    /// attended over everything it holds (a shared prefix and the cache's own KV as parts
    /// of one softmax, docs/cache.md). MLX's causal mask is bottom-right aligned, so it is
    /// right with a cached prefix too. → `[1, H, L, D]`.
    #[allow(clippy::too_many_arguments)]
    fn attend_sequence(
        &self,
        q: Array,
        k: Array,
        v: Array,
        layer: usize,
        offset: usize,
        rope: &RotaryEmbedding,
        cache: &mut dyn KvCache,
    ) -> Result<Array> {
        let q = rope.forward(&q, offset)?;
        let k = rope.forward(&k, offset)?;
        let mask = if q.shape()[2] > 1 {
            AttentionMask::Causal
        } else {
            AttentionMask::None
        };
        Ok(cache.update_and_attend(layer, &q, &k, &v, self.scale, mask)?)
    }

    /// One pass of a mixed step (`x` `[1, B + ΣL, hidden]`: one token of each of the `B`
    /// rows of `rows`, then each prompt's `L` tokens after what its cache holds, in the
    /// order of `kv.prompts`): the projections run once over all of them, the attention of
    /// each part as in [`Attention::forward_rows`] and [`Attention::forward`] →
    /// `[1, B + ΣL, hidden]`.
    pub(crate) fn forward_mixed(
        &self,
        x: &Array,
        layer: usize,
        rope: &RotaryEmbedding,
        kv: &mut MixedKv<'_, '_>,
    ) -> Result<Array> {
        let [q, k, v] = self.qkv.forward(x)?;
        let part = |a: &Array, from: i32, to: i32| {
            let w = a.shape()[2];
            a.slice(&[0, from, 0], &[1, to, w])
        };
        // [B, H, 1, D] -> [1, B, H·D], then each prompt's [1, H, L, D] -> [1, L, H·D]; one
        // output projection over them all.
        let width = self.num_heads * self.head_dim;
        let mut outs = Vec::with_capacity(kv.prompts.len() + 1);
        let mut start = 0;
        if let Some((offsets, rows)) = &mut kv.rows {
            // The rows' tokens: [1, B, ·] read as [B, 1, ·].
            let b = rows.len() as i32;
            let (rq, rk, rv) =
                self.split_heads(&part(&q, 0, b)?, &part(&k, 0, b)?, &part(&v, 0, b)?, b, 1)?;
            let rq = rope.forward_rows(&rq, offsets)?;
            let rk = rope.forward_rows(&rk, offsets)?;
            let ro = rows.attend(layer, &rq, &rk, &rv, self.scale, None)?;
            // [B, H, 1, D] holds [1, B, H·D]'s values in its order.
            outs.push(ro.reshape(&[1, b, width])?);
            start = b;
        }
        for (cache, &(offset, l)) in kv.caches.iter_mut().zip(&kv.prompts) {
            let l = l as i32;
            let (cq, ck, cv) = self.split_heads(
                &part(&q, start, start + l)?,
                &part(&k, start, start + l)?,
                &part(&v, start, start + l)?,
                1,
                l,
            )?;
            let co = self.attend_sequence(cq, ck, cv, layer, offset, rope, &mut **cache)?;
            outs.push(self.merge_heads(&co, 1, l)?);
            start += l;
        }
        let refs: Vec<&Array> = outs.iter().collect();
        self.o_proj.forward(&mlx::ops::concatenate(&refs, 1)?)
    }

    /// One decode step of a batch: `x` `[B, 1, hidden]`, row b at position `offsets[b]`,
    /// attending over its own row of `rows` through a view → `[B, 1, hidden]`.
    pub(crate) fn forward_rows(
        &self,
        x: &Array,
        layer: usize,
        offsets: &Array,
        rope: &RotaryEmbedding,
        rows: &mut PagedKvRows,
    ) -> Result<Array> {
        let (q, k, v) = self.heads(x)?;
        let q = rope.forward_rows(&q, offsets)?;
        let k = rope.forward_rows(&k, offsets)?;
        let o = rows.attend(layer, &q, &k, &v, self.scale, None)?;
        self.output(&o)
    }
}

/// The caches of a mixed step's parts ([`Attention::forward_mixed`]): the decoding rows
/// with their positions (if any), and each prompt's cache with the position and length of
/// its chunk.
pub(crate) struct MixedKv<'a, 'c> {
    /// Each row's position (int32 `[B]`) and their cache; none in a pass of prompts only.
    pub(crate) rows: Option<(Array, &'a mut PagedKvRows)>,
    pub(crate) caches: &'a mut [&'c mut dyn KvCache],
    /// Per prompt (as `caches`): its chunk's first position and its token count.
    pub(crate) prompts: Vec<(usize, usize)>,
}

/// A pre-norm decoder layer: `x + attn(norm(x))`, then `h + mlp(norm(h))`.
#[derive(Debug)]
pub(crate) struct DecoderLayer {
    pub(crate) self_attn: Attention,
    pub(crate) mlp: Mlp,
    pub(crate) input_layernorm: RmsNorm,
    pub(crate) post_attention_layernorm: RmsNorm,
}

impl DecoderLayer {
    pub(crate) fn forward(
        &self,
        x: &Array,
        layer: usize,
        offset: usize,
        rope: &RotaryEmbedding,
        cache: &mut dyn KvCache,
    ) -> Result<Array> {
        let h = self.input_layernorm.forward(x)?;
        let h = x.add(&self.self_attn.forward(&h, layer, offset, rope, cache)?)?;
        let m = self
            .mlp
            .forward(&self.post_attention_layernorm.forward(&h)?)?;
        Ok(h.add(&m)?)
    }

    /// [`DecoderLayer::forward`] for a mixed step ([`Attention::forward_mixed`]): norms,
    /// projections and MLP run once over the rows' tokens and the prompt's.
    pub(crate) fn forward_mixed(
        &self,
        x: &Array,
        layer: usize,
        rope: &RotaryEmbedding,
        kv: &mut MixedKv<'_, '_>,
    ) -> Result<Array> {
        let h = self.input_layernorm.forward(x)?;
        let a = self.self_attn.forward_mixed(&h, layer, rope, kv)?;
        let h = x.add(&a)?;
        let m = self
            .mlp
            .forward(&self.post_attention_layernorm.forward(&h)?)?;
        Ok(h.add(&m)?)
    }

    /// [`DecoderLayer::forward`] for one decode step of a batch of rows.
    pub(crate) fn forward_rows(
        &self,
        x: &Array,
        layer: usize,
        offsets: &Array,
        rope: &RotaryEmbedding,
        rows: &mut PagedKvRows,
    ) -> Result<Array> {
        let h = self.input_layernorm.forward(x)?;
        let h = x.add(
            &self
                .self_attn
                .forward_rows(&h, layer, offsets, rope, rows)?,
        )?;
        let m = self
            .mlp
            .forward(&self.post_attention_layernorm.forward(&h)?)?;
        Ok(h.add(&m)?)
    }
}

/// The decoder stack every supported family shares: embedding, layers, final norm, LM head.
#[derive(Debug)]
pub(crate) struct Decoder {
    pub(crate) embed_tokens: Embedding,
    pub(crate) layers: Vec<DecoderLayer>,
    pub(crate) norm: RmsNorm,
    /// `None` when the LM head is tied to the embedding.
    pub(crate) lm_head: Option<Linear>,
    pub(crate) rope: RotaryEmbedding,
    /// The bytes a prefill pass may hold on a GPU at once: activations, and attention scores
    /// where they are materialized (module `pass_memory`).
    pub(crate) pass_workspace: AtomicU64,
}

impl Decoder {
    /// The bound on a pass over `rows` decoding rows and `prompts` (each chunk's cached
    /// tokens and length): the bytes each layer holds on this device until it has run, its
    /// activations on a GPU and its attention scores where they are materialized.
    fn pass_memory(&self, rows: usize, prompts: &[(usize, usize)]) -> PassMemory {
        let budget = self.pass_workspace.load(Ordering::Relaxed);
        // One token a prompt (a decode step) attends through MLX's vector kernel and makes a
        // step's few activations: no device query on the decode path.
        if prompts.iter().all(|&(_, len)| len <= 1) {
            return PassMemory::new(budget, 0);
        }
        let attn = &self.layers[0].self_attn;
        let dtype = self.embed_tokens.dtype();
        let device = mlx::default_device().unwrap_or(mlx::Device::Cpu);
        let scores = if materializes_scores(device, dtype, attn.head_dim as usize) {
            layer_score_bytes(attn.num_heads as usize, dtype.size(), prompts)
        } else {
            0
        };
        let activations = match self.layer_widths() {
            Some(w) if holds_activations(device) => {
                let tokens = rows + prompts.iter().map(|&(_, len)| len).sum::<usize>();
                layer_activation_bytes(w, dtype.size(), tokens)
            }
            _ => 0,
        };
        PassMemory::new(budget, scores + activations)
    }

    /// The first layer's widths (every layer of these families has the same).
    fn layer_widths(&self) -> Option<LayerWidths> {
        let layer = self.layers.first()?;
        let attn = &layer.self_attn;
        let head_dim = attn.head_dim as usize;
        Some(LayerWidths {
            hidden: attn.o_proj.out_features()? as usize,
            q: attn.num_heads as usize * head_dim,
            kv: attn.num_kv_heads as usize * head_dim,
            intermediate: layer.mlp.gate_up.out_width()? / 2,
            qk_norms: attn.q_norm.is_some(),
        })
    }
}

impl crate::models::Network for Decoder {
    fn hidden(&self, tokens: &Array, cache: &mut dyn KvCache) -> Result<Array> {
        let offset = cache.offset();
        let mut memory = self.pass_memory(0, &[(offset, tokens.shape()[1] as usize)]);
        let mut h = self.embed_tokens.forward(tokens)?;
        for (i, layer) in self.layers.iter().enumerate() {
            h = layer.forward(&h, i, offset, &self.rope, cache)?;
            memory.after_layer(&h)?;
        }
        self.norm.forward(&h)
    }

    fn set_pass_workspace(&self, bytes: u64) {
        self.pass_workspace.store(bytes, Ordering::Relaxed);
    }

    fn hidden_rows(&self, tokens: &Array, rows: &mut PagedKvRows) -> Result<Array> {
        let offsets = rows.offsets()?;
        let mut h = self.embed_tokens.forward(tokens)?;
        for (i, layer) in self.layers.iter().enumerate() {
            h = layer.forward_rows(&h, i, &offsets, &self.rope, rows)?;
        }
        self.norm.forward(&h)
    }

    fn hidden_mixed(
        &self,
        rows: Option<(&Array, &mut PagedKvRows)>,
        chunks: &[Array],
        caches: &mut [&mut dyn KvCache],
    ) -> Result<Option<(Option<Array>, Vec<Array>)>> {
        let prompts: Vec<(usize, usize)> = chunks
            .iter()
            .zip(caches.iter())
            .map(|(c, cache)| (cache.offset(), c.shape()[1] as usize))
            .collect();
        let mut ids = Vec::with_capacity(chunks.len() + 1);
        let rows = match rows {
            Some((tokens, rows)) => {
                let b = rows.len() as i32;
                ids.push(tokens.reshape(&[1, b])?);
                Some((rows.offsets()?, rows))
            }
            None => None,
        };
        let b = rows.as_ref().map_or(0, |(_, r)| r.len() as i32);
        ids.extend(chunks.iter().cloned());
        let refs: Vec<&Array> = ids.iter().collect();
        let mut h = self
            .embed_tokens
            .forward(&mlx::ops::concatenate(&refs, 1)?)?;
        let mut memory = self.pass_memory(b as usize, &prompts);
        let mut kv = MixedKv {
            rows,
            caches,
            prompts,
        };
        for (i, layer) in self.layers.iter().enumerate() {
            h = layer.forward_mixed(&h, i, &self.rope, &mut kv)?;
            memory.after_layer(&h)?;
        }
        let h = self.norm.forward(&h)?;
        let hidden = h.shape()[2];
        let rows_h = match b {
            0 => None,
            _ => Some(
                h.slice(&[0, 0, 0], &[1, b, hidden])?
                    .reshape(&[b, 1, hidden])?,
            ),
        };
        let mut start = b;
        let mut prompt_h = Vec::with_capacity(kv.prompts.len());
        for &(_, l) in &kv.prompts {
            let end = start + l as i32;
            prompt_h.push(h.slice(&[0, start, 0], &[1, end, hidden])?);
            start = end;
        }
        Ok(Some((rows_h, prompt_h)))
    }

    fn logits(&self, h: &Array) -> Result<Array> {
        match &self.lm_head {
            Some(head) => head.forward(h),
            None => self.embed_tokens.as_linear(h),
        }
    }

    fn layer_kinds(&self) -> Vec<crate::model::LayerKind> {
        vec![crate::model::LayerKind::Global; self.layers.len()]
    }
}

/// A causal depthwise 1-D convolution that keeps its last `K − 1` inputs as a layer state
/// (LFM2's short convolution, the convolutions of gated DeltaNet and Mamba-2).
#[derive(Debug)]
pub(crate) struct CausalConv {
    /// The taps, `[K, channels]`: tap `j` weighs the input `K − 1 − j` steps back.
    pub(crate) taps: Array,
    pub(crate) bias: Option<Array>,
}

impl CausalConv {
    /// The convolution `{prefix}` over `channels` channels with `kernel` taps (a bias when
    /// `bias`).
    pub(crate) fn load(
        w: &crate::weights::Weights,
        prefix: &str,
        channels: usize,
        kernel: usize,
        bias: bool,
    ) -> Result<Self> {
        Ok(CausalConv {
            taps: w.depthwise_conv(prefix, channels, kernel)?,
            bias: if bias {
                Some(w.vector(&format!("{prefix}.bias"), channels)?)
            } else {
                None
            },
        })
    }

    /// `x` `[B, L, C]` after the inputs in `state` (`[B, K−1, C]`, zeros before the first
    /// token) → the output `[B, L, C]` and the state after `x` (its last `K − 1` inputs).
    /// Computed as `K` shifted multiply-adds (mlx-lm calls `conv1d`: the same products,
    /// summed in another order).
    pub(crate) fn forward(&self, x: &Array, state: Option<&Array>) -> Result<(Array, Array)> {
        let s = x.shape();
        let (b, l, c) = (s[0], s[1], s[2]);
        let k = self.taps.shape()[0];
        let before = match state {
            Some(st) => st.clone(),
            None => mlx::ops::zeros(&[b, k - 1, c], x.dtype())?,
        };
        let padded = mlx::ops::concatenate(&[&before, x], 1)?;
        let next = padded.slice(&[0, l, 0], &[b, l + k - 1, c])?;
        // out[t] = Σ_j padded[t + j] · taps[j].
        let mut out = padded
            .slice(&[0, 0, 0], &[b, l, c])?
            .mul(&self.taps.slice(&[0, 0], &[1, c])?)?;
        for j in 1..k {
            let tap = self.taps.slice(&[j, 0], &[j + 1, c])?;
            out = out.add(&padded.slice(&[0, j, 0], &[b, j + l, c])?.mul(&tap)?)?;
        }
        if let Some(bias) = &self.bias {
            out = out.add(bias)?;
        }
        Ok((out, next))
    }
}

/// `log(1 + exp(x))` without overflow: `max(x, 0) + log(1 + exp(−|x|))`.
pub(crate) fn softplus(x: &Array) -> Result<Array> {
    let zero = mlx::ops::zeros(&[], x.dtype())?;
    let tail = x.abs()?.neg()?.exp()?.add_scalar(1.0)?.log()?;
    Ok(x.maximum(&zero)?.add(&tail)?)
}

/// Step `t` of `a` `[B, L, ..]` (a recurrence's input at one token): `[B, ..]`.
pub(crate) fn step(a: &Array, t: i32) -> Result<Array> {
    let shape = a.shape();
    let mut start = vec![0; shape.len()];
    let mut stop = shape.clone();
    start[1] = t;
    stop[1] = t + 1;
    Ok(a.slice(&start, &stop)?.squeeze(1)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn random(shape: &[i32], seed: u64) -> Array {
        let key = mlx::random::key(seed).unwrap();
        mlx::random::normal(shape, Dtype::F32, &key).unwrap()
    }

    fn host(a: &Array) -> Vec<f32> {
        a.contiguous().unwrap().to_vec::<f32>().unwrap()
    }

    /// `x Wᵀ + b` in plain Rust: the reference the stacked matmul is checked against.
    fn naive(x: &[f32], w: &[f32], b: Option<&[f32]>, rows: usize, cols: usize) -> Vec<f32> {
        let n = x.len() / cols;
        let mut y = vec![0.0; n * rows];
        for i in 0..n {
            for r in 0..rows {
                let dot: f32 = (0..cols).map(|c| x[i * cols + c] * w[r * cols + c]).sum();
                y[i * rows + r] = dot + b.map_or(0.0, |b| b[r]);
            }
        }
        y
    }

    fn assert_close(a: &[f32], b: &[f32], tol: f32) {
        assert_eq!(a.len(), b.len());
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!(
                (x - y).abs() <= tol * (1.0 + y.abs()),
                "element {i}: {x} vs {y}"
            );
        }
    }

    #[test]
    fn stacked_dense_layers_give_each_layers_own_output() {
        let (cols, widths) = (16, [8, 4, 4]);
        let x = random(&[2, 3, cols], 1);
        let parts: Vec<(Array, Array)> = widths
            .iter()
            .enumerate()
            .map(|(i, &w)| {
                (
                    random(&[w, cols], 10 + i as u64),
                    random(&[w], 20 + i as u64),
                )
            })
            .collect();
        let fused = FusedLinear::new(
            parts
                .iter()
                .map(|(w, b)| Linear::dense(w.clone(), Some(b.clone())))
                .collect(),
        )
        .unwrap();
        assert!(matches!(fused.parts, FusedParts::Stacked(..)));
        let out: [Array; 3] = fused.forward(&x).unwrap();
        for ((o, (w, b)), &rows) in out.iter().zip(&parts).zip(&widths) {
            assert_eq!(o.shape(), [2, 3, rows]);
            let want = naive(
                &host(&x),
                &host(w),
                Some(&host(b)),
                rows as usize,
                cols as usize,
            );
            // f32 products run on TF32 on CUDA: each of the `cols` terms is read with a
            // relative error of up to 2u (docs/cuda.md, "Tolerances on the GPU").
            let u = mlx::f32_matmul_unit_roundoff().unwrap();
            assert_close(&host(o), &want, 1e-5 + 2.0 * u * (cols as f32).sqrt());
        }
        // Asking for the wrong number of outputs is an error, not a panic.
        assert!(fused.forward::<2>(&x).is_err());
    }

    #[test]
    fn stacked_quantized_layers_match_the_layers_run_alone() {
        let spec = quant_spec();
        let x = random(&[1, 5, 64], 2);
        let ws: Vec<Quantized> = [32, 64]
            .iter()
            .enumerate()
            .map(|(i, &rows)| mlx::quantize(&random(&[rows, 64], 30 + i as u64), spec).unwrap())
            .collect();
        let alone: Vec<Vec<f32>> = ws
            .iter()
            .map(|q| host(&Linear::quantized(q.clone(), None).forward(&x).unwrap()))
            .collect();
        let fused =
            FusedLinear::new(ws.into_iter().map(|q| Linear::quantized(q, None)).collect()).unwrap();
        assert!(matches!(fused.parts, FusedParts::Stacked(..)));
        let [a, b] = fused.forward(&x).unwrap();
        assert_close(&host(&a), &alone[0], 1e-5);
        assert_close(&host(&b), &alone[1], 1e-5);
    }

    #[test]
    fn layers_not_stacked_by_choice_give_the_stacked_outputs() {
        let x = random(&[1, 4, 32], 5);
        let weights: Vec<(Array, Array)> = [16, 8]
            .iter()
            .enumerate()
            .map(|(i, &w)| (random(&[w, 32], 50 + i as u64), random(&[w], 60 + i as u64)))
            .collect();
        let make = |stack| {
            let parts = weights
                .iter()
                .map(|(w, b)| Linear::dense(w.clone(), Some(b.clone())))
                .collect();
            FusedLinear::stacked_if(parts, stack).unwrap()
        };
        let (stacked, separate) = (make(true), make(false));
        assert!(matches!(stacked.parts, FusedParts::Stacked(..)));
        assert!(matches!(separate.parts, FusedParts::Separate(..)));
        assert_eq!(separate.out_width(), Some(24));
        let [a, b] = stacked.forward(&x).unwrap();
        let [c, d] = separate.forward(&x).unwrap();
        let u = mlx::f32_matmul_unit_roundoff().unwrap();
        assert_close(&host(&c), &host(&a), 1e-5 + 2.0 * u * 32f32.sqrt());
        assert_close(&host(&d), &host(&b), 1e-5 + 2.0 * u * 32f32.sqrt());
        // The gated product over two parts of one width, stacked or not.
        let gate_up = |stack| {
            let w = random(&[8, 32], 70);
            let parts = vec![
                Linear::dense(w.clone(), None),
                Linear::dense(random(&[8, 32], 71), None),
            ];
            FusedLinear::stacked_if(parts, stack).unwrap()
        };
        let g1 = gate_up(true).gated(&x, mlx::fast::Gate::Silu).unwrap();
        let g0 = gate_up(false).gated(&x, mlx::fast::Gate::Silu).unwrap();
        assert_close(&host(&g0), &host(&g1), 1e-5 + 2.0 * u * 32f32.sqrt());
    }

    #[test]
    fn layers_that_cannot_be_stacked_run_one_by_one() {
        let x = random(&[1, 2, 64], 3);
        let (w0, w1) = (random(&[8, 64], 40), random(&[8, 64], 41));
        let q1 = mlx::quantize(&w1, quant_spec()).unwrap();
        let bias = random(&[8], 42);
        for parts in [
            // dense beside quantized
            vec![
                Linear::dense(w0.clone(), None),
                Linear::quantized(q1.clone(), None),
            ],
            // a bias on one only
            vec![
                Linear::dense(w0.clone(), Some(bias.clone())),
                Linear::dense(w1.clone(), None),
            ],
            // dense of different dtypes
            vec![
                Linear::dense(w0.clone(), None),
                Linear::dense(w1.astype(Dtype::F16).unwrap(), None),
            ],
        ] {
            let want: Vec<Vec<f32>> = parts
                .iter()
                .map(|p| host(&p.forward(&x).unwrap().astype(Dtype::F32).unwrap()))
                .collect();
            let fused = FusedLinear::new(parts).unwrap();
            assert!(matches!(fused.parts, FusedParts::Separate(_)));
            let [a, b] = fused.forward(&x).unwrap();
            assert_eq!(host(&a), want[0]);
            assert_eq!(host(&b.astype(Dtype::F32).unwrap()), want[1]);
        }
    }

    fn quant_spec() -> mlx::QuantSpec {
        mlx::QuantSpec::new(32, 4).unwrap()
    }
}
