//! How the commands run requests: through an [`Engine`], the same state machine `serve`
//! runs (one request is a batch of one). [`complete`] runs one request on an open engine;
//! [`ModelSlot`] lends one loaded model to engine after engine (a benchmark's arms, the
//! turns of a session over tiers that change between them) without loading it again.

use anyhow::Context;
use engine::{Completion, Engine, EngineConfig, Event, KvTiers, Model, Request, Tokenizer};

/// The settings of an engine that serves one command's requests one at a time: the KV
/// budget of `--kv-budget` (`None`: unbounded, for commands without tiers, where it only
/// bounds admission). A request alone prefills in steps of its own `prefill_chunk`.
pub fn config(kv_budget_bytes: Option<u64>) -> EngineConfig {
    EngineConfig {
        kv_budget_bytes: kv_budget_bytes.unwrap_or(EngineConfig::NO_KV_BUDGET),
        ..EngineConfig::default()
    }
}

/// Submits `request` to `engine` and reads its events to the end: each token's text goes
/// to `on_text`, which returns false to cancel the request (it then finishes as cancelled).
pub fn complete(
    engine: &Engine,
    request: Request,
    on_text: &mut dyn FnMut(&str) -> bool,
) -> anyhow::Result<Completion> {
    let mut handle = engine.submit(request)?;
    while let Some(event) = handle.recv_blocking() {
        match event {
            Event::Token { text, .. } if !on_text(&text) => handle.cancel(),
            Event::Finished(done) => return Ok(done),
            Event::Failed(e) => return Err(e.into()),
            _ => {}
        }
    }
    Err(engine::EngineError::EngineStopped.into())
}

/// A loaded model and its tokenizer, lent to one engine at a time ([`Engine::close`]
/// hands them back).
pub struct ModelSlot {
    parts: Option<(Model, Tokenizer)>,
}

impl ModelSlot {
    /// A slot holding `model` and `tokenizer`.
    pub fn new(model: Model, tokenizer: Tokenizer) -> Self {
        Self {
            parts: Some((model, tokenizer)),
        }
    }

    fn parts(&self) -> anyhow::Result<&(Model, Tokenizer)> {
        self.parts
            .as_ref()
            .context("the model was lost with an engine that failed")
    }

    /// The model, between engines (to open tiers for it).
    pub fn model(&self) -> anyhow::Result<&Model> {
        Ok(&self.parts()?.0)
    }

    /// The tokenizer, between engines.
    pub fn tokenizer(&self) -> anyhow::Result<&Tokenizer> {
        Ok(&self.parts()?.1)
    }

    /// Opens an engine over the model and `tiers`, runs `request` on it ([`complete`]),
    /// closes it, and returns the completion and the tiers (what they hold stays: the next
    /// engine over them finds it).
    pub fn run(
        &mut self,
        tiers: Option<KvTiers>,
        config: EngineConfig,
        request: Request,
        on_text: &mut dyn FnMut(&str) -> bool,
    ) -> anyhow::Result<(Completion, Option<KvTiers>)> {
        let (model, tokenizer) = self
            .parts
            .take()
            .context("the model was lost with an engine that failed")?;
        let engine = Engine::open(model, tokenizer, tiers, config)?;
        let done = complete(&engine, request, on_text);
        let (model, tokenizer, tiers) = engine.close()?;
        self.parts = Some((model, tokenizer));
        Ok((done?, tiers))
    }
}
