//! Layers shared by every architecture: linear (dense or quantized), embedding (with the tied
//! LM head), RMS norm, SwiGLU MLP, rotary embedding settings (incl. Llama 3 scaling) and
//! attention over a [`KvCache`].

use cache::{KvCache, PagedKvRows};
use mlx::fast::{self, AttentionMask, Rope, RopeOffset};
use mlx::{Array, Dtype, Quantized};
use serde::Deserialize;

use crate::error::{EngineError, Result};

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

    /// `x` `[.., in]` → `[.., out]`.
    pub(crate) fn forward(&self, x: &Array) -> Result<Array> {
        let y = match &self.weight {
            LinearWeight::Dense(w) => x.matmul(&w.transpose(&[1, 0])?)?,
            LinearWeight::Quantized(q) => mlx::quantized_matmul(x, q, true)?,
        };
        Ok(match &self.bias {
            Some(b) => y.add(b)?,
            None => y,
        })
    }
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
            Embedding::Dense(t) => x.matmul(&t.transpose(&[1, 0])?)?,
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
    pub(crate) gate_proj: Linear,
    pub(crate) up_proj: Linear,
    pub(crate) down_proj: Linear,
}

impl Mlp {
    pub(crate) fn forward(&self, x: &Array) -> Result<Array> {
        let g = self.gate_proj.forward(x)?.silu()?;
        let u = self.up_proj.forward(x)?;
        self.down_proj.forward(&g.mul(&u)?)
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
        let cfg = Rope {
            dims: self.dims,
            traditional: self.traditional,
            base: self.base,
            scale: self.scale,
            freqs: self.freqs.as_ref(),
        };
        Ok(fast::rope(x, &cfg, RopeOffset::Scalar(offset as i32))?)
    }

    /// Rotates `x` `[B, H, 1, D]`, row b at position `offsets[b]` (int32 `[B]`).
    pub(crate) fn forward_rows(&self, x: &Array, offsets: &Array) -> Result<Array> {
        let cfg = Rope {
            dims: self.dims,
            traditional: self.traditional,
            base: self.base,
            scale: self.scale,
            freqs: self.freqs.as_ref(),
        };
        Ok(fast::rope(x, &cfg, RopeOffset::PerRow(offsets))?)
    }
}

/// Multi-head (grouped-query) self-attention: q/k/v/o projections, optional per-head q/k
/// RMS norms (qwen3), rotary embedding, the KV cache and fused SDPA.
#[derive(Debug)]
pub(crate) struct Attention {
    pub(crate) q_proj: Linear,
    pub(crate) k_proj: Linear,
    pub(crate) v_proj: Linear,
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
        // 1. Projections, split into heads: (B, L, H·D) -> (B, L, H, D).
        let q = self
            .q_proj
            .forward(x)?
            .reshape(&[b, l, self.num_heads, self.head_dim])?;
        let k = self
            .k_proj
            .forward(x)?
            .reshape(&[b, l, self.num_kv_heads, self.head_dim])?;
        let v = self
            .v_proj
            .forward(x)?
            .reshape(&[b, l, self.num_kv_heads, self.head_dim])?;
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
        Ok((
            q.transpose(&[0, 2, 1, 3])?,
            k.transpose(&[0, 2, 1, 3])?,
            v.transpose(&[0, 2, 1, 3])?,
        ))
    }

    /// Attention output `[B, H, L, D]` -> `[B, L, H·D]` -> output projection.
    pub(crate) fn output(&self, o: &Array) -> Result<Array> {
        let (b, l) = (o.shape()[0], o.shape()[2]);
        let o = o
            .transpose(&[0, 2, 1, 3])?
            .reshape(&[b, l, self.num_heads * self.head_dim])?;
        self.o_proj.forward(&o)
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
        let l = x.shape()[1];
        let (q, k, v) = self.heads(x)?;
        // Rotate by absolute position.
        let q = rope.forward(&q, offset)?;
        let k = rope.forward(&k, offset)?;
        // Append to the cache; attend over everything it holds. MLX's causal mask is
        // bottom-right aligned, so it is right with a cached prefix too.
        let (keys, values) = cache.update_and_fetch(layer, &k, &v)?;
        let mask = if l > 1 {
            AttentionMask::Causal
        } else {
            AttentionMask::None
        };
        let o = fast::scaled_dot_product_attention(&q, &keys, &values, self.scale, mask)?;
        self.output(&o)
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
}

impl crate::models::Network for Decoder {
    fn hidden(&self, tokens: &Array, cache: &mut dyn KvCache) -> Result<Array> {
        let offset = cache.offset();
        let mut h = self.embed_tokens.forward(tokens)?;
        for (i, layer) in self.layers.iter().enumerate() {
            h = layer.forward(&h, i, offset, &self.rope, cache)?;
        }
        self.norm.forward(&h)
    }

    fn hidden_rows(&self, tokens: &Array, rows: &mut PagedKvRows) -> Result<Array> {
        let offsets = rows.offsets()?;
        let mut h = self.embed_tokens.forward(tokens)?;
        for (i, layer) in self.layers.iter().enumerate() {
            h = layer.forward_rows(&h, i, &offsets, &self.rope, rows)?;
        }
        self.norm.forward(&h)
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
