//! The committed fuzz corpora and seeds (`fuzz/corpus/<target>`, `fuzz/seeds/<target>`)
//! replayed through the same harnesses the fuzz targets run, on stable, in every test run:
//! an input that once crashed a target stays fixed.

use store::fuzzing::{check_block_file, check_journal, check_key_text};

fn replay(target: &str, check: impl Fn(&[u8])) {
    let files = store::fuzzing::committed_inputs(target);
    assert!(!files.is_empty(), "no committed inputs for {target}");
    for path in files {
        let data = std::fs::read(&path).unwrap();
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| check(&data)));
        assert!(outcome.is_ok(), "{} fails", path.display());
    }
}

#[test]
fn block_file_corpus_replays() {
    let scratch = tempfile::tempfile().unwrap();
    replay("block_file", |d| check_block_file(d, &scratch));
}

#[test]
fn journal_corpus_replays() {
    replay("journal", check_journal);
}

#[test]
fn store_key_corpus_replays() {
    replay("store_key", check_key_text);
}
