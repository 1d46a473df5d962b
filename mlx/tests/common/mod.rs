//! What the mlx test binaries share.

use rand::rngs::StdRng;
use rand::SeedableRng;

/// A seeded generator for `test`: the seed is printed, and `KVSTORE_TEST_SEED` replays one.
pub fn rng(test: &str) -> StdRng {
    let seed = std::env::var("KVSTORE_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random::<u64>);
    eprintln!("{test}: KVSTORE_TEST_SEED={seed}");
    StdRng::seed_from_u64(seed)
}
