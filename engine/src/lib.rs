//! The generation engine: models, weights, tokenizer + chat template and sampler on MLX.
//!
//! - [`load`] opens a model path — a `.gguf` file or a Hugging Face folder (config.json +
//!   safetensors, dense or MLX-quantized) — into a [`Model`] and its [`Tokenizer`].
//! - [`Model::forward`] runs tokens after what a [`cache::KvCache`] holds and returns the
//!   last position's logits; [`Model::prefill`] does it in bounded chunks.
//! - [`Tokenizer::apply_chat_template`] renders Hugging Face chat templates with `minijinja`.
//! - [`Sampler`] picks tokens; [`generate`] ties it together with streaming and timings.
//! - [`GrammarCompiler`] compiles a grammar into a [`Constraint`] that
//!   [`GenerateParams::constraint`] enforces while sampling (structured output).
//! - [`Engine`] runs many requests at once (continuous batching, prefix reuse) on its own
//!   thread: submit, stream [`Event`]s, cancel; [`server`] serves it over HTTP (OpenAI API).
//! - [`Model::fingerprint`] and [`Model::kv_layout`] identify the KV blocks a model makes.
//!
//! Families: llama (SmolLM2, Llama 3.x), qwen2, qwen3, one file each under [`models`].
//! On CPU, weights are expanded to f32 at load ([`LoadOptions::keep_as_stored`] keeps them).
//!
//! ```no_run
//! use engine::{load, generate, GenerateParams, LoadOptions};
//! let (model, tokenizer) = load("models/SmolLM2-135M-Instruct.Q4_1.gguf".as_ref(), &LoadOptions::default())?;
//! let prompt = tokenizer.encode_chat(r#"[{"role": "user", "content": "Hi!"}]"#, None, true)?;
//! let mut cache = model.new_cache();
//! let out = generate(&model, &tokenizer, &mut cache, &prompt, &GenerateParams::default(), &mut |_| true)?;
//! println!("{}", out.text);
//! # Ok::<(), engine::EngineError>(())
//! ```

#![deny(unsafe_code)]

mod census;
mod chunk_budget;
mod constrained;
mod cost_model;
mod device_memory;
mod device_sampler;
mod device_tier;
mod error;
mod export;
#[doc(hidden)]
pub mod fuzzing;
mod generate;
mod host_probe;
mod layers;
mod load_gate;
mod model;
pub mod models;
mod pass_memory;
mod prefill_order;
mod reuse;
mod sampler;
mod scheduler;
mod sequence;
pub mod server;
mod staging_budget;
mod tokenizer;
mod warm_up;
mod weights;

pub use census::{
    graph_census, graph_census_enabled, graph_census_lines, StepCensus, StepShape, GRAPH_CENSUS_VAR,
};
pub use constrained::{json_schema_rule, lark_literal, Constraint, GrammarCompiler};
pub use cost_model::{CostSamples, Fit, RestoreEstimates};
pub use device_tier::DeviceTier;
pub use error::{EngineError, ErrorClass, Result};
pub use export::{ExportStats, MAX_PENDING_BYTES};
pub use generate::{
    generate, greedy_ids, FinishReason, GenerateParams, Generation, Timings, TokenEvent,
};
pub use layers::RopeScaling;
pub use model::{
    aligned_chunk, default_prefill_chunk, KvLayout, LayerKind, MixedStep, Model, ModelInfo,
    PromptChunk, PromptPass, DEFAULT_PREFILL_CHUNK, GPU_PREFILL_CHUNK,
};
pub use pass_memory::{pass_memory_waits, DEFAULT_PASS_WORKSPACE};
pub use prefill_order::PrefillOrder;
pub use reuse::{
    auto_state_every, combined_salt, default_share_min_tokens, generate_with_reuse,
    namespace_description, HostPrefix, KvTiers, PinnedTiers, Prepared, ReuseConfig, ReuseReport,
    SHARE_MIN_TOKENS_CPU,
};
pub use sampler::{argmax, Sampled, Sampler, SamplingParams};
pub use scheduler::{
    CancelHandle, Completion, Engine, EngineConfig, EngineMetrics, Event, InjectedFault, Request,
    RequestHandle, StepRecord, SubmitError, DEFAULT_IO_WORKERS, DEFAULT_LOAD_GRACE,
    SUGGESTED_ITL_STRETCH, TTFT_BUCKETS,
};
pub use staging_budget::DEFAULT_STAGING_BYTES;
pub use tokenizer::{
    chat_request_parts, render_template, Tokenizer, MAX_RENDER_BYTES, RENDER_FUEL_BASE,
    RENDER_FUEL_PER_VALUE,
};
pub use weights::LoadOptions;

use std::path::Path;

/// Loads a model and its tokenizer from a `.gguf` file or a Hugging Face folder.
pub fn load(path: &Path, options: &LoadOptions) -> Result<(Model, Tokenizer)> {
    let ck = weights::Checkpoint::load(path, options)?;
    let tokenizer = match &ck.folder {
        Some(dir) => Tokenizer::from_folder(dir)?,
        None => Tokenizer::from_gguf(&ck.gguf_metadata)?,
    };
    let model = Model::from_checkpoint(&ck)?;
    Ok((model, tokenizer))
}
