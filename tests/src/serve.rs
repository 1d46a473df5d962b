//! `kvstore serve` as a child process on a free loopback port, and a minimal HTTP client.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::kvstore_bin;

static LOGS: AtomicU64 = AtomicU64::new(0);

/// A running `kvstore serve`; dropped, it is killed.
pub struct Serve {
    child: Child,
    /// The port it listens on (127.0.0.1).
    pub port: u16,
    log: PathBuf,
}

impl Serve {
    /// Starts `kvstore serve --model MODEL --port 0 ARGS...` and waits until it listens.
    /// `Err` carries its log when it exits first or does not listen within 60 s.
    pub fn start(model: &Path, args: &[&str]) -> Result<Serve, String> {
        let log = std::env::temp_dir().join(format!(
            "kvstore-serve-{}-{}.log",
            std::process::id(),
            LOGS.fetch_add(1, Ordering::Relaxed)
        ));
        let file = std::fs::File::create(&log).map_err(|e| e.to_string())?;
        let child = Command::new(kvstore_bin())
            .arg("serve")
            .arg("--model")
            .arg(model)
            .args(["--port", "0"])
            .args(args)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::from(file))
            .spawn()
            .map_err(|e| format!("spawning kvstore serve: {e}"))?;
        let mut serve = Serve {
            child,
            port: 0,
            log,
        };
        let start = Instant::now();
        loop {
            let text = serve.log();
            if let Some(rest) = text.split("listening on http://127.0.0.1:").nth(1) {
                let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
                serve.port = digits.parse().map_err(|_| text.clone())?;
                return Ok(serve);
            }
            if let Ok(Some(status)) = serve.child.try_wait() {
                return Err(format!("kvstore serve exited with {status}:\n{text}"));
            }
            if start.elapsed() > Duration::from_secs(60) {
                return Err(format!("kvstore serve did not listen within 60 s:\n{text}"));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Everything the server logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGKILL, and reap it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM, and wait up to 60 s for it to exit.
    pub fn terminate(&mut self) -> Result<ExitStatus, String> {
        let pid = self.child.id().to_string();
        let sent = Command::new("kill").args(["-TERM", &pid]).status();
        if !matches!(sent, Ok(s) if s.success()) {
            return Err(format!("kill -TERM {pid} failed: {sent:?}"));
        }
        let start = Instant::now();
        loop {
            if let Some(s) = self.child.try_wait().map_err(|e| e.to_string())? {
                return Ok(s);
            }
            if start.elapsed() > Duration::from_secs(60) {
                return Err("kvstore serve did not exit within 60 s of SIGTERM".into());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Whether it is still running.
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// One HTTP request to the server (see [`http`]).
    pub fn http(&self, method: &str, path: &str, body: &str) -> std::io::Result<(u16, String)> {
        http(self.port, method, path, body)
    }

    /// Greedy `/v1/completions` text for `prompt`, or the failure.
    pub fn complete(&self, prompt: &str, max_tokens: usize) -> Result<Value, String> {
        let body = serde_json::json!({
            "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        })
        .to_string();
        let (status, text) = self
            .http("POST", "/v1/completions", &body)
            .map_err(|e| format!("request failed: {e}"))?;
        if status != 200 {
            return Err(format!("status {status}: {text}"));
        }
        serde_json::from_str(&text).map_err(|e| format!("{e}: {text}"))
    }

    /// The store's counters (`GET /v1/cache` → `store`).
    pub fn store_stats(&self) -> Value {
        let (status, text) = self.http("GET", "/v1/cache", "").expect("GET /v1/cache");
        assert_eq!(status, 200, "{text}");
        serde_json::from_str::<Value>(&text).expect("JSON")["store"].clone()
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_file(&self.log);
    }
}

/// One HTTP/1.1 request on loopback; returns the status and the body (chunked bodies are
/// returned raw).
pub fn http(port: u16, method: &str, path: &str, body: &str) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(120)))?;
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    let (head, rest) = out.split_once("\r\n\r\n").unwrap_or((&out, ""));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    Ok((status, rest.to_string()))
}

/// A metric's value from the Prometheus text of `/metrics` (`name` includes any labels).
pub fn gauge(port: u16, name: &str) -> f64 {
    let (status, text) = http(port, "GET", "/metrics", "").expect("GET /metrics");
    assert_eq!(status, 200);
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse().ok()))
        .unwrap_or_else(|| panic!("{name} missing from /metrics"))
}

/// Files under `dir`, recursively.
pub fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(files(&p));
        } else {
            out.push(p);
        }
    }
    out
}
