//! Decode throughput of the engine's continuous batching against serving the same requests
//! one by one with `engine::generate` (no prefix cache, greedy).
//!
//! ```text
//! cargo run --release -p kvstore-engine --example batch_throughput -- [MODEL] [TOKENS] [BATCHES]
//! ```
//! Defaults: models/SmolLM2-135M-Instruct.Q4_1.gguf, 32 tokens per request, 1,4,8,16.

use std::time::Instant;

use engine::{generate, load, Engine, EngineConfig, GenerateParams, LoadOptions, Request};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let path = args
        .next()
        .unwrap_or_else(|| "models/SmolLM2-135M-Instruct.Q4_1.gguf".into());
    let tokens: usize = args.next().map_or(Ok(32), |s| s.parse())?;
    let batches: Vec<usize> = args
        .next()
        .unwrap_or_else(|| "1,4,8,16".into())
        .split(',')
        .map(str::parse)
        .collect::<Result<_, _>>()?;
    let (model, tok) = load(path.as_ref(), &LoadOptions::default())?;
    let n = *batches.iter().max().unwrap_or(&1);
    let prompts: Vec<Vec<u32>> = (0..n)
        .map(|i| {
            let q = format!(
                "Question {i}: describe the number {} in a few words.",
                i * 37
            );
            let m = serde_json::json!([{"role": "user", "content": q}]).to_string();
            tok.encode_chat(&m, None, true)
        })
        .collect::<Result<_, _>>()?;
    let params = GenerateParams {
        max_tokens: tokens,
        stop_at_eos: false,
        ..GenerateParams::default()
    };

    // One by one: the single-sequence path.
    let t = Instant::now();
    let mut seq_tokens = 0;
    let mut seq_ttft = 0.0;
    for p in &prompts {
        let g = generate(
            &model,
            &tok,
            &mut model.new_cache(),
            p,
            &params,
            &mut |_| true,
        )?;
        seq_tokens += g.tokens.len();
        seq_ttft += g.timings.ttft_s;
    }
    let seq_s = t.elapsed().as_secs_f64();
    println!(
        "one by one: {n} requests, {seq_tokens} tokens in {seq_s:.2}s = {:.1} tok/s, mean TTFT {:.3}s",
        seq_tokens as f64 / seq_s,
        seq_ttft / n as f64
    );

    let engine = Engine::open(
        model,
        tok,
        None,
        EngineConfig {
            max_batch: n,
            ..EngineConfig::default()
        },
    )?;
    println!("| concurrent | tok/s | vs one by one | mean TTFT (s) | max TTFT (s) |");
    println!("|---:|---:|---:|---:|---:|");
    for &b in &batches {
        let t = Instant::now();
        let handles: Vec<_> = prompts[..b]
            .iter()
            .map(|p| engine.submit(Request::new(p.clone(), params.clone())))
            .collect::<Result<_, _>>()?;
        let mut total = 0;
        let mut ttfts = Vec::new();
        for h in handles {
            let c = h.wait()?;
            total += c.completion_tokens;
            ttfts.push(c.queue_s + c.ttft_s);
        }
        let s = t.elapsed().as_secs_f64();
        let rate = total as f64 / s;
        println!(
            "| {b} | {rate:.1} | {:.2}x | {:.3} | {:.3} |",
            rate / (seq_tokens as f64 / seq_s),
            ttfts.iter().sum::<f64>() / b as f64,
            ttfts.iter().cloned().fold(0.0, f64::max)
        );
    }
    engine.shutdown(false)?;
    Ok(())
}
