//! A throwaway `redis-server` on a free loopback port, killed when dropped. Shared by the
//! store's tests and the end-to-end tests (included by path there).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running `redis-server` child process (no persistence).
pub struct RedisServer {
    child: Option<Child>,
    port: u16,
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("binding a free loopback port")
}

/// A loopback URL where nothing listens (a port just freed).
pub fn dead_url() -> String {
    format!("redis://127.0.0.1:{}", free_port())
}

impl RedisServer {
    /// Starts one; panics with set-up instructions when `redis-server` is not installed.
    pub fn start() -> RedisServer {
        let port = free_port();
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string()])
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(["--maxmemory-policy", "allkeys-lru"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        let child = match child {
            Ok(c) => c,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!(
                "redis-server is not installed, and the remote-tier tests need it: \
                 run `bash scripts/setup.sh` as root (it installs Debian's redis-server)"
            ),
            Err(e) => panic!("starting redis-server: {e}"),
        };
        let server = RedisServer {
            child: Some(child),
            port,
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(reply) = server.try_command(&[b"PING"]) {
                if reply.starts_with(b"+PONG") {
                    return server;
                }
            }
            assert!(
                Instant::now() < deadline,
                "redis-server did not answer on port {port} within 10 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `redis://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Sends one command and returns the raw reply (one read; enough for short replies).
    pub fn command(&self, args: &[&[u8]]) -> Vec<u8> {
        self.try_command(args).expect("talking to redis-server")
    }

    fn try_command(&self, args: &[&[u8]]) -> std::io::Result<Vec<u8>> {
        let mut s = TcpStream::connect(("127.0.0.1", self.port))?;
        s.set_read_timeout(Some(Duration::from_secs(2)))?;
        let mut req = format!("*{}\r\n", args.len()).into_bytes();
        for a in args {
            req.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
            req.extend_from_slice(a);
            req.extend_from_slice(b"\r\n");
        }
        s.write_all(&req)?;
        let mut buf = vec![0u8; 4096];
        let n = s.read(&mut buf)?;
        buf.truncate(n);
        Ok(buf)
    }

    /// Kills the server (SIGKILL) and waits for it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}
