//! `kvstore bench prefill`: an agent turn's prefill (`--new` tokens after `--cached` ones,
//! a tool result over a long conversation) as a share of the f32 matrix-product rate MLX
//! reaches on this machine, both measured in the same run.
//!
//! The work is counted, not sampled: the decoder layers' linear weights (2 FLOPs per weight
//! and token) and the attention products (q·kᵀ and p·v over every visible key). The LM
//! head runs on the last token only and is left out, as are norms, RoPE and softmax.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use cache::KvCache;
use engine::Model;
use mlx::Array;
use serde::Serialize;

use super::timing::{matmul_gflops, median_of};
use crate::generate::ModelArgs;

/// Arguments of `kvstore bench prefill`.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Tokens already in the cache (the conversation so far).
    #[arg(long, default_value_t = 4096)]
    cached: usize,
    /// Tokens prefilled after them (the turn's new tokens).
    #[arg(long, default_value_t = 500)]
    new: usize,
    /// Tokens per prefill step; default: the device's.
    #[arg(long)]
    prefill_chunk: Option<usize>,
    /// Measured repetitions (the median is reported).
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Print one JSON object instead of lines.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct Report {
    cached: usize,
    new: usize,
    prefill_chunk: usize,
    /// Median seconds of the turn's prefill.
    seconds: f64,
    /// FLOPs of the linear layers over the new tokens.
    weight_flops: f64,
    /// FLOPs of the attention products over every visible key.
    attention_flops: f64,
    /// (weight + attention FLOPs) / seconds.
    gflops: f64,
    /// f32 matmul of 2048 × 2048 by 2048 × 2048 in the same run.
    gemm_gflops: f64,
    /// gflops / gemm_gflops (the engine-step issue asks ≥ 0.6 on the CPU).
    share: f64,
}

/// The shape facts the count needs, from the model's config (llama-like families).
struct Shape {
    layers: f64,
    hidden: f64,
    heads: f64,
    kv_heads: f64,
    head_dim: f64,
    intermediate: f64,
}

fn shape(model: &Model) -> Result<Shape> {
    let c = model.config();
    let get = |k: &str| c.get(k).and_then(|v| v.as_f64());
    let info = model.info();
    if !matches!(info.architecture.as_str(), "llama" | "qwen2" | "qwen3") {
        bail!(
            "bench prefill counts FLOPs of llama, qwen2 and qwen3 layers; {} is another shape",
            info.architecture
        );
    }
    let layers = get("num_hidden_layers").context("config: num_hidden_layers")?;
    let intermediate = get("intermediate_size").context("config: intermediate_size")?;
    Ok(Shape {
        layers,
        hidden: info.hidden_size as f64,
        heads: info.num_heads as f64,
        kv_heads: info.kv.kv_heads as f64,
        head_dim: info.kv.head_dim as f64,
        intermediate,
    })
}

/// (weight FLOPs, attention FLOPs) of prefilling `new` tokens after `cached`.
fn flops(s: &Shape, cached: usize, new: usize) -> (f64, f64) {
    let (c, n) = (cached as f64, new as f64);
    let attn_w = s.hidden * s.heads * s.head_dim * 2.0 + s.hidden * s.kv_heads * s.head_dim * 2.0;
    let mlp_w = 3.0 * s.hidden * s.intermediate;
    let weights = 2.0 * s.layers * (attn_w + mlp_w) * n;
    // New token i (1-based) sees c + i keys: q·kᵀ and p·v, 2 FLOPs per multiply-add each.
    let visible = n * c + n * (n + 1.0) / 2.0;
    let attention = s.layers * 4.0 * s.heads * s.head_dim * visible;
    (weights, attention)
}

/// Runs the benchmark.
pub fn run(args: Args) -> Result<()> {
    if args.new == 0 || args.reps == 0 {
        bail!("--new and --reps must be at least 1");
    }
    let (model, _) = args.model.load()?;
    let s = shape(&model)?;
    let chunk = args
        .prefill_chunk
        .unwrap_or_else(engine::default_prefill_chunk);
    let vocab = model.info().vocab_size as u32;
    let tokens: Vec<u32> = (0..(args.cached + args.new) as u32)
        .map(|i| i.wrapping_mul(2_654_435_761) % vocab.max(1))
        .collect();
    let (history, turn) = tokens.split_at(args.cached);
    let mut cache = model.new_cache();
    if !history.is_empty() {
        model.prefill(history, &mut cache, chunk)?.eval()?;
    }
    let mut times = Vec::with_capacity(args.reps);
    // One warm-up turn, then the measured ones.
    for rep in 0..=args.reps {
        let t = Instant::now();
        let logits: Array = model.prefill(turn, &mut cache, chunk)?;
        logits.eval()?;
        if rep > 0 {
            times.push(t.elapsed());
        }
        cache.trim(args.new)?;
        if cache.offset() != args.cached {
            bail!(
                "the cache holds {} tokens after a trim, not {}",
                cache.offset(),
                args.cached
            );
        }
    }
    let seconds = median_of(&mut times).as_secs_f64();
    let (weight_flops, attention_flops) = flops(&s, args.cached, args.new);
    let gflops = (weight_flops + attention_flops) / seconds / 1e9;
    let gemm = matmul_gflops(2048, args.reps.max(3))?;
    let r = Report {
        cached: args.cached,
        new: args.new,
        prefill_chunk: chunk,
        seconds,
        weight_flops,
        attention_flops,
        gflops,
        gemm_gflops: gemm,
        share: gflops / gemm,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
        return Ok(());
    }
    println!(
        "prefill of {} tokens after {} cached ({}-token steps): {:.3} s median of {}",
        r.new, r.cached, r.prefill_chunk, r.seconds, args.reps
    );
    println!(
        "work: {:.1} GFLOP in linear layers + {:.1} GFLOP in attention = {:.1} GFLOP/s",
        r.weight_flops / 1e9,
        r.attention_flops / 1e9,
        r.gflops
    );
    println!(
        "f32 matmul 2048³ in the same run: {:.1} GFLOP/s; the turn reaches {:.0} % of it",
        r.gemm_gflops,
        r.share * 100.0
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flop_count_matches_a_hand_count() {
        // 1 layer, hidden 4, 2 heads of 2 over 1 KV head, MLP 8: q 4·4 + k,v 2·(4·2) +
        // o 4·4 = 48 weights, MLP 3·4·8 = 96; 2 new tokens after 3 cached see 4 + 5 keys.
        let s = Shape {
            layers: 1.0,
            hidden: 4.0,
            heads: 2.0,
            kv_heads: 1.0,
            head_dim: 2.0,
            intermediate: 8.0,
        };
        let (w, a) = flops(&s, 3, 2);
        assert_eq!(w, 2.0 * (48.0 + 96.0) * 2.0);
        assert_eq!(a, 4.0 * 2.0 * 2.0 * 9.0);
    }
}
