//! A running `kvstore serve` (or any OpenAI-compatible server that takes token-id prompts)
//! as a replay target: `POST /v1/completions` with the prompt as token ids, streamed (SSE)
//! so the first text's arrival is seen (TTFT, as AIPerf and other clients measure it), and
//! `stream_options.include_usage` for the token counts. No `logprobs`: a client of a trace
//! does not ask for them, and they cost the server a log-softmax and a read per token and
//! keep a greedy row out of the batch's shared pick. Plain HTTP/1.1 over one connection
//! per request (`Connection: close`), so no client library is needed.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

use super::dispatch::{Outcome, Target};

/// Where the server is and how to talk to it.
pub struct HttpTarget {
    /// `host:port`.
    authority: String,
    /// Path before `/v1/...` (empty, or `/prefix`).
    base: String,
    /// The `model` field, if given.
    model: Option<String>,
    /// Bearer key, if the server needs one.
    api_key: Option<String>,
}

impl HttpTarget {
    /// A target for `url` (`http://host:port[/base]`; TLS is not supported).
    pub fn new(url: &str, model: Option<String>, api_key: Option<String>) -> Result<HttpTarget> {
        let Some(rest) = url.strip_prefix("http://") else {
            bail!("--url {url:?}: only http://host:port[/path] is supported");
        };
        let (authority, base) = match rest.find('/') {
            Some(i) => (&rest[..i], rest[i..].trim_end_matches('/')),
            None => (rest, ""),
        };
        if authority.is_empty() {
            bail!("--url {url:?} names no host");
        }
        Ok(HttpTarget {
            authority: authority.to_string(),
            base: base.to_string(),
            model,
            api_key,
        })
    }

    /// Sends one request; returns the status and a reader over the (de-chunked) body.
    fn request(&self, method: &str, path: &str, body: &[u8]) -> Result<(u16, Body)> {
        let stream = TcpStream::connect(&self.authority)
            .with_context(|| format!("connecting to {}", self.authority))?;
        stream.set_read_timeout(Some(Duration::from_secs(3600)))?;
        let mut head = format!(
            "{method} {}{path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n",
            self.base,
            self.authority,
            body.len()
        );
        if let Some(k) = &self.api_key {
            head += &format!("Authorization: Bearer {k}\r\n");
        }
        head += "\r\n";
        let mut w = &stream;
        w.write_all(head.as_bytes())?;
        w.write_all(body)?;
        let mut r = BufReader::new(stream);
        let mut line = String::new();
        r.read_line(&mut line)?;
        let status = line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse::<u16>().ok())
            .with_context(|| format!("not an HTTP status line: {line:?}"))?;
        let mut chunked = false;
        loop {
            line.clear();
            if r.read_line(&mut line)? == 0 || line.trim().is_empty() {
                break;
            }
            if let Some((k, v)) = line.split_once(':') {
                if k.trim().eq_ignore_ascii_case("transfer-encoding")
                    && v.trim().eq_ignore_ascii_case("chunked")
                {
                    chunked = true;
                }
            }
        }
        Ok((
            status,
            Body {
                r,
                chunked,
                done: false,
            },
        ))
    }

    /// The counters of the server's Prometheus `/metrics` whose names start with `prefix`,
    /// by their full name with labels (`kvstore_cached_prompt_tokens_total{tier="ram"}`).
    pub fn metrics(&self, prefix: &str) -> Result<Vec<(String, f64)>> {
        let (status, mut body) = self.request("GET", "/metrics", b"")?;
        let text = String::from_utf8_lossy(&body.read_all()?).into_owned();
        if status != 200 {
            bail!("GET /metrics: HTTP {status}: {text}");
        }
        Ok(text
            .lines()
            .filter(|l| l.starts_with(prefix))
            .filter_map(|l| {
                let (k, v) = l.rsplit_once(' ')?;
                Some((k.to_string(), v.parse().ok()?))
            })
            .collect())
    }

    /// `GET path`: the status and the body as text.
    pub fn get(&self, path: &str) -> Result<(u16, String)> {
        let (status, mut body) = self.request("GET", path, b"")?;
        Ok((
            status,
            String::from_utf8_lossy(&body.read_all()?).into_owned(),
        ))
    }

    /// Streams one greedy `POST /v1/completions` of `prompt` (token ids or text) and
    /// records when each piece arrived. `per_token` asks for `logprobs: 0` so that a
    /// kvstore server sends every token as its own event (a server that rejects the field,
    /// as mlx_lm.server does, must be called without it).
    pub fn stream_completion(
        &self,
        prompt: Value,
        max_tokens: usize,
        per_token: bool,
    ) -> Result<Streamed> {
        let mut body = json!({
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        if per_token {
            body["logprobs"] = json!(0);
        }
        if let Some(m) = &self.model {
            body["model"] = json!(m);
        }
        let bytes = serde_json::to_vec(&body)?;
        let sent = Instant::now();
        // A server with a short listen backlog (mlx_lm.server's is Python's default, 5)
        // resets connections beyond it under load: such a request never reached it and is
        // sent again, as client libraries do; the time counts from the first attempt.
        let mut retries = 0;
        let (status, mut body) = loop {
            match self.request("POST", "/v1/completions", &bytes) {
                Err(e) if retries < MAX_RETRIES && never_reached_the_server(&e) => {
                    retries += 1;
                    std::thread::sleep(Duration::from_millis(20 * retries as u64));
                }
                r => break r?,
            }
        };
        if status != 200 {
            let text = String::from_utf8_lossy(&body.read_all()?).into_owned();
            bail!("HTTP {status}: {}", text.trim());
        }
        let mut out = Streamed {
            sent,
            retries,
            arrivals: Vec::new(),
            text: String::new(),
            outcome: Outcome::default(),
        };
        let mut pending = Vec::new();
        while let Some(chunk) = body.next_chunk()? {
            pending.extend_from_slice(&chunk);
            while let Some(nl) = pending.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = pending.drain(..=nl).collect();
                let line = String::from_utf8_lossy(&line);
                let Some(data) = line.trim().strip_prefix("data:") else {
                    continue;
                };
                let data = data.trim();
                if data == "[DONE]" {
                    continue;
                }
                let v: Value = serde_json::from_str(data)
                    .with_context(|| format!("a stream event is not JSON: {data:?}"))?;
                if let Some(e) = v.get("error") {
                    bail!("the server ended the stream with an error: {e}");
                }
                let text = v["choices"][0]["text"].as_str().unwrap_or("");
                if v["choices"][0]["logprobs"].is_object() || !text.is_empty() {
                    out.arrivals.push(Instant::now());
                    out.text.push_str(text);
                }
                if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
                    let n = |x: &Value| x.as_u64().unwrap_or(0) as usize;
                    out.outcome.prompt_tokens = n(&u["prompt_tokens"]);
                    out.outcome.completion_tokens = n(&u["completion_tokens"]);
                    out.outcome.cached_tokens = n(&u["prompt_tokens_details"]["cached_tokens"]);
                }
            }
        }
        let o = &mut out.outcome;
        o.ttft_s = out.arrivals.first().map(|t| (*t - sent).as_secs_f64());
        o.e2e_s = Some(sent.elapsed().as_secs_f64());
        if o.completion_tokens == 0 {
            o.completion_tokens = out.arrivals.len();
        }
        Ok(out)
    }
}

/// One streamed completion: when it was sent, when each piece of it arrived, its text.
pub struct Streamed {
    /// When the request was first sent.
    pub sent: Instant,
    /// Times it was sent again because the connection was refused or reset before the
    /// server answered.
    pub retries: usize,
    /// When each event carrying a token (or a piece of text) arrived.
    pub arrivals: Vec<Instant>,
    /// The completion's text.
    pub text: String,
    /// Token counts and latencies.
    pub outcome: Outcome,
}

impl Target for HttpTarget {
    fn send(&self, prompt: Vec<u32>, max_tokens: usize) -> Outcome {
        self.stream_completion(json!(prompt), max_tokens, false)
            .map(|s| s.outcome)
            .unwrap_or_else(|e| Outcome::failed(format!("{e:#}")))
    }
}

/// Attempts after the first for a request whose connection failed before any answer.
const MAX_RETRIES: usize = 8;

/// Whether `e` is a refused or reset connection, met before a status line arrived.
fn never_reached_the_server(e: &anyhow::Error) -> bool {
    e.chain()
        .filter_map(|c| c.downcast_ref::<std::io::Error>())
        .any(|io| {
            matches!(
                io.kind(),
                std::io::ErrorKind::ConnectionRefused
                    | std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::ConnectionAborted
                    | std::io::ErrorKind::BrokenPipe
            )
        })
}

/// A response body, de-chunked when the server chunks it, else read to the end.
struct Body {
    r: BufReader<TcpStream>,
    chunked: bool,
    done: bool,
}

impl Body {
    /// The next piece of the body as it arrives; `None` at its end.
    fn next_chunk(&mut self) -> Result<Option<Vec<u8>>> {
        if self.done {
            return Ok(None);
        }
        if !self.chunked {
            let mut buf = vec![0u8; 16 << 10];
            let n = self.r.read(&mut buf)?;
            if n == 0 {
                self.done = true;
                return Ok(None);
            }
            buf.truncate(n);
            return Ok(Some(buf));
        }
        let mut line = String::new();
        if self.r.read_line(&mut line)? == 0 {
            bail!("the connection closed inside a chunked body");
        }
        let size = line.trim().split(';').next().unwrap_or("");
        let size = usize::from_str_radix(size, 16)
            .with_context(|| format!("bad chunk size line {line:?}"))?;
        if size == 0 {
            self.done = true;
            return Ok(None);
        }
        let mut buf = vec![0u8; size];
        self.r.read_exact(&mut buf)?;
        let mut crlf = [0u8; 2];
        self.r.read_exact(&mut crlf)?;
        Ok(Some(buf))
    }

    fn read_all(&mut self) -> Result<Vec<u8>> {
        let mut all = Vec::new();
        while let Some(c) = self.next_chunk()? {
            all.extend(c);
        }
        Ok(all)
    }
}
