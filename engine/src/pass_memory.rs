//! A bound on the attention scores a prefill pass holds at once on a GPU.
//!
//! Where MLX has no fused attention for a prefill chunk's shape (on CUDA: f32 KV, or a head
//! dimension cuDNN does not take), it computes the chunk's attention as products: a
//! `[heads, chunk, context]` array of scores and one of probabilities, per layer. MLX's CUDA
//! backend keeps every kernel's inputs alive until the device has run it, and the engine
//! thread queues a pass's layers far faster than the device runs them, so a pass holds the
//! scores of nearly all its layers at once: 2,048 tokens over a 27K-token context are 4 GB a
//! layer in f32, 60 GB over SmolLM2's 30 layers (seen on the H200, docs/benchmarks.md, session
//! 31), and at 64K-token contexts the pass ran the GPU out of memory. [`PassMemory`] waits for
//! the device between layers whenever the layers queued since the last wait would hold more
//! than the pass workspace (`EngineConfig::pass_workspace`), so that the scores in flight stay
//! within it. The wait costs the device its idle time while the host queues the next
//! layers (tens of microseconds a layer) against the milliseconds such a layer computes.

use std::sync::atomic::{AtomicU64, Ordering};

use mlx::{Array, Device, Dtype};

use crate::error::Result;

/// Waits for the device [`PassMemory`] made over the process.
static WAITS: AtomicU64 = AtomicU64::new(0);

/// How many times prefill passes waited for the device to free their attention scores,
/// over the process (what `kvstore bench trace` reports).
pub fn pass_memory_waits() -> u64 {
    WAITS.load(Ordering::Relaxed)
}

/// `EngineConfig::pass_workspace`'s default: the attention scores one prefill pass may hold
/// at once where they are materialized.
pub const DEFAULT_PASS_WORKSPACE: u64 = 8 << 30;

/// Whether a prefill chunk's attention materializes its scores on `device` for queries and
/// keys of `dtype` and `head_dim`: on a GPU, unless cuDNN's fused attention takes the shape
/// (f16 or bf16, a head dimension that is a multiple of 8 up to 128: MLX 0.32's
/// `supports_sdpa_cudnn`). The CPU runs the fused kernel of mlx/src/cpu_attention.rs.
/// On macOS the GPU is Metal, whose full attention kernel takes every float type at head
/// dimensions 64, 80 and 128.
pub(crate) fn materializes_scores(device: Device, dtype: Dtype, head_dim: usize) -> bool {
    #[cfg(test)]
    if tests::FORCE.with(|f| f.get()) {
        return true;
    }
    if device == Device::Cpu {
        return false;
    }
    if cfg!(target_os = "macos") {
        return ![64, 80, 128].contains(&head_dim);
    }
    let fused =
        matches!(dtype, Dtype::F16 | Dtype::BF16) && head_dim.is_multiple_of(8) && head_dim <= 128;
    !fused
}

/// Bytes of scores and probabilities one layer of a pass holds: for each prompt chunk of
/// `len` tokens after `offset` cached ones, `len × (offset + len)` per query head, twice,
/// in elements of `itemsize` bytes.
pub(crate) fn layer_score_bytes(
    q_heads: usize,
    itemsize: usize,
    prompts: &[(usize, usize)],
) -> u64 {
    prompts
        .iter()
        .map(|&(offset, len)| (len * (offset + len)) as u64)
        .sum::<u64>()
        * (q_heads * itemsize * 2) as u64
}

/// Tracks the scores a pass has queued since the device last caught up (see the module
/// docs); [`PassMemory::after_layer`] waits when the next layer would pass the budget.
#[derive(Debug)]
pub(crate) struct PassMemory {
    per_layer: u64,
    budget: u64,
    queued: u64,
    waits: usize,
}

impl PassMemory {
    /// A pass whose every layer materializes `per_layer` bytes of scores (0: none, nothing
    /// to bound), under `budget`.
    pub(crate) fn new(budget: u64, per_layer: u64) -> PassMemory {
        PassMemory {
            per_layer,
            budget,
            queued: 0,
            waits: 0,
        }
    }

    /// After a layer was queued, with `h` its output: when one more layer would take the
    /// scores in flight past the budget, computes `h` (the device catches up and MLX frees
    /// the layers' scores). A layer larger than the budget alone still runs, one at a time.
    pub(crate) fn after_layer(&mut self, h: &Array) -> Result<()> {
        if self.per_layer == 0 {
            return Ok(());
        }
        self.queued += self.per_layer;
        if self.queued + self.per_layer > self.budget {
            mlx::eval(&[h])?;
            self.queued = 0;
            self.waits += 1;
            WAITS.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    /// How many times the pass waited for the device.
    #[cfg(test)]
    pub(crate) fn waits(&self) -> usize {
        self.waits
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    use crate::model::PromptChunk;

    thread_local! {
        /// Makes this thread's passes count their scores as materialized (on the CPU, whose
        /// fused attention never does), so that the waits run where tests run.
        pub(super) static FORCE: Cell<bool> = const { Cell::new(false) };
    }

    #[test]
    fn a_pass_that_waits_between_layers_computes_what_one_pass_computes() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/goldens/tiny-qwen3");
        let (model, _) = crate::load(&dir, &crate::LoadOptions::default()).unwrap();
        let a: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % 300).collect();
        let b: Vec<u32> = (0..25).map(|i| (i * 11 + 5) % 300).collect();
        // A prompt in two chunks (the second over the first's cache), and a pass of two
        // prompts; each one's last logits.
        let run = |waits: bool| -> Vec<Vec<f32>> {
            FORCE.with(|f| f.set(waits));
            model.set_pass_workspace(if waits { 1 } else { DEFAULT_PASS_WORKSPACE });
            let mut one = model.new_cache();
            model.forward(&a[..20], &mut one).unwrap();
            let second = model.forward(&a[20..], &mut one).unwrap();
            let (mut ca, mut cb) = (model.new_cache(), model.new_cache());
            let pass = model
                .forward_prompts(&mut [
                    PromptChunk {
                        tokens: &a,
                        cache: &mut ca,
                    },
                    PromptChunk {
                        tokens: &b,
                        cache: &mut cb,
                    },
                ])
                .unwrap()
                .expect("the qwen3 decoder has a pass of prompts");
            FORCE.with(|f| f.set(false));
            let mut out = vec![second.to_vec::<f32>().unwrap()];
            out.extend(pass.iter().map(|p| p.logits.to_vec::<f32>().unwrap()));
            out
        };
        let before = pass_memory_waits();
        let plain = run(false);
        let waited = run(true);
        // A 1-byte workspace waits after every layer of all three passes (other tests may
        // add theirs; none runs on this thread).
        let layers = model.info().kv.layers as u64;
        assert!(pass_memory_waits() - before >= 3 * layers);
        // The same graph, computed in pieces: the same numbers, bit for bit.
        assert_eq!(plain, waited);
    }

    #[test]
    fn only_unfused_gpu_attention_materializes_its_scores() {
        assert!(!materializes_scores(Device::Cpu, Dtype::F32, 64));
        if cfg!(target_os = "macos") {
            assert!(!materializes_scores(Device::Gpu, Dtype::F32, 64));
            return;
        }
        assert!(materializes_scores(Device::Gpu, Dtype::F32, 64));
        assert!(!materializes_scores(Device::Gpu, Dtype::BF16, 128));
        assert!(!materializes_scores(Device::Gpu, Dtype::F16, 64));
        // Past cuDNN's head dimensions, MLX falls back to products.
        assert!(materializes_scores(Device::Gpu, Dtype::BF16, 256));
        assert!(materializes_scores(Device::Gpu, Dtype::BF16, 60));
    }

    #[test]
    fn a_layers_scores_are_counted_per_prompt_and_head() {
        // SmolLM2 (9 heads, f32): 2,048 tokens after 25,000 cached, and 100 after none.
        let b = layer_score_bytes(9, 4, &[(25_000, 2_048), (0, 100)]);
        assert_eq!(b, (2_048 * 27_048 + 100 * 100) * 9 * 4 * 2);
        assert_eq!(layer_score_bytes(9, 4, &[]), 0);
    }

    #[test]
    fn the_pass_waits_before_the_layer_that_would_pass_the_budget() {
        let h = Array::from_slice(&[1.0f32], &[1]).unwrap();
        // 3 bytes a layer under 10: waits after the 3rd layer (9 + 3 > 10), then the 6th.
        let mut m = PassMemory::new(10, 3);
        let mut waited_after = Vec::new();
        for layer in 1..=7 {
            let before = m.waits();
            m.after_layer(&h).unwrap();
            if m.waits() > before {
                waited_after.push(layer);
            }
        }
        assert_eq!(waited_after, vec![3, 6]);
        // A layer larger than the budget: a wait after every layer.
        let mut big = PassMemory::new(10, 30);
        for _ in 0..4 {
            big.after_layer(&h).unwrap();
        }
        assert_eq!(big.waits(), 4);
        // Nothing materialized: never.
        let mut none = PassMemory::new(10, 0);
        for _ in 0..4 {
            none.after_layer(&h).unwrap();
        }
        assert_eq!(none.waits(), 0);
    }
}
