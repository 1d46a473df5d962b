//! Safe Rust arrays over MLX.
