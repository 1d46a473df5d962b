//! The live side of kvstore: paged KV caches over MLX arrays, and the conversion of their
//! full blocks into immutable store blocks and back.
