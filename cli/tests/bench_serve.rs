//! `kvstore bench serve` as a user runs it: the built binary on the tiny test model.

use std::path::Path;
use std::process::Command;

/// Both interleave arms and the sessions part run and report; sessions reuse their earlier
/// turns (every turn after the first extends the previous prompt and reply, so almost all
/// of its prompt comes from the prefix cache); bad arguments are refused with a message.
#[test]
fn bench_serve_reports_both_arms_and_the_sessions_hit_share() {
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("../engine/tests/goldens/tiny-qwen3");
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("serve.json");
    let out = Command::new(env!("CARGO_BIN_EXE_kvstore"))
        .args(["bench", "serve", "--model"])
        .arg(&model)
        .args([
            "--streams",
            "3",
            "--stream-tokens",
            "40",
            "--long-prompt",
            "200",
            "--prefill-chunk",
            "16",
            "--sessions",
            "3",
            "--turns",
            "3",
            "--first-prompt",
            "40",
            "--new-tokens",
            "8",
            "--reply-tokens",
            "8",
            "--json",
        ])
        .arg(&json)
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let arms = r["interleave"].as_array().unwrap();
    assert_eq!(arms.len(), 2);
    assert_eq!(arms[0]["prefill_chunk"], 16);
    assert_eq!(arms[1]["prefill_chunk"], u64::MAX);
    for arm in arms {
        assert!(arm["itl_during"]["n"].as_u64().unwrap() > 0, "{arm}");
        assert!(arm["long_ttft_s"].as_f64().unwrap() > 0.0, "{arm}");
    }
    let s = &r["sessions"];
    assert_eq!(s["ttft"]["n"], 9, "{s}");
    // Turns 2 and 3 of a session: prompts of 40 + 8 + 8 and 56 + 8 + 8 tokens, of which all
    // but the new tokens (and at most one block-boundary token) were seen before.
    let hit = s["hit_share"].as_f64().unwrap();
    assert!(hit > 0.7 && hit < 1.0, "{s}");

    let bad = Command::new(env!("CARGO_BIN_EXE_kvstore"))
        .args(["bench", "serve", "--model"])
        .arg(&model)
        .args(["--streams", "0"])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--streams must be at least 1"));
}
