//! The committed fuzz corpora and seeds of the engine targets (`fuzz/corpus/<target>`,
//! `fuzz/seeds/<target>`) replayed through the harnesses the fuzz targets run, on stable, in
//! every test run: an input that once crashed a target stays fixed.

use engine::fuzzing::{check_chat_template, check_request_body, smollm2_tokenizer};
use engine::Tokenizer;

fn replay(target: &str, check: impl Fn(&Tokenizer, &[u8])) {
    let files = store::fuzzing::committed_inputs(target);
    assert!(!files.is_empty(), "no committed inputs for {target}");
    for path in files {
        let data = std::fs::read(&path).unwrap();
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            check(smollm2_tokenizer(), &data)
        }));
        assert!(outcome.is_ok(), "{} fails", path.display());
    }
}

#[test]
fn chat_template_corpus_replays() {
    replay("chat_template", check_chat_template);
}

#[test]
fn http_request_corpus_replays() {
    replay("http_request", check_request_body);
}
