//! `kvstore demo`: the README's main job. Replays a scripted multi-turn agent session
//! (system prompt with tools, a task, tool calls and results, growing past 4,000 tokens)
//! against the model with prefix reuse, printing per turn the prompt tokens, the tokens
//! restored from the cache and the time to first token; then starts a new process that
//! restores the conversation from SSD; then prints `kvstore inspect` of the store.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result};
use engine::{Engine, GenerateParams, Request, ReuseReport};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use crate::agent_session;
use crate::cache_args::CacheArgs;
use crate::generate::ModelArgs;

/// Arguments of `kvstore demo`.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    cache: CacheArgs,
    /// Requests (turns) in the session.
    #[arg(long, default_value_t = agent_session::DEFAULT_TURNS)]
    turns: usize,
    /// Tokens the model generates per turn (the replay then continues with the script).
    #[arg(long, default_value_t = 12)]
    max_tokens: usize,
    /// Print the per-turn reports as JSON.
    #[arg(long)]
    json: bool,
    /// Internal: run only the last turn (the restart phase, in a new process).
    #[arg(long, hide = true)]
    restore_only: bool,
}

/// One turn's outcome.
#[derive(Serialize)]
struct Turn {
    turn: usize,
    #[serde(flatten)]
    report: ReuseReport,
    reply: String,
}

fn bar(len: u64, msg: &str) -> ProgressBar {
    let pb = if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        ProgressBar::new(len)
    } else {
        ProgressBar::hidden()
    };
    pb.set_style(
        ProgressStyle::with_template("{spinner} {msg} [{bar:30}] {pos}/{len} ({elapsed})")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    pb.set_message(msg.to_string());
    pb.enable_steady_tick(Duration::from_millis(200));
    pb
}

fn run_turns(args: &Args, first: usize) -> Result<Vec<Turn>> {
    let spinner = bar(1, "loading the model");
    let (model, tokenizer) = args.model.load()?;
    spinner.finish_and_clear();
    let prefix = args.cache.open(&model, &tokenizer)?;
    let kv_budget = match &prefix {
        Some(_) => Some(args.cache.kv_budget_bytes()?),
        None => None,
    };
    let params = GenerateParams {
        max_tokens: args.max_tokens,
        ..GenerateParams::default()
    };
    let config = crate::engine_run::config(kv_budget);
    let engine = Engine::open(model, tokenizer, prefix, config)?;
    let tools = serde_json::to_string(&agent_session::tools())?;
    let pb = bar((args.turns - first) as u64, "replaying the agent session");
    let mut out = Vec::new();
    for turn in first..args.turns {
        let messages = serde_json::to_string(&agent_session::messages(turn))?;
        let prompt = engine
            .tokenizer()
            .encode_chat(&messages, Some(&tools), true)?;
        pb.set_message(format!("turn {}: {} prompt tokens", turn + 1, prompt.len()));
        let request = Request::new(prompt, params.clone());
        let done = crate::engine_run::complete(&engine, request, &mut |_| true)
            .with_context(|| format!("turn {}", turn + 1))?;
        out.push(Turn {
            turn: turn + 1,
            report: done.reuse,
            reply: done.text,
        });
        pb.inc(1);
    }
    pb.finish_and_clear();
    engine.shutdown(false).context("flushing the block store")?;
    Ok(out)
}

fn print_table(turns: &[Turn]) {
    println!(
        "{:>4} {:>8} {:>8} {:>10} {:>9} {:>9}  reply",
        "turn", "prompt", "cached", "from", "prefilled", "TTFT"
    );
    for t in turns {
        let r = &t.report;
        let from: Vec<&str> = [
            (r.cached_device_tokens, "device"),
            (r.cached_ram_tokens, "RAM"),
            (r.cached_ssd_tokens, "SSD"),
            (r.cached_remote_tokens, "remote"),
        ]
        .iter()
        .filter(|(n, _)| *n > 0)
        .map(|(_, name)| *name)
        .collect();
        let from = if from.is_empty() {
            "-".to_string()
        } else {
            from.join("+")
        };
        let reply: String = t
            .reply
            .chars()
            .take(40)
            .collect::<String>()
            .replace('\n', " ");
        println!(
            "{:>4} {:>8} {:>8} {:>10} {:>9} {:>8.2}s  {}",
            t.turn,
            r.prompt_tokens,
            r.cached_tokens,
            from,
            r.prompt_tokens - r.cached_tokens,
            r.ttft_s,
            reply
        );
    }
}

/// Runs the demo.
pub fn run(mut args: Args) -> Result<()> {
    if args.turns == 0 {
        anyhow::bail!("--turns must be at least 1");
    }
    if args.restore_only {
        let turns = run_turns(&args, args.turns - 1)?;
        if args.json {
            println!("{}", serde_json::to_string_pretty(&turns)?);
        } else {
            print_table(&turns);
        }
        return Ok(());
    }
    // A fresh store unless one is named, so the demo always starts cold; it is removed
    // when the demo ends (a named store is kept).
    let _temporary;
    let store: PathBuf = match &args.cache.store {
        Some(s) => s.clone(),
        None => {
            let dir = tempfile::Builder::new()
                .prefix("kvstore-demo-")
                .tempdir()
                .context("creating the demo's temporary store")?;
            let path = dir.path().to_path_buf();
            _temporary = dir;
            args.cache.store = Some(path.clone());
            path
        }
    };
    if !args.json {
        println!(
            "kvstore demo: a {}-turn agent session with prefix reuse",
            args.turns
        );
        println!("store: {}\n", store.display());
    }
    let turns = run_turns(&args, 0)?;
    // The session's engine and model are gone; MLX still keeps their freed buffers (its
    // buffer cache, up to --mlx-cache-limit). Hand them back before the restart phase's
    // process allocates its own: on a VM, memory the guest has never used costs far more
    // to fault in than memory freed a moment ago (the restart's restore took 2.5 s with
    // the parent's cache held, 0.3 s without, on cpu-vm).
    mlx::clear_cache().context("releasing MLX's buffer cache")?;
    let exe = std::env::current_exe().context("locating the kvstore executable")?;
    let mut child = Command::new(&exe);
    child.args(["demo", "--restore-only", "--turns", &args.turns.to_string()]);
    child
        .args(["--max-tokens", &args.max_tokens.to_string(), "--store"])
        .arg(&store);
    child.args(["--block-size", &args.cache.block_size.to_string()]);
    child.args([
        "--ram-budget",
        &args.cache.ram_budget,
        "--ssd-budget",
        &args.cache.ssd_budget,
        "--eviction",
        args.cache.eviction.name(),
        "--kv-budget",
        &args.cache.kv_budget,
        "--mlx-cache-limit",
        &args.cache.mlx_cache_limit,
    ]);
    if let Some(m) = &args.model.model {
        child.arg("--model").arg(m);
    }
    if let Some(s) = &args.cache.cache_salt {
        child.args(["--cache-salt", s]);
    }
    if args.model.keep_quantized {
        child.arg("--keep-quantized");
    }
    if args.cache.no_cache {
        child.arg("--no-cache");
    }
    if args.json {
        child.arg("--json");
    }
    if args.json {
        let out = child.output().context("running the restart phase")?;
        if !out.status.success() {
            anyhow::bail!(
                "the restart phase failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let restart: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        let report = serde_json::json!({"store": store, "turns": turns, "restart": restart});
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    print_table(&turns);
    let total: f64 = turns.iter().map(|t| t.report.ttft_s).sum();
    let reused: usize = turns.iter().skip(1).map(|t| t.report.cached_tokens).sum();
    let prompts: usize = turns.iter().skip(1).map(|t| t.report.prompt_tokens).sum();
    println!(
        "\ntotal TTFT {total:.2}s; from turn 2 on, {:.1}% of prompt tokens came from the cache",
        100.0 * reused as f64 / prompts.max(1) as f64
    );
    println!(
        "\nA new process replays the last turn with an empty device and RAM tier (blocks come from SSD):"
    );
    let status = child.status().context("running the restart phase")?;
    if !status.success() {
        anyhow::bail!("the restart phase failed ({status})");
    }
    println!("\nkvstore inspect --store {}:", store.display());
    let status = Command::new(&exe)
        .arg("inspect")
        .arg("--store")
        .arg(&store)
        .status()?;
    if !status.success() {
        anyhow::bail!("kvstore inspect failed ({status})");
    }
    Ok(())
}
