//! `kvstore bench trace FILE`: replays a Mooncake-format request trace (docs/benchmarks.md,
//! "Trace replay"). Flags are read in two stages: [`Args`] as clap gives them, then
//! [`Settings`], validated.

use std::path::PathBuf;

use anyhow::{bail, Result};

mod parse;
mod scale;

use parse::{TraceRequest, Window};
use scale::TokenScale;

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
    /// Multiplies every length and the 512-token block by F (512 × F must be whole).
    #[arg(long, value_name = "F", default_value_t = 1.0)]
    token_scale: f64,
}

/// Validated settings of a run.
struct Settings {
    requests: Vec<TraceRequest>,
    window: Window,
    speed: f64,
    max_concurrency: usize,
    scale: TokenScale,
}

impl Settings {
    fn new(args: &Args) -> Result<Settings> {
        if !(args.speed.is_finite() && args.speed > 0.0) {
            bail!("--speed must be a number above 0, not {}", args.speed);
        }
        if args.max_concurrency == 0 {
            bail!("--max-concurrency must be at least 1");
        }
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
    Ok(())
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
