//! Errors of the live cache.

/// What went wrong in a cache operation.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CacheError {
    /// An MLX call failed.
    #[error(transparent)]
    Mlx(#[from] mlx::Error),
    /// A layer index past the model's layers.
    #[error("layer {layer} does not exist; the cache has {layers} layers")]
    NoSuchLayer {
        /// The layer asked for.
        layer: usize,
        /// Layers in the cache.
        layers: usize,
    },
    /// Keys or values whose shape or dtype does not fit the cache.
    #[error("keys/values rejected: {0}")]
    Shape(String),
}
