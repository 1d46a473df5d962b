//! `kvstore serve` as a separate process: the official `openai` Python client (from the
//! venv that scripts/setup.sh makes) drives a multi-turn streaming chat, then a graceful
//! SIGTERM; a forced tool loop with a `json_schema` answer and bad input; the OpenAI Agents
//! SDK runs a 3-tool agent; and a bounded load test of 64 concurrent streams.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use kvstore_tests::serve::{files, gauge, Serve};
use kvstore_tests::tiny_model;
use serde_json::Value;

fn python() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.venv-test/bin/python");
    assert!(
        p.is_file(),
        "{} is missing: run `bash scripts/setup.sh` (it makes .venv-test with the openai client)",
        p.display()
    );
    p
}

#[test]
fn the_openai_client_streams_a_multi_turn_chat_with_cached_tokens_from_turn_two() {
    let store = tempfile::tempdir().unwrap();
    let mut server = start(store.path(), &[]);
    let turns = python_lines("openai_chat.py", server.port, &["tiny-qwen3", "3"]);
    assert_eq!(turns.len(), 3);
    for (i, t) in turns.iter().enumerate() {
        assert!(
            t["chunks"].as_u64().unwrap() >= 2,
            "turn {}: text did not arrive incrementally: {t}",
            i + 1
        );
        assert!(
            t["prompt_tokens"].as_u64().unwrap() > 0,
            "turn {}: no usage: {t}",
            i + 1
        );
    }
    assert_eq!(turns[0]["cached_tokens"], 0);
    for t in &turns[1..] {
        assert!(
            t["cached_tokens"].as_u64().unwrap() > 0,
            "no cached tokens after turn 1: {t}"
        );
    }

    // SIGTERM: the server stops accepting, finishes, flushes the store and exits 0.
    let status = server.terminate().unwrap();
    assert!(
        status.success(),
        "kvstore serve exited with {status} after SIGTERM"
    );
    let files = files(store.path());
    assert!(
        files
            .iter()
            .any(|f| f.extension().is_some_and(|e| e == "safetensors")),
        "nothing was flushed to the store: {files:?}"
    );
}

#[test]
fn sixty_four_concurrent_streams_finish_without_errors_and_memory_returns_to_baseline() {
    let store = tempfile::tempdir().unwrap();
    // A RAM tier of zero bytes: published blocks go straight to SSD, so live MLX memory
    // after the load is weights only, as before it.
    let server = start(store.path(), &["--max-batch", "16", "--ram-budget", "0"]);
    let port = server.port;
    let body = |i: usize| {
        serde_json::json!({
            "model": "tiny-qwen3",
            "messages": [{"role": "user", "content": format!("Request number {i}: say something short.")}],
            "max_tokens": 6,
            "temperature": 0,
            "stream": true,
        })
        .to_string()
    };
    // One load: 64 streams at once, each must finish with [DONE]; then the server idles.
    let load = |first: usize| {
        let handles: Vec<_> = (first..first + 64)
            .map(|i| {
                let b = body(i);
                std::thread::spawn(move || http(port, "POST", "/v1/chat/completions", &b))
            })
            .collect();
        let mut errors = Vec::new();
        for (i, h) in handles.into_iter().enumerate() {
            let (status, text) = h.join().unwrap();
            if status != 200 || !text.contains("[DONE]") {
                errors.push(format!("request {i}: {status} {text}"));
            }
        }
        assert!(
            errors.is_empty(),
            "{} of 64 streams failed: {errors:?}",
            errors.len()
        );
        let start = Instant::now();
        while gauge(port, "kvstore_active_requests") > 0.0
            || gauge(port, "kvstore_queue_depth") > 0.0
        {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "the server never went idle"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    // The MLX buffers the resident sequences hold: their arenas' bytes, plus what MLX's
    // buffer cache added where it handed an arena a larger freed buffer (docs/server.md,
    // "Memory after a load": up to ~0.25 MB over this load's 8.5 MB, in 1 process of 4-10).
    let resident = || gauge(port, "kvstore_device_resident_buffer_bytes");
    // Live MLX memory beyond the resident sequences, settled: the same reading twice, 200
    // ms apart (a finished step frees its buffers just after its requests end).
    let settled = || {
        let start = Instant::now();
        let mut last = gauge(port, "kvstore_mlx_active_bytes") - resident();
        loop {
            std::thread::sleep(Duration::from_millis(200));
            let now = gauge(port, "kvstore_mlx_active_bytes") - resident();
            if now == last || start.elapsed() > Duration::from_secs(5) {
                return last.min(now);
            }
            last = now;
        }
    };
    load(1000);
    assert_eq!(
        gauge(port, "kvstore_kv_reserved_bytes"),
        0.0,
        "KV reservations left after the load"
    );
    assert!(
        gauge(port, "kvstore_decode_rows_total") > gauge(port, "kvstore_decode_steps_total"),
        "the streams never shared a decode step"
    );
    assert!(
        resident() >= gauge(port, "kvstore_device_resident_bytes"),
        "the resident sequences' buffers are smaller than their arenas"
    );
    // What stays on the device is the finished sequences the device tier keeps resident
    // (within --kv-budget); everything else returns: the memory must reach a steady
    // state, within 4 more loads one load leaving it where it found it, within 32 KB (a
    // leak of 512 bytes a request, or one sequence's KV left behind, grows it in every
    // load; a long-lived array other than an arena that MLX's buffer cache gave a larger
    // buffer is a one-off of at most a few KB).
    const SLACK: f64 = 32.0 * 1024.0;
    let mut growth = Vec::new();
    let mut before = settled();
    for first in [2000, 3000, 4000, 5000] {
        load(first);
        let after = settled();
        growth.push(after - before);
        if after <= before + SLACK {
            break;
        }
        before = after;
    }
    assert!(
        growth.last().is_some_and(|&g| g <= SLACK),
        "live MLX memory beyond the resident sequences grew in every load of 64 streams \
         (bytes a load: {growth:?})"
    );
    assert!(
        resident() <= gauge(port, "kvstore_device_budget_bytes"),
        "the device tier exceeds its budget"
    );
}

/// Starts `kvstore serve` with the tiny qwen3 model and a store at `store`.
fn start(store: &Path, extra: &[&str]) -> Serve {
    let mut args = vec!["--block-size", "8", "--store"];
    let store = store.display().to_string();
    args.push(&store);
    args.extend_from_slice(extra);
    Serve::start(&tiny_model("tiny-qwen3"), &args).unwrap_or_else(|log| panic!("{log}"))
}

/// One request; the status and body (the connection errors of a load test are failures).
fn http(port: u16, method: &str, path: &str, body: &str) -> (u16, String) {
    kvstore_tests::serve::http(port, method, path, body)
        .unwrap_or_else(|e| (0, format!("request failed: {e}")))
}

/// A counter from /metrics, `None` when the metric is absent.
fn counter(port: u16, name: &str) -> Option<f64> {
    let (_, text) = http(port, "GET", "/metrics", "");
    text.lines().find_map(|l| {
        l.strip_prefix(name)
            .filter(|rest| rest.starts_with(' '))
            .and_then(|v| v.trim().parse().ok())
    })
}

#[test]
fn metrics_show_the_remote_tier_two_servers_share_blocks_through_redis() {
    let redis = kvstore_tests::redis_server::RedisServer::start();
    let url = redis.url();
    let (sa, sb) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let a = start(sa.path(), &["--remote", &url, "--remote-ttl", "600"]);
    let pa = a.port;
    // B restores every cached block (`--restore always`): this test is about the remote
    // tier's metrics, and for the tiny model under a loaded machine the cost model may
    // rightly find recomputing 3 blocks cheaper than importing them (then no remote hits).
    let b = start(sb.path(), &["--remote", &url, "--restore", "always"]);
    let pb = b.port;
    let body = serde_json::json!({
        "model": "tiny-qwen3",
        "prompt": "The remote tier lets many engines share the prefixes each one computed; this prompt is long enough for several blocks.",
        "max_tokens": 4,
        "temperature": 0,
    })
    .to_string();
    let (status, first) = http(pa, "POST", "/v1/completions", &body);
    assert_eq!(status, 200, "{first}");
    assert_eq!(http(pa, "POST", "/admin/cache/flush", "").0, 200);
    let published = counter(pa, "kvstore_remote_published_blocks_total").unwrap();
    assert!(published > 0.0, "server A published nothing");
    assert_eq!(
        counter(pa, "kvstore_remote_publish_queue_drops_total"),
        Some(0.0)
    );
    assert_eq!(
        counter(pa, "kvstore_remote_publish_errors_total"),
        Some(0.0)
    );

    let (status, second) = http(pb, "POST", "/v1/completions", &body);
    assert_eq!(status, 200, "{second}");
    let text = |s: &str| serde_json::from_str::<Value>(s).unwrap()["choices"][0]["text"].clone();
    assert_eq!(
        text(&second),
        text(&first),
        "remote-restored output differs"
    );
    let hits = counter(pb, "kvstore_remote_hits_total").unwrap();
    assert!(hits > 0.0, "server B got no remote hits");
    assert!(counter(pb, "kvstore_remote_fetched_bytes_total").unwrap() > 0.0);
    assert_eq!(counter(pb, "kvstore_remote_fetches_total"), Some(1.0));
    assert_eq!(
        counter(pb, "kvstore_remote_verify_failures_total"),
        Some(0.0)
    );
    assert_eq!(counter(pb, "kvstore_remote_errors_total"), Some(0.0));
    assert_eq!(
        counter(pb, "kvstore_cached_prompt_tokens_total{tier=\"remote\"}"),
        Some(hits * 8.0)
    );

    // Redis gone: B keeps serving; the failure shows in the counters.
    drop(redis);
    let other = body.replace("long enough", "different, and long enough");
    let (status, _) = http(pb, "POST", "/v1/completions", &other);
    assert_eq!(status, 200);
    assert!(counter(pb, "kvstore_remote_errors_total").unwrap() >= 1.0);

    // Without --remote: no remote-tier metrics at all.
    let sc = tempfile::tempdir().unwrap();
    let c = start(sc.path(), &[]);
    let pc = c.port;
    let (_, text) = http(pc, "GET", "/metrics", "");
    assert!(!text.contains("kvstore_remote_"), "{text}");
}

/// Runs `script` (under scripts/tests/) with the test venv's Python against `port` and
/// `args`; returns its JSON lines.
fn python_lines(script: &str, port: u16, args: &[&str]) -> Vec<Value> {
    let out = Command::new(python())
        .arg(
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../scripts/tests")
                .join(script),
        )
        .arg(format!("http://127.0.0.1:{port}/v1"))
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{script} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

/// The default model with a store at `store`.
fn start_default(store: &Path) -> Serve {
    let store = store.display().to_string();
    let args = [
        "--block-size",
        "16",
        "--served-model-name",
        "default",
        "--store",
        &store,
    ];
    Serve::start(&kvstore_tests::smollm2(), &args).unwrap_or_else(|log| panic!("{log}"))
}

/// The official client runs a tool loop on the default model (it executes the tools): a
/// named function and `required`, streamed, then a `json_schema` answer; every call and the
/// answer validate against their schemas (`jsonschema`), and each turn reuses at least the
/// whole previous prompt. Bad input gets OpenAI's 400 error shape.
#[test]
fn the_openai_client_runs_a_forced_tool_loop_and_a_json_schema_answer() {
    let store = tempfile::tempdir().unwrap();
    let server = start_default(store.path());
    let lines = python_lines("openai_tools.py", server.port, &["default"]);
    let (turns, bad) = lines.split_at(3);
    assert_eq!(turns[0]["name"], "get_weather", "{turns:?}");
    assert!(turns[..2]
        .iter()
        .all(|t| t["finish"] == "tool_calls" && t["calls"] == 1));
    assert!(turns.iter().all(|t| t["valid"] == true), "{turns:?}");
    assert_eq!(turns[2]["finish"], "stop", "{turns:?}");
    for w in turns.windows(2) {
        let prev = w[0]["prompt_tokens"].as_u64().unwrap();
        let cached = w[1]["cached_tokens"].as_u64().unwrap();
        assert!(
            cached >= prev && cached > w[0]["cached_tokens"].as_u64().unwrap(),
            "a turn reused {cached} tokens after a prompt of {prev}: {turns:?}"
        );
    }
    assert_eq!(bad.len(), 3, "{bad:?}");
    for (b, param) in bad.iter().zip(["tool_choice", "tools", "tools"]) {
        assert_eq!(b["status"], 400, "{b}");
        assert_eq!(b["type"], "invalid_request_error", "{b}");
        assert_eq!(b["param"], param, "{b}");
    }
}

/// The OpenAI Agents SDK runs a 3-tool agent with a forced tool choice against the default
/// model to completion; every model turn after the first reuses at least the previous
/// turn's whole prompt.
#[test]
fn the_openai_agents_sdk_runs_a_three_tool_agent_with_growing_cached_prefixes() {
    let store = tempfile::tempdir().unwrap();
    let server = start_default(store.path());
    let lines = python_lines("openai_agents_run.py", server.port, &["default"]);
    let (turns, end) = lines.split_at(lines.len() - 1);
    assert_eq!(turns.len(), 3, "{lines:?}");
    assert_eq!(end[0]["ran"].as_array().unwrap().len(), 3, "{end:?}");
    for w in turns.windows(2) {
        let prev = w[0]["input_tokens"].as_u64().unwrap();
        let cached = w[1]["cached_tokens"].as_u64().unwrap();
        assert!(
            cached >= prev,
            "cached {cached} < previous prompt {prev}: {turns:?}"
        );
    }
}
