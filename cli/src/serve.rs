//! `kvstore serve`: the OpenAI-compatible server over the engine, with prefix reuse.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use engine::server::{self, ConnectionLimits, ServerConfig};
use engine::{Engine, EngineConfig};

use crate::cache_args::{parse_size, CacheArgs};
use crate::generate::ModelArgs;

/// Flags of `kvstore serve`.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    cache: CacheArgs,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0 picks a free one; the address is logged).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Listen on this Unix socket instead of TCP.
    #[arg(long, value_name = "PATH")]
    unix: Option<PathBuf>,
    /// Most requests decoding together.
    #[arg(long, default_value_t = 8)]
    max_batch: usize,
    /// Requests waiting for admission before new ones get 503 (`queue_full`).
    #[arg(long, default_value_t = 256)]
    max_queue: usize,
    /// Most prompt tokens prefilled per engine step while other requests decode: a long
    /// prompt delays running streams by one such chunk per step, not by its whole prefill
    /// [default: 2048 on a GPU (mlx-lm's prefill step), 512 on the CPU].
    #[arg(long, value_name = "N", value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    prefill_chunk: Option<usize>,
    /// Which admitted prompt is prefilled next: `arrival` (oldest first) or `fewest-new`
    /// (the fewest tokens left to compute first, so a prompt mostly restored from the cache
    /// answers at once; each step a prompt waits counts as one of its chunks computed, so
    /// none is passed over for ever).
    #[arg(long, value_name = "arrival|fewest-new", default_value = "fewest-new")]
    prefill_order: engine::PrefillOrder,
    /// Threads that look up and load queued requests' cached prefixes from RAM, SSD or
    /// Redis, a load each at a time: a slow load (a cold SSD, a remote tier) holds back only
    /// its own request, whose place in the queue is kept while the ones behind it are
    /// admitted.
    #[arg(long, value_name = "N", default_value_t = engine::DEFAULT_IO_WORKERS, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=64))]
    io_workers: usize,
    /// Milliseconds admission waits, at most, for the loads of just-submitted requests
    /// before a step with a prompt to prefill, so that a burst's later prompts join that
    /// step instead of waiting for it (0: never waits).
    #[arg(long, value_name = "MS", default_value_t = engine::DEFAULT_LOAD_GRACE.as_secs_f64() * 1e3)]
    load_grace: f64,
    /// What one prefill pass may hold on a GPU at once: its layers' activations, and their
    /// attention scores where MLX materializes them (no fused attention for the model's
    /// dtype: f32 on CUDA); the pass waits for the device between layers to stay within it.
    #[arg(long, value_name = "SIZE", default_value = "8GiB")]
    pass_workspace: String,
    /// While requests decode, a step with a prefill chunk takes at most this multiple of a
    /// decode-only step (1.5, say): the chunk (at most --prefill-chunk) is sized from
    /// measured step times, putting running streams before a long prompt's TTFT; `none`
    /// (the default) always runs the whole --prefill-chunk.
    #[arg(long, value_name = "X|none", default_value = "none", value_parser = parse_itl_stretch)]
    itl_stretch: ItlStretch,
    /// Require `Authorization: Bearer KEY` on /v1/* and /admin/* (default:
    /// $KVSTORE_API_KEY). Other users can read a command line: prefer --api-key-file.
    #[arg(long, value_name = "KEY", conflicts_with = "api_key_file")]
    api_key: Option<String>,
    /// Read the API key from this file (surrounding whitespace ignored); beats
    /// $KVSTORE_API_KEY.
    #[arg(long, value_name = "PATH")]
    api_key_file: Option<PathBuf>,
    /// Require the API key on /metrics too (by default /metrics is open, as in vLLM, so a
    /// Prometheus scraper needs no credentials).
    #[arg(long)]
    metrics_need_key: bool,
    /// The model id clients name; default: the model file's name.
    #[arg(long, value_name = "ID")]
    served_model_name: Option<String>,
    /// Largest request body.
    #[arg(long, value_name = "SIZE", default_value = "4MiB")]
    max_body: String,
    /// Most tokens one request may generate (larger `max_tokens` gets 400; requests
    /// without `max_tokens` stop here or at the end of the context).
    #[arg(long, value_name = "N", default_value_t = 4096)]
    max_tokens_limit: usize,
    /// On SIGINT/SIGTERM, how long in-flight requests may run before they are cancelled.
    #[arg(long, value_name = "DURATION", default_value = "30s")]
    shutdown_grace: humantime::Duration,
    /// Close a keep-alive connection after this long without a request or a byte.
    #[arg(long, value_name = "DURATION", default_value = "5s")]
    keep_alive_timeout: humantime::Duration,
    /// Close a connection whose request headers have not all arrived after this long.
    #[arg(long, value_name = "DURATION", default_value = "30s")]
    header_read_timeout: humantime::Duration,
    /// Answer 408 to a request whose body has not all arrived this long after its headers.
    #[arg(long, value_name = "DURATION", default_value = "60s")]
    body_read_timeout: humantime::Duration,
    /// Most connections open at once; more get 503 and are closed. Default: 1024, or less
    /// where the file-descriptor limit (`ulimit -n`) would run out first.
    #[arg(long, value_name = "N")]
    max_connections: Option<usize>,
}

/// Runs the server until SIGINT or SIGTERM.
pub fn run(args: Args) -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    if args.max_batch == 0 {
        bail!("--max-batch must be at least 1");
    }
    if args.max_tokens_limit == 0 {
        bail!("--max-tokens-limit must be at least 1");
    }
    let max_connections = match args.max_connections {
        Some(0) => bail!("--max-connections must be at least 1"),
        Some(n) => n,
        None => default_max_connections(),
    };
    let limits = ConnectionLimits {
        keep_alive_timeout: args.keep_alive_timeout.into(),
        header_read_timeout: args.header_read_timeout.into(),
        body_read_timeout: args.body_read_timeout.into(),
        max_connections,
        ..ConnectionLimits::default()
    };
    for (flag, d) in [
        ("--keep-alive-timeout", limits.keep_alive_timeout),
        ("--header-read-timeout", limits.header_read_timeout),
        ("--body-read-timeout", limits.body_read_timeout),
    ] {
        if d.is_zero() {
            bail!("{flag} must be more than 0");
        }
    }
    let api_key = api_key(&args)?;
    if args.metrics_need_key && api_key.is_none() {
        bail!(
            "--metrics-need-key needs an API key (--api-key, --api-key-file or \
             $KVSTORE_API_KEY)"
        );
    }
    // Claim the socket path before the (slow) model load: a second server fails at once.
    let unix = match &args.unix {
        Some(path) => Some(crate::unix_socket::SocketClaim::take(path)?),
        None => None,
    };
    let path = args.model.path()?;
    let model_id = args.served_model_name.clone().unwrap_or_else(|| {
        path.file_name()
            .map_or_else(|| "default".into(), |n| n.to_string_lossy().into_owned())
    });
    let (model, tokenizer) = args.model.load()?;
    let prefix = args.cache.open(&model, &tokenizer)?;
    let config = EngineConfig {
        max_batch: args.max_batch,
        kv_budget_bytes: args.cache.kv_budget_bytes()?,
        max_queue: args.max_queue,
        context_limit: None,
        prefill_chunk: args
            .prefill_chunk
            .unwrap_or_else(engine::default_prefill_chunk),
        itl_stretch: args.itl_stretch,
        prefill_order: args.prefill_order,
        io_workers: args.io_workers,
        load_grace: crate::cli_duration_ms(args.load_grace, "--load-grace")?,
        pass_workspace: parse_size(&args.pass_workspace).context("--pass-workspace")?,
        ..EngineConfig::default()
    };
    let engine = Arc::new(Engine::open(model, tokenizer, prefix, config)?);
    let server_config = ServerConfig {
        model_id,
        api_key,
        metrics_need_key: args.metrics_need_key,
        max_body_bytes: parse_size(&args.max_body).context("--max-body")? as usize,
        max_tokens_limit: args.max_tokens_limit,
    };
    let app = server::router(engine.clone(), server_config);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let grace: Duration = args.shutdown_grace.into();
    let served = rt.block_on(async {
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let shutdown = {
            let mut rx = stop_rx.clone();
            async move {
                let _ = rx.wait_for(|s| *s).await;
            }
        };
        // On the first signal: drain. /health answers 503 and new requests are refused
        // while open ones finish; when none is left (or the grace period ends, or a second
        // signal comes, and what is left is cancelled: those requests end with an error),
        // the listener closes.
        let engine_sig = engine.clone();
        tokio::spawn(async move {
            signal().await;
            tracing::info!("shutting down: /health answers 503, open requests finish");
            engine_sig.stop_accepting();
            let drained = async {
                loop {
                    let m = engine_sig.metrics();
                    if m.active_rows == 0 && m.queue_depth == 0 {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            };
            let cut = tokio::select! {
                _ = drained => false,
                _ = tokio::time::sleep(grace) => true,
                _ = signal() => true,
            };
            if cut {
                tracing::warn!("cancelling requests still running");
                let e = engine_sig.clone();
                let _ = tokio::task::spawn_blocking(move || e.shutdown(true)).await;
            }
            let _ = stop_tx.send(true);
        });
        if let Some(claim) = &unix {
            let listener = claim.bind()?;
            tracing::info!(socket = %store::escape_path(claim.path()), "kvstore serve listening");
            server::serve_with_limits(listener, app, limits, shutdown).await?;
        } else {
            let addr = format!("{}:{}", args.host, args.port);
            let listener = tokio::net::TcpListener::bind(&addr)
                .await
                .with_context(|| format!("listening on {addr}"))?;
            let local = listener.local_addr()?;
            tracing::info!(address = %local, "kvstore serve listening");
            eprintln!("kvstore serve: listening on http://{local}");
            server::serve_with_limits(listener, app, limits, shutdown).await?;
        }
        anyhow::Ok(())
    });
    // Every connection is closed: finish anything left, then make the store durable.
    engine
        .shutdown(false)
        .context("flushing the block store at shutdown")?;
    tracing::info!("store flushed; bye");
    served
}

/// The API key: `--api-key`, else the contents of `--api-key-file`, else
/// `$KVSTORE_API_KEY`, else none; surrounding whitespace is dropped (the server trims the
/// key a client sends too). An empty key, or one that cannot travel in an HTTP header, is
/// refused rather than leaving the API open or locking every client out.
fn api_key(args: &Args) -> Result<Option<String>> {
    let (key, from) = if let Some(k) = &args.api_key {
        (k.clone(), "--api-key".to_string())
    } else if let Some(path) = &args.api_key_file {
        let shown = store::escape_path(path);
        let bytes = read_capped(path, MAX_KEY_FILE_BYTES)
            .with_context(|| format!("reading the API key from {shown} (--api-key-file)"))?;
        let Some(bytes) = bytes else {
            bail!("the API key file {shown} is over {MAX_KEY_FILE_BYTES} bytes: not a key");
        };
        let Ok(key) = String::from_utf8(bytes) else {
            bail!("the API key file {shown} is not UTF-8 text");
        };
        warn_if_others_can_read(path);
        (key, format!("--api-key-file {shown}"))
    } else {
        match std::env::var("KVSTORE_API_KEY") {
            Ok(k) => (k, "$KVSTORE_API_KEY".to_string()),
            Err(std::env::VarError::NotPresent) => return Ok(None),
            Err(std::env::VarError::NotUnicode(_)) => bail!("$KVSTORE_API_KEY is not UTF-8"),
        }
    };
    let key = key.trim();
    if key.is_empty() {
        bail!(
            "the API key is empty ({from}): an empty key would leave the API open; give a \
             real key, or set none of --api-key, --api-key-file and $KVSTORE_API_KEY to \
             serve without one"
        );
    }
    if !key.bytes().all(|b| (0x20..0x7f).contains(&b)) {
        bail!(
            "the API key ({from}) holds characters an HTTP header cannot carry: use \
             printable ASCII"
        );
    }
    Ok(Some(key.to_string()))
}

/// Largest API key file read; a longer one (or `/dev/zero`) is refused, not read whole.
const MAX_KEY_FILE_BYTES: u64 = 64 << 10;

/// The contents of `path` when at most `max` bytes long, else `None`.
fn read_capped(path: &std::path::Path, max: u64) -> std::io::Result<Option<Vec<u8>>> {
    use std::io::Read;
    let mut bytes = Vec::new();
    std::fs::File::open(path)?
        .take(max + 1)
        .read_to_end(&mut bytes)?;
    Ok((bytes.len() as u64 <= max).then_some(bytes))
}

/// Warns when a key file is readable by other users (as ssh does for private keys).
fn warn_if_others_can_read(path: &std::path::Path) {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        if let Ok(m) = std::fs::metadata(path) {
            if m.permissions().mode() & 0o044 != 0 {
                tracing::warn!(
                    path = %store::escape_path(path),
                    "the API key file is readable by other users; chmod 600 it"
                );
            }
        }
    }
}

/// 1024 connections, or fewer when the soft limit on open files leaves less room: the
/// model, the store and the runtime keep up to a few dozen descriptors of their own, and a
/// connection past the limit would fail `accept` instead of getting a 503.
fn default_max_connections() -> usize {
    const DEFAULT: usize = 1024;
    const RESERVED: usize = 128;
    let soft = std::fs::read_to_string("/proc/self/limits")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("Max open files"))
                .and_then(|l| l.split_whitespace().nth(3))
                .and_then(|v| v.parse::<usize>().ok())
        });
    match soft {
        Some(n) => DEFAULT.min(n.saturating_sub(RESERVED)).max(1),
        None => DEFAULT,
    }
}

async fn signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match (
            signal(SignalKind::interrupt()),
            signal(SignalKind::terminate()),
        ) {
            (Ok(mut int), Ok(mut term)) => {
                tokio::select! {
                    _ = int.recv() => {}
                    _ = term.recv() => {}
                }
            }
            _ => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// `--itl-stretch`: `None` for `none` (an alias, so clap does not read it as optional).
pub(crate) type ItlStretch = Option<f64>;

/// Parses `--itl-stretch`: `none`, or a multiple above 1.
pub(crate) fn parse_itl_stretch(s: &str) -> std::result::Result<Option<f64>, String> {
    if s.eq_ignore_ascii_case("none") {
        return Ok(None);
    }
    match s.parse::<f64>() {
        Ok(x) if x.is_finite() && x > 1.0 => Ok(Some(x)),
        _ => Err(format!(
            "`{s}` is not a multiple above 1 (such as 1.5) or `none`"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn itl_stretch_takes_a_multiple_above_one_or_none() {
        assert_eq!(parse_itl_stretch("none"), Ok(None));
        assert_eq!(parse_itl_stretch("NONE"), Ok(None));
        assert_eq!(parse_itl_stretch("2"), Ok(Some(2.0)));
        assert_eq!(
            parse_itl_stretch("1.5"),
            Ok(Some(engine::SUGGESTED_ITL_STRETCH))
        );
        for bad in ["1", "0.5", "-2", "nan", "inf", "", "fast"] {
            let e = parse_itl_stretch(bad).unwrap_err();
            assert!(e.contains("multiple above 1"), "{bad}: {e}");
        }
    }
}
