//! One generation loop: `kvstore generate` runs the engine `serve` runs. The same greedy
//! request through the CLI and through an in-process [`Engine`] opened as `serve` opens it
//! ends alike (tokens, text, finish reason) at a stop string, EOS, `max_tokens` and the
//! context limit; and a CLI run shows up as engine steps in the engine's step log.

use std::path::Path;

use engine::{
    load, Engine, EngineConfig, FinishReason, GenerateParams, KvTiers, LoadOptions, Request,
    ReuseConfig,
};
use kvstore_tests::{generate_json, smollm2, tiny_model};
use serde_json::Value;
use store::StoreConfig;

/// `kvstore generate --json` of a user message, greedy, with a fresh store.
fn cli(model: &Path, message: &str, extra: &[&str]) -> Value {
    let store = tempfile::tempdir().unwrap();
    let mut args = vec!["--prompt", message];
    args.extend(extra);
    generate_json(model, store.path(), &args)
}

/// What `serve`'s engine gives for the same message: an engine over tiers in a fresh
/// store, with serve's default settings, the request submitted as the server submits it.
struct Served {
    tokens: Vec<u32>,
    text: String,
    finish: FinishReason,
    prompt_tokens: usize,
}

fn served(model: &Path, message: &str, params: GenerateParams) -> Served {
    let store = tempfile::tempdir().unwrap();
    let (model, tok) = load(model, &LoadOptions::default()).unwrap();
    let reuse = ReuseConfig {
        store: StoreConfig::default().root(store.path()),
        ..ReuseConfig::default()
    };
    let tiers = KvTiers::open(&model, &tok, reuse).unwrap();
    let engine = Engine::open(model, tok, Some(tiers), EngineConfig::default()).unwrap();
    let messages = serde_json::json!([{"role": "user", "content": message}]).to_string();
    let prompt = engine
        .tokenizer()
        .encode_chat(&messages, None, true)
        .unwrap();
    let prompt_tokens = prompt.len();
    let done = engine
        .submit(Request::new(prompt, params))
        .unwrap()
        .wait()
        .unwrap();
    engine.shutdown(false).unwrap();
    Served {
        tokens: done.tokens,
        text: done.text,
        finish: done.finish_reason,
        prompt_tokens,
    }
}

fn greedy(max_tokens: usize, stop: &[&str]) -> GenerateParams {
    GenerateParams {
        max_tokens,
        stop: stop.iter().map(|s| s.to_string()).collect(),
        ..GenerateParams::default()
    }
}

/// Asserts the CLI's output is the engine's, and returns the finish reason both gave.
fn same(cli: &Value, engine: &Served) -> String {
    let tokens: Vec<u32> = serde_json::from_value(cli["tokens"].clone()).unwrap();
    assert_eq!(tokens, engine.tokens, "CLI {cli}");
    assert_eq!(cli["text"], engine.text.as_str(), "CLI {cli}");
    let finish = serde_json::to_value(engine.finish).unwrap();
    assert_eq!(cli["finish_reason"], finish, "CLI {cli}");
    assert_eq!(cli["prompt_tokens"], engine.prompt_tokens);
    finish.as_str().unwrap().to_string()
}

const MESSAGE: &str = "Summarize the plot of a long novel about a lighthouse keeper.";

#[test]
fn the_cli_and_the_engine_end_alike_at_max_tokens() {
    let model = tiny_model("tiny-qwen3");
    let engine = served(&model, MESSAGE, greedy(7, &[]));
    let cli = cli(&model, MESSAGE, &["--max-tokens", "7"]);
    assert_eq!(same(&cli, &engine), "length");
    assert_eq!(engine.tokens.len(), 7);
}

#[test]
fn the_cli_and_the_engine_end_alike_at_a_stop_string() {
    let model = tiny_model("tiny-qwen3");
    // A stop string taken from the middle of what the model says unstopped.
    let free = served(&model, MESSAGE, greedy(24, &[]));
    let chars: Vec<char> = free.text.chars().collect();
    assert!(chars.len() >= 12, "too little text to cut: {:?}", free.text);
    let stop: String = chars[8..11].iter().collect();
    let engine = served(&model, MESSAGE, greedy(24, &[&stop]));
    let cli = cli(&model, MESSAGE, &["--max-tokens", "24", "--stop", &stop]);
    assert_eq!(same(&cli, &engine), "stop");
    assert!(!engine.text.contains(&stop), "{:?}", engine.text);
    assert!(engine.tokens.len() < 24);
}

#[test]
fn the_cli_and_the_engine_end_alike_at_the_context_limit() {
    // tiny-qwen3's context is 512 tokens: a long prompt leaves room for a few.
    let model = tiny_model("tiny-qwen3");
    let message = "the lighthouse keeper watched the storm ".repeat(14);
    let engine = served(&model, &message, greedy(200, &[]));
    assert!(
        (400..500).contains(&engine.prompt_tokens),
        "prompt of {} tokens",
        engine.prompt_tokens
    );
    let cli = cli(&model, &message, &["--max-tokens", "200"]);
    assert_eq!(same(&cli, &engine), "length");
    assert_eq!(engine.prompt_tokens + engine.tokens.len(), 512);
}

#[test]
fn the_cli_and_the_engine_end_alike_at_eos() {
    let model = smollm2();
    let message = "What is 2 + 2? Answer with the number only.";
    let engine = served(&model, message, greedy(48, &[]));
    let cli = cli(&model, message, &["--max-tokens", "48"]);
    assert_eq!(same(&cli, &engine), "stop");
    let (_, tok) = load(&model, &LoadOptions::default()).unwrap();
    let last = *engine.tokens.last().unwrap();
    assert!(tok.eos_ids().contains(&last), "ended at {last}, not EOS");
}

#[test]
fn a_cli_generate_runs_as_engine_steps() {
    let model = tiny_model("tiny-qwen3");
    let out = cli(
        &model,
        MESSAGE,
        &["--max-tokens", "6", "--no-cache", "--step-log"],
    );
    let steps = out["engine_steps"].as_array().unwrap();
    let prompt = out["prompt_tokens"].as_u64().unwrap();
    let prefilled: u64 = steps
        .iter()
        .filter_map(|s| s["prefilled"].as_array())
        .map(|p| p[1].as_u64().unwrap())
        .sum();
    assert_eq!(
        prefilled, prompt,
        "every prompt token prefilled by the engine: {out}"
    );
    let decoded: Vec<&Value> = steps
        .iter()
        .filter(|s| !s["decoded"].as_array().unwrap().is_empty())
        .collect();
    // The first token comes from the prefill; each later one from a batched decode step
    // (of one row, the request's), and no step runs past the last.
    assert_eq!(out["finish_reason"], "length");
    assert_eq!(decoded.len(), 6 - 1, "{steps:?}");
    let id = &decoded[0]["decoded"][0];
    for s in &decoded {
        assert_eq!(s["decoded"], serde_json::json!([id]), "{s}");
    }
    let first_decode = steps
        .iter()
        .position(|s| !s["decoded"].as_array().unwrap().is_empty());
    let last_prefill = steps.iter().rposition(|s| !s["prefilled"].is_null());
    assert!(last_prefill < first_decode, "{steps:?}");
}
