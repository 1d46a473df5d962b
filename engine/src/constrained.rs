//! Grammar-constrained sampling: a [`Constraint`] says, before each token, which tokens keep
//! the output inside a grammar, so that a reply that breaks the grammar cannot be sampled.
//!
//! Grammars are Lark text with embedded JSON schemas (`%json {...}`), compiled by
//! [`llguidance`] (the library llama.cpp, vLLM and SGLang use) against a token trie of the
//! model's tokenizer ([`GrammarCompiler`], built once per tokenizer). Each step the host
//! computes the set of allowed tokens ([`Constraint::device_mask`]), the device sets every
//! other logit to -inf before sampling (`device_sampler.rs`), and the host feeds the picked
//! token back ([`Constraint::commit`]). End-of-sequence tokens are allowed only where the
//! grammar accepts. docs/engine.md describes how the batched decode schedules such rows.
//!
//! [`json_schema_rule`] and [`lark_literal`] build grammar text: the server's structured
//! outputs and forced tool calls are written with them.

use std::sync::Arc;
use std::time::{Duration, Instant};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::TokEnv;
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;

use crate::error::{EngineError, Result};
use crate::tokenizer::Tokenizer;

/// Compiles grammars for one tokenizer; holds its token trie (built once, shared by every
/// grammar compiled here).
pub struct GrammarCompiler {
    factory: Arc<ParserFactory>,
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarCompiler")
            .field("vocab", &self.factory.tok_env().tok_trie().vocab_size())
            .finish()
    }
}

fn grammar_err(message: impl std::fmt::Display) -> EngineError {
    EngineError::InvalidParameter {
        name: "grammar",
        message: message.to_string(),
    }
}

fn tok_err(e: impl std::fmt::Display) -> EngineError {
    EngineError::Tokenizer(format!("token trie: {e}"))
}

impl GrammarCompiler {
    /// The compiler for `tokenizer`'s vocabulary; its end-of-sequence tokens are the ones
    /// a grammar's end allows.
    pub fn new(tokenizer: &Tokenizer) -> Result<GrammarCompiler> {
        let mut bt = toktrie_hf_tokenizers::ByteTokenizer::from_tokenizer(tokenizer.hf().clone())
            .map_err(tok_err)?;
        let vocab = tokenizer.vocab_size() as u32;
        let eos: Vec<u32> = tokenizer
            .eos_ids()
            .iter()
            .copied()
            .filter(|&t| t < vocab)
            .collect();
        if !eos.is_empty() {
            bt.set_eos_tokens(&eos);
        }
        let env: TokEnv = bt.into_tok_env(None).map_err(tok_err)?;
        let mut factory = ParserFactory::new_simple(&env).map_err(tok_err)?;
        factory.quiet();
        Ok(GrammarCompiler {
            factory: Arc::new(factory),
        })
    }

    /// Compiles a Lark grammar (with `%json` schemas) into a fresh [`Constraint`]. A grammar
    /// or schema llguidance cannot compile (an unsupported JSON-schema keyword included) is
    /// an [`EngineError::InvalidParameter`] naming what it rejected.
    pub fn compile(&self, lark: &str) -> Result<Constraint> {
        let t = Instant::now();
        let parser = self
            .factory
            .create_parser(TopLevelGrammar::from_lark(lark.to_string()))
            .map_err(grammar_err)?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(grammar_err(e));
        }
        Ok(Constraint {
            matcher,
            grammar: Arc::from(lark),
            committed: 0,
            mask_time: Duration::ZERO,
            masks: 0,
            compile_time: t.elapsed(),
        })
    }
}

/// A compiled grammar and how far one generation has got through it.
#[derive(Clone)]
pub struct Constraint {
    matcher: Matcher,
    grammar: Arc<str>,
    committed: usize,
    mask_time: Duration,
    masks: u64,
    compile_time: Duration,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("grammar_bytes", &self.grammar.len())
            .field("committed", &self.committed)
            .finish()
    }
}

/// Two constraints are equal when they hold the same grammar at the same point.
impl PartialEq for Constraint {
    fn eq(&self, other: &Self) -> bool {
        self.grammar == other.grammar && self.committed == other.committed
    }
}

impl Constraint {
    /// The allowed tokens of the next step as one byte per id of a `vocab`-token model
    /// (1: allowed); ids past the tokenizer's vocabulary are never allowed. Once the
    /// grammar is complete only end-of-sequence tokens are.
    pub fn allowed(&mut self, vocab: usize) -> Result<Vec<u8>> {
        let t = Instant::now();
        let set = self.matcher.compute_mask_or_eos().map_err(grammar_err)?;
        let mut out = vec![0u8; vocab];
        let mut any = false;
        set.iter_set_entries(|id| {
            if let Some(slot) = out.get_mut(id) {
                *slot = 1;
                any = true;
            }
        });
        self.mask_time += t.elapsed();
        self.masks += 1;
        if !any {
            return Err(grammar_err(format!(
                "the grammar allows no token after {} tokens",
                self.committed
            )));
        }
        Ok(out)
    }

    /// [`Constraint::allowed`] as a `[vocab]` bool array on the device.
    pub(crate) fn device_mask(&mut self, vocab: usize) -> Result<mlx::Array> {
        let allowed = self.allowed(vocab)?;
        Ok(mlx::Array::from_slice(&allowed, &[vocab as i32])?.astype(mlx::Dtype::Bool)?)
    }

    /// Advances past `token`, which the last mask allowed. An end-of-sequence token where
    /// the grammar accepts ends it.
    pub fn commit(&mut self, token: u32) -> Result<()> {
        self.committed += 1;
        if self.matcher.is_stopped() {
            return Ok(());
        }
        self.matcher.consume_token(token).map_err(grammar_err)
    }

    /// Whether the output so far is a complete sentence of the grammar.
    pub fn is_accepting(&mut self) -> bool {
        self.matcher.is_accepting().unwrap_or(false)
    }

    /// Whether the grammar allows nothing more than an end-of-sequence token.
    pub fn is_finished(&self) -> bool {
        self.matcher.is_stopped()
    }

    /// Masks computed and the host time they took.
    pub fn mask_stats(&self) -> (u64, Duration) {
        (self.masks, self.mask_time)
    }

    /// How long compiling the grammar took.
    pub fn compile_time(&self) -> Duration {
        self.compile_time
    }
}

/// `text` as a Lark string literal.
pub fn lark_literal(text: &str) -> String {
    // Lark string literals take JSON's escapes.
    Value::String(text.to_string()).to_string()
}

/// A Lark rule body matching one JSON value of `schema`, written compactly with `", "` and
/// `": "` separators (as Python's `json.dumps`, which chat templates' `tojson` follows) and
/// no other whitespace. A schema keyword llguidance does not implement makes compiling the
/// grammar fail with an error naming it (never silently unenforced).
pub fn json_schema_rule(schema: &Value) -> Result<String> {
    let Value::Object(map) = schema else {
        return Err(grammar_err("a JSON schema must be an object"));
    };
    let mut map = map.clone();
    let mut options = serde_json::json!({
        "whitespace_flexible": false,
        "item_separator": ", ",
        "key_separator": ": ",
        "lenient": false,
    });
    if let Some(Value::Object(given)) = map.get("x-guidance") {
        for (k, v) in given {
            options[k] = v.clone();
        }
    }
    map.insert("x-guidance".into(), options);
    Ok(format!("%json {}", Value::Object(map)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn literals_escape_what_lark_needs() {
        assert_eq!(lark_literal("a\"b\n"), r#""a\"b\n""#);
    }

    #[test]
    fn schema_rules_fix_the_separators_and_keep_the_schema() {
        let rule = json_schema_rule(&serde_json::json!({"type": "object"})).unwrap();
        assert!(rule.starts_with("%json {"), "{rule}");
        assert!(rule.contains(r#""item_separator":", ""#), "{rule}");
        assert!(rule.contains(r#""lenient":false"#), "{rule}");
        assert!(json_schema_rule(&serde_json::json!([1])).is_err());
    }
}
