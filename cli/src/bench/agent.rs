//! `kvstore bench agent`: the multi-turn agent session (the demo's transcript) served five
//! ways on the same model in the same run: no cache; reuse as a user gets it (the device
//! tier, with the host tiers behind it); host-RAM reuse (the device tier off, so every hit
//! is restored from host RAM); SSD-only reuse (the store reopened before every turn, so
//! nothing is on the device or in RAM); and mlx-lm with its prompt cache
//! (scripts/bench/mlx_lm_agent.py). For hybrid models (LFM2), `ssd-no-snapshots` is the SSD
//! arm with `--state-every 0`: blocks without layer-state snapshots, which a hybrid cannot
//! resume from. Writes JSON and an SVG plot.

use std::cell::RefCell;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result};
use engine::{Fit, GenerateParams, KvTiers, Request, RestoreEstimates, ReuseConfig, ReuseReport};
use serde::Serialize;
use store::StoreConfig;

use crate::agent_session;
use crate::engine_run::ModelSlot;
use crate::generate::ModelArgs;

/// Arguments of `kvstore bench agent`.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Turns of the session.
    #[arg(long, default_value_t = agent_session::DEFAULT_TURNS)]
    turns: usize,
    /// Tokens generated per turn.
    #[arg(long, default_value_t = 8)]
    max_tokens: usize,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 32)]
    block_size: usize,
    /// Arms to run, comma-separated: cold, device, ram, ssd, ssd-no-snapshots,
    /// ssd-whole-windows (the SSD arm storing every plane of window layers), mlx-lm.
    #[arg(
        long,
        default_value = "cold,device,ram,ssd,mlx-lm",
        value_delimiter = ','
    )]
    arms: Vec<String>,
    /// Hybrid models: blocks between layer-state snapshots in the reuse arms (the
    /// ssd-no-snapshots arm uses 0).
    #[arg(
        long,
        value_name = "N|auto",
        default_value = "auto",
        value_parser = crate::cache_args::parse_state_every
    )]
    state_every: crate::cache_args::StateEvery,
    /// Device memory for all KV of the device arm (live and resident).
    #[arg(long, value_name = "SIZE", default_value = "4GiB")]
    kv_budget: String,
    /// Bound on MLX's buffer cache, or `auto` (as `serve`'s: the KV budget on the CPU,
    /// 1 GiB on a GPU).
    #[arg(long, value_name = "SIZE|auto", default_value = "auto")]
    mlx_cache_limit: String,
    /// The model as an mlx-lm folder (made by scripts/goldens/make_goldens.sh from the
    /// same GGUF).
    #[arg(long, default_value = "target/goldens/smollm2-hf")]
    mlx_lm_model: PathBuf,
    /// Python with mlx-lm (the venv scripts/goldens/make_goldens.sh creates).
    #[arg(long, default_value = ".venv-goldens/bin/python")]
    python: PathBuf,
    /// Instead of the agent session, two turns of seeded random token ids: a prefix of
    /// PREFIX tokens, then the same prefix plus NEW tokens (`--synthetic 32768,64`: the
    /// TTFT of a 32K-token cached prefix plus 64 new tokens, against cold).
    #[arg(long, value_name = "PREFIX,NEW", value_parser = parse_synthetic)]
    synthetic: Option<(usize, usize)>,
    /// Runs of the in-process arms, each over fresh stores, interleaved turn by turn as
    /// one run is; each turn of an arm reports its run with the median TTFT (all runs'
    /// TTFTs beside it), so that a per-turn ratio is not one draw of a noisy machine. The
    /// mlx-lm arm runs once.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    repeat: u32,
    /// Where to write <out>.json and <out>.svg.
    #[arg(long, default_value = "docs/bench-agent")]
    out: PathBuf,
}

fn parse_synthetic(s: &str) -> std::result::Result<(usize, usize), String> {
    let (a, b) = s
        .split_once(',')
        .ok_or_else(|| format!("{s:?}: expected PREFIX,NEW (e.g. 32768,64)"))?;
    let n = |x: &str| {
        x.trim()
            .parse::<usize>()
            .map_err(|e| format!("{x:?} in {s:?}: {e}"))
    };
    let (prefix, new) = (n(a)?, n(b)?);
    if prefix == 0 || new == 0 {
        return Err(format!("{s:?}: both sizes must be at least 1"));
    }
    Ok((prefix, new))
}

/// One turn of one arm.
#[derive(Serialize, Clone, Debug, Default)]
struct TurnResult {
    prompt_tokens: usize,
    cached_tokens: usize,
    cached_device_tokens: usize,
    ttft_s: f64,
    lookup_s: f64,
    restore_s: f64,
    /// Of `restore_s`, moving the loaded blocks into device memory.
    import_s: f64,
    prefill_s: f64,
    ssd_bytes_written: u64,
    /// SSD arms: bytes of block files on SSD after the turn.
    ssd_stored_bytes: u64,
    /// SSD arms: block files read in the turn (the request's restore and any background
    /// probe of the SSD), and the seconds the reading threads spent opening, reading and
    /// verifying them: what of the loads' wall time ([`Self::ssd_samples`]) the disk and
    /// the checksums took.
    #[serde(skip_serializing_if = "Option::is_none")]
    ssd_reads: Option<(u64, f64)>,
    /// SSD arms: the store's loads of the turn by phase, microseconds summed over loads
    /// (store's `LoadPhases`): where a load's time outside its file reads went.
    #[serde(skip_serializing_if = "Option::is_none")]
    ssd_load_phases: Option<store::LoadPhases>,
    /// SSD arms: the cost model's SSD samples after the turn, oldest first, each (blocks,
    /// seconds of the load).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    ssd_samples: Vec<(usize, f64)>,
    /// In-process arms: the token ids generated.
    generated: Vec<u32>,
    /// Arms with a cache: the cost model's estimates after the turn.
    #[serde(skip_serializing_if = "Option::is_none")]
    estimates: Option<TurnEstimates>,
    /// With `--repeat`: the turn's TTFT in every run, in run order (this result is the
    /// run with the median).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    ttft_runs_s: Vec<f64>,
}

/// What the restore-or-recompute model estimated after a turn (engine/src/cost_model.rs).
#[derive(Serialize, Clone, Copy, Debug)]
struct TurnEstimates {
    prefill: Option<Fit>,
    #[serde(flatten)]
    restore: RestoreEstimates,
}

impl TurnEstimates {
    fn of(tiers: &KvTiers) -> Self {
        TurnEstimates {
            prefill: tiers.prefill_estimate(),
            restore: tiers.restore_estimates(),
        }
    }
}

#[derive(Serialize)]
struct Arm {
    name: String,
    turns: Vec<TurnResult>,
    total_ttft_s: f64,
    /// Share of prompt tokens restored instead of computed, turns 2 onwards.
    reused_from_turn_2: f64,
}

fn arm(name: &str, turns: Vec<TurnResult>) -> Arm {
    let total = turns.iter().map(|t| t.ttft_s).sum();
    let (reused, prompts) = turns.iter().skip(1).fold((0, 0), |(r, p), t| {
        (r + t.cached_tokens, p + t.prompt_tokens)
    });
    Arm {
        name: name.into(),
        turns,
        total_ttft_s: total,
        reused_from_turn_2: reused as f64 / prompts.max(1) as f64,
    }
}

/// The arms of several runs of the same arms (`--repeat`): each turn of each arm is its
/// run with the median TTFT (the lower of the two middle ones for an even count), with
/// every run's TTFT recorded beside it.
fn median_of_runs(runs: Vec<Vec<Arm>>) -> Vec<Arm> {
    let Some(first) = runs.first() else {
        return Vec::new();
    };
    let names: Vec<String> = first.iter().map(|a| a.name.clone()).collect();
    let mut per_arm: Vec<Vec<Vec<TurnResult>>> = vec![Vec::new(); names.len()];
    for run in runs {
        for (i, a) in run.into_iter().enumerate().take(names.len()) {
            per_arm[i].push(a.turns);
        }
    }
    names
        .iter()
        .zip(per_arm)
        .map(|(name, runs)| {
            let turns = runs.iter().map(Vec::len).min().unwrap_or(0);
            let median = (0..turns)
                .map(|t| {
                    let mut of_turn: Vec<&TurnResult> = runs.iter().map(|r| &r[t]).collect();
                    let ttfts: Vec<f64> = of_turn.iter().map(|r| r.ttft_s).collect();
                    of_turn.sort_by(|a, b| a.ttft_s.total_cmp(&b.ttft_s));
                    let mut pick = of_turn[(of_turn.len() - 1) / 2].clone();
                    if ttfts.len() > 1 {
                        pick.ttft_runs_s = ttfts;
                    }
                    pick
                })
                .collect();
            arm(name, median)
        })
        .collect()
}

/// What one turn of an in-process arm gave: the generated ids and the reuse report.
type Turn = (Vec<u32>, ReuseReport);

fn from_report((generated, r): &Turn, written: u64) -> TurnResult {
    TurnResult {
        generated: generated.clone(),
        prompt_tokens: r.prompt_tokens,
        cached_tokens: r.cached_tokens,
        cached_device_tokens: r.cached_device_tokens,
        ttft_s: r.ttft_s,
        lookup_s: r.lookup_s,
        restore_s: r.restore_s,
        import_s: r.import_s,
        prefill_s: r.prefill_s,
        ssd_bytes_written: written,
        ssd_stored_bytes: 0,
        ssd_reads: None,
        ssd_load_phases: None,
        ssd_samples: Vec::new(),
        estimates: None,
        ttft_runs_s: Vec::new(),
    }
}

/// Whether two arms generated the same tokens at every turn both ran.
fn same_output(a: &Arm, b: &Arm) -> bool {
    a.turns
        .iter()
        .zip(&b.turns)
        .all(|(x, y)| x.generated == y.generated)
}

struct Ctx<'a> {
    /// The model, lent to one engine per turn of each arm (an engine over that arm's
    /// tiers, the loop `serve` runs).
    slot: RefCell<ModelSlot>,
    prompts: &'a [Vec<u32>],
    params: GenerateParams,
    block_size: usize,
    kv_budget: u64,
    state_every: Option<usize>,
}

/// Which arms run in process.
#[derive(Clone, Copy)]
struct InProcess {
    cold: bool,
    device: bool,
    ram: bool,
    ssd: bool,
    ssd_no_snapshots: bool,
    ssd_whole_windows: bool,
}

impl Ctx<'_> {
    fn config(&self, dir: &Path, kv_budget: u64) -> ReuseConfig {
        self.config_every(dir, kv_budget, self.state_every)
    }

    fn config_every(&self, dir: &Path, kv_budget: u64, state_every: Option<usize>) -> ReuseConfig {
        self.config_with(dir, kv_budget, state_every, true)
    }

    fn config_with(
        &self,
        dir: &Path,
        kv_budget: u64,
        state_every: Option<usize>,
        window_trim: bool,
    ) -> ReuseConfig {
        ReuseConfig {
            store: StoreConfig::default()
                .root(dir)
                .ram_budget(4 << 30)
                .ssd_budget(16 << 30),
            block_size: self.block_size,
            kv_budget_bytes: kv_budget,
            state_every,
            window_trim,
            ..ReuseConfig::default()
        }
    }

    /// One turn through an engine over `prefix`, whose tiers come back with the result.
    fn turn(&self, prefix: Option<KvTiers>, prompt: &[u32]) -> Result<(Turn, Option<KvTiers>)> {
        // The tiers' device budget: an engine with another one would empty the device tier.
        let config = crate::engine_run::config(Some(self.kv_budget));
        let request = Request::new(prompt.to_vec(), self.params.clone());
        let (done, prefix) = self
            .slot
            .borrow_mut()
            .run(prefix, config, request, &mut |_| true)?;
        Ok(((done.tokens, done.reuse), prefix))
    }

    fn open_tiers(&self, config: ReuseConfig) -> Result<KvTiers> {
        let slot = self.slot.borrow();
        Ok(KvTiers::open(slot.model()?, slot.tokenizer()?, config)?)
    }

    /// Runs the selected in-process arms turn by turn, interleaved, so that load on this
    /// shared machine falls on every arm alike.
    fn interleaved(&self, on: InProcess) -> Result<Vec<Arm>> {
        let InProcess {
            cold,
            device,
            ram,
            ssd,
            ssd_no_snapshots,
            ssd_whole_windows,
        } = on;
        let dirs = [
            tempfile::tempdir()?,
            tempfile::tempdir()?,
            tempfile::tempdir()?,
            tempfile::tempdir()?,
            tempfile::tempdir()?,
        ];
        let open = |on: bool, dir: &Path| -> Result<Option<KvTiers>> {
            Ok(match on {
                true => Some(self.open_tiers(self.config(dir, self.kv_budget))?),
                false => None,
            })
        };
        let mut device_pc = open(device, dirs[0].path())?;
        let mut ram_pc = open(ram, dirs[1].path())?;
        let (mut c, mut d, mut r) = (Vec::new(), Vec::new(), Vec::new());
        let (mut s, mut s0, mut sw) = (Vec::new(), Vec::new(), Vec::new());
        for (i, p) in self.prompts.iter().enumerate() {
            eprintln!("turn {} ({} prompt tokens)", i + 1, p.len());
            if cold {
                c.push(from_report(&self.turn(None, p)?.0, 0));
            }
            for (pc, out, keep_resident) in
                [(&mut device_pc, &mut d, true), (&mut ram_pc, &mut r, false)]
            {
                let Some(tiers) = pc.take() else {
                    continue;
                };
                if !keep_resident {
                    // An emptied device tier: every hit comes from host RAM.
                    tiers.set_kv_budget(self.kv_budget)?;
                }
                let before = tiers.stats().bytes_written;
                let (rep, back) = self.turn(Some(tiers), p)?;
                let back = back.context("the engine kept the tiers")?;
                let mut t = from_report(&rep, back.stats().bytes_written - before);
                t.estimates = Some(TurnEstimates::of(&back));
                out.push(t);
                *pc = Some(back);
            }
            for (on, dir, every, trim, out) in [
                (ssd, &dirs[2], self.state_every, true, &mut s),
                (ssd_no_snapshots, &dirs[3], Some(0), true, &mut s0),
                (
                    ssd_whole_windows,
                    &dirs[4],
                    self.state_every,
                    false,
                    &mut sw,
                ),
            ] {
                if on {
                    // A new store handle each turn: nothing on the device or in RAM, as after
                    // a restart (the cost model is read back from the store, as after one).
                    let config = self.config_with(dir.path(), self.kv_budget, every, trim);
                    let pc = self.open_tiers(config)?;
                    let (rep, pc) = self.turn(Some(pc), p)?;
                    let pc = pc.context("the engine kept the tiers")?;
                    pc.flush()?;
                    let mut t = from_report(&rep, pc.stats().bytes_written);
                    let stats = pc.stats();
                    t.ssd_stored_bytes = stats.ssd_bytes;
                    t.ssd_reads = Some((stats.ssd_hits, stats.ssd_read_us as f64 / 1e6));
                    t.ssd_load_phases = Some(stats.load_phases);
                    t.ssd_samples = pc.ssd_samples();
                    t.estimates = Some(TurnEstimates::of(&pc));
                    out.push(t);
                }
            }
        }
        let mut arms = Vec::new();
        for (on, name, turns) in [
            (cold, "no cache", c),
            (device, "device reuse", d),
            (ram, "RAM reuse", r),
            (ssd, "SSD reuse", s),
            (ssd_no_snapshots, "SSD reuse, no state snapshots", s0),
            (ssd_whole_windows, "SSD reuse, whole window layers", sw),
        ] {
            if on {
                arms.push(arm(name, turns));
            }
        }
        Ok(arms)
    }

    fn mlx_lm(&self, args: &Args) -> Result<Option<Arm>> {
        if !args.python.exists() || !args.mlx_lm_model.join("config.json").exists() {
            eprintln!(
                "mlx-lm arm skipped: {} or {} is missing; run `bash scripts/goldens/make_goldens.sh` to create both",
                args.python.display(),
                args.mlx_lm_model.display()
            );
            return Ok(None);
        }
        let file = tempfile::NamedTempFile::new()?;
        let transcript =
            serde_json::json!({"max_tokens": self.params.max_tokens, "prompts": self.prompts});
        std::fs::write(file.path(), serde_json::to_vec(&transcript)?)?;
        eprintln!("mlx-lm: {} turns", self.prompts.len());
        super::peer_blas::warn_if_reference_blas(&args.python);
        let mut cmd = Command::new(&args.python);
        super::peer_env(&mut cmd);
        cmd.arg("scripts/bench/mlx_lm_agent.py")
            .arg(&args.mlx_lm_model)
            .arg(file.path());
        if args.model.keep_quantized {
            cmd.arg("stored");
        }
        let out = cmd
            .output()
            .context("running scripts/bench/mlx_lm_agent.py")?;
        if !out.status.success() {
            anyhow::bail!(
                "mlx-lm arm failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let turns = String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l)?;
                Ok(TurnResult {
                    prompt_tokens: v["prompt_tokens"].as_u64().unwrap_or(0) as usize,
                    cached_tokens: v["cached_tokens"].as_u64().unwrap_or(0) as usize,
                    ttft_s: v["ttft_s"].as_f64().unwrap_or(f64::NAN),
                    ..TurnResult::default()
                })
            })
            .collect::<Result<_>>()?;
        Ok(Some(arm("mlx-lm prompt cache", turns)))
    }
}

/// An SVG line chart of TTFT per turn, one line per arm.
fn svg(arms: &[Arm]) -> String {
    let (w, h, pad) = (720.0, 400.0, 60.0);
    let turns = arms.iter().map(|a| a.turns.len()).max().unwrap_or(1).max(2);
    let ymax = arms
        .iter()
        .flat_map(|a| a.turns.iter().map(|t| t.ttft_s))
        .filter(|v| v.is_finite())
        .fold(0.0f64, f64::max)
        .max(1e-3)
        * 1.1;
    let x = |i: usize| pad + (w - 2.0 * pad) * i as f64 / (turns - 1) as f64;
    let y = |v: f64| h - pad - (h - 2.0 * pad) * v / ymax;
    let colors = [
        "#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b",
    ];
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{}\" y=\"20\" text-anchor=\"middle\" font-size=\"14\">kvstore bench agent: time to first token per turn</text>\n\
         <line x1=\"{pad}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/>\n<line x1=\"{pad}\" y1=\"{pad}\" x2=\"{pad}\" y2=\"{}\" stroke=\"black\"/>\n",
        w / 2.0,
        h - pad,
        w - pad,
        h - pad,
        h - pad
    );
    for k in 0..=4 {
        let v = ymax * k as f64 / 4.0;
        s += &format!(
            "<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{v:.1}s</text>\n",
            pad - 6.0,
            y(v) + 4.0
        );
    }
    for i in 0..turns {
        s += &format!(
            "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n",
            x(i),
            h - pad + 16.0,
            i + 1
        );
    }
    s += &format!(
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">turn</text>\n",
        w / 2.0,
        h - 18.0
    );
    for (a, color) in arms.iter().zip(colors.iter().cycle()) {
        let points: Vec<String> = a
            .turns
            .iter()
            .enumerate()
            .filter(|(_, t)| t.ttft_s.is_finite())
            .map(|(i, t)| format!("{:.1},{:.1}", x(i), y(t.ttft_s)))
            .collect();
        s += &format!(
            "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"2\" points=\"{}\"/>\n",
            points.join(" ")
        );
    }
    for (k, (a, color)) in arms.iter().zip(colors.iter().cycle()).enumerate() {
        let ly = pad + 16.0 * k as f64;
        s += &format!(
            "<rect x=\"{}\" y=\"{}\" width=\"12\" height=\"4\" fill=\"{color}\"/><text x=\"{}\" y=\"{}\">{} (total {:.1}s)</text>\n",
            pad + 12.0,
            ly - 4.0,
            pad + 30.0,
            ly,
            a.name,
            a.total_ttft_s
        );
    }
    s + "</svg>\n"
}

/// Runs the agent benchmark.
pub fn run(args: Args) -> Result<()> {
    let (model, tokenizer) = args.model.load()?;
    let prompts: Vec<Vec<u32>> = match args.synthetic {
        Some((prefix, new)) => {
            let vocab = model.info().vocab_size as u64;
            // xorshift over a fixed seed: the same ids in every run and process.
            let mut x = 0x9E37_79B9_7F4A_7C15u64;
            let ids: Vec<u32> = (0..prefix + new)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (x % vocab.max(1)) as u32
                })
                .collect();
            vec![ids[..prefix].to_vec(), ids]
        }
        None => {
            let tools = serde_json::to_string(&agent_session::tools())?;
            (0..args.turns)
                .map(|t| {
                    let m = serde_json::to_string(&agent_session::messages(t))?;
                    Ok(tokenizer.encode_chat(&m, Some(&tools), true)?)
                })
                .collect::<Result<_>>()?
        }
    };
    let ctx = Ctx {
        slot: RefCell::new(ModelSlot::new(model, tokenizer)),
        prompts: &prompts,
        params: GenerateParams {
            max_tokens: args.max_tokens,
            ..GenerateParams::default()
        },
        block_size: args.block_size,
        kv_budget: crate::cache_args::parse_size(&args.kv_budget).context("--kv-budget")?,
        state_every: args.state_every.0,
    };
    crate::cache_args::apply_mlx_cache_limit(&args.mlx_cache_limit, ctx.kv_budget)?;
    // Warm-up (weights paged in, kernels ready), as every arm would otherwise pay it once.
    ctx.turn(None, &prompts[0][..prompts[0].len().min(64)])?;
    // Peak device memory of the arms below, all turns (each engine reports the process's).
    const ARMS: [&str; 7] = [
        "cold",
        "device",
        "ram",
        "ssd",
        "ssd-no-snapshots",
        "ssd-whole-windows",
        "mlx-lm",
    ];
    for name in &args.arms {
        if !ARMS.contains(&name.as_str()) {
            anyhow::bail!("unknown arm {name:?}: use {}", ARMS.join(", "));
        }
    }
    let has = |a: &str| args.arms.iter().any(|n| n == a);
    mlx::clear_cache()?;
    // What stays allocated with no request in flight: the weights, mostly.
    let baseline_bytes = mlx::active_memory()?;
    mlx::reset_peak_memory()?;
    let on = InProcess {
        cold: has("cold"),
        device: has("device"),
        ram: has("ram"),
        ssd: has("ssd"),
        ssd_no_snapshots: has("ssd-no-snapshots"),
        ssd_whole_windows: has("ssd-whole-windows"),
    };
    let runs = (0..args.repeat)
        .map(|r| {
            if args.repeat > 1 {
                eprintln!("run {} of {}", r + 1, args.repeat);
            }
            ctx.interleaved(on)
        })
        .collect::<Result<Vec<_>>>()?;
    let mut arms = median_of_runs(runs);
    let peak_device_bytes = mlx::peak_memory()?;
    if has("mlx-lm") {
        // The buffers MLX cached for the in-process arms go back first: on a GPU the child
        // allocates from the same device memory (docs/cuda.md).
        mlx::clear_cache()?;
        // A failing peer arm must not lose the in-process arms' numbers.
        match ctx.mlx_lm(&args) {
            Ok(arm) => arms.extend(arm),
            Err(e) => eprintln!("mlx-lm arm failed, reporting the other arms: {e:#}"),
        }
    }
    println!(
        "{:>4} {:>7} {}",
        "turn",
        "prompt",
        arms.iter()
            .map(|a| format!("{:>22}", a.name))
            .collect::<String>()
    );
    for (i, p) in prompts.iter().enumerate() {
        let cells: String = arms
            .iter()
            .map(|a| match a.turns.get(i) {
                Some(t) => format!("{:>13.2}s ({:>5})", t.ttft_s, t.cached_tokens),
                None => format!("{:>22}", "-"),
            })
            .collect();
        println!("{:>4} {:>7} {cells}", i + 1, p.len());
    }
    println!("(TTFT, with cached prompt tokens in parentheses)");
    for a in &arms {
        println!(
            "{:>20}: total TTFT {:>8.2}s, {:>5.1}% of prompt tokens reused from turn 2",
            a.name,
            a.total_ttft_s,
            100.0 * a.reused_from_turn_2
        );
    }
    let stored = |a: &Arm| a.turns.last().map_or(0, |t| t.ssd_stored_bytes);
    let whole = arms
        .iter()
        .find(|a| a.name == "SSD reuse, whole window layers")
        .map(stored);
    let whole_arm = arms
        .iter()
        .find(|a| a.name == "SSD reuse, whole window layers");
    for a in arms.iter().filter(|a| stored(a) > 0) {
        let ratio = whole.zip(whole_arm).map_or(String::new(), |(w, wa)| {
            format!(
                " ({:.3}x whole window layers; {} generated tokens)",
                stored(a) as f64 / w as f64,
                if same_output(a, wa) { "same" } else { "OTHER" }
            )
        });
        println!(
            "{:>20}: {} bytes stored on SSD after the last turn{ratio}",
            a.name,
            stored(a)
        );
    }
    if let Some(cold) = arms.iter().find(|a| a.name == "no cache") {
        for a in arms.iter().filter(|a| a.name != "no cache") {
            let worst = a
                .turns
                .iter()
                .zip(&cold.turns)
                .map(|(t, c)| t.ttft_s / c.ttft_s)
                .fold(0.0f64, f64::max);
            println!(
                "{:>20}: {:.3} of the no-cache total; worst turn {:.2}x no cache",
                a.name,
                a.total_ttft_s / cold.total_ttft_s,
                worst
            );
        }
    }
    if let Some(peer) = arms.iter().find(|a| a.name == "mlx-lm prompt cache") {
        for a in arms.iter().filter(|a| a.name.ends_with("reuse")) {
            println!(
                "{:>20}: {:.3} of mlx-lm's total",
                a.name,
                a.total_ttft_s / peer.total_ttft_s
            );
        }
    }
    println!(
        "peak MLX memory of the in-process arms: {:.1} MiB, {:.1} MiB above the {:.1} MiB held \
         before them (KV budget {})",
        peak_device_bytes as f64 / 1048576.0,
        peak_device_bytes.saturating_sub(baseline_bytes) as f64 / 1048576.0,
        baseline_bytes as f64 / 1048576.0,
        args.kv_budget
    );
    let json = serde_json::json!({
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "model": args.model.path()?.display().to_string(),
        "turns": prompts.len(),
        "max_tokens": args.max_tokens,
        "block_size": args.block_size,
        "state_every": args.state_every.0.map_or("auto".into(), |k| k.to_string()),
        "kv_budget": args.kv_budget,
        "peak_device_bytes": peak_device_bytes,
        "baseline_bytes": baseline_bytes,
        "prompt_tokens": prompts.iter().map(Vec::len).collect::<Vec<_>>(),
        "arms": arms,
    });
    if let Some(dir) = args.out.parent() {
        std::fs::create_dir_all(dir).ok();
    }
    let json_path = args.out.with_extension("json");
    let svg_path = args.out.with_extension("svg");
    std::fs::write(&json_path, serde_json::to_string_pretty(&json)?)
        .with_context(|| format!("writing {}", json_path.display()))?;
    std::fs::write(&svg_path, svg(&arms))
        .with_context(|| format!("writing {}", svg_path.display()))?;
    println!("wrote {} and {}", json_path.display(), svg_path.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(name: &str, ttfts: &[f64]) -> Arm {
        let turns = ttfts
            .iter()
            .enumerate()
            .map(|(i, &t)| TurnResult {
                ttft_s: t,
                cached_tokens: i * 10 + (t * 1000.0) as usize,
                prompt_tokens: 100,
                ..TurnResult::default()
            })
            .collect();
        arm(name, turns)
    }

    #[test]
    fn each_turn_reports_its_median_run_and_every_runs_ttft() {
        let runs = vec![
            vec![run("no cache", &[0.3, 0.1]), run("RAM reuse", &[0.2, 0.9])],
            vec![run("no cache", &[0.1, 0.2]), run("RAM reuse", &[0.4, 0.5])],
            vec![run("no cache", &[0.2, 0.3]), run("RAM reuse", &[0.3, 0.1])],
        ];
        let arms = median_of_runs(runs);
        assert_eq!(arms.len(), 2);
        let ttft = |a: &Arm| a.turns.iter().map(|t| t.ttft_s).collect::<Vec<_>>();
        assert_eq!(ttft(&arms[0]), vec![0.2, 0.2]);
        assert_eq!(ttft(&arms[1]), vec![0.3, 0.5]);
        // The whole median run's result, not only its TTFT.
        assert_eq!(arms[1].turns[1].cached_tokens, 10 + 500);
        assert_eq!(arms[1].turns[0].ttft_runs_s, vec![0.2, 0.4, 0.3]);
        assert!((arms[1].total_ttft_s - 0.8).abs() < 1e-12);
        // Two runs: the lower middle; one run: as it was, no run list.
        let two = median_of_runs(vec![
            vec![run("no cache", &[0.4])],
            vec![run("no cache", &[0.2])],
        ]);
        assert_eq!(ttft(&two[0]), vec![0.2]);
        let one = median_of_runs(vec![vec![run("no cache", &[0.4])]]);
        assert!(one[0].turns[0].ttft_runs_s.is_empty());
        assert!(median_of_runs(Vec::new()).is_empty());
    }
}
