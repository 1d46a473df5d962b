//! OpenAI request parsing (validated into engine [`Request`]s) and response bodies.

use axum::http::StatusCode;
use serde_json::{json, Map, Value};

use super::error::ApiError;
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
}

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
    })
}

const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

/// Renders the chat prompt of a request body (`raw` is its text, for key order).
pub(crate) fn chat_prompt(
    tokenizer: &Tokenizer,
    body: &Map<String, Value>,
    raw: &str,
) -> Result<Vec<u32>, ApiError> {
    let messages = match body.get("messages") {
        Some(Value::Array(m)) if !m.is_empty() => m,
        Some(Value::Array(_)) => {
            return Err(ApiError::param("messages", "messages must not be empty"))
        }
        _ => return Err(ApiError::param("messages", "messages must be an array")),
    };
    let mut flatten = false;
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
    match body.get("tools") {
        None | Some(Value::Null) | Some(Value::Array(_)) => {}
        Some(_) => return Err(ApiError::param("tools", "tools must be an array")),
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
    tokenizer
        .encode_chat(&messages_json, tools_json.as_deref(), true)
        .map_err(ApiError::from)
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
