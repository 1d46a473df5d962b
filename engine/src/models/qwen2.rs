//! Qwen2 / Qwen2.5: the llama decoder with biases on the q/k/v projections (none on o).

use serde::Deserialize;

use crate::error::Result;
use crate::layers::Decoder;
use crate::models::llama::{self, Variant};
use crate::models::{Family, GgufLayout};
use crate::weights::Weights;

/// A qwen2 `config.json`: llama's fields (sliding-window options are ignored, as mlx-lm does:
/// released Qwen2 checkpoints leave `use_sliding_window` off).
#[derive(Clone, Debug, Deserialize)]
#[serde(transparent)]
pub struct Config(pub llama::Config);

/// A qwen2 model.
pub(crate) fn new(cfg: &Config, w: &Weights, source: &str) -> Result<Decoder> {
    let variant = Variant {
        qkv_bias: true,
        o_bias: false,
        mlp_bias: false,
        qk_norm: false,
    };
    llama::build(&cfg.0, w, &variant, source)
}

/// Qwen2 / Qwen2.5, from folders and GGUFs.
pub(crate) const FAMILY: Family = Family {
    model_type: "qwen2",
    gguf: Some(GgufLayout { permuted_qk: false }),
    build: |ck| {
        let cfg = Config(llama::parse(ck)?);
        let d = new(&cfg, &ck.weights, &ck.source)?;
        Ok(llama::decoder_model(FAMILY.model_type, &cfg.0, d))
    },
};
