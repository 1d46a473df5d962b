//! Prefix reuse through the `kvstore` binary: separate processes sharing one store.

use std::path::Path;
use std::process::Command;

use kvstore_tests::{generate_json, kvstore_bin, smollm2, tiny_model};
use serde_json::Value;

fn generate(model: &Path, store: &Path, prompt: &str, extra: &[&str]) -> Value {
    let mut args = vec![
        "--prompt",
        prompt,
        "--max-tokens",
        "6",
        "--block-size",
        "8",
        // These tests check what each tier serves: no estimate may skip a tier.
        "--restore",
        "always",
    ];
    args.extend(extra);
    generate_json(model, store, &args)
}

#[test]
fn a_second_process_reuses_the_first_ones_blocks_from_ssd() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model("tiny-qwen3");
    let prompt = "Summarize the plot of a long novel about a lighthouse keeper and a storm.";
    let first = generate(&model, dir.path(), prompt, &[]);
    assert_eq!(first["cache"]["cached_tokens"], 0);
    assert!(
        first["cache"]["published_blocks"].as_u64().unwrap() > 2,
        "{first}"
    );
    let second = generate(&model, dir.path(), prompt, &[]);
    let cached = second["cache"]["cached_ssd_tokens"].as_u64().unwrap();
    assert!(
        cached >= 16,
        "the second process restored nothing from SSD: {second}"
    );
    assert_eq!(second["cache"]["cached_ram_tokens"], 0);
    assert_eq!(
        second["tokens"], first["tokens"],
        "restored output differs from cold output"
    );
    // One TTFT: what the user waited for, lookup and restore included.
    assert_eq!(second["timings"]["ttft_s"], second["cache"]["ttft_s"]);
    let c = &second["cache"];
    let parts: f64 = ["lookup_s", "restore_s", "prefill_s"]
        .iter()
        .map(|k| c[k].as_f64().unwrap())
        .sum();
    assert!((c["ttft_s"].as_f64().unwrap() - parts).abs() < 1e-9, "{c}");
    // --no-cache computes everything and still agrees.
    let cold = generate(&model, dir.path(), prompt, &["--no-cache"]);
    assert_eq!(cold["cache"]["cached_tokens"], 0);
    assert_eq!(cold["tokens"], first["tokens"]);
    // Another salt shares nothing.
    let salted = generate(&model, dir.path(), prompt, &["--cache-salt", "tenant-b"]);
    assert_eq!(salted["cache"]["cached_tokens"], 0);
}

#[test]
fn smollm2_greedy_output_is_identical_cold_from_ram_and_from_ssd() {
    let dir = tempfile::tempdir().unwrap();
    let model = smollm2();
    let turn1 = "List three uses of a paperclip, one per line.";
    let cold = generate(&model, dir.path(), turn1, &["--no-cache"]);
    let first = generate(&model, dir.path(), turn1, &[]);
    assert_eq!(first["tokens"], cold["tokens"]);
    // A new process: the prompt's blocks come from SSD.
    let second = generate(&model, dir.path(), turn1, &[]);
    assert!(
        second["cache"]["cached_ssd_tokens"].as_u64().unwrap() >= 16,
        "{second}"
    );
    assert_eq!(
        second["tokens"], cold["tokens"],
        "SSD-restored prefix changed SmolLM2's output"
    );
}

#[test]
fn the_demo_replays_turns_restarts_and_restores_from_ssd() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(kvstore_bin())
        .args([
            "demo",
            "--turns",
            "2",
            "--max-tokens",
            "2",
            "--json",
            "--store",
        ])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "kvstore demo failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let turns = v["turns"].as_array().unwrap();
    assert_eq!(turns.len(), 2);
    assert_eq!(turns[0]["cached_tokens"], 0);
    let t2 = &turns[1];
    assert!(
        t2["cached_device_tokens"].as_u64().unwrap() >= 256,
        "turn 2 should reuse turn 1's prompt from the device tier: {t2}"
    );
    let restart = &v["restart"][0];
    assert_eq!(restart["prompt_tokens"], t2["prompt_tokens"]);
    // The new process finds the conversation on SSD. The cost model restores it where
    // reading beats recomputing: on this CPU always. A GPU recomputes 600 tokens faster
    // than the SSD gives them back, and may skip the blocks (each 32 tokens) it found.
    let restored = restart["cached_ssd_tokens"].as_u64().unwrap();
    let skipped = restart["ssd_blocks_skipped"].as_u64().unwrap() * 32;
    let found = if mlx::default_device().unwrap() == mlx::Device::Cpu {
        restored
    } else {
        restored + skipped
    };
    assert!(
        found >= 256,
        "the new process restored nothing from SSD: {restart}"
    );
    assert_eq!(
        restart["reply"], t2["reply"],
        "the restored turn answered differently"
    );
}
