//! Content-addressed store for published KV blocks: named, typed byte planes in a RAM
//! tier and an SSD tier. This crate never depends on MLX.
