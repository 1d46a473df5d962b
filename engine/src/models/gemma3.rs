//! Gemma 3 (text): a decoder whose layers alternate between sliding-window attention (most
//! layers) and global attention (every `sliding_window_pattern`-th, or as `layer_types`
//! says), with
//!
//! - per-head RMS norms on queries and keys before RoPE,
//! - four norms per layer: before and after attention, before and after the MLP
//!   ("sandwich" norms), all Gemma RMS norms that scale by `1 + weight`,
//! - a gated GELU (tanh approximation) MLP,
//! - the embedding scaled by `sqrt(hidden)` (rounded to bf16 first, as Gemma does),
//! - RoPE base `rope_local_base_freq` on window layers and `rope_theta` (with
//!   `rope_scaling`) on global layers,
//! - attention scale `query_pre_attn_scalar^-1/2`,
//! - tied embeddings and optional final logit softcapping.
//!
//! Window layers keep every key in the cache (a paged cache publishes full blocks of every
//! layer); the mask hides keys that fell out of the window, so a restored cache attends
//! exactly as a fresh one does.

use cache::{attention_mask, KvCache, PagedKvRows};
use mlx::fast;
use mlx::{Array, Dtype};
use serde::Deserialize;
use serde_json::Value;

use crate::error::{EngineError, Result};
use crate::layers::{Embedding, FusedLinear, Linear, RmsNorm, RopeScaling, RotaryEmbedding};
use crate::model::{KvLayout, LayerKind, ModelInfo};
use crate::models::{Built, Family, Network};
use crate::weights::{Checkpoint, Weights};

fn default_heads() -> usize {
    4
}
fn default_kv_heads() -> usize {
    1
}
fn default_head_dim() -> usize {
    256
}
fn default_eps() -> f64 {
    1e-6
}
fn default_local_base() -> f64 {
    10_000.0
}
fn default_scalar() -> f64 {
    256.0
}
fn default_window() -> usize {
    512
}
fn default_max_pos() -> usize {
    32_768
}
fn default_true() -> bool {
    true
}

/// A `gemma3_text` `config.json`. Defaults are Gemma 3's (as in transformers and mlx-lm).
#[derive(Clone, Debug, Deserialize)]
pub struct Config {
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the MLP.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    #[serde(default = "default_heads")]
    pub num_attention_heads: usize,
    /// Key/value heads.
    #[serde(default = "default_kv_heads")]
    pub num_key_value_heads: usize,
    /// Per-head width.
    #[serde(default = "default_head_dim")]
    pub head_dim: usize,
    /// RMS norm epsilon.
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// RoPE base of global layers (transformers' name).
    #[serde(default)]
    pub rope_theta: Option<f64>,
    /// RoPE base of global layers (mlx-lm's name); must agree with `rope_theta` if both.
    #[serde(default)]
    pub rope_global_base_freq: Option<f64>,
    /// RoPE base of sliding-window layers.
    #[serde(default = "default_local_base")]
    pub rope_local_base_freq: f64,
    /// RoPE scaling of global layers (linear).
    #[serde(default)]
    pub rope_scaling: Option<RopeScaling>,
    /// Interleaved-pair RoPE (never in Gemma checkpoints).
    #[serde(default)]
    pub rope_traditional: bool,
    /// Attention scale is `query_pre_attn_scalar^-1/2`.
    #[serde(default = "default_scalar")]
    pub query_pre_attn_scalar: f64,
    /// Keys a window layer sees, the query's own included.
    #[serde(default = "default_window")]
    pub sliding_window: usize,
    /// Every n-th layer is global (mlx-lm's field; transformers writes
    /// `_sliding_window_pattern`).
    #[serde(default, alias = "_sliding_window_pattern")]
    pub sliding_window_pattern: Option<usize>,
    /// `sliding_attention` or `full_attention` per layer (transformers).
    #[serde(default)]
    pub layer_types: Option<Vec<String>>,
    /// Context the model was trained for.
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
    /// The LM head is the embedding table.
    #[serde(default = "default_true")]
    pub tie_word_embeddings: bool,
    /// `tanh(logits / cap) · cap` on the final logits, when set.
    #[serde(default)]
    pub final_logit_softcapping: Option<f64>,
    /// Gemma 2's attention-score softcapping: not supported (Gemma 3 has none).
    #[serde(default)]
    pub attn_logit_softcapping: Option<f64>,
    /// The MLP activation; only the tanh-approximated GELU is supported.
    #[serde(default)]
    pub hidden_activation: Option<String>,
}

impl Config {
    /// Reads and validates a config.json value.
    pub fn parse(v: &Value, source: &str) -> Result<Config> {
        let cfg: Config = serde_json::from_value(v.clone())
            .map_err(|e| EngineError::config(source, e.to_string()))?;
        cfg.validate(source)?;
        Ok(cfg)
    }

    /// RoPE base of global layers.
    pub fn global_theta(&self) -> f64 {
        self.rope_theta
            .or(self.rope_global_base_freq)
            .unwrap_or(1_000_000.0)
    }

    /// Each layer's attention: a window of `sliding_window` keys, or global. `layer_types`
    /// wins; else every `sliding_window_pattern`-th layer (default 6) is global.
    pub fn layer_kinds(&self) -> Vec<LayerKind> {
        let window = LayerKind::Window(self.sliding_window);
        match &self.layer_types {
            Some(types) => types
                .iter()
                .map(|t| match t.as_str() {
                    "sliding_attention" => window,
                    _ => LayerKind::Global,
                })
                .collect(),
            None => {
                let p = self.sliding_window_pattern.unwrap_or(6).max(1);
                (0..self.num_hidden_layers)
                    .map(|i| {
                        if (i + 1) % p == 0 {
                            LayerKind::Global
                        } else {
                            window
                        }
                    })
                    .collect()
            }
        }
    }

    fn validate(&self, source: &str) -> Result<()> {
        let bad = |m: String| Err(EngineError::config(source, m));
        let (nh, nkv) = (self.num_attention_heads, self.num_key_value_heads);
        if nh == 0 || nkv == 0 || self.num_hidden_layers == 0 || self.hidden_size == 0 {
            return bad("heads, key/value heads, layers and hidden size must be positive".into());
        }
        if !nh.is_multiple_of(nkv) {
            return bad(format!(
                "{nh} heads are not a multiple of {nkv} key/value heads"
            ));
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return bad(format!("head_dim {} must be even", self.head_dim));
        }
        if self.sliding_window == 0 {
            return bad("sliding_window must be at least 1".into());
        }
        if self.query_pre_attn_scalar.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater) {
            return bad("query_pre_attn_scalar must be positive".into());
        }
        if let (Some(a), Some(b)) = (self.rope_theta, self.rope_global_base_freq) {
            if a != b {
                return bad(format!(
                    "rope_theta {a} and rope_global_base_freq {b} disagree"
                ));
            }
        }
        if let Some(types) = &self.layer_types {
            if types.len() != self.num_hidden_layers {
                return bad(format!(
                    "layer_types lists {} layers, the model has {}",
                    types.len(),
                    self.num_hidden_layers
                ));
            }
            if let Some(t) = types
                .iter()
                .find(|t| !["sliding_attention", "full_attention"].contains(&t.as_str()))
            {
                return bad(format!("layer type {t:?} is not supported"));
            }
            if let Some(p) = self.sliding_window_pattern {
                let by_pattern = Config {
                    layer_types: None,
                    ..self.clone()
                };
                if p == 0 || by_pattern.layer_kinds() != self.layer_kinds() {
                    return bad(format!(
                        "layer_types disagree with sliding_window_pattern {p}"
                    ));
                }
            }
        }
        if self.sliding_window_pattern == Some(0) {
            return bad("sliding_window_pattern must be at least 1".into());
        }
        if let Some(c) = self.attn_logit_softcapping {
            return bad(format!(
                "attn_logit_softcapping {c} is not supported (Gemma 3 has none)"
            ));
        }
        if let Some(c) = self.final_logit_softcapping {
            if c.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater) {
                return bad(format!("final_logit_softcapping {c} must be positive"));
            }
        }
        match self.hidden_activation.as_deref() {
            None | Some("gelu_pytorch_tanh") | Some("gelu_tanh") => {}
            Some(other) => {
                return bad(format!(
                    "hidden_activation {other:?} is not supported (gelu_pytorch_tanh)"
                ))
            }
        }
        Ok(())
    }
}

/// Gemma's RMS norm scales by `1 + weight`: folded into the weight once, at load.
fn gemma_norm(w: &Weights, prefix: &str, dim: usize, eps: f64) -> Result<RmsNorm> {
    let n = w.rms_norm(prefix, dim, eps)?;
    let weight = n.weight.add_scalar(1.0)?;
    weight.eval()?;
    Ok(RmsNorm { weight, eps: n.eps })
}

/// `down(gelu_tanh(gate(x)) · up(x))`.
#[derive(Debug)]
struct Mlp {
    /// gate_proj and up_proj, stacked.
    gate_up: FusedLinear,
    down_proj: Linear,
}

impl Mlp {
    fn new(gate_proj: Linear, up_proj: Linear, down_proj: Linear) -> Result<Self> {
        Ok(Mlp {
            gate_up: FusedLinear::new(vec![gate_proj, up_proj])?,
            down_proj,
        })
    }

    fn forward(&self, x: &Array) -> Result<Array> {
        let h = self.gate_up.gated(x, mlx::fast::Gate::GeluTanh)?;
        self.down_proj.forward(&h)
    }
}

/// Self-attention of one layer, windowed or global: the shared projections and per-head
/// norms of [`crate::layers::Attention`], with a window-aware mask.
#[derive(Debug)]
struct Attention {
    inner: crate::layers::Attention,
    kind: LayerKind,
}

impl Attention {
    fn heads(&self, x: &Array) -> Result<(Array, Array, Array)> {
        self.inner.heads(x)
    }

    fn output(&self, o: &Array) -> Result<Array> {
        self.inner.output(o)
    }

    fn window(&self) -> Option<usize> {
        match self.kind {
            LayerKind::Window(w) => Some(w),
            _ => None,
        }
    }

    /// `x` `[1, L, hidden]` after `offset` cached positions → `[1, L, hidden]`.
    fn forward(
        &self,
        x: &Array,
        layer: usize,
        offset: usize,
        rope: &RotaryEmbedding,
        cache: &mut dyn KvCache,
    ) -> Result<Array> {
        let l = x.shape()[1] as usize;
        let (q, k, v) = self.heads(x)?;
        let q = rope.forward(&q, offset)?;
        let k = rope.forward(&k, offset)?;
        // 3. The cache returns every key it holds; a window layer's mask hides those more
        //    than `window - 1` positions behind each query.
        let (keys, values) = cache.update_and_fetch(layer, &k, &v)?;
        let held = keys.shape()[2] as usize;
        let mask = attention_mask(held.saturating_sub(l), l, self.window())?;
        let o = fast::scaled_dot_product_attention(
            &q,
            &keys,
            &values,
            self.inner.scale,
            mask.as_attention(),
        )?;
        self.output(&o)
    }

    /// One decode step of a batch: `x` `[B, 1, hidden]`, row b at position `offsets[b]`;
    /// each row attends over its own cache, on window layers over the window's keys only.
    fn forward_rows(
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
        let o = rows.attend(layer, &q, &k, &v, self.inner.scale, self.window())?;
        self.output(&o)
    }
}

/// One decoder layer with Gemma's sandwich norms.
#[derive(Debug)]
struct DecoderLayer {
    self_attn: Attention,
    mlp: Mlp,
    input_layernorm: RmsNorm,
    post_attention_layernorm: RmsNorm,
    pre_feedforward_layernorm: RmsNorm,
    post_feedforward_layernorm: RmsNorm,
}

impl DecoderLayer {
    /// `x` through the layer, with `attend` as its attention (one sequence or a batch).
    fn forward(
        &self,
        x: &Array,
        attend: impl FnOnce(&Attention, &Array) -> Result<Array>,
    ) -> Result<Array> {
        // h = x + post_attn_norm(attn(input_norm(x)))
        let r = attend(&self.self_attn, &self.input_layernorm.forward(x)?)?;
        let h = x.add(&self.post_attention_layernorm.forward(&r)?)?;
        // out = h + post_ffw_norm(mlp(pre_ffw_norm(h)))
        let r = self
            .mlp
            .forward(&self.pre_feedforward_layernorm.forward(&h)?)?;
        Ok(h.add(&self.post_feedforward_layernorm.forward(&r)?)?)
    }
}

/// A Gemma 3 text model.
#[derive(Debug)]
pub(crate) struct Gemma3 {
    embed_tokens: Embedding,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    /// `None` when the LM head is tied to the embedding (Gemma's default).
    lm_head: Option<Linear>,
    rope_local: RotaryEmbedding,
    rope_global: RotaryEmbedding,
    hidden_size: usize,
    softcap: Option<f64>,
    kinds: Vec<LayerKind>,
}

impl Gemma3 {
    /// Builds the model from a validated config and its checkpoint's tensors.
    pub(crate) fn new(cfg: &Config, w: &Weights, source: &str) -> Result<Gemma3> {
        let (h, hd) = (cfg.hidden_size, cfg.head_dim);
        let (nh, nkv) = (cfg.num_attention_heads, cfg.num_key_value_heads);
        let eps = cfg.rms_norm_eps;
        let kinds = cfg.layer_kinds();
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for (i, &kind) in kinds.iter().enumerate() {
            let p = format!("model.layers.{i}");
            let a = format!("{p}.self_attn");
            let m = format!("{p}.mlp");
            let inter = cfg.intermediate_size;
            layers.push(DecoderLayer {
                self_attn: Attention {
                    inner: crate::layers::Attention {
                        qkv: FusedLinear::new(vec![
                            w.linear(&format!("{a}.q_proj"), nh * hd, h, false)?,
                            w.linear(&format!("{a}.k_proj"), nkv * hd, h, false)?,
                            w.linear(&format!("{a}.v_proj"), nkv * hd, h, false)?,
                        ])?,
                        o_proj: w.linear(&format!("{a}.o_proj"), h, nh * hd, false)?,
                        q_norm: Some(gemma_norm(w, &format!("{a}.q_norm"), hd, eps)?),
                        k_norm: Some(gemma_norm(w, &format!("{a}.k_norm"), hd, eps)?),
                        num_heads: nh as i32,
                        num_kv_heads: nkv as i32,
                        head_dim: hd as i32,
                        scale: cfg.query_pre_attn_scalar.powf(-0.5) as f32,
                    },
                    kind,
                },
                mlp: Mlp::new(
                    w.linear(&format!("{m}.gate_proj"), inter, h, false)?,
                    w.linear(&format!("{m}.up_proj"), inter, h, false)?,
                    w.linear(&format!("{m}.down_proj"), h, inter, false)?,
                )?,
                input_layernorm: gemma_norm(w, &format!("{p}.input_layernorm"), h, eps)?,
                post_attention_layernorm: gemma_norm(
                    w,
                    &format!("{p}.post_attention_layernorm"),
                    h,
                    eps,
                )?,
                pre_feedforward_layernorm: gemma_norm(
                    w,
                    &format!("{p}.pre_feedforward_layernorm"),
                    h,
                    eps,
                )?,
                post_feedforward_layernorm: gemma_norm(
                    w,
                    &format!("{p}.post_feedforward_layernorm"),
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
        Ok(Gemma3 {
            embed_tokens: w.embedding("model.embed_tokens", cfg.vocab_size, h)?,
            layers,
            norm: gemma_norm(w, "model.norm", h, eps)?,
            lm_head,
            rope_local: RotaryEmbedding::new(
                hd,
                cfg.rope_local_base_freq,
                cfg.rope_traditional,
                None,
                source,
            )?,
            rope_global: RotaryEmbedding::new(
                hd,
                cfg.global_theta(),
                cfg.rope_traditional,
                cfg.rope_scaling.as_ref(),
                source,
            )?,
            hidden_size: h,
            softcap: cfg.final_logit_softcapping,
            kinds,
        })
    }

    /// Each layer's attention kind, in order.
    pub(crate) fn layer_kinds(&self) -> &[LayerKind] {
        &self.kinds
    }

    /// The dtype activations take.
    pub(crate) fn dtype(&self) -> Dtype {
        self.embed_tokens.dtype()
    }

    /// Hidden states after the final norm, `[1, L, hidden]`, for `tokens` placed after
    /// what `cache` holds.
    pub(crate) fn hidden(&self, tokens: &Array, cache: &mut dyn KvCache) -> Result<Array> {
        let offset = cache.offset();
        let mut h = self.embed(tokens)?;
        for (i, layer) in self.layers.iter().enumerate() {
            let rope = self.rope(layer);
            h = layer.forward(&h, |a, x| a.forward(x, i, offset, rope, cache))?;
        }
        self.norm.forward(&h)
    }

    /// Hidden states `[B, 1, hidden]` of one decode step of a batch: `tokens` `[B, 1]`,
    /// row b placed after what row b of `rows` holds.
    pub(crate) fn hidden_rows(&self, tokens: &Array, rows: &mut PagedKvRows) -> Result<Array> {
        let offsets = rows.offsets()?;
        let mut h = self.embed(tokens)?;
        for (i, layer) in self.layers.iter().enumerate() {
            let rope = self.rope(layer);
            h = layer.forward(&h, |a, x| a.forward_rows(x, i, &offsets, rope, rows))?;
        }
        self.norm.forward(&h)
    }

    /// The scaled embedding: Gemma multiplies by sqrt(hidden) rounded to bf16 (25.25 for
    /// 640, not 25.298), as transformers and mlx-lm do.
    fn embed(&self, tokens: &Array) -> Result<Array> {
        let h = self.embed_tokens.forward(tokens)?;
        let scale =
            Array::scalar((self.hidden_size as f64).sqrt(), Dtype::BF16)?.astype(h.dtype())?;
        Ok(h.mul(&scale)?)
    }

    fn rope(&self, layer: &DecoderLayer) -> &RotaryEmbedding {
        match layer.self_attn.kind {
            LayerKind::Window(_) => &self.rope_local,
            _ => &self.rope_global,
        }
    }

    /// Logits `[.., vocab]` of hidden states `[.., hidden]`, softcapped when configured.
    pub(crate) fn logits(&self, h: &Array) -> Result<Array> {
        let logits = match &self.lm_head {
            Some(head) => head.forward(h)?,
            None => self.embed_tokens.as_linear(h)?,
        };
        Ok(match self.softcap {
            Some(cap) => logits.mul_scalar(1.0 / cap)?.tanh()?.mul_scalar(cap)?,
            None => logits,
        })
    }
}

impl Network for Gemma3 {
    fn hidden(&self, tokens: &Array, cache: &mut dyn KvCache) -> Result<Array> {
        Gemma3::hidden(self, tokens, cache)
    }

    fn hidden_rows(&self, tokens: &Array, rows: &mut PagedKvRows) -> Result<Array> {
        Gemma3::hidden_rows(self, tokens, rows)
    }

    fn logits(&self, h: &Array) -> Result<Array> {
        Gemma3::logits(self, h)
    }

    fn layer_kinds(&self) -> Vec<LayerKind> {
        Gemma3::layer_kinds(self).to_vec()
    }
}

/// Gemma 3 text models, from Hugging Face folders (its K-quant GGUFs are converted by
/// `setup.sh --with-gemma`).
pub(crate) const FAMILY: Family = Family {
    model_type: "gemma3_text",
    gguf: None,
    build,
};

fn build(ck: &Checkpoint) -> Result<Built> {
    let cfg = Config::parse(&ck.config, &ck.source)?;
    let g = Gemma3::new(&cfg, &ck.weights, &ck.source)?;
    let info = ModelInfo {
        architecture: FAMILY.model_type.to_string(),
        vocab_size: cfg.vocab_size,
        hidden_size: cfg.hidden_size,
        num_heads: cfg.num_attention_heads,
        max_position_embeddings: cfg.max_position_embeddings,
        rope_theta: cfg.global_theta(),
        kv: KvLayout {
            layers: cfg.num_hidden_layers,
            kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim,
            dtype: g.dtype(),
            state_layers: 0,
        },
    };
    Ok((Box::new(g), info))
}
