//! The generation engine: models, weights, tokenizer, sampler and scheduling on MLX, with
//! prefix reuse through the block store.
