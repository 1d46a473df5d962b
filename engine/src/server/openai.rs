//! OpenAI request parsing (validated into engine [`Request`]s) and response bodies.

use axum::http::StatusCode;
use serde_json::{json, Map, Value};

use super::error::ApiError;
use super::tool_calls::{Marker, ToolFormat, ToolSpec};
use crate::generate::GenerateParams;
use crate::sampler::{Sampled, SamplingParams};
use crate::scheduler::Completion;
use crate::tokenizer::Tokenizer;

/// Parses a request body that must be a JSON object; returns its text (for key order) and
/// the object.
pub(crate) fn parse_json_body(bytes: &[u8]) -> Result<(String, Map<String, Value>), ApiError> {
    let raw = String::from_utf8(bytes.to_vec()).map_err(|_| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "the body is not UTF-8",
        )
    })?;
    match serde_json::from_str::<Value>(&raw) {
        Ok(Value::Object(m)) => Ok((raw, m)),
        Ok(_) => Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "the body must be a JSON object",
        )),
        Err(e) => Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            format!("malformed JSON: {e}"),
        )
        .with_code("invalid_json")),
    }
}

/// The parts of a chat or completion request that are not the prompt.
#[derive(Debug)]
pub(crate) struct Options {
    pub model: Option<String>,
    pub stream: bool,
    pub include_usage: bool,
    /// Whether per-token log-probabilities were asked for.
    pub logprobs: bool,
    pub params: GenerateParams,
    /// `max_tokens` as given (the default fills the context).
    pub max_tokens: Option<usize>,
    /// `cache_salt` (as in vLLM): requests with different salts never share cached blocks.
    pub cache_salt: Option<String>,
    /// `prompt_cache_key`: names the session a request belongs to (accounted per key in
    /// `/v1/cache`).
    pub prompt_cache_key: Option<String>,
    /// `prompt_cache_retention: "24h"`: pin the prompt's blocks for a day.
    pub retain_24h: bool,
}

/// Longest `prompt_cache_key` accepted, in bytes.
pub(crate) const MAX_PROMPT_CACHE_KEY_BYTES: usize = 256;

fn num(v: &Map<String, Value>, name: &'static str) -> Result<Option<f64>, ApiError> {
    match v.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => Ok(n.as_f64()),
        Some(_) => Err(ApiError::param(name, format!("{name} must be a number"))),
    }
}

fn uint(v: &Map<String, Value>, name: &'static str) -> Result<Option<u64>, ApiError> {
    match v.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => n
            .as_u64()
            .map(Some)
            .ok_or_else(|| ApiError::param(name, format!("{name} must be a non-negative integer"))),
        Some(_) => Err(ApiError::param(name, format!("{name} must be an integer"))),
    }
}

fn flag(v: &Map<String, Value>, name: &'static str) -> Result<bool, ApiError> {
    match v.get(name) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(ApiError::param(name, format!("{name} must be a boolean"))),
    }
}

/// Parses the sampling and streaming options shared by both endpoints. `chat` selects the
/// chat form of `logprobs` (a boolean plus `top_logprobs`) over the completions form (an
/// integer).
pub(crate) fn options(body: &Map<String, Value>, chat: bool) -> Result<Options, ApiError> {
    let model = match body.get("model") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => return Err(ApiError::param("model", "model must be a string")),
    };
    if let Some(n) = uint(body, "n")? {
        if n != 1 {
            return Err(ApiError::param("n", "only n = 1 is supported"));
        }
    }
    let mut s = SamplingParams::default();
    let f32_in = |name: &'static str, lo: f64, hi: f64| -> Result<Option<f32>, ApiError> {
        match num(body, name)? {
            Some(x) if !(lo..=hi).contains(&x) => Err(ApiError::param(
                name,
                format!("{name} = {x} is outside [{lo}, {hi}]"),
            )),
            x => Ok(x.map(|x| x as f32)),
        }
    };
    if let Some(t) = f32_in("temperature", 0.0, 2.0)? {
        s.temperature = t;
    }
    if let Some(p) = f32_in("top_p", 0.0, 1.0)? {
        if p == 0.0 {
            return Err(ApiError::param("top_p", "top_p must be greater than 0"));
        }
        s.top_p = p;
    }
    if let Some(p) = f32_in("min_p", 0.0, 1.0)? {
        s.min_p = p;
    }
    if let Some(p) = f32_in("presence_penalty", -2.0, 2.0)? {
        s.presence_penalty = p;
    }
    if let Some(p) = f32_in("frequency_penalty", -2.0, 2.0)? {
        s.frequency_penalty = p;
    }
    if let Some(p) = f32_in("repetition_penalty", 0.01, 10.0)? {
        s.repetition_penalty = p;
    }
    if let Some(k) = uint(body, "top_k")? {
        s.top_k = k as usize;
    }
    s.seed = match body.get("seed") {
        None | Some(Value::Null) => None,
        Some(Value::Number(n)) => Some(
            n.as_u64()
                .or_else(|| n.as_i64().map(|i| i as u64))
                .ok_or_else(|| ApiError::param("seed", "seed must be an integer"))?,
        ),
        Some(_) => return Err(ApiError::param("seed", "seed must be an integer")),
    };
    let logprobs = if chat {
        let on = flag(body, "logprobs")?;
        let top = uint(body, "top_logprobs")?;
        if top.is_some_and(|t| t > 20) {
            return Err(ApiError::param("top_logprobs", "top_logprobs must be ≤ 20"));
        }
        if top.is_some() && !on {
            return Err(ApiError::param(
                "top_logprobs",
                "top_logprobs needs logprobs: true",
            ));
        }
        if on {
            s.logprobs = Some(top.unwrap_or(0) as usize);
        }
        on
    } else {
        match uint(body, "logprobs")? {
            Some(t) if t > 20 => return Err(ApiError::param("logprobs", "logprobs must be ≤ 20")),
            Some(t) => {
                s.logprobs = Some(t as usize);
                true
            }
            None => false,
        }
    };
    s.validate()
        .map_err(|e| ApiError::param("sampling", e.to_string()))?;
    let stop = match body.get("stop") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| x.as_str().map(String::from))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| ApiError::param("stop", "stop must be a string or strings"))?,
        Some(_) => return Err(ApiError::param("stop", "stop must be a string or strings")),
    };
    if stop.len() > 16 || stop.iter().any(String::is_empty) {
        return Err(ApiError::param(
            "stop",
            "stop takes at most 16 non-empty strings",
        ));
    }
    let max_tokens = match uint(body, "max_completion_tokens")? {
        Some(m) => Some(m),
        None => uint(body, "max_tokens")?,
    };
    if max_tokens == Some(0) {
        return Err(ApiError::param(
            "max_tokens",
            "max_tokens must be at least 1",
        ));
    }
    // Its length is checked where every caller's salt is: Engine::submit.
    let cache_salt = match body.get("cache_salt") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => return Err(ApiError::param("cache_salt", "cache_salt must be a string")),
    };
    let prompt_cache_key = match body.get("prompt_cache_key") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if s.len() <= MAX_PROMPT_CACHE_KEY_BYTES => Some(s.clone()),
        Some(Value::String(_)) => {
            return Err(ApiError::param(
                "prompt_cache_key",
                format!("prompt_cache_key is longer than {MAX_PROMPT_CACHE_KEY_BYTES} bytes"),
            ))
        }
        Some(_) => {
            return Err(ApiError::param(
                "prompt_cache_key",
                "prompt_cache_key must be a string",
            ))
        }
    };
    let retain_24h = match body.get("prompt_cache_retention") {
        None | Some(Value::Null) => false,
        Some(Value::String(s)) if s == "in_memory" || s == "in-memory" => false,
        Some(Value::String(s)) if s == "24h" => true,
        Some(_) => {
            return Err(ApiError::param(
                "prompt_cache_retention",
                "prompt_cache_retention must be \"in_memory\" or \"24h\"",
            ))
        }
    };
    let stream = flag(body, "stream")?;
    let include_usage = match body.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(o)) => flag(o, "include_usage")?,
        Some(_) => {
            return Err(ApiError::param(
                "stream_options",
                "stream_options must be an object",
            ))
        }
    };
    Ok(Options {
        model,
        stream,
        include_usage,
        logprobs,
        params: GenerateParams {
            max_tokens: max_tokens.map_or(usize::MAX, |m| m as usize),
            stop,
            sampling: s,
            ..GenerateParams::default()
        },
        max_tokens: max_tokens.map(|m| usize::try_from(m).unwrap_or(usize::MAX)),
        cache_salt,
        prompt_cache_key,
        retain_24h,
    })
}

const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

/// Renders the chat prompt of a request body (`raw` is its text, for key order).
pub(crate) fn chat_prompt(
    tokenizer: &Tokenizer,
    body: &Map<String, Value>,
    raw: &str,
) -> Result<Vec<u32>, ApiError> {
    let (messages, tools) = chat_template_input(tokenizer, body, raw)?;
    tokenizer
        .encode_chat(&messages, tools.as_deref(), true)
        .map_err(ApiError::from)
}

/// Validates a chat body's messages and returns the JSON texts of `messages` and `tools`
/// the chat template renders (text parts joined, key order kept, tool-call arguments as the
/// template expects them).
pub(crate) fn chat_template_input(
    tokenizer: &Tokenizer,
    body: &Map<String, Value>,
    raw: &str,
) -> Result<(String, Option<String>), ApiError> {
    let messages = match body.get("messages") {
        Some(Value::Array(m)) if !m.is_empty() => m,
        Some(Value::Array(_)) => {
            return Err(ApiError::param("messages", "messages must not be empty"))
        }
        _ => return Err(ApiError::param("messages", "messages must be an array")),
    };
    let mut flatten = false;
    // Ids of the tool calls earlier assistant messages made: a tool message answers one.
    let mut call_ids = std::collections::HashSet::new();
    for (i, m) in messages.iter().enumerate() {
        let role = m.get("role").and_then(Value::as_str);
        match role {
            Some(r) if ROLES.contains(&r) => {}
            _ => {
                return Err(ApiError::param(
                    "messages",
                    format!("messages[{i}].role must be one of {}", ROLES.join(", ")),
                ))
            }
        }
        if role == Some("assistant") {
            if let Some(Value::Array(calls)) = m.get("tool_calls") {
                call_ids.extend(calls.iter().filter_map(|c| c.get("id")?.as_str()));
            }
        }
        if role == Some("tool") {
            match m.get("tool_call_id").and_then(Value::as_str) {
                None => {
                    return Err(ApiError::param(
                        "messages",
                        format!("messages[{i}]: a tool message needs the tool_call_id it answers"),
                    ))
                }
                Some(id) if !call_ids.contains(id) => {
                    return Err(ApiError::param(
                        "messages",
                        format!(
                            "messages[{i}].tool_call_id {:?} answers no tool call of an earlier \
                             assistant message",
                            id.chars().take(80).collect::<String>()
                        ),
                    ))
                }
                Some(_) => {}
            }
        }
        match m.get("content") {
            None | Some(Value::Null) | Some(Value::String(_)) => {}
            Some(Value::Array(parts)) => {
                if parts
                    .iter()
                    .any(|p| p.get("type").and_then(Value::as_str) != Some("text"))
                {
                    return Err(ApiError::param(
                        "messages",
                        format!("messages[{i}].content: only text parts are supported"),
                    ));
                }
                flatten = true;
            }
            Some(_) => {
                return Err(ApiError::param(
                    "messages",
                    format!("messages[{i}].content must be a string or an array of parts"),
                ))
            }
        }
    }
    // The template sees messages and tools with their keys in the order the client sent.
    let (messages_json, tools_json) = if flatten {
        let flat: Vec<Value> = messages
            .iter()
            .map(|m| {
                let mut m = m.clone();
                if let Some(Value::Array(parts)) = m.get("content") {
                    let text: String = parts
                        .iter()
                        .filter_map(|p| p.get("text").and_then(Value::as_str))
                        .collect();
                    m["content"] = Value::String(text);
                }
                m
            })
            .collect();
        let tools = body
            .get("tools")
            .filter(|t| !t.is_null())
            .map(Value::to_string);
        (Value::Array(flat).to_string(), tools)
    } else {
        crate::tokenizer::chat_request_parts(raw).map_err(ApiError::from)?
    };
    let messages_json = match tokenizer.chat_template() {
        Some(t) if tojsons_arguments(t) && messages_json.contains("tool_calls") => {
            objectify_arguments(&messages_json)?
        }
        Some(t) if ToolFormat::detect(t).is_none() && messages_json.contains("tool_calls") => {
            calls_as_content(&messages_json)?
        }
        _ => messages_json,
    };
    Ok((messages_json, tools_json))
}

/// Whether a template writes a call's `arguments` through `tojson` without first checking
/// for a string (Llama 3's, Qwen2.5's): OpenAI's string `arguments` would then render as a
/// quoted string, not as the object the model wrote.
fn tojsons_arguments(template: &str) -> bool {
    let t: String = template.chars().filter(|c| !c.is_whitespace()).collect();
    t.contains("arguments|tojson") && !t.contains("argumentsisstring")
}

/// `messages` (a JSON array) with each assistant tool call's `function.arguments` string
/// replaced by the JSON object it holds, keys in their order; arguments that are not a JSON
/// object's text stay as they are.
fn objectify_arguments(messages: &str) -> Result<String, ApiError> {
    use minijinja::value::{Value as J, ValueKind};
    /// `v` (a map) with `key` set to `new`, the other entries and their order kept.
    fn with(v: &J, key: &str, new: J) -> J {
        let keys: Vec<J> = v.try_iter().map(Iterator::collect).unwrap_or_default();
        J::from_iter(keys.into_iter().map(|k| {
            let value = if k.as_str() == Some(key) {
                new.clone()
            } else {
                v.get_item(&k).unwrap_or_default()
            };
            (k, value)
        }))
    }
    let call = |c: J| -> J {
        let Ok(f) = c.get_attr("function") else {
            return c;
        };
        let parsed = f
            .get_attr("arguments")
            .ok()
            .and_then(|a| a.as_str().map(serde_json::from_str::<J>))
            .and_then(Result::ok)
            .filter(|a| a.kind() == ValueKind::Map);
        match parsed {
            Some(args) if f.kind() == ValueKind::Map => {
                with(&c, "function", with(&f, "arguments", args))
            }
            _ => c,
        }
    };
    let v: J = serde_json::from_str(messages)
        .map_err(|e| ApiError::param("messages", format!("messages are not valid JSON: {e}")))?;
    let Ok(items) = v.try_iter() else {
        return Ok(messages.to_string());
    };
    let fixed = J::from_iter(items.map(|m| match m.get_attr("tool_calls") {
        Ok(calls) if m.kind() == ValueKind::Map && calls.kind() == ValueKind::Seq => {
            let calls: Vec<J> = calls
                .try_iter()
                .map(|it| it.map(call).collect())
                .unwrap_or_default();
            with(&m, "tool_calls", J::from(calls))
        }
        _ => m,
    }));
    serde_json::to_string(&fixed)
        .map_err(|e| ApiError::internal(format!("re-encoding messages: {e}")))
}

/// `messages` (a JSON array) with each assistant message's `tool_calls` also written into
/// its `content`, as the `<tool_call>` blocks a forced call is generated in
/// (`ToolFormat::call_grammar`), after any text: for a template that knows no tool calls
/// (SmolLM2's renders `content` only, and fails on a null one), so that the history shows
/// the calls exactly as the model wrote them and the next prompt extends the cached reply.
fn calls_as_content(messages: &str) -> Result<String, ApiError> {
    let mut v: Value = serde_json::from_str(messages)
        .map_err(|e| ApiError::param("messages", format!("messages are not valid JSON: {e}")))?;
    for m in v.as_array_mut().into_iter().flatten() {
        let Some(Value::Array(calls)) = m.get("tool_calls") else {
            continue;
        };
        let blocks: Vec<String> = calls
            .iter()
            .filter_map(|c| {
                let f = c.get("function")?;
                let name = Value::String(f.get("name")?.as_str()?.to_string());
                let args = match f.get("arguments")? {
                    Value::String(a) => a.clone(),
                    other => other.to_string(),
                };
                Some(format!(
                    "<tool_call>\n{{\"name\": {name}, \"arguments\": {args}}}\n</tool_call>"
                ))
            })
            .collect();
        if blocks.is_empty() {
            continue;
        }
        let text = m.get("content").and_then(Value::as_str).unwrap_or("");
        let mut content = text.to_string();
        if !content.is_empty() {
            content.push('\n');
        }
        content.push_str(&blocks.join("\n"));
        m["content"] = Value::String(content);
    }
    serde_json::to_string(&v).map_err(|e| ApiError::internal(format!("re-encoding messages: {e}")))
}

/// The prompt of a completions request: a string, or an array of token ids.
pub(crate) fn completion_prompt(
    tokenizer: &Tokenizer,
    body: &Map<String, Value>,
) -> Result<Vec<u32>, ApiError> {
    match body.get("prompt") {
        Some(Value::String(s)) => {
            if s.is_empty() {
                return Err(ApiError::param("prompt", "prompt must not be empty"));
            }
            tokenizer.encode(s, true).map_err(ApiError::from)
        }
        Some(Value::Array(a)) if a.iter().all(Value::is_u64) && !a.is_empty() => a
            .iter()
            .filter_map(Value::as_u64)
            .enumerate()
            .map(|(i, x)| {
                u32::try_from(x).map_err(|_| {
                    ApiError::param(
                        "prompt",
                        format!(
                            "prompt[{i}] = {x} is not a token id of this model (its \
                             vocabulary has {} tokens)",
                            tokenizer.vocab_size()
                        ),
                    )
                })
            })
            .collect(),
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
            let mut one = Map::new();
            one.insert("prompt".into(), a[0].clone());
            completion_prompt(tokenizer, &one)
        }
        _ => Err(ApiError::param(
            "prompt",
            "prompt must be a non-empty string or an array of token ids",
        )),
    }
}

/// `usage` of a response.
pub(crate) fn usage(c: &Completion) -> Value {
    json!({
        "prompt_tokens": c.prompt_tokens,
        "completion_tokens": c.completion_tokens,
        "total_tokens": c.prompt_tokens + c.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": c.cached_tokens},
    })
}

/// OpenAI's `finish_reason` (a cancelled request reports `"stop"`; it has no reader).
pub(crate) fn finish_reason(c: &Completion) -> &'static str {
    match c.finish_reason {
        crate::generate::FinishReason::Length => "length",
        _ => "stop",
    }
}

/// One chat `logprobs.content` entry.
pub(crate) fn chat_logprob(tokenizer: &Tokenizer, s: &Sampled) -> Value {
    let text = |id: u32| tokenizer.decode(&[id], false).unwrap_or_default();
    let bytes = |t: &str| t.as_bytes().to_vec();
    let tok = text(s.token);
    let top: Vec<Value> = s
        .top_logprobs
        .iter()
        .map(|(id, lp)| {
            let t = text(*id);
            json!({"token": t, "logprob": lp, "bytes": bytes(&t)})
        })
        .collect();
    json!({"token": tok, "logprob": s.logprob, "bytes": bytes(&tok), "top_logprobs": top})
}

/// How long `prompt_cache_retention: "24h"` pins a prompt's blocks.
pub(crate) const RETENTION_24H: std::time::Duration = std::time::Duration::from_secs(24 * 3600);
/// Most `prompt_cache_key`s accounted at once (the least recently used leaves first).
const MAX_CACHE_KEYS: usize = 1024;

/// What the requests of one `prompt_cache_key` did.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub(crate) struct CacheKeyStats {
    pub requests: u64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    /// Prompt tokens of the key's last request, and how many of them were cached.
    pub last_prompt_tokens: u64,
    pub last_cached_tokens: u64,
    /// When the key's 24 h pin ends (Unix ms; 0: never pinned).
    pub pinned_until_unix_ms: u64,
    #[serde(skip)]
    seen: u64,
}

/// Per-`prompt_cache_key` accounting (shown by `GET /v1/cache`).
#[derive(Default)]
pub(crate) struct CacheKeys {
    map: std::sync::Mutex<(std::collections::HashMap<String, CacheKeyStats>, u64)>,
}

impl CacheKeys {
    /// Counts a finished request of `key`; `pinned_until` when it pinned its prompt.
    pub fn record(&self, key: &str, c: &Completion, pinned_until: Option<u64>) {
        let Ok(mut g) = self.map.lock() else {
            return;
        };
        let (map, clock) = &mut *g;
        *clock += 1;
        let seen = *clock;
        if !map.contains_key(key) && map.len() >= MAX_CACHE_KEYS {
            if let Some(old) = map
                .iter()
                .min_by_key(|(_, v)| v.seen)
                .map(|(k, _)| k.clone())
            {
                map.remove(&old);
            }
        }
        let e = map.entry(key.to_string()).or_default();
        e.requests += 1;
        e.prompt_tokens += c.prompt_tokens as u64;
        e.cached_tokens += c.cached_tokens as u64;
        e.last_prompt_tokens = c.prompt_tokens as u64;
        e.last_cached_tokens = c.cached_tokens as u64;
        if let Some(t) = pinned_until {
            e.pinned_until_unix_ms = e.pinned_until_unix_ms.max(t);
        }
        e.seen = seen;
    }

    /// Every key's counters.
    pub fn snapshot(&self) -> std::collections::BTreeMap<String, CacheKeyStats> {
        self.map
            .lock()
            .map(|g| g.0.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
            .unwrap_or_default()
    }
}

/// How a chat request's reply is searched for tool calls: the template's format and the
/// names of the request's functions.
#[derive(Clone, Debug)]
pub(crate) struct ToolParsing {
    pub format: ToolFormat,
    pub names: Vec<String>,
}

/// The most functions one request may define (OpenAI's limit).
pub(crate) const MAX_TOOLS: usize = 128;

/// What a chat request's `tools`, `tool_choice` and `response_format` make of its reply.
#[derive(Clone, Debug, Default)]
pub(crate) struct ReplyShape {
    /// How to parse the reply for calls (None: plain content).
    pub parsing: Option<ToolParsing>,
    /// The grammar the reply must follow, and the parameter that asked for it: `tools`
    /// (`tool_choice` required or naming a function) or `response_format`.
    pub grammar: Option<(&'static str, String)>,
}

const TOOL_CHOICE_SHAPE: &str = "tool_choice must be \"none\", \"auto\", \"required\" or \
                                 {\"type\": \"function\", \"function\": {\"name\": ...}}";

/// Validates `tools`, `tool_choice`, `parallel_tool_calls` and `response_format`; returns
/// how to parse the reply for calls and the grammar, if any, that decoding must follow.
/// `tool_choice: "required"` or a named function forces calls in the template's format (the
/// `<tool_call>` family for a template without one); `response_format` `json_object` or
/// `json_schema` forces a JSON document, or calls in the template's format when the model
/// may call tools (`auto`). Forced calls take precedence over a document.
pub(crate) fn reply_shape(
    body: &Map<String, Value>,
    tokenizer: &Tokenizer,
) -> Result<ReplyShape, ApiError> {
    let tools = match body.get("tools") {
        None | Some(Value::Null) => &[][..],
        Some(Value::Array(a)) => a.as_slice(),
        Some(_) => return Err(ApiError::param("tools", "tools must be an array")),
    };
    if tools.len() > MAX_TOOLS {
        return Err(ApiError::param(
            "tools",
            format!(
                "tools has {} functions; at most {MAX_TOOLS} are allowed",
                tools.len()
            ),
        ));
    }
    let mut specs: Vec<ToolSpec> = Vec::with_capacity(tools.len());
    for (i, t) in tools.iter().enumerate() {
        let function = (t.get("type").and_then(Value::as_str) == Some("function"))
            .then(|| t.get("function"))
            .flatten()
            .filter(|f| f.is_object());
        let name = function
            .and_then(|f| f.get("name"))
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty());
        let (Some(function), Some(name)) = (function, name) else {
            return Err(ApiError::param(
                "tools",
                format!(
                    "tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": \
                     ..., ...}}}} with a non-empty name"
                ),
            ));
        };
        if specs.iter().any(|s| s.name == name) {
            return Err(ApiError::param(
                "tools",
                format!("tools[{i}]: the function {name:?} is defined twice"),
            ));
        }
        let parameters = match function.get("parameters") {
            None | Some(Value::Null) => json!({"type": "object"}),
            Some(p @ Value::Object(_)) => p.clone(),
            Some(_) => {
                return Err(ApiError::param(
                    "tools",
                    format!("tools[{i}].function.parameters must be a JSON schema object"),
                ))
            }
        };
        specs.push(ToolSpec {
            name: name.to_string(),
            parameters,
        });
    }
    let one = match body.get("parallel_tool_calls") {
        None | Some(Value::Null) | Some(Value::Bool(true)) => false,
        Some(Value::Bool(false)) => true,
        Some(_) => {
            return Err(ApiError::param(
                "parallel_tool_calls",
                "parallel_tool_calls must be a boolean",
            ))
        }
    };
    // The functions a reply must call from (None: calls are not forced), or whether the
    // model's own calls are parsed.
    let (forced, parse): (Option<Vec<ToolSpec>>, bool) = match body.get("tool_choice") {
        None | Some(Value::Null) => (None, !specs.is_empty()),
        Some(Value::String(s)) if s == "auto" => (None, !specs.is_empty()),
        Some(Value::String(s)) if s == "none" => (None, false),
        Some(Value::String(s)) if s == "required" => {
            if specs.is_empty() {
                return Err(ApiError::param(
                    "tool_choice",
                    "tool_choice \"required\" needs at least one function in tools",
                ));
            }
            (Some(specs.clone()), true)
        }
        Some(Value::Object(o)) => {
            let name = (o.get("type").and_then(Value::as_str) == Some("function"))
                .then(|| o.get("function"))
                .flatten()
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .ok_or_else(|| ApiError::param("tool_choice", TOOL_CHOICE_SHAPE))?;
            let Some(spec) = specs.iter().find(|s| s.name == name) else {
                return Err(ApiError::param(
                    "tool_choice",
                    format!("tool_choice names the function {name:?}, which is not in tools"),
                ));
            };
            (Some(vec![spec.clone()]), true)
        }
        Some(_) => return Err(ApiError::param("tool_choice", TOOL_CHOICE_SHAPE)),
    };
    let detected = tokenizer.chat_template().and_then(ToolFormat::detect);
    let names: Vec<String> = specs.iter().map(|s| s.name.clone()).collect();
    let document = response_format(body)?;
    // A marker is its single token when that token is text (Qwen's `<tool_call>`), not a
    // special token that decoding drops: the reply must still show it.
    let marker = |m: &str| {
        let Some(id) = tokenizer.token_to_id(m) else {
            return Marker::Text;
        };
        let single = tokenizer.encode(m, false).ok().as_deref() == Some(&[id][..]);
        let text = tokenizer.decode(&[id], true).ok();
        match (single, text.as_deref() == Some(m)) {
            (true, true) => Marker::Token(id),
            (_, false) => Marker::Special,
            (false, true) => Marker::Text,
        }
    };
    Ok(match forced {
        Some(forced) => {
            // A template with no call format of its own gets the <tool_call> family: the
            // grammar writes it, so the parser reads it.
            let format = detected.unwrap_or(ToolFormat::Hermes);
            let named = matches!(body.get("tool_choice"), Some(Value::Object(_)));
            let grammar = format
                .call_grammar(&forced, one || named, &marker, None)
                .map_err(|e| ApiError::param("tools", e.to_string()))?;
            ReplyShape {
                parsing: Some(ToolParsing { format, names }),
                grammar: Some(("tools", grammar)),
            }
        }
        None => {
            let parsing = detected
                .filter(|_| parse)
                .map(|format| ToolParsing { format, names });
            // A document, or (with tools the model may call) calls instead of it.
            let grammar = match (document, &parsing) {
                (Some(doc), Some(p)) => Some(
                    p.format
                        .call_grammar(&specs, one, &marker, Some(&doc))
                        .map_err(|e| ApiError::param("response_format", e.to_string()))?,
                ),
                (Some(doc), None) => Some(format!("start: {doc}\n")),
                (None, _) => None,
            };
            ReplyShape {
                parsing,
                grammar: grammar.map(|g| ("response_format", g)),
            }
        }
    })
}

/// The grammar rule of `response_format`'s document: None for plain text, else a JSON
/// document (any object for `json_object`, the schema's for `json_schema`).
fn response_format(body: &Map<String, Value>) -> Result<Option<String>, ApiError> {
    const SHAPE: &str = "response_format must be {\"type\": \"text\"}, {\"type\": \
                         \"json_object\"} or {\"type\": \"json_schema\", \"json_schema\": \
                         {\"name\": ..., \"schema\": {...}}}";
    let rf = match body.get("response_format") {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(o)) => o,
        Some(_) => return Err(ApiError::param("response_format", SHAPE)),
    };
    let bad = |e: crate::EngineError| ApiError::param("response_format", e.to_string());
    match rf.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => crate::json_schema_rule(&json!({"type": "object"}))
            .map(Some)
            .map_err(bad),
        Some("json_schema") => {
            let Some(Value::Object(js)) = rf.get("json_schema") else {
                return Err(ApiError::param("response_format", SHAPE));
            };
            let schema = match js.get("schema") {
                Some(s @ Value::Object(_)) => s,
                None | Some(Value::Null) => &json!({}),
                Some(_) => {
                    return Err(ApiError::param(
                        "response_format",
                        "response_format.json_schema.schema must be a JSON schema object",
                    ))
                }
            };
            // Enforced whether or not `strict` is set (OpenAI's non-strict mode is best
            // effort; here every schema is followed exactly or refused).
            match js.get("strict") {
                None | Some(Value::Null) | Some(Value::Bool(_)) => {}
                Some(_) => {
                    return Err(ApiError::param(
                        "response_format",
                        "response_format.json_schema.strict must be a boolean",
                    ))
                }
            }
            crate::json_schema_rule(schema).map(Some).map_err(bad)
        }
        _ => Err(ApiError::param("response_format", SHAPE)),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::server::tool_calls::{self, ToolFormat};

    /// The tokenizer of a golden test model.
    pub(crate) fn tokenizer(model: &str) -> Tokenizer {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/goldens")
            .join(model);
        Tokenizer::from_folder(&dir).unwrap()
    }

    fn prompt(tok: &Tokenizer, body: &Value) -> Vec<u32> {
        let raw = body.to_string();
        chat_prompt(tok, body.as_object().unwrap(), &raw).unwrap()
    }

    #[test]
    fn a_tool_message_must_answer_an_earlier_call() {
        let tok = tokenizer("tiny-qwen3");
        let call = json!({"role": "assistant", "content": null, "tool_calls": [{"id": "call_1",
            "type": "function", "function": {"name": "f", "arguments": "{}"}}]});
        let user = json!({"role": "user", "content": "x"});
        let answer = |id: Value| json!({"role": "tool", "tool_call_id": id, "content": "ok"});
        let ask = |messages: Vec<Value>| {
            let body = json!({"messages": messages});
            chat_prompt(&tok, body.as_object().unwrap(), &body.to_string())
        };
        assert!(ask(vec![user.clone(), call.clone(), answer(json!("call_1"))]).is_ok());
        for (messages, says) in [
            (
                vec![user.clone(), answer(json!("call_1"))],
                "answers no tool call",
            ),
            (
                vec![user.clone(), call.clone(), answer(json!("call_2"))],
                "answers no tool call",
            ),
            (
                vec![
                    user.clone(),
                    call.clone(),
                    json!({"role": "tool", "content": "ok"}),
                ],
                "needs the tool_call_id",
            ),
            (
                vec![user.clone(), call.clone(), answer(json!(7))],
                "needs the tool_call_id",
            ),
        ] {
            let e = ask(messages).unwrap_err();
            assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST);
            assert!(e.message.contains(says), "{}", e.message);
        }
    }

    #[test]
    fn objectified_arguments_keep_their_key_order_and_everything_else() {
        let messages = r#"[{"role": "user", "content": "x"}, {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"z\": 1, \"a\": {\"y\": 2, \"b\": 3}}"}}, {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "not json"}}]}]"#;
        let out = objectify_arguments(messages).unwrap();
        assert_eq!(
            out,
            r#"[{"role":"user","content":"x"},{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":{"z":1,"a":{"y":2,"b":3}}}},{"id":"c2","type":"function","function":{"name":"g","arguments":"not json"}}]}]"#
        );
    }

    #[test]
    fn templates_that_tojson_string_arguments_are_recognised() {
        let chatml = include_str!("../../tests/goldens/chatml_tools.jinja");
        let header = include_str!("../../tests/goldens/header_tools.jinja");
        assert!(
            !tojsons_arguments(chatml),
            "it renders string arguments verbatim"
        );
        assert!(tojsons_arguments(header));
        // Qwen2.5's, spaced differently.
        assert!(tojsons_arguments(
            "{{- '\", \"arguments\": ' }}{{- tool_call.arguments|tojson }}"
        ));
    }

    #[test]
    fn a_llama_call_sent_back_renders_as_the_model_wrote_it() {
        let tok = tokenizer("tiny-llama");
        let tools = json!([{"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
        let mut messages = json!([{"role": "user", "content": "Weather in Paris?"}]);
        let first = json!({"messages": messages, "tools": tools});
        let reply = r#"{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}"#;
        let format = ToolFormat::detect(tok.chat_template().unwrap()).unwrap();
        let parsed = tool_calls::parse(format, &["get_weather".into()], reply);
        assert_eq!(parsed.content, None);
        let call = &parsed.calls[0];
        messages.as_array_mut().unwrap().extend([
            json!({"role": "assistant", "content": null, "tool_calls": [{"id": "call_1",
                "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]}),
            json!({"role": "tool", "tool_call_id": "call_1", "content": "18 C"}),
        ]);
        let second = json!({"messages": messages, "tools": tools});
        let (a, b) = (prompt(&tok, &first), prompt(&tok, &second));
        let (ta, tb) = (
            tok.decode(&a, false).unwrap(),
            tok.decode(&b, false).unwrap(),
        );
        assert!(
            tb.starts_with(&format!("{ta}{reply}<|eot_id|>")),
            "the history does not render the reply as written:\n{ta}\n---\n{tb}"
        );
        assert_eq!(
            &b[..a.len()],
            &a[..],
            "the second prompt does not extend the first"
        );
    }

    /// The grammar of `required` without `parallel_tool_calls: false` takes several calls
    /// in a row; with it, or naming a function, exactly one.
    #[test]
    fn forced_call_grammars_take_one_or_several_calls() {
        let tok = tokenizer("tiny-qwen3");
        let compiler = crate::GrammarCompiler::new(&tok).unwrap();
        let tools = json!([
            {"type": "function", "function": {"name": "a", "parameters": {"type": "object",
                "properties": {"x": {"type": "integer"}}, "required": ["x"]}}},
            {"type": "function", "function": {"name": "b"}},
        ]);
        let call_a = "<tool_call>\n{\"name\": \"a\", \"arguments\": {\"x\": 1}}\n</tool_call>";
        let call_b = "<tool_call>\n{\"name\": \"b\", \"arguments\": {}}\n</tool_call>";
        let two = format!("{call_a}\n{call_b}");
        let bad_args =
            "<tool_call>\n{\"name\": \"a\", \"arguments\": {\"x\": \"1\"}}\n</tool_call>";
        // Whether `text` (spelled out byte by byte through the tokenizer) is a complete
        // sentence of the grammar.
        let accepts = |body: &Value, text: &str| -> bool {
            let shape = reply_shape(body.as_object().unwrap(), &tok).unwrap();
            let (_, grammar) = shape.grammar.unwrap();
            let mut c = compiler.compile(&grammar).unwrap();
            // Char by char: this tokenizer's `<tool_call>` is a special token the grammar
            // spells out.
            let ids = text
                .chars()
                .flat_map(|ch| tok.encode(&ch.to_string(), false).unwrap());
            for id in ids {
                let allowed = c.allowed(tok.vocab_size()).unwrap();
                if allowed[id as usize] == 0 || c.commit(id).is_err() {
                    return false;
                }
            }
            c.is_accepting()
        };
        let required = json!({"tools": tools, "tool_choice": "required"});
        let mut one = required.clone();
        one["parallel_tool_calls"] = json!(false);
        let named = json!({"tools": tools,
            "tool_choice": {"type": "function", "function": {"name": "b"}}});
        assert!(accepts(&required, call_a));
        assert!(accepts(&required, &two));
        assert!(!accepts(&required, bad_args));
        assert!(!accepts(&required, "Sure."));
        assert!(accepts(&one, call_b));
        assert!(!accepts(&one, &two));
        assert!(accepts(&named, call_b));
        assert!(!accepts(&named, call_a));
        // `auto` with a response_format: the document, or calls instead of it.
        let either = json!({"tools": tools, "response_format": {"type": "json_schema",
            "json_schema": {"name": "d", "schema": {"type": "object", "properties": {
                "ok": {"type": "boolean"}}, "required": ["ok"]}}}});
        assert!(accepts(&either, "{\"ok\": true}"));
        assert!(accepts(&either, call_a));
        assert!(accepts(&either, &two));
        assert!(!accepts(&either, "{\"ok\": 1}"));
        assert!(!accepts(&either, "Sure."));
    }

    #[test]
    fn calls_become_content_for_a_template_without_tool_calls() {
        let messages = r#"[{"role": "user", "content": "x"}, {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}, {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]}, {"role": "assistant", "content": "Hi", "tool_calls": [{"id": "c3", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]"#;
        let v: Value = serde_json::from_str(&calls_as_content(messages).unwrap()).unwrap();
        assert_eq!(v[0]["content"], "x");
        assert_eq!(
            v[1]["content"],
            "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n</tool_call>\n<tool_call>\n{\"name\": \"g\", \"arguments\": {}}\n</tool_call>"
        );
        assert_eq!(
            v[2]["content"],
            "Hi\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>"
        );
    }
}
