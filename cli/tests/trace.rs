//! `kvstore bench trace` as a user runs it: the built binary on small trace files.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn kvstore(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvstore"))
        .args(args)
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("run kvstore")
}

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/trace-small.jsonl")
}

/// The trace of `sim.rs`'s `lru_leaf_lfu_belady_by_hand`, at 512 tokens a block: [A B], [X],
/// [A B], [X], [A B] (4,096 prompt tokens). Ideal: r2, r3, r4 hit 1024 + 512 + 1024 = 2,560.
/// With 2 blocks (1,024 tokens): lru 0, lru-leaf 1,024 (A at r2 and r4), belady 2,048.
#[test]
fn simulate_prints_and_writes_the_hand_computed_shares() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("sim.json");
    let f = fixture();
    let out = kvstore(&[
        "bench",
        "trace",
        f.to_str().unwrap(),
        "--simulate",
        "--budget-tokens",
        "1024",
        "--json",
        json.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("ideal (unbounded cache): 62.50 %"),
        "{stdout}"
    );
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(v["schema"], "kvstore.bench.trace.simulate.v1");
    assert_eq!(v["prompt_tokens"], 4096);
    assert_eq!(v["ideal"], 0.625);
    let b = &v["budgets"][0];
    assert_eq!(b["blocks"], 2);
    assert_eq!(b["lru"], 0.0);
    assert_eq!(b["lru-leaf"], 0.25);
    assert_eq!(b["lfu"], 0.25);
    assert_eq!(b["belady"], 0.5);
}

/// `--window 1..4` keeps the requests at 1, 2 and 3 s: [X], [A B], [X]; only the second X
/// hits (512 of 2,048 tokens).
#[test]
fn window_takes_requests_by_trace_seconds() {
    let f = fixture();
    let out = kvstore(&[
        "bench",
        "trace",
        f.to_str().unwrap(),
        "--window",
        "1..4",
        "--simulate",
        "--budget-tokens",
        "512",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.starts_with("3 requests over 2.0 s"), "{stdout}");
    assert!(
        stdout.contains("ideal (unbounded cache): 25.00 % of 2048"),
        "{stdout}"
    );
}

#[test]
fn a_malformed_line_fails_with_its_number_and_no_panic() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.jsonl");
    let mut text = std::fs::read_to_string(fixture()).unwrap();
    text.push_str(
        "{\"timestamp\": 5000, \"input_length\": 2000, \"output_length\": 1, \"hash_ids\": [1]}\n",
    );
    std::fs::write(&bad, text).unwrap();
    let out = kvstore(&[
        "bench",
        "trace",
        bad.to_str().unwrap(),
        "--simulate",
        "--budget-tokens",
        "1",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("line 6: input_length 2000 does not fit 1 hash ids"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");

    for (flags, what) in [
        (&["--token-scale", "0.1"][..], "--token-scale 0.1"),
        (&["--speed", "0"], "--speed must be a number above 0"),
        (
            &["--max-concurrency", "0"],
            "--max-concurrency must be at least 1",
        ),
        (&["--window", "9.."], "no request"),
    ] {
        let f = fixture();
        let mut args = vec!["bench", "trace", f.to_str().unwrap(), "--simulate"];
        args.extend_from_slice(flags);
        let out = kvstore(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{flags:?}: {stderr}");
        assert!(stderr.contains(what), "{flags:?}: {stderr}");
    }
}
