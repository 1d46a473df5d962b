//! `kvstore bench grammar`: the cost of grammar-constrained sampling. Decode tok/s of the
//! same prompt unconstrained and under a JSON-schema grammar (the constrained row does not
//! run ahead: docs/engine.md), the host time llguidance takes per token mask, and that mask
//! time alone over a reference document replayed without the model.

use std::time::Instant;

use anyhow::{bail, Context};
use engine::{Engine, GenerateParams, GrammarCompiler, Request};
use serde_json::json;

use crate::generate::ModelArgs;

/// Arguments of `kvstore bench grammar`.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Most tokens to decode in each run.
    #[arg(long, default_value_t = 128)]
    tokens: usize,
    /// Runs of each kind; the best run is reported.
    #[arg(long, default_value_t = 3)]
    runs: usize,
}

/// The schema of the benchmark: strings, numbers, an enum and an array, nested once.
fn schema() -> serde_json::Value {
    json!({"type": "object", "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string"},
        "role": {"enum": ["engineer", "artist", "doctor", "teacher"]},
        "skills": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "address": {"type": "object", "properties": {
            "street": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "zip"], "additionalProperties": false}},
        "required": ["name", "age", "city", "role", "skills", "address"],
        "additionalProperties": false})
}

/// A document of [`schema`], replayed token by token for the mask-only figure.
const REFERENCE: &str = r#"{"name": "Ada Lovelace", "age": 36, "city": "London", "role": "engineer", "skills": ["mathematics", "analysis", "poetry", "engines"], "address": {"street": "12 St James's Square", "zip": "10001"}}"#;

struct Run {
    tokens: usize,
    tok_per_s: f64,
    mask_ms_per_token: f64,
}

/// Runs the benchmark and prints its table.
pub fn run(args: Args) -> anyhow::Result<()> {
    if args.tokens < 2 || args.runs == 0 {
        bail!("--tokens must be at least 2 and --runs at least 1");
    }
    let path = args.model.path()?;
    let (model, tokenizer) = args.model.load()?;
    let t = Instant::now();
    let compiler = GrammarCompiler::new(&tokenizer)?;
    let trie_s = t.elapsed().as_secs_f64();
    let grammar = format!("start: {}\n", engine::json_schema_rule(&schema())?);
    let t = Instant::now();
    compiler.compile(&grammar)?;
    let compile_s = t.elapsed().as_secs_f64();
    println!(
        "bench grammar: {} ({}, vocab {}), up to {} tokens, best of {}, MLX {}",
        path.display(),
        model.info().architecture,
        model.info().vocab_size,
        args.tokens,
        args.runs,
        mlx::version()?
    );
    println!(
        "token trie: {:.1} ms once per tokenizer; grammar compile: {:.2} ms",
        trie_s * 1e3,
        compile_s * 1e3
    );
    let messages = json!([{"role": "user", "content":
        "Describe a famous engineer as a JSON object with name, age, city, role, skills and address."}]);
    let prompt = tokenizer.encode_chat(&messages.to_string(), None, true)?;
    let vocab = model.info().vocab_size;
    // Every run goes through an engine, as `serve` runs a request with `response_format`.
    let engine = Engine::open(model, tokenizer, None, crate::engine_run::config(None))?;
    let best = |constrained: bool| -> anyhow::Result<Run> {
        let mut best: Option<Run> = None;
        for _ in 0..args.runs {
            let params = GenerateParams {
                max_tokens: args.tokens,
                stop_at_eos: constrained,
                constraint: if constrained {
                    Some(compiler.compile(&grammar)?)
                } else {
                    None
                },
                ..GenerateParams::default()
            };
            let out = crate::engine_run::complete(
                &engine,
                Request::new(prompt.clone(), params),
                &mut |_| true,
            )?;
            let n = out.tokens.len().max(1);
            let run = Run {
                tokens: out.tokens.len(),
                tok_per_s: out.timings.decode_tok_per_s,
                mask_ms_per_token: out.timings.mask_s * 1e3 / n as f64,
            };
            if best.as_ref().is_none_or(|b| run.tok_per_s > b.tok_per_s) {
                best = Some(run);
            }
        }
        best.context("no run")
    };
    let free = best(false)?;
    let forced = best(true)?;
    // The mask alone: the reference document's tokens committed one by one.
    let ids = engine.tokenizer().encode(REFERENCE, false)?;
    let mut c = compiler.compile(&grammar)?;
    let mut per_token = Vec::with_capacity(ids.len());
    for &id in &ids {
        let t = Instant::now();
        let allowed = c.allowed(vocab)?;
        per_token.push(t.elapsed().as_secs_f64() * 1e3);
        if allowed.get(id as usize) != Some(&1) {
            bail!("the reference document leaves the grammar at token {id}");
        }
        c.commit(id)?;
    }
    per_token.sort_by(f64::total_cmp);
    let mean = per_token.iter().sum::<f64>() / per_token.len().max(1) as f64;
    let pct = |q: f64| per_token[((per_token.len() - 1) as f64 * q).round() as usize];
    println!(
        "{:>13}  {:>7}  {:>10}  {:>8}  {:>15}",
        "run", "tokens", "decode tok/s", "ratio", "mask ms/token"
    );
    println!(
        "{:>13}  {:>7}  {:>12.1}  {:>8}  {:>15}",
        "unconstrained", free.tokens, free.tok_per_s, "1.00x", "-"
    );
    println!(
        "{:>13}  {:>7}  {:>12.1}  {:>7.2}x  {:>15.3}",
        "json schema",
        forced.tokens,
        forced.tok_per_s,
        forced.tok_per_s / free.tok_per_s.max(f64::MIN_POSITIVE),
        forced.mask_ms_per_token
    );
    println!(
        "mask alone over a {}-token reference document: mean {:.3} ms, p50 {:.3} ms, p99 {:.3} ms, max {:.3} ms",
        ids.len(),
        mean,
        pct(0.5),
        pct(0.99),
        pct(1.0)
    );
    Ok(())
}
