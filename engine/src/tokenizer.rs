//! [`Tokenizer`]: text ↔ token ids through the `tokenizers` crate, the model's chat template
//! rendered with `minijinja` the way Hugging Face's `apply_chat_template` renders it, and the
//! ids that end a turn.
//!
//! Sources: a Hugging Face folder (`tokenizer.json`, `tokenizer_config.json`,
//! `chat_template.jinja`, `generation_config.json`) or a GGUF file's `tokenizer.ggml.*`
//! metadata (byte-level BPE rebuilt from its vocabulary, merges and pre-tokenizer name).

use std::collections::BTreeMap;
use std::path::Path;

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, ErrorKind, Value};
use mlx::io::GgufValue;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::Split;
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior};

use crate::error::{EngineError, Result};

/// A model's tokenizer, chat template and stop tokens.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    chat_template: Option<String>,
    special: BTreeMap<&'static str, String>,
    eos_ids: Vec<u32>,
    add_bos: Option<u32>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab", &self.vocab_size())
            .field("eos_ids", &self.eos_ids)
            .field("has_chat_template", &self.chat_template.is_some())
            .finish()
    }
}

fn tok_err(e: impl std::fmt::Display) -> EngineError {
    EngineError::Tokenizer(e.to_string())
}

/// A special-token entry of tokenizer_config.json: a string or `{"content": ...}`.
fn token_text(v: &serde_json::Value) -> Option<String> {
    match v {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content").and_then(|c| c.as_str()).map(String::from),
        _ => None,
    }
}

// llama.cpp's pre-tokenizer regexes, by `tokenizer.ggml.pre` (gpt2's is ByteLevel's own).
const LLAMA3_SPLIT: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_SPLIT: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

fn split(regex: &str) -> Result<PreTokenizerWrapper> {
    Ok(Split::new(
        tokenizers::pre_tokenizers::split::SplitPattern::Regex(regex.to_string()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .map_err(tok_err)?
    .into())
}

impl Tokenizer {
    /// The tokenizer of a Hugging Face folder.
    pub fn from_folder(dir: &Path) -> Result<Tokenizer> {
        let path = dir.join("tokenizer.json");
        let bytes = crate::weights::read_capped(&path, crate::weights::MAX_TOKENIZER_BYTES)?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes)
            .map_err(|e| EngineError::Tokenizer(format!("{}: {e}", path.display())))?;
        drop(bytes);
        let read = |name: &str| -> Result<Option<serde_json::Value>> {
            let p = dir.join(name);
            if !p.exists() {
                return Ok(None);
            }
            let bytes = crate::weights::read_capped(&p, crate::weights::MAX_JSON_BYTES)?;
            serde_json::from_slice(&bytes)
                .map(Some)
                .map_err(|e| EngineError::config(p.display().to_string(), e.to_string()))
        };
        let cfg = read("tokenizer_config.json")?.unwrap_or_default();
        let mut special = BTreeMap::new();
        for key in ["bos_token", "eos_token", "unk_token", "pad_token"] {
            if let Some(t) = cfg.get(key).and_then(token_text) {
                special.insert(key, t);
            }
        }
        let jinja = dir.join("chat_template.jinja");
        let chat_template = if jinja.exists() {
            let bytes = crate::weights::read_capped(&jinja, crate::weights::MAX_TEMPLATE_BYTES)?;
            Some(
                String::from_utf8(bytes).map_err(|_| {
                    EngineError::config(jinja.display().to_string(), "not valid UTF-8")
                })?,
            )
        } else {
            match cfg.get("chat_template") {
                Some(serde_json::Value::String(s)) => Some(s.clone()),
                // A list of named templates: take "default".
                Some(serde_json::Value::Array(list)) => list
                    .iter()
                    .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                    .and_then(|t| t.get("template").and_then(|s| s.as_str()))
                    .map(String::from),
                _ => None,
            }
        };
        let mut eos_ids = Vec::new();
        if let Some(gen) = read("generation_config.json")? {
            match gen.get("eos_token_id") {
                Some(serde_json::Value::Number(n)) => eos_ids.extend(n.as_u64().map(|n| n as u32)),
                Some(serde_json::Value::Array(a)) => {
                    eos_ids.extend(a.iter().filter_map(|n| n.as_u64()).map(|n| n as u32))
                }
                _ => {}
            }
        }
        if let Some(id) = special.get("eos_token").and_then(|t| inner.token_to_id(t)) {
            eos_ids.push(id);
        }
        eos_ids.sort_unstable();
        eos_ids.dedup();
        Ok(Tokenizer {
            inner,
            chat_template,
            special,
            eos_ids,
            add_bos: None,
        })
    }

    /// The tokenizer described by a GGUF file's metadata (byte-level BPE models).
    pub fn from_gguf(meta: &BTreeMap<String, GgufValue>) -> Result<Tokenizer> {
        let model = match meta.get("tokenizer.ggml.model") {
            Some(GgufValue::String(s)) => s.as_str(),
            _ => return Err(tok_err("GGUF has no tokenizer.ggml.model")),
        };
        if model != "gpt2" {
            return Err(tok_err(format!(
                "GGUF tokenizer model {model:?} is not supported (byte-level BPE \"gpt2\" only)"
            )));
        }
        let strings = |k: &str| match meta.get(k) {
            Some(GgufValue::Strings(v)) => Ok(v),
            _ => Err(tok_err(format!("GGUF has no {k}"))),
        };
        let ints = |k: &str| -> Option<Vec<i32>> {
            match meta.get(k) {
                Some(GgufValue::Array(a)) => a.astype(mlx::Dtype::I32).ok()?.to_vec::<i32>().ok(),
                _ => None,
            }
        };
        let id = |k: &str| ints(k).and_then(|v| v.first().copied()).map(|v| v as u32);
        let tokens = strings("tokenizer.ggml.tokens")?;
        let merges = strings("tokenizer.ggml.merges")?;
        let types = ints("tokenizer.ggml.token_type").unwrap_or_default();
        let vocab: tokenizers::models::bpe::Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let merges: Vec<(String, String)> = merges
            .iter()
            .filter_map(|m| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
            })
            .collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(tok_err)?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        let pre = match meta.get("tokenizer.ggml.pre") {
            Some(GgufValue::String(s)) => s.as_str(),
            _ => "default",
        };
        let byte_level = ByteLevel::new(false, true, false);
        let pre_tok: PreTokenizerWrapper = match pre {
            "default" | "gpt2" => ByteLevel::new(false, true, true).into(),
            "smollm" => Sequence::new(vec![
                Digits::new(true).into(),
                ByteLevel::new(false, true, true).into(),
            ])
            .into(),
            "llama-bpe" | "llama3" => {
                Sequence::new(vec![split(LLAMA3_SPLIT)?, byte_level.into()]).into()
            }
            "qwen2" => Sequence::new(vec![split(QWEN2_SPLIT)?, byte_level.into()]).into(),
            other => {
                return Err(tok_err(format!(
                    "GGUF pre-tokenizer {other:?} is not supported (gpt2, smollm, llama-bpe, qwen2)"
                )))
            }
        };
        inner.with_pre_tokenizer(Some(pre_tok));
        inner.with_decoder(Some(ByteLevel::default()));
        // Control (3) and user-defined (4) tokens match whole, never split by BPE.
        let specials: Vec<AddedToken> = tokens
            .iter()
            .zip(types.iter())
            .filter(|(_, &t)| t == 3 || t == 4)
            .map(|(s, &t)| AddedToken::from(s.clone(), t == 3))
            .collect();
        inner.add_special_tokens(&specials);
        let name = |i: Option<u32>| i.and_then(|i| tokens.get(i as usize)).cloned();
        let bos = id("tokenizer.ggml.bos_token_id");
        let eos = id("tokenizer.ggml.eos_token_id");
        let mut special = BTreeMap::new();
        for (k, v) in [
            ("bos_token", name(bos)),
            ("eos_token", name(eos)),
            ("unk_token", name(id("tokenizer.ggml.unknown_token_id"))),
            ("pad_token", name(id("tokenizer.ggml.padding_token_id"))),
        ] {
            if let Some(v) = v {
                special.insert(k, v);
            }
        }
        let mut eos_ids: Vec<u32> = [
            eos,
            id("tokenizer.ggml.eot_token_id"),
            id("tokenizer.ggml.eom_token_id"),
        ]
        .into_iter()
        .flatten()
        .collect();
        eos_ids.sort_unstable();
        eos_ids.dedup();
        let add_bos = match meta.get("tokenizer.ggml.add_bos_token") {
            Some(GgufValue::Array(a)) => a.item_i32().unwrap_or(0) != 0,
            _ => false,
        };
        let chat_template = match meta.get("tokenizer.chat_template") {
            Some(GgufValue::String(s)) => Some(s.clone()),
            _ => None,
        };
        Ok(Tokenizer {
            inner,
            chat_template,
            special,
            eos_ids,
            add_bos: if add_bos { bos } else { None },
        })
    }

    /// blake3 over the vocabulary (token strings by id, added tokens included), the stop
    /// ids and the chat template: identical for identical tokenizers across processes.
    pub fn fingerprint(&self) -> blake3::Hash {
        let mut vocab: Vec<(u32, String)> = self
            .inner
            .get_vocab(true)
            .into_iter()
            .map(|(t, id)| (id, t))
            .collect();
        vocab.sort();
        let mut h = blake3::Hasher::new();
        h.update(b"kvstore-tokenizer-v1");
        h.update(&(vocab.len() as u64).to_le_bytes());
        for (id, t) in &vocab {
            h.update(&id.to_le_bytes());
            h.update(&(t.len() as u64).to_le_bytes());
            h.update(t.as_bytes());
        }
        h.update(&(self.eos_ids.len() as u64).to_le_bytes());
        for id in &self.eos_ids {
            h.update(&id.to_le_bytes());
        }
        let template = self.chat_template.as_deref().unwrap_or("");
        h.update(&(template.len() as u64).to_le_bytes());
        h.update(template.as_bytes());
        h.finalize()
    }
    /// The underlying `tokenizers` tokenizer (grammar-constrained sampling builds its token
    /// trie from it).
    pub(crate) fn hf(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Ids that end generation (EOS, end-of-turn).
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// The special token `bos_token`, `eos_token`, `unk_token` or `pad_token`, if defined.
    pub fn special_token(&self, name: &str) -> Option<&str> {
        self.special.get(name).map(String::as_str)
    }

    /// The chat template, if the model has one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// The id of a token string.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Token ids of `text`; `add_special_tokens` adds what the model adds to a raw prompt
    /// (e.g. BOS). Special-token text in `text` becomes the special token.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode_fast(text, add_special_tokens)
            .map_err(tok_err)?;
        let mut ids = enc.get_ids().to_vec();
        if add_special_tokens {
            if let Some(bos) = self.add_bos {
                if ids.first() != Some(&bos) {
                    ids.insert(0, bos);
                }
            }
        }
        Ok(ids)
    }

    /// The text of `ids`.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner.decode(ids, skip_special_tokens).map_err(tok_err)
    }

    /// Renders the chat template for `messages` (a JSON array of message objects, as in an
    /// OpenAI or Hugging Face request: `role`, `content`, `tool_calls`, ...) with optional
    /// `tools` (a JSON array of function schemas) and extra template variables (e.g.
    /// `{"enable_thinking": false}`). Key order inside the JSON is kept, as Python keeps it.
    pub fn apply_chat_template(
        &self,
        messages: &str,
        tools: Option<&str>,
        add_generation_prompt: bool,
        extra: Option<&str>,
    ) -> Result<String> {
        let template = self.chat_template.as_deref().ok_or_else(|| {
            EngineError::Template("the model has no chat template; use a raw prompt".into())
        })?;
        let parse = |what: &str, s: &str| -> Result<Value> {
            serde_json::from_str::<Value>(s)
                .map_err(|e| EngineError::Template(format!("{what} are not valid JSON: {e}")))
        };
        let messages = parse("messages", messages)?;
        if messages.kind() != ValueKind::Seq {
            return Err(EngineError::Template(
                "messages must be a JSON array".into(),
            ));
        }
        let tools = match tools {
            Some(t) => parse("tools", t)?,
            None => Value::from(()),
        };
        let mut ctx: BTreeMap<String, Value> = BTreeMap::new();
        for (k, v) in &self.special {
            ctx.insert(k.to_string(), Value::from(v.clone()));
        }
        if let Some(extra) = extra {
            let extra = parse("template variables", extra)?;
            if let Ok(keys) = extra.try_iter() {
                for k in keys {
                    if let (Some(name), Ok(v)) = (k.as_str(), extra.get_item(&k)) {
                        ctx.insert(name.to_string(), v);
                    }
                }
            }
        }
        ctx.insert("messages".into(), messages);
        ctx.insert("tools".into(), tools);
        ctx.insert(
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt),
        );
        render_template(template, ctx)
    }

    /// Chat-template prompt ids for `messages` (see [`Tokenizer::apply_chat_template`]):
    /// the rendered text already holds any BOS, so no special tokens are added.
    pub fn encode_chat(
        &self,
        messages: &str,
        tools: Option<&str>,
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>> {
        let text = self.apply_chat_template(messages, tools, add_generation_prompt, None)?;
        self.encode(&text, false)
    }
}

/// Splits a chat request — a JSON array of messages, or an object with `messages` and
/// optional `tools` — into the JSON texts [`Tokenizer::apply_chat_template`] takes, keeping
/// key order.
pub fn chat_request_parts(json: &str) -> Result<(String, Option<String>)> {
    let v: Value = serde_json::from_str(json)
        .map_err(|e| EngineError::Template(format!("the chat request is not valid JSON: {e}")))?;
    let text =
        |v: &Value| serde_json::to_string(v).map_err(|e| EngineError::Template(e.to_string()));
    match v.kind() {
        ValueKind::Seq => Ok((text(&v)?, None)),
        ValueKind::Map => {
            let messages = v
                .get_attr("messages")
                .ok()
                .filter(|m| m.kind() == ValueKind::Seq)
                .ok_or_else(|| {
                    EngineError::Template("the request has no \"messages\" array".into())
                })?;
            let tools = v
                .get_attr("tools")
                .ok()
                .filter(|t| !t.is_undefined() && !t.is_none());
            Ok((text(&messages)?, tools.as_ref().map(text).transpose()?))
        }
        _ => Err(EngineError::Template(
            "a chat request is a JSON array of messages or an object with \"messages\"".into(),
        )),
    }
}

/// Template instructions every render may run, before [`RENDER_FUEL_PER_VALUE`] for each
/// value in the context: a looping or runaway template fails instead of spinning.
pub const RENDER_FUEL_BASE: u64 = 1_000_000;
/// Template instructions added per value (string, number, list or map entry) in the context.
pub const RENDER_FUEL_PER_VALUE: u64 = 10_000;
/// Longest rendered text in bytes; a template that writes more fails.
pub const MAX_RENDER_BYTES: usize = 64 << 20;

/// Values in `v` (itself included), stopping early once past `limit`.
fn count_values(v: &Value, depth: usize, limit: u64) -> u64 {
    let mut n = 1;
    if depth > 256 || !matches!(v.kind(), ValueKind::Seq | ValueKind::Map) {
        return n;
    }
    let Ok(items) = v.try_iter() else { return n };
    for item in items {
        if n > limit {
            break;
        }
        n += count_values(&item, depth + 1, limit - n);
        if v.kind() == ValueKind::Map {
            if let Ok(value) = v.get_item(&item) {
                n += count_values(&value, depth + 1, limit.saturating_sub(n));
            }
        }
    }
    n
}

/// An `io::Write` into a buffer that refuses to grow past a cap.
struct CappedWriter {
    out: Vec<u8>,
    cap: usize,
}

impl std::io::Write for CappedWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.out.len() + buf.len() > self.cap {
            return Err(std::io::Error::other(format!(
                "the rendered template exceeds {} bytes",
                self.cap
            )));
        }
        self.out.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Renders a Hugging Face chat template: jinja2 with `trim_blocks` and `lstrip_blocks`,
/// loop controls, Python string methods, `raise_exception`, `strftime_now`, and a `tojson`
/// that prints exactly what Python's `json.dumps(ensure_ascii=False)` prints.
///
/// Bounded: the template may run [`RENDER_FUEL_BASE`] plus [`RENDER_FUEL_PER_VALUE`] per
/// context value instructions and write [`MAX_RENDER_BYTES`]; past either it fails.
pub fn render_template(template: &str, ctx: BTreeMap<String, Value>) -> Result<String> {
    let values: u64 = ctx
        .values()
        .map(|v| count_values(v, 0, u64::MAX / RENDER_FUEL_PER_VALUE))
        .sum();
    let mut env = Environment::new();
    env.set_fuel(Some(
        RENDER_FUEL_BASE.saturating_add(values.saturating_mul(RENDER_FUEL_PER_VALUE)),
    ));
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function(
        "raise_exception",
        |msg: String| -> std::result::Result<Value, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
        },
    );
    env.add_function("strftime_now", |fmt: String| strftime_now(&fmt));
    env.add_filter("tojson", tojson);
    env.add_template("chat", template)
        .map_err(|e| EngineError::Template(format!("{e:#}")))?;
    let t = env
        .get_template("chat")
        .map_err(|e| EngineError::Template(format!("{e:#}")))?;
    let mut out = CappedWriter {
        out: Vec::new(),
        cap: MAX_RENDER_BYTES,
    };
    t.render_captured_to(Value::from_serialize(&ctx), &mut out)
        .map_err(|e| EngineError::Template(format!("{e:#}")))?;
    String::from_utf8(out.out).map_err(|e| EngineError::Template(e.to_string()))
}

fn tojson(v: Value, kwargs: Kwargs) -> std::result::Result<Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let _: Option<Value> = kwargs.get("ensure_ascii")?;
    let _: Option<Value> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let mut out = String::new();
    py_json(&v, indent, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

fn py_str(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `json.dumps(v, ensure_ascii=False, indent=indent)`.
fn py_json(
    v: &Value,
    indent: Option<usize>,
    depth: usize,
    out: &mut String,
) -> std::result::Result<(), minijinja::Error> {
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if let Ok(i) = i64::try_from(v.clone()) {
                out.push_str(&i.to_string());
            } else {
                let f = f64::try_from(v.clone()).unwrap_or(f64::NAN);
                out.push_str(&py_float(f));
            }
        }
        ValueKind::String => py_str(v.as_str().unwrap_or_default(), out),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                py_json(item, indent, depth + 1, out)?;
            }
            newline(out, depth);
            out.push(']');
        }
        ValueKind::Map => {
            let keys: Vec<Value> = v.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                match k.as_str() {
                    Some(s) => py_str(s, out),
                    None => py_str(&k.to_string(), out),
                }
                out.push_str(": ");
                py_json(&v.get_item(k)?, indent, depth + 1, out)?;
            }
            newline(out, depth);
            out.push('}');
        }
        _ => py_str(&v.to_string(), out),
    }
    Ok(())
}

/// Python's float repr (shortest round-trip, with `.0` on integral values).
fn py_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    let s = format!("{f:?}");
    if s.contains('e') {
        // Rust prints 1e20 as "1e20"; Python as "1e+20".
        let (m, e) = s.split_once('e').unwrap_or((&s, "0"));
        let e: i32 = e.parse().unwrap_or(0);
        return format!("{m}e{}{:02}", if e < 0 { '-' } else { '+' }, e.abs());
    }
    s
}

/// `strftime_now(fmt)` of Hugging Face templates (UTC; %d %m %Y %y %b %B %H %M %S %j %%).
fn strftime_now(fmt: &str) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    let days = secs.div_euclid(86_400);
    let tod = secs.rem_euclid(86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let month = MONTHS[(m - 1) as usize];
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let cum = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cum[(m - 1) as usize] + d + i64::from(leap && m > 2);
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&format!("{:02}", y % 100)),
            Some('b') => out.push_str(&month[..3]),
            Some('B') => out.push_str(month),
            Some('H') => out.push_str(&format!("{:02}", tod / 3600)),
            Some('M') => out.push_str(&format!("{:02}", tod / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", tod % 60)),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tojson_matches_python_json_dumps() {
        let v: Value =
            serde_json::from_str(r#"{"b": 1, "a": [1.5, "é\n", null, true], "c": {}}"#).unwrap();
        let mut s = String::new();
        py_json(&v, None, 0, &mut s).unwrap();
        assert_eq!(s, r#"{"b": 1, "a": [1.5, "é\n", null, true], "c": {}}"#);
        let mut s = String::new();
        py_json(&v, Some(2), 0, &mut s).unwrap();
        assert_eq!(s, "{\n  \"b\": 1,\n  \"a\": [\n    1.5,\n    \"é\\n\",\n    null,\n    true\n  ],\n  \"c\": {}\n}");
    }

    #[test]
    fn a_template_that_loops_for_ever_runs_out_of_fuel() {
        let t = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}";
        let err = render_template(t, BTreeMap::new()).unwrap_err();
        assert!(err.to_string().contains("fuel"), "{err}");
    }

    #[test]
    fn a_template_that_writes_too_much_fails() {
        let t = "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}";
        assert!(render_template(t, BTreeMap::new()).is_err());
    }

    #[test]
    fn strftime_formats_a_date() {
        let s = strftime_now("%d %b %Y");
        assert_eq!(s.len(), 11, "{s}");
    }
}
