//! `kvstore serve` with the default SmolLM2 model as a separate process, driven by the
//! official `anthropic` Python SDK (scripts/tests/anthropic_messages.py, from the venv
//! scripts/setup.sh makes): messages.create and messages.stream with tools and
//! cache_control, usage checked, a breakpoint read back from the cache within its TTL, and
//! again after other traffic evicted an unpinned prompt from every tier.

use std::path::PathBuf;
use std::process::Command;

use kvstore_tests::prerequisite;
use kvstore_tests::serve::Serve;
use serde_json::Value;

fn python() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.venv-test/bin/python");
    assert!(
        p.is_file(),
        "{} is missing: run `bash scripts/setup.sh` (it makes .venv-test with the anthropic SDK)",
        p.display()
    );
    p
}

fn total(u: &Value) -> u64 {
    [
        "input_tokens",
        "cache_creation_input_tokens",
        "cache_read_input_tokens",
    ]
    .iter()
    .map(|k| {
        u[k].as_u64()
            .unwrap_or_else(|| panic!("usage.{k} missing: {u}"))
    })
    .sum()
}

fn read(u: &Value) -> u64 {
    u["cache_read_input_tokens"].as_u64().unwrap()
}

#[test]
fn the_anthropic_sdk_reads_a_pinned_breakpoint_back_after_forced_evictions() {
    let model =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !model.is_file() {
        prerequisite::missing(
            "the SmolLM2 model is not in models/",
            "run `bash scripts/setup.sh`",
        );
        return;
    }
    let store = tempfile::tempdir().unwrap();
    let store_arg = store.path().display().to_string();
    // Budgets that hold about two conversations in each tier: the traffic in between
    // evicts whatever is not pinned from the device, from RAM and from SSD.
    let server = Serve::start(
        &model,
        &[
            "--store",
            &store_arg,
            "--block-size",
            "16",
            "--kv-budget",
            "40MiB",
            "--ram-budget",
            "24MiB",
            "--ssd-budget",
            "32MiB",
            "--api-key",
            "sk-ant-test",
        ],
    )
    .unwrap_or_else(|log| panic!("{log}"));
    let out = Command::new(python())
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../scripts/tests/anthropic_messages.py"
        ))
        .arg(format!("http://127.0.0.1:{}", server.port))
        .arg("sk-ant-test")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "the anthropic SDK failed: {}\nserver log:\n{}",
        String::from_utf8_lossy(&out.stderr),
        server.log()
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();

    let create = &v["create"];
    assert_eq!(create["type"], "message", "{v}");
    assert_eq!(create["role"], "assistant");
    let u = &create["usage"];
    assert_eq!(total(u), v["count_tokens"].as_u64().unwrap(), "{u}");
    assert_eq!(read(u), 0, "a fresh server read from the cache: {u}");
    let created = u["cache_creation_input_tokens"].as_u64().unwrap();
    assert!(created > 100, "the breakpoint wrote too little: {u}");
    assert!(u["input_tokens"].as_u64().unwrap() > 0, "{u}");

    let stream = &v["stream"];
    let events: Vec<&str> = stream["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e.as_str().unwrap())
        .collect();
    assert_eq!(events.first(), Some(&"message_start"), "{events:?}");
    assert_eq!(events.last(), Some(&"message_stop"), "{events:?}");
    assert!(events.contains(&"content_block_start") && events.contains(&"message_delta"));
    let u = &stream["usage"];
    assert!(
        read(u) >= created,
        "the streamed request did not read the breakpoint's {created} tokens: {u}"
    );
    assert_eq!(u["cache_creation_input_tokens"], 0, "{u}");

    // The round trip's top-level cache_control wrote the rest of its conversation.
    let u = &v["tool_round_trip"]["usage"];
    assert!(read(u) >= created, "{u}");
    assert!(
        u["cache_creation_input_tokens"].as_u64().unwrap() > 0,
        "{u}"
    );

    // The unpinned prompt was cached before the traffic and evicted by it.
    let unpinned_prompt = total(&v["unpinned_first"]);
    let before = read(&v["unpinned_again"]);
    let after = read(&v["unpinned_after"]);
    assert!(before >= unpinned_prompt / 2, "{v}");
    assert!(
        after < unpinned_prompt / 2,
        "the other traffic evicted nothing ({before} then {after} of {unpinned_prompt} read), \
         so the pin was never tested"
    );
    // The pinned breakpoint survived it.
    let u = &v["pinned_after"];
    assert!(
        read(u) >= created,
        "the pinned breakpoint's {created} tokens were evicted: {u}"
    );

    let e = &v["error"];
    assert_eq!(e["status"], 400, "{v}");
    assert_eq!(e["type"], "invalid_request_error");
    assert!(e["message"].as_str().unwrap().contains("no_such_tool"));
}
