//! `kvstore gc`: remove least-recently-used, old, unreachable, corrupt and foreign files.

use std::path::PathBuf;

use anyhow::{Context, Result};
use serde::Serialize;
use store::gc::{GcOptions, GcReport};
use store::NamespaceId;

use crate::inspect::{size, store_dir};

/// Arguments of `kvstore gc`.
#[derive(clap::Args)]
pub struct Args {
    /// Store directory. Default: $KVSTORE_DIR, else the platform cache dir (~/.cache/kvstore).
    #[arg(long, value_name = "DIR")]
    store: Option<PathBuf>,
    /// Remove least recently used blocks until the blocks take at most SIZE (e.g. 512MiB).
    #[arg(long, value_name = "SIZE")]
    max_bytes: Option<String>,
    /// Remove blocks not used for DURATION (e.g. 7d, 12h).
    #[arg(long, value_name = "DURATION")]
    older_than: Option<String>,
    /// Only collect in this namespace (64 hex digits).
    #[arg(long, value_name = "ID")]
    namespace: Option<String>,
    /// Show what would be removed without removing anything.
    #[arg(long)]
    dry_run: bool,
    /// Print JSON (stable, documented in docs/cli.md) instead of text.
    #[arg(long)]
    json: bool,
}

/// Validated options (stage two of argument handling).
fn options(args: &Args) -> Result<GcOptions> {
    let max_bytes = match &args.max_bytes {
        None => None,
        Some(s) => Some(
            s.parse::<bytesize::ByteSize>()
                .map_err(|e| anyhow::anyhow!("--max-bytes {s:?}: {e} (try 512MiB or 20GB)"))?
                .as_u64(),
        ),
    };
    let older_than = match &args.older_than {
        None => None,
        Some(s) => Some(
            humantime::parse_duration(s)
                .with_context(|| format!("--older-than {s:?} (try 7d or 12h)"))?,
        ),
    };
    let namespace =
        match &args.namespace {
            None => None,
            Some(s) => Some(s.parse::<NamespaceId>().with_context(|| {
                format!("--namespace {s:?} is not a namespace id (64 hex digits)")
            })?),
        };
    Ok(GcOptions {
        max_bytes,
        older_than,
        namespace,
        dry_run: args.dry_run,
    })
}

#[derive(Serialize)]
struct JsonOut<'a> {
    schema: &'static str,
    #[serde(flatten)]
    report: &'a GcReport,
}

/// Runs `kvstore gc`; returns the exit code (1 if some deletion failed).
pub fn run(args: Args) -> Result<i32> {
    let opts = options(&args)?;
    let root = store_dir(args.store)?;
    if !root.exists() {
        anyhow::bail!(
            "store directory {} does not exist; check --store / $KVSTORE_DIR",
            root.display()
        );
    }
    let report = store::gc::gc(&root, &opts)
        .with_context(|| format!("cannot collect garbage in {}", root.display()))?;
    if args.json {
        let out = JsonOut {
            schema: "kvstore.gc.v1",
            report: &report,
        };
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        let verb = if report.dry_run {
            "would delete"
        } else {
            "deleted"
        };
        for i in &report.deleted {
            let detail = i
                .detail
                .as_deref()
                .map(|d| format!(" ({d})"))
                .unwrap_or_default();
            println!(
                "{verb} {:<13} {:>10}  {}{detail}",
                format!("{:?}", i.reason).to_lowercase(),
                size(i.bytes),
                i.path.display()
            );
        }
        for f in &report.failed {
            println!("FAILED to delete {}: {}", f.path.display(), f.error);
        }
        println!(
            "{} {} in {} files; kept {} blocks ({}); {} failures",
            if report.dry_run {
                "would free"
            } else {
                "freed"
            },
            size(report.freed_bytes),
            report.deleted.len(),
            report.kept_blocks,
            size(report.kept_bytes),
            report.failed.len()
        );
    }
    Ok(if report.failed.is_empty() { 0 } else { 1 })
}
