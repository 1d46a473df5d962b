//! Entry points for the fuzz targets (`fuzz/`) and the corpus replay tests: what the HTTP
//! handlers do with a request body before a request reaches the engine, and the `check_*`
//! harnesses over it and over chat-template rendering. Not a stable API.
//!
//! The functions under test never panic; the `check_*` functions panic when an invariant
//! breaks (that is how a fuzzer or a test reports it).

use std::collections::BTreeMap;

use minijinja::Value;

use crate::server::openai;
use crate::tokenizer::{chat_request_parts, render_template, MAX_RENDER_BYTES};
use crate::Tokenizer;

/// The tokenizer the engine fuzz targets use, loaded once: `fuzz/assets/smollm2` in this
/// source tree (SmolLM2's chat template over a small BPE). Panics if it does not load.
pub fn smollm2_tokenizer() -> &'static Tokenizer {
    static TOK: std::sync::OnceLock<Tokenizer> = std::sync::OnceLock::new();
    TOK.get_or_init(|| {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/assets/smollm2");
        Tokenizer::from_folder(&dir).expect("fuzz/assets/smollm2 loads")
    })
}

/// Longest template [`check_chat_template`] renders.
pub const MAX_FUZZ_TEMPLATE_BYTES: usize = 4096;

/// Runs a `/v1/chat/completions` (`chat`) or `/v1/completions` body through the handlers'
/// parsing and validation and builds its prompt ids; an error is the HTTP status and message
/// the client would get.
pub fn request_prompt(
    tokenizer: &Tokenizer,
    body: &[u8],
    chat: bool,
) -> Result<Vec<u32>, (u16, String)> {
    let err = |e: crate::server::ApiError| (e.status.as_u16(), e.message);
    let (raw, body) = openai::parse_json_body(body).map_err(err)?;
    openai::options(&body, chat).map_err(err)?;
    if chat {
        openai::chat_prompt(tokenizer, &body, &raw).map_err(err)
    } else {
        openai::completion_prompt(tokenizer, &body).map_err(err)
    }
}

/// Runs `body` as both endpoints' request body. Panics on a status outside 4xx.
pub fn check_request_body(tokenizer: &Tokenizer, body: &[u8]) {
    for chat in [true, false] {
        if let Err((status, message)) = request_prompt(tokenizer, body, chat) {
            assert!((400..500).contains(&status), "{status}: {message}");
        }
    }
}

/// A fixed conversation with a tool call, for rendering arbitrary templates.
fn conversation() -> BTreeMap<String, Value> {
    let messages = r#"[{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4", "tool_calls": [{"type": "function",
          "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}]},
        {"role": "tool", "content": "4"}]"#;
    let tools = r#"[{"type": "function", "function": {"name": "add", "parameters":
        {"type": "object", "properties": {"a": {"type": "integer"}}}}}]"#;
    let json = |s: &str| serde_json::from_str::<Value>(s).unwrap_or_default();
    let mut ctx = BTreeMap::new();
    ctx.insert("messages".into(), json(messages));
    ctx.insert("tools".into(), json(tools));
    ctx.insert("add_generation_prompt".into(), Value::from(true));
    ctx.insert("bos_token".into(), Value::from("<|im_start|>"));
    ctx.insert("eos_token".into(), Value::from("<|im_end|>"));
    ctx
}

/// Chat-template rendering of `data`, whose first byte picks the input: below 128 the rest
/// is a chat request (or messages, or template variables) rendered with `tokenizer`'s
/// template; from 128 the rest is a template (at most [`MAX_FUZZ_TEMPLATE_BYTES`]) rendered
/// over a fixed conversation. Panics on rendered text longer than [`MAX_RENDER_BYTES`].
pub fn check_chat_template(tokenizer: &Tokenizer, data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let Ok(text) = std::str::from_utf8(rest) else {
        return;
    };
    let bounded = |r: crate::Result<String>| {
        if let Ok(out) = r {
            assert!(out.len() <= MAX_RENDER_BYTES);
        }
    };
    if mode < 128 {
        if let Ok((messages, tools)) = chat_request_parts(text) {
            for generation_prompt in [false, true] {
                bounded(tokenizer.apply_chat_template(
                    &messages,
                    tools.as_deref(),
                    generation_prompt,
                    None,
                ));
            }
        }
        bounded(tokenizer.apply_chat_template(text, None, true, None));
        bounded(tokenizer.apply_chat_template("[]", None, true, Some(text)));
    } else if text.len() <= MAX_FUZZ_TEMPLATE_BYTES {
        bounded(render_template(text, conversation()));
    }
}
