//! [`Model`]: a loaded checkpoint of a supported family, its forward pass over a
//! [`KvCache`], and what identifies its KV blocks (weights fingerprint, KV layout).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use cache::{KvCache, PagedKvRows};
use mlx::{Array, Dtype};
use serde::Serialize;
use serde_json::Value;

use crate::error::{EngineError, Result};
use crate::models::{self, Network};
use crate::weights::{Checkpoint, LoadOptions};

/// The shape of a model's KV cache: what a stored block of it holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct KvLayout {
    /// Attention layers (each has one K and one V plane): all decoder layers but a
    /// hybrid's non-attention ones.
    pub layers: usize,
    /// Key/value heads per layer.
    pub kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Element type of keys and values as the forward pass produces them.
    #[serde(serialize_with = "dtype_name")]
    pub dtype: Dtype,
    /// Non-attention layers whose state a sequence carries beside its KV (a hybrid's
    /// convolution or recurrent layers); 0 for attention-only models.
    pub state_layers: usize,
}

fn dtype_name<S: serde::Serializer>(d: &Dtype, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_str(d.name())
}

/// The facts of a model every caller needs, whatever its family.
#[derive(Clone, Debug, Serialize)]
pub struct ModelInfo {
    /// `llama`, `qwen2`, `qwen3`, `gemma3_text` or `lfm2`.
    pub architecture: String,
    /// Vocabulary size (rows of the LM head).
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Query heads.
    pub num_heads: usize,
    /// The context the model was trained for (`max_position_embeddings`).
    pub max_position_embeddings: usize,
    /// RoPE base.
    pub rope_theta: f64,
    /// The KV layout.
    pub kv: KvLayout,
}

/// How one layer mixes tokens: attention over every earlier position or over a sliding
/// window, or (in hybrids) a state that folds every token in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LayerKind {
    /// Every earlier position (and itself).
    Global,
    /// The last `n` positions, the query's own included.
    Window(usize),
    /// A causal short convolution of `n` taps: its state is the last `n - 1` inputs.
    Conv(usize),
    /// A recurrent layer (gated DeltaNet, Mamba-2): a fixed-size state folds every token in.
    Recurrent,
    /// A feed-forward layer that mixes no tokens (Nemotron-H's `-` layers).
    Mlp,
}

impl std::fmt::Display for LayerKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LayerKind::Global => f.write_str("global"),
            LayerKind::Window(n) => write!(f, "window({n})"),
            LayerKind::Conv(n) => write!(f, "conv({n})"),
            LayerKind::Recurrent => f.write_str("recurrent"),
            LayerKind::Mlp => f.write_str("mlp"),
        }
    }
}

/// A loaded model: weights in MLX arrays and the forward pass of its family.
pub struct Model {
    decoder: Box<dyn Network>,
    info: ModelInfo,
    config: Value,
    files: Vec<PathBuf>,
    fingerprint: OnceLock<[u8; 32]>,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("info", &self.info)
            .field("files", &self.files)
            .finish()
    }
}

/// Tokens per prefill step on the CPU, and the most prompt tokens an engine step prefills
/// while other rows decode ([`crate::EngineConfig::prefill_chunk`]). Smaller than mlx-lm's
/// 2048: on CPU it is as fast or faster at long prompts and peaks lower (figures:
/// docs/benchmarks.md, "Generate").
pub const DEFAULT_PREFILL_CHUNK: usize = 512;

/// Tokens per prefill step on a GPU (mlx-lm's `prefill_step_size`): a 512-token step leaves
/// an H200 mostly waiting for kernel launches (SmolLM2's shape prefills 2,048 tokens at 21K
/// tok/s in 512-token steps, 34K in 2,048-token steps; docs/benchmarks.md).
pub const GPU_PREFILL_CHUNK: usize = 2048;

/// The prefill step for the device MLX computes on: [`GPU_PREFILL_CHUNK`] on a GPU,
/// [`DEFAULT_PREFILL_CHUNK`] on the CPU.
pub fn default_prefill_chunk() -> usize {
    match mlx::default_device() {
        Ok(mlx::Device::Gpu) => GPU_PREFILL_CHUNK,
        _ => DEFAULT_PREFILL_CHUNK,
    }
}

impl Model {
    /// Builds the model of a checkpoint (its tensors are consumed by the layers).
    pub(crate) fn from_checkpoint(ck: &Checkpoint) -> Result<Model> {
        let model_type = ck
            .config
            .get("model_type")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let family = models::family(model_type)
            .ok_or_else(|| EngineError::UnsupportedArchitecture(model_type.to_string()))?;
        let (decoder, info) = (family.build)(ck)?;
        Ok(Model {
            decoder,
            info,
            config: ck.config.clone(),
            files: ck.files.clone(),
            fingerprint: OnceLock::new(),
        })
    }

    /// Loads a model alone (see [`crate::load`] for the model and its tokenizer).
    pub fn load(path: &Path, options: &LoadOptions) -> Result<Model> {
        Model::from_checkpoint(&Checkpoint::load(path, options)?)
    }

    /// Family, sizes and KV layout.
    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    /// The KV layout (layers, kv heads, head dim, dtype).
    pub fn kv_layout(&self) -> KvLayout {
        self.info.kv
    }

    /// How each layer mixes tokens, in order: all global except in families with
    /// sliding-window layers (gemma3) or non-attention layers (lfm2).
    pub fn layer_kinds(&self) -> Vec<LayerKind> {
        self.decoder.layer_kinds()
    }

    /// Shapes of each non-attention layer's state parts for one sequence (`[1, ..]`), in
    /// state-layer order; empty for attention-only models.
    pub fn state_shapes(&self) -> Vec<Vec<Vec<usize>>> {
        self.decoder.state_shapes()
    }

    /// The Hugging Face config (rebuilt from metadata for GGUF), as loaded.
    pub fn config(&self) -> &Value {
        &self.config
    }

    /// The weight files, in the order the fingerprint hashes them.
    pub fn files(&self) -> &[PathBuf] {
        &self.files
    }

    /// blake3 over the bytes of every weight file (length-prefixed, in order): identical
    /// across processes and machines for identical weights. Computed on first use (reading
    /// the files once), then remembered.
    pub fn fingerprint(&self) -> Result<[u8; 32]> {
        if let Some(f) = self.fingerprint.get() {
            return Ok(*f);
        }
        let mut h = blake3::Hasher::new();
        h.update(b"kvstore-weights-v1");
        h.update(&(self.files.len() as u64).to_le_bytes());
        for f in &self.files {
            let meta = std::fs::metadata(f).map_err(|e| EngineError::io(f, e))?;
            h.update(&meta.len().to_le_bytes());
            let file = std::fs::File::open(f).map_err(|e| EngineError::io(f, e))?;
            h.update_reader(file).map_err(|e| EngineError::io(f, e))?;
        }
        let out = *h.finalize().as_bytes();
        Ok(*self.fingerprint.get_or_init(|| out))
    }

    /// Bounds what a prefill pass holds on a GPU at once, its activations and its attention
    /// scores where MLX materializes them (`EngineConfig::pass_workspace`; engine/src/
    /// pass_memory.rs). The llama and qwen decoders take it; other families ignore it.
    pub fn set_pass_workspace(&self, bytes: u64) {
        self.decoder.set_pass_workspace(bytes);
    }

    /// A fresh KV cache for this model: paged, float KV, 32-token blocks, growing as
    /// needed (appends update it in place; attention reads it through a view), with the
    /// state layers a hybrid carries.
    pub fn new_cache(&self) -> cache::PagedKvCache {
        cache::PagedKvCache::with_default_config(self.info.kv.layers)
            .with_state_layers(self.info.kv.state_layers)
    }

    /// A fresh cache for this model under `config` (see [`Model::new_cache`]).
    pub fn empty_cache(&self, config: cache::PagedConfig) -> Result<cache::PagedKvCache> {
        Ok(cache::PagedKvCache::new(self.info.kv.layers, config)?
            .with_state_layers(self.info.kv.state_layers))
    }

    fn ids(&self, tokens: &[u32]) -> Result<Array> {
        if let Some(&id) = tokens.iter().find(|&&t| t as usize >= self.info.vocab_size) {
            return Err(EngineError::TokenOutOfRange {
                id,
                vocab: self.info.vocab_size,
            });
        }
        Ok(Array::from_slice(tokens, &[1, tokens.len() as i32])?)
    }

    /// The hidden states of `tokens` after what `cache` holds, in one step, or in several
    /// where the cache keeps state snapshots: a step then ends at every snapshot point
    /// inside it, so the snapshot holds the state at exactly that token. Returns the hidden
    /// states of the last step only.
    fn hidden(&self, tokens: &[u32], cache: &mut dyn KvCache) -> Result<Array> {
        // Every id is checked before any step changes the cache.
        let all = self.ids(tokens)?;
        let Some(every) = cache.state_snapshot_every().filter(|&e| e > 0) else {
            return self.decoder.hidden(&all, cache);
        };
        let mut rest = tokens;
        loop {
            let to_snapshot = every - cache.offset() % every;
            if to_snapshot >= rest.len() {
                return self.decoder.hidden(&self.ids(rest)?, cache);
            }
            let (head, tail) = rest.split_at(to_snapshot);
            self.decoder.hidden(&self.ids(head)?, cache)?;
            rest = tail;
        }
    }

    /// Runs `tokens` after what `cache` holds (appending their keys and values) and returns
    /// the logits of the last position, `[vocab]`, in f32. The graph is lazy: reading the
    /// logits computes it.
    pub fn forward(&self, tokens: &[u32], cache: &mut dyn KvCache) -> Result<Array> {
        if tokens.is_empty() {
            return Err(EngineError::InvalidParameter {
                name: "tokens",
                message: "a forward step needs at least one token".into(),
            });
        }
        let h = self.hidden(tokens, cache)?;
        let l = h.shape()[1];
        let last = h.slice(&[0, l - 1, 0], &[1, l, self.info.hidden_size as i32])?;
        let logits = self.decoder.logits(&last)?.reshape(&[-1])?;
        Ok(logits.astype(Dtype::F32)?)
    }

    /// [`Model::forward`] of one token held on the device (`[1]` u32, possibly not computed
    /// yet: a pick of the previous step), so the step is built before the host reads it.
    pub(crate) fn forward_token(&self, token: &Array, cache: &mut dyn KvCache) -> Result<Array> {
        let h = self.decoder.hidden(&token.reshape(&[1, 1])?, cache)?;
        let logits = self.decoder.logits(&h)?.reshape(&[-1])?;
        Ok(logits.astype(Dtype::F32)?)
    }

    /// One decode step of a batch: `tokens[b]` runs after what row `b` of `rows` holds, at
    /// that row's own position (per-row RoPE offsets, left padding masked). Returns the
    /// logits `[B, vocab]` in f32. See docs/server.md for how this compares numerically to
    /// [`Model::forward`] on each row alone.
    pub fn forward_rows(&self, tokens: &[u32], rows: &mut PagedKvRows) -> Result<Array> {
        let ids = self.ids(tokens)?.reshape(&[-1])?;
        self.forward_rows_tokens(&ids, rows)
    }

    /// [`Model::forward_rows`] of tokens held on the device, `[B]` u32 (possibly not
    /// computed yet: the picks of the previous step), so the step is built before the host
    /// reads them.
    pub(crate) fn forward_rows_tokens(
        &self,
        tokens: &Array,
        rows: &mut PagedKvRows,
    ) -> Result<Array> {
        let b = rows.len() as i32;
        if b == 0 || tokens.size() != rows.len() {
            return Err(EngineError::InvalidParameter {
                name: "tokens",
                message: format!(
                    "a batched step needs one token per row: {} tokens for {} rows",
                    tokens.size(),
                    rows.len()
                ),
            });
        }
        let h = self.decoder.hidden_rows(&tokens.reshape(&[b, 1])?, rows)?;
        let logits = self.decoder.logits(&h)?.reshape(&[b, -1])?;
        Ok(logits.astype(Dtype::F32)?)
    }

    /// One pass over a decode step of `rows` (`row_tokens` `[B]` u32, possibly not computed
    /// yet) and a prefill chunk of each of `prompts`, after what its cache holds, with the
    /// weights read once ([`MixedStep`]). `None` where the family has no such pass, a
    /// prompt's cache keeps state snapshots (a chunk then stops at each), or an id is out
    /// of the vocabulary (nothing changed: the caller runs the steps apart, and the
    /// prefill reports the bad id).
    pub fn forward_mixed(
        &self,
        row_tokens: &Array,
        rows: &mut PagedKvRows,
        prompts: &mut [PromptChunk<'_>],
    ) -> Result<Option<MixedStep>> {
        let b = rows.len() as i32;
        if b == 0 || row_tokens.size() != rows.len() {
            return Ok(None);
        }
        let Some((rows_h, prompts)) = self.pass(Some((row_tokens, rows)), prompts)? else {
            return Ok(None);
        };
        let Some(rows_h) = rows_h else {
            return Ok(None);
        };
        let rows_logits = self.decoder.logits(&rows_h)?.reshape(&[b, -1])?;
        Ok(Some(MixedStep {
            rows_logits: rows_logits.astype(Dtype::F32)?,
            prompts,
        }))
    }

    /// One prefill pass over a chunk of each of `prompts`, after what its cache holds: the
    /// weights read once for all of them (a burst of short prompts is one pass, not one
    /// each). `None` as for [`Model::forward_mixed`].
    pub fn forward_prompts(
        &self,
        prompts: &mut [PromptChunk<'_>],
    ) -> Result<Option<Vec<PromptPass>>> {
        Ok(self.pass(None, prompts)?.map(|(_, p)| p))
    }

    /// The pass of [`Model::forward_mixed`] and [`Model::forward_prompts`]: the rows'
    /// hidden states (with rows) and each prompt's part.
    #[allow(clippy::type_complexity)]
    fn pass(
        &self,
        rows: Option<(&Array, &mut PagedKvRows)>,
        prompts: &mut [PromptChunk<'_>],
    ) -> Result<Option<(Option<Array>, Vec<PromptPass>)>> {
        if prompts.is_empty() {
            return Ok(None);
        }
        let mut ids = Vec::with_capacity(prompts.len());
        for p in prompts.iter() {
            if p.tokens.is_empty() || p.cache.state_snapshot_every().is_some() {
                return Ok(None);
            }
            let Ok(i) = self.ids(p.tokens) else {
                return Ok(None);
            };
            ids.push(i);
        }
        let mut caches: Vec<&mut dyn KvCache> = Vec::with_capacity(prompts.len());
        for p in prompts.iter_mut() {
            caches.push(&mut *p.cache);
        }
        let Some((rows_h, prompt_h)) = self.decoder.hidden_mixed(rows, &ids, &mut caches)? else {
            return Ok(None);
        };
        let hidden = self.info.hidden_size as i32;
        let mut out = Vec::with_capacity(prompt_h.len());
        for h in prompt_h {
            let l = h.shape()[1];
            let last = h.slice(&[0, l - 1, 0], &[1, l, hidden])?;
            let logits = self.decoder.logits(&last)?.reshape(&[-1])?;
            out.push(PromptPass {
                logits: logits.astype(Dtype::F32)?,
                hidden: h,
            });
        }
        Ok(Some((rows_h, out)))
    }

    /// Like [`Model::forward`] but returns logits for every position, `[L, vocab]` (tests),
    /// in one step whatever snapshots the cache keeps.
    pub fn forward_all(&self, tokens: &[u32], cache: &mut dyn KvCache) -> Result<Array> {
        if cache.state_snapshot_every().is_some() {
            return Err(EngineError::InvalidParameter {
                name: "cache",
                message: "forward_all runs one step: give it a cache without state snapshots"
                    .into(),
            });
        }
        let h = self.decoder.hidden(&self.ids(tokens)?, cache)?;
        let logits = self.decoder.logits(&h)?;
        Ok(logits
            .reshape(&[tokens.len() as i32, -1])?
            .astype(Dtype::F32)?)
    }

    /// Prefills `tokens` in steps of at most `chunk` tokens, evaluating each step so memory
    /// stays bounded by the chunk, and returns the logits of the last token. Steps end on
    /// multiples of `chunk` positions ([`aligned_chunk`]).
    pub fn prefill(&self, tokens: &[u32], cache: &mut dyn KvCache, chunk: usize) -> Result<Array> {
        self.prefill_while(tokens, cache, chunk, &mut || true)?
            .ok_or_else(|| EngineError::InvalidParameter {
                name: "prefill",
                message: "stopped without a reason".into(),
            })
    }

    /// [`Model::prefill`] that asks `keep_going` before every chunk and stops at that chunk
    /// boundary when it says no (a caller whose client went away): `None`, with the cache
    /// holding the chunks computed so far. (`serve` runs one chunk per engine step instead,
    /// with the same check between chunks.)
    pub fn prefill_while(
        &self,
        tokens: &[u32],
        cache: &mut dyn KvCache,
        chunk: usize,
        keep_going: &mut dyn FnMut() -> bool,
    ) -> Result<Option<Array>> {
        let mut rest = tokens;
        loop {
            let step = aligned_chunk(cache.offset(), chunk);
            if rest.len() <= step {
                break;
            }
            if !keep_going() {
                return Ok(None);
            }
            let (head, tail) = rest.split_at(step);
            self.prefill_chunk(head, cache)?;
            rest = tail;
        }
        if !keep_going() {
            return Ok(None);
        }
        self.forward(rest, cache).map(Some)
    }

    /// Runs `tokens` after what `cache` holds and computes their keys and values now,
    /// without the logits: a prefill chunk that is not the prompt's last.
    pub(crate) fn prefill_chunk(&self, tokens: &[u32], cache: &mut dyn KvCache) -> Result<()> {
        let h = self.hidden(tokens, cache)?;
        h.eval()?;
        Ok(())
    }
}

/// What [`Model::forward_mixed`] built (lazily: nothing is computed until evaluated).
pub struct MixedStep {
    /// The rows' logits, `[B, vocab]`, f32.
    pub rows_logits: Array,
    /// Each prompt's part, in the order given.
    pub prompts: Vec<PromptPass>,
}

/// One prompt chunk's part of a [`MixedStep`] or of [`Model::forward_prompts`].
pub struct PromptPass {
    /// The logits of the chunk's last token, `[vocab]`, f32 (read when it ends the prompt).
    pub logits: Array,
    /// The chunk's hidden states: evaluating them computes its keys and values.
    pub hidden: Array,
}

/// A prefill chunk for [`Model::forward_mixed`] and [`Model::forward_prompts`]: `tokens`
/// placed after what `cache` holds.
pub struct PromptChunk<'a> {
    /// The chunk's prompt tokens.
    pub tokens: &'a [u32],
    /// The prompt's cache, which the chunk's keys and values are appended to.
    pub cache: &'a mut dyn KvCache,
}

/// Tokens of the next prefill step for a cache holding `offset` tokens: up to the next
/// multiple of `chunk` positions (a whole `chunk` from a multiple of it).
///
/// Steps that end on multiples of the chunk give attention calls of the same shapes for
/// every prompt, whatever prefix was cached before it: on CUDA, MLX builds a cuDNN graph
/// for every new shape and strides (tens of milliseconds each; docs/cache.md, "Attention
/// shapes on CUDA"), so only a request's first and last steps can be new shapes.
pub fn aligned_chunk(offset: usize, chunk: usize) -> usize {
    let chunk = chunk.max(1);
    chunk - offset % chunk
}
