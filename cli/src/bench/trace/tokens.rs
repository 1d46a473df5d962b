//! Deterministic token synthesis: each hash id of a trace becomes a fixed pseudo-random
//! block of token ids, the same in every run, process and machine (no process-random RNG).
//!
//! Block `id` at vocabulary `V`: the blake3 extendable output of
//! `derive_key(CONTEXT, id as u64 little-endian)`, read as little-endian u32 words, each
//! taken modulo `V`. A shorter block (a smaller `--token-scale`) is a prefix of a longer one.
//! Test vectors are in docs/benchmarks.md ("Trace replay") and in the tests below.

use super::parse::TraceRequest;
use super::scale::TokenScale;

/// blake3 key-derivation context of the block tokens; changing it changes every prompt.
const CONTEXT: &str = "kvstore bench trace 2026-12-01 block tokens v1";

/// The first `n` token ids of block `id`, each below `vocab` (which must be at least 1).
pub fn block_tokens(id: u64, n: usize, vocab: u32) -> Vec<u32> {
    let mut h = blake3::Hasher::new_derive_key(CONTEXT);
    h.update(&id.to_le_bytes());
    let mut bytes = vec![0u8; 4 * n];
    h.finalize_xof().fill(&mut bytes);
    bytes
        .chunks_exact(4)
        .map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]) % vocab.max(1))
        .collect()
}

/// A request's prompt: its blocks' tokens one after another, cut to the scaled
/// `input_length` (the last block may be partial).
pub fn prompt(r: &TraceRequest, scale: &TokenScale, vocab: u32) -> Vec<u32> {
    let len = scale.prompt_len(r);
    let b = scale.block();
    let mut out = Vec::with_capacity(len);
    for &id in &r.hash_ids {
        let take = b.min(len - out.len());
        out.extend(block_tokens(id, take, vocab));
        if out.len() == len {
            break;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vectors written in docs/benchmarks.md; a change here is a change of every
    /// synthesized prompt, so every figure measured before would stop being comparable.
    #[test]
    fn test_vectors() {
        // Also computed with Python's `blake3` package (docs/benchmarks.md shows how).
        assert_eq!(
            block_tokens(0, 8, 49152),
            vec![41353, 22348, 10039, 17528, 18584, 10173, 25199, 39932]
        );
        assert_eq!(
            block_tokens(1, 8, 49152),
            vec![18769, 35325, 44020, 1589, 35863, 18824, 26049, 14972]
        );
        assert_eq!(
            block_tokens(0, 8, 320),
            vec![137, 204, 247, 312, 24, 125, 111, 60]
        );
        assert_eq!(
            block_tokens(1, 8, 320),
            vec![209, 125, 116, 53, 23, 264, 193, 124]
        );
    }

    #[test]
    fn blocks_are_fixed_prefix_closed_and_in_range() {
        let a = block_tokens(42, 512, 320);
        assert_eq!(a, block_tokens(42, 512, 320));
        assert_eq!(&a[..8], &block_tokens(42, 8, 320)[..]);
        assert!(a.iter().all(|&t| t < 320));
        assert_ne!(a, block_tokens(43, 512, 320));
        // Not degenerate: a 512-token block over 320 ids uses most of them.
        let distinct: std::collections::HashSet<_> = a.iter().collect();
        assert!(distinct.len() > 250, "{}", distinct.len());
    }

    #[test]
    fn prompts_concatenate_blocks_and_cut_the_last() {
        let s = TokenScale::new(1.0 / 64.0).unwrap();
        let r = TraceRequest {
            timestamp: 0,
            input_length: 1000,
            output_length: 1,
            hash_ids: vec![7, 9],
        };
        let p = prompt(&r, &s, 320);
        // 1000 / 64 = 15.6 -> 16 tokens: all of block 7 (8) and 8 of block 9.
        assert_eq!(p.len(), 16);
        assert_eq!(&p[..8], &block_tokens(7, 8, 320)[..]);
        assert_eq!(&p[8..], &block_tokens(9, 8, 320)[..]);
        let short = TraceRequest {
            input_length: 600,
            ..r
        };
        // 600 / 64 = 9.4 -> 10 tokens: block 7, then 2 tokens of block 9.
        assert_eq!(prompt(&short, &s, 320), p[..10].to_vec());
    }
}
