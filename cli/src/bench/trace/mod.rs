//! `kvstore bench trace FILE`: replays a Mooncake-format request trace (docs/benchmarks.md,
//! "Trace replay"). Flags are read in two stages: [`Args`] as clap gives them, then
//! [`Settings`], validated.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};

mod bursts;
pub(crate) mod dispatch;
#[cfg(test)]
mod exact_tests;
pub(crate) mod http;
mod inprocess;
mod memory;
mod parse;
mod peer;
mod plot;
mod prefill_bound;
mod replay;
pub(crate) mod report;
mod scale;
mod sim;
#[cfg(test)]
mod tier_tests;
mod tiered;
mod tokens;

use parse::{TraceRequest, Window};
use prefill_bound::PrefillBound;
use scale::TokenScale;
use sim::{Policy, SimTrace};

use crate::cache_args::CacheArgs;
use crate::generate::ModelArgs;

/// Arguments of `kvstore bench trace`.
#[derive(clap::Args)]
pub struct Args {
    /// The trace: JSON lines with `timestamp` (ms), `input_length`, `output_length` and
    /// `hash_ids` (one id per 512-token block), as published by Mooncake.
    file: PathBuf,
    /// Take only the requests arriving in `[START, END)` seconds of trace time
    /// (`0..600`, `..300`, `900..`). Default: the whole trace.
    #[arg(long, value_name = "START..END", value_parser = Window::parse)]
    window: Option<Window>,
    /// Time compression: a request at trace second t is sent at t / X after the start.
    #[arg(long, value_name = "X", default_value_t = 1.0)]
    speed: f64,
    /// Most requests in flight at once; later ones wait for a slot (and are sent late).
    #[arg(long, value_name = "N", default_value_t = 16)]
    max_concurrency: usize,
    /// Stop sending this many seconds (wall time) after the start: requests not sent by
    /// then are reported as unsent and left out of every share and percentile; those in
    /// flight finish. A run that cannot keep up with the arrivals still ends and reports.
    #[arg(long, value_name = "SECONDS")]
    deadline: Option<f64>,
    /// After the report, leave the RAM tier's blocks unwritten instead of flushing them to
    /// the SSD (blocks already queued for the SSD are still written): for a scratch store,
    /// where the flush is only time (86 s after a 10-minute slice on the H200).
    #[arg(long)]
    no_flush: bool,
    /// Multiplies every length and the 512-token block by F (512 × F must be whole).
    #[arg(long, value_name = "F", default_value_t = 1.0)]
    token_scale: f64,
    /// Run no model: print the hit share of prompt tokens an unbounded cache (ideal), and
    /// caches of each `--budget-tokens` under every eviction policy, would get.
    #[arg(long)]
    simulate: bool,
    /// A cache size in (scaled) tokens for the simulated policies; repeatable. It holds
    /// N / block whole blocks.
    #[arg(long = "budget-tokens", value_name = "N")]
    budget_tokens: Vec<u64>,
    /// With `--simulate`: also replay the trace through a model of kvstore's three tiers
    /// with these token budgets (`DEVICE,RAM,SSD`, e.g. `364089,1118481,838861`; 0 leaves
    /// a tier out), in host blocks of `--block-size` tokens with RAM under `--eviction`,
    /// and print the hit share by tier beside one cache of their sum; repeatable.
    #[arg(long, value_name = "DEVICE,RAM,SSD", requires = "simulate", value_parser = tiered::TierBudgets::parse)]
    tiers: Vec<tiered::TierBudgets>,
    /// With `--tiers`: drop this share (0 to 1) of the spills the SSD would be written,
    /// evenly spread, as a full write-behind queue drops them.
    #[arg(long, value_name = "F", default_value_t = 0.0, requires = "tiers")]
    drop_spills: f64,
    /// With `--drop-spills`: drop that share in runs of N consecutive spills (a full queue
    /// drops what leaves RAM until the writer catches up).
    #[arg(long, value_name = "N", default_value_t = 1, requires = "drop_spills")]
    drop_run: u64,
    /// With `--tiers`: queue the spills for a writer of RATE host blocks a second with a
    /// queue of QUEUE host blocks, dropping what arrives while it is full; a request's
    /// blocks are published at its arrival, or with PUBLISH one after another at that many
    /// blocks a second (in place of `--drop-spills`; e.g. `305,728,397`: the H200 writer's
    /// rate while busy, 1 GiB of SmolLM2 blocks, 12.7K prompt tokens a second).
    #[arg(long, value_name = "RATE,QUEUE[,PUBLISH]", requires = "tiers", conflicts_with = "drop_spills", value_parser = tiered::WriterModel::parse)]
    writer: Option<tiered::WriterModel>,
    /// With `--writer`: after a drop, keep dropping until the queue has drained to this
    /// share of its bound (the store's mark, `store::QUEUE_RESUME_SHARE`, by default; 1:
    /// take a spill as soon as one fits, as the store did until session 27).
    #[arg(long, value_name = "F", default_value_t = store::QUEUE_RESUME_SHARE, requires = "writer")]
    writer_resume: f64,
    /// With `--tiers`: the device tier exclusive of RAM (a block reaches RAM when its
    /// sequence leaves the device, not when it is published), as `--device-tier exclusive`
    /// runs it.
    #[arg(long, requires = "tiers")]
    device_exclusive: bool,
    /// Also write the results as JSON to this file.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Write the replay's plot here (SVG: hit share per minute against the ideal and the
    /// simulated LRU, TTFT CDF).
    #[arg(long, value_name = "FILE")]
    svg: Option<PathBuf>,
    /// In process: write every engine step of the replay here, one JSON object a line (its
    /// engine, its start in seconds after the first request was sent, and the engine's
    /// step record: the rows it decoded, the prompt chunk and riders it prefilled by request
    /// id, and where its time went). The JSON's requests carry their `request_id` and
    /// `engine` to match.
    #[arg(long, value_name = "FILE")]
    step_log: Option<PathBuf>,
    /// The replay's name in its JSON and plot. Default: the target (`in process`, the URL).
    #[arg(long, value_name = "NAME")]
    label: Option<String>,
    /// Also draw an earlier replay's `--json` in the plot (hit share per minute, TTFT CDF);
    /// repeatable, for arms run one after another on the same window.
    #[arg(long, value_name = "FILE")]
    compare: Vec<PathBuf>,
    /// Replay against a running server (`http://host:port`) instead of an engine in this
    /// process. Its `/v1/completions` must take token-id prompts.
    #[arg(long, value_name = "URL")]
    url: Option<String>,
    /// With `--url`: the server model's vocabulary size (token ids are drawn below it).
    #[arg(long, value_name = "N", requires = "url")]
    vocab: Option<u32>,
    /// With `--url`: the `model` field of every request. Default: none sent.
    #[arg(long, value_name = "ID", requires = "url")]
    served_model: Option<String>,
    /// With `--url`: `Authorization: Bearer KEY` (default: $KVSTORE_API_KEY).
    #[arg(long, value_name = "KEY", requires = "url")]
    api_key: Option<String>,
    /// In process: most requests decoding together (as `serve --max-batch`).
    #[arg(long, default_value_t = 8)]
    max_batch: usize,
    /// In process: most prompt tokens prefilled per engine step (as `serve
    /// --prefill-chunk`) [default: 2048 on a GPU, 512 on the CPU].
    #[arg(long, value_name = "N", value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    prefill_chunk: Option<usize>,
    /// In process: which admitted prompt is prefilled next (as `serve --prefill-order`).
    #[arg(long, value_name = "arrival|fewest-new", default_value = "fewest-new")]
    prefill_order: engine::PrefillOrder,
    /// In process: threads loading queued requests' cached prefixes (as `serve
    /// --io-workers`).
    #[arg(long, value_name = "N", default_value_t = engine::DEFAULT_IO_WORKERS, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=64))]
    io_workers: usize,
    /// In process: milliseconds admission waits for just-submitted requests' loads before
    /// a prefill step (as `serve --load-grace`).
    #[arg(long, value_name = "MS", default_value_t = engine::DEFAULT_LOAD_GRACE.as_secs_f64() * 1e3)]
    load_grace: f64,
    /// In process: what one prefill pass may hold on a GPU at once, its activations and
    /// its attention scores where MLX materializes them (as `serve --pass-workspace`).
    #[arg(long, value_name = "SIZE", default_value = "8GiB")]
    pass_workspace: String,
    /// In process: a step with a prefill chunk takes at most this multiple of a
    /// decode-only step (as `serve --itl-stretch`); `none` always runs the whole chunk.
    #[arg(long, value_name = "X|none", default_value = "none", value_parser = crate::serve::parse_itl_stretch)]
    itl_stretch: crate::serve::ItlStretch,
    /// Replay against mlx-lm's `mlx_lm.server`, started with this Python (mlx-lm ≥ 0.32,
    /// `bash scripts/bench/setup_peer.sh` makes `.venv-peer`) on the `--model` folder (or
    /// `--peer-model`), its prompt caches bounded by `--kv-budget`. It takes text: each
    /// prompt is sent as the text the model's tokenizer decodes its token ids to.
    #[arg(long, value_name = "PY", conflicts_with = "url")]
    peer_python: Option<String>,
    /// With `--peer-python`: the Hugging Face folder mlx_lm.server loads (when `--model`
    /// is a GGUF file).
    #[arg(long, value_name = "DIR", requires = "peer_python")]
    peer_model: Option<std::path::PathBuf>,
    /// In process: this many engines, each with its own device tier and local store (RAM,
    /// SSD) and the same budgets, sharing the remote tier (`--remote`, required from 2 on);
    /// requests go to them in turn, as to servers behind a round-robin balancer.
    #[arg(long, value_name = "N", default_value_t = 1)]
    engines: usize,
    #[command(flatten)]
    model: ModelArgs,
    /// In process: the prefix cache (a fresh temporary store unless `--store` is given).
    #[command(flatten)]
    cache: CacheArgs,
}

impl Args {
    /// The prefill chunk: `--prefill-chunk`, or the device's default.
    fn prefill_chunk(&self) -> usize {
        self.prefill_chunk
            .unwrap_or_else(engine::default_prefill_chunk)
    }
}

/// Validated settings of a run.
struct Settings {
    requests: Vec<TraceRequest>,
    window: Window,
    speed: f64,
    max_concurrency: usize,
    scale: TokenScale,
    /// `--deadline`.
    deadline: Option<std::time::Duration>,
}

impl Settings {
    fn new(args: &Args) -> Result<Settings> {
        if !(args.speed.is_finite() && args.speed > 0.0) {
            bail!("--speed must be a number above 0, not {}", args.speed);
        }
        if args.max_batch == 0 {
            bail!("--max-batch must be at least 1");
        }
        if args.max_concurrency == 0 {
            bail!("--max-concurrency must be at least 1");
        }
        if args.engines == 0 {
            bail!("--engines must be at least 1");
        }
        if args.engines > 1
            && (args.url.is_some() || args.peer_python.is_some() || args.cache.no_cache)
        {
            bail!("--engines runs engines in this process with their caches: not with --url, --peer-python or --no-cache");
        }
        if args.step_log.is_some()
            && (args.url.is_some() || args.peer_python.is_some() || args.simulate)
        {
            bail!("--step-log writes the steps of engines in this process: not with --url, --peer-python or --simulate");
        }
        if args.engines > 1 && args.cache.remote.remote.is_none() {
            bail!(
                "--engines {} shares blocks between the engines through the remote tier: give \
                 it with --remote redis://host:port",
                args.engines
            );
        }
        let deadline = match args.deadline {
            None => None,
            Some(d) if d.is_finite() && d > 0.0 => Some(std::time::Duration::from_secs_f64(d)),
            Some(d) => bail!("--deadline must be a number of seconds above 0, not {d}"),
        };
        let scale = TokenScale::new(args.token_scale)?;
        let window = args.window.unwrap_or(Window {
            start_s: 0.0,
            end_s: f64::INFINITY,
        });
        let requests = window.select(&parse::read(&args.file)?);
        if requests.is_empty() {
            bail!(
                "no request of {} arrives in the window {}..{} s",
                args.file.display(),
                window.start_s,
                window.end_s
            );
        }
        Ok(Settings {
            requests,
            window,
            speed: args.speed,
            max_concurrency: args.max_concurrency,
            scale,
            deadline,
        })
    }

    /// Seconds from the window's start to request `r`'s send time (after `--speed`).
    fn send_at_s(&self, r: &TraceRequest) -> f64 {
        (r.timestamp as f64 / 1000.0 - self.window.start_s).max(0.0) / self.speed
    }
}

/// Runs the trace benchmark.
pub fn run(args: Args) -> Result<()> {
    let s = Settings::new(&args)?;
    summary(&s);
    // mlx_lm.server (the peer arm) reuses token by token: no blocks of its own to note.
    if !args.cache.no_cache && args.peer_python.is_none() {
        if let Some(note) = s.scale.granularity_note(args.cache.block_size) {
            println!("{note}");
        }
    }
    if args.simulate {
        let mut json = simulate(&s, &args.budget_tokens, &args.tiers)?;
        if !args.tiers.is_empty() {
            let model = tiered::TierModel {
                block: args.cache.block_size,
                eviction: args.cache.eviction,
                drop_spills: args.drop_spills,
                drop_run: args.drop_run,
                writer: args.writer.map(|w| tiered::WriterModel {
                    resume: args.writer_resume,
                    ..w
                }),
                exclusive: args.device_exclusive,
                max_blocks: engine::ReuseConfig::default().max_blocks,
            };
            let t = SimTrace::new(&s.requests, &s.scale);
            json["tiers"] = tiered::report(&t, &args.tiers, model)?;
        }
        if let Some(path) = &args.json {
            write_json(path, &json)?;
        }
        return Ok(());
    }
    replay::run(&args, &s)
}

fn write_json(path: &std::path::Path, json: &serde_json::Value) -> Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    std::fs::write(path, serde_json::to_string_pretty(json)?)
        .with_context(|| format!("writing {}", path.display()))?;
    println!("wrote {}", path.display());
    Ok(())
}

/// `--simulate`: the ideal and every policy at every budget, as a table and as JSON.
fn simulate(
    s: &Settings,
    budgets: &[u64],
    tiers: &[tiered::TierBudgets],
) -> Result<serde_json::Value> {
    if budgets.is_empty() && tiers.is_empty() {
        bail!("--simulate needs at least one --budget-tokens N or --tiers DEVICE,RAM,SSD");
    }
    let t = SimTrace::new(&s.requests, &s.scale);
    let total = t.prompt_tokens() as f64;
    let share = |hits: &[usize]| hits.iter().sum::<usize>() as f64 / total;
    let bound = |hits: &[usize]| {
        PrefillBound::of(t.requests.iter().map(|r| r.len).zip(hits.iter().copied()))
    };
    let ideal_hits = sim::ideal(&t);
    let ideal = share(&ideal_hits);
    let ideal_bound = bound(&ideal_hits);
    println!(
        "ideal (unbounded cache): {:.2} % of {} prompt tokens",
        100.0 * ideal,
        t.prompt_tokens()
    );
    if let Some(b) = &ideal_bound {
        println!(
            "tokens left to prefill per request with the ideal's hits / without a cache, \
             P50 / P90 / P99: {} (the TTFT ratio where TTFT follows them and no queue forms)",
            b.describe()
        );
    }
    let times: Vec<u64> = s.requests.iter().map(|r| r.timestamp).collect();
    let mut gaps = sim::reuse_gaps(&t, &times);
    if !gaps.is_empty() {
        let q = |g: &mut Vec<(usize, u64)>, at: f64| {
            let k = ((at * g.len() as f64) as usize).min(g.len() - 1);
            let n = *g.select_nth_unstable_by_key(k, |x| x.0).1;
            let ms = g.select_nth_unstable_by_key(k, |x| x.1).1 .1;
            (n.0, ms as f64 / 1000.0)
        };
        let (m, p10) = (q(&mut gaps, 0.5), q(&mut gaps, 0.1));
        println!(
            "{} requests reuse two blocks or more; their deepest reused block was last used \
             {} requests ({:.0} s) earlier at the median, {} requests ({:.0} s) at P10",
            gaps.len(),
            m.0,
            m.1,
            p10.0,
            p10.1
        );
    }
    println!(
        "{:>14} {:>9} {}   (% of prompt tokens hit; in brackets: share of the ideal)",
        "budget tokens",
        "blocks",
        Policy::ALL
            .iter()
            .map(|p| format!("{:>17}", p.name()))
            .collect::<String>()
    );
    let mut rows = Vec::new();
    for &b in budgets {
        let blocks = usize::try_from(b / t.block as u64).unwrap_or(usize::MAX);
        let mut row = serde_json::Map::new();
        row.insert("budget_tokens".into(), b.into());
        row.insert("blocks".into(), blocks.into());
        let mut cells = String::new();
        let mut bounds = serde_json::Map::new();
        let mut shipped = None;
        for p in Policy::ALL {
            let hits = sim::simulate(&t, p, blocks);
            let h = share(&hits);
            row.insert(p.name().into(), h.into());
            let b = bound(&hits);
            if p == Policy::FreqAdmit {
                shipped = b;
            }
            bounds.insert(p.name().into(), serde_json::to_value(b)?);
            cells += &format!(
                "{:>9.2} ({:>5.3})",
                100.0 * h,
                if ideal > 0.0 { h / ideal } else { 0.0 }
            );
        }
        println!("{b:>14} {blocks:>9} {cells}");
        if let Some(pb) = shipped {
            println!(
                "{:>25} tokens left to prefill with {}'s hits / without, P50 / P90 / P99: {}",
                "",
                Policy::FreqAdmit.name(),
                pb.describe()
            );
        }
        row.insert("prefill_bound".into(), serde_json::Value::Object(bounds));
        rows.push(serde_json::Value::Object(row));
    }
    Ok(serde_json::json!({
        "schema": "kvstore.bench.trace.simulate.v1",
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "requests": t.requests.len(),
        "prompt_tokens": t.prompt_tokens(),
        "block_tokens": t.block,
        "ideal": ideal,
        "ideal_prefill_bound": ideal_bound,
        "budgets": rows,
    }))
}

/// One line on what the window holds.
fn summary(s: &Settings) {
    let prompt: usize = s.requests.iter().map(|r| s.scale.prompt_len(r)).sum();
    let output: usize = s.requests.iter().map(|r| s.scale.output_len(r)).sum();
    let last = s.requests.last().map_or(0.0, |r| s.send_at_s(r));
    println!(
        "{} requests over {:.1} s (after --speed {}), {} prompt and {} completion tokens, \
         trace blocks of {} tokens (--token-scale {}), at most {} in flight",
        s.requests.len(),
        last,
        s.speed,
        prompt,
        output,
        s.scale.block(),
        s.scale.factor(),
        s.max_concurrency
    );
}
