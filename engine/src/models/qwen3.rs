//! Qwen3 (dense): the llama decoder with per-head RMS norms on queries and keys before RoPE,
//! an explicit `head_dim`, and no attention biases by default.

use serde::Deserialize;

use crate::error::{EngineError, Result};
use crate::layers::Decoder;
use crate::models::llama::{self, Variant};
use crate::models::{Family, GgufLayout};
use crate::weights::Weights;

/// A qwen3 `config.json`: llama's fields; `head_dim` is required.
#[derive(Clone, Debug, Deserialize)]
#[serde(transparent)]
pub struct Config(pub llama::Config);

/// A qwen3 model.
pub(crate) fn new(cfg: &Config, w: &Weights, source: &str) -> Result<Decoder> {
    if cfg.0.head_dim.is_none() {
        return Err(EngineError::config(source, "qwen3 needs head_dim"));
    }
    let variant = Variant {
        qkv_bias: cfg.0.attention_bias,
        o_bias: cfg.0.attention_bias,
        mlp_bias: false,
        qk_norm: true,
    };
    llama::build(&cfg.0, w, &variant, source)
}

/// Qwen3, from folders and GGUFs.
pub(crate) const FAMILY: Family = Family {
    model_type: "qwen3",
    gguf: Some(GgufLayout { permuted_qk: false }),
    build: |ck| {
        let cfg = Config(llama::parse(ck)?);
        let d = new(&cfg, &ck.weights, &ck.source)?;
        Ok(llama::decoder_model(FAMILY.model_type, &cfg.0, d))
    },
};
