//! Llama (SmolLM2, Llama 2/3.x incl. `rope_scaling` type llama3): pre-norm decoder, grouped
//! query attention, SwiGLU MLP, optional tied embeddings.

use std::sync::atomic::AtomicU64;

use serde::Deserialize;

use crate::error::{EngineError, Result};
use crate::layers::{
    Attention, Decoder, DecoderLayer, FusedLinear, Mlp, RopeScaling, RotaryEmbedding,
};
use crate::model::{KvLayout, ModelInfo};
use crate::models::{Built, Family, GgufLayout};
use crate::pass_memory::DEFAULT_PASS_WORKSPACE;
use crate::weights::{Checkpoint, Weights};

fn default_theta() -> f64 {
    10_000.0
}
fn default_eps() -> f64 {
    1e-6
}
fn default_max_pos() -> usize {
    2048
}

/// A llama `config.json`.
#[derive(Clone, Debug, Deserialize)]
pub struct Config {
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the MLP.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (grouped-query attention); defaults to the query heads.
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    /// Per-head width; defaults to hidden / heads.
    #[serde(default)]
    pub head_dim: Option<usize>,
    /// RMS norm epsilon.
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    /// RoPE base.
    #[serde(default = "default_theta")]
    pub rope_theta: f64,
    /// RoPE scaling (llama3 or linear).
    #[serde(default)]
    pub rope_scaling: Option<RopeScaling>,
    /// Interleaved-pair RoPE (mlx-lm's option; Hugging Face checkpoints use halves).
    #[serde(default)]
    pub rope_traditional: bool,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Context the model was trained for.
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
    /// The LM head is the embedding table.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Biases on q/k/v/o.
    #[serde(default)]
    pub attention_bias: bool,
    /// Biases on the MLP projections.
    #[serde(default)]
    pub mlp_bias: bool,
}

impl Config {
    /// Key/value heads.
    pub fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// Per-head width.
    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// Rejects configs the forward pass cannot run.
    pub(crate) fn validate(&self, source: &str) -> Result<()> {
        let bad = |m: String| Err(EngineError::config(source, m));
        if self.num_attention_heads == 0 || self.kv_heads() == 0 || self.num_hidden_layers == 0 {
            return bad("heads, key/value heads and layers must be positive".into());
        }
        if !self.num_attention_heads.is_multiple_of(self.kv_heads()) {
            return bad(format!(
                "{} heads are not a multiple of {} key/value heads",
                self.num_attention_heads,
                self.kv_heads()
            ));
        }
        if !self.head_dim().is_multiple_of(2) || self.head_dim() == 0 {
            return bad(format!("head_dim {} must be even", self.head_dim()));
        }
        Ok(())
    }
}

/// Biases and norms in which the llama-like families differ.
pub(crate) struct Variant {
    pub(crate) qkv_bias: bool,
    pub(crate) o_bias: bool,
    pub(crate) mlp_bias: bool,
    pub(crate) qk_norm: bool,
}

/// Builds the decoder of a llama-shaped checkpoint (llama, qwen2, qwen3 share the names).
pub(crate) fn build(cfg: &Config, w: &Weights, v: &Variant, source: &str) -> Result<Decoder> {
    cfg.validate(source)?;
    let (h, hd) = (cfg.hidden_size, cfg.head_dim());
    let (nh, nkv) = (cfg.num_attention_heads, cfg.kv_heads());
    let eps = cfg.rms_norm_eps;
    let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
    for i in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{i}");
        let a = format!("{p}.self_attn");
        let m = format!("{p}.mlp");
        let norm = |n: &str| -> Result<Option<_>> {
            Ok(if v.qk_norm {
                Some(w.rms_norm(&format!("{a}.{n}"), hd, eps)?)
            } else {
                None
            })
        };
        layers.push(DecoderLayer {
            self_attn: Attention {
                qkv: FusedLinear::new(vec![
                    w.linear(&format!("{a}.q_proj"), nh * hd, h, v.qkv_bias)?,
                    w.linear(&format!("{a}.k_proj"), nkv * hd, h, v.qkv_bias)?,
                    w.linear(&format!("{a}.v_proj"), nkv * hd, h, v.qkv_bias)?,
                ])?,
                o_proj: w.linear(&format!("{a}.o_proj"), h, nh * hd, v.o_bias)?,
                q_norm: norm("q_norm")?,
                k_norm: norm("k_norm")?,
                num_heads: nh as i32,
                num_kv_heads: nkv as i32,
                head_dim: hd as i32,
                scale: (hd as f32).powf(-0.5),
            },
            mlp: Mlp::new(
                w.linear(
                    &format!("{m}.gate_proj"),
                    cfg.intermediate_size,
                    h,
                    v.mlp_bias,
                )?,
                w.linear(
                    &format!("{m}.up_proj"),
                    cfg.intermediate_size,
                    h,
                    v.mlp_bias,
                )?,
                w.linear(
                    &format!("{m}.down_proj"),
                    h,
                    cfg.intermediate_size,
                    v.mlp_bias,
                )?,
            )?,
            input_layernorm: w.rms_norm(&format!("{p}.input_layernorm"), h, eps)?,
            post_attention_layernorm: w.rms_norm(
                &format!("{p}.post_attention_layernorm"),
                h,
                eps,
            )?,
        });
    }
    // Some tied checkpoints still ship an lm_head copy; the tie decides.
    let lm_head = if cfg.tie_word_embeddings {
        None
    } else {
        Some(w.linear("lm_head", cfg.vocab_size, h, false)?)
    };
    Ok(Decoder {
        embed_tokens: w.embedding("model.embed_tokens", cfg.vocab_size, h)?,
        layers,
        norm: w.rms_norm("model.norm", h, eps)?,
        lm_head,
        rope: RotaryEmbedding::new(
            hd,
            cfg.rope_theta,
            cfg.rope_traditional,
            cfg.rope_scaling.as_ref(),
            source,
        )?,
        pass_workspace: AtomicU64::new(DEFAULT_PASS_WORKSPACE),
    })
}

/// A llama model.
pub(crate) fn new(cfg: &Config, w: &Weights, source: &str) -> Result<Decoder> {
    let variant = Variant {
        qkv_bias: cfg.attention_bias,
        o_bias: cfg.attention_bias,
        mlp_bias: cfg.mlp_bias,
        qk_norm: false,
    };
    build(cfg, w, &variant, source)
}

/// Llama (SmolLM2, Llama 2/3.x), from folders and GGUFs (llama.cpp permuted Q and K).
pub(crate) const FAMILY: Family = Family {
    model_type: "llama",
    gguf: Some(GgufLayout { permuted_qk: true }),
    build: |ck| {
        let cfg = parse(ck)?;
        let d = new(&cfg, &ck.weights, &ck.source)?;
        Ok(decoder_model(FAMILY.model_type, &cfg, d))
    },
};

/// A family config read as llama's (qwen2 and qwen3 use the same fields).
pub(crate) fn parse(ck: &Checkpoint) -> Result<Config> {
    serde_json::from_value(ck.config.clone())
        .map_err(|e| EngineError::config(&ck.source, e.to_string()))
}

/// The network and description of a model built on the shared [`Decoder`].
pub(crate) fn decoder_model(model_type: &str, cfg: &Config, decoder: Decoder) -> Built {
    let info = ModelInfo {
        architecture: model_type.to_string(),
        vocab_size: cfg.vocab_size,
        hidden_size: cfg.hidden_size,
        num_heads: cfg.num_attention_heads,
        max_position_embeddings: cfg.max_position_embeddings,
        rope_theta: cfg.rope_theta,
        kv: KvLayout {
            layers: cfg.num_hidden_layers,
            kv_heads: cfg.kv_heads(),
            head_dim: cfg.head_dim(),
            dtype: decoder.embed_tokens.dtype(),
            state_layers: 0,
        },
    };
    (Box::new(decoder), info)
}
