//! One file per architecture family; the layers they share live in `layers`.

pub mod gemma3;
pub mod llama;
pub mod qwen2;
pub mod qwen3;
