//! Grammar-constrained generation through the library path (`engine::generate`, the CLI's):
//! a [`engine::Constraint`] in [`GenerateParams`] is enforced there as in serve.

use engine::{generate, json_schema_rule, load, FinishReason, GenerateParams, GrammarCompiler};
use engine::{LoadOptions, SamplingParams};
use serde_json::{json, Value};

use crate::common::goldens;

#[test]
fn generate_follows_a_grammar_whatever_the_weights() {
    let (model, tok) = load(&goldens().join("tiny-qwen3"), &LoadOptions::default()).unwrap();
    let compiler = GrammarCompiler::new(&tok).unwrap();
    let rule = json_schema_rule(&json!({"type": "object", "properties": {
        "k": {"enum": ["x", "y"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["k", "n"], "additionalProperties": false}))
    .unwrap();
    let grammar = format!("start: \"answer: \" ({rule} | \"none\")\n");
    let prompt = tok.encode("Say something:", false).unwrap();
    for seed in 0..8 {
        let params = GenerateParams {
            max_tokens: 60,
            sampling: SamplingParams {
                temperature: 1.0,
                seed: Some(seed),
                ..SamplingParams::default()
            },
            constraint: Some(compiler.compile(&grammar).unwrap()),
            ..GenerateParams::default()
        };
        let g = generate(
            &model,
            &tok,
            &mut model.new_cache(),
            &prompt,
            &params,
            &mut |_| true,
        )
        .unwrap();
        assert_eq!(g.finish_reason, FinishReason::Stop, "{seed}: {:?}", g.text);
        assert!(
            tok.eos_ids().contains(g.tokens.last().unwrap()),
            "ended by an EOS token"
        );
        let body = g
            .text
            .strip_prefix("answer: ")
            .unwrap_or_else(|| panic!("{:?}", g.text));
        if body != "none" {
            let v: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"));
            assert!(v["k"] == "x" || v["k"] == "y", "{v}");
            assert!(v["n"].as_u64().is_some_and(|n| n <= 9), "{v}");
            assert_eq!(body, v.to_string().replace(",", ", ").replace(":", ": "));
        }
        assert!(g.timings.mask_s > 0.0);
    }
}

#[test]
fn grammars_that_cannot_compile_are_invalid_parameters() {
    let (_, tok) = load(&goldens().join("tiny-qwen3"), &LoadOptions::default()).unwrap();
    let compiler = GrammarCompiler::new(&tok).unwrap();
    for (grammar, says) in [
        ("start: undefined_rule\n", "undefined_rule"),
        ("start: %json {\"type\": \"object\", \"if\": {}}\n", "if"),
        ("start: \"a\" (\n", ""),
    ] {
        match compiler.compile(grammar) {
            Err(engine::EngineError::InvalidParameter { name, message }) => {
                assert_eq!(name, "grammar");
                assert!(message.contains(says), "{grammar}: {message}");
            }
            other => panic!("{grammar}: {other:?}"),
        }
    }
}
