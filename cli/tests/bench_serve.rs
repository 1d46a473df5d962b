//! `kvstore bench serve` as a user runs it: the built binary on the tiny test model.

use std::path::Path;
use std::process::Command;

/// Every interleave arm and the sessions part run and report; sessions reuse their earlier
/// turns (every turn after the first extends the previous prompt and reply, so almost all
/// of its prompt comes from the prefix cache); bad arguments are refused with a message.
#[test]
fn bench_serve_reports_every_arm_and_the_sessions_hit_share() {
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
    // As served (the chunk in the decode pass), budgeted (1.5 when --itl-stretch is none),
    // the chunk in a pass of its own, the whole prompt.
    let arms = r["interleave"].as_array().unwrap();
    let schedules: Vec<(u64, Option<f64>, bool)> = arms
        .iter()
        .map(|a| {
            (
                a["prefill_chunk"].as_u64().unwrap(),
                a["itl_stretch"].as_f64(),
                a["mixed_steps"].as_bool().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        schedules,
        [
            (16, None, true),
            (16, Some(1.5), true),
            (16, None, false),
            (u64::MAX, None, false)
        ]
    );
    for arm in arms {
        assert!(arm["itl_without"]["n"].as_u64().unwrap() > 0, "{arm}");
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

mod peer;

/// The peer comparison: the same text sessions over HTTP against `kvstore serve` and
/// mlx-lm's `mlx_lm.server`, each started by the benchmark on the tiny model; both arms
/// report every turn, the same completion token count (greedy, no EOS in 6 tokens is not
/// assumed: the counts come from each server's usage), and the throughput ratio.
#[test]
fn bench_serve_runs_the_same_http_sessions_against_kvstore_and_mlx_lm_server() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let Some(python) = peer::python() else {
        return;
    };
    let model = root.join("engine/tests/goldens/tiny-qwen3");
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("serve.json");
    let out = Command::new(env!("CARGO_BIN_EXE_kvstore"))
        .args(["bench", "serve", "--http-only", "--model"])
        .arg(&model)
        .arg("--peer-python")
        .arg(&python)
        .args([
            "--sessions",
            "2",
            "--turns",
            "2",
            "--first-prompt",
            "40",
            "--new-tokens",
            "8",
            "--reply-tokens",
            "6",
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
    assert!(r["interleave"].as_array().unwrap().is_empty(), "{r}");
    assert!(r["sessions"].is_null(), "{r}");
    let arms = r["http_sessions"].as_array().unwrap();
    let servers: Vec<_> = arms.iter().map(|a| a["server"].as_str().unwrap()).collect();
    assert_eq!(servers, ["kvstore serve", "mlx_lm.server"]);
    for arm in arms {
        // 2 sessions x 2 turns, each with a first token.
        assert_eq!(arm["ttft"]["n"], 4, "{arm}");
        let tokens = arm["completion_tokens"].as_u64().unwrap();
        assert!((4..=24).contains(&tokens), "{arm}");
        assert!(arm["completion_tok_per_s"].as_f64().unwrap() > 0.0, "{arm}");
    }
    // kvstore reports cached prompt tokens: turn 2 extends turn 1's prompt and reply.
    assert!(arms[0]["hit_share"].as_f64().unwrap() > 0.3, "{}", arms[0]);
    let ratio = r["http_throughput_ratio"].as_f64().unwrap();
    let expect = arms[0]["completion_tok_per_s"].as_f64().unwrap()
        / arms[1]["completion_tok_per_s"].as_f64().unwrap();
    assert!(
        (ratio - expect).abs() < 1e-9 * expect,
        "{ratio} vs {expect}"
    );
}

/// Without a Hugging Face folder for mlx_lm.server the peer comparison says what to pass.
#[test]
fn bench_serve_peer_needs_a_model_folder() {
    let dir = tempfile::tempdir().unwrap();
    let gguf = dir.path().join("model.gguf");
    std::fs::write(&gguf, b"not a model").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_kvstore"))
        .args(["bench", "serve", "--http-only", "--model"])
        .arg(&gguf)
        .args(["--peer-python", "python3"])
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--peer-model"), "{err}");
}
