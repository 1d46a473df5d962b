//! `kvstore generate`: one completion from a prompt or a messages file, streamed as plain
//! text or printed as JSON with token ids and timings, run as one request through an
//! [`Engine`] (the loop `serve` runs). Also the model selection shared by `chat` and
//! `bench generate`.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use engine::{
    Engine, EngineConfig, GenerateParams, LoadOptions, Model, Request, SamplingParams, Tokenizer,
};

/// The default model's file name under `models/` (fetched by scripts/setup.sh).
pub const DEFAULT_MODEL: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// Which model to load.
#[derive(clap::Args, Debug, Clone)]
pub struct ModelArgs {
    /// A .gguf file or a Hugging Face folder; default: $KVSTORE_MODEL, else
    /// models/SmolLM2-135M-Instruct.Q4_1.gguf of this checkout.
    #[arg(long, value_name = "PATH")]
    pub model: Option<PathBuf>,
    /// Keep weights as stored (quantized / bf16) instead of expanding them to f32, which is
    /// faster on CPU.
    #[arg(long)]
    pub keep_quantized: bool,
}

impl ModelArgs {
    /// The model path: the flag, $KVSTORE_MODEL, or the default model found near the
    /// executable or the working directory.
    pub fn path(&self) -> anyhow::Result<PathBuf> {
        if let Some(p) = &self.model {
            return Ok(p.clone());
        }
        if let Some(p) = std::env::var_os("KVSTORE_MODEL") {
            return Ok(PathBuf::from(p));
        }
        let mut roots: Vec<PathBuf> = Vec::new();
        if let Ok(exe) = std::env::current_exe() {
            roots.extend(exe.ancestors().skip(1).map(Path::to_path_buf));
        }
        if let Ok(cwd) = std::env::current_dir() {
            roots.extend(cwd.ancestors().map(Path::to_path_buf));
        }
        roots
            .iter()
            .map(|r| r.join("models").join(DEFAULT_MODEL))
            .find(|p| p.is_file())
            .with_context(|| {
                format!(
                    "no model given and the default model (models/{DEFAULT_MODEL}) is not here: \
                     run `bash scripts/setup.sh` to fetch it, or pass --model PATH \
                     (or set KVSTORE_MODEL)"
                )
            })
    }

    /// Loads the model and its tokenizer.
    pub fn load(&self) -> anyhow::Result<(Model, Tokenizer)> {
        let path = self.path()?;
        let options = LoadOptions {
            keep_as_stored: self.keep_quantized,
        };
        engine::load(&path, &options).with_context(|| format!("loading {}", path.display()))
    }
}

/// Sampling flags shared by `generate` and `chat`.
#[derive(clap::Args, Debug, Clone)]
pub struct SamplingArgs {
    /// Most tokens to generate.
    #[arg(long, default_value_t = 256)]
    pub max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, allow_negative_numbers = true, default_value_t = 0.0)]
    pub temperature: f32,
    /// Nucleus sampling: keep the most likely tokens up to this probability mass.
    #[arg(long, allow_negative_numbers = true, default_value_t = 1.0)]
    pub top_p: f32,
    /// Keep only the k most likely tokens (0: all).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Drop tokens below min-p × the top probability.
    #[arg(long, allow_negative_numbers = true, default_value_t = 0.0)]
    pub min_p: f32,
    /// Penalize recently seen tokens (1: off).
    #[arg(long, allow_negative_numbers = true, default_value_t = 1.0)]
    pub repetition_penalty: f32,
    /// Seed for reproducible sampling.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Stop when the text contains this (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
}

impl SamplingArgs {
    /// Validated generation parameters.
    pub fn params(&self) -> anyhow::Result<GenerateParams> {
        if self.max_tokens == 0 {
            bail!("--max-tokens must be at least 1");
        }
        let sampling = SamplingParams {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            seed: self.seed,
            ..SamplingParams::default()
        };
        sampling.validate()?;
        Ok(GenerateParams {
            max_tokens: self.max_tokens,
            stop: self.stop.clone(),
            sampling,
            ..GenerateParams::default()
        })
    }
}

/// Arguments of `kvstore generate`.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// The user message (or, with --raw, the whole prompt text).
    #[arg(
        long,
        conflicts_with = "messages",
        required_unless_present = "messages"
    )]
    prompt: Option<String>,
    /// A JSON file: an array of chat messages, or {"messages": [...], "tools": [...]}.
    #[arg(long, value_name = "FILE.json")]
    messages: Option<PathBuf>,
    /// Use the prompt text as is, without the chat template.
    #[arg(long, conflicts_with = "messages")]
    raw: bool,
    #[command(flatten)]
    sampling: SamplingArgs,
    #[command(flatten)]
    cache: crate::cache_args::CacheArgs,
    /// Print token ids, text, timings and the prefix-reuse report as JSON instead of
    /// streaming text.
    #[arg(long)]
    json: bool,
    /// With --json: also print the engine's step log (`engine_steps`: what each engine step
    /// decoded and prefilled), for tests and debugging.
    #[arg(long, hide = true, requires = "json")]
    step_log: bool,
}

/// Runs `kvstore generate`.
pub fn run(args: Args) -> anyhow::Result<()> {
    let params = args.sampling.params()?;
    let (model, tokenizer) = args.model.load()?;
    let prompt = match (&args.prompt, &args.messages) {
        (Some(text), _) if args.raw => tokenizer.encode(text, true)?,
        (Some(text), _) => {
            let messages = serde_json::json!([{"role": "user", "content": text}]).to_string();
            tokenizer.encode_chat(&messages, None, true)?
        }
        (None, Some(file)) => {
            let text = std::fs::read_to_string(file)
                .with_context(|| format!("reading {}", file.display()))?;
            let (messages, tools) = engine::chat_request_parts(&text)
                .with_context(|| format!("in {}", file.display()))?;
            tokenizer.encode_chat(&messages, tools.as_deref(), true)?
        }
        (None, None) => bail!("give --prompt TEXT or --messages FILE.json"),
    };
    let prefix = args.cache.open(&model, &tokenizer)?;
    let kv_budget = match &prefix {
        Some(_) => Some(args.cache.kv_budget_bytes()?),
        None => None,
    };
    let config = EngineConfig {
        step_log: if args.step_log { usize::MAX } else { 0 },
        ..crate::engine_run::config(kv_budget)
    };
    let engine = Engine::open(model, tokenizer, prefix, config)?;
    let mut stdout = std::io::stdout().lock();
    let mut write_failed = None;
    let request = Request::new(prompt, params);
    let done = crate::engine_run::complete(&engine, request, &mut |text| {
        if args.json {
            return true;
        }
        if let Err(err) = stdout
            .write_all(text.as_bytes())
            .and_then(|_| stdout.flush())
        {
            write_failed = Some(err);
            return false;
        }
        true
    })?;
    let steps = engine.step_log();
    engine
        .shutdown(false)
        .context("making the published blocks durable")?;
    log_report(&done.reuse);
    if let Some(err) = write_failed {
        if err.kind() == std::io::ErrorKind::BrokenPipe {
            return Ok(());
        }
        return Err(err.into());
    }
    if args.json {
        let mut report = serde_json::json!({
            "prompt_tokens": done.prompt_tokens,
            "tokens": done.tokens,
            "text": done.text,
            "finish_reason": done.finish_reason,
            "timings": done.timings,
            "cache": done.reuse,
        });
        if args.step_log {
            report["engine_steps"] = serde_json::to_value(&steps)?;
        }
        writeln!(stdout, "{}", serde_json::to_string_pretty(&report)?)?;
    } else {
        writeln!(stdout)?;
    }
    Ok(())
}

/// Logs what prefix reuse did, on stderr (the per-request report of `--json`, in brief).
fn log_report(r: &engine::ReuseReport) {
    if std::env::var_os("KVSTORE_QUIET").is_some() {
        return;
    }
    eprintln!(
        "[kvstore] prompt {} tokens, cached {} (device {}, RAM {}, SSD {}, remote {}), diverged at {}, TTFT {:.3}s = lookup {:.3}s + restore {:.3}s + prefill {:.3}s, published {} blocks",
        r.prompt_tokens,
        r.cached_tokens,
        r.cached_device_tokens,
        r.cached_ram_tokens,
        r.cached_ssd_tokens,
        r.cached_remote_tokens,
        r.diverged_at.map_or("-".to_string(), |d| d.to_string()),
        r.ttft_s,
        r.lookup_s,
        r.restore_s,
        r.prefill_s,
        r.published_blocks
    );
}
