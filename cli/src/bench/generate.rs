//! `kvstore bench generate`: prefill tok/s at several prompt lengths, decode tok/s and peak
//! memory of the engine (each request through an [`Engine`], as `kvstore generate` and
//! `serve` run them), beside mlx-lm run on the same weights and machine in the same run
//! (through the goldens venv's Python; see scripts/goldens/make_goldens.sh).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context};
use engine::{Engine, GenerateParams, Request, Tokenizer};

use crate::engine_run::{complete, config};
use crate::generate::{ModelArgs, DEFAULT_MODEL};

/// Arguments of `kvstore bench generate`.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt lengths to prefill, in tokens.
    #[arg(long, value_delimiter = ',', default_value = "512,2048")]
    prompt_lens: Vec<usize>,
    /// Tokens to decode after each prompt.
    #[arg(long, default_value_t = 64)]
    decode_tokens: usize,
    /// The Hugging Face folder mlx-lm loads; default: the model itself when it is a folder,
    /// else target/goldens/smollm2-hf (the default GGUF converted by make_goldens.sh).
    #[arg(long, value_name = "DIR")]
    mlx_lm_model: Option<PathBuf>,
    /// The Python with mlx-lm; default: .venv-goldens/bin/python of this checkout.
    #[arg(long, value_name = "PATH")]
    python: Option<PathBuf>,
    /// Tokens per prefill step of the engine (mlx-lm's side keeps its default, 2048);
    /// default: the device's (2,048 on a GPU, 512 on the CPU).
    #[arg(long)]
    prefill_chunk: Option<usize>,
    /// Only measure kvstore.
    #[arg(long)]
    skip_mlx_lm: bool,
}

#[derive(Debug, Default, Clone, serde::Deserialize, serde::Serialize)]
struct Row {
    prompt_tokens: usize,
    prefill_tok_per_s: f64,
    decode_tok_per_s: f64,
    peak_memory_bytes: usize,
    /// kvstore only: where a decode step's time went (medians over the request's
    /// decode-only steps), from the engine's step log.
    #[serde(skip)]
    steps: Option<StepSplit>,
}

/// Medians, in milliseconds, over a request's decode-only engine steps: queueing the step
/// (building its graph and handing it to the device), the thread's own CPU time within
/// that, and reading the previous step's picks (waiting for the device) and emitting them.
/// Queueing near the whole step says the host bounds decode; reading, the device.
#[derive(Debug, Clone, Copy)]
struct StepSplit {
    launch_ms: f64,
    launch_cpu_ms: f64,
    build_ms: f64,
    read_ms: f64,
    step_ms: f64,
    /// Mean of the whole step: above the median when some steps take much longer.
    step_mean_ms: f64,
    /// The three slowest decode steps, slowest first: (whole step, queueing it, building
    /// its graph, reading the picks before), ms.
    slowest: [(f64, f64, f64, f64); 3],
}

impl StepSplit {
    fn of(steps: &[engine::StepRecord]) -> Option<Self> {
        let decode: Vec<&engine::StepRecord> = steps
            .iter()
            .filter(|s| !s.decoded.is_empty() && s.prefilled.is_none())
            .collect();
        let median = |f: &dyn Fn(&engine::StepRecord) -> u64| {
            let mut v: Vec<u64> = decode.iter().map(|s| f(s)).collect();
            v.sort_unstable();
            v.get(v.len() / 2).map(|&us| us as f64 / 1e3)
        };
        let total: u64 = decode.iter().map(|s| s.step_us).sum();
        let mut by_time = decode.clone();
        by_time.sort_unstable_by_key(|s| std::cmp::Reverse(s.step_us));
        let ms = |us: u64| us as f64 / 1e3;
        let mut slowest = [(0.0, 0.0, 0.0, 0.0); 3];
        for (out, s) in slowest.iter_mut().zip(&by_time) {
            *out = (
                ms(s.step_us),
                ms(s.launch_us),
                ms(s.build_us),
                ms(s.emit_us),
            );
        }
        Some(Self {
            launch_ms: median(&|s| s.launch_us)?,
            launch_cpu_ms: median(&|s| s.launch_cpu_us)?,
            build_ms: median(&|s| s.build_us)?,
            read_ms: median(&|s| s.emit_us)?,
            step_ms: median(&|s| s.step_us)?,
            step_mean_ms: total as f64 / decode.len() as f64 / 1e3,
            slowest,
        })
    }
}

fn prompt(tokenizer: &Tokenizer, n: usize) -> anyhow::Result<Vec<u32>> {
    let base = tokenizer.encode(
        &"The quick brown fox jumps over the lazy dog. ".repeat(400),
        false,
    )?;
    Ok(base.iter().copied().cycle().take(n).collect())
}

/// The engine's side: every request through an [`Engine`] (the loop `serve` runs), one at
/// a time, as `kvstore generate` runs them.
fn ours(engine: &Engine, args: &Args) -> anyhow::Result<Vec<Row>> {
    let tokenizer = engine.tokenizer();
    let params = GenerateParams {
        max_tokens: args.decode_tokens,
        stop_at_eos: false,
        context_limit: Some(usize::MAX),
        prefill_chunk: args
            .prefill_chunk
            .unwrap_or_else(engine::default_prefill_chunk),
        ..GenerateParams::default()
    };
    // Warm-up, as the mlx-lm side does.
    let warm = GenerateParams {
        max_tokens: 4,
        ..params.clone()
    };
    let run = |prompt: Vec<u32>, params: &GenerateParams| {
        // Peak memory per request: the engine reports the process's peak at its end.
        mlx::reset_peak_memory()?;
        complete(engine, Request::new(prompt, params.clone()), &mut |_| true)
    };
    run(prompt(tokenizer, 16)?, &warm)?;
    let mut rows = Vec::new();
    for &n in &args.prompt_lens {
        let before = engine.step_log().len();
        let done = run(prompt(tokenizer, n)?, &params)?;
        let log = engine.step_log();
        rows.push(Row {
            prompt_tokens: n,
            prefill_tok_per_s: done.timings.prefill_tok_per_s,
            decode_tok_per_s: done.timings.decode_tok_per_s,
            peak_memory_bytes: done.timings.peak_memory_bytes,
            steps: StepSplit::of(log.get(before..).unwrap_or_default()),
        });
    }
    Ok(rows)
}

fn checkout_file(rel: &str) -> Option<PathBuf> {
    let mut roots: Vec<PathBuf> = Vec::new();
    if let Ok(exe) = std::env::current_exe() {
        roots.extend(exe.ancestors().skip(1).map(Path::to_path_buf));
    }
    if let Ok(cwd) = std::env::current_dir() {
        roots.extend(cwd.ancestors().map(Path::to_path_buf));
    }
    roots.iter().map(|r| r.join(rel)).find(|p| p.exists())
}

fn theirs(model_path: &Path, args: &Args) -> anyhow::Result<Vec<Row>> {
    let python = match &args.python {
        Some(p) => p.clone(),
        None => checkout_file(".venv-goldens/bin/python").context(
            "mlx-lm's Python is missing: run `bash scripts/goldens/make_goldens.sh` once (it makes \
             .venv-goldens with mlx-lm and converts the default model), or pass --skip-mlx-lm",
        )?,
    };
    let folder = match &args.mlx_lm_model {
        Some(d) => d.clone(),
        None if model_path.is_dir() => model_path.to_path_buf(),
        None if model_path.file_name().is_some_and(|f| f == DEFAULT_MODEL) => {
            checkout_file("target/goldens/smollm2-hf").context(
                "target/goldens/smollm2-hf is missing: run `bash scripts/goldens/make_goldens.sh` \
                 (it converts the default GGUF for mlx-lm), or pass --mlx-lm-model DIR",
            )?
        }
        None => bail!(
            "mlx-lm cannot read {}: pass --mlx-lm-model DIR",
            model_path.display()
        ),
    };
    super::peer_blas::warn_if_reference_blas(&python);
    let script = checkout_file("scripts/goldens/bench_mlx_lm.py")
        .context("scripts/goldens/bench_mlx_lm.py not found")?;
    let lens: Vec<String> = args.prompt_lens.iter().map(|n| n.to_string()).collect();
    let mut cmd = Command::new(&python);
    super::peer_env(&mut cmd);
    let out = cmd
        .arg(&script)
        .arg(&folder)
        .arg(lens.join(","))
        .arg(args.decode_tokens.to_string())
        .output()
        .with_context(|| format!("running {}", python.display()))?;
    if !out.status.success() {
        bail!(
            "mlx-lm failed ({}):\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).context("reading mlx-lm's report"))
        .collect()
}

/// Runs the benchmark and prints a table (kvstore, mlx-lm, ratio).
pub fn run(args: Args) -> anyhow::Result<()> {
    if args.prompt_lens.is_empty() || args.prompt_lens.contains(&0) || args.decode_tokens < 2 {
        bail!("--prompt-lens must be positive and --decode-tokens at least 2");
    }
    let path = args.model.path()?;
    let (model, tokenizer) = args.model.load()?;
    println!(
        "bench generate: {} ({}, f32 weights: {}), decode {} tokens, MLX {}",
        path.display(),
        model.info().architecture,
        !args.model.keep_quantized,
        args.decode_tokens,
        mlx::version()?
    );
    // Every step logged: the decode split below comes from it.
    let engine = Engine::open(
        model,
        tokenizer,
        None,
        engine::EngineConfig {
            step_log: usize::MAX,
            ..config(None)
        },
    )?;
    let ours = ours(&engine, &args)?;
    drop(engine);
    let theirs = if args.skip_mlx_lm {
        Vec::new()
    } else {
        theirs(&path, &args)?
    };
    println!(
        "{:>7}  {:>22}  {:>22}  {:>20}",
        "prompt", "prefill tok/s (ratio)", "decode tok/s (ratio)", "peak MiB"
    );
    for (i, o) in ours.iter().enumerate() {
        let t = theirs.get(i).cloned().unwrap_or_default();
        let ratio = |a: f64, b: f64| {
            if b > 0.0 {
                format!("{:.2}x", a / b)
            } else {
                "-".into()
            }
        };
        let mib = |b: usize| b as f64 / (1 << 20) as f64;
        println!(
            "{:>7}  {:>8.1} vs {:>6.1} {:>5}  {:>8.2} vs {:>6.2} {:>5}  {:>7.0} vs {:>7.0}",
            o.prompt_tokens,
            o.prefill_tok_per_s,
            t.prefill_tok_per_s,
            ratio(o.prefill_tok_per_s, t.prefill_tok_per_s),
            o.decode_tok_per_s,
            t.decode_tok_per_s,
            ratio(o.decode_tok_per_s, t.decode_tok_per_s),
            mib(o.peak_memory_bytes),
            mib(t.peak_memory_bytes),
        );
    }
    println!("(kvstore vs mlx-lm; ratio > 1 means kvstore is faster)");
    println!(
        "kvstore's decode steps (medians, ms): queue the step (its CPU; building its graph), read \
         the picks before, the whole step (its mean), 1 / decode tok/s"
    );
    println!(
        "(a pipelined loop splits the device's time between queueing one step and reading the \
         last, so the median step can be far below it: the mean is the step; \
         KVSTORE_DECODE_WAIT=drained times each step alone)"
    );
    for o in &ours {
        if let Some(s) = o.steps {
            println!(
                "{:>7}  queue {:>6.2} ({:>6.2}; {:>6.2})  read {:>6.2}  step {:>6.2} ({:>6.2})  per token {:>6.2}",
                o.prompt_tokens,
                s.launch_ms,
                s.launch_cpu_ms,
                s.build_ms,
                s.read_ms,
                s.step_ms,
                s.step_mean_ms,
                1e3 / o.decode_tok_per_s.max(f64::MIN_POSITIVE)
            );
            let slow: Vec<String> = s
                .slowest
                .iter()
                .map(|(step, queue, build, read)| {
                    format!("{step:.1} (queue {queue:.1}, build {build:.1}, read {read:.1})")
                })
                .collect();
            println!("{:>7}  slowest steps: {}", "", slow.join(", "));
        }
    }
    Ok(())
}
