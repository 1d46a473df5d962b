//! One file per architecture family; the layers they share live in `layers`.
//!
//! Each family file declares its [`Family`] (its `model_type`, how its GGUF files load, how
//! its network is built); [`FAMILIES`] is the registry the loader reads. Adding a family is
//! its file, its line in [`FAMILIES`], and its tests.

use cache::{KvCache, PagedKvRows};
use mlx::Array;

use crate::error::Result;
use crate::model::{LayerKind, ModelInfo};
use crate::weights::Checkpoint;

pub mod gemma3;
pub mod lfm2;
pub mod llama;
pub mod nemotron_h;
pub mod qwen2;
pub mod qwen3;
pub mod qwen3_next;

/// A family's forward pass, as the engine calls it.
pub(crate) trait Network: Send + std::fmt::Debug {
    /// Hidden states after the final norm, `[1, L, hidden]`, for `tokens` `[1, L]` placed
    /// after what `cache` holds. A hybrid reads and sets its non-attention layers' state in
    /// the cache's state layers (once per layer per step) and refuses a cache without them.
    fn hidden(&self, tokens: &Array, cache: &mut dyn KvCache) -> Result<Array>;
    /// Hidden states after the final norm, `[B, 1, hidden]`, for one token per row of
    /// `rows` (`tokens` `[B, 1]`), each at its own row's position.
    fn hidden_rows(&self, tokens: &Array, rows: &mut PagedKvRows) -> Result<Array>;
    /// One pass over one token of each decoding row (`rows`: the tokens `[B]` or `[B, 1]`
    /// and their cache; none for a pass of prompts only) and each prompt chunk of `chunks`
    /// (`[1, L]` ids) placed after what its cache in `caches` holds: the rows' hidden
    /// states `[B, 1, hidden]` and each chunk's `[1, L, hidden]`, as
    /// [`Network::hidden_rows`] and [`Network::hidden`] would give them, with the weights
    /// read once. `None` where the family has no such pass (the caller runs them apart).
    fn hidden_mixed(
        &self,
        _rows: Option<(&Array, &mut PagedKvRows)>,
        _chunks: &[Array],
        _caches: &mut [&mut dyn KvCache],
    ) -> Result<Option<(Option<Array>, Vec<Array>)>> {
        Ok(None)
    }
    /// Bounds the attention scores a prefill pass holds at once where MLX materializes them
    /// (module `pass_memory`); families that do not bound them ignore it.
    fn set_pass_workspace(&self, _bytes: u64) {}
    /// Logits `[.., vocab]` of hidden states `[.., hidden]`.
    fn logits(&self, h: &Array) -> Result<Array>;
    /// Shapes of each non-attention layer's state parts for one sequence (batch axis first,
    /// 1), in state-layer order; empty for attention-only families.
    fn state_shapes(&self) -> Vec<Vec<Vec<usize>>> {
        Vec::new()
    }
    /// What each layer mixes tokens with (attention, windowed, a convolution), in order.
    fn layer_kinds(&self) -> Vec<LayerKind>;
}

/// How a family's GGUF files (llama.cpp's conversion) map to its Hugging Face tensors.
#[derive(Clone, Copy, Debug)]
pub(crate) struct GgufLayout {
    /// llama.cpp permuted the rows of Q and K for its interleaved RoPE (llama does, qwen
    /// does not): they are permuted back at load.
    pub(crate) permuted_qk: bool,
}

/// A family's network and the model's description, built from a checkpoint.
pub(crate) type Built = (Box<dyn Network>, ModelInfo);

/// One architecture family the engine runs.
pub(crate) struct Family {
    /// The `model_type` of its `config.json`, and the `general.architecture` of its GGUFs.
    pub(crate) model_type: &'static str,
    /// How its GGUF files load; `None`: only Hugging Face folders.
    pub(crate) gguf: Option<GgufLayout>,
    /// Builds the network and the model's description from a checkpoint.
    pub(crate) build: fn(&Checkpoint) -> Result<Built>,
}

/// Refuses a cache that does not carry a hybrid's `expected` state layers, or that holds
/// `offset` tokens of KV without their states (`has_state`): K/V restored without the state
/// would look like a hit and compute garbage.
fn check_state_layers(
    family: &str,
    expected: usize,
    states: usize,
    offset: usize,
    has_state: bool,
) -> Result<()> {
    if states != expected || (offset > 0 && !has_state) {
        return Err(crate::error::EngineError::InvalidParameter {
            name: "cache",
            message: format!(
                "the cache carries {states} layer states for {offset} tokens; this {family} \
                 model has {expected} non-attention layers whose states it needs (make \
                 caches with Model::new_cache)"
            ),
        });
    }
    Ok(())
}

/// A hybrid's non-attention layer (short convolution, gated DeltaNet, Mamba-2): its output
/// and next state from its input and state.
pub(crate) trait StateMixer {
    /// `x` `[B, L, hidden]` after `state` (`None` before the first token) → the output
    /// `[B, L, hidden]` and the state after `x`.
    fn mix(&self, x: &Array, state: Option<&[Array]>) -> Result<(Array, Vec<Array>)>;
}

/// Runs `mixer` over `x` as state layer `slot` of a sequence's cache: reads the state,
/// sets the next one.
pub(crate) fn mix_cache(
    mixer: &dyn StateMixer,
    x: &Array,
    slot: usize,
    cache: &mut dyn KvCache,
) -> Result<Array> {
    let state = cache.layer_state(slot)?;
    let (y, next) = mixer.mix(x, state.as_deref())?;
    cache.set_layer_state(slot, x.shape()[1] as usize, next)?;
    Ok(y)
}

/// [`mix_cache`] for one decode step of a batch: every row's state stacked, then split.
pub(crate) fn mix_rows(
    mixer: &dyn StateMixer,
    x: &Array,
    slot: usize,
    rows: &mut PagedKvRows,
) -> Result<Array> {
    let state = rows.layer_states(slot)?;
    let (y, next) = mixer.mix(x, state.as_deref())?;
    rows.set_layer_states(slot, 1, &next)?;
    Ok(y)
}

/// [`check_state_layers`] for a single sequence's cache.
pub(crate) fn check_cache_states(family: &str, expected: usize, cache: &dyn KvCache) -> Result<()> {
    let has_state = expected == 0 || cache.layer_state(0).ok().flatten().is_some();
    check_state_layers(
        family,
        expected,
        cache.state_layers(),
        cache.offset(),
        has_state,
    )
}

/// [`check_state_layers`] for a batch (its rows share their layer counts).
pub(crate) fn check_rows_states(family: &str, expected: usize, rows: &PagedKvRows) -> Result<()> {
    let states = rows.row(0).map_or(0, |r| r.state_layers());
    let offset = rows.row(0).map_or(0, |r| r.offset());
    let has_state = expected == 0 || rows.layer_states(0)?.is_some();
    check_state_layers(family, expected, states, offset, has_state)
}

/// Every family the engine runs.
pub(crate) const FAMILIES: &[Family] = &[
    llama::FAMILY,
    qwen2::FAMILY,
    qwen3::FAMILY,
    gemma3::FAMILY,
    lfm2::FAMILY,
    qwen3_next::FAMILY,
    nemotron_h::FAMILY,
];

/// The family of a `model_type`.
pub(crate) fn family(model_type: &str) -> Option<&'static Family> {
    FAMILIES.iter().find(|f| f.model_type == model_type)
}

/// The `model_type`s the engine runs, for messages: `llama, qwen2, qwen3, gemma3_text`.
pub(crate) fn supported() -> String {
    FAMILIES
        .iter()
        .map(|f| f.model_type)
        .collect::<Vec<_>>()
        .join(", ")
}
