//! Prefixes that survive a re-rendered history (issue 17, point 5): a client that drops
//! the previous turn's reasoning or writes its tool call back differently still gets every
//! token its new prompt shares with the previous prompt and reply reused, the partial last
//! block included, and `diverged_at` says where the prompt left them. Qwen3's real chat
//! template (the tiny model's), thinking on and off, and a tool-call round trip.

use std::sync::Arc;

use engine::{load, Completion, Engine, EngineConfig, Event, GenerateParams, KvTiers};
use engine::{LoadOptions, Request, Tokenizer};
use serde_json::{json, Value};

const BLOCK: usize = 8;

struct Session {
    engine: Arc<Engine>,
    _dir: tempfile::TempDir,
}

fn session() -> Session {
    let dir = tempfile::tempdir().unwrap();
    let model_dir = crate::common::roomy_tiny_model("tiny-qwen3", dir.path());
    let (model, tok) = load(&model_dir, &LoadOptions::default()).unwrap();
    let reuse = crate::common::reuse_config(dir.path().join("store"), BLOCK);
    let prefix = KvTiers::open(&model, &tok, reuse).unwrap();
    let engine = Arc::new(Engine::open(model, tok, Some(prefix), EngineConfig::default()).unwrap());
    Session { engine, _dir: dir }
}

fn render(
    tok: &Tokenizer,
    messages: &Value,
    tools: Option<&Value>,
    extra: Option<&Value>,
) -> Vec<u32> {
    let text = tok
        .apply_chat_template(
            &messages.to_string(),
            tools.map(Value::to_string).as_deref(),
            true,
            extra.map(Value::to_string).as_deref(),
        )
        .unwrap();
    tok.encode(&text, false).unwrap()
}

/// Runs `prompt` to the end; the reply's tokens and the completion.
fn turn(s: &Session, prompt: &[u32]) -> (Vec<u32>, Completion) {
    let params = GenerateParams {
        max_tokens: 12,
        stop_at_eos: false,
        ..GenerateParams::default()
    };
    let mut h = s
        .engine
        .submit(Request::new(prompt.to_vec(), params))
        .unwrap();
    let mut reply = Vec::new();
    while let Some(e) = h.recv_blocking() {
        match e {
            Event::Token { sampled, .. } => reply.push(sampled.token),
            Event::Finished(c) => return (reply, c),
            Event::Failed(e) => panic!("{e}"),
            _ => {}
        }
    }
    panic!("no completion");
}

fn common(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// A first user message whose rendered prompt ends mid-block, so that reusing it whole
/// means reusing a partial block.
fn first_user(tok: &Tokenizer, tools: Option<&Value>, extra: Option<&Value>) -> Value {
    for pad in 0..BLOCK {
        let m = json!([{"role": "user", "content": format!("What is the capital of France{}?", "!".repeat(pad))}]);
        if render(tok, &m, tools, extra).len() % BLOCK == BLOCK / 2 {
            return m;
        }
    }
    panic!("no padding ends the prompt mid-block");
}

/// Asserts the reuse of `next` after a turn that ran `prev` and replied `reply`: exactly
/// the tokens it shares with them, and `diverged_at` there.
fn assert_reuse(c: &Completion, next: &[u32], prev: &[u32], reply: &[u32]) -> usize {
    let ran: Vec<u32> = prev.iter().chain(reply).copied().collect();
    let shared = common(next, &ran).min(next.len() - 1);
    assert_eq!(c.cached_tokens, shared, "{:?}", c.reuse);
    assert_eq!(
        c.reuse.diverged_at,
        Some(common(next, &ran)),
        "{:?}",
        c.reuse
    );
    shared
}

#[test]
fn stripped_reasoning_reuses_the_whole_previous_prompt_with_thinking_on() {
    let s = session();
    let tok = s.engine.tokenizer();
    let first = first_user(tok, None, None);
    let p1 = render(tok, &first, None, None);
    let (reply, _) = turn(&s, &p1);
    // The client sends back the answer without the reasoning the model wrote before it.
    let mut history = first.as_array().unwrap().clone();
    history.extend([
        json!({"role": "assistant", "content": "Paris."}),
        json!({"role": "user", "content": "And of Italy?"}),
    ]);
    let p2 = render(tok, &json!(history), None, None);
    assert!(
        p2.starts_with(&p1),
        "Qwen3 renders the stripped turn after the old prompt"
    );
    let (_, c) = turn(&s, &p2);
    let shared = assert_reuse(&c, &p2, &p1, &reply);
    assert!(shared >= p1.len(), "{shared} < {}", p1.len());
    assert_ne!(p1.len() % BLOCK, 0, "the partial block is part of it");
}

#[test]
fn thinking_off_reuses_up_to_where_the_template_drops_the_empty_think_block() {
    let s = session();
    let tok = s.engine.tokenizer();
    let off = json!({"enable_thinking": false});
    let first = first_user(tok, None, Some(&off));
    let p1 = render(tok, &first, None, Some(&off));
    let (reply, _) = turn(&s, &p1);
    let mut history = first.as_array().unwrap().clone();
    history.extend([
        json!({"role": "assistant", "content": "Paris."}),
        json!({"role": "user", "content": "And of Italy?"}),
    ]);
    let p2 = render(tok, &json!(history), None, Some(&off));
    // The generation prompt ended with an empty <think></think>; the history's assistant
    // turn has none: the new prompt leaves the old one inside it.
    let drift = common(&p1, &p2);
    assert!(drift < p1.len());
    let text = tok.decode(&p1[drift..], false).unwrap();
    assert!(text.starts_with("<think>"), "{text:?}");
    let (_, c) = turn(&s, &p2);
    assert_eq!(assert_reuse(&c, &p2, &p1, &reply), drift);
}

#[test]
fn a_tool_call_round_trip_reuses_the_prompt_and_survives_a_re_rendered_call() {
    let s = session();
    let tok = s.engine.tokenizer();
    let tools = json!([{"type": "function", "function": {"name": "capital",
        "parameters": {"type": "object", "properties": {"country": {"type": "string"}}}}}]);
    let first = first_user(tok, Some(&tools), None);
    let p1 = render(tok, &first, Some(&tools), None);
    let (reply1, _) = turn(&s, &p1);
    let call = |args: &str, reasoning: Option<&str>| {
        let mut m = json!({"role": "assistant", "content": "", "tool_calls": [{"id": "c1",
            "type": "function", "function": {"name": "capital", "arguments": args}}]});
        if let Some(r) = reasoning {
            m["reasoning_content"] = json!(r);
        }
        m
    };
    let result = json!({"role": "tool", "tool_call_id": "c1", "content": "Paris"});
    // Turn 2: the call comes back with the model's reasoning.
    let mut h2 = first.as_array().unwrap().clone();
    h2.extend([
        call(r#"{"country": "France"}"#, Some("I should look it up.")),
        result.clone(),
    ]);
    let p2 = render(tok, &json!(h2), Some(&tools), None);
    assert!(p2.starts_with(&p1));
    let (reply2, c2) = turn(&s, &p2);
    assert!(assert_reuse(&c2, &p2, &p1, &reply1) >= p1.len());
    // Turn 3: the same history, re-rendered by a client that drops the reasoning and writes
    // the arguments compactly: reuse runs to where the text changed, past the old prompt.
    let mut h3 = first.as_array().unwrap().clone();
    h3.extend([call(r#"{"country":"France"}"#, None), result]);
    let p3 = render(tok, &json!(h3), Some(&tools), None);
    let (_, c3) = turn(&s, &p3);
    let shared = c3.cached_tokens;
    assert!(shared >= p1.len(), "{shared} < {}", p1.len());
    let ran2: Vec<u32> = p2.iter().chain(&reply2).copied().collect();
    assert_eq!(
        shared,
        common(&p3, &ran2).max(common(&p3, &p1)).min(p3.len() - 1)
    );
}
