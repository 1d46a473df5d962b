//! A server a benchmark starts as a child process on a free loopback port: `kvstore serve`
//! (this executable) or the peer, mlx-lm's `mlx_lm.server`. Dropped, it is killed.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use super::trace::http::HttpTarget;

/// A running server child.
pub struct ChildServer {
    child: Child,
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

/// A port nothing listens on right now (the OS picks it; another process could take it
/// before the child binds it, which the child then reports).
fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(l.local_addr()?.port())
}

impl ChildServer {
    /// `kvstore serve --model MODEL --port P ARGS...` from this executable.
    pub fn kvstore(model: &Path, args: &[String]) -> Result<ChildServer> {
        let exe = std::env::current_exe().context("locating the kvstore executable")?;
        let port = free_port()?;
        let mut cmd = Command::new(exe);
        cmd.arg("serve")
            .arg("--model")
            .arg(model)
            .args(["--port", &port.to_string()])
            .args(args);
        ChildServer::start(cmd, port, "kvstore serve")
    }

    /// The Hugging Face folder mlx_lm.server would load (`peer_model`, else `model`) and
    /// its tokenizer; an error naming `--peer-model` when it is not a folder.
    pub fn mlx_lm_folder(
        model: PathBuf,
        peer_model: Option<PathBuf>,
    ) -> Result<(PathBuf, engine::Tokenizer)> {
        let folder = peer_model.unwrap_or(model);
        if !folder.is_dir() {
            bail!(
                "mlx_lm.server loads Hugging Face folders; {} is not one: pass --peer-model DIR",
                folder.display()
            );
        }
        let tokenizer = engine::Tokenizer::from_folder(&folder)
            .map_err(|e| anyhow::anyhow!("loading the tokenizer of {}: {e}", folder.display()))?;
        Ok((folder, tokenizer))
    }

    /// `PYTHON -m mlx_lm.server --model MODEL --port P --prompt-cache-size N` (greedy by
    /// default, as kvstore). `N` prompt caches are kept: mlx-lm's default (10) would make
    /// more concurrent sessions than that evict each other, which a user serving them would
    /// not configure. `cache_bytes`: `--prompt-cache-bytes`, the caches' byte budget.
    pub fn mlx_lm(
        python: &str,
        model: &Path,
        prompt_caches: usize,
        cache_bytes: Option<u64>,
    ) -> Result<ChildServer> {
        super::peer_blas::warn_if_reference_blas(Path::new(python));
        let port = free_port()?;
        let mut cmd = Command::new(python);
        cmd.args(["-m", "mlx_lm.server", "--model"])
            .arg(model)
            .args(["--port", &port.to_string(), "--log-level", "WARNING"])
            .args(["--prompt-cache-size", &prompt_caches.max(10).to_string()]);
        if let Some(b) = cache_bytes {
            cmd.args(["--prompt-cache-bytes", &b.to_string()]);
        }
        super::peer_env(&mut cmd);
        ChildServer::start(cmd, port, "mlx_lm.server")
    }

    fn start(mut cmd: Command, port: u16, what: &str) -> Result<ChildServer> {
        let dir = tempfile::tempdir().context("creating a directory for the server's log")?;
        let log = dir.path().join("server.log");
        let file = std::fs::File::create(&log)?;
        let child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::from(file))
            .spawn()
            .with_context(|| format!("starting {what}"))?;
        let mut server = ChildServer {
            child,
            url: format!("http://127.0.0.1:{port}"),
            log,
            _dir: dir,
        };
        let client = HttpTarget::new(&server.url, None, None)?;
        let t0 = Instant::now();
        loop {
            if let Ok((200, _)) = client.get("/health") {
                return Ok(server);
            }
            if let Some(status) = server.child.try_wait()? {
                bail!(
                    "{what} exited with {status} before it listened:\n{}",
                    server.log_tail()
                );
            }
            if t0.elapsed() > Duration::from_secs(300) {
                bail!(
                    "{what} did not answer /health within 300 s:\n{}",
                    server.log_tail()
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// The last lines of the child's log, for an error message.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }
}

impl Drop for ChildServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
