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
    /// A configuration the cache cannot honour.
    #[error("invalid cache configuration: {0}")]
    Config(String),
    /// The pool is at its maximum size and every block is in use.
    #[error(
        "KV block pool exhausted: all {capacity} blocks of {block_size} tokens are in use \
         (maximum {max_blocks}); raise the KV budget or shorten the request"
    )]
    PoolExhausted {
        /// Blocks in the pool.
        capacity: usize,
        /// The pool's maximum size in blocks.
        max_blocks: usize,
        /// Tokens per block.
        block_size: usize,
    },
    /// Blocks handed to restore do not form a valid prefix for this cache.
    #[error("cannot restore block {position}: {reason}")]
    Restore {
        /// Position (block index) of the first rejected block.
        position: usize,
        /// Why it was rejected.
        reason: String,
    },
    /// A non-attention layer's state cannot go back that far: it kept no state there.
    #[error(
        "cannot drop the last {tokens} of {held} tokens: a recurrent or convolutional layer \
         kept its state only after {kept:?} tokens (and at 0)"
    )]
    Rewind {
        /// Tokens asked to drop.
        tokens: usize,
        /// Tokens the layer holds.
        held: usize,
        /// Token counts at which it kept an earlier state.
        kept: Vec<usize>,
    },
    /// Window layers hold no keys (a restore left them out) where a continuation from the
    /// trimmed length would look.
    #[error(
        "cannot drop the last {tokens} of {held} tokens: window layers of {window} hold real \
         keys only from position {floor} on, so a continuation needs at least {} tokens",
        floor + window - 1
    )]
    WindowRewind {
        /// Tokens asked to drop.
        tokens: usize,
        /// Tokens the cache holds.
        held: usize,
        /// The first position whose window-layer keys were restored or computed.
        floor: usize,
        /// The widest window.
        window: usize,
    },
    /// Tokens given for publication do not match what the cache holds.
    #[error("publish: {0}")]
    Publish(String),
}
