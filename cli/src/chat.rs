//! `kvstore chat`: a multi-turn REPL that streams the model's replies. Each turn renders the
//! whole conversation with the chat template and runs as one request through an [`Engine`]
//! (the loop `serve` runs) over tiers kept in memory: the previous turn's KV stays resident
//! on the device, so when a turn extends the conversation only its new tokens are prefilled.

use std::io::{BufRead, Write};

use engine::{Engine, KvTiers, Request, ReuseConfig};

use crate::generate::{ModelArgs, SamplingArgs};

/// Arguments of `kvstore chat`.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// A system message for the conversation.
    #[arg(long)]
    system: Option<String>,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Print prompt/cached tokens and speeds after each reply.
    #[arg(long)]
    stats: bool,
}

/// Runs `kvstore chat` until end of input or `/exit`.
pub fn run(args: Args) -> anyhow::Result<()> {
    let params = args.sampling.params()?;
    let path = args.model.path()?;
    let (model, tokenizer) = args.model.load()?;
    eprintln!(
        "kvstore chat: {} ({} layers). /reset starts over, /exit or Ctrl-D quits.",
        path.display(),
        model.info().kv.layers
    );
    // No store directory: blocks stay on the device and in RAM for this session only.
    let reuse = ReuseConfig::default();
    let kv_budget = reuse.kv_budget_bytes;
    let tiers = KvTiers::open(&model, &tokenizer, reuse)?;
    let config = crate::engine_run::config(Some(kv_budget));
    let engine = Engine::open(model, tokenizer, Some(tiers), config)?;
    let mut messages: Vec<serde_json::Value> = Vec::new();
    if let Some(s) = &args.system {
        messages.push(serde_json::json!({"role": "system", "content": s}));
    }
    let base = messages.clone();
    let stdin = std::io::stdin();
    let mut stdout = std::io::stdout();
    loop {
        print!("> ");
        stdout.flush()?;
        let mut line = String::new();
        if stdin.lock().read_line(&mut line)? == 0 {
            println!();
            return Ok(());
        }
        let line = line.trim();
        match line {
            "" => continue,
            "/exit" | "/quit" => return Ok(()),
            "/reset" => {
                messages = base.clone();
                continue;
            }
            _ => {}
        }
        messages.push(serde_json::json!({"role": "user", "content": line}));
        let prompt =
            engine
                .tokenizer()
                .encode_chat(&serde_json::to_string(&messages)?, None, true)?;
        let request = Request::new(prompt, params.clone());
        let out = crate::engine_run::complete(&engine, request, &mut |text| {
            print!("{text}");
            std::io::stdout().flush().is_ok()
        });
        let out = match out {
            Ok(o) => o,
            Err(e) => {
                eprintln!("\nerror: {e}");
                messages.pop();
                continue;
            }
        };
        println!();
        if args.stats {
            let t = &out.timings;
            eprintln!(
                "[{} prompt tokens, {} cached; TTFT {:.2}s; prefill {:.0} tok/s; decode {:.1} tok/s]",
                t.prompt_tokens, t.cached_tokens, t.ttft_s, t.prefill_tok_per_s, t.decode_tok_per_s
            );
        }
        messages.push(serde_json::json!({"role": "assistant", "content": out.text}));
    }
}
