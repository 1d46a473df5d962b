//! The library engine (submit / stream / cancel / shutdown) and the HTTP server on an
//! ephemeral port, with the tiny qwen3 model (it has a chat template) and a temp store.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use engine::server::{router, scripted_router, serve_with_limits, ConnectionLimits, ServerConfig};
use engine::{
    generate, load, Engine, EngineConfig, Event, FinishReason, GenerateParams, InjectedFault,
    KvTiers, LoadOptions, Request, ReuseConfig, SubmitError,
};
use serde_json::{json, Value};

use crate::common::goldens;

pub(crate) const MODEL: &str = "tiny-qwen3";

fn open_engine(dir: &std::path::Path, config: EngineConfig) -> Arc<Engine> {
    open_salted_engine(dir, None, config)
}

/// An engine on the store at `dir` that decodes one row at a time (later requests queue).
fn one_row_engine(dir: &std::path::Path) -> Arc<Engine> {
    let config = EngineConfig {
        max_batch: 1,
        ..EngineConfig::default()
    };
    open_engine(dir, config)
}

/// An engine on the store at `dir` configured with cache salt `salt` (`--cache-salt`).
fn open_salted_engine(
    dir: &std::path::Path,
    salt: Option<&str>,
    config: EngineConfig,
) -> Arc<Engine> {
    let (model, tok) = load(&goldens().join(MODEL), &LoadOptions::default()).unwrap();
    let reuse = ReuseConfig {
        salt: salt.map(String::from),
        ..crate::common::reuse_config(dir, 8)
    };
    let prefix = KvTiers::open(&model, &tok, reuse).unwrap();
    Arc::new(Engine::open(model, tok, Some(prefix), config).unwrap())
}

/// A server on 127.0.0.1:0 in a background runtime; dropped, it stops.
pub(crate) struct Server {
    pub(crate) addr: SocketAddr,
    pub(crate) engine: Arc<Engine>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
    _dir: Option<tempfile::TempDir>,
}

/// The server settings of these tests, guarded by `api_key` when given.
pub(crate) fn server_config(api_key: Option<&str>) -> ServerConfig {
    ServerConfig {
        model_id: MODEL.into(),
        api_key: api_key.map(String::from),
        max_body_bytes: 64 << 10,
        max_tokens_limit: 4096,
        ..ServerConfig::default()
    }
}

impl Server {
    pub(crate) fn start(api_key: Option<&str>, config: EngineConfig) -> Server {
        Self::start_with(api_key, config, ConnectionLimits::default())
    }

    fn start_with(api_key: Option<&str>, config: EngineConfig, limits: ConnectionLimits) -> Server {
        let dir = tempfile::tempdir().unwrap();
        let engine = open_engine(dir.path(), config);
        let mut srv = Self::serve(engine, server_config(api_key), limits);
        srv._dir = Some(dir);
        srv
    }

    /// A server over `engine` with `config` (the caller owns the engine's store).
    pub(crate) fn serve(
        engine: Arc<Engine>,
        config: ServerConfig,
        limits: ConnectionLimits,
    ) -> Server {
        let app = router(engine.clone(), config);
        Self::serve_app(engine, app, limits)
    }

    /// A server of `app` over `engine`.
    fn serve_app(engine: Arc<Engine>, app: axum::Router, limits: ConnectionLimits) -> Server {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (addr_tx, addr_rx) = std::sync::mpsc::channel();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                addr_tx.send(l.local_addr().unwrap()).unwrap();
                serve_with_limits(l, app, limits, async {
                    let _ = stopped.await;
                })
                .await
                .unwrap();
            });
        });
        Server {
            addr: addr_rx.recv().unwrap(),
            engine,
            stop: Some(stop),
            thread: Some(thread),
            _dir: None,
        }
    }

    pub(crate) fn request(
        &self,
        method: &str,
        path: &str,
        key: Option<&str>,
        body: &str,
    ) -> Response {
        let mut s = self.send(method, path, key, body);
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).unwrap();
        Response::parse(&raw)
    }

    fn send(&self, method: &str, path: &str, key: Option<&str>, body: &str) -> TcpStream {
        let mut s = TcpStream::connect(self.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(600))).unwrap();
        let auth = key.map_or(String::new(), |k| format!("Authorization: Bearer {k}\r\n"));
        write!(
            s,
            "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{auth}\
             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        s
    }

    pub(crate) fn post(&self, path: &str, body: &Value) -> Response {
        self.request("POST", path, None, &body.to_string())
    }

    /// Waits until the engine has no rows and no queue.
    pub(crate) fn idle(&self) -> engine::EngineMetrics {
        let t = Instant::now();
        loop {
            let m = self.engine.metrics();
            if m.active_rows == 0 && m.queue_depth == 0 {
                return m;
            }
            assert!(t.elapsed() < Duration::from_secs(30), "engine never idle");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = self.engine.shutdown(true);
    }
}

pub(crate) struct Response {
    pub(crate) status: u16,
    pub(crate) body: String,
}

impl Response {
    pub(crate) fn parse(raw: &[u8]) -> Response {
        let text = String::from_utf8_lossy(raw).to_string();
        let (head, rest) = text.split_once("\r\n\r\n").unwrap();
        let status = head.split(' ').nth(1).unwrap().parse().unwrap();
        let chunked = head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked");
        let body = if chunked {
            dechunk(rest)
        } else {
            rest.to_string()
        };
        Response { status, body }
    }

    pub(crate) fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }

    /// The `data:` payloads of an SSE body.
    pub(crate) fn events(&self) -> Vec<String> {
        self.body
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .map(String::from)
            .collect()
    }

    fn error(&self) -> Value {
        let v = self.json();
        assert!(v["error"]["message"].is_string(), "{}", self.body);
        assert!(v["error"]["type"].is_string(), "{}", self.body);
        v["error"].clone()
    }
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        s = rest[n..].trim_start_matches("\r\n");
    }
    out
}

fn chat(content: &str, max_tokens: usize) -> Value {
    json!({
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "You are a terse assistant that answers in one line."},
            {"role": "user", "content": content},
        ],
        "max_tokens": max_tokens,
    })
}

/// What engine::generate gives for a chat body served alone.
fn alone(body: &Value) -> engine::Generation {
    let (model, tok) = load(&goldens().join(MODEL), &LoadOptions::default()).unwrap();
    let messages = body["messages"].to_string();
    let prompt = tok.encode_chat(&messages, None, true).unwrap();
    let params = GenerateParams {
        max_tokens: body["max_tokens"].as_u64().unwrap() as usize,
        ..GenerateParams::default()
    };
    let mut cache = model.new_cache();
    generate(&model, &tok, &mut cache, &prompt, &params, &mut |_| true).unwrap()
}

#[test]
fn non_streaming_chat_matches_generate_and_reports_usage() {
    let srv = Server::start(None, EngineConfig::default());
    let body = chat("Name three colours.", 10);
    let r = srv.post("/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let want = alone(&body);
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["choices"][0]["message"]["content"], want.text.as_str());
    assert_eq!(v["usage"]["completion_tokens"], want.tokens.len());
    assert_eq!(v["usage"]["prompt_tokens"], want.timings.prompt_tokens);
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
}

#[test]
fn streaming_chat_arrives_in_chunks_with_usage_and_done() {
    let srv = Server::start(None, EngineConfig::default());
    let mut body = chat("Count from one to five.", 8);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    body["logprobs"] = json!(true);
    body["top_logprobs"] = json!(2);
    let r = srv.post("/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let events = r.events();
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    let want = alone(&body);
    assert_eq!(text, want.text);
    // The tiny model's text is mostly held-back partial UTF-8; with logprobs every token
    // is its own chunk, as it is sampled.
    let per_token = chunks
        .iter()
        .filter(|c| c["choices"][0]["logprobs"]["content"].is_array())
        .count();
    assert_eq!(per_token, want.tokens.len(), "{events:?}");
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(usage["completion_tokens"], want.tokens.len());
    assert!(chunks
        .iter()
        .any(|c| c["choices"][0]["finish_reason"] == "length"));
}

#[test]
fn concurrent_clients_each_get_their_greedy_output_alone() {
    let questions = [
        "Hi",
        "What is the capital of France? Answer briefly please.",
        "Write a haiku about the sea, the wind, and a small boat that sails at dawn.",
        "2+2?",
        "List the planets of the solar system in order from the sun outwards.",
        "Why is the sky blue?",
        "Say something nice about Rust.",
        "Translate 'good morning' into French, Spanish, German and Italian, one per line.",
        "ok",
    ];
    each_client_gets_its_greedy_output_alone(EngineConfig::default(), &questions);
}

/// The serving loop with the batch arena forced on (the GPU's default), on the CPU: every
/// client still gets its greedy output alone.
#[test]
fn concurrent_clients_get_their_greedy_output_alone_through_a_batch_arena() {
    let config = EngineConfig {
        batch_arena: Some(true),
        ..EngineConfig::default()
    };
    let questions = [
        "What is the capital of France? Answer briefly please.",
        "Write a haiku about the sea, the wind, and a small boat that sails at dawn.",
        "List the planets of the solar system in order from the sun outwards.",
        "Translate 'good morning' into French, Spanish, German and Italian, one per line.",
    ];
    each_client_gets_its_greedy_output_alone(config, &questions);
}

#[test]
fn a_batch_mixing_plain_greedy_rows_with_a_logprobs_row_gives_each_its_output_alone() {
    // The plain greedy rows pick together (one argmax over their rows of the step's logits),
    // the row that asks for log-probabilities picks on its own: the same tokens either way.
    let srv = Arc::new(Server::start(None, EngineConfig::default()));
    let mut bodies: Vec<Value> = [
        "Name three rivers of Europe, one per line.",
        "What is two plus two? Answer in words.",
        "Spell the word 'ocean' backwards, letter by letter.",
    ]
    .iter()
    .map(|q| chat(q, 12))
    .collect();
    bodies[1]["logprobs"] = json!(true);
    bodies[1]["top_logprobs"] = json!(2);
    let got = post_all(&srv, &bodies);
    for (b, r) in bodies.iter().zip(&got) {
        assert_eq!(r.status, 200, "{}", r.body);
        let choice = &r.json()["choices"][0];
        assert_eq!(choice["message"]["content"], alone(b).text.as_str());
        let logprobs = &choice["logprobs"]["content"];
        assert_eq!(logprobs.is_array(), b.get("logprobs").is_some(), "{choice}");
    }
    let m = srv.idle();
    assert!(
        m.decode_rows > m.decode_steps,
        "no shared decode steps: {m:?}"
    );
}

/// Posts every chat body at once, each from its own thread; the responses in order.
fn post_all(srv: &Arc<Server>, bodies: &[Value]) -> Vec<Response> {
    let handles: Vec<_> = bodies
        .iter()
        .cloned()
        .map(|b| {
            let srv = srv.clone();
            std::thread::spawn(move || srv.post("/v1/chat/completions", &b))
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// Sends every question at once and checks each answer against the same request run
/// alone, and that the requests shared decode steps.
fn each_client_gets_its_greedy_output_alone(config: EngineConfig, questions: &[&str]) {
    let srv = Arc::new(Server::start(None, config));
    let bodies: Vec<Value> = questions.iter().map(|q| chat(q, 12)).collect();
    let got = post_all(&srv, &bodies);
    for (b, r) in bodies.iter().zip(&got) {
        assert_eq!(r.status, 200, "{}", r.body);
        let want = alone(b);
        assert_eq!(
            r.json()["choices"][0]["message"]["content"],
            want.text.as_str(),
            "{}",
            b["messages"][1]["content"]
        );
    }
    let m = srv.idle();
    assert!(
        m.decode_rows > m.decode_steps,
        "requests should have shared decode steps: {m:?}"
    );
}

#[test]
fn requests_sharing_a_prefix_both_report_cached_tokens() {
    let srv = Arc::new(Server::start(None, EngineConfig::default()));
    let system = "You are a coding agent. Tools: read_file(path), write_file(path, text), \
                  run(cmd). Think step by step, call one tool per turn, and keep answers short.";
    let first = json!({"messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": "Fix the failing test in src/lib.rs."},
    ], "max_tokens": 4});
    let r = srv.post("/v1/chat/completions", &first);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        r.json()["usage"]["prompt_tokens_details"]["cached_tokens"],
        0
    );
    let follow = |task: &str| {
        json!({"messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": "Fix the failing test in src/lib.rs."},
            {"role": "assistant", "content": "Reading the file first."},
            {"role": "user", "content": task},
        ], "max_tokens": 6, "stream": true, "stream_options": {"include_usage": true}})
    };
    let (a, b) = (
        follow("Now run the tests."),
        follow("Now show me the diff."),
    );
    let ta = {
        let srv = srv.clone();
        std::thread::spawn(move || srv.post("/v1/chat/completions", &a))
    };
    let tb = {
        let srv = srv.clone();
        std::thread::spawn(move || srv.post("/v1/chat/completions", &b))
    };
    for r in [ta.join().unwrap(), tb.join().unwrap()] {
        assert_eq!(r.status, 200, "{}", r.body);
        let events = r.events();
        let usage: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
        let cached = usage["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        assert!(cached > 0, "{usage}");
    }
    let cache = srv.request("GET", "/v1/cache", None, "").json();
    assert_eq!(cache["enabled"], true);
    // Both branch from the first conversation, resident on the device: the first admitted
    // takes (or forks) it there; the other finds it on the device or, once taken, in RAM.
    assert!(cache["device"]["hits"].as_u64().unwrap() >= 1, "{cache}");
    assert!(
        cache["engine"]["cached_device_tokens"].as_u64().unwrap() > 0,
        "{cache}"
    );
    assert!(cache["engine"]["cached_tokens"].as_u64().unwrap() > 0);
}

#[test]
fn requests_with_different_cache_salts_never_share_blocks() {
    let srv = Server::start(None, EngineConfig::default());
    let body = |salt: Option<&str>| {
        let mut b = chat(
            "Summarise the design document of the block store in two lines.",
            5,
        );
        if let Some(s) = salt {
            b["cache_salt"] = json!(s);
        }
        b
    };
    let cached = |r: &Response| {
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
    };
    let want = alone(&body(None)).text;
    let first = srv.post("/v1/chat/completions", &body(Some("tenant-a")));
    assert_eq!(cached(&first), 0);
    assert_eq!(
        first.json()["choices"][0]["message"]["content"],
        want.as_str()
    );
    // Same prompt, same salt: the blocks are shared.
    let again = srv.post("/v1/chat/completions", &body(Some("tenant-a")));
    assert!(cached(&again) > 0, "{}", again.body);
    // Another salt, or none, sees nothing of tenant-a's blocks, and the output is the same.
    for other in [Some("tenant-b"), None, Some("tenant-a ")] {
        let r = srv.post("/v1/chat/completions", &body(other));
        assert_eq!(cached(&r), 0, "salt {other:?} shared tenant-a's blocks");
        assert_eq!(r.json()["choices"][0]["message"]["content"], want.as_str());
    }
    // Each salt is its own namespace in the store.
    srv.idle();
    let prefix = srv.engine.kv_tiers().unwrap();
    let a = prefix.namespace_for(Some("tenant-a")).unwrap();
    let b = prefix.namespace_for(Some("tenant-b")).unwrap();
    assert_ne!(a, b);
    assert_ne!(a, prefix.namespace());
    // Salts that are not 1..=256-byte strings are refused.
    for bad in [json!(""), json!(7), json!("x".repeat(257))] {
        let mut b = body(None);
        b["cache_salt"] = bad;
        let r = srv.post("/v1/chat/completions", &b);
        assert_eq!(r.status, 400, "{}", r.body);
        assert_eq!(r.error()["param"], "cache_salt");
    }
}

/// The collision of issue 19: a server configured with `--cache-salt "request:8:tenant-a"`
/// used to put its unsalted requests in the namespace of requests salted `tenant-a` on a
/// server without one, since the configured salt went into the namespace verbatim.
#[test]
fn a_configured_salt_never_shares_a_namespace_with_a_request_salt_on_another_server() {
    let lookalike = "request:8:tenant-a";
    assert_ne!(
        engine::combined_salt(Some(lookalike), None),
        engine::combined_salt(None, Some("tenant-a"))
    );
    // Distinct (configured, request) pairs never encode alike; equal pairs always do.
    let salts = [
        None,
        Some("a"),
        Some("b"),
        Some("a;request=1:b"),
        Some("-"),
        Some("1:a"),
        Some(lookalike),
        Some("kvstore.salt/2;server=-;request=1:a"),
    ];
    let mut seen = std::collections::HashMap::new();
    for c in salts {
        for r in salts {
            let e = engine::combined_salt(c, r);
            assert_eq!(e, engine::combined_salt(c, r));
            assert_eq!(e.is_none(), c.is_none() && r.is_none());
            if let Some(prev) = seen.insert(e.clone(), (c, r)) {
                panic!("{prev:?} and {:?} both encode as {e:?}", (c, r));
            }
        }
    }

    // Through two servers sharing one store, one after the other (one writer per store).
    let dir = tempfile::tempdir().unwrap();
    let serve = |salt: Option<&str>| {
        let engine = open_salted_engine(dir.path(), salt, EngineConfig::default());
        Server::serve(engine, server_config(None), ConnectionLimits::default())
    };
    let body = |salt: Option<&str>| {
        let mut b = chat("Name the tiers of the block store, fastest first.", 4);
        if let Some(s) = salt {
            b["cache_salt"] = json!(s);
        }
        b
    };
    let cached = |srv: &Server, salt: Option<&str>| {
        let r = srv.post("/v1/chat/completions", &body(salt));
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
    };
    let configured = serve(Some(lookalike));
    assert_eq!(cached(&configured, None), 0);
    assert!(cached(&configured, None) > 0, "equal pairs must share");
    let configured_ns = configured.engine.kv_tiers().unwrap().namespace();
    drop(configured);

    let plain = serve(None);
    assert_eq!(
        cached(&plain, Some("tenant-a")),
        0,
        "a request salted tenant-a hit the blocks of a server configured with {lookalike:?}"
    );
    assert!(
        cached(&plain, Some("tenant-a")) > 0,
        "equal pairs must share"
    );
    let tenant_ns = plain
        .engine
        .kv_tiers()
        .unwrap()
        .namespace_for(Some("tenant-a"))
        .unwrap();
    assert_ne!(tenant_ns, configured_ns);
    drop(plain);

    // The derivation is reproducible: the configured server, restarted, finds its blocks.
    let again = serve(Some(lookalike));
    assert_eq!(again.engine.kv_tiers().unwrap().namespace(), configured_ns);
    assert!(cached(&again, None) > 0, "a restart lost the namespace");
}

#[test]
fn oversized_headers_and_bodies_are_refused_before_any_work() {
    let srv = Server::start(None, EngineConfig::default());
    let raw = |request: String| {
        let mut s = TcpStream::connect(srv.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        // The server may answer and close before reading everything.
        let _ = s.write_all(request.as_bytes());
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
        String::from_utf8_lossy(&out).into_owned()
    };
    let huge_header = format!(
        "GET /health HTTP/1.1\r\nHost: x\r\nX-Big: {}\r\nConnection: close\r\n\r\n",
        "x".repeat(1 << 20)
    );
    assert!(raw(huge_header).starts_with("HTTP/1.1 431"));
    let many: String = (0..500).map(|i| format!("X-{i}: y\r\n")).collect();
    let many_headers =
        format!("GET /health HTTP/1.1\r\nHost: x\r\n{many}Connection: close\r\n\r\n");
    assert!(raw(many_headers).starts_with("HTTP/1.1 431"));
    // A body over the limit (64 KiB here) is a 413 whatever it claims to be.
    let body = format!("{{\"prompt\": \"{}\"}}", "y".repeat(100 << 10));
    let r = srv.request("POST", "/v1/completions", None, &body);
    assert_eq!(r.status, 413, "{}", r.body);
    // And the server is fine afterwards.
    assert_eq!(srv.request("GET", "/health", None, "").status, 200);
}

#[test]
fn max_tokens_above_the_server_limit_is_refused() {
    let srv = Server::start(None, EngineConfig::default());
    let r = srv.post("/v1/chat/completions", &chat("Hello.", 4097));
    assert_eq!(r.status, 400, "{}", r.body);
    let e = r.error();
    assert_eq!(e["param"], "max_tokens");
    assert!(e["message"].as_str().unwrap().contains("4096"), "{e}");
    let r = srv.post("/v1/chat/completions", &chat("Hello.", 4096));
    assert_eq!(r.status, 200, "{}", r.body);
}

#[test]
fn a_client_disconnect_cancels_the_request_and_frees_its_row() {
    let srv = Server::start(None, EngineConfig::default());
    let mut body = chat("Tell me a very long story.", 400);
    body["stream"] = json!(true);
    body["logprobs"] = json!(true);
    let mut s = srv.send("POST", "/v1/chat/completions", None, &body.to_string());
    // Read until the first content has arrived, then hang up.
    let mut buf = [0u8; 4096];
    let mut seen = String::new();
    while seen.matches("data: ").count() < 3 {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "stream ended early: {seen}");
        seen.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    drop(s);
    let m = srv.idle();
    assert_eq!(m.requests_cancelled, 1, "{m:?}");
    assert_eq!(m.kv_reserved_bytes, 0);
    assert!(m.generated_tokens < 400, "{m:?}");
}

#[test]
fn bad_input_gets_openai_style_4xx() {
    let srv = Server::start(None, EngineConfig::default());
    let post = |body: &str| srv.request("POST", "/v1/chat/completions", None, body);
    let cases: Vec<(String, u16)> = vec![
        ("{\"messages\": [".into(), 400),
        ("[1, 2]".into(), 400),
        (json!({"messages": []}).to_string(), 400),
        (json!({"messages": "hi"}).to_string(), 400),
        (
            json!({"messages": [{"role": "wizard", "content": "x"}]}).to_string(),
            400,
        ),
        (
            json!({"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}).to_string(),
            404,
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "temperature": -1}).to_string(),
            400,
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "top_p": 7}).to_string(),
            400,
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}).to_string(),
            400,
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": "many"})
                .to_string(),
            400,
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "n": 3}).to_string(),
            400,
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "stop": 5}).to_string(),
            400,
        ),
        (
            json!({"messages": [{"role": "user", "content": "x ".repeat(600)}]}).to_string(),
            400,
        ),
    ];
    for (body, status) in cases {
        let r = post(&body);
        assert_eq!(r.status, status, "{body}: {}", r.body);
        r.error();
    }
    let long =
        post(&json!({"messages": [{"role": "user", "content": "x ".repeat(600)}]}).to_string());
    assert_eq!(long.error()["code"], "context_length_exceeded");
    let huge = post(&"x".repeat(100 << 10));
    assert_eq!(huge.status, 413, "{}", huge.body);
    huge.error();
    let r = srv.request(
        "POST",
        "/v1/completions",
        None,
        &json!({"prompt": ""}).to_string(),
    );
    assert_eq!(r.status, 400);
    r.error();
    let r = srv.request("GET", "/v1/chat/completions", None, "");
    assert_eq!(r.status, 405);
    r.error();
    let r = srv.request("GET", "/v1/nothing", None, "");
    assert_eq!(r.status, 404);
    r.error();
    // Still serving after all that.
    assert_eq!(srv.post("/v1/chat/completions", &chat("hi", 2)).status, 200);
}

#[test]
fn an_api_key_guards_the_api_but_not_health() {
    let srv = Server::start(Some("sk-test"), EngineConfig::default());
    let body = chat("hi", 2).to_string();
    let r = srv.request("POST", "/v1/chat/completions", None, &body);
    assert_eq!(r.status, 401);
    assert_eq!(r.error()["code"], "invalid_api_key");
    let r = srv.request("POST", "/v1/chat/completions", Some("sk-wrong"), &body);
    assert_eq!(r.status, 401);
    let r = srv.request("POST", "/admin/cache/flush", None, "");
    assert_eq!(r.status, 401);
    let r = srv.request("POST", "/v1/chat/completions", Some("sk-test"), &body);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(srv.request("GET", "/health", None, "").status, 200);
    // /metrics stays open by default, as vLLM's does (`metrics_need_key` closes it).
    assert_eq!(srv.request("GET", "/metrics", None, "").status, 200);
    let r = srv.request("GET", "/v1/models", Some("sk-test"), "");
    assert_eq!(r.json()["data"][0]["id"], MODEL);
}

#[test]
fn completions_metrics_cache_stats_and_flush() {
    let srv = Server::start(None, EngineConfig::default());
    let r = srv.post(
        "/v1/completions",
        &json!({"prompt": "The quick brown fox jumps over the lazy dog and then", "max_tokens": 5, "logprobs": 2}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["usage"]["completion_tokens"], 5);
    assert_eq!(
        v["choices"][0]["logprobs"]["token_logprobs"]
            .as_array()
            .unwrap()
            .len(),
        5
    );
    let mut stream = json!({"prompt": "Once upon a time", "max_tokens": 4, "stream": true});
    let r = srv.post("/v1/completions", &stream);
    assert_eq!(r.events().last().unwrap(), "[DONE]");
    stream["stream"] = json!(false);

    let flush = srv.request("POST", "/admin/cache/flush", None, "");
    assert_eq!(flush.status, 200, "{}", flush.body);
    let f = flush.json();
    assert_eq!(f["flushed"], true);
    assert!(f["store"]["ssd_blocks"].as_u64().unwrap() > 0, "{f}");

    let metrics = srv.request("GET", "/metrics", None, "");
    assert_eq!(metrics.status, 200);
    for name in [
        "kvstore_requests_total{outcome=\"length\"} 2",
        "kvstore_generated_tokens_total 9",
        "kvstore_ttft_seconds_bucket{le=\"+Inf\"} 2",
        "kvstore_ttft_seconds_count 2",
        "kvstore_queue_depth 0",
        "kvstore_cache_hits_total{tier=\"ram\"}",
        "kvstore_cache_bytes{tier=\"ssd\"}",
        "kvstore_http_responses_total{code=\"200\"}",
    ] {
        assert!(
            metrics.body.contains(name),
            "{name} missing from:\n{}",
            metrics.body
        );
    }
}

/// Every metric the server exports without `--remote` (docs/server.md), as scraped.
const METRIC_NAMES: [&str; 37] = [
    "kvstore_requests_total",
    "kvstore_prompt_tokens_total",
    "kvstore_cached_prompt_tokens_total",
    "kvstore_generated_tokens_total",
    "kvstore_decode_steps_total",
    "kvstore_decode_rows_total",
    "kvstore_queue_depth",
    "kvstore_active_requests",
    "kvstore_kv_reserved_bytes",
    "kvstore_mlx_active_bytes",
    "kvstore_mlx_cache_bytes",
    "kvstore_ttft_seconds",
    "kvstore_device_resident_bytes",
    "kvstore_device_resident_buffer_bytes",
    "kvstore_device_resident_sequences",
    "kvstore_device_budget_bytes",
    "kvstore_device_hits_total",
    "kvstore_device_evictions_total",
    "kvstore_export_blocks_total",
    "kvstore_export_bytes_total",
    "kvstore_export_failed_blocks_total",
    "kvstore_export_skipped_exports_total",
    "kvstore_export_skipped_blocks_total",
    "kvstore_export_read_seconds_total",
    "kvstore_export_insert_seconds_total",
    "kvstore_export_lookup_wait_seconds_total",
    "kvstore_cache_hits_total",
    "kvstore_cache_misses_total",
    "kvstore_cache_bytes",
    "kvstore_cache_budget_bytes",
    "kvstore_cache_blocks",
    "kvstore_cache_bytes_written_total",
    "kvstore_cache_evictions_total",
    "kvstore_cache_spills_total",
    "kvstore_cache_spills_dropped_total",
    "kvstore_cache_ram_not_admitted_total",
    "kvstore_http_responses_total",
];

#[test]
fn metrics_parse_as_prometheus_text_and_count_the_requests_served() {
    use prometheus_parse::{LineInfo, Scrape, Value as PromValue};
    let srv = Server::start(None, EngineConfig::default());
    let chat = json!({"messages": [
        {"role": "system", "content": "You are a terse assistant that answers in one line."},
        {"role": "user", "content": "Name three prime numbers."},
    ], "max_tokens": 4});
    let (mut prompt, mut completion, mut cached) = (0, 0, 0);
    let mut usage = |r: &Response| {
        assert_eq!(r.status, 200, "{}", r.body);
        let u = &r.json()["usage"];
        prompt += u["prompt_tokens"].as_u64().unwrap();
        completion += u["completion_tokens"].as_u64().unwrap();
        cached += u["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0);
    };
    usage(&srv.post("/v1/chat/completions", &chat));
    usage(&srv.post("/v1/chat/completions", &chat));
    usage(&srv.post(
        "/v1/completions",
        &json!({"prompt": "Once upon a time there was", "max_tokens": 3}),
    ));
    assert!(cached > 0, "the repeated chat reuses its prefix");
    assert_eq!(srv.request("GET", "/nope", None, "").status, 404);
    assert_eq!(
        srv.request("POST", "/v1/completions", None, "{not json")
            .status,
        400
    );
    srv.idle();
    assert_eq!(
        srv.request("POST", "/admin/cache/flush", None, "").status,
        200
    );

    let mut raw = Vec::new();
    srv.send("GET", "/metrics", None, "")
        .read_to_end(&mut raw)
        .unwrap();
    let head = String::from_utf8_lossy(&raw).to_lowercase();
    assert!(
        head.contains("content-type: text/plain; version=0.0.4"),
        "{head}"
    );
    let r = Response::parse(&raw);
    assert_eq!(r.status, 200);

    // Every line is a HELP, a TYPE or a sample the parser understands (it skips the rest
    // silently, so a malformed line would otherwise go unseen).
    for line in r.body.lines() {
        assert!(
            !matches!(LineInfo::parse(line), LineInfo::Ignored),
            "not Prometheus text: {line:?}"
        );
    }
    let scrape = Scrape::parse(r.body.lines().map(|l| Ok(l.to_owned()))).unwrap();
    let families: std::collections::BTreeSet<&str> = scrape
        .samples
        .iter()
        .map(|s| {
            let m = s.metric.as_str();
            ["_sum", "_count"]
                .iter()
                .find_map(|suffix| {
                    m.strip_suffix(suffix)
                        .filter(|f| *f == "kvstore_ttft_seconds")
                })
                .unwrap_or(m)
        })
        .collect();
    for name in METRIC_NAMES {
        assert!(families.contains(name), "{name} missing from:\n{}", r.body);
        assert!(
            scrape.docs.get(name).is_some_and(|h| !h.is_empty()),
            "{name} has no help text"
        );
    }
    for f in &families {
        assert!(
            METRIC_NAMES.contains(f),
            "{f} is exported but not listed in docs/server.md"
        );
    }
    let value = |name: &str, label: Option<(&str, &str)>| -> f64 {
        let s = scrape
            .samples
            .iter()
            .find(|s| s.metric == name && label.is_none_or(|(k, v)| s.labels.get(k) == Some(v)))
            .unwrap_or_else(|| panic!("no sample {name} {label:?} in:\n{}", r.body));
        match s.value {
            PromValue::Counter(v) | PromValue::Gauge(v) | PromValue::Untyped(v) => v,
            ref other => panic!("{name}: {other:?}"),
        }
    };
    let outcome = |o| value("kvstore_requests_total", Some(("outcome", o)));
    assert_eq!(outcome("submitted"), 3.0);
    assert_eq!(outcome("stop") + outcome("length"), 3.0);
    assert_eq!(outcome("cancelled") + outcome("failed"), 0.0);
    assert_eq!(value("kvstore_prompt_tokens_total", None), prompt as f64);
    assert_eq!(
        value("kvstore_generated_tokens_total", None),
        completion as f64
    );
    let cached_by_tier: f64 = ["device", "ram", "ssd", "remote"]
        .iter()
        .map(|t| value("kvstore_cached_prompt_tokens_total", Some(("tier", t))))
        .sum();
    assert_eq!(cached_by_tier, cached as f64);
    assert_eq!(value("kvstore_queue_depth", None), 0.0);
    assert_eq!(value("kvstore_active_requests", None), 0.0);
    let code = |c| value("kvstore_http_responses_total", Some(("code", c)));
    // The scrape itself is counted after its body is written.
    assert_eq!(code("200"), 4.0);
    assert_eq!(code("404"), 1.0);
    assert_eq!(code("400"), 1.0);
    let stats = srv.engine.cache_stats().unwrap();
    assert!(stats.ssd_blocks > 0);
    assert_eq!(
        value("kvstore_cache_blocks", Some(("tier", "ssd"))),
        stats.ssd_blocks as f64
    );
    assert_eq!(
        value("kvstore_cache_bytes_written_total", None),
        stats.bytes_written as f64
    );
    // Counters the export thread may still move after the scrape: never above the store's.
    let stats = srv.engine.cache_stats().unwrap();
    for (name, tier, now) in [
        (
            "kvstore_cache_evictions_total",
            Some(("tier", "ram")),
            stats.ram_evictions,
        ),
        (
            "kvstore_cache_evictions_total",
            Some(("tier", "ssd")),
            stats.ssd_evictions,
        ),
        ("kvstore_cache_spills_total", None, stats.spills),
        (
            "kvstore_cache_ram_not_admitted_total",
            None,
            stats.ram_not_admitted,
        ),
    ] {
        let scraped = value(name, tier);
        assert!(scraped <= now as f64, "{name} {tier:?}: {scraped} > {now}");
    }
    assert_eq!(value("kvstore_cache_spills_dropped_total", None), 0.0);
    // The blocks on SSD came from the device through the export thread; it may have
    // finished more since the scrape, never fewer.
    let exported = srv.engine.kv_tiers().unwrap().export_stats();
    let scraped = value("kvstore_export_blocks_total", None);
    assert!(
        scraped > 0.0 && scraped <= exported.blocks as f64,
        "{scraped} vs {exported:?}"
    );
    assert!(value("kvstore_export_bytes_total", None) > 0.0);
    assert_eq!(value("kvstore_export_failed_blocks_total", None), 0.0);
    let ttft = scrape
        .samples
        .iter()
        .find(|s| s.metric == "kvstore_ttft_seconds")
        .unwrap();
    let PromValue::Histogram(buckets) = &ttft.value else {
        panic!("kvstore_ttft_seconds is a histogram: {:?}", ttft.value)
    };
    assert!(buckets
        .windows(2)
        .all(|w| w[0].count <= w[1].count && w[0].less_than < w[1].less_than));
    let last = buckets.last().unwrap();
    assert!(
        last.less_than.is_infinite() && last.count == 3.0,
        "{buckets:?}"
    );
    assert_eq!(value("kvstore_ttft_seconds_count", None), 3.0);
    assert!(value("kvstore_ttft_seconds_sum", None) > 0.0);
}

#[test]
fn the_library_api_streams_cancels_and_shuts_down() {
    let dir = tempfile::tempdir().unwrap();
    let engine = one_row_engine(dir.path());
    let tok = engine.tokenizer();
    let prompt = tok
        .encode("one two three four five six seven eight nine ten", true)
        .unwrap();
    let params = GenerateParams {
        max_tokens: 300,
        stop_at_eos: false,
        ..GenerateParams::default()
    };
    let req = |max_tokens: usize| Request {
        prompt: prompt.clone(),
        params: GenerateParams {
            max_tokens,
            ..params.clone()
        },
        cache_salt: None,
    };
    // With one row, the second request queues behind the first; cancel the first mid-way.
    let mut a = engine.submit(req(300)).unwrap();
    let b = engine.submit(req(6)).unwrap();
    let mut tokens = 0;
    while let Some(e) = a.recv_blocking() {
        match e {
            Event::Token { .. } => {
                tokens += 1;
                if tokens == 3 {
                    a.cancel_handle().cancel();
                }
            }
            Event::Finished(c) => {
                assert_eq!(c.finish_reason, FinishReason::Cancelled);
                assert!(c.completion_tokens < 300);
                break;
            }
            Event::Failed(e) => panic!("{e}"),
            _ => {}
        }
    }
    let done = b.wait().unwrap();
    assert_eq!(done.finish_reason, FinishReason::Length);
    assert_eq!(done.completion_tokens, 6);
    assert!(
        done.cached_tokens > 0,
        "the second request reuses the first's prompt"
    );
    // Over budget and bad prompts are refused at submit.
    assert!(matches!(
        engine.submit(Request::new(vec![], params.clone())),
        Err(SubmitError::Invalid(_))
    ));
    // Shutdown finishes what runs, flushes, and refuses new work.
    let c = engine.submit(req(4)).unwrap();
    engine.shutdown(false).unwrap();
    assert_eq!(c.wait().unwrap().completion_tokens, 4);
    assert!(engine.cache_stats().unwrap().ssd_blocks > 0);
    assert!(matches!(
        engine.submit(req(1)),
        Err(SubmitError::ShuttingDown)
    ));
}

/// A request submitted while the queue is short has its cached prefix looked up and loaded
/// by the I/O thread from submission on (not from the engine's next step); behind a long
/// queue the load waits until the request nears the head. Every request still gets its
/// output and its cache hit.
#[test]
fn a_short_queue_starts_each_lookup_at_submission() {
    let dir = tempfile::tempdir().unwrap();
    let engine = one_row_engine(dir.path());
    let prompt = distinct_ids(40, 1);
    // One row: the first request holds it while the rest queue behind it.
    let first = engine
        .submit(Request::new(prompt.clone(), no_eos(200)))
        .unwrap();
    let rest: Vec<_> = (0..8)
        .map(|_| {
            engine
                .submit(Request::new(prompt.clone(), no_eos(2)))
                .unwrap()
        })
        .collect();
    let early = engine.metrics().early_loads;
    // The first two submissions met a queue shorter than two batches (max_batch 1); the
    // third may have, if the first was admitted already; later ones met a longer queue
    // (the queue-depth gauge can lag by the submissions the engine thread has not taken
    // yet, hence the slack), and never all of them.
    assert!(
        (2..=5).contains(&early),
        "{early} loads started at submission"
    );
    assert_eq!(first.wait().unwrap().completion_tokens, 200);
    let mut prefetched = 0;
    for h in rest {
        let done = h.wait().unwrap();
        assert_eq!(done.completion_tokens, 2);
        assert!(done.cached_tokens > 0, "a later request reuses the prompt");
        // A prefetched prefix was loaded after submission and before admission began
        // (or, with the engine waiting for it, within the restore).
        let r = &done.reuse;
        if r.prefetched {
            prefetched += 1;
            assert!(
                r.prefetch_s > 0.0 && r.prefetch_s <= done.queue_s + r.restore_s + 1e-6,
                "loaded {} s after submission, queued {} s, restored {} s",
                r.prefetch_s,
                done.queue_s,
                r.restore_s
            );
        } else {
            assert_eq!(r.prefetch_s, 0.0);
        }
    }
    assert!(prefetched >= 2, "{prefetched} requests were prefetched");
    assert_eq!(engine.metrics().early_loads, early);
    // Without a prefix cache there is nothing to load.
    let (model, tok) = load(&goldens().join(MODEL), &LoadOptions::default()).unwrap();
    let plain = Engine::open(model, tok, None, EngineConfig::default()).unwrap();
    plain
        .submit(Request::new(prompt, no_eos(2)))
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(plain.metrics().early_loads, 0);
}

/// With no host tier (RAM and SSD budgets 0, no remote), publication copies nothing off
/// the device: nothing is exported or stored, and a later request sharing the prompt still
/// reuses it from the device tier.
#[test]
fn without_host_tiers_nothing_is_exported_and_the_device_tier_still_serves() {
    let dir = tempfile::tempdir().unwrap();
    let (model, tok) = load(&goldens().join(MODEL), &LoadOptions::default()).unwrap();
    let reuse = ReuseConfig {
        store: store::StoreConfig::default()
            .root(dir.path())
            .ram_budget(0)
            .ssd_budget(0),
        ..crate::common::reuse_config(dir.path(), 8)
    };
    let prefix = KvTiers::open(&model, &tok, reuse).unwrap();
    let engine = Engine::open(model, tok, Some(prefix), EngineConfig::default()).unwrap();
    let prompt = distinct_ids(40, 2);
    let first = engine
        .submit(Request::new(prompt.clone(), no_eos(3)))
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(first.reuse.published_blocks, 0);
    let mut longer = prompt.clone();
    longer.extend(distinct_ids(5, 3));
    let second = engine
        .submit(Request::new(longer, no_eos(3)))
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(
        second.cached_tokens, 40,
        "the first prompt, from the device tier"
    );
    assert_eq!(second.reuse.cached_device_tokens, 40);
    let stats = engine.cache_stats().unwrap();
    assert_eq!((stats.ram_blocks, stats.ssd_blocks), (0, 0));
}

/// Prompt ids for `seed` sharing nothing with another seed's (their first tokens differ).
fn distinct_ids(n: u32, seed: u32) -> Vec<u32> {
    (0..n)
        .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed << 20) >> 7) % 250 + 3)
        .collect()
}

/// Greedy decoding of exactly `max_tokens` tokens (EOS ignored).
fn no_eos(max_tokens: usize) -> GenerateParams {
    GenerateParams {
        max_tokens,
        stop_at_eos: false,
        ..GenerateParams::default()
    }
}

/// Chunked prefill: a long prompt that arrives while two rows decode is prefilled a chunk
/// per engine step, and both rows decode in every one of those steps (from the engine's
/// step log, not from timing).
#[test]
fn a_long_prompt_is_prefilled_a_chunk_per_step_while_rows_decode() {
    let (chunk, long) = (16, 300);
    let steps = long_prompt_among_rows(chunk, None, long);
    assert_eq!(steps.len(), long.div_ceil(chunk), "{steps:?}");
}

/// With the step budget on, the chunk sizes follow measured step times: whatever they are,
/// the long prompt is prefilled once, no step takes more than `prefill_chunk` of it, and
/// both rows advance in every one of its steps.
#[test]
fn a_budgeted_chunk_stays_within_the_prefill_chunk() {
    long_prompt_among_rows(64, Some(1.5), 400);
}

/// An engine refuses a step budget that is not a multiple above 1.
#[test]
fn an_itl_stretch_of_one_or_less_is_refused() {
    for bad in [1.0, 0.5, f64::NAN] {
        let (model, tok) = load(&goldens().join(MODEL), &LoadOptions::default()).unwrap();
        let config = EngineConfig {
            itl_stretch: Some(bad),
            ..EngineConfig::default()
        };
        let Err(e) = Engine::open(model, tok, None, config) else {
            panic!("itl_stretch {bad} accepted");
        };
        assert!(e.to_string().contains("itl_stretch"), "{bad}: {e}");
    }
}

/// Two rows decode while a `long`-token prompt arrives; returns the steps that prefilled
/// it, after checking that every prompt token was prefilled once, no step ran more than
/// `chunk` of them and both rows decoded in each.
fn long_prompt_among_rows(
    chunk: usize,
    itl_stretch: Option<f64>,
    long: usize,
) -> Vec<engine::StepRecord> {
    let dir = tempfile::tempdir().unwrap();
    let engine = open_engine(
        dir.path(),
        EngineConfig {
            max_batch: 4,
            prefill_chunk: chunk,
            itl_stretch,
            step_log: 100_000,
            ..EngineConfig::default()
        },
    );
    let (ids, params) = (distinct_ids, no_eos);
    let mut a = engine
        .submit(Request::new(ids(12, 1), params(100_000)))
        .unwrap();
    let mut b = engine
        .submit(Request::new(ids(9, 2), params(100_000)))
        .unwrap();
    wait_first_token(&mut a);
    wait_first_token(&mut b);
    let c = engine
        .submit(Request::new(ids(long as u32, 3), params(2)))
        .unwrap();
    let c_id = c.id();
    let done = c.wait().unwrap();
    assert_eq!(done.completion_tokens, 2);
    assert_eq!(done.cached_tokens, 0);
    a.cancel();
    b.cancel();

    let log = engine.step_log();
    for s in &log {
        assert!(step_prefill(s) <= chunk, "{s:?}");
    }
    let c_steps: Vec<_> = log
        .into_iter()
        .filter(|s| s.prefilled.is_some_and(|(id, _)| id == c_id))
        .collect();
    let prefilled: usize = c_steps.iter().map(|s| s.prefilled.unwrap().1).sum();
    assert_eq!(prefilled, long, "every prompt token prefilled once");
    for s in &c_steps {
        for row in [a.id(), b.id()] {
            assert!(
                s.decoded.contains(&row),
                "row {row} did not advance in {s:?}"
            );
        }
    }
    c_steps
}

/// The step log says where publication and admission went: with a prefix cache, the
/// step that admitted a request spent time admitting it (its lookup) and a step that
/// published its blocks (its first token, its end) spent time publishing; without one, no
/// step publishes.
#[test]
fn the_step_log_times_admission_and_publication() {
    let dir = tempfile::tempdir().unwrap();
    let config = EngineConfig {
        step_log: 100_000,
        ..EngineConfig::default()
    };
    let cached = open_engine(dir.path(), config.clone());
    let (model, tok) = load(&goldens().join(MODEL), &LoadOptions::default()).unwrap();
    let plain = Engine::open(model, tok, None, config).unwrap();
    for (engine, with_cache) in [(&*cached, true), (&plain, false)] {
        let done = engine
            .submit(Request::new(distinct_ids(40, 7), no_eos(3)))
            .unwrap()
            .wait()
            .unwrap();
        assert_eq!(done.completion_tokens, 3);
        let log = engine.step_log();
        let published: u64 = log.iter().map(|s| s.publish_us).sum();
        let publishing = log.iter().filter(|s| s.publish_us > 0).count();
        if with_cache {
            assert!(done.reuse.published_blocks > 0);
            assert!(publishing >= 1, "no step timed a publication: {log:?}");
        } else {
            assert_eq!(published, 0, "published without a cache: {log:?}");
        }
        let first = log
            .iter()
            .find(|s| s.prefilled.is_some())
            .expect("a step prefilled the prompt");
        if with_cache {
            assert!(first.admit_us > 0, "{first:?}");
            // The request was admitted in that step: its admission itself took time.
            assert!(first.begin_us > 0, "{first:?}");
        }
        assert!(
            log.iter().all(|s| s.admit_us + s.publish_us <= s.step_us),
            "parts longer than their steps: {log:?}"
        );
        // Admission's own parts lie within it (CPU time to the microsecond's rounding).
        assert!(
            log.iter()
                .all(|s| s.begin_us <= s.admit_us && s.admit_cpu_us <= s.admit_us + 1),
            "admission's parts longer than admission: {log:?}"
        );
        // Without a cache no request has a load to wait for. With one, the lone request's
        // lookup may still be running on the I/O worker when the idle engine first looks
        // at it (a loaded machine), which the flag rightly records: only the plain engine
        // can be held to never.
        if !with_cache {
            assert!(log.iter().all(|s| !s.admit_waited_load), "{log:?}");
        }
    }
}

/// While a row decodes, a 64-token prompt (eight 8-token chunks) starts prefilling and an
/// 8-token one arrives: prefilling the fewest new tokens first, the short prompt's chunk
/// runs before the long prompt's last; in arrival order, after it (the long prompt's chunks
/// fill each step's budget, so the short one cannot ride along). The short prompt is
/// submitted once the step log shows the long one's first chunk: submitted together, a
/// loaded machine could finish the short one's lookup first, and admission rightly passes
/// over a request still loading.
#[test]
fn the_prefill_order_decides_whether_a_short_prompt_passes_a_long_one() {
    for (order, passes) in [
        (engine::PrefillOrder::FewestNew, true),
        (engine::PrefillOrder::Arrival, false),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let engine = open_engine(
            dir.path(),
            EngineConfig {
                prefill_chunk: 8,
                prefill_order: order,
                ..logged(4)
            },
        );
        let mut row = engine
            .submit(Request::new(distinct_ids(12, 1), no_eos(100_000)))
            .unwrap();
        wait_first_token(&mut row);
        let long = engine
            .submit(Request::new(distinct_ids(64, 2), no_eos(2)))
            .unwrap();
        wait_prefilling(&engine, long.id());
        let short = engine
            .submit(Request::new(distinct_ids(8, 3), no_eos(2)))
            .unwrap();
        let (l, sh) = (long.id(), short.id());
        assert_eq!(long.wait().unwrap().completion_tokens, 2);
        assert_eq!(short.wait().unwrap().completion_tokens, 2);
        row.cancel();
        let log = engine.step_log();
        let runs = |s: &engine::StepRecord, id: u64| {
            s.prefilled.is_some_and(|(p, _)| p == id) || s.riders.iter().any(|(p, _)| *p == id)
        };
        let long_ends = log.iter().rposition(|s| runs(s, l)).unwrap();
        let short_runs = log.iter().position(|s| runs(s, sh)).unwrap();
        assert_eq!(
            short_runs < long_ends,
            passes,
            "{order}: the short prompt ran at step {short_runs}, the long one ended at {long_ends}: {:?}",
            &log[short_runs.min(long_ends)..=short_runs.max(long_ends)]
        );
    }
}

/// With the fewest-new order, what the front prompt's chunk leaves of a pass goes to the
/// waiting prompts with the fewest tokens first: prompts of 40, 30, 20 and 12 tokens
/// (submitted in that order while a row decodes, 64-token passes) run as the 12-token one
/// with the 20- and 30-token ones riding (62 tokens), where queue order would take the
/// 40-token one alone (52). A burst's prompts are admitted together in most rounds (each
/// submission takes microseconds, a step milliseconds); ten rounds are tried.
#[test]
fn under_fewest_new_riders_are_the_prompts_with_the_fewest_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let engine = fewest_new_engine(dir.path(), 8, 64);
    let mut row = engine
        .submit(Request::new(distinct_ids(12, 1), no_eos(100_000)))
        .unwrap();
    wait_first_token(&mut row);
    let mut packed = false;
    for round in 0..10u32 {
        // Submitted back to back, then waited for.
        let handles: Vec<_> = [40u32, 30, 20, 12]
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                let prompt = distinct_ids(n, 10 + 4 * round + i as u32);
                engine.submit(Request::new(prompt, no_eos(1))).unwrap()
            })
            .collect();
        let ids: Vec<u64> = handles.iter().map(|h| h.id()).collect();
        for h in handles {
            assert_eq!(h.wait().unwrap().completion_tokens, 1);
        }
        let log = engine.step_log();
        let Some(step) = log
            .iter()
            .find(|s| s.prefilled.is_some_and(|(id, _)| id == ids[3]))
        else {
            continue;
        };
        let mut riders: Vec<u64> = step.riders.iter().map(|r| r.0).collect();
        riders.sort_unstable();
        assert_ne!(
            riders,
            vec![ids[0]],
            "the 40-token prompt rode before the 20- and 30-token ones: {step:?}"
        );
        if riders == vec![ids[1], ids[2]] {
            packed = true;
            break;
        }
    }
    row.cancel();
    assert!(
        packed,
        "no round packed the 12-, 20- and 30-token prompts into one pass"
    );
}

/// A queued request whose cached-prefix load is slow (held at the I/O workers' gate, as a
/// cold SSD or a far remote tier would be) keeps its place while a request submitted after
/// it is loaded by another worker, admitted past it and answered; once the load ends, the
/// slow request is served too. With one I/O thread and admission stopping at the first
/// request still loading (the engine before session 29), the second request waited for the
/// first's load.
/// An engine configuration of `max_batch` rows that keeps a step log.
fn logged(max_batch: usize) -> EngineConfig {
    EngineConfig {
        max_batch,
        step_log: 100_000,
        ..EngineConfig::default()
    }
}

/// Submits `prompt` (for `tokens` tokens) with its load held at the gate until the test
/// releases it ([`KvTiers::hold_loads`]), once the load is waiting there.
fn submit_held(engine: &Engine, prompt: Vec<u32>, tokens: usize) -> engine::RequestHandle {
    let tiers = engine.kv_tiers().expect("a prefix cache");
    tiers.hold_loads(prompt[..8].to_vec());
    let h = engine.submit(Request::new(prompt, no_eos(tokens))).unwrap();
    while tiers.loads_waiting() == 0 {
        std::thread::yield_now();
    }
    h
}

/// Waits for `h`'s answer while a load is held at the gate: on another thread, so that an
/// engine holding `h` behind the held load fails the test (`what` happened) instead of
/// hanging it; the held loads are released before the failure.
fn wait_past_held(tiers: &KvTiers, h: engine::RequestHandle, what: &str) -> engine::Completion {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(h.wait());
    });
    match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(done) => done.unwrap(),
        Err(_) => {
            tiers.release_loads();
            panic!("{what}");
        }
    }
}

/// A request whose load ends while admission waits for it (within `load_grace`) joins the
/// prefill step of the request admitted before it; with no grace it waits for that step.
/// From the step log, not from timing: the held load is released while the engine waits
/// (a grace far longer than the test), or after the first request's answer (no grace).
#[test]
fn a_load_that_ends_within_the_grace_joins_the_step_it_would_have_waited_for() {
    for grace in [Duration::from_secs(60), Duration::ZERO] {
        let dir = tempfile::tempdir().unwrap();
        let engine = open_engine(
            dir.path(),
            EngineConfig {
                load_grace: grace,
                ..logged(4)
            },
        );
        let tiers = engine.kv_tiers().expect("a prefix cache");
        let late = submit_held(&engine, distinct_ids(24, 11), 2);
        let first = engine
            .submit(Request::new(distinct_ids(40, 12), no_eos(2)))
            .unwrap();
        let (late_id, first_id) = (late.id(), first.id());
        if grace.is_zero() {
            assert_eq!(first.wait().unwrap().completion_tokens, 2);
            tiers.release_loads();
        } else {
            // The engine admits `first` and waits for `late`'s load (or has not reached
            // the wait yet: then `late` is loaded before its admission pass, as well).
            std::thread::sleep(Duration::from_millis(50));
            tiers.release_loads();
            assert_eq!(first.wait().unwrap().completion_tokens, 2);
        }
        assert_eq!(late.wait().unwrap().completion_tokens, 2);
        let in_step = |s: &engine::StepRecord, id: u64| {
            s.prefilled.is_some_and(|p| p.0 == id) || s.riders.iter().any(|r| r.0 == id)
        };
        let together = engine
            .step_log()
            .iter()
            .any(|s| in_step(s, late_id) && in_step(s, first_id));
        assert_eq!(
            together,
            !grace.is_zero(),
            "grace {grace:?}: whether the late request joined the first one's prefill step"
        );
    }
}

#[test]
fn a_slow_load_holds_back_only_its_own_request() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open_engine(dir.path(), logged(4));
    let tiers = engine.kv_tiers().expect("a prefix cache");
    let slow_prompt = distinct_ids(40, 7);
    // The slow request's prefix is in the store, so its load has something to read.
    engine
        .submit(Request::new(slow_prompt.clone(), no_eos(2)))
        .unwrap()
        .wait()
        .unwrap();
    let slow = submit_held(&engine, slow_prompt.clone(), 2);
    let quick = engine
        .submit(Request::new(distinct_ids(24, 8), no_eos(3)))
        .unwrap();
    let quick_id = quick.id();
    let done = wait_past_held(
        tiers,
        quick,
        "the quick request waited for the slow request's load",
    );
    assert_eq!(done.completion_tokens, 3);
    // The slow request is still waiting for its load: it neither ran nor was dropped.
    assert_eq!(tiers.loads_waiting(), 1);
    let log = engine.step_log();
    assert!(
        log.iter().any(|s| s.admit_waited_load),
        "no step saw a request still loading"
    );
    assert!(log
        .iter()
        .any(|s| s.prefilled.is_some_and(|p| p.0 == quick_id)
            || s.riders.iter().any(|r| r.0 == quick_id)));
    tiers.release_loads();
    let slow = slow.wait().unwrap();
    assert_eq!(slow.completion_tokens, 2);
    assert!(
        slow.cached_tokens > 0,
        "the held load was restored once released"
    );
    assert!(slow.reuse.prefetched);
}

/// An engine on the store at `dir` with one I/O worker (a held load then holds every lookup
/// behind it) that has answered `prompt` (2 tokens) and flushed it to the store.
fn one_worker_engine_with(dir: &std::path::Path, prompt: Vec<u32>) -> (Arc<Engine>, Vec<u32>) {
    let engine = open_engine(
        dir,
        EngineConfig {
            io_workers: 1,
            ..logged(4)
        },
    );
    engine
        .submit(Request::new(prompt.clone(), no_eos(2)))
        .unwrap()
        .wait()
        .unwrap();
    engine.flush().unwrap();
    (engine, prompt)
}

/// Admission waits for a queued request's lookup only where the lookup can find something.
/// With one I/O worker, held at the gate by another request's load, a request whose prefix
/// the store lacks (nothing past the device tier's match) is admitted and answered while its
/// own lookup is still queued behind the held one; a request whose prefix the store holds
/// (the device tier emptied) waits for its lookup and then restores from RAM. From the
/// engine's counters and step log, not from timing.
#[test]
fn admission_waits_only_for_lookups_that_can_find_something() {
    let dir = tempfile::tempdir().unwrap();
    let (engine, stored) = one_worker_engine_with(dir.path(), distinct_ids(40, 23));
    let tiers = engine.kv_tiers().expect("a prefix cache");
    // In the store (RAM) and then off the device: only a lookup finds it.
    tiers
        .set_kv_budget(tiers.resident_stats().budget_bytes)
        .unwrap();
    assert_eq!(tiers.resident_stats().sequences, 0);
    let before = engine.metrics().loads_not_waited;
    // The one I/O worker is busy with a held load from here on.
    let held = submit_held(&engine, distinct_ids(24, 21), 2);
    let mut extended = stored.clone();
    extended.extend(distinct_ids(8, 24));
    let waits = engine.submit(Request::new(extended, no_eos(2))).unwrap();
    let fresh = engine
        .submit(Request::new(distinct_ids(24, 22), no_eos(3)))
        .unwrap();
    let (waits_id, fresh_id) = (waits.id(), fresh.id());
    let done = wait_past_held(
        tiers,
        fresh,
        "a request with nothing to load waited for its lookup",
    );
    // Read before the held load is released (an assertion failing while it is held would
    // leave the engine's I/O worker waiting at the gate for ever).
    let runs = |s: &engine::StepRecord, id: u64| {
        s.prefilled.is_some_and(|p| p.0 == id) || s.riders.iter().any(|r| r.0 == id)
    };
    let log = engine.step_log();
    let (not_waited, still_loading) = (engine.metrics().loads_not_waited, tiers.loads_waiting());
    tiers.release_loads();
    assert_eq!(done.completion_tokens, 3);
    assert_eq!(done.cached_tokens, 0);
    assert!(not_waited > before);
    assert!(log.iter().any(|s| runs(s, fresh_id)));
    // The request whose prefix is in the store had not run: its lookup was still queued.
    assert!(!log.iter().any(|s| runs(s, waits_id)), "{log:?}");
    assert_eq!(still_loading, 1);
    let waited = waits.wait().unwrap();
    assert_eq!(waited.completion_tokens, 2);
    assert!(waited.reuse.prefetched);
    // Its lookup found the stored blocks (restored, or left to the prefill by the cost
    // model).
    let r = &waited.reuse;
    let found =
        r.cached_ram_tokens + r.cached_ssd_tokens + r.ram_blocks_skipped + r.ssd_blocks_skipped;
    assert!(found > 0, "{r:?}");
    assert_eq!(held.wait().unwrap().completion_tokens, 2);
}

/// A lookup that admission did not wait for reads nothing when it finally runs. With one
/// I/O worker held by another request's load, a request extending a stored prompt takes
/// that prompt from the device tier (a hand-over) and decodes; its lookup, queued behind
/// the held one, then finds the device tier without the prefix, yet stops before reading
/// the store's copy of it (reads count as uses of blocks nobody took).
#[test]
fn an_abandoned_lookup_reads_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (engine, stored) = one_worker_engine_with(dir.path(), distinct_ids(40, 31));
    let tiers = engine.kv_tiers().expect("a prefix cache");
    let held = submit_held(&engine, distinct_ids(24, 32), 2);
    let mut longer = stored.clone();
    longer.extend(distinct_ids(8, 33));
    let mut row = engine
        .submit(Request::new(longer, no_eos(100_000)))
        .unwrap();
    wait_first_token(&mut row);
    let ram_hits = tiers.stats().ram_hits;
    tiers.release_loads();
    let t = Instant::now();
    while tiers.loads_abandoned() == 0 && t.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(1));
    }
    let (abandoned, hits_after) = (tiers.loads_abandoned(), tiers.stats().ram_hits);
    row.cancel();
    assert_eq!(held.wait().unwrap().completion_tokens, 2);
    assert_eq!(
        abandoned, 1,
        "the lookup the request was admitted without ran on"
    );
    assert_eq!(hits_after, ram_hits, "an abandoned lookup read the store");
}

/// An idle engine prefills a prompt chunk after chunk; a request that arrives meanwhile
/// is admitted at the next chunk boundary and shares the next pass, so it waits for one
/// chunk of the long prompt, not all of them (from the step log: its prefill comes before
/// the long prompt's last chunk). Before, it waited for the whole prompt (an idle engine
/// ran every chunk back to back in one step): a
/// burst whose later loads finished after the first request's admission queued behind the
/// first's whole prefill (docs/server.md, "Arrivals during a prefill").
#[test]
fn an_arrival_joins_an_idle_engines_prefill_at_the_next_chunk() {
    let dir = tempfile::tempdir().unwrap();
    let engine = fewest_new_engine(dir.path(), 4, 8);
    let mut conclusive = 0;
    for round in 0..6u32 {
        let long = distinct_ids(480, 100 + 2 * round);
        let params = GenerateParams {
            prefill_chunk: 8,
            ..no_eos(1)
        };
        let sent_long = Instant::now();
        let long = engine.submit(Request::new(long, params)).unwrap();
        // Once the long prompt holds its KV reservation it is admitted, and its 60 chunks
        // run back to back.
        while engine.metrics().kv_reserved_bytes == 0 {
            std::thread::yield_now();
        }
        let sent_short = sent_long.elapsed().as_secs_f64();
        let short = engine
            .submit(Request::new(distinct_ids(12, 101 + 2 * round), no_eos(1)))
            .unwrap();
        let (long_id, short_id) = (long.id(), short.id());
        let long = long.wait().unwrap();
        assert_eq!(short.wait().unwrap().completion_tokens, 1);
        // Conclusive where the short request came after the long one's admission and in
        // the first half of its prefill (it would otherwise have queued with it, or met
        // its last chunks).
        let admitted = long.queue_s;
        let prefilled = long.queue_s + long.ttft_s;
        if sent_short <= admitted || sent_short >= admitted + (prefilled - admitted) / 2.0 {
            continue;
        }
        conclusive += 1;
        let log = engine.step_log();
        let holds = |s: &engine::StepRecord, id: u64| {
            s.prefilled.is_some_and(|(p, _)| p == id) || s.riders.iter().any(|r| r.0 == id)
        };
        let short_at = log
            .iter()
            .position(|s| holds(s, short_id))
            .expect("the short prompt's prefill is in the step log");
        let long_steps: Vec<usize> = (0..log.len())
            .filter(|&i| holds(&log[i], long_id))
            .collect();
        let long_last = *long_steps.last().unwrap();
        assert!(
            short_at < long_last,
            "the short prompt (step {short_at}) waited for the long one's whole prefill \
             (steps {long_steps:?})"
        );
        // The long prompt was cut at a chunk boundary: its first step prefilled part of it.
        let first = &log[long_steps[0]];
        let first_tokens = first
            .prefilled
            .filter(|p| p.0 == long_id)
            .map_or(0, |p| p.1);
        assert!(first_tokens < 480, "{first:?}");
        if conclusive >= 2 {
            break;
        }
    }
    assert!(
        conclusive > 0,
        "no round sent the short prompt inside the first half of the long one's prefill"
    );
}

/// An engine with mixed steps, the fewest-new prefill order and a step log, of
/// `max_batch` rows and `prefill_chunk`-token passes.
fn fewest_new_engine(dir: &std::path::Path, max_batch: usize, prefill_chunk: usize) -> Arc<Engine> {
    open_engine(
        dir,
        EngineConfig {
            max_batch,
            prefill_chunk,
            mixed_steps: Some(true),
            step_log: 100_000,
            prefill_order: engine::PrefillOrder::FewestNew,
            ..EngineConfig::default()
        },
    )
}

/// Waits until the step log shows a step that prefilled (part of) request `id`'s prompt.
fn wait_prefilling(engine: &Engine, id: u64) {
    let t = Instant::now();
    while !engine.step_log().iter().any(|s| {
        s.prefilled.is_some_and(|(p, _)| p == id) || s.riders.iter().any(|(p, _)| *p == id)
    }) {
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "request {id} did not start prefilling"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Waits for `h`'s first token (panics on a failure or an end without one).
fn wait_first_token(h: &mut engine::RequestHandle) {
    loop {
        match h.recv_blocking() {
            Some(Event::Token { .. }) => return,
            Some(Event::Failed(e)) => panic!("{e}"),
            Some(_) => {}
            None => panic!("no token"),
        }
    }
}

/// Prompt tokens a step prefilled: its chunk and its riders'.
fn step_prefill(s: &engine::StepRecord) -> usize {
    s.prefilled.map_or(0, |p| p.1) + s.riders.iter().map(|r| r.1).sum::<usize>()
}

/// Where riders go: in the decode pass (mixed steps), in a prefill pass of their own
/// beside it (two passes), or in a prefill pass with nothing decoding (an idle engine).
#[derive(Clone, Copy, Debug, PartialEq)]
enum RideIn {
    DecodePass,
    OwnPass,
    Idle,
}

/// Short prompts that arrive together ride in one pass with the oldest one's chunk: some
/// step prefills several of them at once (riders), no step prefills more than the chunk,
/// every prompt token is prefilled exactly once and every request completes. Where the riders went is read from
/// the step log: with a row decoding in mixed steps or in two passes, or with nothing
/// decoding (requests of one token each on an idle engine).
fn short_prompts_ride_together(mode: RideIn) {
    let chunk = 64;
    let dir = tempfile::tempdir().unwrap();
    let engine = open_engine(
        dir.path(),
        EngineConfig {
            max_batch: 16,
            prefill_chunk: chunk,
            mixed_steps: Some(mode == RideIn::DecodePass),
            step_log: 100_000,
            ..EngineConfig::default()
        },
    );
    let (ids, params) = (distinct_ids, no_eos);
    let a = (mode != RideIn::Idle).then(|| {
        let mut a = engine
            .submit(Request::new(ids(12, 1), params(100_000)))
            .unwrap();
        wait_first_token(&mut a);
        a
    });
    let each = if mode == RideIn::Idle { 1 } else { 3 };
    let mut lens = std::collections::HashMap::new();
    let mut prefill_s = std::collections::HashMap::new();
    let mut rode = false;
    for round in 0..5u32 {
        // A burst: each submission takes microseconds, an engine step milliseconds.
        let handles: Vec<_> = (0..4u32)
            .map(|i| {
                let prompt = ids(5 + 3 * i, 10 + 4 * round + i);
                let h = engine
                    .submit(Request::new(prompt.clone(), params(each)))
                    .unwrap();
                lens.insert(h.id(), prompt.len());
                h
            })
            .collect();
        for h in handles {
            let id = h.id();
            let done = h.wait().unwrap();
            assert_eq!(done.completion_tokens, each);
            prefill_s.insert(id, done.reuse.prefill_s);
        }
        if engine.step_log().iter().any(|s| !s.riders.is_empty()) {
            rode = true;
            break;
        }
    }
    if let Some(a) = &a {
        a.cancel();
    }
    assert!(rode, "{mode:?}: no step carried riders in five bursts");
    let log = engine.step_log();
    let mut prefilled = std::collections::HashMap::new();
    for s in &log {
        assert!(step_prefill(s) <= chunk, "{s:?}");
        for &(id, n) in s.prefilled.iter().chain(&s.riders) {
            *prefilled.entry(id).or_insert(0) += n;
        }
        if !s.riders.is_empty() {
            assert_pass_charged(s);
            match &a {
                Some(a) => assert!(
                    s.decoded.contains(&a.id()),
                    "riders without a decode: {s:?}"
                ),
                None => assert!(s.decoded.is_empty(), "{mode:?}: a row decoded: {s:?}"),
            }
        }
    }
    for (id, n) in &lens {
        assert_eq!(
            prefilled.get(id),
            Some(n),
            "{mode:?}: request {id}'s prompt prefilled once"
        );
    }
    // What a pass charged a prompt is in the prefill time its report (and the cost
    // model's sample, recorded with it) holds: charged before its first pick.
    let mut charged = std::collections::HashMap::new();
    for s in &log {
        for &(id, us) in &s.prefill_charged_us {
            *charged.entry(id).or_insert(0u64) += us;
        }
    }
    for (id, secs) in &prefill_s {
        let us = charged.get(id).copied().unwrap_or(0);
        assert!(
            *secs * 1e6 + 2.0 >= us as f64,
            "{mode:?}: request {id} reports {secs} s of prefill, its passes charged {us} µs"
        );
    }
}

/// A step whose prefill pass carried riders charged the pass to each of its prompts (the
/// chunk's and every rider's), in proportion to their tokens.
fn assert_pass_charged(s: &engine::StepRecord) {
    let parts: Vec<(u64, usize)> = s.prefilled.iter().chain(&s.riders).copied().collect();
    let ids: Vec<u64> = s.prefill_charged_us.iter().map(|c| c.0).collect();
    let mut want: Vec<u64> = parts.iter().map(|p| p.0).collect();
    let mut got = ids.clone();
    want.sort_unstable();
    got.sort_unstable();
    assert_eq!(got, want, "not every prompt of the pass was charged: {s:?}");
    let total_us: u64 = s.prefill_charged_us.iter().map(|c| c.1).sum();
    let total_tokens: usize = parts.iter().map(|p| p.1).sum();
    for &(id, us) in &s.prefill_charged_us {
        let n = parts.iter().find(|p| p.0 == id).unwrap().1;
        let share = total_us as f64 * n as f64 / total_tokens as f64;
        assert!(
            (us as f64 - share).abs() <= parts.len() as f64,
            "request {id} charged {us} µs of {total_us}, not its {n} of {total_tokens} tokens: {s:?}"
        );
    }
}

#[test]
fn short_prompts_ride_together_in_one_mixed_step() {
    short_prompts_ride_together(RideIn::DecodePass);
}

#[test]
fn short_prompts_ride_together_in_a_prefill_pass_beside_the_decode_pass() {
    short_prompts_ride_together(RideIn::OwnPass);
}

#[test]
fn short_prompts_arriving_at_an_idle_engine_ride_together() {
    short_prompts_ride_together(RideIn::Idle);
}

/// Token ids and the completion of a request run to its end.
fn run_to_end(
    engine: &Engine,
    req: Request,
    cancel_after: Option<usize>,
) -> (Vec<u32>, engine::Completion) {
    let mut h = engine.submit(req).unwrap();
    let mut tokens = Vec::new();
    loop {
        match h.recv_blocking() {
            Some(Event::Token { sampled, .. }) => {
                tokens.push(sampled.token);
                if Some(tokens.len()) == cancel_after {
                    h.cancel_handle().cancel();
                }
            }
            Some(Event::Finished(c)) => return (tokens, c),
            Some(Event::Failed(e)) => panic!("{e}"),
            Some(_) => {}
            None => panic!("no completion"),
        }
    }
}

/// The batched decode runs a step ahead of what it has read: a row that ends (at its token
/// budget, or cancelled with a step already queued) must leave only the KV of what it
/// emitted. The next turn, which extends the previous prompt and reply, then reuses that
/// KV and decodes exactly what a cold engine decodes.
#[test]
fn a_turn_after_a_pipelined_reply_reuses_it_and_decodes_as_cold() {
    let (ids, params) = (distinct_ids, no_eos);
    for cancel_after in [None, Some(3)] {
        let warm_dir = tempfile::tempdir().unwrap();
        let warm = open_engine(warm_dir.path(), EngineConfig::default());
        let prompt = ids(21, 7);
        let (reply, first) = run_to_end(
            &warm,
            Request::new(prompt.clone(), params(12)),
            cancel_after,
        );
        match cancel_after {
            None => assert_eq!(reply.len(), 12),
            Some(n) => {
                assert_eq!(first.finish_reason, FinishReason::Cancelled);
                assert!(reply.len() >= n, "{reply:?}");
            }
        }
        let next: Vec<u32> = prompt
            .iter()
            .chain(&reply)
            .copied()
            .chain(ids(5, 9))
            .collect();
        let (warm_out, warm_done) = run_to_end(&warm, Request::new(next.clone(), params(10)), None);
        assert!(
            warm_done.cached_tokens >= prompt.len() + reply.len() - 1,
            "{cancel_after:?}: cached {} of {} + {}",
            warm_done.cached_tokens,
            prompt.len(),
            reply.len()
        );
        let cold_dir = tempfile::tempdir().unwrap();
        let cold = open_engine(cold_dir.path(), EngineConfig::default());
        let (cold_out, cold_done) = run_to_end(&cold, Request::new(next, params(10)), None);
        assert_eq!(cold_done.cached_tokens, 0);
        assert_eq!(warm_out, cold_out, "{cancel_after:?}");
    }
}

#[test]
fn a_kv_budget_queues_requests_and_refuses_oversized_ones() {
    let dir = tempfile::tempdir().unwrap();
    let (model, _) = load(&goldens().join(MODEL), &LoadOptions::default()).unwrap();
    let kv = model.info().kv;
    let per_token = (kv.layers * 2 * kv.kv_heads * kv.head_dim * 4) as u64;
    drop(model);
    // Room for one 64-token reservation at a time.
    let engine = open_engine(
        dir.path(),
        EngineConfig {
            kv_budget_bytes: 100 * per_token,
            ..EngineConfig::default()
        },
    );
    let prompt: Vec<u32> = (10..30).collect();
    let req = |max_tokens| Request {
        prompt: prompt.clone(),
        params: GenerateParams {
            max_tokens,
            stop_at_eos: false,
            ..GenerateParams::default()
        },
        cache_salt: None,
    };
    assert!(matches!(
        engine.submit(req(400)),
        Err(SubmitError::OverBudget { .. })
    ));
    let hs: Vec<_> = (0..3).map(|_| engine.submit(req(40)).unwrap()).collect();
    for h in hs {
        assert_eq!(h.wait().unwrap().completion_tokens, 40);
    }
    let m = engine.metrics();
    assert_eq!(
        m.decode_rows, m.decode_steps,
        "one row at a time under this budget"
    );
}

#[test]
fn smollm2_serves_two_concurrent_requests_like_generate() {
    let Some(path) = crate::common::smollm2() else {
        return;
    };
    let (model, tok) = load(&path, &LoadOptions::default()).unwrap();
    let prompts: Vec<Vec<u32>> = ["What is 2+2?", "Name a colour."]
        .iter()
        .map(|q| {
            tok.encode_chat(
                &json!([{"role": "user", "content": q}]).to_string(),
                None,
                true,
            )
            .unwrap()
        })
        .collect();
    let params = GenerateParams {
        max_tokens: 6,
        ..GenerateParams::default()
    };
    let want: Vec<String> = prompts
        .iter()
        .map(|p| {
            generate(
                &model,
                &tok,
                &mut model.new_cache(),
                p,
                &params,
                &mut |_| true,
            )
            .unwrap()
            .text
        })
        .collect();
    let engine = Engine::open(model, tok, None, EngineConfig::default()).unwrap();
    let hs: Vec<_> = prompts
        .iter()
        .map(|p| {
            engine
                .submit(Request::new(p.clone(), params.clone()))
                .unwrap()
        })
        .collect();
    let got: Vec<String> = hs.into_iter().map(|h| h.wait().unwrap().text).collect();
    assert_eq!(got, want);
}

// ---- Hostile clients (issue 21) ----

/// Reads from `s` until the server closes it; the time that took, or `None` if it was
/// still open after `within`.
fn closed_within(s: &mut TcpStream, within: Duration) -> Option<Duration> {
    let t = Instant::now();
    s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
    let mut buf = [0u8; 4096];
    while t.elapsed() < within {
        match s.read(&mut buf) {
            Ok(0) => return Some(t.elapsed()),
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => return Some(t.elapsed()),
        }
    }
    None
}

fn short_limits() -> ConnectionLimits {
    ConnectionLimits {
        keep_alive_timeout: Duration::from_millis(300),
        header_read_timeout: Duration::from_millis(500),
        body_read_timeout: Duration::from_millis(500),
        ..ConnectionLimits::default()
    }
}

#[test]
fn idle_and_kept_alive_connections_are_closed_after_the_keep_alive_timeout() {
    let srv = Server::start_with(None, EngineConfig::default(), short_limits());
    // Connects and sends nothing.
    let mut silent = TcpStream::connect(srv.addr).unwrap();
    let t = closed_within(&mut silent, Duration::from_secs(10));
    assert!(t.is_some(), "a silent connection stayed open");
    // One request on a keep-alive connection, then silence.
    let mut kept = TcpStream::connect(srv.addr).unwrap();
    write!(kept, "GET /health HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut buf = [0u8; 1024];
    let n = kept.read(&mut buf).unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    let t = closed_within(&mut kept, Duration::from_secs(10))
        .expect("kept-alive connection stayed open");
    assert!(t >= Duration::from_millis(200), "closed too early: {t:?}");
    // The server still answers.
    assert_eq!(srv.request("GET", "/health", None, "").status, 200);
}

#[test]
fn a_slow_header_sender_is_cut_off_by_the_header_read_timeout() {
    let limits = ConnectionLimits {
        keep_alive_timeout: Duration::from_secs(30),
        ..short_limits()
    };
    let srv = Server::start_with(None, EngineConfig::default(), limits);
    let mut s = TcpStream::connect(srv.addr).unwrap();
    write!(s, "GET /health HTTP/1.1\r\nHost: x\r\n").unwrap();
    let t = Instant::now();
    // One header byte every 100 ms: always active, never done.
    let mut closed = false;
    while t.elapsed() < Duration::from_secs(10) {
        if s.write_all(b"X").is_err() {
            closed = true;
            break;
        }
        if closed_within(&mut s, Duration::from_millis(100)).is_some() {
            closed = true;
            break;
        }
    }
    assert!(closed, "a slowloris client kept its connection for 10 s");
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
}

#[test]
fn a_body_that_never_arrives_gets_408() {
    let srv = Server::start_with(None, EngineConfig::default(), short_limits());
    let mut s = TcpStream::connect(srv.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: 100\r\n\r\n{{\"prompt\""
    )
    .unwrap();
    let t = Instant::now();
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let r = Response::parse(&raw);
    assert_eq!(r.status, 408, "{}", r.body);
    assert_eq!(r.error()["code"], "request_timeout");
    assert!(t.elapsed() < Duration::from_secs(5));
}

/// The status of a `GET /health` on a fresh connection, whatever happened to the write;
/// `None` when no status line came back.
fn health_status(addr: std::net::SocketAddr) -> Option<u16> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    let _ = s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let text = String::from_utf8_lossy(&raw);
    text.strip_prefix("HTTP/1.1 ")?.get(..3)?.parse().ok()
}

#[test]
fn connections_over_the_cap_get_503_with_retry_after() {
    let limits = ConnectionLimits {
        keep_alive_timeout: Duration::from_secs(30),
        max_connections: 3,
        ..ConnectionLimits::default()
    };
    let srv = Server::start_with(None, EngineConfig::default(), limits);
    let held: Vec<TcpStream> = (0..3)
        .map(|_| TcpStream::connect(srv.addr).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    let mut over = TcpStream::connect(srv.addr).unwrap();
    over.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut raw = Vec::new();
    let _ = over.read_to_end(&mut raw);
    let text = String::from_utf8_lossy(&raw);
    assert!(text.starts_with("HTTP/1.1 503"), "{text}");
    assert!(text.contains("Retry-After: 1"), "{text}");
    drop(held);
    // Slots come back when connections close.
    let t = Instant::now();
    loop {
        // A connection still over the cap is answered 503 and closed, possibly before the
        // request is written (a broken pipe): only the status line it read counts.
        let status = health_status(srv.addr);
        if status == Some(200) {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "slots never came back"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn json_endpoints_need_a_json_content_type() {
    let srv = Server::start(None, EngineConfig::default());
    let body = chat("hi", 2).to_string();
    for ct in ["text/plain", "application/x-www-form-urlencoded", ""] {
        let mut s = TcpStream::connect(srv.addr).unwrap();
        let header = if ct.is_empty() {
            String::new()
        } else {
            format!("Content-Type: {ct}\r\n")
        };
        write!(
            s,
            "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{header}\
             Content-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).unwrap();
        let r = Response::parse(&raw);
        assert_eq!(r.status, 415, "{ct}: {}", r.body);
        assert_eq!(r.error()["code"], "unsupported_media_type");
    }
    assert_eq!(srv.idle().requests_submitted, 0);
    // With a charset it is JSON.
    let mut s = TcpStream::connect(srv.addr).unwrap();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\
         Content-Type: application/json; charset=utf-8\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    assert_eq!(Response::parse(&raw).status, 200);
}

/// Overload is the server's passing condition, not the client's mistake: 503 with
/// `Retry-After`, as OpenAI answers "the engine is currently overloaded".
#[test]
fn a_full_queue_answers_503_with_retry_after() {
    let srv = Server::start(
        None,
        EngineConfig {
            max_queue: 0,
            ..EngineConfig::default()
        },
    );
    let mut s = srv.send(
        "POST",
        "/v1/chat/completions",
        None,
        &chat("hi", 2).to_string(),
    );
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let text = String::from_utf8_lossy(&raw).to_ascii_lowercase();
    assert!(text.starts_with("http/1.1 503"), "{text}");
    assert!(text.contains("retry-after: 1\r\n"), "{text}");
    let e = Response::parse(&raw).error();
    assert_eq!(e["type"], "server_error");
    assert_eq!(e["code"], "queue_full");
}

/// Asserts the OpenAI error shape with all four fields, and returns the error object.
fn openai_error(r: &Response, status: u16) -> Value {
    assert_eq!(r.status, status, "{}", r.body);
    let e = r.error();
    for field in ["message", "type", "param", "code"] {
        assert!(e.get(field).is_some(), "no {field} in {e}");
    }
    e
}

/// A 4xx condition met only at admission (the engine's cap on cache salts) is the client's,
/// not a 500 as it was when every failure after submission became a 500.
#[test]
fn a_refusal_at_admission_is_a_400_naming_the_parameter() {
    // 4,096 namespaces are 4,096 fsync'd registrations: on tmpfs where there is one
    // (37 s on the development VM's disk, under a second on /dev/shm).
    let shm = std::path::Path::new("/dev/shm");
    let dir = if shm.is_dir() {
        tempfile::tempdir_in(shm).unwrap()
    } else {
        tempfile::tempdir().unwrap()
    };
    let engine = open_engine(dir.path(), EngineConfig::default());
    let srv = Server::serve(engine, server_config(None), ConnectionLimits::default());
    let prefix = srv.engine.kv_tiers().unwrap();
    // Fill the engine's table of salted namespaces (4,096) through the library.
    let mut n = 0;
    while prefix.namespace_for(Some(&format!("filler-{n}"))).is_ok() {
        n += 1;
        assert!(n <= 100_000, "the cache salt cap never came");
    }
    assert_eq!(n, 4096);
    let mut body = chat("hi", 2);
    body["cache_salt"] = json!("one-too-many");
    let e = openai_error(&srv.post("/v1/chat/completions", &body), 400);
    assert_eq!(e["type"], "invalid_request_error");
    assert_eq!(e["param"], "cache_salt");
    assert!(e["message"].as_str().unwrap().contains("4096"), "{e}");
    // A known salt is still served.
    body["cache_salt"] = json!("filler-7");
    assert_eq!(srv.post("/v1/chat/completions", &body).status, 200);
}

#[test]
fn a_poisoned_lock_is_a_500_not_the_clients_fault() {
    let srv = Server::start(None, EngineConfig::default());
    let prefix = srv.engine.kv_tiers().unwrap();
    std::thread::scope(|s| {
        let poisoner = s.spawn(|| {
            let _held = prefix.resident().unwrap();
            panic!("a thread dies holding the device tier's lock (expected in this test)");
        });
        assert!(poisoner.join().is_err());
    });
    let e = openai_error(&srv.post("/v1/chat/completions", &chat("hi", 2)), 500);
    assert_eq!(e["type"], "server_error");
    assert_eq!(e["code"], "internal_error");
    assert!(e["param"].is_null(), "{e}");
    assert!(
        e["message"].as_str().unwrap().contains("prefix cache lock"),
        "{e}"
    );
}

#[test]
fn a_failed_batch_step_is_a_500_streamed_or_not() {
    let srv = Server::start(None, EngineConfig::default());
    srv.engine.inject_fault(InjectedFault::FailNextStep);
    let e = openai_error(&srv.post("/v1/chat/completions", &chat("hi", 8)), 500);
    assert_eq!(e["type"], "server_error");
    assert_eq!(e["code"], "internal_error");
    assert!(
        e["message"]
            .as_str()
            .unwrap()
            .contains("generation step failed"),
        "{e}"
    );
    // Streamed: the status is already sent, so the error object is the last event.
    srv.engine.inject_fault(InjectedFault::FailNextStep);
    let mut body = chat("hi", 8);
    body["stream"] = json!(true);
    let r = srv.post("/v1/chat/completions", &body);
    assert_eq!(r.status, 200);
    let events = r.events();
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    let last: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(last["error"]["type"], "server_error", "{events:?}");
    assert_eq!(last["error"]["code"], "internal_error", "{events:?}");
    // The engine goes on serving.
    assert_eq!(srv.post("/v1/chat/completions", &chat("hi", 2)).status, 200);
    assert_eq!(srv.engine.metrics().requests_failed, 2);
}

/// A prefill that fails after admission is the engine's failure even when the error's
/// type reads like a bad argument (the model's checks on its inputs raise those).
#[test]
fn a_failed_prefill_is_a_500_whatever_the_errors_type() {
    let srv = Server::start(None, EngineConfig::default());
    srv.engine.inject_fault(InjectedFault::FailNextPrefill);
    let e = openai_error(&srv.post("/v1/chat/completions", &chat("hi", 4)), 500);
    assert_eq!(e["type"], "server_error");
    assert_eq!(e["code"], "internal_error");
    assert!(e["param"].is_null(), "{e}");
    assert!(
        e["message"].as_str().unwrap().contains("fault injected"),
        "{e}"
    );
    assert_eq!(srv.post("/v1/chat/completions", &chat("hi", 2)).status, 200);
}

#[test]
fn a_vanished_engine_thread_is_a_500_and_fails_the_health_check() {
    let srv = Server::start(None, EngineConfig::default());
    // Two requests in flight when the engine thread dies, one of them streamed.
    let mut body = chat("Tell me a very long story.", 2000);
    let mut whole = srv.send("POST", "/v1/chat/completions", None, &body.to_string());
    body["stream"] = json!(true);
    let mut streamed = srv.send("POST", "/v1/chat/completions", None, &body.to_string());
    let t = Instant::now();
    while srv.engine.metrics().active_rows < 2 || srv.engine.metrics().generated_tokens < 6 {
        assert!(t.elapsed() < Duration::from_secs(60), "never decoded");
        std::thread::sleep(Duration::from_millis(5));
    }
    srv.engine.inject_fault(InjectedFault::PanicEngineThread);
    let mut raw = Vec::new();
    whole.read_to_end(&mut raw).unwrap();
    let e = openai_error(&Response::parse(&raw), 500);
    assert_eq!(e["code"], "engine_stopped");
    let mut raw = Vec::new();
    streamed.read_to_end(&mut raw).unwrap();
    let r = Response::parse(&raw);
    assert_eq!(r.status, 200);
    let events = r.events();
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    let last: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(last["error"]["code"], "engine_stopped", "{events:?}");
    // The thread ends once it has unwound (its channels close first).
    let t = Instant::now();
    while srv.engine.is_running() {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the engine thread never ended"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // New requests: the engine's failure (500), not a shutdown (503) or a bad request (400).
    let e = openai_error(&srv.post("/v1/chat/completions", &chat("hi", 2)), 500);
    assert_eq!(e["type"], "server_error");
    assert_eq!(e["code"], "engine_stopped");
    let health = srv.request("GET", "/health", None, "");
    assert_eq!(health.status, 503, "{}", health.body);
    assert_eq!(health.json()["status"], "engine_stopped");
}

#[test]
fn token_ids_past_u32_are_a_400_naming_the_value() {
    let srv = Server::start(None, EngineConfig::default());
    let r = srv.post(
        "/v1/completions",
        &json!({"prompt": [1, 4294967296u64], "max_tokens": 1}),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    let e = r.error();
    assert_eq!(e["param"], "prompt");
    assert!(e["message"].as_str().unwrap().contains("4294967296"), "{e}");
    let r = srv.post(
        "/v1/completions",
        &json!({"prompt": [1, 4000000000u64], "max_tokens": 1}),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("4000000000"), "{}", r.body);
}

/// Starts a long request, waits until it decodes, cancels everything as a shutdown past its
/// grace period does, and returns the raw response.
fn cut_off_by_shutdown(stream: bool) -> Response {
    let srv = Server::start(None, EngineConfig::default());
    let mut body = chat("Tell me a very long story.", 2000);
    body["stream"] = json!(stream);
    let mut s = srv.send("POST", "/v1/chat/completions", None, &body.to_string());
    let t = Instant::now();
    while srv.engine.metrics().generated_tokens < 3 {
        assert!(t.elapsed() < Duration::from_secs(60), "never decoded");
        std::thread::sleep(Duration::from_millis(5));
    }
    srv.engine.shutdown(true).unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    Response::parse(&raw)
}

#[test]
fn a_request_cut_off_by_shutdown_is_an_error_not_a_stop() {
    let r = cut_off_by_shutdown(false);
    assert_eq!(r.status, 503, "{}", r.body);
    let e = r.error();
    assert_eq!(e["code"], "request_cancelled");
    assert!(!r.body.contains("finish_reason"), "{}", r.body);
}

#[test]
fn a_stream_cut_off_by_shutdown_ends_with_an_error_object() {
    let r = cut_off_by_shutdown(true);
    assert_eq!(r.status, 200);
    let events = r.events();
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    let last: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(last["error"]["code"], "request_cancelled", "{events:?}");
    for e in &events[..events.len() - 2] {
        let v: Value = serde_json::from_str(e).unwrap();
        let reason = &v["choices"][0]["finish_reason"];
        assert!(reason.is_null(), "a cut-off stream claims {reason}: {e}");
    }
}

// Tool calls. The tiny random models never write a call, so these servers script the reply's
// text (`engine::server::scripted_router`, test-only): the model still runs and the engine, the
// cache and the streaming are real; each generated token's text is replaced by the next
// piece, and the pieces left over when generation ends come at the end.

/// A tool call as the Qwen-style template teaches it, cut where a streamed reply may cut it.
pub(crate) const SCRIPTED_CALL: [&str; 5] = [
    "Let me check. ",
    "<tool_",
    "call>\n{\"name\": \"get_weather\", ",
    "\"arguments\": {\"city\": \"Paris\", \"days\": 2}}",
    "\n</tool_call>",
];

/// What the model "wrote": the pieces of [`SCRIPTED_CALL`] after the text before the call.
const CALL_TEXT: &str =
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 2}}\n</tool_call>";

pub(crate) fn scripted_server(script: &[&str]) -> Server {
    scripted_server_of(MODEL, script)
}

/// [`scripted_server`] over the golden model `model`.
fn scripted_server_of(model: &str, script: &[&str]) -> Server {
    let dir = tempfile::tempdir().unwrap();
    let (model, tok) = load(&goldens().join(model), &LoadOptions::default()).unwrap();
    let reuse = crate::common::reuse_config(dir.path(), 8);
    let prefix = KvTiers::open(&model, &tok, reuse).unwrap();
    let engine = Arc::new(Engine::open(model, tok, Some(prefix), EngineConfig::default()).unwrap());
    let script = script.iter().map(|s| s.to_string()).collect();
    let app = scripted_router(engine.clone(), server_config(None), script);
    let mut srv = Server::serve_app(engine, app, ConnectionLimits::default());
    srv._dir = Some(dir);
    srv
}

fn weather_tools() -> Value {
    // Short: the tiny model's context is 512 tokens, and its tokenizer is byte-level.
    json!([
        {"type": "function", "function": {"name": "get_weather",
            "parameters": {"properties": {"city": {"type": "string"}}}}},
        {"type": "function", "function": {"name": "search"}},
    ])
}

fn tool_chat(max_tokens: usize) -> Value {
    json!({
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "Use the tools."},
            {"role": "user", "content": "Weather in Paris?"},
        ],
        "tools": weather_tools(),
        "max_tokens": max_tokens,
    })
}

fn chunks(r: &Response) -> Vec<Value> {
    let events = r.events();
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{}",
        r.body
    );
    events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect()
}

#[test]
fn a_reply_holding_a_tool_call_is_answered_with_tool_calls() {
    let srv = scripted_server(&SCRIPTED_CALL);
    let r = srv.post("/v1/chat/completions", &tool_chat(16));
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
    assert_eq!(choice["message"]["role"], "assistant");
    assert_eq!(choice["message"]["content"], "Let me check.");
    let calls = choice["message"]["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1, "{v}");
    assert_eq!(calls[0]["type"], "function");
    assert!(calls[0]["id"].as_str().unwrap().starts_with("call_"));
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    assert_eq!(
        calls[0]["function"]["arguments"],
        r#"{"city": "Paris", "days": 2}"#
    );

    // Only calls: content is null. Two requests never share a call id.
    let srv = scripted_server(&[CALL_TEXT]);
    let ids: Vec<Value> = (0..2)
        .map(|_| {
            let v = srv.post("/v1/chat/completions", &tool_chat(4)).json();
            assert_eq!(v["choices"][0]["message"]["content"], Value::Null, "{v}");
            assert_eq!(v["choices"][0]["finish_reason"], "tool_calls", "{v}");
            v["choices"][0]["message"]["tool_calls"][0]["id"].clone()
        })
        .collect();
    assert_ne!(ids[0], ids[1]);
}

#[test]
fn a_streamed_tool_call_arrives_as_tool_call_deltas() {
    let srv = scripted_server(&SCRIPTED_CALL);
    let mut body = tool_chat(16);
    body["stream"] = json!(true);
    let r = srv.post("/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let chunks = chunks(&r);
    let deltas: Vec<&Value> = chunks.iter().map(|c| &c["choices"][0]["delta"]).collect();
    let text: String = deltas
        .iter()
        .filter_map(|d| d["content"].as_str())
        .collect();
    // The opener was held back: no part of the call leaks into content.
    assert_eq!(text, "Let me check. ", "{deltas:?}");
    let calls: Vec<&Value> = deltas
        .iter()
        .filter_map(|d| d["tool_calls"].as_array())
        .flatten()
        .collect();
    assert_eq!(calls.len(), 2, "{deltas:?}");
    assert_eq!(calls[0]["index"], 0);
    assert!(calls[0]["id"].as_str().unwrap().starts_with("call_"));
    assert_eq!(calls[0]["type"], "function");
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    assert_eq!(calls[0]["function"]["arguments"], "");
    assert_eq!(calls[1]["index"], 0);
    assert_eq!(
        calls[1]["function"]["arguments"],
        r#"{"city": "Paris", "days": 2}"#
    );
    let finish: Vec<&Value> = chunks
        .iter()
        .map(|c| &c["choices"][0]["finish_reason"])
        .filter(|f| !f.is_null())
        .collect();
    assert_eq!(finish, [&json!("tool_calls")]);
}

#[test]
fn a_llama_template_gets_llama_json_calls_parsed_whole_and_streamed() {
    let script = [
        "<|python_tag|>",
        "{\"name\": \"get_weather\", ",
        "\"parameters\": {\"city\": \"Paris\"}}",
    ];
    let srv = scripted_server_of("tiny-llama", &script);
    let mut body = tool_chat(8);
    body.as_object_mut().unwrap().remove("model");
    let v = srv.post("/v1/chat/completions", &body).json();
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
    assert_eq!(choice["message"]["content"], Value::Null, "{v}");
    assert_eq!(
        choice["message"]["tool_calls"][0]["function"]["name"],
        "get_weather"
    );
    assert_eq!(
        choice["message"]["tool_calls"][0]["function"]["arguments"],
        r#"{"city": "Paris"}"#
    );
    body["stream"] = json!(true);
    let r = srv.post("/v1/chat/completions", &body);
    let streamed = chunks(&r);
    let calls: Vec<&Value> = streamed
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array())
        .flatten()
        .collect();
    assert_eq!(calls.len(), 2, "{}", r.body);
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    assert_eq!(calls[1]["function"]["arguments"], r#"{"city": "Paris"}"#);
    assert!(!r.body.contains("python_tag"), "{}", r.body);

    // A reply that is text streams as text, as it comes.
    let srv = scripted_server_of("tiny-llama", &["It is ", "sunny."]);
    let r = srv.post("/v1/chat/completions", &body);
    let text: Vec<String> = chunks(&r)
        .iter()
        .filter_map(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .map(String::from)
        })
        .filter(|t| !t.is_empty())
        .collect();
    assert_eq!(text, ["It is ", "sunny."], "{}", r.body);
}

#[test]
fn calls_that_are_not_valid_or_not_asked_for_stay_content() {
    let unknown = "<tool_call>\n{\"name\": \"launch\", \"arguments\": {}}\n</tool_call>";
    let broken = "<tool_call>\n{\"name\": \"search\", \"arguments\": {\"q\": }\n</tool_call>";
    for (text, tool_choice) in [
        (unknown, json!("auto")),
        (broken, json!("auto")),
        (CALL_TEXT, json!("none")),
    ] {
        let srv = scripted_server(&[text]);
        let mut body = tool_chat(4);
        body["tool_choice"] = tool_choice.clone();
        let v = srv.post("/v1/chat/completions", &body).json();
        let choice = &v["choices"][0];
        assert_eq!(choice["message"]["content"], text, "{tool_choice}: {v}");
        assert!(choice["message"].get("tool_calls").is_none(), "{v}");
        assert_ne!(choice["finish_reason"], "tool_calls", "{v}");
        body["stream"] = json!(true);
        let r = srv.post("/v1/chat/completions", &body);
        let chunks = chunks(&r);
        let streamed: String = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
            .collect();
        assert_eq!(streamed, text, "{tool_choice}");
        assert!(!r.body.contains("\"tool_calls\""), "{}", r.body);
    }
}

#[test]
fn tool_choice_none_keeps_the_tools_in_the_prompt() {
    let srv = Server::start(None, EngineConfig::default());
    let prompt_tokens = |choice: Option<&str>| {
        let mut b = tool_chat(1);
        if let Some(c) = choice {
            b["tool_choice"] = json!(c);
        }
        let v = srv.post("/v1/chat/completions", &b).json();
        v["usage"]["prompt_tokens"].as_u64().unwrap()
    };
    let auto = prompt_tokens(None);
    assert_eq!(prompt_tokens(Some("none")), auto);
    assert_eq!(prompt_tokens(Some("auto")), auto);
    let mut without = tool_chat(1);
    without.as_object_mut().unwrap().remove("tools");
    let v = srv.post("/v1/chat/completions", &without).json();
    assert!(v["usage"]["prompt_tokens"].as_u64().unwrap() < auto, "{v}");
}

#[test]
fn malformed_tools_tool_choices_and_response_formats_are_400s() {
    let srv = Server::start(None, EngineConfig::default());
    let with = |key: &str, value: Value| {
        let mut b = tool_chat(2);
        b[key] = value;
        b
    };
    let cases = [
        (
            with(
                "tool_choice",
                json!({"type": "function", "function": {"name": "nope"}}),
            ),
            "tool_choice",
            "not in tools",
        ),
        (
            with("tool_choice", json!("sometimes")),
            "tool_choice",
            "must be",
        ),
        (with("tools", json!({"name": "f"})), "tools", "array"),
        (
            with("tools", json!([{"type": "function"}])),
            "tools",
            "tools[0]",
        ),
        (
            with(
                "tools",
                json!([{"type": "retrieval", "function": {"name": "f"}}]),
            ),
            "tools",
            "tools[0]",
        ),
        (
            with(
                "tools",
                json!([{"type": "function", "function": {"name": ""}}]),
            ),
            "tools",
            "non-empty",
        ),
        (
            with(
                "tools",
                json!([{"type": "function", "function": {"name": "f"}},
                       {"type": "function", "function": {"name": "f"}}]),
            ),
            "tools",
            "twice",
        ),
        (
            with(
                "tools",
                json!((0..129)
                    .map(|i| json!({"type": "function", "function": {"name": format!("f{i}")}}))
                    .collect::<Vec<_>>()),
            ),
            "tools",
            "at most 128",
        ),
        (
            with(
                "tools",
                json!([{"type": "function", "function": {"name": "f", "parameters": "x"}}]),
            ),
            "tools",
            "parameters must be a JSON schema object",
        ),
        (
            with("response_format", json!("json")),
            "response_format",
            "must be",
        ),
        (
            with("response_format", json!({"type": "yaml"})),
            "response_format",
            "must be",
        ),
        (
            with(
                "response_format",
                json!({"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}),
            ),
            "response_format",
            "JSON schema object",
        ),
        (
            with("parallel_tool_calls", json!("no")),
            "parallel_tool_calls",
            "boolean",
        ),
    ];
    for (body, param, says) in cases {
        let e = openai_error(&srv.post("/v1/chat/completions", &body), 400);
        assert_eq!(e["param"], param, "{e}");
        assert_eq!(e["type"], "invalid_request_error", "{e}");
        let msg = e["message"].as_str().unwrap();
        assert!(msg.contains(says), "{msg:?} should say {says:?}");
    }
}

#[test]
fn the_openai_client_reads_tool_calls_streamed_or_not() {
    let python =
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.venv-test/bin/python");
    if !python.is_file() {
        crate::prerequisite::missing(
            &format!("{} is missing", python.display()),
            "run bash scripts/setup.sh (it makes .venv-test with the openai client)",
        );
        return;
    }
    let (srv, first) = tool_writing_server();
    let script = r#"
import json, sys
from openai import OpenAI
client = OpenAI(base_url=sys.argv[1], api_key="unused")
tools = json.loads(sys.argv[2])
messages = json.loads(sys.argv[3])
r = client.chat.completions.create(model="tiny-qwen3", messages=messages, tools=tools, max_tokens=16)
m = r.choices[0].message
first_prompt = r.usage.prompt_tokens
out = {"finish": r.choices[0].finish_reason, "content": m.content,
       "calls": [{"id": c.id, "type": c.type, "name": c.function.name,
                  "arguments": json.loads(c.function.arguments)} for c in m.tool_calls]}
stream = client.chat.completions.create(model="tiny-qwen3", messages=messages, tools=tools,
                                        max_tokens=16, stream=True)
calls, text, finish = {}, "", None
for chunk in stream:
    d = chunk.choices[0].delta
    text += d.content or ""
    for c in d.tool_calls or []:
        acc = calls.setdefault(c.index, {"id": None, "name": "", "arguments": ""})
        acc["id"] = c.id or acc["id"]
        if c.function is not None:
            acc["name"] += c.function.name or ""
            acc["arguments"] += c.function.arguments or ""
    finish = chunk.choices[0].finish_reason or finish
out["stream"] = {"finish": finish, "content": text,
                 "calls": [dict(c, arguments=json.loads(c["arguments"])) for c in calls.values()]}
messages += [m.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "18 C"}]
r = client.chat.completions.create(model="tiny-qwen3", messages=messages, tools=tools, max_tokens=2)
out["second_cached"] = r.usage.prompt_tokens_details.cached_tokens
out["first_prompt"] = first_prompt
print(json.dumps(out))
"#;
    let out = std::process::Command::new(python)
        .args(["-c", script])
        .arg(format!("http://{}/v1", srv.addr))
        .arg(first["tools"].to_string())
        .arg(first["messages"].to_string())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "the openai client failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let args = json!({"city": "Paris", "days": 2});
    assert_eq!(v["finish"], "tool_calls", "{v}");
    assert_eq!(v["content"], Value::Null, "{v}");
    assert_eq!(v["calls"][0]["type"], "function", "{v}");
    assert_eq!(v["calls"][0]["name"], "get_weather", "{v}");
    assert_eq!(v["calls"][0]["arguments"], args, "{v}");
    assert_eq!(v["stream"]["finish"], "tool_calls", "{v}");
    assert_eq!(v["stream"]["content"], "", "{v}");
    assert_eq!(v["stream"]["calls"].as_array().unwrap().len(), 1, "{v}");
    assert_eq!(v["stream"]["calls"][0]["name"], "get_weather", "{v}");
    assert_eq!(v["stream"]["calls"][0]["arguments"], args, "{v}");
    assert!(v["stream"]["calls"][0]["id"]
        .as_str()
        .unwrap()
        .starts_with("call_"));
    // The client's own rendering of the history (model_dump of the message) still reuses
    // the first prompt and the call token.
    let replied = v["first_prompt"].as_u64().unwrap() + 1;
    assert!(
        v["second_cached"].as_u64().unwrap() >= replied / 8 * 8,
        "{v}"
    );
}

/// Copies the tiny qwen3 model into `dir` with a tokenizer under which the model, its
/// weights untouched, greedily writes [`CALL_TEXT`] and ends its turn. Returns the request.
///
/// The model's greedy first token after the request's prompt is renamed to `CALL_TEXT`
/// (an added token: the same text in a later prompt encodes to that one id again, as a real
/// model's reply does), and its second token becomes a special end-of-turn token. The renamed token is
/// not in the prompt and the merges that made or used it are dropped; the prompt's ids are
/// checked unchanged, so the model computes exactly what it computed before.
fn tool_writing_model(dir: &std::path::Path) -> Value {
    let src = goldens().join(MODEL);
    for f in ["config.json", "model.safetensors", "tokenizer_config.json"] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    let (model, tok) = load(&src, &LoadOptions::default()).unwrap();
    let raw: Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("tokenizer.json")).unwrap())
            .unwrap();
    let vocab = raw["model"]["vocab"].as_object().unwrap();
    let added: Vec<u64> = raw["added_tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["id"].as_u64().unwrap())
        .collect();
    let pair = |m: &Value| -> (String, String) {
        match m {
            Value::String(s) => {
                let (a, b) = s.split_once(' ').unwrap();
                (a.into(), b.into())
            }
            m => (m[0].as_str().unwrap().into(), m[1].as_str().unwrap().into()),
        }
    };
    for i in 0..64 {
        let mut body = tool_chat(4);
        body["messages"][1]["content"] = json!(format!("Weather in Paris, case {i}"));
        let (messages, tools) = (body["messages"].to_string(), body["tools"].to_string());
        let prompt = tok.encode_chat(&messages, Some(&tools), true).unwrap();
        let params = GenerateParams {
            max_tokens: 2,
            ..GenerateParams::default()
        };
        let mut cache = model.new_cache();
        let out = generate(&model, &tok, &mut cache, &prompt, &params, &mut |_| true).unwrap();
        let [g1, g2] = out.tokens[..] else { continue };
        if g1 == g2
            || prompt.contains(&g1)
            || prompt.contains(&g2)
            || added.contains(&u64::from(g2))
            || added.contains(&u64::from(g1))
            || tok.eos_ids().contains(&g1)
        {
            continue;
        }
        let name = |g: u32| {
            vocab
                .iter()
                .find(|(_, id)| id.as_u64() == Some(u64::from(g)))
                .map(|(k, _)| k.clone())
        };
        let (Some(old), Some(end)) = (name(g1), name(g2)) else {
            continue;
        };
        let mut t = raw.clone();
        let v = t["model"]["vocab"].as_object_mut().unwrap();
        v.remove(&old);
        v.insert(CALL_TEXT.into(), json!(g1));
        t["model"]["merges"].as_array_mut().unwrap().retain(|m| {
            let (a, b) = pair(m);
            a != old && b != old && format!("{a}{b}") != old
        });
        t["added_tokens"].as_array_mut().unwrap().push(json!({
            "id": g1, "content": CALL_TEXT, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": false,
        }));
        // A special token, as an end of turn is: its text is not part of the reply.
        t["added_tokens"].as_array_mut().unwrap().push(json!({
            "id": g2, "content": end, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true,
        }));
        std::fs::write(dir.join("tokenizer.json"), t.to_string()).unwrap();
        let mut eos = tok.eos_ids().to_vec();
        eos.push(g2);
        std::fs::write(
            dir.join("generation_config.json"),
            json!({"eos_token_id": eos}).to_string(),
        )
        .unwrap();
        let renamed = engine::Tokenizer::from_folder(dir).unwrap();
        assert_eq!(
            renamed.encode_chat(&messages, Some(&tools), true).unwrap(),
            prompt,
            "renaming token {g1} ({old:?}) changed the prompt's ids"
        );
        assert_eq!(renamed.decode(&[g1], true).unwrap(), CALL_TEXT);
        return body;
    }
    panic!("none of 64 prompts makes the tiny model start with two distinct new tokens");
}

/// A server of [`tool_writing_model`] (block size 8) and the request it answers with a call.
fn tool_writing_server() -> (Server, Value) {
    let model_dir = tempfile::tempdir().unwrap();
    let first = tool_writing_model(model_dir.path());
    let store = tempfile::tempdir().unwrap();
    let (model, tok) = load(model_dir.path(), &LoadOptions::default()).unwrap();
    let reuse = crate::common::reuse_config(store.path(), 8);
    let prefix = KvTiers::open(&model, &tok, reuse).unwrap();
    let engine = Arc::new(Engine::open(model, tok, Some(prefix), EngineConfig::default()).unwrap());
    let mut srv = Server::serve(engine, server_config(None), ConnectionLimits::default());
    srv._dir = Some(store);
    (srv, first)
}

#[test]
fn a_model_that_writes_a_tool_call_gets_it_parsed_and_its_next_turn_reuses_prompt_and_reply() {
    let (srv, first) = tool_writing_server();

    let r = srv.post("/v1/chat/completions", &first);
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let message = v["choices"][0]["message"].clone();
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls", "{v}");
    assert_eq!(message["content"], Value::Null, "{v}");
    assert_eq!(message["tool_calls"][0]["function"]["name"], "get_weather");
    assert_eq!(
        message["tool_calls"][0]["function"]["arguments"],
        r#"{"city": "Paris", "days": 2}"#
    );
    // The call token, then the end of turn.
    assert_eq!(v["usage"]["completion_tokens"], 2, "{v}");
    let first_prompt = v["usage"]["prompt_tokens"].as_u64().unwrap();

    // Streamed, the same reply arrives as tool-call deltas.
    let mut body = first.clone();
    body["stream"] = json!(true);
    let chunks = chunks(&srv.post("/v1/chat/completions", &body));
    let calls: Vec<&Value> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array())
        .flatten()
        .collect();
    assert_eq!(calls[0]["function"]["name"], "get_weather", "{chunks:?}");
    assert_eq!(
        calls[1]["function"]["arguments"],
        r#"{"city": "Paris", "days": 2}"#
    );
    assert!(chunks
        .iter()
        .any(|c| c["choices"][0]["finish_reason"] == "tool_calls"));
    srv.idle();

    // The next turn: the history renders the call as the model wrote it, so the prompt
    // extends the first prompt and its reply, and every full block of both is reused.
    let mut second = first.clone();
    second["messages"].as_array_mut().unwrap().extend([
        message.clone(),
        json!({"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "18 C"}),
    ]);
    let tok = srv.engine.tokenizer();
    let render = |b: &Value| {
        let (messages, tools) = (b["messages"].to_string(), b["tools"].to_string());
        tok.apply_chat_template(&messages, Some(&tools), true, None)
            .unwrap()
    };
    let (a, b) = (render(&first), render(&second));
    assert!(
        b.starts_with(&format!("{a}{CALL_TEXT}<|im_end|>")),
        "the history does not render the call as the model wrote it:\n{a}\n---\n{b}"
    );
    let r = srv.post("/v1/chat/completions", &second);
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    let replied = first_prompt + 1;
    assert!(
        cached >= replied / 8 * 8,
        "the second turn reused {cached} tokens; the first prompt and reply are {replied}: {v}"
    );
    eprintln!("first prompt + reply: {replied} tokens; the next turn reused {cached}");
}

// ---- Grammar-constrained replies (issue 17, point 2) ----

/// Functions whose arguments the tiny model can finish: every string is an enum or short.
fn forced_tools() -> Value {
    // Short: the tiny model's context is 512 tokens, and its tokenizer is byte-level.
    json!([
        {"type": "function", "function": {"name": "wx", "parameters": {"type": "object",
            "properties": {"c": {"enum": ["P", "R"]}}, "required": ["c"],
            "additionalProperties": false}}},
        {"type": "function", "function": {"name": "find", "parameters": {"type": "object",
            "properties": {"q": {"type": "string", "maxLength": 3}}, "required": ["q"],
            "additionalProperties": false}}},
    ])
}

/// Whether `args` (a call's arguments text) is valid under [`forced_tools`]'s schema of
/// `name`.
fn valid_forced_args(name: &str, args: &str) -> bool {
    let Ok(Value::Object(a)) = serde_json::from_str::<Value>(args) else {
        return false;
    };
    match name {
        "wx" => a.len() == 1 && matches!(a.get("c").and_then(Value::as_str), Some("P" | "R")),
        "find" => {
            a.len() == 1
                && a.get("q")
                    .and_then(Value::as_str)
                    .is_some_and(|q| q.chars().count() <= 3)
        }
        _ => false,
    }
}

/// A server of the tiny model with a 2048-token context ([`crate::common::roomy_tiny_model`]).
fn roomy_server() -> Server {
    let dir = tempfile::tempdir().unwrap();
    let model_dir = crate::common::roomy_tiny_model(MODEL, dir.path());
    let (model, tok) = load(&model_dir, &LoadOptions::default()).unwrap();
    let reuse = crate::common::reuse_config(dir.path().join("store"), 8);
    let prefix = KvTiers::open(&model, &tok, reuse).unwrap();
    let engine = Arc::new(Engine::open(model, tok, Some(prefix), EngineConfig::default()).unwrap());
    let mut srv = Server::serve(engine, server_config(None), ConnectionLimits::default());
    srv._dir = Some(dir);
    srv
}

fn forced_chat(tool_choice: Value, seed: u64) -> Value {
    json!({
        "messages": [{"role": "user", "content": "Hi"}],
        "tools": forced_tools(),
        "tool_choice": tool_choice,
        "parallel_tool_calls": false,
        "temperature": 1.0,
        "seed": seed,
    })
}

/// A tiny model with random weights writes whatever its logits say; under `tool_choice`
/// `required` or a named function every reply is nonetheless a valid call of a listed
/// function with arguments valid under its schema, whatever the seed.
#[test]
fn forced_tool_choice_makes_even_random_weights_write_valid_calls() {
    let srv = roomy_server();
    let mut names = std::collections::BTreeSet::new();
    for seed in 0..6 {
        for choice in [
            json!("required"),
            json!({"type": "function", "function": {"name": "find"}}),
        ] {
            let body = forced_chat(choice.clone(), seed);
            let r = srv.post("/v1/chat/completions", &body);
            assert_eq!(r.status, 200, "{}", r.body);
            let v = r.json();
            let choice_out = &v["choices"][0];
            assert_eq!(
                choice_out["finish_reason"], "tool_calls",
                "{choice} {seed}: {v}"
            );
            let calls = choice_out["message"]["tool_calls"].as_array().unwrap();
            assert!(!calls.is_empty());
            assert_eq!(calls.len(), 1, "{v}");
            for c in calls {
                let name = c["function"]["name"].as_str().unwrap();
                let args = c["function"]["arguments"].as_str().unwrap();
                assert!(valid_forced_args(name, args), "{name} {args}");
                if choice.is_object() {
                    assert_eq!(name, "find");
                }
                names.insert(name.to_string());
            }
        }
    }
    assert!(!names.is_empty());
}

#[test]
fn a_forced_call_streams_as_tool_call_deltas() {
    let srv = roomy_server();
    let mut body = forced_chat(json!({"type": "function", "function": {"name": "wx"}}), 3);
    body["stream"] = json!(true);
    let r = srv.post("/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let chunks = chunks(&r);
    let mut name = String::new();
    let mut args = String::new();
    for c in &chunks {
        for d in c["choices"][0]["delta"]["tool_calls"]
            .as_array()
            .into_iter()
            .flatten()
        {
            name.push_str(d["function"]["name"].as_str().unwrap_or(""));
            args.push_str(d["function"]["arguments"].as_str().unwrap_or(""));
        }
    }
    assert_eq!(name, "wx");
    assert!(valid_forced_args(&name, &args), "{args}");
    let last = &chunks.last().unwrap()["choices"][0];
    assert_eq!(last["finish_reason"], "tool_calls");
}

/// A forced call sent back in the history extends the previous prompt: the next turn reuses
/// all of it, whatever the template makes of the reply (this tokenizer's `<tool_call>` is a
/// special token, so the constrained reply spells it out and the re-rendered history holds
/// the single token instead: the reuse ends where the reply starts).
#[test]
fn a_forced_call_sent_back_extends_the_cached_prompt_and_reply() {
    let srv = roomy_server();
    let body = forced_chat(json!({"type": "function", "function": {"name": "find"}}), 1);
    let v = srv.post("/v1/chat/completions", &body).json();
    let first_prompt = v["usage"]["prompt_tokens"].as_u64().unwrap();
    let reply = v["usage"]["completion_tokens"].as_u64().unwrap();
    let call = v["choices"][0]["message"]["tool_calls"][0].clone();
    srv.idle();
    let mut next = body.clone();
    next["messages"] = json!([
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": null, "tool_calls": [call.clone()]},
        {"role": "tool", "tool_call_id": call["id"], "content": "ok"},
    ]);
    next["tool_choice"] = json!("none");
    next["max_tokens"] = json!(1);
    let v = srv.post("/v1/chat/completions", &next).json();
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(reply > 0);
    assert!(
        cached >= first_prompt,
        "cached {cached} < the previous prompt's {first_prompt} tokens: {v}"
    );
}

/// `response_format` `json_schema`: the reply is a document of the schema, whatever the
/// weights; an unsupported keyword or a malformed schema is a 400 naming it.
#[test]
fn response_format_json_schema_forces_a_valid_document() {
    let srv = roomy_server();
    let schema = json!({"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "tag": {"enum": ["a", "b"]}},
        "required": ["n", "ok", "tag"], "additionalProperties": false});
    for seed in 0..4 {
        let body = json!({
            "messages": [{"role": "user", "content": "JSON please"}],
            "response_format": {"type": "json_schema",
                "json_schema": {"name": "thing", "schema": schema, "strict": true}},
            "temperature": 1.0,
            "seed": seed,
            "max_tokens": 100,
        });
        let v = srv.post("/v1/chat/completions", &body).json();
        assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
        let text = v["choices"][0]["message"]["content"].as_str().unwrap();
        let doc: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"));
        assert!(doc["n"].as_u64().is_some_and(|n| n <= 99), "{doc}");
        assert!(doc["ok"].is_boolean(), "{doc}");
        assert!(doc["tag"] == "a" || doc["tag"] == "b", "{doc}");
        assert_eq!(doc.as_object().unwrap().len(), 3, "{doc}");
    }
    let bad = |schema: Value| {
        json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x",
            "schema": schema}}})
    };
    for (schema, says) in [
        (json!({"type": "array", "uniqueItems": true}), "uniqueItems"),
        (json!({"type": "banana"}), "banana"),
        (json!({"type": "object", "properties": {"a": 7}}), "schema"),
    ] {
        let e = openai_error(&srv.post("/v1/chat/completions", &bad(schema.clone())), 400);
        assert_eq!(e["param"], "response_format", "{e}");
        let msg = e["message"].as_str().unwrap();
        assert!(msg.contains(says), "{schema}: {msg:?} should say {says:?}");
    }
    // A forced call's schema is compiled the same way; its errors name `tools`.
    let mut body = forced_chat(json!("required"), 0);
    body["tools"][0]["function"]["parameters"] = json!({"type": "object", "not": {}});
    let e = openai_error(&srv.post("/v1/chat/completions", &body), 400);
    assert_eq!(e["param"], "tools", "{e}");
    assert!(e["message"].as_str().unwrap().contains("not"), "{e}");
}

/// A constrained row waits for its pick before its next step; rows beside it in the batch
/// still decode exactly as they would alone.
#[test]
fn a_constrained_row_leaves_its_batch_neighbours_unchanged() {
    let srv = roomy_server();
    let plain = chat("Tell me something.", 24);
    let alone = srv.post("/v1/chat/completions", &plain).json();
    srv.idle();
    let forced = forced_chat(json!("required"), 5);
    let (a, b) = std::thread::scope(|s| {
        let a = s.spawn(|| srv.post("/v1/chat/completions", &forced).json());
        let b = s.spawn(|| srv.post("/v1/chat/completions", &plain).json());
        (a.join().unwrap(), b.join().unwrap())
    });
    assert_eq!(a["choices"][0]["finish_reason"], "tool_calls", "{a}");
    assert_eq!(
        b["choices"][0]["message"]["content"], alone["choices"][0]["message"]["content"],
        "{b}"
    );
}

/// The default model: forced calls (its template has no call format: the `<tool_call>`
/// family is used) and a `json_object` reply are what they must be.
#[test]
fn smollm2_forced_calls_and_json_objects_are_valid() {
    let Some(path) = crate::common::smollm2() else {
        return;
    };
    let (model, tok) = load(&path, &LoadOptions::default()).unwrap();
    let engine = Arc::new(Engine::open(model, tok, None, EngineConfig::default()).unwrap());
    let srv = Server::serve(engine, server_config(None), ConnectionLimits::default());
    let body = json!({
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": forced_tools(),
        "tool_choice": "required",
        "parallel_tool_calls": false,
        "max_tokens": 64,
    });
    let v = srv.post("/v1/chat/completions", &body).json();
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls", "{v}");
    let call = &v["choices"][0]["message"]["tool_calls"][0]["function"];
    assert!(
        valid_forced_args(
            call["name"].as_str().unwrap(),
            call["arguments"].as_str().unwrap()
        ),
        "{call}"
    );
    let body = json!({
        "messages": [{"role": "user", "content": "Describe a cat as a JSON object."}],
        "response_format": {"type": "json_object"},
        "max_tokens": 96,
    });
    let v = srv.post("/v1/chat/completions", &body).json();
    let text = v["choices"][0]["message"]["content"].as_str().unwrap();
    if v["choices"][0]["finish_reason"] == "stop" {
        let doc: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"));
        assert!(doc.is_object(), "{doc}");
    } else {
        // Cut off by max_tokens: still a prefix of an object.
        assert!(text.starts_with('{'), "{text}");
    }
}

/// The Anthropic API's `tool_choice` `any` and `tool` are forced the same way: the reply is
/// a `tool_use` block whose input is valid under the tool's `input_schema`.
#[test]
fn anthropic_tool_choice_any_and_tool_force_valid_tool_use_blocks() {
    let srv = roomy_server();
    let tools: Vec<Value> = forced_tools()
        .as_array()
        .unwrap()
        .iter()
        .map(
            |t| json!({"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}),
        )
        .collect();
    for (choice, want, one) in [
        (json!({"type": "any"}), None, false),
        (json!({"type": "tool", "name": "wx"}), Some("wx"), false),
        // At most one tool_use block: the grammar takes exactly one call.
        (
            json!({"type": "any", "disable_parallel_tool_use": true}),
            None,
            true,
        ),
    ] {
        let body = json!({
            "model": MODEL,
            "max_tokens": 200,
            "messages": [{"role": "user", "content": "Hi"}],
            "tools": tools,
            "tool_choice": choice,
            "temperature": 1.0,
        });
        let r = srv.post("/v1/messages", &body);
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        assert_eq!(v["stop_reason"], "tool_use", "{v}");
        let blocks: Vec<&Value> = v["content"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|b| b["type"] == "tool_use")
            .collect();
        assert!(!blocks.is_empty(), "{v}");
        if one {
            assert_eq!(blocks.len(), 1, "{v}");
        }
        for b in blocks {
            let name = b["name"].as_str().unwrap();
            assert!(valid_forced_args(name, &b["input"].to_string()), "{b}");
            if let Some(w) = want {
                assert_eq!(name, w);
            }
        }
    }
}
