//! LFM2 (Liquid AI): a hybrid of gated short convolutions and grouped-query attention.
//!
//! Each layer is pre-norm: `h = x + op(norm(x))`, then `h + mlp(norm(h))`, where `op` is
//! either attention (per-head RMS norms on q and k, RoPE, no biases) or a short
//! convolution: `in_proj` splits into gates `b`, `c` and input `x`; `b·x` runs through a
//! causal depthwise convolution of `conv_L_cache` taps; `c` gates its output; `out_proj`.
//! A convolution layer's state is its last `conv_L_cache - 1` inputs `b·x`, `[B, K-1,
//! hidden]`, carried in the cache's state layers ([`cache::LayerStates`]); attention
//! layers use the paged KV. The final norm is `embedding_norm`; the LM head is the
//! embedding table (mlx-lm's `lfm2`).

use cache::{KvCache, PagedKvRows};
use mlx::Array;
use serde::Deserialize;

use crate::error::{EngineError, Result};
use crate::layers::{
    Attention, CausalConv, Embedding, FusedLinear, Linear, Mlp, RmsNorm, RotaryEmbedding,
};
use crate::model::{KvLayout, LayerKind, ModelInfo};
use crate::models::{
    check_cache_states, check_rows_states, mix_cache, mix_rows, Built, Family, Network, StateMixer,
};
use crate::weights::{Checkpoint, Weights};

fn default_theta() -> f64 {
    1_000_000.0
}
fn default_eps() -> f64 {
    1e-5
}
fn default_max_pos() -> usize {
    128_000
}
fn default_multiple_of() -> usize {
    256
}

/// An LFM2 `config.json`.
#[derive(Clone, Debug, Deserialize)]
pub struct Config {
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Layers (convolution and attention).
    pub num_hidden_layers: usize,
    /// Query heads of the attention layers.
    pub num_attention_heads: usize,
    /// Key/value heads; defaults to the query heads.
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    /// RMS norm epsilon.
    #[serde(default = "default_eps")]
    pub norm_eps: f64,
    /// Biases on the convolution layers' projections and taps.
    #[serde(default)]
    pub conv_bias: bool,
    /// Taps of the short convolution (it keeps this many minus one inputs).
    #[serde(rename = "conv_L_cache")]
    pub conv_l_cache: usize,
    /// Width of the feed-forward input (must equal `hidden_size`).
    pub block_dim: usize,
    /// Feed-forward width before adjustment.
    pub block_ff_dim: usize,
    /// The adjusted feed-forward width is rounded up to a multiple of this.
    #[serde(default = "default_multiple_of")]
    pub block_multiple_of: usize,
    /// Multiplier of the adjusted feed-forward width.
    #[serde(default)]
    pub block_ffn_dim_multiplier: Option<f64>,
    /// Adjust the feed-forward width as LFM2 does (2/3, multiplier, rounding).
    #[serde(default)]
    pub block_auto_adjust_ff_dim: bool,
    /// RoPE base.
    #[serde(default = "default_theta")]
    pub rope_theta: f64,
    /// Indices of the attention layers (or `layer_types`).
    #[serde(default)]
    pub full_attn_idxs: Option<Vec<usize>>,
    /// Per layer: `full_attention` or `conv`.
    #[serde(default)]
    pub layer_types: Option<Vec<String>>,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Context the model was trained for.
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
}

impl Config {
    /// Key/value heads.
    pub fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// Per-head width (LFM2 has no `head_dim`: hidden / heads).
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads.max(1)
    }

    /// The feed-forward width after LFM2's adjustment.
    pub fn ff_dim(&self) -> usize {
        let mut ff = self.block_ff_dim;
        if self.block_auto_adjust_ff_dim {
            ff = 2 * ff / 3;
            if let Some(m) = self.block_ffn_dim_multiplier {
                ff = (m * ff as f64) as usize;
            }
            let m = self.block_multiple_of.max(1);
            ff = m * ff.div_ceil(m);
        }
        ff
    }

    /// Whether layer `i` is an attention layer.
    pub fn is_attention(&self, i: usize) -> bool {
        match (&self.full_attn_idxs, &self.layer_types) {
            (Some(idx), _) => idx.contains(&i),
            (None, Some(types)) => types.get(i).is_some_and(|t| t == "full_attention"),
            (None, None) => false,
        }
    }

    fn validate(&self, source: &str) -> Result<()> {
        let bad = |m: String| Err(EngineError::config(source, m));
        if self.num_attention_heads == 0 || self.kv_heads() == 0 || self.num_hidden_layers == 0 {
            return bad("heads, key/value heads and layers must be positive".into());
        }
        if !self.num_attention_heads.is_multiple_of(self.kv_heads())
            || !self.hidden_size.is_multiple_of(self.num_attention_heads)
            || !self.head_dim().is_multiple_of(2)
        {
            return bad(format!(
                "hidden {} / {} heads / {} key-value heads do not give an even head width \
                 shared by whole groups",
                self.hidden_size,
                self.num_attention_heads,
                self.kv_heads()
            ));
        }
        if self.block_dim != self.hidden_size {
            return bad(format!(
                "block_dim {} differs from hidden_size {}",
                self.block_dim, self.hidden_size
            ));
        }
        if !(2..=64).contains(&self.conv_l_cache) {
            return bad(format!(
                "conv_L_cache {} is outside 2..=64",
                self.conv_l_cache
            ));
        }
        if self.full_attn_idxs.is_none() && self.layer_types.is_none() {
            return bad("needs full_attn_idxs or layer_types".into());
        }
        if let Some(t) = &self.layer_types {
            if t.len() != self.num_hidden_layers {
                return bad(format!(
                    "{} layer_types for {} layers",
                    t.len(),
                    self.num_hidden_layers
                ));
            }
        }
        if !(0..self.num_hidden_layers).any(|i| self.is_attention(i)) {
            return bad("no attention layer: the engine needs at least one".into());
        }
        Ok(())
    }
}

/// A gated short convolution (mlx-lm's `ShortConv`).
#[derive(Debug)]
struct ShortConv {
    in_proj: Linear,
    conv: CausalConv,
    out_proj: Linear,
}

impl StateMixer for ShortConv {
    /// `x` `[B, L, C]` after the inputs in `state` (`[B, K-1, C]`, zeros before the first
    /// token) → the output `[B, L, C]` and the state after `x`.
    fn mix(&self, x: &Array, state: Option<&[Array]>) -> Result<(Array, Vec<Array>)> {
        let s = x.shape();
        let (b, l, c) = (s[0], s[1], s[2]);
        // 1. (B, L, C) -> (B, L, 3C) = gate b | gate c | input.
        let bcx = self.in_proj.forward(x)?;
        let part = |i: i32| bcx.slice(&[0, 0, i * c], &[b, l, (i + 1) * c]);
        let (gb, gc, input) = (part(0)?, part(1)?, part(2)?);
        // 2. The causal convolution of b·x after the kept inputs.
        let (out, next) = self.conv.forward(&gb.mul(&input)?, state.map(|s| &s[0]))?;
        // 3. Gate by c, project out.
        let y = self.out_proj.forward(&gc.mul(&out)?)?;
        Ok((y, vec![next]))
    }
}

/// What a layer mixes tokens with; the index is its place among the attention layers (its
/// KV layer) or among the convolution layers (its state layer).
#[derive(Debug)]
enum Operator {
    Attention(Attention, usize),
    Conv(ShortConv, usize),
}

#[derive(Debug)]
struct Layer {
    operator: Operator,
    feed_forward: Mlp,
    operator_norm: RmsNorm,
    ffn_norm: RmsNorm,
}

/// An LFM2 network.
#[derive(Debug)]
pub(crate) struct Lfm2 {
    embed_tokens: Embedding,
    layers: Vec<Layer>,
    embedding_norm: RmsNorm,
    rope: RotaryEmbedding,
    conv_layers: usize,
    kernel: usize,
}

impl Lfm2 {
    fn new(cfg: &Config, w: &Weights, source: &str) -> Result<Self> {
        cfg.validate(source)?;
        let (h, hd) = (cfg.hidden_size, cfg.head_dim());
        let (nh, nkv) = (cfg.num_attention_heads, cfg.kv_heads());
        let (eps, ff, k) = (cfg.norm_eps, cfg.ff_dim(), cfg.conv_l_cache);
        let (mut attn, mut conv) = (0, 0);
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let operator = if cfg.is_attention(i) {
                let a = format!("{p}.self_attn");
                let op = Operator::Attention(
                    Attention {
                        qkv: FusedLinear::new(vec![
                            w.linear(&format!("{a}.q_proj"), nh * hd, h, false)?,
                            w.linear(&format!("{a}.k_proj"), nkv * hd, h, false)?,
                            w.linear(&format!("{a}.v_proj"), nkv * hd, h, false)?,
                        ])?,
                        o_proj: w.linear(&format!("{a}.out_proj"), h, nh * hd, false)?,
                        q_norm: Some(w.rms_norm(&format!("{a}.q_layernorm"), hd, eps)?),
                        k_norm: Some(w.rms_norm(&format!("{a}.k_layernorm"), hd, eps)?),
                        num_heads: nh as i32,
                        num_kv_heads: nkv as i32,
                        head_dim: hd as i32,
                        scale: (hd as f32).powf(-0.5),
                    },
                    attn,
                );
                attn += 1;
                op
            } else {
                let c = format!("{p}.conv");
                let op = Operator::Conv(
                    ShortConv {
                        in_proj: w.linear(&format!("{c}.in_proj"), 3 * h, h, cfg.conv_bias)?,
                        conv: CausalConv::load(w, &format!("{c}.conv"), h, k, cfg.conv_bias)?,
                        out_proj: w.linear(&format!("{c}.out_proj"), h, h, cfg.conv_bias)?,
                    },
                    conv,
                );
                conv += 1;
                op
            };
            let f = format!("{p}.feed_forward");
            layers.push(Layer {
                operator,
                feed_forward: Mlp::new(
                    w.linear(&format!("{f}.w1"), ff, h, false)?,
                    w.linear(&format!("{f}.w3"), ff, h, false)?,
                    w.linear(&format!("{f}.w2"), h, ff, false)?,
                )?,
                operator_norm: w.rms_norm(&format!("{p}.operator_norm"), h, eps)?,
                ffn_norm: w.rms_norm(&format!("{p}.ffn_norm"), h, eps)?,
            });
        }
        Ok(Lfm2 {
            embed_tokens: w.embedding("model.embed_tokens", cfg.vocab_size, h)?,
            layers,
            embedding_norm: w.rms_norm("model.embedding_norm", h, eps)?,
            rope: RotaryEmbedding::new(hd, cfg.rope_theta, false, None, source)?,
            conv_layers: conv,
            kernel: k,
        })
    }

    /// The residual around the operator, then the feed-forward block.
    fn block(&self, layer: &Layer, x: &Array, r: Array) -> Result<Array> {
        let h = x.add(&r)?;
        let m = layer.feed_forward.forward(&layer.ffn_norm.forward(&h)?)?;
        Ok(h.add(&m)?)
    }
}

impl Network for Lfm2 {
    fn hidden(&self, tokens: &Array, cache: &mut dyn KvCache) -> Result<Array> {
        check_cache_states("LFM2", self.conv_layers, cache)?;
        let offset = cache.offset();
        let mut h = self.embed_tokens.forward(tokens)?;
        for layer in &self.layers {
            let x = layer.operator_norm.forward(&h)?;
            let r = match &layer.operator {
                Operator::Attention(a, kv) => a.forward(&x, *kv, offset, &self.rope, cache)?,
                Operator::Conv(c, slot) => mix_cache(c, &x, *slot, cache)?,
            };
            h = self.block(layer, &h, r)?;
        }
        self.embedding_norm.forward(&h)
    }

    fn hidden_rows(&self, tokens: &Array, rows: &mut PagedKvRows) -> Result<Array> {
        check_rows_states("LFM2", self.conv_layers, rows)?;
        let offsets = rows.offsets()?;
        let mut h = self.embed_tokens.forward(tokens)?;
        for layer in &self.layers {
            let x = layer.operator_norm.forward(&h)?;
            let r = match &layer.operator {
                Operator::Attention(a, kv) => {
                    a.forward_rows(&x, *kv, &offsets, &self.rope, rows)?
                }
                Operator::Conv(c, slot) => mix_rows(c, &x, *slot, rows)?,
            };
            h = self.block(layer, &h, r)?;
        }
        self.embedding_norm.forward(&h)
    }

    fn logits(&self, h: &Array) -> Result<Array> {
        self.embed_tokens.as_linear(h)
    }

    fn state_shapes(&self) -> Vec<Vec<Vec<usize>>> {
        let hidden = self.embedding_norm.weight.shape()[0] as usize;
        vec![vec![vec![1, self.kernel - 1, hidden]]; self.conv_layers]
    }

    fn layer_kinds(&self) -> Vec<LayerKind> {
        self.layers
            .iter()
            .map(|l| match l.operator {
                Operator::Attention(..) => LayerKind::Global,
                Operator::Conv(..) => LayerKind::Conv(self.kernel),
            })
            .collect()
    }
}

fn build(ck: &Checkpoint) -> Result<Built> {
    let cfg: Config = serde_json::from_value(ck.config.clone())
        .map_err(|e| EngineError::config(&ck.source, e.to_string()))?;
    let net = Lfm2::new(&cfg, &ck.weights, &ck.source)?;
    let attention = net.layers.len() - net.conv_layers;
    let info = ModelInfo {
        architecture: FAMILY.model_type.to_string(),
        vocab_size: cfg.vocab_size,
        hidden_size: cfg.hidden_size,
        num_heads: cfg.num_attention_heads,
        max_position_embeddings: cfg.max_position_embeddings,
        rope_theta: cfg.rope_theta,
        kv: KvLayout {
            layers: attention,
            kv_heads: cfg.kv_heads(),
            head_dim: cfg.head_dim(),
            dtype: net.embed_tokens.dtype(),
            state_layers: net.conv_layers,
        },
    };
    Ok((Box::new(net), info))
}

/// LFM2, from Hugging Face folders.
pub(crate) const FAMILY: Family = Family {
    model_type: "lfm2",
    gguf: None,
    build,
};
