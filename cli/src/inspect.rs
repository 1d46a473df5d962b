//! `kvstore inspect`: what a store directory holds, optionally verifying every checksum.

use std::path::PathBuf;
use std::time::{Duration, UNIX_EPOCH};

use anyhow::{Context, Result};
use serde::Serialize;
use store::inspect::{BlockReport, StoreReport};
use store::BlockKey;

/// Arguments of `kvstore inspect`.
#[derive(clap::Args)]
pub struct Args {
    /// Store directory. Default: $KVSTORE_DIR, else the platform cache dir (~/.cache/kvstore).
    #[arg(long, value_name = "DIR")]
    store: Option<PathBuf>,
    /// Print JSON (stable, documented in docs/cli.md) instead of text.
    #[arg(long)]
    json: bool,
    /// Re-check every block's checksum (reads all data); exit 1 if any file is corrupt.
    #[arg(long)]
    verify: bool,
    /// Show one block's metadata (64 hex digits).
    #[arg(long, value_name = "KEY")]
    block: Option<String>,
    /// With --remote URL: report what that remote tier holds per namespace instead of a
    /// store directory (SCAN over `kvstore:*` keys, on every master of a cluster).
    #[command(flatten)]
    remote: crate::cache_args::RemoteArgs,
}

/// The store directory: the flag, else `$KVSTORE_DIR`, else `<cache dir>/kvstore`.
pub fn store_dir(flag: Option<PathBuf>) -> Result<PathBuf> {
    if let Some(p) = flag {
        return Ok(p);
    }
    if let Some(p) = std::env::var_os("KVSTORE_DIR").filter(|p| !p.is_empty()) {
        return Ok(PathBuf::from(p));
    }
    dirs::cache_dir().map(|d| d.join("kvstore")).context(
        "no --store given, $KVSTORE_DIR unset, and no platform cache directory; pass --store DIR",
    )
}

/// Formats Unix milliseconds as RFC 3339 (UTC, seconds).
pub fn time(ms: u64) -> String {
    humantime::format_rfc3339_seconds(UNIX_EPOCH + Duration::from_millis(ms)).to_string()
}

/// Bytes as a human size (binary units).
pub fn size(bytes: u64) -> String {
    bytesize::ByteSize::b(bytes).display().iec().to_string()
}

#[derive(Serialize)]
struct JsonOut<'a, T> {
    schema: &'static str,
    #[serde(flatten)]
    body: &'a T,
}

/// Runs `kvstore inspect`; returns the process exit code (1 when `--verify` found corruption).
pub fn run(args: Args) -> Result<i32> {
    if let Some(config) = args.remote.config()? {
        return remote(&config, args.json);
    }
    let root = store_dir(args.store)?;
    if let Some(k) = args.block {
        let key: BlockKey = k
            .parse()
            .with_context(|| format!("--block {k:?} is not a block key (64 hex digits)"))?;
        let report = store::inspect::block(&root, key)
            .with_context(|| format!("cannot inspect store {}", root.display()))?;
        let Some(b) = report else {
            anyhow::bail!("no block {key} in store {}", root.display());
        };
        if args.json {
            let out = JsonOut {
                schema: "kvstore.inspect.block.v1",
                body: &b,
            };
            println!("{}", serde_json::to_string_pretty(&out)?);
        } else {
            print_block(&b);
        }
        return Ok(if b.verify.is_ok() { 0 } else { 1 });
    }
    let report = store::inspect::inspect(&root, args.verify)
        .with_context(|| format!("cannot inspect store {}", root.display()))?;
    if args.json {
        let out = JsonOut {
            schema: "kvstore.inspect.v1",
            body: &report,
        };
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        print_report(&report);
    }
    Ok(if args.verify && !report.corrupt.is_empty() {
        1
    } else {
        0
    })
}

fn esc(s: &str) -> std::borrow::Cow<'_, str> {
    store::escape_control(s)
}

fn esc_path(p: &std::path::Path) -> String {
    store::escape_path(p)
}

fn print_report(r: &StoreReport) {
    let budget = r
        .ssd_budget_bytes
        .map_or_else(|| "unknown".to_owned(), size);
    // Everything below that came from the directory or a description (names, salts,
    // errors quoting them) is escaped: a planted file name or a salt holding terminal
    // escapes or a newline must not recolour the terminal or print a fake line.
    println!("store {}", esc_path(&r.root));
    println!(
        "  format {}, budget {budget}, {} blocks, {} on disk",
        r.format_version,
        r.blocks,
        size(r.bytes)
    );
    for n in &r.namespaces {
        println!("namespace {}", n.id);
        match (&n.description, &n.description_error) {
            (Some(d), _) => {
                let quant = d
                    .kv_quantization
                    .map_or_else(String::new, |q| format!(" q{}/g{}", q.bits, q.group_size));
                println!(
                    "  model {}  kv {}{quant}  block {} tokens  {} layers  {} planes",
                    esc(&d.model),
                    esc(&d.kv_dtype.to_string()),
                    d.block_size,
                    d.layers.len(),
                    d.planes.len()
                );
                if !d.weights_fingerprint.is_empty() {
                    println!("  weights {}", esc(&d.weights_fingerprint));
                }
                if let Some(salt) = &d.salt {
                    println!("  salt {}", esc(salt));
                }
            }
            (None, Some(e)) => println!("  description unavailable: {}", esc(e)),
            (None, None) => {}
        }
        println!(
            "  {} blocks, {}, longest chain {} blocks, {} unreachable",
            n.blocks,
            size(n.bytes),
            n.longest_chain,
            n.unreachable_blocks
        );
        if n.window_trimmed_blocks > 0 {
            println!(
                "  {} blocks window-trimmed, {} of window-layer planes not stored",
                n.window_trimmed_blocks,
                size(n.window_trimmed_bytes)
            );
        }
        if let (Some(o), Some(nw)) = (n.oldest_access_unix_ms, n.newest_access_unix_ms) {
            println!("  accessed {} .. {}", time(o), time(nw));
        }
    }
    let list = |label: &str, v: &[PathBuf]| {
        if !v.is_empty() {
            println!("{label} ({}):", v.len());
            for p in v {
                println!("  {}", esc_path(p));
            }
        }
    };
    list("quarantined files", &r.quarantined);
    list("temporary files", &r.temp_files);
    list("foreign files", &r.foreign_files);
    list("unknown entries at the root", &r.unknown_entries);
    if !r.corrupt.is_empty() {
        println!("CORRUPT files ({}):", r.corrupt.len());
        for c in &r.corrupt {
            println!("  {}: {}", esc_path(&c.path), esc(&c.error));
        }
        println!("run `kvstore gc` to remove them");
    } else if r.verified {
        println!("verify: all {} blocks OK", r.blocks);
    }
}

fn print_block(b: &BlockReport) {
    println!("block {}", b.key);
    println!("  file       {}", esc_path(&b.path));
    println!("  namespace  {}", b.namespace);
    println!("  parent     {}", b.parent);
    println!("  position   {}", b.position);
    println!("  created    {}", time(b.created_unix_ms));
    println!("  tokens     {:?}", b.tokens);
    println!("  checksum   {}", b.checksum);
    println!(
        "  size       {} data, {} file",
        size(b.data_bytes),
        size(b.file_bytes)
    );
    for p in &b.planes {
        println!("  plane      {} {} {:?}", esc(&p.name), p.dtype, p.shape);
    }
    match &b.verify {
        Ok(()) => println!("  verify     OK"),
        Err(e) => println!("  verify     CORRUPT: {}", esc(&e.to_string())),
    }
}

#[derive(Serialize)]
struct RemoteOut {
    namespaces: Vec<store::remote::RemoteNamespaceUsage>,
    blocks: u64,
    bytes: u64,
}

/// `kvstore inspect --remote URL`: blocks and bytes per namespace in Redis.
fn remote(config: &store::RemoteConfig, json: bool) -> Result<i32> {
    let namespaces = store::remote::inspect_remote(config).context(
        "cannot scan the remote tier (is Redis running at that URL, with that password and CA?)",
    )?;
    let out = RemoteOut {
        blocks: namespaces.iter().map(|n| n.blocks).sum(),
        bytes: namespaces.iter().map(|n| n.bytes).sum(),
        namespaces,
    };
    if json {
        let out = JsonOut {
            schema: "kvstore.inspect.remote.v1",
            body: &out,
        };
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!(
            "remote tier: {} blocks, {} in {} namespaces",
            out.blocks,
            size(out.bytes),
            out.namespaces.len()
        );
        for n in &out.namespaces {
            println!(
                "  {}  {:>8} blocks  {:>10}",
                n.namespace,
                n.blocks,
                size(n.bytes)
            );
        }
    }
    Ok(0)
}
