//! The Anthropic Messages API over HTTP (tiny qwen3 model, temp store): response and event
//! shapes, tool_use blocks, cache usage and pins, stop reasons, errors and x-api-key; and
//! OpenAI's per-request cache controls (`prompt_cache_key`, `prompt_cache_retention`).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use engine::EngineConfig;
use serde_json::{json, Value};

use crate::server::{scripted_server, Response, Server, MODEL, SCRIPTED_CALL};

/// A system prompt several blocks long, so a breakpoint after it covers whole blocks.
const SYSTEM: &str = "You are a careful assistant. Answer in one short line, cite nothing, \
     and never repeat the question back to the user.";

fn message(user: &str, max_tokens: usize) -> Value {
    json!({
        "model": "claude-any-name",
        "max_tokens": max_tokens,
        "temperature": 0,
        "system": [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": user}],
    })
}

/// `(event name, data)` of an SSE body.
fn sse(r: &Response) -> Vec<(String, Value)> {
    let mut out = Vec::new();
    let mut name = String::new();
    for line in r.body.lines() {
        if let Some(n) = line.strip_prefix("event: ") {
            name = n.to_string();
        } else if let Some(d) = line.strip_prefix("data: ") {
            out.push((std::mem::take(&mut name), serde_json::from_str(d).unwrap()));
        }
    }
    out
}

fn usage_total(u: &Value) -> u64 {
    [
        "input_tokens",
        "cache_creation_input_tokens",
        "cache_read_input_tokens",
    ]
    .iter()
    .map(|k| {
        u[k].as_u64()
            .unwrap_or_else(|| panic!("usage.{k} missing: {u}"))
    })
    .sum()
}

fn count_tokens(srv: &Server, body: &Value) -> u64 {
    let r = srv.post("/v1/messages/count_tokens", body);
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()["input_tokens"].as_u64().unwrap()
}

#[test]
fn a_message_has_anthropics_shape_and_its_usage_adds_up() {
    let srv = Server::start(None, EngineConfig::default());
    let body = message("Name a colour.", 6);
    let r = srv.post("/v1/messages", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["type"], "message");
    assert_eq!(v["role"], "assistant");
    assert_eq!(v["model"], "claude-any-name");
    assert!(v["id"].as_str().unwrap().starts_with("msg_"));
    assert!(["end_turn", "max_tokens"].contains(&v["stop_reason"].as_str().unwrap()));
    for b in v["content"].as_array().unwrap() {
        assert_eq!(b["type"], "text", "{v}");
    }
    let u = &v["usage"];
    assert_eq!(usage_total(u), count_tokens(&srv, &body), "{u}");
    assert_eq!(u["cache_read_input_tokens"], 0, "{u}");
    assert!(
        u["cache_creation_input_tokens"].as_u64().unwrap() > 0,
        "{u}"
    );
    assert_eq!(
        u["cache_creation"]["ephemeral_5m_input_tokens"],
        u["cache_creation_input_tokens"]
    );
    assert!(u["output_tokens"].as_u64().unwrap() >= 1);

    // Within the TTL, another question after the same system prompt reads the breakpoint's
    // tokens from the cache and writes nothing.
    let r = srv.post("/v1/messages", &message("Name a number.", 4));
    let u = &r.json()["usage"];
    let created = v["usage"]["cache_creation_input_tokens"].as_u64().unwrap();
    assert!(
        u["cache_read_input_tokens"].as_u64().unwrap() >= created,
        "the breakpoint's {created} tokens were not read back: {u}"
    );
    assert_eq!(u["cache_creation_input_tokens"], 0, "{u}");

    // The breakpoint's blocks are pinned, and /v1/cache shows where.
    let c = srv.request("GET", "/v1/cache", None, "").json();
    let pinned = &c["pinned"];
    assert!(pinned["keys"].as_u64().unwrap() >= 1, "{c}");
    assert!(
        pinned["device_bytes"].as_u64().unwrap() + pinned["ram_bytes"].as_u64().unwrap() > 0,
        "{c}"
    );
}

#[test]
fn a_stream_sends_the_documented_events_in_order() {
    let srv = Server::start(None, EngineConfig::default());
    let mut body = message("Say something.", 6);
    body["stream"] = json!(true);
    let r = srv.post("/v1/messages", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let events = sse(&r);
    for (name, data) in &events {
        assert_eq!(data["type"], name.as_str(), "event name and type differ");
    }
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(&names[..2], ["message_start", "ping"], "{names:?}");
    assert_eq!(
        &names[names.len() - 2..],
        ["message_delta", "message_stop"],
        "{names:?}"
    );
    let start = &events[0].1["message"];
    assert_eq!(start["role"], "assistant");
    assert_eq!(start["content"], json!([]));
    assert!(start["stop_reason"].is_null());
    // Blocks: start, deltas, stop, indexes counting up from 0.
    let mut open: Option<u64> = None;
    let mut next = 0;
    let mut text = String::new();
    for (name, d) in &events[2..events.len() - 2] {
        match name.as_str() {
            "content_block_start" => {
                assert!(open.is_none(), "a block started inside another");
                assert_eq!(d["index"], next);
                open = Some(next);
                next += 1;
            }
            "content_block_delta" => {
                assert_eq!(d["index"].as_u64(), open);
                text.push_str(d["delta"]["text"].as_str().unwrap());
            }
            "content_block_stop" => {
                assert_eq!(d["index"].as_u64(), open);
                open = None;
            }
            other => panic!("unexpected event {other} inside the message"),
        }
    }
    assert!(open.is_none(), "a block was never stopped");
    let delta = &events[events.len() - 2].1;
    assert!(["end_turn", "max_tokens"].contains(&delta["delta"]["stop_reason"].as_str().unwrap()));
    assert_eq!(
        usage_total(&delta["usage"]),
        usage_total(&start["usage"]),
        "message_start and message_delta disagree on the prompt"
    );

    // The same request whole says the same.
    body["stream"] = json!(false);
    let whole = srv.post("/v1/messages", &body).json();
    let whole_text: String = whole["content"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|b| b["text"].as_str())
        .collect();
    assert_eq!(whole_text, text);
}

#[test]
fn max_tokens_and_stop_sequences_set_the_stop_reason() {
    let srv = Server::start(None, EngineConfig::default());
    let body = json!({"model": MODEL, "max_tokens": 12, "temperature": 0,
        "messages": [{"role": "user", "content": "Count with me: one two three"}]});
    let v = srv.post("/v1/messages", &body).json();
    let text = v["content"][0]["text"].as_str().unwrap_or("").to_string();
    if v["stop_reason"] == "max_tokens" {
        assert_eq!(v["usage"]["output_tokens"], 12);
    }
    // A stop sequence taken from the greedy reply ends the same reply there.
    let chars: Vec<char> = text.chars().collect();
    assert!(chars.len() >= 4, "the reply is too short to cut: {text:?}");
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
    let mut cut = body.clone();
    cut["stop_sequences"] = json!([stop]);
    let w = srv.post("/v1/messages", &cut).json();
    assert_eq!(w["stop_reason"], "stop_sequence", "{w}");
    assert_eq!(w["stop_sequence"], stop.as_str());
    let kept = w["content"][0]["text"].as_str().unwrap_or("");
    assert!(
        text.starts_with(kept) && !kept.contains(&stop),
        "{kept:?} / {text:?}"
    );
}

#[test]
fn a_tool_call_becomes_a_tool_use_block_and_its_result_renders_the_next_turn() {
    let tools = json!([{"name": "get_weather", "description": "Weather of a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]);
    let first = json!({"model": MODEL, "max_tokens": 16, "tools": tools,
        "messages": [{"role": "user", "content": "Weather in Paris?"}]});
    let srv = scripted_server(&SCRIPTED_CALL);
    let v = srv.post("/v1/messages", &first).json();
    assert_eq!(v["stop_reason"], "tool_use", "{v}");
    let content = v["content"].as_array().unwrap();
    assert_eq!(content[0], json!({"type": "text", "text": "Let me check."}));
    let call = &content[1];
    assert_eq!(call["type"], "tool_use");
    assert_eq!(call["name"], "get_weather");
    assert_eq!(call["input"], json!({"city": "Paris", "days": 2}));
    assert!(call["id"].as_str().unwrap().starts_with("toolu_"));

    // Streamed: the call is a tool_use block whose input_json_delta holds the input.
    let mut streamed = first.clone();
    streamed["stream"] = json!(true);
    let events = sse(&srv.post("/v1/messages", &streamed));
    let start = events
        .iter()
        .find(|(n, d)| n == "content_block_start" && d["content_block"]["type"] == "tool_use")
        .expect("no tool_use block");
    let index = &start.1["index"];
    let json_text: String = events
        .iter()
        .filter(|(n, d)| n == "content_block_delta" && d["index"] == *index)
        .map(|(_, d)| {
            assert_eq!(d["delta"]["type"], "input_json_delta");
            d["delta"]["partial_json"].as_str().unwrap().to_string()
        })
        .collect();
    assert_eq!(
        serde_json::from_str::<Value>(&json_text).unwrap(),
        json!({"city": "Paris", "days": 2})
    );
    let delta = events.iter().find(|(n, _)| n == "message_delta").unwrap();
    assert_eq!(delta.1["delta"]["stop_reason"], "tool_use");

    // The next turn sends the call and its result back: accepted, and its prompt is the
    // first one's plus the turn, so the first prompt is read from the cache.
    let prompt_tokens = usage_total(&v["usage"]);
    let next = json!({"model": MODEL, "max_tokens": 4, "tools": tools, "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call["id"], "content": "18 C"}]},
    ]});
    let w = srv.post("/v1/messages", &next);
    assert_eq!(w.status, 200, "{}", w.body);
    let u = &w.json()["usage"];
    assert!(
        u["cache_read_input_tokens"].as_u64().unwrap() >= prompt_tokens / 8 * 8,
        "the first turn's {prompt_tokens} prompt tokens were not reused: {u}"
    );
}

fn anthropic_error(r: &Response, status: u16, kind: &str) -> String {
    assert_eq!(r.status, status, "{}", r.body);
    let v = r.json();
    assert_eq!(v["type"], "error", "{v}");
    assert_eq!(v["error"]["type"], kind, "{v}");
    v["error"]["message"].as_str().unwrap().to_string()
}

#[test]
fn bad_input_gets_anthropics_error_shape() {
    let srv = Server::start(None, EngineConfig::default());
    let tool = json!({"name": "f", "input_schema": {"type": "object"}});
    let base =
        json!({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]});
    let with = |k: &str, v: Value| {
        let mut b = base.clone();
        b[k] = v;
        b
    };
    let mut unknown_choice = with("tool_choice", json!({"type": "tool", "name": "g"}));
    unknown_choice["tools"] = json!([tool]);
    for (body, says) in [
        (unknown_choice, "not in tools"),
        (
            with("tools", json!([{"name": "f", "input_schema": {"type": 3}}])),
            "input_schema",
        ),
        (
            with(
                "messages",
                json!([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_none", "content": "x"}]}]),
            ),
            "answers no tool_use",
        ),
        (
            with(
                "messages",
                json!([{"role": "user", "content": {"text": "x"}}]),
            ),
            "content",
        ),
        (with("max_tokens", json!(null)), "max_tokens"),
        (with("max_tokens", json!(1_000_000)), "max_tokens"),
    ] {
        let msg = anthropic_error(
            &srv.post("/v1/messages", &body),
            400,
            "invalid_request_error",
        );
        assert!(msg.contains(says), "{msg}");
    }
    let r = srv.request("POST", "/v1/messages", None, "{not json");
    anthropic_error(&r, 400, "invalid_request_error");
    let many: Vec<Value> = (0..200)
        .map(|i| json!({"name": format!("t{i}"), "input_schema": {"type": "object"}}))
        .collect();
    let r = srv.post("/v1/messages", &with("tools", json!(many)));
    anthropic_error(&r, 400, "invalid_request_error");
    let r = srv.post("/v1/messages/count_tokens", &with("system", json!(7)));
    anthropic_error(&r, 400, "invalid_request_error");
}

/// A request with `header` (name, value) instead of a bearer key.
fn with_header(srv: &Server, header: (&str, &str), body: &Value) -> Response {
    let body = body.to_string();
    let mut s = TcpStream::connect(srv.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    write!(
        s,
        "POST /v1/messages HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{}: {}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        header.0,
        header.1,
        body.len()
    )
    .unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    Response::parse(&raw)
}

#[test]
fn x_api_key_is_checked_like_a_bearer_key() {
    let srv = Server::start(Some("sk-ant"), EngineConfig::default());
    let body = message("hi", 2);
    anthropic_error(
        &srv.post("/v1/messages", &body),
        401,
        "authentication_error",
    );
    anthropic_error(
        &with_header(&srv, ("x-api-key", "sk-wrong"), &body),
        401,
        "authentication_error",
    );
    let r = with_header(&srv, ("x-api-key", "sk-ant"), &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let r = with_header(&srv, ("Authorization", "Bearer sk-ant"), &body);
    assert_eq!(r.status, 200, "{}", r.body);
}

#[test]
fn prompt_cache_retention_24h_pins_the_prompt_and_keys_are_accounted() {
    let srv = Server::start(None, EngineConfig::default());
    let chat = |user: &str, retention: Value| {
        json!({"model": MODEL, "max_tokens": 3, "prompt_cache_key": "session-1",
            "prompt_cache_retention": retention, "messages": [
                {"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]})
    };
    let r = srv.post(
        "/v1/chat/completions",
        &chat("First question?", json!("24h")),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let prompt = r.json()["usage"]["prompt_tokens"].as_u64().unwrap();
    let c = srv.request("GET", "/v1/cache", None, "").json();
    assert_eq!(c["pinned"]["keys"].as_u64().unwrap(), prompt / 8, "{c}");
    let key = &c["prompt_cache_keys"]["session-1"];
    assert_eq!(key["requests"], 1, "{c}");
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let until = key["pinned_until_unix_ms"].as_u64().unwrap();
    assert!(until > now_ms + 23 * 3600 * 1000, "{key}");

    let r = srv.post(
        "/v1/chat/completions",
        &chat("Second one?", json!("in_memory")),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached > 0);
    let c = srv.request("GET", "/v1/cache", None, "").json();
    let key = &c["prompt_cache_keys"]["session-1"];
    assert_eq!(key["requests"], 2, "{c}");
    assert_eq!(key["last_cached_tokens"].as_u64(), Some(cached));
    // in_memory pinned nothing more.
    assert_eq!(c["pinned"]["keys"].as_u64().unwrap(), prompt / 8, "{c}");

    for (field, value) in [
        ("prompt_cache_retention", json!("7d")),
        ("prompt_cache_key", json!(5)),
        ("prompt_cache_key", json!("k".repeat(300))),
    ] {
        let mut body = chat("x", json!(null));
        body[field] = value;
        let r = srv.post("/v1/chat/completions", &body);
        assert_eq!(r.status, 400, "{}", r.body);
        assert_eq!(r.json()["error"]["param"], field);
    }
}
