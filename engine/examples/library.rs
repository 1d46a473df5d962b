//! The engine as a library, without HTTP: open an engine with a block store, submit a chat
//! request, stream its tokens, then cancel a second one mid-way.
//!
//! ```text
//! cargo run -p kvstore-engine --example library -- [MODEL] [STORE_DIR]
//! ```
//! MODEL defaults to models/SmolLM2-135M-Instruct.Q4_1.gguf, STORE_DIR to a temp folder.

use std::io::Write;

use engine::{
    load, Engine, EngineConfig, Event, GenerateParams, KvTiers, LoadOptions, Request, ReuseConfig,
};
use store::StoreConfig;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let model_path = args
        .next()
        .unwrap_or_else(|| "models/SmolLM2-135M-Instruct.Q4_1.gguf".into());
    let store_dir = match args.next() {
        Some(d) => std::path::PathBuf::from(d),
        None => std::env::temp_dir().join("kvstore-library-example"),
    };

    // 1. Load the model; open the prefix cache (RAM + SSD tiers) for it; start the engine.
    let (model, tokenizer) = load(model_path.as_ref(), &LoadOptions::default())?;
    let reuse = ReuseConfig {
        store: StoreConfig::default().root(store_dir),
        ..ReuseConfig::default()
    };
    let prefix = KvTiers::open(&model, &tokenizer, reuse)?;
    let engine = Engine::open(model, tokenizer, Some(prefix), EngineConfig::default())?;

    // 2. Submit a chat request and stream its text as it is generated.
    let messages = r#"[{"role": "user", "content": "Give me three tips for writing tests."}]"#;
    let prompt = engine.tokenizer().encode_chat(messages, None, true)?;
    let params = GenerateParams {
        max_tokens: 64,
        ..GenerateParams::default()
    };
    let mut handle = engine.submit(Request::new(prompt.clone(), params.clone()))?;
    let mut out = std::io::stdout().lock();
    while let Some(event) = handle.recv_blocking() {
        match event {
            Event::Started { cached_tokens, .. } => {
                writeln!(out, "[{cached_tokens} prompt tokens from the cache]")?
            }
            Event::Token { text, .. } => {
                out.write_all(text.as_bytes())?;
                out.flush()?;
            }
            Event::Finished(done) => writeln!(
                out,
                "\n[{:?}: {} tokens, TTFT {:.3}s]",
                done.finish_reason, done.completion_tokens, done.ttft_s
            )?,
            Event::Failed(e) => return Err(e.into()),
            _ => {}
        }
    }

    // 3. The same prompt again hits the cache; cancel it after five tokens.
    let mut again = engine.submit(Request::new(prompt, params))?;
    let cancel = again.cancel_handle(); // may be sent to another thread
    let mut n = 0;
    while let Some(event) = again.recv_blocking() {
        match event {
            Event::Started { cached_tokens, .. } => {
                writeln!(out, "[again: {cached_tokens} prompt tokens from the cache]")?
            }
            Event::Token { .. } => {
                n += 1;
                if n == 5 {
                    cancel.cancel();
                }
            }
            Event::Finished(done) => writeln!(
                out,
                "[{:?} after {} tokens]",
                done.finish_reason, done.completion_tokens
            )?,
            _ => {}
        }
    }

    // 4. Finish what runs, flush the store to disk, stop the engine thread.
    engine.shutdown(false)?;
    Ok(())
}
