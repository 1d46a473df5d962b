//! The OpenAI-compatible HTTP server on tokio + axum, built on [`Engine`].
//!
//! Endpoints (see docs/server.md): `POST /v1/chat/completions`, `POST /v1/completions`
//! (both SSE-streaming or not), `GET /v1/models`, `GET /health`, `GET /metrics`
//! (Prometheus text), `GET /v1/cache` (store stats JSON), `POST /admin/cache/flush`.
//! With an API key, `/v1/*` and `/admin/*` need `Authorization: Bearer KEY` (and
//! `/metrics` too when [`ServerConfig::metrics_need_key`] is set); keys are compared in
//! constant time. A chat with `tools` gets the model's tool calls parsed into OpenAI
//! `tool_calls`, whole or streamed (`tool_calls.rs`, one parser per template family).
//!
//! A streaming response reads the request's [`RequestHandle`] as it goes; when the client
//! disconnects, the response body is dropped, the handle with it, and the engine cancels
//! the request at its next step boundary and frees its blocks.

mod anthropic;
mod conn;
mod error;
mod metrics;
pub(crate) mod openai;
mod tool_calls;

use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::Future;
use std::sync::{Arc, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request as HttpRequest, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Map, Value};

use crate::constrained::{Constraint, GrammarCompiler};
use crate::generate::FinishReason;
use crate::scheduler::{Completion, Engine, Event, Request, RequestHandle};
pub use conn::{serve_with_limits, ConnectionLimits};
pub(crate) use error::ApiError;
use metrics::ServerMetrics;
use openai::{ReplyShape, ToolParsing};
use tool_calls::{CallStream, Piece};

/// Settings of the HTTP layer.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// The model id clients name (`model` in requests, `/v1/models`). Requests naming
    /// another model get 404. Default: `"default"`.
    pub model_id: String,
    /// When set, `/v1/*` and `/admin/*` need `Authorization: Bearer <key>`. Default: None.
    pub api_key: Option<String>,
    /// Whether `/metrics` needs the API key too (when there is one). Off, as in vLLM: a
    /// Prometheus scraper then needs no credentials. Default: false.
    pub metrics_need_key: bool,
    /// Largest request body in bytes; larger ones get 413. Default: 4 MiB.
    pub max_body_bytes: usize,
    /// Most tokens one request may generate: a larger `max_tokens` gets 400, and a request
    /// without one generates at most this many (or to the end of the context, if sooner).
    /// Default: 4096.
    pub max_tokens_limit: usize,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            model_id: "default".into(),
            api_key: None,
            metrics_need_key: false,
            max_body_bytes: 4 << 20,
            max_tokens_limit: 4096,
        }
    }
}

struct AppState {
    engine: Arc<Engine>,
    config: ServerConfig,
    /// blake3 of the API key: what a presented key's hash is compared with.
    key_hash: Option<[u8; 32]>,
    metrics: ServerMetrics,
    /// [`scripted_router`]'s script.
    script: Option<Vec<String>>,
    /// The arguments text of the tool calls answered through the Anthropic API.
    tool_inputs: anthropic::ToolInputs,
    /// Per-`prompt_cache_key` accounting.
    cache_keys: openai::CacheKeys,
    /// The grammar compiler of the model's tokenizer, built by the first request that
    /// needs one (its token trie takes a moment).
    grammars: OnceLock<Result<Arc<GrammarCompiler>, String>>,
}

impl AppState {
    /// Compiles `grammar` for the reply of a request; a grammar it rejects is a 400 on
    /// `param`.
    fn constraint(&self, param: &'static str, grammar: &str) -> Result<Constraint, ApiError> {
        let compiler = self
            .grammars
            .get_or_init(|| {
                GrammarCompiler::new(self.engine.tokenizer())
                    .map(Arc::new)
                    .map_err(|e| e.to_string())
            })
            .as_ref()
            .map_err(|e| ApiError::internal(format!("building the grammar compiler: {e}")))?;
        compiler.compile(grammar).map_err(|e| match e {
            crate::EngineError::InvalidParameter { message, .. } => {
                // llguidance's first line says what failed; the rest quotes our grammar.
                let first = message.lines().next().unwrap_or_default();
                let what = match first.split_once("): ") {
                    Some((at, rest)) if at.starts_with("at ") => rest,
                    _ => first,
                };
                ApiError::param(
                    param,
                    format!("{param}: the reply cannot be constrained to it: {what}"),
                )
            }
            e => ApiError::from(e),
        })
    }
}

type Shared = Arc<AppState>;

/// The axum router of the server over `engine`.
pub fn router(engine: Arc<Engine>, config: ServerConfig) -> Router {
    build_router(engine, config, None)
}

/// Test-only: [`router`], with each generated token's text replaced by the next piece of
/// `script` (the pieces left when generation ends come at the end), so that HTTP tests can
/// drive tool-call parsing with tiny random models that never write a call. The model still
/// runs; the engine, the cache and the streaming are real. Never for a real server.
#[doc(hidden)]
pub fn scripted_router(engine: Arc<Engine>, config: ServerConfig, script: Vec<String>) -> Router {
    build_router(engine, config, Some(script))
}

fn build_router(engine: Arc<Engine>, config: ServerConfig, script: Option<Vec<String>>) -> Router {
    let limit = config.max_body_bytes;
    let metrics_need_key = config.metrics_need_key;
    let state = Arc::new(AppState {
        metrics: ServerMetrics::new(engine.clone()),
        engine,
        key_hash: config
            .api_key
            .as_deref()
            .map(|k| *blake3::hash(k.as_bytes()).as_bytes()),
        config,
        script,
        tool_inputs: anthropic::ToolInputs::default(),
        cache_keys: openai::CacheKeys::default(),
        grammars: OnceLock::new(),
    });
    let mut protected = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route("/v1/models", get(models))
        .route("/v1/cache", get(cache_stats))
        .route("/admin/cache/flush", post(flush));
    let mut open = Router::new().route("/health", get(health));
    if metrics_need_key {
        protected = protected.route("/metrics", get(metrics));
    } else {
        open = open.route("/metrics", get(metrics));
    }
    let protected = protected.route_layer(middleware::from_fn_with_state(state.clone(), auth));
    Router::new()
        .merge(protected)
        .merge(open)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(limit))
        .layer(middleware::from_fn_with_state(state.clone(), record))
        .with_state(state)
}

/// Serves `app` on a TCP listener under the default [`ConnectionLimits`] until `shutdown`
/// resolves, then waits for open requests to finish (stop accepting first: the caller then
/// shuts the engine down). [`serve_with_limits`] takes the limits.
pub async fn serve_tcp(
    listener: tokio::net::TcpListener,
    app: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_with_limits(listener, app, ConnectionLimits::default(), shutdown).await
}

/// [`serve_tcp`] on a Unix socket (a private engine process for another program).
#[cfg(unix)]
pub async fn serve_unix(
    listener: tokio::net::UnixListener,
    app: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_with_limits(listener, app, ConnectionLimits::default(), shutdown).await
}

async fn record(State(s): State<Shared>, req: HttpRequest, next: Next) -> Response {
    let (method, path) = (req.method().clone(), req.uri().path().to_string());
    let t = std::time::Instant::now();
    let resp = next.run(req).await;
    let status = resp.status().as_u16();
    s.metrics.record_response(status);
    tracing::info!(%method, %path, status, ms = t.elapsed().as_millis() as u64, "http");
    resp
}

async fn auth(
    State(s): State<Shared>,
    headers: HeaderMap,
    req: HttpRequest,
    next: Next,
) -> Response {
    if let Some(want) = &s.key_hash {
        // Bearer (OpenAI) or x-api-key (Anthropic): the same key, the same check.
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .or_else(|| headers.get("x-api-key").and_then(|v| v.to_str().ok()))
            .map(str::trim);
        if !key_matches(want, given) {
            let e = ApiError::new(
                StatusCode::UNAUTHORIZED,
                "invalid_request_error",
                "Incorrect or missing API key: send Authorization: Bearer <key> or x-api-key: <key>",
            )
            .with_code("invalid_api_key");
            if req.uri().path().starts_with("/v1/messages") {
                return anthropic::error_response(e);
            }
            return e.into_response();
        }
    }
    next.run(req).await
}

/// Whether the presented key is the one whose blake3 is `want`. The hashes are compared in
/// constant time, so neither the key's bytes nor its length show in the time a wrong guess
/// takes (a `==` on the keys stops at the first differing byte).
fn key_matches(want: &[u8; 32], given: Option<&str>) -> bool {
    use subtle::ConstantTimeEq;
    let Some(given) = given else {
        return false;
    };
    let given = blake3::hash(given.as_bytes());
    bool::from(want.as_slice().ct_eq(given.as_bytes().as_slice()))
}

async fn not_found() -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        "no such endpoint",
    )
    .with_code("not_found")
}

async fn method_not_allowed() -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        "method not allowed on this endpoint",
    )
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

async fn health(State(s): State<Shared>) -> Response {
    let status = if !s.engine.is_accepting() {
        "shutting_down"
    } else if !s.engine.is_running() {
        // The engine thread died (a bug): every request would fail; take this server out.
        "engine_stopped"
    } else {
        return Json(json!({"status": "ok"})).into_response();
    };
    (
        StatusCode::SERVICE_UNAVAILABLE,
        Json(json!({"status": status})),
    )
        .into_response()
}

async fn models(State(s): State<Shared>) -> Json<Value> {
    Json(json!({
        "object": "list",
        "data": [{
            "id": s.config.model_id,
            "object": "model",
            "created": 0,
            "owned_by": "kvstore",
            "max_model_len": s.engine.context_limit(),
        }],
    }))
}

async fn cache_stats(State(s): State<Shared>) -> Json<Value> {
    let m = s.engine.metrics();
    let engine = json!({
        "prompt_tokens": m.prompt_tokens,
        "cached_tokens": m.cached_tokens,
        "cached_device_tokens": m.cached_device_tokens,
        "cached_ram_tokens": m.cached_ram_tokens,
        "cached_ssd_tokens": m.cached_ssd_tokens,
        "cached_remote_tokens": m.cached_remote_tokens,
    });
    Json(match s.engine.kv_tiers() {
        Some(p) => json!({
            "enabled": true,
            "namespace": p.namespace().to_string(),
            "block_size": p.paged_config().block_size,
            "device": p.resident_stats(),
            "store": p.stats(),
            "pinned": p.pinned(),
            "prompt_cache_keys": s.cache_keys.snapshot(),
            "engine": engine,
        }),
        None => json!({
            "enabled": false,
            "prompt_cache_keys": s.cache_keys.snapshot(),
            "engine": engine,
        }),
    })
}

async fn flush(State(s): State<Shared>) -> Result<Json<Value>, ApiError> {
    let engine = s.engine.clone();
    let t = std::time::Instant::now();
    tokio::task::spawn_blocking(move || engine.flush())
        .await
        .map_err(|e| ApiError::internal(format!("the flush task failed: {e}")))?
        .map_err(ApiError::from)?;
    Ok(Json(json!({
        "flushed": true,
        "seconds": t.elapsed().as_secs_f64(),
        "store": s.engine.cache_stats(),
    })))
}

async fn metrics(State(s): State<Shared>) -> Result<Response, ApiError> {
    let text = s
        .metrics
        .encode()
        .map_err(|_| ApiError::internal("the metrics could not be encoded"))?;
    Ok(([(header::CONTENT_TYPE, metrics::CONTENT_TYPE)], text).into_response())
}

/// Parses a JSON object body, mapping every failure to an OpenAI-style 4xx.
fn parse_body(
    body: Result<Bytes, BytesRejection>,
) -> Result<(String, Map<String, Value>), ApiError> {
    let bytes = body.map_err(|e| {
        // The body-read timeout of the connection layer (conn.rs) surfaces here.
        let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&e);
        while let Some(err) = source {
            if let Some(t) = err.downcast_ref::<conn::BodyReadTimeout>() {
                return ApiError::new(
                    StatusCode::REQUEST_TIMEOUT,
                    "invalid_request_error",
                    t.to_string(),
                )
                .with_code("request_timeout");
            }
            source = err.source();
        }
        let status = e.status();
        let mut err = ApiError::new(status, "invalid_request_error", e.body_text());
        if status == StatusCode::PAYLOAD_TOO_LARGE {
            err = err.with_code("request_too_large");
        }
        err
    })?;
    openai::parse_json_body(&bytes)
}

async fn chat_completions(
    State(s): State<Shared>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    json_content_type(&headers)?;
    generate_endpoint(s, body, true).await
}

async fn completions(
    State(s): State<Shared>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    json_content_type(&headers)?;
    generate_endpoint(s, body, false).await
}

/// JSON endpoints take only `Content-Type: application/json` (415 otherwise): a browser
/// page may send a cross-site `text/plain` POST without a preflight, never a JSON one.
fn json_content_type(headers: &HeaderMap) -> Result<(), ApiError> {
    let ct = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let essence = ct.split(';').next().unwrap_or("").trim();
    if essence.eq_ignore_ascii_case("application/json") {
        return Ok(());
    }
    let found = if ct.is_empty() {
        "no Content-Type".to_string()
    } else {
        format!("Content-Type {:?}", store::escape_control(ct))
    };
    Err(ApiError::new(
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "invalid_request_error",
        format!("{found}; send the body as Content-Type: application/json"),
    )
    .with_code("unsupported_media_type"))
}

/// Everything a response needs to name itself.
#[derive(Clone)]
struct Meta {
    id: String,
    created: u64,
    model: String,
    chat: bool,
    logprobs: bool,
    include_usage: bool,
    /// How the reply is parsed for tool calls (chat requests with tools only).
    tools: Option<ToolParsing>,
    /// Makes the ids of this response's tool calls unique across requests and restarts.
    nonce: u128,
    /// [`scripted_router`]'s script.
    script: Option<Vec<String>>,
    /// `prompt_cache_key`, and when its pin ends (Unix ms) if the request pinned.
    cache_key: Option<(String, Option<u64>)>,
}

impl Meta {
    /// Counts a finished request under its `prompt_cache_key`.
    fn account(&self, s: &Shared, c: &Completion) {
        if let Some((key, until)) = &self.cache_key {
            s.cache_keys.record(key, c, *until);
        }
    }

    /// The id of this response's `i`th tool call.
    fn call_id(&self, i: usize) -> String {
        let h = blake3::hash(format!("{}:{}:{i}", self.id, self.nonce).as_bytes());
        format!("call_{}", &h.to_hex()[..24])
    }

    /// The chat `message` of a whole reply and its `finish_reason` (`tool_calls` when the
    /// reply held calls).
    fn message(&self, text: String, reason: &'static str) -> (Value, &'static str) {
        let Some(t) = &self.tools else {
            return (json!({"role": "assistant", "content": text}), reason);
        };
        let p = tool_calls::parse(t.format, &t.names, &text);
        if p.calls.is_empty() {
            return (json!({"role": "assistant", "content": p.content}), reason);
        }
        let calls: Vec<Value> = p
            .calls
            .iter()
            .enumerate()
            .map(|(i, c)| {
                json!({
                    "id": self.call_id(i),
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                })
            })
            .collect();
        let message = json!({"role": "assistant", "content": p.content, "tool_calls": calls});
        (message, "tool_calls")
    }
}

async fn generate_endpoint(
    s: Shared,
    body: Result<Bytes, BytesRejection>,
    chat: bool,
) -> Result<Response, ApiError> {
    let (raw, body) = parse_body(body)?;
    let mut opts = openai::options(&body, chat)?;
    let shape = if chat {
        openai::reply_shape(&body, s.engine.tokenizer())?
    } else {
        ReplyShape::default()
    };
    let tools = shape.parsing.clone();
    if let Some(m) = &opts.model {
        if *m != s.config.model_id {
            return Err(ApiError::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                format!(
                    "the model {m:?} does not exist; this server serves {:?}",
                    s.config.model_id
                ),
            )
            .with_code("model_not_found"));
        }
    }
    // Templates, tokenizers and grammars take a while on long conversations and large
    // schemas: off the async workers.
    let state = s.clone();
    let (prompt, constraint) = tokio::task::spawn_blocking(move || {
        let tok = state.engine.tokenizer();
        let prompt = if chat {
            openai::chat_prompt(tok, &body, &raw)
        } else {
            openai::completion_prompt(tok, &body)
        }?;
        let constraint = match &shape.grammar {
            Some((param, grammar)) => Some(state.constraint(param, grammar)?),
            None => None,
        };
        Ok::<_, ApiError>((prompt, constraint))
    })
    .await
    .map_err(|e| ApiError::internal(format!("building the prompt failed: {e}")))??;
    opts.params.constraint = constraint;
    opts.params.max_tokens = token_budget(&s, prompt.len(), opts.max_tokens)?;
    // Retention 24h: the whole prompt stays in every tier for a day, across restarts.
    let pinned_until = match s.engine.kv_tiers() {
        Some(kv) if opts.retain_24h => {
            let ttl = openai::RETENTION_24H;
            kv.pin_prefix(opts.cache_salt.as_deref(), &prompt, ttl, true)?;
            Some(now() * 1000 + ttl.as_millis() as u64)
        }
        _ => None,
    };
    let handle = s.engine.submit(Request {
        prompt,
        params: opts.params,
        cache_salt: opts.cache_salt,
    })?;
    let meta = Meta {
        id: format!("{}-{}", if chat { "chatcmpl" } else { "cmpl" }, handle.id()),
        created: now(),
        model: s.config.model_id.clone(),
        chat,
        logprobs: opts.logprobs,
        include_usage: opts.include_usage,
        tools,
        nonce: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
        script: s.script.clone(),
        cache_key: opts.prompt_cache_key.map(|k| (k, pinned_until)),
    };
    if opts.stream {
        Ok(stream(s, handle, meta).into_response())
    } else {
        whole(s, handle, meta).await
    }
}

/// The tokens a request with a prompt of `prompt` tokens and `max_tokens` (as asked) may
/// generate: at most `--max-tokens-limit` (more is a 400) and what the context leaves.
fn token_budget(s: &Shared, prompt: usize, max_tokens: Option<usize>) -> Result<usize, ApiError> {
    let context = s.engine.context_limit();
    if prompt >= context {
        return Err(ApiError::from(crate::EngineError::PromptTooLong {
            prompt,
            context,
        }));
    }
    let limit = s.config.max_tokens_limit;
    if let Some(m) = max_tokens.filter(|m| *m > limit) {
        return Err(ApiError::param(
            "max_tokens",
            format!(
                "max_tokens = {m} is above this server's limit of {limit} (--max-tokens-limit)"
            ),
        ));
    }
    Ok(max_tokens.unwrap_or(limit).min(context - prompt))
}

/// A non-streaming response: collect every token, then answer once.
async fn whole(s: Shared, mut handle: RequestHandle, meta: Meta) -> Result<Response, ApiError> {
    let mut logprobs = Vec::new();
    while let Some(e) = handle.recv().await {
        match e {
            Event::Token { sampled, .. } if meta.logprobs => logprobs.push(sampled),
            Event::Finished(c) if c.finish_reason == FinishReason::Cancelled => {
                return Err(cut_off(&s, &c));
            }
            Event::Finished(c) => {
                meta.account(&s, &c);
                let tok = s.engine.tokenizer();
                let reason = openai::finish_reason(&c);
                let text = match &meta.script {
                    Some(pieces) => pieces.concat(),
                    None => c.text.clone(),
                };
                let choice = if meta.chat {
                    let lp = meta.logprobs.then(|| {
                        json!({"content": logprobs.iter().map(|l| openai::chat_logprob(tok, l)).collect::<Vec<_>>()})
                    });
                    let (message, reason) = meta.message(text, reason);
                    json!({
                        "index": 0,
                        "message": message,
                        "logprobs": lp,
                        "finish_reason": reason,
                    })
                } else {
                    json!({
                        "index": 0,
                        "text": text,
                        "logprobs": meta.logprobs.then(|| completion_logprobs(tok, &logprobs)),
                        "finish_reason": reason,
                    })
                };
                return Ok(Json(json!({
                    "id": meta.id,
                    "object": if meta.chat { "chat.completion" } else { "text_completion" },
                    "created": meta.created,
                    "model": meta.model,
                    "choices": [choice],
                    "usage": openai::usage(&c),
                    "kvstore": timing(&c),
                }))
                .into_response());
            }
            Event::Failed(e) => return Err(e.into()),
            _ => {}
        }
    }
    Err(crate::EngineError::EngineStopped.into())
}

/// The error a request cut off before its end gets: its partial output is not a reply, and
/// no `finish_reason` may claim it stopped or reached its length.
fn cut_off(s: &Shared, c: &Completion) -> ApiError {
    let why = if s.engine.is_accepting() {
        "the request was cancelled"
    } else {
        "the server is shutting down"
    };
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "server_error",
        format!(
            "{why}: generation stopped after {} of its tokens; retry it",
            c.completion_tokens
        ),
    )
    .with_code("request_cancelled")
}

fn timing(c: &Completion) -> Value {
    json!({
        "queue_s": c.queue_s,
        "ttft_s": c.ttft_s,
        "total_s": c.total_s,
        "cached_ram_tokens": c.reuse.cached_ram_tokens,
        "cached_ssd_tokens": c.reuse.cached_ssd_tokens,
        "published_blocks": c.reuse.published_blocks,
    })
}

fn completion_logprobs(tok: &crate::Tokenizer, l: &[crate::Sampled]) -> Value {
    let text = |id: u32| tok.decode(&[id], false).unwrap_or_default();
    json!({
        "tokens": l.iter().map(|s| text(s.token)).collect::<Vec<_>>(),
        "token_logprobs": l.iter().map(|s| s.logprob).collect::<Vec<_>>(),
        "top_logprobs": l.iter().map(|s| {
            s.top_logprobs.iter().map(|(id, lp)| (text(*id), json!(lp))).collect::<Map<_, _>>()
        }).collect::<Vec<_>>(),
    })
}

struct StreamState {
    s: Shared,
    handle: Option<RequestHandle>,
    meta: Meta,
    out: VecDeque<SseEvent>,
    /// The tool-call parser of a chat with tools.
    calls: Option<CallStream>,
    /// Tool calls sent so far.
    calls_sent: usize,
    /// What is left of [`scripted_router`]'s script.
    script: Option<VecDeque<String>>,
}

impl StreamState {
    fn chunk(&self, delta: Value, logprobs: Value, finish: Option<&str>) -> SseEvent {
        let choice = if self.meta.chat {
            json!({"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
        } else {
            json!({"index": 0, "text": delta, "logprobs": logprobs, "finish_reason": finish})
        };
        self.event(json!([choice]), None)
    }

    fn event(&self, choices: Value, usage: Option<Value>) -> SseEvent {
        let mut body = json!({
            "id": self.meta.id,
            "object": if self.meta.chat { "chat.completion.chunk" } else { "text_completion" },
            "created": self.meta.created,
            "model": self.meta.model,
            "choices": choices,
        });
        if let Some(u) = usage {
            body["usage"] = u;
        }
        SseEvent::default().data(body.to_string())
    }

    /// Pushes the chunks of released reply pieces; `lp` (the token's log-probabilities)
    /// goes with the first, or with an empty chunk of its own.
    fn emit(&mut self, pieces: Vec<Piece>, mut lp: Value) {
        for p in pieces {
            match p {
                Piece::Text(t) if t.is_empty() => {}
                Piece::Text(t) => {
                    let delta = if self.meta.chat {
                        json!({"content": t})
                    } else {
                        json!(t)
                    };
                    let ev = self.chunk(delta, std::mem::take(&mut lp), None);
                    self.out.push_back(ev);
                }
                Piece::Call(c) => {
                    let i = self.calls_sent;
                    self.calls_sent += 1;
                    let head = json!({"tool_calls": [{
                        "index": i,
                        "id": self.meta.call_id(i),
                        "type": "function",
                        "function": {"name": c.name, "arguments": ""},
                    }]});
                    let ev = self.chunk(head, std::mem::take(&mut lp), None);
                    self.out.push_back(ev);
                    let args = json!({"tool_calls": [{
                        "index": i,
                        "function": {"arguments": c.arguments},
                    }]});
                    let ev = self.chunk(args, Value::Null, None);
                    self.out.push_back(ev);
                }
            }
        }
        if !lp.is_null() {
            let delta = if self.meta.chat {
                json!({"content": ""})
            } else {
                json!("")
            };
            let ev = self.chunk(delta, lp, None);
            self.out.push_back(ev);
        }
    }

    /// The pieces of the reply's next text that can be released now.
    fn pieces(&mut self, text: &str) -> Vec<Piece> {
        match &mut self.calls {
            Some(p) => p.push(text),
            None => vec![Piece::Text(text.to_string())],
        }
    }

    /// Turns one engine event into SSE events; false once the stream is over.
    fn on(&mut self, e: Option<Event>) -> bool {
        match e {
            Some(Event::Started { .. }) => {
                if self.meta.chat {
                    let ev = self.chunk(
                        json!({"role": "assistant", "content": ""}),
                        Value::Null,
                        None,
                    );
                    self.out.push_back(ev);
                }
                true
            }
            Some(Event::Token { sampled, text }) => {
                let text = match &mut self.script {
                    Some(script) => script.pop_front().unwrap_or_default(),
                    None => text,
                };
                if text.is_empty() && !self.meta.logprobs {
                    return true;
                }
                let tok = self.s.engine.tokenizer();
                let lp = if !self.meta.logprobs {
                    Value::Null
                } else if self.meta.chat {
                    json!({"content": [openai::chat_logprob(tok, &sampled)]})
                } else {
                    completion_logprobs(tok, std::slice::from_ref(&sampled))
                };
                let pieces = self.pieces(&text);
                self.emit(pieces, lp);
                true
            }
            Some(Event::Finished(c)) if c.finish_reason == FinishReason::Cancelled => {
                let err = cut_off(&self.s, &c);
                self.out
                    .push_back(SseEvent::default().data(err.body().to_string()));
                self.out.push_back(SseEvent::default().data("[DONE]"));
                false
            }
            Some(Event::Finished(c)) => {
                self.meta.account(&self.s, &c);
                {
                    let rest: String = self
                        .script
                        .take()
                        .map(|s| s.into_iter().collect())
                        .unwrap_or_default();
                    let mut pieces = self.pieces(&rest);
                    if let Some(p) = &mut self.calls {
                        pieces.extend(p.finish());
                    }
                    self.emit(pieces, Value::Null);
                    let reason = if self.calls_sent > 0 {
                        "tool_calls"
                    } else {
                        openai::finish_reason(&c)
                    };
                    let delta = if self.meta.chat { json!({}) } else { json!("") };
                    let ev = self.chunk(delta, Value::Null, Some(reason));
                    self.out.push_back(ev);
                    if self.meta.include_usage {
                        let ev = self.event(json!([]), Some(openai::usage(&c)));
                        self.out.push_back(ev);
                    }
                }
                self.out.push_back(SseEvent::default().data("[DONE]"));
                false
            }
            // Events end with Finished or Failed; a stream that ends without one lost its
            // engine thread.
            e @ (Some(Event::Failed(_)) | None) => {
                let err = stream_failure(e);
                self.out
                    .push_back(SseEvent::default().data(err.body().to_string()));
                self.out.push_back(SseEvent::default().data("[DONE]"));
                false
            }
        }
    }
}

/// An SSE response that reads the request's events as they come. Dropping it (the client
/// went away) drops the handle, which cancels the request.
fn stream(
    s: Shared,
    handle: RequestHandle,
    meta: Meta,
) -> Sse<impl futures_util::Stream<Item = Result<SseEvent, Infallible>>> {
    let (calls, script) = stream_parsers(meta.tools.as_ref(), meta.script.as_ref());
    sse(StreamState {
        s,
        handle: Some(handle),
        meta,
        out: VecDeque::new(),
        calls,
        calls_sent: 0,
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

/// The tool-call parser of a streamed reply with tools, and what is left of
/// [`scripted_router`]'s script.
fn stream_parsers(
    tools: Option<&ToolParsing>,
    script: Option<&Vec<String>>,
) -> (Option<CallStream>, Option<VecDeque<String>>) {
    (
        tools.map(|t| CallStream::new(t.format, t.names.clone())),
        script.cloned().map(VecDeque::from),
    )
}

/// The error of a stream whose events ended without `Finished`: a failure, or (`None`)
/// the engine thread gone.
fn stream_failure(e: Option<Event>) -> ApiError {
    match e {
        Some(Event::Failed(e)) => e.into(),
        _ => crate::EngineError::EngineStopped.into(),
    }
}

/// A streamed response's state: it turns its request's events into SSE events.
trait EventStream: Send + 'static {
    /// SSE events ready to send.
    fn out(&mut self) -> &mut VecDeque<SseEvent>;
    /// The request's handle, `None` once its last event was read.
    fn handle(&mut self) -> &mut Option<RequestHandle>;
    /// Queues the SSE events of one engine event (`None`: the engine thread is gone);
    /// false once the response is complete.
    fn on(&mut self, e: Option<Event>) -> bool;
}

/// An SSE response that reads the request's events as they come. Dropping it (the client
/// went away) drops the handle, which cancels the request.
fn sse<S: EventStream>(
    state: S,
) -> Sse<impl futures_util::Stream<Item = Result<SseEvent, Infallible>>> {
    let events = futures_util::stream::unfold(state, |mut st| async move {
        loop {
            if let Some(ev) = st.out().pop_front() {
                return Some((Ok(ev), st));
            }
            let handle = st.handle().as_mut()?;
            let e = handle.recv().await;
            if !st.on(e) {
                *st.handle() = None;
            }
        }
    });
    Sse::new(events).keep_alive(KeepAlive::default())
}
