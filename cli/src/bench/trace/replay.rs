//! A replay run: sets up the target (the engine in this process, or a server at `--url`),
//! sends the window's requests at their times, then reports overall and per minute beside
//! the ideal and the simulated LRU of the same requests, as text, JSON and SVG.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use engine::{Engine, EngineConfig, ExportStats};
use serde::Serialize;
use serde_json::json;
use store::{EvictionPolicy, StoreStats};

use super::bursts;
use super::dispatch::{self, Sent};
use super::http::HttpTarget;
use super::inprocess::{EngineTarget, RoundRobin};
use super::peer;
use super::plot::{self, Series};
use super::prefill_bound::PrefillBound;
use super::report::{self, pct, Row, Summary};
use super::sim::{self, Policy, SimTrace};
use super::{tokens, Args, Settings};
use crate::bench::child_server::ChildServer;
use crate::bench::serve::{StepSummary, STEP_LOG};

/// A block id no Mooncake trace uses (ids count up from 0): the warm-up prompt's tokens.
const WARMUP_ID: u64 = u64::MAX;

/// What the target side of a run gave back.
struct Ran {
    /// Describes the target for the report.
    target: serde_json::Value,
    sent: Vec<Sent>,
    wall_s: f64,
    /// The comparison budget of the simulated LRU, in (scaled) tokens.
    lru_budget: Option<u64>,
    /// The host tiers' eviction policy, simulated at the same budget (in process, with a
    /// cache: a server's or a peer's policy is not known here).
    policy: Option<EvictionPolicy>,
    /// Store or server counters before and after, for evictions and bytes moved.
    counters: serde_json::Value,
    /// Lines on the tiers' counters over the run (hit shares by tier where only the
    /// server's counters know them, evictions, bytes written).
    tier_note: Option<String>,
    /// Where the engine threads' time went (in process only).
    steps: Option<StepSummary>,
    /// MLX's memory over the run (in process only).
    memory: Option<super::memory::MemorySummary>,
    /// The in-process engines, shut down (their stores flushed) once the report is out:
    /// a write-back store's flush at the end of a long replay writes tens of GB to SSD,
    /// which is no part of the measurement.
    engines: Vec<Engine>,
    /// The temporary store directory of an in-process run without `--store`: removed only
    /// after the engines have shut down.
    scratch: Option<tempfile::TempDir>,
}

/// Runs the replay and writes its report.
pub fn run(args: &Args, s: &Settings) -> Result<()> {
    let times: Vec<f64> = s.requests.iter().map(|r| s.send_at_s(r)).collect();
    let mut ran = match (&args.url, &args.peer_python) {
        (Some(url), _) => http(args, s, url, &times)?,
        (None, Some(python)) => mlx_lm_server(args, s, python, &times)?,
        (None, None) => in_process(args, s, &times)?,
    };
    let t = SimTrace::new(&s.requests, &s.scale);
    let ideal = sim::ideal(&t);
    let blocks = |b: u64| (b / t.block as u64) as usize;
    let lru = ran
        .lru_budget
        .map(|b| sim::simulate(&t, Policy::Lru, blocks(b)));
    // Under `--eviction lru` the shipped policy is the LRU just simulated.
    let shipped = ran
        .policy
        .zip(ran.lru_budget)
        .map(|(p, b)| match Policy::of_store(p) {
            Policy::Lru => lru.clone().unwrap_or_default(),
            q => sim::simulate(&t, q, blocks(b)),
        });
    let rows: Vec<Row> = std::mem::take(&mut ran.sent)
        .into_iter()
        .enumerate()
        .map(|(i, sent)| Row {
            index: i,
            timestamp_ms: s.requests[i].timestamp,
            prompt_len: t.requests[i].len,
            ideal_tokens: ideal[i],
            lru_tokens: lru.as_ref().map(|l| l[i]),
            policy_tokens: shipped.as_ref().map(|p| p[i]),
            sent,
        })
        .collect();
    let label = args.label.clone().unwrap_or_else(|| {
        ran.target["name"]
            .as_str()
            .unwrap_or("this run")
            .to_string()
    });
    let start_ms = (s.window.start_s * 1000.0) as u64;
    let overall = report::summarize(&rows.iter().collect::<Vec<_>>());
    let minutes = report::per_minute(&rows, start_ms);
    print(&overall, &minutes, &ran, s);
    let places = bursts::burst_places(&rows);
    if !places.is_empty() {
        println!("{}", bursts::describe(&places));
    }
    let bounds = prefill_bounds(&rows);
    if let (Some(hits), Some(ideal)) = (&bounds.hits, &bounds.ideal) {
        println!(
            "tokens left to prefill per answered request / its prompt, P50 / P90 / P99: with \
             this run's hits {}; with the ideal's {} (TTFT / no cache falls below these only \
             where the queue shortens)",
            hits.describe(),
            ideal.describe()
        );
    }
    for r in rows
        .iter()
        .filter(|r| r.sent.outcome.error.is_some())
        .take(3)
    {
        eprintln!(
            "request {} failed: {}",
            r.index,
            r.sent.outcome.error.as_deref().unwrap_or("")
        );
    }
    if overall.unsent > 0 {
        eprintln!(
            "{} of {} requests were NOT sent: --deadline came before their time or before a \
             slot was free; every share and percentile above is of the requests sent",
            overall.unsent, overall.requests
        );
    }
    let throughput = json!({
        "requests_per_s": (overall.requests - overall.unsent) as f64 / ran.wall_s,
        "prompt_tokens_per_s": overall.prompt_tokens as f64 / ran.wall_s,
        "completion_tokens_per_s": overall.completion_tokens as f64 / ran.wall_s,
    });
    if let Some(path) = &args.json {
        let doc = json!({
            "schema": "kvstore.bench.trace.replay.v1",
            "command": std::env::args().collect::<Vec<_>>().join(" "),
            "trace": args.file.display().to_string(),
            "window_s": [s.window.start_s, s.window.end_s],
            "speed": s.speed,
            "token_scale": s.scale.factor(),
            "block_tokens": s.scale.block(),
            "max_concurrency": s.max_concurrency,
            "deadline_s": s.deadline.map(|d| d.as_secs_f64()),
            "label": label,
            "target": ran.target,
            "lru_budget_tokens": ran.lru_budget,
            "policy_simulated": ran.policy.map(|p| p.name()),
            "wall_s": ran.wall_s,
            "throughput": throughput,
            "overall": overall,
            "per_minute": minutes,
            "counters": ran.counters,
            "steps": ran.steps,
            "mlx_memory": ran.memory,
            "prefill_bound": bounds,
            "burst_places": places,
            "requests": rows,
        });
        super::write_json(path, &doc)?;
    }
    if let Some(path) = &args.svg {
        let per = |f: &dyn Fn(&Summary) -> Option<f64>| -> Vec<Option<f64>> {
            minutes
                .iter()
                .map(|m| {
                    if m.requests > m.failed + m.unsent {
                        f(m)
                    } else {
                        None
                    }
                })
                .collect()
        };
        let mut series = vec![Series {
            name: label.clone(),
            per_minute: per(&|m| Some(m.hit_share)),
            dashed: false,
        }];
        let mut ttfts = vec![(
            label.clone(),
            rows.iter().filter_map(|r| r.sent.outcome.ttft_s).collect(),
        )];
        for file in &args.compare {
            let (name, hits, ttft, kv_budget) = earlier_run(file)?;
            let ours = ran.target["kv_budget"].as_str();
            let bytes = |b: &str| b.parse::<bytesize::ByteSize>().ok();
            if let (Some(theirs), Some(ours)) = (kv_budget.as_deref(), ours) {
                if bytes(theirs) != bytes(ours) {
                    println!(
                        "note: {} ran with a device KV budget of {theirs}, this run with \
                         {ours}: their TTFTs compare unequal room for live prompts \
                         (give both the same --kv-budget)",
                        file.display()
                    );
                }
            }
            series.push(Series {
                name: name.clone(),
                per_minute: hits,
                dashed: false,
            });
            ttfts.push((name, ttft));
        }
        series.push(Series {
            name: "ideal (unbounded, simulated)".into(),
            per_minute: per(&|m| Some(m.ideal_share)),
            dashed: true,
        });
        if let Some(b) = ran.lru_budget {
            series.push(Series {
                name: format!("LRU of {b} tokens (simulated)"),
                per_minute: per(&|m| m.lru_share),
                dashed: true,
            });
            if let Some(p) = ran.policy.filter(|p| *p != EvictionPolicy::Lru) {
                series.push(Series {
                    name: format!("{p} of {b} tokens (simulated)"),
                    per_minute: per(&|m| m.policy_share),
                    dashed: true,
                });
            }
        }
        let svg = plot::svg(
            &format!("kvstore bench trace: {}", args.file.display()),
            &series,
            &ttfts,
        );
        std::fs::write(path, svg).with_context(|| format!("writing {}", path.display()))?;
        println!("wrote {}", path.display());
    }
    shut_down(std::mem::take(&mut ran.engines), !args.no_flush)?;
    drop(ran.scratch.take());
    Ok(())
}

/// Finishes the in-process engines and, when `flush`, flushes their stores (with
/// `--store`, what the next run reuses), saying so: with a write-back SSD tier that is the
/// RAM tier's whole content written to disk. Without, the stores only finish the writes
/// already queued (`--no-flush`).
fn shut_down(engines: Vec<Engine>, flush: bool) -> Result<()> {
    if engines.is_empty() {
        return Ok(());
    }
    let t = Instant::now();
    if !flush {
        println!("shutting down without flushing the RAM tier (--no-flush)");
        for engine in engines {
            engine.close_without_flush();
        }
        println!("engines closed in {:.1} s", t.elapsed().as_secs_f64());
        return Ok(());
    }
    println!("shutting down: flushing the store to SSD (not part of the figures above)");
    for engine in engines {
        engine.shutdown(false).context("shutting the engine down")?;
    }
    println!("store flushed in {:.1} s", t.elapsed().as_secs_f64());
    Ok(())
}

/// An earlier replay's `--json`: its label, hit share per minute, TTFTs and device KV
/// budget.
type Earlier = (String, Vec<Option<f64>>, Vec<f64>, Option<String>);

/// Reads an earlier replay's `--json` for `--compare`.
fn earlier_run(path: &std::path::Path) -> Result<Earlier> {
    let text = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let v: serde_json::Value =
        serde_json::from_slice(&text).with_context(|| format!("{} is not JSON", path.display()))?;
    if v["schema"] != "kvstore.bench.trace.replay.v1" {
        bail!(
            "{} is not the --json of a bench trace replay (schema {})",
            path.display(),
            v["schema"]
        );
    }
    let name = v["label"]
        .as_str()
        .unwrap_or_else(|| v["target"]["name"].as_str().unwrap_or("earlier run"))
        .to_string();
    let hits = v["per_minute"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|m| {
                    let count = |k: &str| m[k].as_u64().unwrap_or(0);
                    let ran = count("requests") > count("failed") + count("unsent");
                    m["hit_share"].as_f64().filter(|_| ran)
                })
                .collect()
        })
        .unwrap_or_default();
    let ttft = v["requests"]
        .as_array()
        .map(|a| a.iter().filter_map(|r| r["ttft_s"].as_f64()).collect())
        .unwrap_or_default();
    let kv_budget = v["target"]["kv_budget"].as_str().map(String::from);
    Ok((name, hits, ttft, kv_budget))
}

/// What the run's hits and the ideal's left the answered requests to prefill
/// ([`PrefillBound`]).
#[derive(Debug, Serialize)]
struct PrefillBounds {
    /// With the hits the target reported.
    hits: Option<PrefillBound>,
    /// With the ideal (unbounded) cache's hits, over the same requests.
    ideal: Option<PrefillBound>,
}

fn prefill_bounds(rows: &[Row]) -> PrefillBounds {
    let answered = || rows.iter().filter(|r| r.sent.outcome.ttft_s.is_some());
    PrefillBounds {
        hits: PrefillBound::of(
            answered().map(|r| (r.sent.outcome.prompt_tokens, r.sent.outcome.cached_tokens)),
        ),
        ideal: PrefillBound::of(answered().map(|r| (r.prompt_len, r.ideal_tokens))),
    }
}

fn print(overall: &Summary, minutes: &[Summary], ran: &Ran, s: &Settings) {
    println!("target: {}", ran.target);
    println!(
        "{:>6} {:>5} {:>6} {:>6} {:>7} {:>7} {:>7} {:>7} {:>7} {:>7} {:>9} {:>9} {:>9}",
        "minute",
        "reqs",
        "failed",
        "unsent",
        "hit",
        "device",
        "ram",
        "ssd",
        "ideal",
        "lru",
        "ttft p50",
        "ttft p99",
        "e2e p50"
    );
    let line = |label: String, m: &Summary| {
        println!(
            "{label:>6} {:>5} {:>6} {:>6} {:>7} {:>7} {:>7} {:>7} {:>7} {:>7} {:>8.3}s {:>8.3}s {:>8.3}s",
            m.requests,
            m.failed,
            m.unsent,
            pct(Some(m.hit_share)),
            pct(m.tiers.device),
            pct(m.tiers.ram),
            pct(m.tiers.ssd),
            pct(Some(m.ideal_share)),
            pct(m.lru_share),
            m.ttft_s.p50,
            m.ttft_s.p99,
            m.e2e_s.p50
        );
    };
    for (i, m) in minutes.iter().enumerate() {
        if m.requests > 0 {
            line(i.to_string(), m);
        }
    }
    line("all".into(), overall);
    println!(
        "hit share {} of prompt tokens = {:.3} of the ideal {}{}; TTFT p50/p90/p99 \
         {:.3}/{:.3}/{:.3} s; e2e p50/p90/p99 {:.3}/{:.3}/{:.3} s; sent late p50/p99 \
         {:.2}/{:.2} s",
        pct(Some(overall.hit_share)),
        overall.of_ideal,
        pct(Some(overall.ideal_share)),
        match (ran.lru_budget, overall.lru_share) {
            (Some(b), Some(l)) => format!(", LRU of {b} tokens {}", pct(Some(l))),
            _ => String::new(),
        } + &match (ran.policy, overall.policy_share) {
            (Some(p), Some(v)) if v > 0.0 => format!(
                ", {p} with one perfect tier {} (the run got {:.3} of it)",
                pct(Some(v)),
                overall.hit_share / v
            ),
            _ => String::new(),
        },
        overall.ttft_s.p50,
        overall.ttft_s.p90,
        overall.ttft_s.p99,
        overall.e2e_s.p50,
        overall.e2e_s.p90,
        overall.e2e_s.p99,
        overall.late_s.p50,
        overall.late_s.p99
    );
    let k = &overall.skipped;
    if [k.ram, k.ssd, k.remote]
        .iter()
        .any(|x| x.is_some_and(|x| x > 0.0))
    {
        println!(
            "found cached but recomputed (the cost model estimated it faster than restoring): \
             RAM {}, SSD {}, remote {} of prompt tokens",
            pct(k.ram),
            pct(k.ssd),
            pct(k.remote)
        );
    }
    if let Some(p) = &overall.ttft_parts_p50 {
        println!(
            "TTFT parts, each its median: queue {:.4} s (the prefix loaded by the I/O workers \
             {:.4} s after submission), lookup {:.4} s, restore {:.4} s, \
             prefill and first pick {:.4} s, other work in its steps {:.4} s",
            p.queue_s, p.prefetch_s, p.lookup_s, p.restore_s, p.prefill_s, p.other_work_s
        );
    }
    if let Some(i) = overall.imports.filter(|i| i.requests > 0) {
        println!(
            "imports of loaded blocks: {} requests, the engine thread's part {:.4} s at the \
             median; {} staged ahead by the I/O workers ({:.4} s of checks and assembly each \
             at the median, off the engine thread)",
            i.requests, i.import_s_p50, i.staged, i.staged_s_p50
        );
    }
    if let Some(note) = &ran.tier_note {
        println!("{note}");
    }
    if let Some(steps) = &ran.steps {
        println!("{}", steps.summary());
        println!("{}", steps.by_rows());
    }
    if let Some(m) = &ran.memory {
        println!("{}", m.line());
    }
    let sent = overall.requests - overall.unsent;
    println!(
        "{sent} requests in {:.1} s{}: {:.2} req/s, {:.0} prompt tok/s, {:.1} completion tok/s \
         (trace time compressed {}x)",
        ran.wall_s,
        if overall.unsent > 0 {
            format!(" ({} more not sent before --deadline)", overall.unsent)
        } else {
            String::new()
        },
        sent as f64 / ran.wall_s,
        overall.prompt_tokens as f64 / ran.wall_s,
        overall.completion_tokens as f64 / ran.wall_s,
        s.speed
    );
}

/// The engine in this process, built as `kvstore serve` builds it; with `--engines N`, N
/// of them, each over its own store (`<store>/engine-<i>`) and all over the same remote
/// tier, taking requests in turn.
fn in_process(args: &Args, s: &Settings, times: &[f64]) -> Result<Ran> {
    let scratch = tempfile::tempdir().context("creating a scratch store directory")?;
    let base = args.cache.store.clone();
    let mut engines = Vec::with_capacity(args.engines);
    let mut cache = args.cache.clone();
    let mut bytes_per_token = 0;
    for i in 0..args.engines {
        let (model, tokenizer) = args.model.load()?;
        let root = base.clone().unwrap_or_else(|| scratch.path().to_path_buf());
        cache.store = Some(match args.engines {
            1 => root,
            _ => root.join(format!("engine-{i}")),
        });
        let prefix = cache.open(&model, &tokenizer)?;
        let info = model.info().clone();
        let kv_format = cache.reuse_config(info.kv.head_dim)?.kv_format;
        bytes_per_token = (info.kv.layers
            * 2
            * info.kv.kv_heads
            * kv_format.bytes_per_head_token(info.kv.head_dim, info.kv.dtype.size()))
            as u64;
        engines.push(Engine::open(
            model,
            tokenizer,
            prefix,
            EngineConfig {
                max_batch: args.max_batch,
                prefill_chunk: args.prefill_chunk(),
                itl_stretch: args.itl_stretch,
                prefill_order: args.prefill_order,
                io_workers: args.io_workers,
                load_grace: crate::cli_duration_ms(args.load_grace, "--load-grace")?,
                pass_workspace: crate::cache_args::parse_size(&args.pass_workspace)
                    .context("--pass-workspace")?,
                kv_budget_bytes: cache.kv_budget_bytes()?,
                max_queue: s.max_concurrency.max(256),
                context_limit: None,
                step_log: STEP_LOG,
                ..EngineConfig::default()
            },
        )?);
    }
    let kv_budget = cache.kv_budget_bytes()?;
    let size = |s: &str, flag: &str| crate::cache_args::parse_size(s).context(flag.to_string());
    let lru_budget = match (args.budget_tokens.first(), cache.no_cache) {
        (Some(&b), _) => Some(b),
        (None, true) => None,
        // Every tier's bytes of every engine as distinct tokens: an upper bound of what the
        // local tiers hold (a block spilled to SSD may still be in RAM or on the device).
        (None, false) => Some(
            args.engines as u64
                * (kv_budget
                    + size(&cache.ram_budget, "--ram-budget")?
                    + size(&cache.ssd_budget, "--ssd-budget")?)
                / bytes_per_token.max(1),
        ),
    };
    let vocab = engines
        .iter()
        .map(|e| e.info().vocab_size.min(e.tokenizer().vocab_size()) as u32)
        .min()
        .unwrap_or(0);
    let target = RoundRobin {
        targets: engines
            .iter()
            .map(|engine| EngineTarget {
                engine,
                block_tokens: args.cache.block_size,
            })
            .collect(),
        next: Default::default(),
    };
    // Kernels compiled and weights paged in before the clock starts (on every engine; the
    // warm-up prompt shares no block with the trace).
    for t in &target.targets {
        let warm = tokens::block_tokens(WARMUP_ID, s.scale.block().min(64), vocab);
        if let Some(e) = dispatch::Target::send(t, warm, 2).error {
            bail!("the warm-up request failed: {e}");
        }
    }
    let stats = |engines: &[Engine]| -> Vec<Option<StoreStats>> {
        engines.iter().map(Engine::cache_stats).collect()
    };
    let before = stats(&engines);
    let logged_before: Vec<usize> = engines.iter().map(|e| e.step_log().len()).collect();
    let make = |i: usize| {
        let r = &s.requests[i];
        (tokens::prompt(r, &s.scale, vocab), s.scale.output_len(r))
    };
    let sampler = super::memory::MemorySampler::start()?;
    let t0 = Instant::now();
    let sent = dispatch::replay(times, &make, &target, s.max_concurrency, s.deadline);
    let wall_s = t0.elapsed().as_secs_f64();
    let memory = sampler.finish()?;
    let after = stats(&engines);
    let exports: Vec<Option<ExportStats>> = engines
        .iter()
        .map(|e| e.kv_tiers().map(|t| t.export_stats()))
        .collect();
    // The replay's steps of every engine (the warm-up's come first, unless a full log
    // lost them already).
    let mut steps = Vec::new();
    let mut lines = Vec::new();
    for (i, (engine, before)) in engines.iter().zip(logged_before).enumerate() {
        let log = engine.step_log();
        let skip = if log.len() < STEP_LOG { before } else { 0 };
        let ran = &log[skip.min(log.len())..];
        if args.step_log.is_some() {
            lines.extend(ran.iter().map(|r| step_line(i, engine.started(), t0, r)));
        }
        steps.extend_from_slice(ran);
    }
    if let Some(path) = &args.step_log {
        let mut text = lines.join("\n");
        text.push('\n');
        std::fs::write(path, text)
            .with_context(|| format!("writing the step log {}", path.display()))?;
        eprintln!("wrote {} ({} steps)", path.display(), lines.len());
    }
    drop(target);
    let name = match (cache.no_cache, args.engines) {
        (true, _) => "in process, no cache".to_string(),
        (false, 1) => "in process".to_string(),
        (false, n) => format!("in process, {n} engines sharing the remote tier, round robin"),
    };
    Ok(Ran {
        target: json!({
            "name": name,
            "model": args.model.path()?.display().to_string(),
            "vocab": vocab,
            "engines": args.engines,
            "block_size": cache.block_size,
            "kv_budget": cache.kv_budget,
            "ram_budget": cache.ram_budget,
            "ssd_budget": cache.ssd_budget,
            "remote": cache.remote.remote.as_deref().map(store::redact),
            "eviction": cache.eviction.name(),
            "device_tier": cache.device_tier.name(),
            "restore": format!("{:?}", cache.restore).to_lowercase(),
            "no_cache": cache.no_cache,
            "max_batch": args.max_batch,
            "prefill_chunk": args.prefill_chunk(),
            "prefill_order": args.prefill_order.name(),
            "itl_stretch": args.itl_stretch,
            "kv_bytes_per_token": bytes_per_token,
            // Threads of bulk host-device copies (null where they are not the driver's).
            "transfer_threads": mlx::direct_transfers().then(cache::transfer_threads),
        }),
        sent,
        wall_s,
        lru_budget,
        policy: (!cache.no_cache).then_some(cache.eviction),
        tier_note: store_note(&before, &after, &cache.eviction.to_string(), wall_s)
            .map(|n| n + &export_note(&exports)),
        steps: Some(StepSummary::of(&steps)),
        memory: Some(memory),
        engines,
        scratch: Some(scratch),
        counters: match args.engines {
            1 => json!({"store_before": before[0], "store_after": after[0], "export": exports[0]}),
            _ => json!({"store_before": before, "store_after": after, "export": exports}),
        },
    })
}

/// A line on the stores' counters over the run (summed over the engines), or `None`
/// without a cache.
fn store_note(
    before: &[Option<StoreStats>],
    after: &[Option<StoreStats>],
    eviction: &str,
    wall_s: f64,
) -> Option<String> {
    let pairs: Vec<(&StoreStats, &StoreStats)> = before
        .iter()
        .zip(after)
        .filter_map(|(b, a)| Some((b.as_ref()?, a.as_ref()?)))
        .collect();
    if pairs.is_empty() {
        return None;
    }
    let sum = |f: &dyn Fn(&StoreStats) -> u64| -> u64 {
        pairs.iter().map(|(b, a)| f(a).saturating_sub(f(b))).sum()
    };
    let remote = match sum(&|x| x.remote_hits) {
        0 => String::new(),
        n => format!(", {n} remote hits"),
    };
    let (written, commits) = (sum(&|x| x.blocks_written), sum(&|x| x.group_commits));
    // A share of the run's wall time, every store's own.
    let of_run = |us: u64| 100.0 * us as f64 / 1e6 / (wall_s * pairs.len() as f64).max(1e-9);
    Some(format!(
        "store over the run: {} blocks ({:.1} MiB) written in {commits} group commits ({:.1} \
         blocks each; the writer busy {:.0} % of the run, {:.0} % in fsyncs), {} RAM and {} SSD evictions, {} spills to SSD ({} more dropped: \
         write-behind queue full, --ssd-queue), {} RAM and {} SSD hits{remote}, {} blocks not \
         admitted to RAM (--eviction {eviction})",
        written,
        sum(&|x| x.bytes_written) as f64 / 1048576.0,
        written as f64 / commits.max(1) as f64,
        of_run(sum(&|x| x.write_busy_us)),
        of_run(sum(&|x| x.write_sync_us)),
        sum(&|x| x.ram_evictions),
        sum(&|x| x.ssd_evictions),
        sum(&|x| x.spills),
        sum(&|x| x.skipped_queue_full),
        sum(&|x| x.ram_hits),
        sum(&|x| x.ssd_hits),
        sum(&|x| x.ram_not_admitted),
    ))
}

/// The export threads' work since the engines started (device → host copies of published
/// blocks and their inserts), as a clause of [`store_note`]'s line.
fn export_note(exports: &[Option<ExportStats>]) -> String {
    let all: Vec<&ExportStats> = exports.iter().flatten().collect();
    let sum = |f: &dyn Fn(&ExportStats) -> u64| -> u64 { all.iter().map(|x| f(x)).sum() };
    let s = |us: u64| us as f64 * 1e-6;
    format!(
        "; export thread: {} blocks ({:.1} MiB) in {:.1} s reading back and {:.1} s inserting, \
         {} exports ({} blocks) skipped while it was behind, lookups waited {:.1} s ({} times)",
        sum(&|x| x.blocks),
        sum(&|x| x.bytes) as f64 / 1048576.0,
        s(sum(&|x| x.read_us)),
        s(sum(&|x| x.insert_us)),
        sum(&|x| x.skipped_exports),
        sum(&|x| x.skipped_blocks),
        s(sum(&|x| x.lookup_wait_us)),
        sum(&|x| x.lookup_waits),
    )
}

/// mlx-lm's `mlx_lm.server` as a child process, its prompt caches bounded by `--kv-budget`
/// (its `--prompt-cache-bytes`), prompts sent as text ([`peer`]).
fn mlx_lm_server(args: &Args, s: &Settings, python: &str, times: &[f64]) -> Result<Ran> {
    let (folder, tokenizer) =
        ChildServer::mlx_lm_folder(args.model.path()?, args.peer_model.clone())?;
    let vocab = tokenizer.vocab_size() as u32;
    let make = |i: usize| {
        let r = &s.requests[i];
        (tokens::prompt(r, &s.scale, vocab), s.scale.output_len(r))
    };
    let prompts: Vec<Vec<u32>> = (0..s.requests.len()).map(|i| make(i).0).collect();
    let kept = peer::retokenized_prefix_share(&tokenizer, &prompts)?;
    let cache_bytes = args.cache.kv_budget_bytes()?;
    let child = ChildServer::mlx_lm(python, &folder, 2 * s.max_concurrency, Some(cache_bytes))?;
    let target = peer::TextTarget {
        http: HttpTarget::new(&child.url, None, None)?,
        tokenizer,
    };
    // mlx-lm compiles its kernels on first use too: one request that shares no block with
    // the trace runs before the clock starts.
    let warm = tokens::block_tokens(WARMUP_ID, s.scale.block().min(64), vocab);
    if let Some(e) = dispatch::Target::send(&target, warm, 2).error {
        bail!("the warm-up request failed: {e}\n{}", child.log_tail());
    }
    let t0 = Instant::now();
    let sent = dispatch::replay(times, &make, &target, s.max_concurrency, s.deadline);
    let wall_s = t0.elapsed().as_secs_f64();
    drop(child);
    Ok(Ran {
        target: json!({
            "name": "mlx_lm.server",
            "model": folder.display().to_string(),
            "vocab": vocab,
            "prompt_cache_bytes": cache_bytes,
            "prompt_cache_size": 2 * s.max_concurrency,
            "retokenized_prefix_share": kept,
        }),
        sent,
        wall_s,
        lru_budget: args.budget_tokens.first().copied(),
        policy: None,
        counters: json!({}),
        steps: None,
        memory: None,
        engines: Vec::new(),
        scratch: None,
        tier_note: Some(format!(
            "mlx_lm.server counts its own tokens (it re-tokenizes the text): hit shares above \
             are of its prompt tokens, against the ideal of the trace's; re-tokenizing the \
             prompts' text gives back {} of their tokens as the same leading ids",
            pct(Some(kept))
        )),
    })
}

/// Counters of a server's `/metrics` that a replay reports the change of.
const METRICS: &str = "kvstore_";

/// A running server.
fn http(args: &Args, s: &Settings, url: &str, times: &[f64]) -> Result<Ran> {
    let Some(vocab) = args.vocab else {
        bail!("--url needs --vocab N: the token ids sent must be below the server's vocabulary");
    };
    if vocab == 0 {
        bail!("--vocab must be at least 1");
    }
    let api_key = args
        .api_key
        .clone()
        .or_else(|| std::env::var("KVSTORE_API_KEY").ok());
    let target = HttpTarget::new(url, args.served_model.clone(), api_key)?;
    // Not every server has kvstore's counters; the replay goes on without them.
    let before = target.metrics(METRICS).unwrap_or_default();
    let make = |i: usize| {
        let r = &s.requests[i];
        (tokens::prompt(r, &s.scale, vocab), s.scale.output_len(r))
    };
    let t0 = Instant::now();
    let sent = dispatch::replay(times, &make, &target, s.max_concurrency, s.deadline);
    let wall_s = t0.elapsed().as_secs_f64();
    let after = target.metrics(METRICS).unwrap_or_default();
    let delta: serde_json::Map<String, serde_json::Value> = after
        .iter()
        .map(|(k, v)| {
            let b = before.iter().find(|(bk, _)| bk == k).map_or(0.0, |x| x.1);
            (k.clone(), json!(v - b))
        })
        .collect();
    let prompt: f64 = sent
        .iter()
        .filter(|x| x.outcome.error.is_none())
        .map(|x| x.outcome.prompt_tokens as f64)
        .sum();
    let tiers: Vec<String> = ["device", "ram", "ssd", "remote"]
        .iter()
        .filter_map(|t| {
            let k = format!("kvstore_cached_prompt_tokens_total{{tier=\"{t}\"}}");
            delta
                .get(&k)
                .and_then(|v| v.as_f64())
                .map(|v| format!("{t} {}", pct(Some(v / prompt.max(1.0)))))
        })
        .collect();
    Ok(Ran {
        target: json!({"name": url, "url": url, "vocab": vocab, "model": args.served_model}),
        sent,
        wall_s,
        lru_budget: args.budget_tokens.first().copied(),
        policy: None,
        counters: json!({"server_metrics_delta": delta}),
        steps: None,
        memory: None,
        engines: Vec::new(),
        scratch: None,
        tier_note: (!tiers.is_empty()).then(|| {
            let n = |k: &str| delta.get(k).and_then(|v| v.as_f64()).unwrap_or(0.0);
            format!(
                "by tier, from the server's counters over the run: {}; {} device evictions; \
                 store block hits: RAM {}, SSD {}; {:.1} MiB written to the store",
                tiers.join(", "),
                n("kvstore_device_evictions_total"),
                n("kvstore_cache_hits_total{tier=\"ram\"}"),
                n("kvstore_cache_hits_total{tier=\"ssd\"}"),
                n("kvstore_cache_bytes_written_total") / 1048576.0
            )
        }),
    })
}

/// One line of `--step-log`: engine `engine`'s step `r`, its start in seconds after `t0`
/// (the replay's start; negative for the warm-up) from the engine's origin `started`.
fn step_line(engine: usize, started: Instant, t0: Instant, r: &engine::StepRecord) -> String {
    let at = started + std::time::Duration::from_micros(r.started_us);
    let t_s = match at.checked_duration_since(t0) {
        Some(d) => d.as_secs_f64(),
        None => -t0.duration_since(at).as_secs_f64(),
    };
    json!({ "engine": engine, "t_s": t_s, "step": r }).to_string()
}
