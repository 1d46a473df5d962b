//! Engine integration tests: parity with mlx-lm and transformers (goldens written by
//! scripts/goldens/make_goldens.sh), loading, bad input, generation.

mod anthropic;
mod bad_input;
mod batch;
mod common;
mod constrained;
mod exclusive;
mod fuzz_corpus;
mod gemma3;
mod generation;
mod hostile_models;
mod hybrid;
mod parity;
#[path = "../../../tests/src/prerequisite.rs"]
mod prerequisite;
mod reasoning_reuse;
mod server;
mod share;
mod templates;
