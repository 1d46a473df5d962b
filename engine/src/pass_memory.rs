//! A bound on the device memory a prefill pass holds at once on a GPU: its attention scores
//! where they are materialized, and every layer's activations.
//!
//! MLX's GPU backends keep every kernel's inputs and outputs alive until the device has run
//! it, and the engine thread queues a pass's layers far faster than the device runs them, so
//! a pass holds what nearly all its layers make at once. Where MLX has no fused attention
//! for a prefill chunk's shape (on CUDA: f32 KV, or a head dimension cuDNN does not take),
//! that includes a `[heads, chunk, context]` array of scores and one of probabilities per
//! layer: 2,048 tokens over a 27K-token context are 4 GB a layer in f32, 60 GB over SmolLM2's
//! 30 layers (seen on the H200, docs/benchmarks.md, session 31), and at 64K-token contexts
//! the pass ran the GPU out of memory. With fused attention the activations remain: the
//! 8B's 2,048-token pass makes ~340 MB a layer, 11 GB over its 32 layers, which on the H100
//! came on top of a full device tier to within 4 GB of the card (session 37). [`PassMemory`]
//! waits for the device between layers whenever the layers queued since the last wait
//! would hold more than the pass workspace (`EngineConfig::pass_workspace`), so that what is
//! in flight stays within it. The wait costs the device its idle time while the host queues
//! the next layer (tens of microseconds) against the milliseconds such a layer computes.
//! The CPU is exempt: its fused attention materializes nothing, and its passes (a 512-token
//! chunk of SmolLM2: ~0.6 GB) stay small beside host memory.

use std::sync::atomic::{AtomicU64, Ordering};

use mlx::{Array, Device, Dtype};

use crate::error::Result;

/// Waits for the device [`PassMemory`] made over the process.
static WAITS: AtomicU64 = AtomicU64::new(0);

/// How many times prefill passes waited for the device to free their attention scores and
/// activations, over the process (what `kvstore bench` reports).
pub fn pass_memory_waits() -> u64 {
    WAITS.load(Ordering::Relaxed)
}

/// `EngineConfig::pass_workspace`'s default: the attention scores (where materialized) and
/// activations one prefill pass may hold at once on a GPU.
pub const DEFAULT_PASS_WORKSPACE: u64 = 8 << 30;

/// Whether a pass's activations stay on `device` until it has run them: on a GPU (see the
/// module docs), not on the CPU.
pub(crate) fn holds_activations(device: Device) -> bool {
    #[cfg(test)]
    if tests::FORCE.with(|f| f.get()) {
        return true;
    }
    device != Device::Cpu
}

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

/// The widths of one decoder layer that size its activations: the hidden size, the query
/// and key/value projections' widths, and the MLP's intermediate size.
#[derive(Clone, Copy, Debug)]
pub(crate) struct LayerWidths {
    pub(crate) hidden: usize,
    pub(crate) q: usize,
    pub(crate) kv: usize,
    pub(crate) intermediate: usize,
    /// Whether queries and keys are normed per head before the rotation (qwen3).
    pub(crate) qk_norms: bool,
}

/// Bytes of activations one pre-norm decoder layer makes for `tokens` tokens in elements
/// of `itemsize` bytes, counted from its graph: the input norm, the stacked q/k/v product,
/// the rotated queries and keys, the attention's output, the output projection and the
/// residual sum, the second norm, the stacked gate/up product and its gated product, the
/// down projection and the second residual sum (`6 · hidden + 3 · q + 3 · kv + 3 ·
/// intermediate` elements a token, and `q + kv` more with per-head q/k norms; the KV the
/// layer writes lives in the cache, not here).
pub(crate) fn layer_activation_bytes(w: LayerWidths, itemsize: usize, tokens: usize) -> u64 {
    let norms = if w.qk_norms { w.q + w.kv } else { 0 };
    let per_token = 6 * w.hidden + 3 * w.q + 3 * w.kv + 3 * w.intermediate + norms;
    (per_token * tokens * itemsize) as u64
}

/// Tracks the bytes a pass has queued since the device last caught up (see the module docs);
/// [`PassMemory::after_layer`] waits when the next layer would pass the budget.
#[derive(Debug)]
pub(crate) struct PassMemory {
    per_layer: u64,
    budget: u64,
    queued: u64,
    waits: usize,
}

impl PassMemory {
    /// A pass whose every layer holds `per_layer` bytes on the device until it has run (0:
    /// nothing to bound), under `budget`.
    pub(crate) fn new(budget: u64, per_layer: u64) -> PassMemory {
        PassMemory {
            per_layer,
            budget,
            queued: 0,
            waits: 0,
        }
    }

    /// After a layer was queued, with `h` its output: when one more layer would take the
    /// bytes in flight past the budget, computes `h` (the device catches up and MLX frees
    /// the layers' scores and activations). A layer larger than the budget alone still runs,
    /// one at a time.
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
            #[cfg(test)]
            tests::THREAD_WAITS.with(|w| w.set(w.get() + 1));
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
        /// Makes this thread's passes count their scores as materialized and their
        /// activations as held (on the CPU, which does neither), so that the waits run
        /// where tests run.
        pub(super) static FORCE: Cell<bool> = const { Cell::new(false) };
        /// Waits of passes on this thread (the process counter adds other tests' waits).
        pub(super) static THREAD_WAITS: Cell<u64> = const { Cell::new(0) };
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

    #[test]
    fn a_layers_activations_are_counted_from_its_widths() {
        // Llama-3-8B's layer (bf16) over a 2,048-token chunk: 6 · 4,096 + 3 · 4,096 + 3 ·
        // 1,024 + 3 · 14,336 = 82,944 elements a token, 339.7 MB a layer.
        let w = LayerWidths {
            hidden: 4096,
            q: 4096,
            kv: 1024,
            intermediate: 14336,
            qk_norms: false,
        };
        assert_eq!(layer_activation_bytes(w, 2, 2048), 82_944 * 2 * 2048);
        // Per-head q/k norms add a query's and a key's width.
        let normed = LayerWidths {
            qk_norms: true,
            ..w
        };
        assert_eq!(
            layer_activation_bytes(normed, 2, 1),
            (82_944 + 4096 + 1024) * 2
        );
        assert_eq!(layer_activation_bytes(w, 2, 0), 0);
    }

    #[test]
    fn a_pass_counts_its_activations_where_the_device_holds_them() {
        // tiny-qwen3: 2 layers, hidden 64, 4 query heads and 2 KV heads of 32, MLP 64, q/k
        // norms. A 40-token prompt's layer holds 40 · 40 · 4 · 2 scores and 40 · (6 · 64 + 3 ·
        // 128 + 3 · 64 + 3 · 64 + 192) activations: 4.2 times as many. Under a workspace of
        // four times the scores in f32 (twice the scores alone fit in every dtype, one layer
        // with its activations does not), the pass waits after each of its two layers only
        // because its activations count.
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/goldens/tiny-qwen3");
        let (model, _) = crate::load(&dir, &crate::LoadOptions::default()).unwrap();
        let prompt: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % 300).collect();
        let scores_f32 = layer_score_bytes(4, 4, &[(0, 40)]);
        model.set_pass_workspace(4 * scores_f32);
        let run = |force: bool| {
            FORCE.with(|f| f.set(force));
            let before = THREAD_WAITS.with(|w| w.get());
            let mut cache = model.new_cache();
            model.forward(&prompt, &mut cache).unwrap();
            FORCE.with(|f| f.set(false));
            THREAD_WAITS.with(|w| w.get()) - before
        };
        assert_eq!(run(true), 2, "a wait after each layer: activations counted");
        // On the CPU nothing is held or materialized: no wait. A GPU holds them by itself.
        let device = mlx::default_device().unwrap();
        let unforced = if device == Device::Cpu { 0 } else { 2 };
        assert_eq!(run(false), unforced, "{device:?}");
        model.set_pass_workspace(DEFAULT_PASS_WORKSPACE);
    }
}
