//! Qwen3-Next (dense): a hybrid of gated DeltaNet layers (linear attention with a
//! recurrent state) and gated full attention, every `full_attention_interval`-th layer.
//!
//! - Gated attention: `q_proj` gives each head's query and an output gate; q/k RMS norms
//!   per head; RoPE on the first `head_dim · partial_rotary_factor` dims; the attention
//!   output is multiplied by `sigmoid(gate)` before `o_proj`.
//! - Gated DeltaNet: `in_proj_qkvz` and `in_proj_ba` give per key head its q, k and the
//!   v, z, b, a of its value heads; q, k, v run through a causal depthwise convolution of
//!   `linear_conv_kernel_dim` taps and SiLU; q and k are RMS-normalized (scaled by
//!   `dk^-1` and `dk^-1/2`); then per token, with `g = exp(-exp(A_log) · softplus(a +
//!   dt_bias))` and `β = sigmoid(b)`: `S ← g·S`, `S ← S + k ⊗ (v − S k)·β`, `y = S q`;
//!   `y` is RMS-normalized, gated by `silu(z)` and projected out (mlx-lm's
//!   `gated_delta_ops`).
//!
//! A DeltaNet layer's state is two arrays: the convolution's last `K − 1` inputs `[B,
//! K−1, 2·key_dim + value_dim]` and the recurrent state `[B, Hv, Dv, Dk]`, carried in the
//! cache's state layers. Mixture-of-experts configs (`num_experts > 0`, the published
//! 80B checkpoints) are refused: only the dense MLP is built.

use cache::{KvCache, PagedKvRows};
use mlx::fast::{self, AttentionMask};
use mlx::Array;
use serde::Deserialize;

use crate::error::{EngineError, Result};
use crate::layers::{
    softplus, step, CausalConv, Embedding, FusedLinear, Linear, Mlp, RmsNorm, RopeScaling,
    RotaryEmbedding,
};
use crate::model::{KvLayout, LayerKind, ModelInfo};
use crate::models::{
    check_cache_states, check_rows_states, mix_cache, mix_rows, Built, Family, Network, StateMixer,
};
use crate::weights::{Checkpoint, Weights};

fn default_interval() -> usize {
    4
}
fn default_partial() -> f64 {
    1.0
}

/// A Qwen3-Next `config.json` (the fields the dense model reads).
#[derive(Clone, Debug, Deserialize)]
pub struct Config {
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Layers (DeltaNet and attention).
    pub num_hidden_layers: usize,
    /// Width of the dense MLP.
    pub intermediate_size: usize,
    /// Query heads of the attention layers.
    pub num_attention_heads: usize,
    /// Key/value heads of the attention layers.
    pub num_key_value_heads: usize,
    /// Per-head width of the attention layers.
    pub head_dim: usize,
    /// Value heads of the DeltaNet layers.
    pub linear_num_value_heads: usize,
    /// Key heads of the DeltaNet layers.
    pub linear_num_key_heads: usize,
    /// Key head width of the DeltaNet layers.
    pub linear_key_head_dim: usize,
    /// Value head width of the DeltaNet layers.
    pub linear_value_head_dim: usize,
    /// Taps of the DeltaNet convolution.
    pub linear_conv_kernel_dim: usize,
    /// Experts (0: dense, the only kind built).
    #[serde(default)]
    pub num_experts: usize,
    /// RMS norm epsilon.
    pub rms_norm_eps: f64,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// RoPE base.
    pub rope_theta: f64,
    /// Share of each head's dims that RoPE rotates.
    #[serde(default = "default_partial")]
    pub partial_rotary_factor: f64,
    /// RoPE scaling (linear or llama3).
    #[serde(default)]
    pub rope_scaling: Option<RopeScaling>,
    /// Context the model was trained for.
    pub max_position_embeddings: usize,
    /// The LM head is the embedding table.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Biases on q/k/v/o.
    #[serde(default)]
    pub attention_bias: bool,
    /// Every this many layers, the last is full attention.
    #[serde(default = "default_interval")]
    pub full_attention_interval: usize,
}

impl Config {
    /// Whether layer `i` is a DeltaNet layer.
    pub fn is_linear(&self, i: usize) -> bool {
        !(i + 1).is_multiple_of(self.full_attention_interval.max(1))
    }

    fn rope_dims(&self) -> usize {
        (self.head_dim as f64 * self.partial_rotary_factor) as usize
    }

    fn conv_dim(&self) -> usize {
        2 * self.linear_num_key_heads * self.linear_key_head_dim
            + self.linear_num_value_heads * self.linear_value_head_dim
    }

    fn validate(&self, source: &str) -> Result<()> {
        let bad = |m: String| Err(EngineError::config(source, m));
        if self.num_experts > 0 {
            return bad(format!(
                "{} experts: mixture-of-experts Qwen3-Next is not supported (dense only)",
                self.num_experts
            ));
        }
        let positive = [
            self.num_attention_heads,
            self.num_key_value_heads,
            self.head_dim,
            self.linear_num_value_heads,
            self.linear_num_key_heads,
            self.linear_key_head_dim,
            self.linear_value_head_dim,
            self.num_hidden_layers,
            self.full_attention_interval,
        ];
        if positive.contains(&0) {
            return bad(
                "head counts, head widths, layers and the interval must be positive".into(),
            );
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
            || !self
                .linear_num_value_heads
                .is_multiple_of(self.linear_num_key_heads)
        {
            return bad("query (value) heads must be a multiple of key heads".into());
        }
        let rope = self.rope_dims();
        if rope == 0 || rope > self.head_dim || !rope.is_multiple_of(2) {
            return bad(format!(
                "partial_rotary_factor {} gives {rope} rotated dims of {}",
                self.partial_rotary_factor, self.head_dim
            ));
        }
        if !(2..=64).contains(&self.linear_conv_kernel_dim) {
            return bad(format!(
                "linear_conv_kernel_dim {} is outside 2..=64",
                self.linear_conv_kernel_dim
            ));
        }
        if self.num_hidden_layers < self.full_attention_interval {
            return bad("no attention layer: the engine needs at least one".into());
        }
        Ok(())
    }
}

/// `[B, L, heads, d]` with each head repeated `factor` times in place: `[B, L, heads ·
/// factor, d]` (mlx's `repeat` along the head axis).
fn repeat_heads(x: &Array, factor: i32) -> Result<Array> {
    if factor == 1 {
        return Ok(x.clone());
    }
    let s = x.shape();
    Ok(x.expand_dims(3)?
        .broadcast_to(&[s[0], s[1], s[2], factor, s[3]])?
        .reshape(&[s[0], s[1], s[2] * factor, s[3]])?)
}

/// Full attention with a per-head output gate and partial RoPE.
#[derive(Debug)]
struct GatedAttention {
    /// q_proj (queries and gates), k_proj and v_proj, stacked.
    qkv: FusedLinear,
    o_proj: Linear,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    heads: i32,
    kv_heads: i32,
    head_dim: i32,
    scale: f32,
}

impl GatedAttention {
    /// Queries, keys, values `[B, H, L, D]` (before RoPE) and the gate `[B, L, H·D]`.
    fn heads(&self, x: &Array) -> Result<(Array, Array, Array, Array)> {
        let (b, l) = (x.shape()[0], x.shape()[1]);
        let (h, d) = (self.heads, self.head_dim);
        // 1. (B, L, H·2D) -> (B, L, H, 2D): each head's query, then its gate.
        let [qg, k, v] = self.qkv.forward(x)?;
        let qg = qg.reshape(&[b, l, h, 2 * d])?;
        let q = qg.slice(&[0, 0, 0, 0], &[b, l, h, d])?;
        let gate = qg
            .slice(&[0, 0, 0, d], &[b, l, h, 2 * d])?
            .reshape(&[b, l, h * d])?;
        let k = k.reshape(&[b, l, self.kv_heads, d])?;
        let v = v.reshape(&[b, l, self.kv_heads, d])?;
        // 2. Per-head norms, then (B, L, H, D) -> (B, H, L, D).
        let t = [0, 2, 1, 3];
        Ok((
            self.q_norm.forward(&q)?.transpose(&t)?,
            self.k_norm.forward(&k)?.transpose(&t)?,
            v.transpose(&t)?,
            gate,
        ))
    }

    /// `[B, H, L, D]` attention output, gated, projected out.
    fn output(&self, o: &Array, gate: &Array) -> Result<Array> {
        let (b, l) = (o.shape()[0], o.shape()[2]);
        let o = o
            .transpose(&[0, 2, 1, 3])?
            .reshape(&[b, l, self.heads * self.head_dim])?;
        self.o_proj.forward(&o.mul(&gate.sigmoid()?)?)
    }

    fn forward(
        &self,
        x: &Array,
        layer: usize,
        offset: usize,
        rope: &RotaryEmbedding,
        cache: &mut dyn KvCache,
    ) -> Result<Array> {
        let (q, k, v, gate) = self.heads(x)?;
        let q = rope.forward(&q, offset)?;
        let k = rope.forward(&k, offset)?;
        let (keys, values) = cache.update_and_fetch(layer, &k, &v)?;
        let mask = if x.shape()[1] > 1 {
            AttentionMask::Causal
        } else {
            AttentionMask::None
        };
        let o = fast::scaled_dot_product_attention(&q, &keys, &values, self.scale, mask)?;
        self.output(&o, &gate)
    }

    fn forward_rows(
        &self,
        x: &Array,
        layer: usize,
        offsets: &Array,
        rope: &RotaryEmbedding,
        rows: &mut PagedKvRows,
    ) -> Result<Array> {
        let (q, k, v, gate) = self.heads(x)?;
        let q = rope.forward_rows(&q, offsets)?;
        let k = rope.forward_rows(&k, offsets)?;
        let o = rows.attend(layer, &q, &k, &v, self.scale, None)?;
        self.output(&o, &gate)
    }
}

/// A gated DeltaNet layer (mlx-lm's `Qwen3NextGatedDeltaNet`).
#[derive(Debug)]
struct GatedDeltaNet {
    in_proj_qkvz: Linear,
    in_proj_ba: Linear,
    conv1d: CausalConv,
    a_log: Array,
    dt_bias: Array,
    norm: RmsNorm,
    out_proj: Linear,
    key_heads: i32,
    value_heads: i32,
    key_dim: i32,
    value_dim: i32,
}

impl StateMixer for GatedDeltaNet {
    /// `x` `[B, S, hidden]` after `state` (convolution inputs, recurrent matrix; zeros
    /// before the first token) → output `[B, S, hidden]` and the state after `x`.
    fn mix(&self, x: &Array, state: Option<&[Array]>) -> Result<(Array, Vec<Array>)> {
        let (b, s) = (x.shape()[0], x.shape()[1]);
        let (nk, nv, dk, dv) = (
            self.key_heads,
            self.value_heads,
            self.key_dim,
            self.value_dim,
        );
        let per = nv / nk;
        let (key_all, value_all) = (nk * dk, nv * dv);
        let conv_dim = 2 * key_all + value_all;
        // 1. Per key head: q, k, then its value heads' v and z; b and a likewise.
        let qkvz = self
            .in_proj_qkvz
            .forward(x)?
            .reshape(&[b, s, nk, 2 * dk + 2 * per * dv])?;
        let part = |a: &Array, from: i32, to: i32| a.slice(&[0, 0, 0, from], &[b, s, nk, to]);
        let q = part(&qkvz, 0, dk)?;
        let k = part(&qkvz, dk, 2 * dk)?;
        let v = part(&qkvz, 2 * dk, 2 * dk + per * dv)?;
        let z = part(&qkvz, 2 * dk + per * dv, 2 * dk + 2 * per * dv)?.reshape(&[b, s, nv, dv])?;
        let ba = self.in_proj_ba.forward(x)?.reshape(&[b, s, nk, 2 * per])?;
        let beta_in = part(&ba, 0, per)?.reshape(&[b, s, nv])?;
        let a = part(&ba, per, 2 * per)?.reshape(&[b, s, nv])?;
        // 2. Causal depthwise convolution over [q | k | v] after the kept inputs, SiLU.
        let mixed = mlx::ops::concatenate(
            &[
                &q.reshape(&[b, s, key_all])?,
                &k.reshape(&[b, s, key_all])?,
                &v.reshape(&[b, s, value_all])?,
            ],
            2,
        )?;
        let (conv, next_conv) = self.conv1d.forward(&mixed, state.map(|st| &st[0]))?;
        let conv = conv.silu()?;
        let q = conv
            .slice(&[0, 0, 0], &[b, s, key_all])?
            .reshape(&[b, s, nk, dk])?;
        let k = conv
            .slice(&[0, 0, key_all], &[b, s, 2 * key_all])?
            .reshape(&[b, s, nk, dk])?;
        let v = conv
            .slice(&[0, 0, 2 * key_all], &[b, s, conv_dim])?
            .reshape(&[b, s, nv, dv])?;
        // 3. Normalized q and k, one per value head.
        let inv = (dk as f64).powf(-0.5);
        let q = fast::rms_norm(&q, None, 1e-6)?.mul_scalar(inv * inv)?;
        let k = fast::rms_norm(&k, None, 1e-6)?.mul_scalar(inv)?;
        let q = repeat_heads(&q, per)?;
        let k = repeat_heads(&k, per)?;
        // 4. Gates: β = sigmoid(b), g = exp(-exp(A_log) · softplus(a + dt_bias)).
        let beta = beta_in.sigmoid()?;
        let g = self
            .a_log
            .exp()?
            .neg()?
            .mul(&softplus(&a.add(&self.dt_bias)?)?)?
            .exp()?;
        // 5. The recurrence, token by token: S [B, Hv, Dv, Dk].
        let mut rec = match state {
            Some(st) => st[1].clone(),
            None => mlx::ops::zeros(&[b, nv, dv, dk], q.dtype())?,
        };
        let mut ys = Vec::with_capacity(s as usize);
        for t in 0..s {
            let (qt, kt, vt) = (step(&q, t)?, step(&k, t)?, step(&v, t)?);
            let (gt, bt) = (step(&g, t)?, step(&beta, t)?);
            rec = rec.mul(&gt.expand_dims(2)?.expand_dims(3)?)?;
            let k4 = kt.expand_dims(2)?;
            let kv_mem = rec.mul(&k4)?.sum(-1, false)?;
            let delta = vt.sub(&kv_mem)?.mul(&bt.expand_dims(2)?)?;
            rec = rec.add(&k4.mul(&delta.expand_dims(3)?)?)?;
            ys.push(rec.mul(&qt.expand_dims(2)?)?.sum(-1, false)?);
        }
        let refs: Vec<&Array> = ys.iter().collect();
        let y = mlx::ops::stack(&refs, 1)?;
        // 6. Norm gated by silu(z), projected out.
        let y = self.norm.forward(&y)?.mul(&z.silu()?)?;
        let out = self.out_proj.forward(&y.reshape(&[b, s, value_all])?)?;
        Ok((out, vec![next_conv, rec]))
    }
}

#[derive(Debug)]
enum Mixer {
    Attention(GatedAttention, usize),
    DeltaNet(GatedDeltaNet, usize),
}

#[derive(Debug)]
struct Layer {
    mixer: Mixer,
    mlp: Mlp,
    input_layernorm: RmsNorm,
    post_attention_layernorm: RmsNorm,
}

/// A dense Qwen3-Next network.
#[derive(Debug)]
pub(crate) struct Qwen3Next {
    embed_tokens: Embedding,
    layers: Vec<Layer>,
    norm: RmsNorm,
    lm_head: Option<Linear>,
    rope: RotaryEmbedding,
    linear_layers: usize,
    state_shapes: Vec<Vec<usize>>,
}

impl Qwen3Next {
    fn new(cfg: &Config, w: &Weights, source: &str) -> Result<Self> {
        cfg.validate(source)?;
        let (h, hd, eps) = (cfg.hidden_size, cfg.head_dim, cfg.rms_norm_eps);
        let (nh, nkv) = (cfg.num_attention_heads, cfg.num_key_value_heads);
        let (nk, nv) = (cfg.linear_num_key_heads, cfg.linear_num_value_heads);
        let (dk, dv) = (cfg.linear_key_head_dim, cfg.linear_value_head_dim);
        let bias = cfg.attention_bias;
        let (mut attn, mut linear) = (0, 0);
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let mixer = if cfg.is_linear(i) {
                let l = format!("{p}.linear_attn");
                let m = Mixer::DeltaNet(
                    GatedDeltaNet {
                        in_proj_qkvz: w.linear(
                            &format!("{l}.in_proj_qkvz"),
                            2 * nk * dk + 2 * nv * dv,
                            h,
                            false,
                        )?,
                        in_proj_ba: w.linear(&format!("{l}.in_proj_ba"), 2 * nv, h, false)?,
                        conv1d: CausalConv::load(
                            w,
                            &format!("{l}.conv1d"),
                            cfg.conv_dim(),
                            cfg.linear_conv_kernel_dim,
                            false,
                        )?,
                        a_log: w.vector(&format!("{l}.A_log"), nv)?,
                        dt_bias: w.vector(&format!("{l}.dt_bias"), nv)?,
                        norm: w.rms_norm(&format!("{l}.norm"), dv, eps)?,
                        out_proj: w.linear(&format!("{l}.out_proj"), h, nv * dv, false)?,
                        key_heads: nk as i32,
                        value_heads: nv as i32,
                        key_dim: dk as i32,
                        value_dim: dv as i32,
                    },
                    linear,
                );
                linear += 1;
                m
            } else {
                let a = format!("{p}.self_attn");
                let m = Mixer::Attention(
                    GatedAttention {
                        qkv: FusedLinear::new(vec![
                            w.linear(&format!("{a}.q_proj"), 2 * nh * hd, h, bias)?,
                            w.linear(&format!("{a}.k_proj"), nkv * hd, h, bias)?,
                            w.linear(&format!("{a}.v_proj"), nkv * hd, h, bias)?,
                        ])?,
                        o_proj: w.linear(&format!("{a}.o_proj"), h, nh * hd, bias)?,
                        q_norm: w.rms_norm(&format!("{a}.q_norm"), hd, eps)?,
                        k_norm: w.rms_norm(&format!("{a}.k_norm"), hd, eps)?,
                        heads: nh as i32,
                        kv_heads: nkv as i32,
                        head_dim: hd as i32,
                        scale: (hd as f32).powf(-0.5),
                    },
                    attn,
                );
                attn += 1;
                m
            };
            let m = format!("{p}.mlp");
            let ff = cfg.intermediate_size;
            layers.push(Layer {
                mixer,
                mlp: Mlp::new(
                    w.linear(&format!("{m}.gate_proj"), ff, h, false)?,
                    w.linear(&format!("{m}.up_proj"), ff, h, false)?,
                    w.linear(&format!("{m}.down_proj"), h, ff, false)?,
                )?,
                input_layernorm: w.rms_norm(&format!("{p}.input_layernorm"), h, eps)?,
                post_attention_layernorm: w.rms_norm(
                    &format!("{p}.post_attention_layernorm"),
                    h,
                    eps,
                )?,
            });
        }
        let lm_head = if cfg.tie_word_embeddings {
            None
        } else {
            Some(w.linear("lm_head", cfg.vocab_size, h, false)?)
        };
        Ok(Qwen3Next {
            embed_tokens: w.embedding("model.embed_tokens", cfg.vocab_size, h)?,
            layers,
            norm: w.rms_norm("model.norm", h, eps)?,
            lm_head,
            rope: RotaryEmbedding::new(
                cfg.rope_dims(),
                cfg.rope_theta,
                false,
                cfg.rope_scaling.as_ref(),
                source,
            )?,
            linear_layers: linear,
            state_shapes: vec![
                vec![1, cfg.linear_conv_kernel_dim - 1, cfg.conv_dim()],
                vec![1, nv, dv, dk],
            ],
        })
    }

    /// The residual around the mixer, then the MLP block.
    fn block(layer: &Layer, x: &Array, r: Array) -> Result<Array> {
        let h = x.add(&r)?;
        let m = layer
            .mlp
            .forward(&layer.post_attention_layernorm.forward(&h)?)?;
        Ok(h.add(&m)?)
    }
}

impl Network for Qwen3Next {
    fn hidden(&self, tokens: &Array, cache: &mut dyn KvCache) -> Result<Array> {
        check_cache_states("Qwen3-Next", self.linear_layers, cache)?;
        let offset = cache.offset();
        let mut h = self.embed_tokens.forward(tokens)?;
        for layer in &self.layers {
            let x = layer.input_layernorm.forward(&h)?;
            let r = match &layer.mixer {
                Mixer::Attention(a, kv) => a.forward(&x, *kv, offset, &self.rope, cache)?,
                Mixer::DeltaNet(d, slot) => mix_cache(d, &x, *slot, cache)?,
            };
            h = Self::block(layer, &h, r)?;
        }
        self.norm.forward(&h)
    }

    fn hidden_rows(&self, tokens: &Array, rows: &mut PagedKvRows) -> Result<Array> {
        check_rows_states("Qwen3-Next", self.linear_layers, rows)?;
        let offsets = rows.offsets()?;
        let mut h = self.embed_tokens.forward(tokens)?;
        for layer in &self.layers {
            let x = layer.input_layernorm.forward(&h)?;
            let r = match &layer.mixer {
                Mixer::Attention(a, kv) => a.forward_rows(&x, *kv, &offsets, &self.rope, rows)?,
                Mixer::DeltaNet(d, slot) => mix_rows(d, &x, *slot, rows)?,
            };
            h = Self::block(layer, &h, r)?;
        }
        self.norm.forward(&h)
    }

    fn logits(&self, h: &Array) -> Result<Array> {
        match &self.lm_head {
            Some(head) => head.forward(h),
            None => self.embed_tokens.as_linear(h),
        }
    }

    fn state_shapes(&self) -> Vec<Vec<Vec<usize>>> {
        vec![self.state_shapes.clone(); self.linear_layers]
    }

    fn layer_kinds(&self) -> Vec<LayerKind> {
        self.layers
            .iter()
            .map(|l| match l.mixer {
                Mixer::Attention(..) => LayerKind::Global,
                Mixer::DeltaNet(..) => LayerKind::Recurrent,
            })
            .collect()
    }
}

fn build(ck: &Checkpoint) -> Result<Built> {
    let cfg: Config = serde_json::from_value(ck.config.clone())
        .map_err(|e| EngineError::config(&ck.source, e.to_string()))?;
    let net = Qwen3Next::new(&cfg, &ck.weights, &ck.source)?;
    let info = ModelInfo {
        architecture: FAMILY.model_type.to_string(),
        vocab_size: cfg.vocab_size,
        hidden_size: cfg.hidden_size,
        num_heads: cfg.num_attention_heads,
        max_position_embeddings: cfg.max_position_embeddings,
        rope_theta: cfg.rope_theta,
        kv: KvLayout {
            layers: net.layers.len() - net.linear_layers,
            kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim,
            dtype: net.embed_tokens.dtype(),
            state_layers: net.linear_layers,
        },
    };
    Ok((Box::new(net), info))
}

/// Qwen3-Next (dense), from Hugging Face folders.
pub(crate) const FAMILY: Family = Family {
    model_type: "qwen3_next",
    gguf: None,
    build,
};
