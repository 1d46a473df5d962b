//! Hostile inputs through the built binary (issue 21): crafted model files, an empty API
//! key, escape sequences in a store, a second server on a live Unix socket, and what a
//! client sees while the server drains.

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kvstore"));
    c.env_remove("KVSTORE_DIR")
        .env_remove("KVSTORE_API_KEY")
        .env("RUST_LOG", "info");
    c
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn tiny() -> PathBuf {
    root().join("engine/tests/goldens/tiny-qwen3")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn crafted_ggufs_end_generate_with_a_message_not_a_signal() {
    let dir = root().join("tests/fixtures/hostile");
    let expected: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    for (name, phrase) in &expected {
        let out = bin()
            .args(["generate", "--no-cache", "--prompt", "hi", "--model"])
            .arg(dir.join(name))
            .output()
            .unwrap();
        assert_eq!(
            out.status.signal(),
            None,
            "{name} killed the process: {}",
            text(&out)
        );
        assert_eq!(out.status.code(), Some(1), "{name}: {}", text(&out));
        let phrase = phrase.as_str().unwrap();
        assert!(text(&out).contains(phrase), "{name}: {}", text(&out));
    }
}

#[test]
fn an_empty_api_key_is_refused() {
    let out = bin()
        .args([
            "serve",
            "--no-cache",
            "--port",
            "0",
            "--api-key",
            "",
            "--model",
        ])
        .arg(tiny())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("API key is empty"), "{}", text(&out));
    let out = bin()
        .args(["serve", "--no-cache", "--port", "0", "--model"])
        .arg(tiny())
        .env("KVSTORE_API_KEY", " ")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("API key is empty"), "{}", text(&out));
}

#[test]
fn inspect_escapes_salts_model_names_and_planted_file_names() {
    use store::{Dtype, NamespaceDescription, PlaneSpec, Store, StoreConfig};
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("store");
    let mut d = NamespaceDescription::new("model\x1b[31mred", Dtype::F32, 2);
    d.planes = vec![PlaneSpec::new("k", Dtype::F32, vec![2, 4])];
    d.salt = Some("tenant\x1b]0;owned\x07\nnamespace 0000fake".into());
    let ns = {
        let s: Store = Store::open(StoreConfig::default().root(&root)).unwrap();
        let ns = s.register_namespace(&d).unwrap();
        s.close().unwrap();
        ns
    };
    std::fs::write(root.join(ns.to_string()).join("x\x1b[2J\u{202e}.txt"), b"").unwrap();
    let out = bin()
        .args(["inspect", "--store"])
        .arg(&root)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", text(&out));
    for bad in ['\x1b', '\x07', '\u{202e}'] {
        assert!(!stdout.contains(bad), "raw {bad:?} printed: {stdout}");
    }
    assert!(
        !stdout.lines().any(|l| l.starts_with("namespace 0000fake")),
        "a salt printed a fake line: {stdout}"
    );
    assert!(
        stdout.contains("\\x1b]0;owned\\x07\\nnamespace 0000fake"),
        "{stdout}"
    );
    assert!(stdout.contains("model\\x1b[31mred"), "{stdout}");
    assert!(stdout.contains("x\\x1b[2J\\u{202e}.txt"), "{stdout}");
}

/// `kvstore serve --unix PATH` on the tiny model; returns once it answers on PATH.
fn serve_unix(sock: &Path, log: &Path) -> Child {
    let mut child = bin()
        .args(["serve", "--no-cache", "--model"])
        .arg(tiny())
        .arg("--unix")
        .arg(sock)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while health_unix(sock).is_none() {
        if let Ok(Some(s)) = child.try_wait() {
            panic!(
                "serve exited with {s}: {}",
                std::fs::read_to_string(log).unwrap()
            );
        }
        assert!(t.elapsed() < Duration::from_secs(60), "never listened");
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

fn health_unix(sock: &Path) -> Option<u16> {
    let mut s = UnixStream::connect(sock).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .ok()?;
    let mut raw = String::new();
    s.read_to_string(&mut raw).ok()?;
    raw.split(' ').nth(1)?.parse().ok()
}

fn stop(mut child: Child) {
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(30) {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
}

#[test]
fn a_second_server_never_takes_a_live_unix_socket() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("kv.sock");
    let first = serve_unix(&sock, &dir.path().join("first.log"));
    let out = bin()
        .args(["serve", "--no-cache", "--model"])
        .arg(tiny())
        .arg("--unix")
        .arg(&sock)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        text(&out).contains("another kvstore serve (pid"),
        "{}",
        text(&out)
    );
    assert_eq!(
        health_unix(&sock),
        Some(200),
        "the first server lost its socket"
    );
    stop(first);
    assert!(!sock.exists(), "the socket outlived its server");
}

#[test]
fn unix_refuses_to_replace_files_links_and_live_foreign_sockets() {
    let dir = tempfile::tempdir().unwrap();
    let run = |sock: &Path| {
        bin()
            .args(["serve", "--no-cache", "--model"])
            .arg(tiny())
            .arg("--unix")
            .arg(sock)
            .output()
            .unwrap()
    };
    // A regular file.
    let file = dir.path().join("file.sock");
    std::fs::write(&file, b"precious").unwrap();
    let out = run(&file);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("is a regular file"), "{}", text(&out));
    assert_eq!(std::fs::read(&file).unwrap(), b"precious");
    // A symlink to a file elsewhere.
    let target = dir.path().join("target.txt");
    std::fs::write(&target, b"precious").unwrap();
    let link = dir.path().join("link.sock");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let out = run(&link);
    assert!(text(&out).contains("is a symbolic link"), "{}", text(&out));
    assert!(std::fs::symlink_metadata(&link).unwrap().is_symlink());
    assert_eq!(std::fs::read(&target).unwrap(), b"precious");
    // A live socket of another program.
    let other = dir.path().join("other.sock");
    let listener = UnixListener::bind(&other).unwrap();
    let out = run(&other);
    assert!(
        text(&out).contains("a live server answers"),
        "{}",
        text(&out)
    );
    drop(listener);
    // Now it is stale (nothing listens): that one is replaced.
    let child = serve_unix(&other, &dir.path().join("stale.log"));
    assert_eq!(health_unix(&other), Some(200));
    stop(child);
}

/// `kvstore serve` on TCP port 0; returns the child and its port.
fn serve_tcp(args: &[&str], log: &Path) -> (Child, u16) {
    let mut child = bin()
        .args(["serve", "--no-cache", "--port", "0", "--model"])
        .arg(tiny())
        .args(args)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .unwrap();
    let t = Instant::now();
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if let Some(rest) = text.split("listening on http://127.0.0.1:").nth(1) {
            let port: String = rest.chars().take_while(char::is_ascii_digit).collect();
            return (child, port.parse().unwrap());
        }
        if let Ok(Some(s)) = child.try_wait() {
            panic!("serve exited with {s}: {text}");
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "never listened: {text}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn http(port: u16, method: &str, path: &str, body: &str) -> std::net::TcpStream {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: \
         application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    s
}

fn read_all(mut s: std::net::TcpStream) -> String {
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    String::from_utf8_lossy(&raw).into_owned()
}

/// Starts a long streamed chat and waits for its first content.
fn long_stream(port: u16) -> (std::net::TcpStream, String) {
    let body = serde_json::json!({
        "messages": [{"role": "user", "content": "Tell me a very long story."}],
        "max_tokens": 480, "stream": true, "temperature": 0,
    })
    .to_string();
    let mut s = http(port, "POST", "/v1/chat/completions", &body);
    let mut seen = String::new();
    let mut buf = [0u8; 4096];
    while seen.matches("data: ").count() < 3 {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "stream ended early: {seen}");
        seen.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    (s, seen)
}

fn sigterm(child: &Child) {
    let ok = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(ok.success());
}

#[test]
fn health_is_503_while_draining_and_open_requests_finish_honestly() {
    let dir = tempfile::tempdir().unwrap();
    let (mut child, port) = serve_tcp(&["--shutdown-grace", "60s"], &dir.path().join("s.log"));
    let (s, seen) = long_stream(port);
    sigterm(&child);
    // Draining: /health says so, new work is refused, the open stream goes on.
    let t = Instant::now();
    let health = loop {
        let r = read_all(http(port, "GET", "/health", ""));
        if !r.starts_with("HTTP/1.1 200") || t.elapsed() > Duration::from_secs(5) {
            break r;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    assert!(health.starts_with("HTTP/1.1 503"), "{health}");
    let rest = seen + &read_all(s);
    assert!(rest.contains("\"finish_reason\":\"length\""), "{rest}");
    assert!(!rest.contains("\"error\""), "{rest}");
    let status = child.wait().unwrap();
    assert!(status.success(), "{status}");
}

#[test]
fn a_stream_cut_off_by_the_grace_period_ends_with_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let (mut child, port) = serve_tcp(&["--shutdown-grace", "0s"], &dir.path().join("s.log"));
    let (s, seen) = long_stream(port);
    sigterm(&child);
    let rest = seen + &read_all(s);
    assert!(rest.contains("request_cancelled"), "{rest}");
    assert!(!rest.contains("\"finish_reason\":\"stop\""), "{rest}");
    assert!(!rest.contains("\"finish_reason\":\"length\""), "{rest}");
    let (error_at, done_at) = (rest.find("request_cancelled"), rest.find("data: [DONE]"));
    assert!(error_at < done_at && error_at.is_some(), "{rest}");
    assert!(child.wait().unwrap().success());
}

#[test]
fn the_default_connection_cap_stays_below_the_file_descriptor_limit() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("s.log");
    // 256 descriptors: the default cap becomes 256 - 128 = 128 connections.
    let script = format!(
        "ulimit -n 256 && exec '{}' serve --no-cache --port 0 --keep-alive-timeout 600s \
         --model '{}'",
        env!("CARGO_BIN_EXE_kvstore"),
        tiny().display()
    );
    let mut child = Command::new("sh")
        .args(["-c", &script])
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let t = Instant::now();
    let port: u16 = loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if let Some(rest) = text.split("listening on http://127.0.0.1:").nth(1) {
            break rest
                .chars()
                .take_while(char::is_ascii_digit)
                .collect::<String>()
                .parse()
                .unwrap();
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "never listened: {text}"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut held = Vec::new();
    let mut refused = None;
    for _ in 0..300 {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
        let mut buf = [0u8; 512];
        match s.read(&mut buf) {
            Ok(n) if n > 0 => {
                refused = Some(String::from_utf8_lossy(&buf[..n]).into_owned());
                break;
            }
            _ => held.push(s),
        }
    }
    let refused = refused.expect("300 connections and none was refused with a 503");
    assert!(refused.starts_with("HTTP/1.1 503"), "{refused}");
    assert!(
        held.len() >= 100 && held.len() <= 128,
        "{} held",
        held.len()
    );
    drop(held);
    let t = Instant::now();
    while !read_all(http(port, "GET", "/health", "")).starts_with("HTTP/1.1 200") {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "never answered again"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    sigterm(&child);
    assert!(child.wait().unwrap().success());
}
