//! Greedy chat completion with a model path: `cargo run --example greedy -- MODEL "question"`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let path = args
        .next()
        .unwrap_or("models/SmolLM2-135M-Instruct.Q4_1.gguf".into());
    let question = args
        .next()
        .unwrap_or("What is the capital of France?".into());
    let t = std::time::Instant::now();
    let (model, tok) = engine::load(path.as_ref(), &engine::LoadOptions::default())?;
    eprintln!(
        "loaded {:?} in {:.2}s",
        model.info(),
        t.elapsed().as_secs_f64()
    );
    let messages = serde_json::json!([{"role": "user", "content": question}]).to_string();
    let text = tok.apply_chat_template(&messages, None, true, None)?;
    eprintln!("prompt: {text:?}");
    let prompt = tok.encode(&text, false)?;
    eprintln!("ids: {prompt:?}");
    let mut cache = model.new_cache();
    let params = engine::GenerateParams {
        max_tokens: 48,
        ..Default::default()
    };
    let out = engine::generate(&model, &tok, &mut cache, &prompt, &params, &mut |e| {
        eprint!("{}", e.text);
        true
    })?;
    eprintln!();
    println!("{}", serde_json::to_string_pretty(&out.timings)?);
    println!("{:?} {:?}", out.finish_reason, out.tokens);
    Ok(())
}
