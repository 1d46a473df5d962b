//! Greedy generation with and without prefix reuse, and seeded token streams: what the
//! reuse and remote-tier tests compare.

use engine::{generate_with_reuse, GenerateParams, KvTiers, Model, ReuseReport, Tokenizer};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Greedy decoding of exactly `max_tokens` tokens (EOS does not stop it).
pub fn params(max_tokens: usize) -> GenerateParams {
    GenerateParams {
        max_tokens,
        stop_at_eos: false,
        ..GenerateParams::default()
    }
}

/// Greedy tokens for `prompt` on a fresh cache, nothing reused: the reference.
pub fn cold(model: &Model, tok: &Tokenizer, prompt: &[u32], n: usize) -> Vec<u32> {
    generate_with_reuse(model, tok, None, prompt, &params(n), &mut |_| true)
        .unwrap()
        .0
        .tokens
}

/// Greedy tokens for `prompt` through the prefix cache `pc`, and what reuse did.
pub fn cached(
    model: &Model,
    tok: &Tokenizer,
    pc: &KvTiers,
    prompt: &[u32],
    n: usize,
) -> (Vec<u32>, ReuseReport) {
    let (g, r) =
        generate_with_reuse(model, tok, Some(pc), prompt, &params(n), &mut |_| true).unwrap();
    (g.tokens, r)
}

/// Prompt tokens a request reused from this engine's own tiers (device, RAM, SSD).
pub fn local_tokens(r: &ReuseReport) -> usize {
    r.cached_device_tokens + r.cached_ram_tokens + r.cached_ssd_tokens
}

/// A generator seeded from `$KVSTORE_TEST_SEED`, else at random; the seed is printed.
pub fn rng(test: &str) -> StdRng {
    let seed = std::env::var("KVSTORE_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random::<u64>);
    eprintln!("{test}: KVSTORE_TEST_SEED={seed}");
    StdRng::seed_from_u64(seed)
}

/// `n` random token ids in `3..vocab` (below 3: special tokens of the tiny models).
pub fn random_tokens(r: &mut StdRng, n: usize, vocab: u32) -> Vec<u32> {
    (0..n).map(|_| r.gen_range(3..vocab)).collect()
}
