//! `kvstore serve` as a separate process: the official `openai` Python client (from the
//! venv that scripts/setup.sh makes) drives a multi-turn streaming chat, then a graceful
//! SIGTERM; and a bounded load test of 64 concurrent streams.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvstore_tests::{kvstore_bin, tiny_model};
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

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn healthy(port: u16) -> bool {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    if s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .is_err()
    {
        return false;
    }
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out.starts_with("HTTP/1.1 200")
}

struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn the_openai_client_streams_a_multi_turn_chat_with_cached_tokens_from_turn_two() {
    let store = tempfile::tempdir().unwrap();
    let (mut server, port) = start(store.path(), &[]);
    let out = Command::new(python())
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../scripts/tests/openai_chat.py"
        ))
        .arg(format!("http://127.0.0.1:{port}/v1"))
        .args(["tiny-qwen3", "3"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "the openai client failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let turns: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
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
    let pid = server.0.id().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    let start = Instant::now();
    let status = loop {
        if let Some(s) = server.0.try_wait().unwrap() {
            break s;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "kvstore serve did not exit after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(
        status.success(),
        "kvstore serve exited with {status} after SIGTERM"
    );
    let files = walk(store.path());
    assert!(
        files
            .iter()
            .any(|f| f.extension().is_some_and(|e| e == "safetensors")),
        "nothing was flushed to the store: {files:?}"
    );
}

fn walk(dir: &std::path::Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

/// Starts `kvstore serve` with the tiny qwen3 model on a free port and waits until healthy.
fn start(store: &std::path::Path, extra: &[&str]) -> (Server, u16) {
    let port = free_port();
    let child = Command::new(kvstore_bin())
        .arg("serve")
        .arg("--model")
        .arg(tiny_model("tiny-qwen3"))
        .arg("--store")
        .arg(store)
        .args(["--port", &port.to_string(), "--block-size", "8"])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut server = Server(child);
    let start = Instant::now();
    while !healthy(port) {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "kvstore serve did not become healthy"
        );
        if let Some(status) = server.0.try_wait().unwrap() {
            panic!("kvstore serve exited early: {status}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    (server, port)
}

/// One HTTP request; returns the status and the body (chunked bodies joined raw).
fn http(port: u16, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let (head, rest) = out.split_once("\r\n\r\n").unwrap_or((&out, ""));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, rest.to_string())
}

/// A gauge from the Prometheus text of /metrics.
fn gauge(port: u16, name: &str) -> f64 {
    let (status, text) = http(port, "GET", "/metrics", "");
    assert_eq!(status, 200);
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse().ok()))
        .unwrap_or_else(|| panic!("{name} missing from /metrics"))
}

#[test]
fn sixty_four_concurrent_streams_finish_without_errors_and_memory_returns_to_baseline() {
    let store = tempfile::tempdir().unwrap();
    // A RAM tier of zero bytes: published blocks go straight to SSD, so live MLX memory
    // after the load is weights only, as before it.
    let (_server, port) = start(store.path(), &["--max-batch", "16", "--ram-budget", "0"]);
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
    // Warm-up, so the baseline holds what the first request allocates once.
    assert_eq!(
        http(port, "POST", "/v1/chat/completions", &body(999)).0,
        200
    );
    let baseline = gauge(port, "kvstore_mlx_active_bytes");
    let handles: Vec<_> = (0..64)
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
    while gauge(port, "kvstore_active_requests") > 0.0 || gauge(port, "kvstore_queue_depth") > 0.0 {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the server never went idle"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(
        gauge(port, "kvstore_kv_reserved_bytes"),
        0.0,
        "KV reservations left after the load"
    );
    assert!(
        gauge(port, "kvstore_decode_rows_total") > gauge(port, "kvstore_decode_steps_total"),
        "the streams never shared a decode step"
    );
    // The write-behind worker drains published blocks to SSD in the background.
    let start = Instant::now();
    let mut after = gauge(port, "kvstore_mlx_active_bytes");
    while after > baseline && start.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(100));
        after = gauge(port, "kvstore_mlx_active_bytes");
    }
    assert!(
        after <= baseline,
        "live MLX memory {after} did not return to the baseline {baseline}"
    );
}
