//! Where `kvstore serve` takes its API key from (`--api-key`, `--api-key-file`,
//! `$KVSTORE_API_KEY`, in that order), and `--metrics-need-key`, through the built binary
//! and real HTTP requests.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kvstore"));
    c.env_remove("KVSTORE_DIR")
        .env_remove("KVSTORE_API_KEY")
        .env("RUST_LOG", "warn");
    c
}

fn tiny() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../engine/tests/goldens/tiny-qwen3")
}

/// `kvstore serve --no-cache --port 0` on the tiny model; the test adds its flags.
fn serve() -> Command {
    let mut c = bin();
    c.args(["serve", "--no-cache", "--port", "0", "--model"])
        .arg(tiny());
    c
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// A `kvstore serve --no-cache --port 0` child on the tiny model; killed when dropped.
struct Serve {
    child: Child,
    addr: String,
    /// What it printed on stderr up to the "listening" line.
    log: String,
}

impl Serve {
    fn start(cmd: &mut Command) -> Serve {
        let mut child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let mut log = String::new();
        let t = Instant::now();
        let addr = loop {
            let Some(Ok(line)) = lines.next() else {
                let _ = child.kill();
                panic!("serve exited before listening: {log}");
            };
            log.push_str(&line);
            log.push('\n');
            if let Some(a) = line.split("listening on http://").nth(1) {
                break a.trim().to_string();
            }
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "never listened: {log}"
            );
        };
        // Keep draining stderr so the child never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        Serve { child, addr, log }
    }

    /// The status of `GET path` with `key` as the bearer token.
    fn get(&self, path: &str, key: Option<&str>) -> u16 {
        let mut s = TcpStream::connect(&self.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let auth = key.map_or(String::new(), |k| format!("Authorization: Bearer {k}\r\n"));
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{auth}\r\n"
        )
        .unwrap();
        let mut raw = String::new();
        s.read_to_string(&mut raw).unwrap();
        raw.split(' ').nth(1).unwrap().parse().unwrap()
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn key_file(dir: &tempfile::TempDir, contents: &str) -> PathBuf {
    let p = dir.path().join("key");
    std::fs::write(&p, contents).unwrap();
    p
}

#[test]
fn the_api_key_comes_from_a_file_and_beats_the_environment() {
    let dir = tempfile::tempdir().unwrap();
    let path = key_file(&dir, "  sk-from-file\n");
    let srv = Serve::start(
        serve()
            .arg("--api-key-file")
            .arg(&path)
            .env("KVSTORE_API_KEY", "sk-from-env"),
    );
    assert_eq!(srv.get("/v1/models", None), 401);
    assert_eq!(srv.get("/v1/models", Some("sk-from-env")), 401);
    assert_eq!(srv.get("/v1/models", Some("sk-from-fil")), 401);
    assert_eq!(srv.get("/v1/models", Some("sk-from-file")), 200);
    // By default /metrics and /health stay open, as a Prometheus scraper expects.
    assert_eq!(srv.get("/metrics", None), 200);
    assert_eq!(srv.get("/health", None), 200);
    // The file is readable by others (0644 from std::fs::write): the log says so.
    assert!(srv.log.contains("readable by other users"), "{}", srv.log);
}

#[test]
fn the_api_key_comes_from_the_environment_and_metrics_can_need_it() {
    let srv = Serve::start(
        serve()
            .arg("--metrics-need-key")
            .env("KVSTORE_API_KEY", "sk-from-env"),
    );
    assert_eq!(srv.get("/v1/models", None), 401);
    assert_eq!(srv.get("/v1/models", Some("sk-from-env")), 200);
    assert_eq!(srv.get("/metrics", None), 401);
    assert_eq!(srv.get("/metrics", Some("sk-wrong")), 401);
    assert_eq!(srv.get("/metrics", Some("sk-from-env")), 200);
    assert_eq!(srv.get("/health", None), 200);
    drop(srv);
    // --api-key beats the environment.
    let srv = Serve::start(
        serve()
            .args(["--api-key", "sk-flag"])
            .env("KVSTORE_API_KEY", "sk-from-env"),
    );
    assert_eq!(srv.get("/v1/models", Some("sk-from-env")), 401);
    assert_eq!(srv.get("/v1/models", Some("sk-flag")), 200);
}

#[test]
fn unusable_key_settings_are_refused_at_start_up() {
    let dir = tempfile::tempdir().unwrap();
    let run = |cmd: &mut Command| -> Output { cmd.output().unwrap() };
    let empty = key_file(&dir, " \n");
    let out = run(serve().arg("--api-key-file").arg(&empty));
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("API key is empty"), "{}", text(&out));

    let out = run(serve().args(["--api-key-file", "/dev/zero"]));
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("not a key"), "{}", text(&out));

    let missing = dir.path().join("no-such-key");
    let out = run(serve().arg("--api-key-file").arg(&missing));
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("no-such-key"), "{}", text(&out));

    let out = run(serve().args(["--api-key", "sk-é"]));
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("printable ASCII"), "{}", text(&out));

    let out = run(serve()
        .args(["--api-key", "a"])
        .arg("--api-key-file")
        .arg(&empty));
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("cannot be used with"), "{}", text(&out));

    let out = run(serve().arg("--metrics-need-key"));
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("needs an API key"), "{}", text(&out));
}
