//! Tokenizer ids and chat-template text against transformers.

use std::collections::BTreeMap;

use engine::{load, render_template, LoadOptions, Tokenizer};
use minijinja::Value;

use crate::common::{golden, goldens, ids, smollm2};

fn check_tokenizer(tok: &Tokenizer, cases: &serde_json::Value) {
    for case in cases.as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        assert_eq!(
            tok.encode(text, false).unwrap(),
            ids(&case["ids"]),
            "{text:?}"
        );
        assert_eq!(
            tok.encode(text, true).unwrap(),
            ids(&case["ids_with_special"]),
            "{text:?} with special tokens"
        );
        assert_eq!(tok.decode(&ids(&case["ids"]), false).unwrap(), text);
    }
}

#[test]
fn tiny_tokenizer_json_matches_transformers() {
    let tok = Tokenizer::from_folder(&goldens().join("tiny-qwen3")).unwrap();
    check_tokenizer(&tok, &golden("tokenizer.json")["tiny-qwen3"]);
}

#[test]
fn smollm2_gguf_tokenizer_matches_reference() {
    let Some(path) = smollm2() else { return };
    let (_, tok) = load(&path, &LoadOptions::default()).unwrap();
    check_tokenizer(&tok, &golden("tokenizer.json")["smollm2"]);
}

fn render_case(template: &str, special: &serde_json::Value, case: &serde_json::Value) -> String {
    let mut ctx: BTreeMap<String, Value> = BTreeMap::new();
    for (k, v) in special.as_object().unwrap() {
        ctx.insert(k.clone(), Value::from(v.as_str().unwrap()));
    }
    let parse = |s: &serde_json::Value| -> Value {
        match s.as_str() {
            Some(s) => serde_json::from_str(s).unwrap(),
            None => Value::from(()),
        }
    };
    ctx.insert("messages".into(), parse(&case["messages_json"]));
    ctx.insert("tools".into(), parse(&case["tools_json"]));
    ctx.insert(
        "add_generation_prompt".into(),
        Value::from(case["add_generation_prompt"].as_bool().unwrap()),
    );
    if let Some(extra) = case["extra_json"].as_str() {
        let extra: serde_json::Value = serde_json::from_str(extra).unwrap();
        for (k, v) in extra.as_object().unwrap() {
            ctx.insert(k.clone(), Value::from_serialize(v));
        }
    }
    render_template(template, ctx).unwrap()
}

#[test]
fn written_templates_render_like_transformers() {
    let g = golden("chat_templates.json");
    for name in ["chatml_tools", "header_tools"] {
        let t = &g[name];
        let template =
            std::fs::read_to_string(goldens().join(t["template"].as_str().unwrap())).unwrap();
        for case in t["cases"].as_array().unwrap() {
            let got = render_case(&template, &t["special"], case);
            assert_eq!(
                got,
                case["text"].as_str().unwrap(),
                "{name} / {} / generation prompt {}",
                case["conversation"],
                case["add_generation_prompt"]
            );
        }
    }
}

#[test]
fn smollm2_template_from_gguf_renders_and_tokenizes_like_transformers() {
    let Some(path) = smollm2() else { return };
    let (_, tok) = load(&path, &LoadOptions::default()).unwrap();
    let g = golden("chat_templates.json");
    for case in g["smollm2"]["cases"].as_array().unwrap() {
        let text = tok
            .apply_chat_template(
                case["messages_json"].as_str().unwrap(),
                case["tools_json"].as_str(),
                case["add_generation_prompt"].as_bool().unwrap(),
                case["extra_json"].as_str(),
            )
            .unwrap();
        assert_eq!(
            text,
            case["text"].as_str().unwrap(),
            "{}",
            case["conversation"]
        );
        assert_eq!(tok.encode(&text, false).unwrap(), ids(&case["ids"]));
    }
}
