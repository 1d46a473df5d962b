//! `--token-scale F`: every length and the 512-token trace block are multiplied by F, so
//! that a small model with a short context keeps the trace's sharing structure (which
//! requests share how many blocks) at a fraction of the tokens.

use anyhow::{bail, Result};

use super::parse::{TraceRequest, TRACE_BLOCK_TOKENS};

/// Slack for factors written in decimal (`0.015625`) that are exact in binary anyway.
const EPS: f64 = 1e-9;

/// A validated token scale.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TokenScale {
    factor: f64,
    block: usize,
}

impl TokenScale {
    /// A scale whose trace block (512 × `factor` tokens) is a whole number of at least 1.
    pub fn new(factor: f64) -> Result<TokenScale> {
        if !(factor.is_finite() && factor > 0.0) {
            bail!("--token-scale must be a number above 0, not {factor}");
        }
        let b = TRACE_BLOCK_TOKENS as f64 * factor;
        if b < 1.0 - EPS || (b - b.round()).abs() > EPS {
            bail!(
                "--token-scale {factor}: a trace block would hold {b} tokens; choose a factor \
                 that makes {TRACE_BLOCK_TOKENS} × F a whole number (1/64 gives 8, 1/16 gives 32)"
            );
        }
        Ok(TokenScale {
            factor,
            block: b.round() as usize,
        })
    }

    /// The scale factor F.
    pub fn factor(&self) -> f64 {
        self.factor
    }

    /// Tokens per trace block after scaling.
    pub fn block(&self) -> usize {
        self.block
    }

    /// What a reader of the hit shares must know when the trace's blocks are shorter than
    /// the cache's (`block_size` tokens): the ideal and the simulated policies count hits
    /// on the trace's blocks, and a cache of longer blocks cannot reuse a shared run that
    /// ends inside one of its blocks. `None` where the trace's blocks are at least as long.
    pub fn granularity_note(&self, block_size: usize) -> Option<String> {
        if self.block >= block_size {
            return None;
        }
        let factor = block_size as f64 / TRACE_BLOCK_TOKENS as f64;
        Some(format!(
            "note: the trace's {}-token blocks are shorter than the cache's {block_size}-token \
             blocks (--block-size): the ideal and LRU shares count hits on the trace's blocks, \
             which a cache of {block_size}-token blocks cannot all reuse, so a replay's share \
             of them reads low; --token-scale {factor} or more, or --block-size {}, compares \
             like with like",
            self.block, self.block
        ))
    }

    /// A length after scaling: ceil(len × F), at least 1. Rounding up keeps a prompt in
    /// the same number of blocks: (n-1)·512 < len ≤ n·512 gives (n-1)·b < len' ≤ n·b.
    pub fn len(&self, len: usize) -> usize {
        ((len as f64 * self.factor - EPS).ceil() as usize).max(1)
    }

    /// Scaled prompt length of a request.
    pub fn prompt_len(&self, r: &TraceRequest) -> usize {
        self.len(r.input_length)
            .min(r.hash_ids.len() * self.block)
            .max(1)
    }

    /// Scaled completion length of a request (at least 1).
    pub fn output_len(&self, r: &TraceRequest) -> usize {
        self.len(r.output_length)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trace_block_shorter_than_the_cache_block_is_noted() {
        let note = TokenScale::new(1.0 / 64.0)
            .unwrap()
            .granularity_note(32)
            .expect("8-token trace blocks against 32-token cache blocks");
        assert!(note.contains("8-token blocks"), "{note}");
        assert!(note.contains("--token-scale 0.0625"), "{note}");
        assert!(note.contains("--block-size 8"), "{note}");
        assert_eq!(
            TokenScale::new(1.0 / 16.0).unwrap().granularity_note(32),
            None
        );
        assert_eq!(TokenScale::new(0.125).unwrap().granularity_note(32), None);
    }

    #[test]
    fn factors_must_give_whole_blocks() {
        assert_eq!(TokenScale::new(1.0).unwrap().block(), 512);
        assert_eq!(TokenScale::new(0.015625).unwrap().block(), 8);
        assert_eq!(TokenScale::new(1.0 / 512.0).unwrap().block(), 1);
        assert_eq!(TokenScale::new(2.0).unwrap().block(), 1024);
        for bad in [0.1, 0.0, -1.0, 1.0 / 1024.0, f64::NAN, f64::INFINITY] {
            assert!(TokenScale::new(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn scaled_prompts_keep_their_block_count() {
        let s = TokenScale::new(1.0 / 64.0).unwrap();
        for (len, n) in [(1, 1), (512, 1), (513, 2), (1000, 2), (1024, 2), (6758, 14)] {
            let r = TraceRequest {
                timestamp: 0,
                input_length: len,
                output_length: 0,
                hash_ids: (0..n).collect(),
            };
            let l = s.prompt_len(&r);
            assert_eq!(l.div_ceil(s.block()), n as usize, "{len}");
            assert_eq!(s.output_len(&r), 1);
        }
        // 6758 / 64 = 105.6 -> 106.
        assert_eq!(s.len(6758), 106);
        assert_eq!(TokenScale::new(1.0).unwrap().len(6758), 6758);
    }
}
