//! `kvstore chat`: a multi-turn REPL that streams the model's replies. Each turn renders the
//! whole conversation with the chat template; when it extends what the KV cache already
//! holds, only the new tokens are prefilled.

use std::io::{BufRead, Write};

use cache::KvCache;

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
    let mut messages: Vec<serde_json::Value> = Vec::new();
    if let Some(s) = &args.system {
        messages.push(serde_json::json!({"role": "system", "content": s}));
    }
    let base = messages.clone();
    let mut cache = model.new_cache();
    let mut cached: Vec<u32> = Vec::new();
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
                cache = model.new_cache();
                cached.clear();
                continue;
            }
            _ => {}
        }
        messages.push(serde_json::json!({"role": "user", "content": line}));
        let prompt = tokenizer.encode_chat(&serde_json::to_string(&messages)?, None, true)?;
        // Keep the cache only when this prompt extends exactly what it holds.
        if !(prompt.starts_with(&cached)
            && cached.len() < prompt.len()
            && cache.offset() == cached.len())
        {
            cache = model.new_cache();
            cached.clear();
        }
        let out = engine::generate(&model, &tokenizer, &mut cache, &prompt, &params, &mut |e| {
            print!("{}", e.text);
            std::io::stdout().flush().is_ok()
        });
        let out = match out {
            Ok(o) => o,
            Err(e) => {
                eprintln!("\nerror: {e}");
                messages.pop();
                cache = model.new_cache();
                cached.clear();
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
        // The cache holds the prompt and every generated token but the last.
        cached = prompt;
        cached.extend(&out.tokens[..out.tokens.len().saturating_sub(1)]);
        messages.push(serde_json::json!({"role": "assistant", "content": out.text}));
    }
}
