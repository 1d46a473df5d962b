//! generate(): context limits, stop strings, cached prefixes, seeds, chunked prefill.

use cache::KvCache;
use engine::{
    generate, load, EngineError, FinishReason, GenerateParams, LoadOptions, SamplingParams,
};

use crate::common::goldens;

fn tiny() -> (engine::Model, engine::Tokenizer) {
    load(&goldens().join("tiny-llama"), &LoadOptions::default()).unwrap()
}

#[test]
fn a_prompt_longer_than_the_context_is_rejected() {
    let (model, tok) = tiny();
    let prompt = vec![5u32; 40];
    let params = GenerateParams {
        context_limit: Some(32),
        ..Default::default()
    };
    let err = generate(
        &model,
        &tok,
        &mut model.new_cache(),
        &prompt,
        &params,
        &mut |_| true,
    )
    .unwrap_err();
    assert!(
        matches!(
            err,
            EngineError::PromptTooLong {
                prompt: 40,
                context: 32
            }
        ),
        "{err}"
    );
}

#[test]
fn generation_stops_at_the_context_limit() {
    let (model, tok) = tiny();
    let params = GenerateParams {
        context_limit: Some(12),
        max_tokens: 100,
        stop_at_eos: false,
        ..Default::default()
    };
    let out = generate(
        &model,
        &tok,
        &mut model.new_cache(),
        &[5; 8],
        &params,
        &mut |_| true,
    )
    .unwrap();
    assert_eq!(out.tokens.len(), 4);
    assert_eq!(out.finish_reason, FinishReason::Length);
}

#[test]
fn invalid_sampling_values_are_rejected() {
    let (model, tok) = tiny();
    let params = GenerateParams {
        sampling: SamplingParams {
            temperature: -0.5,
            ..Default::default()
        },
        ..Default::default()
    };
    let err = generate(
        &model,
        &tok,
        &mut model.new_cache(),
        &[5; 4],
        &params,
        &mut |_| true,
    )
    .unwrap_err();
    assert!(matches!(
        err,
        EngineError::InvalidParameter {
            name: "temperature",
            ..
        }
    ));
}

#[test]
fn token_ids_outside_the_vocabulary_are_rejected() {
    let (model, _) = tiny();
    let err = model
        .forward(&[1_000_000], &mut model.new_cache())
        .unwrap_err();
    assert!(matches!(err, EngineError::TokenOutOfRange { .. }), "{err}");
}

#[test]
fn chunked_prefill_and_a_cached_prefix_give_the_same_tokens() {
    let (model, tok) = tiny();
    let prompt: Vec<u32> = (0..50).map(|i| (i * 7 % 300) as u32).collect();
    let params = GenerateParams {
        max_tokens: 8,
        stop_at_eos: false,
        ..Default::default()
    };
    let whole = generate(
        &model,
        &tok,
        &mut model.new_cache(),
        &prompt,
        &params,
        &mut |_| true,
    )
    .unwrap();
    let chunked = GenerateParams {
        prefill_chunk: 7,
        ..params.clone()
    };
    let out = generate(
        &model,
        &tok,
        &mut model.new_cache(),
        &prompt,
        &chunked,
        &mut |_| true,
    )
    .unwrap();
    assert_eq!(out.tokens, whole.tokens);
    // A prefix already in the cache is not prefilled again.
    let mut cache = model.new_cache();
    model
        .prefill(&prompt[..30], &mut cache, 16)
        .unwrap()
        .eval()
        .unwrap();
    assert_eq!(cache.offset(), 30);
    let out = generate(&model, &tok, &mut cache, &prompt, &params, &mut |_| true).unwrap();
    assert_eq!(out.tokens, whole.tokens);
    assert_eq!(out.timings.cached_tokens, 30);
}

#[test]
fn a_seed_reproduces_sampled_text_and_stop_strings_cut_it() {
    let (model, tok) = tiny();
    let prompt = tok.encode("The quick brown fox", false).unwrap();
    let params = GenerateParams {
        max_tokens: 16,
        stop_at_eos: false,
        sampling: SamplingParams {
            temperature: 0.8,
            top_p: 0.9,
            seed: Some(42),
            logprobs: Some(3),
            ..Default::default()
        },
        ..Default::default()
    };
    let run = || {
        generate(
            &model,
            &tok,
            &mut model.new_cache(),
            &prompt,
            &params,
            &mut |_| true,
        )
        .unwrap()
    };
    let (a, b) = (run(), run());
    assert_eq!(a.tokens, b.tokens);
    assert_eq!(a.logprobs.len(), a.tokens.len());
    assert!(a
        .logprobs
        .iter()
        .all(|s| s.logprob <= 0.0 && s.top_logprobs.len() == 3));
    // Streamed deltas add up to the text.
    let mut streamed = String::new();
    let out = generate(
        &model,
        &tok,
        &mut model.new_cache(),
        &prompt,
        &params,
        &mut |e| {
            streamed.push_str(e.text);
            true
        },
    )
    .unwrap();
    assert_eq!(streamed, out.text);
    // Stop at a piece of the text seen above.
    let chars: Vec<char> = a.text.chars().collect();
    if chars.len() > 6 {
        let stop: String = chars[3..6].iter().collect();
        let p = GenerateParams {
            stop: vec![stop.clone()],
            ..params.clone()
        };
        let mut streamed = String::new();
        let out = generate(
            &model,
            &tok,
            &mut model.new_cache(),
            &prompt,
            &p,
            &mut |e| {
                streamed.push_str(e.text);
                true
            },
        )
        .unwrap();
        assert_eq!(out.finish_reason, FinishReason::Stop);
        assert!(!out.text.contains(&stop));
        assert_eq!(streamed, out.text);
    }
}

#[test]
fn a_prefill_told_to_stop_ends_at_a_chunk_boundary_and_keeps_what_it_computed() {
    let (model, _) = tiny();
    let prompt: Vec<u32> = (0..40).map(|i| 3 + (i * 7) % 200).collect();
    let mut asked = 0;
    let mut cache = model.new_cache();
    let got = model
        .prefill_while(&prompt, &mut cache, 8, &mut || {
            asked += 1;
            asked <= 2
        })
        .unwrap();
    assert!(
        got.is_none(),
        "the prefill went on after being told to stop"
    );
    assert_eq!(
        cache.offset(),
        16,
        "two chunks of 8 computed, then it stopped"
    );
    // Told nothing, it computes everything and gives prefill's logits.
    let mut a = model.new_cache();
    let mut b = model.new_cache();
    let all = model
        .prefill_while(&prompt, &mut a, 8, &mut || true)
        .unwrap()
        .unwrap();
    let reference = model.prefill(&prompt, &mut b, 8).unwrap();
    assert_eq!(a.offset(), 40);
    assert_eq!(
        all.to_vec::<f32>().unwrap(),
        reference.to_vec::<f32>().unwrap()
    );
}
