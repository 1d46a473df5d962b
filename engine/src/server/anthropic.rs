//! The Anthropic Messages API: `POST /v1/messages` (whole or streamed) and
//! `POST /v1/messages/count_tokens`.
//!
//! A request is translated into the chat form the OpenAI path renders (system text, user
//! and assistant turns, `tool_use` blocks as assistant `tool_calls`, `tool_result` blocks as
//! `tool` messages, `tools` as functions), so one chat template rendering serves both APIs
//! and a conversation's next turn renders its history exactly as the previous prompt and
//! reply were: the arguments text the model wrote for each call it made is kept by id
//! ([`ToolInputs`]) and rendered again verbatim when the call comes back as a `tool_use`
//! block. Replies are parsed for tool calls by the template's format (`tool_calls.rs`);
//! each call becomes a `tool_use` block.
//!
//! `cache_control` breakpoints (on blocks and tools, or top-level: after the last block)
//! pin the prompt's blocks up to the breakpoint in every tier
//! for the breakpoint's TTL ([`KvTiers::pin_prefix`](crate::KvTiers::pin_prefix)), and
//! `usage` splits the prompt into what was read from the cache, what was written to it up
//! to the last breakpoint, and the rest (docs/server.md).
//!
//! Errors have Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`.

use std::collections::{HashMap, HashSet, VecDeque};
use std::convert::Infallible;
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use minijinja::value::Value as J;
use serde_json::{json, Map, Value};

use super::error::ApiError;
use super::openai::{self, ToolParsing};
use super::tool_calls::{self, CallStream, Piece};
use super::{
    cut_off, json_content_type, parse_body, sse, stream_failure, stream_parsers, token_budget,
    EventStream, Shared,
};
use crate::generate::FinishReason;
use crate::scheduler::{Completion, Event, Request, RequestHandle};
use crate::tokenizer::Tokenizer;

/// Most tools one request may define.
pub(crate) const MAX_TOOLS: usize = 128;
/// Most bytes the `tools` array may take (as JSON).
pub(crate) const MAX_TOOLS_BYTES: usize = 256 << 10;
/// Most `cache_control` breakpoints one request may set (Anthropic's limit).
pub(crate) const MAX_BREAKPOINTS: usize = 4;
/// Tool calls whose arguments text is remembered for rendering their `tool_use` again.
const REMEMBERED_CALLS: usize = 4096;

/// The arguments text of the tool calls this server answered with, by `tool_use` id (the
/// most recent [`REMEMBERED_CALLS`]). A client sends a call back as a parsed `input`
/// object; rendering the model's own text instead keeps the next prompt's prefix identical
/// to the tokens the model produced.
#[derive(Default)]
pub(crate) struct ToolInputs {
    map: Mutex<(HashMap<String, String>, VecDeque<String>)>,
}

impl ToolInputs {
    fn remember(&self, id: &str, arguments: &str) {
        let Ok(mut g) = self.map.lock() else {
            return;
        };
        let (map, order) = &mut *g;
        if map.insert(id.to_string(), arguments.to_string()).is_none() {
            order.push_back(id.to_string());
        }
        while order.len() > REMEMBERED_CALLS {
            if let Some(old) = order.pop_front() {
                map.remove(&old);
            }
        }
    }

    /// The text the model wrote for call `id`, if `input` is still what it says.
    fn text_of(&self, id: &str, input: &Value) -> Option<String> {
        let g = self.map.lock().ok()?;
        let text = g.0.get(id)?;
        (serde_json::from_str::<Value>(text).ok()? == *input).then(|| text.clone())
    }
}

/// A `cache_control` breakpoint's time to live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Ttl {
    FiveMinutes,
    OneHour,
}

impl Ttl {
    fn duration(self) -> Duration {
        match self {
            Ttl::FiveMinutes => Duration::from_secs(5 * 60),
            Ttl::OneHour => Duration::from_secs(60 * 60),
        }
    }
}

/// A breakpoint: the chat messages that end where the marked block ends.
struct Breakpoint {
    ttl: Ttl,
    messages: Vec<J>,
}

/// A Messages request, validated and translated into the OpenAI chat form.
pub(crate) struct Translated {
    /// The chat body (`messages`, `tools`, `tool_choice`) as JSON text, key order kept.
    chat_raw: String,
    chat: Map<String, Value>,
    /// The chat form's `tools`, key order kept (breakpoint renders take them too).
    tools: Option<J>,
    breakpoints: Vec<Breakpoint>,
    /// The text of a final assistant message, which the reply continues.
    prefill: Option<String>,
}

/// A 400 naming the request field at fault.
fn bad(param: &'static str, message: impl Into<String>) -> ApiError {
    ApiError::param(param, message)
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// An ordered JSON object for the template.
fn obj<const N: usize>(pairs: [(&str, J); N]) -> J {
    J::from_iter(pairs.into_iter().map(|(k, v)| (J::from(k), v)))
}

/// `cache_control` of a block or tool, if any.
fn cache_control(v: &Value, at: &str) -> Result<Option<Ttl>, ApiError> {
    let Some(cc) = v.get("cache_control").filter(|c| !c.is_null()) else {
        return Ok(None);
    };
    if cc.get("type").and_then(Value::as_str) != Some("ephemeral") {
        return Err(bad(
            "cache_control",
            format!(
                "{at}.cache_control must be {{\"type\": \"ephemeral\"}} (with an optional \"ttl\")"
            ),
        ));
    }
    match cc.get("ttl") {
        None | Some(Value::Null) => Ok(Some(Ttl::FiveMinutes)),
        Some(Value::String(t)) if t == "5m" => Ok(Some(Ttl::FiveMinutes)),
        Some(Value::String(t)) if t == "1h" => Ok(Some(Ttl::OneHour)),
        Some(_) => Err(bad(
            "cache_control",
            format!("{at}.cache_control.ttl must be \"5m\" or \"1h\""),
        )),
    }
}

/// The text of `system`, or of a `tool_result`'s `content`: a string or text blocks.
/// Breakpoints on its blocks are reported through `marks` (block index, ttl).
fn text_blocks(
    v: &Value,
    param: &'static str,
    at: &str,
    marks: &mut Vec<(usize, Ttl)>,
) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => {
            let mut text = String::new();
            for (j, b) in blocks.iter().enumerate() {
                if b.get("type").and_then(Value::as_str) != Some("text") {
                    return Err(bad(param, format!("{at}[{j}] must be a text block")));
                }
                match b.get("text") {
                    Some(Value::String(t)) => text.push_str(t),
                    _ => return Err(bad(param, format!("{at}[{j}].text must be a string"))),
                }
                if let Some(ttl) = cache_control(b, &format!("{at}[{j}]"))? {
                    marks.push((j, ttl));
                }
            }
            Ok(text)
        }
        other => Err(bad(
            param,
            format!(
                "{at} must be a string or an array of text blocks, not {}",
                kind(other)
            ),
        )),
    }
}

/// A tool's name as Anthropic allows it: 1 to 128 of `[a-zA-Z0-9_-]`.
fn valid_tool_name(name: &str) -> bool {
    (1..=128).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// A request's tools in the OpenAI form.
struct Functions {
    /// `{"type": "function", "function": {...}}` each.
    functions: Vec<J>,
    names: Vec<String>,
    /// The TTL of a breakpoint on a tool.
    mark: Option<Ttl>,
}

/// Validates `tools`; returns them as OpenAI functions (key order of each schema kept), their
/// names, and the index of the last tool carrying a breakpoint.
fn tools(body: &Map<String, Value>, ordered: &J) -> Result<Functions, ApiError> {
    let tools = match body.get("tools") {
        None | Some(Value::Null) => {
            return Ok(Functions {
                functions: Vec::new(),
                names: Vec::new(),
                mark: None,
            })
        }
        Some(Value::Array(a)) => a,
        Some(other) => {
            return Err(bad(
                "tools",
                format!("tools must be an array, not {}", kind(other)),
            ))
        }
    };
    if tools.len() > MAX_TOOLS {
        return Err(bad(
            "tools",
            format!(
                "{} tools are more than this server takes ({MAX_TOOLS})",
                tools.len()
            ),
        ));
    }
    let bytes = Value::Array(tools.clone()).to_string().len();
    if bytes > MAX_TOOLS_BYTES {
        return Err(bad(
            "tools",
            format!("tools take {bytes} bytes; this server takes at most {MAX_TOOLS_BYTES}"),
        ));
    }
    let ordered_tools = ordered.get_attr("tools").unwrap_or_default();
    let mut out = Vec::with_capacity(tools.len());
    let mut names: Vec<String> = Vec::with_capacity(tools.len());
    let mut mark = None;
    for (i, t) in tools.iter().enumerate() {
        let at = format!("tools[{i}]");
        let Some(t) = t.as_object() else {
            return Err(bad("tools", format!("{at} must be an object")));
        };
        match t.get("type").and_then(Value::as_str) {
            None | Some("custom") => {}
            Some(other) => {
                return Err(bad(
                    "tools",
                    format!(
                        "{at}: server tools ({other:?}) are not supported; define a custom tool \
                         with name, description and input_schema"
                    ),
                ))
            }
        }
        let name = match t.get("name") {
            Some(Value::String(n)) if valid_tool_name(n) => n,
            _ => {
                return Err(bad(
                    "tools",
                    format!("{at}.name must be 1 to 128 characters of [a-zA-Z0-9_-]"),
                ))
            }
        };
        if names.contains(name) {
            return Err(bad(
                "tools",
                format!("{at}: the tool {name:?} is defined twice"),
            ));
        }
        match t.get("description") {
            None | Some(Value::Null) | Some(Value::String(_)) => {}
            Some(_) => return Err(bad("tools", format!("{at}.description must be a string"))),
        }
        let schema = t.get("input_schema");
        let schema_ok = schema.and_then(Value::as_object).is_some_and(|s| {
            s.get("type").and_then(Value::as_str) == Some("object")
                && s.get("properties").is_none_or(Value::is_object)
                && s.get("required")
                    .is_none_or(|r| r.as_array().is_some_and(|r| r.iter().all(Value::is_string)))
        });
        if !schema_ok {
            return Err(bad(
                "tools",
                format!(
                    "{at}.input_schema must be a JSON Schema object with \"type\": \"object\" \
                     (\"properties\" an object, \"required\" an array of names)"
                ),
            ));
        }
        if let Some(ttl) = cache_control(&Value::Object(t.clone()), &at)? {
            mark = Some(ttl);
        }
        let ot = ordered_tools.get_item(&J::from(i)).unwrap_or_default();
        let mut function = vec![(J::from("name"), J::from(name.as_str()))];
        if let Some(d) = t.get("description").and_then(Value::as_str) {
            function.push((J::from("description"), J::from(d)));
        }
        function.push((
            J::from("parameters"),
            ot.get_attr("input_schema").unwrap_or_default(),
        ));
        out.push(obj([
            ("type", J::from("function")),
            ("function", J::from_iter(function)),
        ]));
        names.push(name.clone());
    }
    Ok(Functions {
        functions: out,
        names,
        mark,
    })
}

/// `tool_choice` in the OpenAI form.
fn tool_choice(body: &Map<String, Value>, names: &[String]) -> Result<Value, ApiError> {
    let choice = match body.get("tool_choice") {
        None | Some(Value::Null) => return Ok(Value::Null),
        Some(Value::Object(o)) => o,
        Some(other) => {
            return Err(bad(
                "tool_choice",
                format!("tool_choice must be an object, not {}", kind(other)),
            ))
        }
    };
    match choice.get("disable_parallel_tool_use") {
        None | Some(Value::Null) | Some(Value::Bool(_)) => {}
        Some(_) => {
            return Err(bad(
                "tool_choice",
                "tool_choice.disable_parallel_tool_use must be a boolean",
            ))
        }
    }
    let need_tools = |what: &str| {
        if names.is_empty() {
            Err(bad(
                "tool_choice",
                format!("tool_choice {what} needs tools"),
            ))
        } else {
            Ok(())
        }
    };
    match choice.get("type").and_then(Value::as_str) {
        Some("auto") => Ok(json!("auto")),
        Some("none") => Ok(json!("none")),
        Some("any") => need_tools("\"any\"").map(|()| json!("required")),
        Some("tool") => {
            let Some(name) = choice.get("name").and_then(Value::as_str) else {
                return Err(bad(
                    "tool_choice",
                    "tool_choice {\"type\": \"tool\"} needs the tool's \"name\"",
                ));
            };
            if !names.iter().any(|n| n == name) {
                return Err(bad(
                    "tool_choice",
                    format!(
                        "tool_choice names the tool {:?}, which is not in tools",
                        name.chars().take(128).collect::<String>()
                    ),
                ));
            }
            Ok(json!({"type": "function", "function": {"name": name}}))
        }
        _ => Err(bad(
            "tool_choice",
            "tool_choice.type must be \"auto\", \"any\", \"tool\" or \"none\"",
        )),
    }
}

/// Translates one message into chat messages, its content blocks up to `upto` (all when
/// `None`). `ordered` is the same message with its key order; `calls` collects the ids of
/// the `tool_use` blocks seen so far (a `tool_result` must answer one).
fn translate_message(
    i: usize,
    m: &Value,
    ordered: &J,
    upto: Option<usize>,
    calls: &mut HashSet<String>,
    inputs: &ToolInputs,
    marks: &mut Vec<(usize, Ttl)>,
) -> Result<Vec<J>, ApiError> {
    let at = format!("messages[{i}]");
    // "system" between turns is the mid-conversation system beta Claude Code sends
    // (`anthropic-beta: mid-conversation-system-…`): text only, rendered where it stands.
    let role = match m.get("role").and_then(Value::as_str) {
        Some(r @ ("user" | "assistant" | "system")) => r,
        _ => {
            return Err(bad(
                "messages",
                format!("{at}.role must be \"user\", \"assistant\" or \"system\""),
            ))
        }
    };
    let blocks: Vec<Value> = match m.get("content") {
        Some(Value::String(s)) => vec![json!({"type": "text", "text": s})],
        Some(Value::Array(a)) => a.clone(),
        Some(other) => {
            return Err(bad(
                "messages",
                format!(
                    "{at}.content must be a string or an array of content blocks, not {}",
                    kind(other)
                ),
            ))
        }
        None => return Err(bad("messages", format!("{at}.content is missing"))),
    };
    let ordered_blocks = ordered.get_attr("content").unwrap_or_default();
    let mut out = Vec::new();
    let mut text = String::new();
    let mut tool_calls: Vec<J> = Vec::new();
    let end = upto.map_or(blocks.len(), |u| u + 1);
    for (j, b) in blocks.iter().enumerate().take(end) {
        let bat = format!("{at}.content[{j}]");
        let ty = b.get("type").and_then(Value::as_str);
        match (ty, role) {
            (Some("text"), _) => match b.get("text") {
                Some(Value::String(t)) => text.push_str(t),
                _ => return Err(bad("messages", format!("{bat}.text must be a string"))),
            },
            (Some("tool_use"), "assistant") => {
                let (Some(id), Some(name), Some(input)) = (
                    b.get("id").and_then(Value::as_str),
                    b.get("name").and_then(Value::as_str),
                    b.get("input").filter(|v| v.is_object()),
                ) else {
                    return Err(bad(
                        "messages",
                        format!("{bat}: a tool_use block needs a string id and name and an object input"),
                    ));
                };
                calls.insert(id.to_string());
                let arguments = match inputs.text_of(id, input) {
                    Some(t) => J::from(t),
                    None => {
                        let o = ordered_blocks
                            .get_item(&J::from(j))
                            .and_then(|b| b.get_attr("input"))
                            .unwrap_or_default();
                        let text = serde_json::to_string(&o).map_err(|e| {
                            ApiError::internal(format!("re-encoding a tool input: {e}"))
                        })?;
                        J::from(text)
                    }
                };
                tool_calls.push(obj([
                    ("id", J::from(id)),
                    ("type", J::from("function")),
                    (
                        "function",
                        obj([("name", J::from(name)), ("arguments", arguments)]),
                    ),
                ]));
            }
            (Some("tool_result"), "user") => {
                let Some(id) = b.get("tool_use_id").and_then(Value::as_str) else {
                    return Err(bad(
                        "messages",
                        format!("{bat}: a tool_result block needs the tool_use_id it answers"),
                    ));
                };
                if !calls.contains(id) {
                    return Err(bad(
                        "messages",
                        format!(
                            "{bat}.tool_use_id {:?} answers no tool_use block of an earlier \
                             assistant message",
                            id.chars().take(80).collect::<String>()
                        ),
                    ));
                }
                match b.get("is_error") {
                    None | Some(Value::Null) | Some(Value::Bool(_)) => {}
                    Some(_) => {
                        return Err(bad("messages", format!("{bat}.is_error must be a boolean")))
                    }
                }
                let content = match b.get("content") {
                    None | Some(Value::Null) => String::new(),
                    Some(c) => {
                        text_blocks(c, "messages", &format!("{bat}.content"), &mut Vec::new())?
                    }
                };
                // Results come first in a user turn; text after them is a user message.
                if !text.is_empty() {
                    out.push(obj([
                        ("role", J::from("user")),
                        ("content", J::from(std::mem::take(&mut text))),
                    ]));
                }
                out.push(obj([
                    ("role", J::from("tool")),
                    ("tool_call_id", J::from(id)),
                    ("content", J::from(content)),
                ]));
            }
            // Reasoning the model never wrote here is not rendered.
            (Some("thinking" | "redacted_thinking"), "assistant") => {}
            (Some(t @ ("tool_use" | "tool_result")), _) => {
                return Err(bad(
                    "messages",
                    format!("{bat}: a {t} block cannot be in a {role} message"),
                ))
            }
            (Some(t), _) => {
                return Err(bad(
                    "messages",
                    format!(
                        "{bat}: {:?} blocks are not supported (text, tool_use and tool_result are)",
                        t.chars().take(40).collect::<String>()
                    ),
                ))
            }
            (None, _) => {
                return Err(bad(
                    "messages",
                    format!("{bat} must be an object with a string \"type\""),
                ))
            }
        }
        if let Some(ttl) = cache_control(b, &bat)? {
            marks.push((j, ttl));
        }
    }
    if role == "assistant" {
        let mut m = vec![
            (J::from("role"), J::from("assistant")),
            (J::from("content"), J::from(text)),
        ];
        if !tool_calls.is_empty() {
            m.push((J::from("tool_calls"), J::from(tool_calls)));
        }
        out.push(J::from_iter(m));
    } else if !text.is_empty() || out.is_empty() {
        out.push(obj([("role", J::from(role)), ("content", J::from(text))]));
    }
    Ok(out)
}

fn to_json(v: &J) -> Result<String, ApiError> {
    serde_json::to_string(v).map_err(|e| ApiError::internal(format!("encoding the chat: {e}")))
}

/// Validates a Messages request's prompt parts (`system`, `messages`, `tools`,
/// `tool_choice`) and translates them into the OpenAI chat form.
pub(crate) fn translate(
    body: &Map<String, Value>,
    raw: &str,
    inputs: &ToolInputs,
) -> Result<Translated, ApiError> {
    let ordered: J = serde_json::from_str(raw)
        .map_err(|e| bad("messages", format!("the body is not valid JSON: {e}")))?;
    let Functions {
        functions: tools,
        names,
        mark: tools_mark,
    } = tools(body, &ordered)?;
    let choice = tool_choice(body, &names)?;
    let mut breakpoints = Vec::new();
    if let Some(ttl) = tools_mark {
        breakpoints.push(Breakpoint {
            ttl,
            messages: Vec::new(),
        });
    }
    let mut chat: Vec<J> = Vec::new();
    match body.get("system") {
        None | Some(Value::Null) => {}
        Some(s) => {
            let mut marks = Vec::new();
            let text = text_blocks(s, "system", "system", &mut marks)?;
            let message = obj([("role", J::from("system")), ("content", J::from(text))]);
            // A breakpoint inside the system text caches all of it: the template renders
            // one system message.
            if let Some(&(_, ttl)) = marks.last() {
                breakpoints.push(Breakpoint {
                    ttl,
                    messages: vec![message.clone()],
                });
            }
            chat.push(message);
        }
    }
    let messages = match body.get("messages") {
        Some(Value::Array(m)) if !m.is_empty() => m,
        Some(Value::Array(_)) => return Err(bad("messages", "messages must not be empty")),
        _ => return Err(bad("messages", "messages must be an array")),
    };
    // A final assistant turn of text is a prefill: the reply continues it.
    let (messages, prefill) = match messages.split_last() {
        Some((last, rest))
            if last.get("role").and_then(Value::as_str) == Some("assistant")
                && !rest.is_empty() =>
        {
            let mut marks = Vec::new();
            let text = match last.get("content") {
                Some(c) => text_blocks(
                    c,
                    "messages",
                    "the final assistant message's content",
                    &mut marks,
                )
                .map_err(|e| {
                    bad(
                        "messages",
                        format!(
                            "{}: a final assistant message (a prefill the reply continues) \
                                 takes text only",
                            e.message
                        ),
                    )
                })?,
                None => {
                    return Err(bad(
                        "messages",
                        "the final assistant message has no content",
                    ))
                }
            };
            (rest, Some(text))
        }
        _ => (&messages[..], None),
    };
    let ordered_messages = ordered.get_attr("messages").unwrap_or_default();
    let mut calls = HashSet::new();
    for (i, m) in messages.iter().enumerate() {
        let om = ordered_messages.get_item(&J::from(i)).unwrap_or_default();
        let mut marks = Vec::new();
        let before = calls.clone();
        let whole = translate_message(i, m, &om, None, &mut calls, inputs, &mut marks)?;
        for (j, ttl) in marks {
            let mut upto = chat.clone();
            let mut seen = before.clone();
            upto.extend(translate_message(
                i,
                m,
                &om,
                Some(j),
                &mut seen,
                inputs,
                &mut Vec::new(),
            )?);
            breakpoints.push(Breakpoint {
                ttl,
                messages: upto,
            });
        }
        chat.extend(whole);
    }
    // The top-level cache_control marks the last block of the conversation.
    if let Some(ttl) = cache_control(&Value::Object(body.clone()), "the request")? {
        breakpoints.push(Breakpoint {
            ttl,
            messages: chat.clone(),
        });
    }
    if breakpoints.len() > MAX_BREAKPOINTS {
        return Err(bad(
            "cache_control",
            format!(
                "{} cache_control breakpoints; at most {MAX_BREAKPOINTS} are allowed",
                breakpoints.len()
            ),
        ));
    }
    let tools = (!tools.is_empty()).then(|| J::from(tools));
    let mut pairs = vec![(J::from("messages"), J::from(chat))];
    if let Some(t) = &tools {
        pairs.push((J::from("tools"), t.clone()));
    }
    if !choice.is_null() {
        pairs.push((J::from("tool_choice"), J::from_serialize(&choice)));
    }
    // At most one tool_use block: the forced-call grammar then takes exactly one call.
    let one_call = body
        .get("tool_choice")
        .and_then(|c| c.get("disable_parallel_tool_use"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    if one_call {
        pairs.push((J::from("parallel_tool_calls"), J::from(false)));
    }
    let chat_raw = to_json(&J::from_iter(pairs))?;
    let (_, chat) = openai::parse_json_body(chat_raw.as_bytes())?;
    Ok(Translated {
        chat_raw,
        chat,
        tools,
        breakpoints,
        prefill,
    })
}

/// Where a breakpoint ends in the prompt (tokens), and its TTL.
type Mark = (usize, Ttl);

/// The prompt of a translated request, and its breakpoints' [`Mark`]s in prompt order.
fn render(tok: &Tokenizer, t: &Translated) -> Result<(Vec<u32>, Vec<Mark>), ApiError> {
    let mut prompt = openai::chat_prompt(tok, &t.chat, &t.chat_raw)?;
    if let Some(text) = &t.prefill {
        prompt.extend(tok.encode(text, false).map_err(ApiError::from)?);
    }
    let mut marks = Vec::with_capacity(t.breakpoints.len());
    for b in &t.breakpoints {
        // Templates render tools ahead of the messages: every breakpoint's part has them.
        let mut pairs = vec![(J::from("messages"), J::from(b.messages.clone()))];
        if let Some(tools) = &t.tools {
            pairs.push((J::from("tools"), tools.clone()));
        }
        let raw = to_json(&J::from_iter(pairs))?;
        let (_, body) = openai::parse_json_body(raw.as_bytes())?;
        // The template's rendering of the conversation up to the marked block; where it
        // stops agreeing with the whole prompt is where the breakpoint's prefix ends. A
        // template that cannot render the part (one that needs a user turn) marks nothing.
        let part = openai::chat_template_input(tok, &body, &raw).and_then(|(m, tools)| {
            tok.encode_chat(&m, tools.as_deref(), false)
                .map_err(ApiError::from)
        });
        let at = match part {
            Ok(ids) => ids.iter().zip(&prompt).take_while(|(a, b)| a == b).count(),
            Err(e) => {
                tracing::debug!(error = %e.message, "a cache breakpoint's prefix did not render");
                0
            }
        };
        marks.push((at, b.ttl));
    }
    marks.sort_by_key(|(at, _)| *at);
    Ok((prompt, marks))
}

/// Anthropic's `usage` for a prompt of `prompt` tokens of which `read` came from the cache,
/// breakpoints `marks` (token positions, sorted) and `output` generated tokens:
/// `cache_read_input_tokens` = `read`; `cache_creation_input_tokens` = the tokens after
/// `read` up to the last breakpoint (written to the cache and pinned), split by TTL;
/// `input_tokens` = the rest, so the three add up to the prompt.
pub(crate) fn usage(prompt: usize, read: usize, marks: &[Mark], output: usize) -> Value {
    let (mut five, mut hour) = (0, 0);
    let mut from = read;
    for &(at, ttl) in marks {
        let at = at.min(prompt);
        if at > from {
            match ttl {
                Ttl::FiveMinutes => five += at - from,
                Ttl::OneHour => hour += at - from,
            }
            from = at;
        }
    }
    let created = five + hour;
    json!({
        "input_tokens": prompt - read.min(prompt) - created,
        "cache_creation_input_tokens": created,
        "cache_read_input_tokens": read.min(prompt),
        "cache_creation": {
            "ephemeral_5m_input_tokens": five,
            "ephemeral_1h_input_tokens": hour,
        },
        "output_tokens": output,
    })
}

/// Sampling and stop options of a Messages request, in the OpenAI form `openai::options`
/// parses.
fn options(body: &Map<String, Value>) -> Result<openai::Options, ApiError> {
    let mut o = Map::new();
    match body.get("max_tokens") {
        Some(v @ Value::Number(_)) => {
            o.insert("max_tokens".into(), v.clone());
        }
        _ => {
            return Err(bad(
                "max_tokens",
                "max_tokens is required: a positive integer",
            ))
        }
    }
    if let Some(t) = body.get("temperature").and_then(Value::as_f64) {
        if !(0.0..=1.0).contains(&t) {
            return Err(bad(
                "temperature",
                format!("temperature = {t} is outside [0, 1]"),
            ));
        }
    }
    for k in ["temperature", "top_p", "top_k", "stream"] {
        if let Some(v) = body.get(k) {
            o.insert(k.into(), v.clone());
        }
    }
    match body.get("stop_sequences") {
        None | Some(Value::Null) => {}
        Some(Value::Array(a)) if a.iter().all(Value::is_string) => {
            o.insert("stop".into(), Value::Array(a.clone()));
        }
        Some(_) => {
            return Err(bad(
                "stop_sequences",
                "stop_sequences must be an array of strings",
            ))
        }
    }
    let mut opts = openai::options(&o, true).map_err(|mut e| {
        if e.param == Some("stop") {
            e.param = Some("stop_sequences");
            e.message = "stop_sequences takes at most 16 non-empty strings".into();
        }
        e
    })?;
    opts.model = match body.get("model") {
        Some(Value::String(m)) => Some(m.clone()),
        _ => return Err(bad("model", "model is required: a string")),
    };
    Ok(opts)
}

/// An error response in Anthropic's shape. Overload and shutdown are 529
/// `overloaded_error` (with `Retry-After`), as Anthropic answers them.
pub(crate) fn error_response(e: ApiError) -> Response {
    let (status, kind) = match e.status.as_u16() {
        401 => (e.status, "authentication_error"),
        403 => (e.status, "permission_error"),
        404 => (e.status, "not_found_error"),
        413 => (e.status, "request_too_large"),
        429 => (e.status, "rate_limit_error"),
        503 => (
            StatusCode::from_u16(529).unwrap_or(StatusCode::SERVICE_UNAVAILABLE),
            "overloaded_error",
        ),
        s if s >= 500 => (e.status, "api_error"),
        _ => (e.status, "invalid_request_error"),
    };
    let mut resp = (status, Json(error_body(kind, &e.message))).into_response();
    if kind == "overloaded_error" {
        resp.headers_mut().insert(
            axum::http::header::RETRY_AFTER,
            axum::http::HeaderValue::from_static("1"),
        );
    }
    resp
}

fn error_body(kind: &str, message: &str) -> Value {
    json!({"type": "error", "error": {"type": kind, "message": message}})
}

/// The `error` event of a stream that failed after its response began.
fn error_event(e: &ApiError) -> SseEvent {
    let kind = match e.status.as_u16() {
        503 => "overloaded_error",
        s if s >= 500 => "api_error",
        _ => "invalid_request_error",
    };
    SseEvent::default()
        .event("error")
        .data(error_body(kind, &e.message).to_string())
}

/// `POST /v1/messages`.
pub(crate) async fn messages(
    State(s): State<Shared>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match messages_endpoint(s, &headers, body).await {
        Ok(r) => r,
        Err(e) => error_response(e),
    }
}

/// `POST /v1/messages/count_tokens`: `{"input_tokens": N}`, the prompt's tokens.
pub(crate) async fn count_tokens(
    State(s): State<Shared>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let counted = async {
        json_content_type(&headers)?;
        let (raw, body) = parse_body(body)?;
        let engine = s.engine.clone();
        let state = s.clone();
        let n = tokio::task::spawn_blocking(move || {
            let t = translate(&body, &raw, &state.tool_inputs)?;
            openai::reply_shape(&t.chat, engine.tokenizer())?;
            render(engine.tokenizer(), &t).map(|(p, _)| p.len())
        })
        .await
        .map_err(|e| ApiError::internal(format!("counting tokens failed: {e}")))??;
        Ok::<_, ApiError>(Json(json!({"input_tokens": n})).into_response())
    };
    counted.await.unwrap_or_else(error_response)
}

/// What a response needs besides the engine's events.
struct Reply {
    id: String,
    model: String,
    tools: Option<ToolParsing>,
    stop: Vec<String>,
    marks: Vec<Mark>,
    nonce: u128,
    script: Option<Vec<String>>,
}

impl Reply {
    fn tool_id(&self, i: usize) -> String {
        let h = blake3::hash(format!("{}:{}:{i}", self.id, self.nonce).as_bytes());
        format!("toolu_{}", &h.to_hex()[..24])
    }

    /// `stop_reason` and `stop_sequence` of a finished reply that made no tool call.
    fn stop(&self, s: &Shared, c: &Completion, tokens: &[u32]) -> (&'static str, Value) {
        match c.finish_reason {
            FinishReason::Length => ("max_tokens", Value::Null),
            _ => {
                // A stop string ended it when the text without it is shorter than all the
                // tokens decode to; which one is the one found where the text ends.
                let full = s
                    .engine
                    .tokenizer()
                    .decode(tokens, true)
                    .unwrap_or_default();
                let rest = full.get(c.text.len()..).unwrap_or("");
                match self.stop.iter().find(|x| rest.starts_with(x.as_str())) {
                    Some(x) if self.script.is_none() => ("stop_sequence", json!(x)),
                    _ => ("end_turn", Value::Null),
                }
            }
        }
    }
}

async fn messages_endpoint(
    s: Shared,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    json_content_type(headers)?;
    let (raw, body) = parse_body(body)?;
    let mut opts = options(&body)?;
    let engine = s.engine.clone();
    let state = s.clone();
    let (prompt, marks, tools, constraint) = tokio::task::spawn_blocking(move || {
        let t = translate(&body, &raw, &state.tool_inputs)?;
        // tool_choice any / tool: forced calls by constrained decoding, as in the OpenAI API.
        let shape = openai::reply_shape(&t.chat, engine.tokenizer())?;
        let (prompt, marks) = render(engine.tokenizer(), &t)?;
        let constraint = match &shape.grammar {
            Some((param, grammar)) => Some(state.constraint(param, grammar)?),
            None => None,
        };
        Ok::<_, ApiError>((prompt, marks, shape.parsing, constraint))
    })
    .await
    .map_err(|e| ApiError::internal(format!("building the prompt failed: {e}")))??;
    opts.params.constraint = constraint;
    opts.params.max_tokens = token_budget(&s, prompt.len(), opts.max_tokens)?;
    if let Some(kv) = s.engine.kv_tiers() {
        for &(at, ttl) in &marks {
            kv.pin_prefix(None, &prompt[..at], ttl.duration(), ttl == Ttl::OneHour)?;
        }
    }
    let stop = opts.params.stop.clone();
    let handle = s.engine.submit(Request {
        prompt,
        params: opts.params,
        cache_salt: None,
    })?;
    let reply = Reply {
        id: format!("msg_{:024x}", handle.id()),
        model: opts.model.unwrap_or_default(),
        tools,
        stop,
        marks,
        nonce: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
        script: s.script.clone(),
    };
    if opts.stream {
        Ok(stream(s, handle, reply).into_response())
    } else {
        whole(s, handle, reply).await
    }
}

/// A content block of a tool call.
fn tool_use(id: String, name: &str, arguments: &str) -> Value {
    let input: Value = serde_json::from_str(arguments).unwrap_or_else(|_| json!({}));
    json!({"type": "tool_use", "id": id, "name": name, "input": input})
}

async fn whole(s: Shared, mut handle: RequestHandle, reply: Reply) -> Result<Response, ApiError> {
    let mut tokens = Vec::new();
    while let Some(e) = handle.recv().await {
        match e {
            Event::Token { sampled, .. } => tokens.push(sampled.token),
            Event::Finished(c) if c.finish_reason == FinishReason::Cancelled => {
                return Err(cut_off(&s, &c));
            }
            Event::Finished(c) => {
                let text = match &reply.script {
                    Some(pieces) => pieces.concat(),
                    None => c.text.clone(),
                };
                let mut content = Vec::new();
                let (mut reason, mut sequence) = reply.stop(&s, &c, &tokens);
                let parsed = reply
                    .tools
                    .as_ref()
                    .map(|t| tool_calls::parse(t.format, &t.names, &text));
                match parsed {
                    Some(p) if !p.calls.is_empty() => {
                        if let Some(t) = p.content.filter(|t| !t.is_empty()) {
                            content.push(json!({"type": "text", "text": t}));
                        }
                        for (i, call) in p.calls.iter().enumerate() {
                            let id = reply.tool_id(i);
                            s.tool_inputs.remember(&id, &call.arguments);
                            content.push(tool_use(id, &call.name, &call.arguments));
                        }
                        (reason, sequence) = ("tool_use", Value::Null);
                    }
                    _ if !text.is_empty() => content.push(json!({"type": "text", "text": text})),
                    _ => {}
                }
                return Ok(Json(json!({
                    "id": reply.id,
                    "type": "message",
                    "role": "assistant",
                    "model": reply.model,
                    "content": content,
                    "stop_reason": reason,
                    "stop_sequence": sequence,
                    "usage": usage(c.prompt_tokens, c.cached_tokens, &reply.marks, c.completion_tokens),
                }))
                .into_response());
            }
            Event::Failed(e) => return Err(e.into()),
            _ => {}
        }
    }
    Err(crate::EngineError::EngineStopped.into())
}

struct StreamState {
    s: Shared,
    handle: Option<RequestHandle>,
    reply: Reply,
    out: VecDeque<SseEvent>,
    calls: Option<CallStream>,
    calls_sent: usize,
    /// Index the next content block gets.
    next_block: usize,
    /// Whether a text block is open (tool_use blocks open and close at once).
    text_open: bool,
    tokens: Vec<u32>,
    script: Option<VecDeque<String>>,
}

impl StreamState {
    fn push(&mut self, name: &'static str, data: Value) {
        self.out
            .push_back(SseEvent::default().event(name).data(data.to_string()));
    }

    fn close(&mut self) {
        if std::mem::take(&mut self.text_open) {
            let index = self.next_block - 1;
            self.push(
                "content_block_stop",
                json!({"type": "content_block_stop", "index": index}),
            );
        }
    }

    fn emit(&mut self, pieces: Vec<Piece>) {
        for p in pieces {
            match p {
                Piece::Text(t) if t.is_empty() => {}
                Piece::Text(t) => {
                    if !self.text_open {
                        let index = self.next_block;
                        self.next_block += 1;
                        self.text_open = true;
                        self.push(
                            "content_block_start",
                            json!({"type": "content_block_start", "index": index,
                                "content_block": {"type": "text", "text": ""}}),
                        );
                    }
                    let index = self.next_block - 1;
                    self.push(
                        "content_block_delta",
                        json!({"type": "content_block_delta", "index": index,
                            "delta": {"type": "text_delta", "text": t}}),
                    );
                }
                Piece::Call(c) => {
                    self.close();
                    let id = self.reply.tool_id(self.calls_sent);
                    self.calls_sent += 1;
                    self.s.tool_inputs.remember(&id, &c.arguments);
                    let index = self.next_block;
                    self.next_block += 1;
                    self.push(
                        "content_block_start",
                        json!({"type": "content_block_start", "index": index,
                            "content_block": {"type": "tool_use", "id": id, "name": c.name, "input": {}}}),
                    );
                    self.push(
                        "content_block_delta",
                        json!({"type": "content_block_delta", "index": index,
                            "delta": {"type": "input_json_delta", "partial_json": c.arguments}}),
                    );
                    self.push(
                        "content_block_stop",
                        json!({"type": "content_block_stop", "index": index}),
                    );
                }
            }
        }
    }

    fn pieces(&mut self, text: &str) -> Vec<Piece> {
        match &mut self.calls {
            Some(p) => p.push(text),
            None => vec![Piece::Text(text.to_string())],
        }
    }

    fn fail(&mut self, e: ApiError) {
        self.out.push_back(error_event(&e));
    }

    /// Turns one engine event into SSE events; false once the stream is over.
    fn on(&mut self, e: Option<Event>) -> bool {
        match e {
            Some(Event::Started {
                prompt_tokens,
                cached_tokens,
            }) => {
                let mut u = usage(prompt_tokens, cached_tokens, &self.reply.marks, 0);
                u["output_tokens"] = json!(1);
                self.push(
                    "message_start",
                    json!({"type": "message_start", "message": {
                        "id": self.reply.id, "type": "message", "role": "assistant",
                        "model": self.reply.model, "content": [], "stop_reason": null,
                        "stop_sequence": null, "usage": u}}),
                );
                self.push("ping", json!({"type": "ping"}));
                true
            }
            Some(Event::Token { sampled, text }) => {
                self.tokens.push(sampled.token);
                let text = match &mut self.script {
                    Some(script) => script.pop_front().unwrap_or_default(),
                    None => text,
                };
                if !text.is_empty() {
                    let pieces = self.pieces(&text);
                    self.emit(pieces);
                }
                true
            }
            Some(Event::Finished(c)) if c.finish_reason == FinishReason::Cancelled => {
                let e = cut_off(&self.s, &c);
                self.fail(e);
                false
            }
            Some(Event::Finished(c)) => {
                let rest: String = self
                    .script
                    .take()
                    .map(|s| s.into_iter().collect())
                    .unwrap_or_default();
                let mut pieces = self.pieces(&rest);
                if let Some(p) = &mut self.calls {
                    pieces.extend(p.finish());
                }
                self.emit(pieces);
                self.close();
                let (reason, sequence) = if self.calls_sent > 0 {
                    ("tool_use", Value::Null)
                } else {
                    self.reply.stop(&self.s, &c, &self.tokens)
                };
                let u = usage(
                    c.prompt_tokens,
                    c.cached_tokens,
                    &self.reply.marks,
                    c.completion_tokens,
                );
                self.push(
                    "message_delta",
                    json!({"type": "message_delta",
                        "delta": {"stop_reason": reason, "stop_sequence": sequence},
                        "usage": u}),
                );
                self.push("message_stop", json!({"type": "message_stop"}));
                false
            }
            e @ (Some(Event::Failed(_)) | None) => {
                self.fail(stream_failure(e));
                false
            }
        }
    }
}

/// The Messages event stream of a request. Dropping it (the client went away) drops the
/// handle, which cancels the request.
fn stream(
    s: Shared,
    handle: RequestHandle,
    reply: Reply,
) -> Sse<impl futures_util::Stream<Item = Result<SseEvent, Infallible>>> {
    let (calls, script) = stream_parsers(reply.tools.as_ref(), reply.script.as_ref());
    sse(StreamState {
        s,
        handle: Some(handle),
        reply,
        out: VecDeque::new(),
        calls,
        calls_sent: 0,
        next_block: 0,
        text_open: false,
        tokens: Vec::new(),
        script,
    })
}

impl EventStream for StreamState {
    fn out(&mut self) -> &mut VecDeque<SseEvent> {
        &mut self.out
    }

    fn handle(&mut self) -> &mut Option<RequestHandle> {
        &mut self.handle
    }

    fn on(&mut self, e: Option<Event>) -> bool {
        StreamState::on(self, e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::server::openai::tests::tokenizer;

    fn tr(body: &Value) -> Result<Translated, ApiError> {
        translate(
            body.as_object().unwrap(),
            &body.to_string(),
            &ToolInputs::default(),
        )
    }

    #[test]
    fn usage_adds_up_to_the_prompt() {
        let marks = [(40, Ttl::OneHour), (100, Ttl::FiveMinutes)];
        // Cold: everything up to the last breakpoint is written, the rest is input.
        let u = usage(120, 0, &marks, 7);
        assert_eq!(u["cache_read_input_tokens"], 0);
        assert_eq!(u["cache_creation_input_tokens"], 100);
        assert_eq!(u["cache_creation"]["ephemeral_1h_input_tokens"], 40);
        assert_eq!(u["cache_creation"]["ephemeral_5m_input_tokens"], 60);
        assert_eq!(u["input_tokens"], 20);
        assert_eq!(u["output_tokens"], 7);
        // Warm past the first breakpoint.
        let u = usage(120, 64, &marks, 1);
        assert_eq!(u["cache_read_input_tokens"], 64);
        assert_eq!(u["cache_creation_input_tokens"], 36);
        assert_eq!(u["cache_creation"]["ephemeral_1h_input_tokens"], 0);
        assert_eq!(u["input_tokens"], 20);
        // Read past every breakpoint: nothing created.
        let u = usage(120, 112, &marks, 1);
        assert_eq!(u["cache_creation_input_tokens"], 0);
        assert_eq!(u["input_tokens"], 8);
        // No breakpoints: what was read, and the rest.
        let u = usage(50, 16, &[], 1);
        assert_eq!(
            (
                u["input_tokens"].as_u64(),
                u["cache_read_input_tokens"].as_u64()
            ),
            (Some(34), Some(16))
        );
    }

    #[test]
    fn tool_turns_render_as_the_openai_path_renders_them() {
        let tok = tokenizer("tiny-qwen3");
        let tools_a = json!([{"name": "get_weather", "description": "Weather.",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]);
        let tools_o = json!([{"type": "function", "function": {"name": "get_weather",
            "description": "Weather.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
        let args = r#"{"city": "Paris"}"#;
        let anthropic = json!({"model": "m", "max_tokens": 4, "system": "Use tools.",
            "tools": tools_a, "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"}]},
        ]});
        let openai = json!({"tools": tools_o, "messages": [
            {"role": "system", "content": "Use tools."},
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "Checking.", "tool_calls": [{"id": "toolu_1",
                "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C"},
        ]});
        let inputs = ToolInputs::default();
        inputs.remember("toolu_1", args);
        let t = translate(
            anthropic.as_object().unwrap(),
            &anthropic.to_string(),
            &inputs,
        )
        .unwrap();
        let (a, _) = render(&tok, &t).unwrap();
        // The text keeps each tool's keys in the order an OpenAI client sends them.
        let raw = openai
            .to_string()
            .replace(
                r#"{"function":{"description":"Weather.","name":"get_weather","#,
                r#"{"type":"function","function":{"name":"get_weather","description":"Weather.","#,
            )
            .replace(r#"}},"type":"function"}]"#, r#"}}}]"#);
        let b = openai::chat_prompt(&tok, openai.as_object().unwrap(), &raw).unwrap();
        assert_eq!(
            tok.decode(&a, false).unwrap(),
            tok.decode(&b, false).unwrap()
        );
        assert_eq!(a, b);
    }

    #[test]
    fn a_breakpoint_ends_where_its_block_ends_in_the_prompt() {
        let tok = tokenizer("tiny-qwen3");
        let body = json!({"model": "m", "max_tokens": 4,
        "system": [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "A long shared document.",
                "cache_control": {"type": "ephemeral"}}, {"type": "text", "text": " Question?"}]},
        ]});
        let t = tr(&body).unwrap();
        let (prompt, marks) = render(&tok, &t).unwrap();
        assert_eq!(marks.len(), 2);
        assert_eq!(marks[0].1, Ttl::OneHour);
        assert_eq!(marks[1].1, Ttl::FiveMinutes);
        let text = |n: usize| tok.decode(&prompt[..n], false).unwrap();
        assert!(
            text(marks[0].0).contains("You are terse."),
            "{}",
            text(marks[0].0)
        );
        assert!(!text(marks[0].0).contains("document"));
        assert!(
            text(marks[1].0).ends_with("A long shared document."),
            "{}",
            text(marks[1].0)
        );
        assert!(marks[1].0 < prompt.len());

        // Top-level: the whole conversation, up to the generation prompt.
        let mut top = body.clone();
        top["cache_control"] = json!({"type": "ephemeral"});
        let (prompt, marks) = render(&tok, &tr(&top).unwrap()).unwrap();
        let last = marks.last().unwrap().0;
        let (before, after) = (
            text_of(&tok, &prompt[..last]),
            text_of(&tok, &prompt[last..]),
        );
        assert!(before.ends_with("Question?<|im_end|>\n"), "{before}");
        assert_eq!(after, "<|im_start|>assistant\n");
    }

    fn text_of(tok: &Tokenizer, ids: &[u32]) -> String {
        tok.decode(ids, false).unwrap()
    }

    #[test]
    fn bad_input_is_refused_with_the_field_named() {
        let base = |extra: Value| {
            let mut b = json!({"model": "m", "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}]});
            for (k, v) in extra.as_object().unwrap() {
                b[k] = v.clone();
            }
            b
        };
        let tool = json!({"name": "f", "input_schema": {"type": "object"}});
        let cases = [
            (
                json!({"tools": [tool], "tool_choice": {"type": "tool", "name": "g"}}),
                "tool_choice",
                "not in tools",
            ),
            (
                json!({"tools": [{"name": "f", "input_schema": {"type": "string"}}]}),
                "tools",
                "input_schema",
            ),
            (json!({"tools": [{"name": "f"}]}), "tools", "input_schema"),
            (
                json!({"tools": [{"name": "bad name!", "input_schema": {"type": "object"}}]}),
                "tools",
                "name",
            ),
            (json!({"tools": [tool, tool]}), "tools", "defined twice"),
            (
                json!({"tools": vec![json!({"name": "x", "input_schema": {"type": "object"}}); MAX_TOOLS + 1]}),
                "tools",
                "more than",
            ),
            (
                json!({"tools": [{"name": "f", "description": "x".repeat(MAX_TOOLS_BYTES), "input_schema": {"type": "object"}}]}),
                "tools",
                "bytes",
            ),
            (
                json!({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}),
                "tools",
                "server tools",
            ),
            (
                json!({"tool_choice": {"type": "any"}}),
                "tool_choice",
                "needs tools",
            ),
            (
                json!({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}]}]}),
                "messages",
                "answers no tool_use",
            ),
            (
                json!({"messages": [{"role": "user", "content": 7}]}),
                "messages",
                "not a number",
            ),
            (
                json!({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}),
                "messages",
                "not supported",
            ),
            (
                json!({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]}),
                "messages",
                "cannot be in a user message",
            ),
            (
                json!({"messages": [{"role": "tool", "content": "x"}]}),
                "messages",
                "role",
            ),
            (json!({"messages": []}), "messages", "empty"),
            (json!({"system": 3}), "system", "not a number"),
            (
                json!({"system": [{"type": "text", "text": "x", "cache_control": {"type": "persistent"}}]}),
                "cache_control",
                "ephemeral",
            ),
            (
                json!({"system": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "2h"}}]}),
                "cache_control",
                "ttl",
            ),
        ];
        for (extra, param, says) in cases {
            let body = base(extra.clone());
            let e = match tr(&body) {
                Err(e) => e,
                Ok(_) => panic!("accepted: {extra}"),
            };
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{extra}");
            assert_eq!(e.param, Some(param), "{extra}: {}", e.message);
            assert!(e.message.contains(says), "{extra}: {}", e.message);
        }
        // Options: max_tokens required, Anthropic's temperature range, stop_sequences.
        for (extra, param) in [
            (json!({"max_tokens": null}), "max_tokens"),
            (json!({"temperature": 1.5}), "temperature"),
            (json!({"stop_sequences": "x"}), "stop_sequences"),
            (json!({"stop_sequences": vec!["x"; 17]}), "stop_sequences"),
            (json!({"model": null}), "model"),
        ] {
            let body = base(extra.clone());
            let e = options(body.as_object().unwrap()).unwrap_err();
            assert_eq!(e.param, Some(param), "{extra}: {}", e.message);
        }
        let five =
            vec![json!({"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}); 5];
        let e = tr(&base(
            json!({"messages": [{"role": "user", "content": five}]}),
        ))
        .err()
        .unwrap();
        assert_eq!(e.param, Some("cache_control"));
    }

    #[test]
    fn a_final_assistant_message_is_continued() {
        let tok = tokenizer("tiny-qwen3");
        let ask = json!({"model": "m", "max_tokens": 4,
            "messages": [{"role": "user", "content": "Pick a letter."}]});
        let mut prefilled = ask.clone();
        prefilled["messages"]
            .as_array_mut()
            .unwrap()
            .push(json!({"role": "assistant", "content": "The letter is"}));
        let (a, _) = render(&tok, &tr(&ask).unwrap()).unwrap();
        let (b, _) = render(&tok, &tr(&prefilled).unwrap()).unwrap();
        assert_eq!(&b[..a.len()], &a[..]);
        assert_eq!(text_of(&tok, &b[a.len()..]), "The letter is");
        let mut bad_prefill = ask.clone();
        bad_prefill["messages"]
            .as_array_mut()
            .unwrap()
            .push(json!({"role": "assistant",
            "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}));
        let e = tr(&bad_prefill).err().unwrap();
        assert!(e.message.contains("takes text only"), "{}", e.message);
    }

    #[test]
    fn errors_have_anthropics_shape_and_status() {
        let cases = [
            (ApiError::param("tools", "x"), 400, "invalid_request_error"),
            (
                ApiError::new(StatusCode::UNAUTHORIZED, "invalid_request_error", "k"),
                401,
                "authentication_error",
            ),
            (
                ApiError::new(StatusCode::NOT_FOUND, "invalid_request_error", "m"),
                404,
                "not_found_error",
            ),
            (
                ApiError::unavailable("queue_full", "busy"),
                529,
                "overloaded_error",
            ),
            (ApiError::internal("boom"), 500, "api_error"),
            (
                ApiError::from(crate::EngineError::EngineStopped),
                500,
                "api_error",
            ),
        ];
        for (e, status, kind) in cases {
            let r = error_response(e);
            assert_eq!(r.status().as_u16(), status);
            if status == 529 {
                assert!(r.headers().contains_key(axum::http::header::RETRY_AFTER));
            }
            let body =
                futures_util::FutureExt::now_or_never(axum::body::to_bytes(r.into_body(), 1 << 20))
                    .unwrap()
                    .unwrap();
            let v: Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(v["type"], "error");
            assert_eq!(v["error"]["type"], kind);
            assert!(v["error"]["message"].is_string());
        }
    }
}
