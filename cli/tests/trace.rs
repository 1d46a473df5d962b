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
    // Left to prefill with the ideal's hits: 1024, 512, then 1 each (a whole hit still
    // computes its last token) against prompts of 1024, 512, 1024, 512, 1024: nearest rank
    // of five, P50 is the 3rd (1 of 1024), P90 and P99 the 5th (1024 of 1024).
    let ideal = &v["ideal_prefill_bound"];
    assert_eq!(ideal["no_cache"]["p50"], 1024.0);
    assert_eq!(ideal["cached"]["p50"], 1.0);
    assert_eq!(ideal["ratio"]["p50"], 1.0 / 1024.0);
    assert_eq!(ideal["ratio"]["p99"], 1.0);
    assert!(
        stdout.contains("with the ideal's hits / without a cache, P50 / P90 / P99: 0.001 / 1.000 / 1.000 (1 / 1024 / 1024 of 1024 / 1024 / 1024 tokens)"),
        "{stdout}"
    );
    // LRU at two blocks hits nothing: every request prefills its whole prompt.
    assert_eq!(b["prefill_bound"]["lru"]["ratio"]["p50"], 1.0);
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

/// `kvstore serve` on the tiny model at an ephemeral port; returns it and its address.
fn serve(dir: &Path) -> (std::process::Child, String) {
    use std::io::{BufRead, BufReader};
    let tiny = Path::new(env!("CARGO_MANIFEST_DIR")).join("../engine/tests/goldens/tiny-qwen3");
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvstore"))
        .args(["serve", "--block-size", "8", "--port", "0", "--model"])
        .arg(tiny)
        .arg("--store")
        .arg(dir)
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let addr = loop {
        let line = lines.next().expect("serve ended before listening").unwrap();
        if let Some(a) = line.strip_prefix("kvstore serve: listening on ") {
            break a.trim().to_string();
        }
    };
    // Keep reading its log so that it never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines {});
    (child, addr)
}

/// Over HTTP, one request at a time, the server's `cached_tokens` are the ideal up to
/// `len - 1` (the device tier, token by token), found through a whole kvstore block: at 8
/// tokens a block (trace and kvstore) the fixture's prompts are [A B] 16, [X] 8, [A B] 16,
/// [X] 8, [A B] 16 tokens, ideal 0, 0, 16, 8, 16, served 0, 0, 15, 0, 15. The second [X]
/// could reuse at most 7 tokens, less than one kvstore block, and the device tier finds a
/// resident sequence by the keys of the prompt's whole blocks: none. Every request
/// generates its 16 / 64 -> 1 token.
#[test]
fn replay_over_http_reads_the_servers_cached_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let (mut server, url) = serve(&dir.path().join("store"));
    let json = dir.path().join("http.json");
    let f = fixture();
    let out = kvstore(&[
        "bench",
        "trace",
        f.to_str().unwrap(),
        "--speed",
        "1000",
        "--max-concurrency",
        "1",
        "--token-scale",
        "0.015625",
        "--url",
        &url,
        "--vocab",
        "320",
        "--json",
        json.to_str().unwrap(),
    ]);
    let _ = server.kill();
    let _ = server.wait();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(v["schema"], "kvstore.bench.trace.replay.v1");
    let rows = v["requests"].as_array().unwrap();
    let col = |k: &str| -> Vec<u64> { rows.iter().map(|r| r[k].as_u64().unwrap()).collect() };
    assert_eq!(col("prompt_len"), vec![16, 8, 16, 8, 16]);
    assert_eq!(col("prompt_tokens"), vec![16, 8, 16, 8, 16]);
    assert_eq!(col("ideal_tokens"), vec![0, 0, 16, 8, 16]);
    assert_eq!(col("cached_tokens"), vec![0, 0, 15, 0, 15]);
    assert_eq!(col("completion_tokens"), vec![1; 5]);
    for r in rows {
        assert!(r["error"].is_null(), "{r}");
        assert!(
            r["ttft_s"].as_f64().unwrap() <= r["e2e_s"].as_f64().unwrap(),
            "{r}"
        );
    }
    assert_eq!(v["overall"]["cached_tokens"], 30);
    // Left to prefill: 16, 8, 1, 8, 1 with the server's hits, 16, 8, 1, 1, 1 with the
    // ideal's, against prompts 16, 8, 16, 8, 16: the 3rd of five is 8 and 1 of 16.
    let bound = &v["prefill_bound"];
    assert_eq!(bound["hits"]["ratio"]["p50"], 0.5);
    assert_eq!(bound["ideal"]["ratio"]["p50"], 0.0625);
    assert_eq!(bound["hits"]["ratio"]["p90"], 1.0);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("with this run's hits 0.500 / 1.000 / 1.000 (8 / 16 / 16 of 16 / 16 / 16 tokens); with the ideal's 0.062 /"),
        "{stdout}"
    );
    // Every request has its own timestamp: each is the first of its burst.
    let places = v["burst_places"].as_array().unwrap();
    assert_eq!(places.len(), 1, "{places:?}");
    assert_eq!(places[0]["places"], "1st");
    assert_eq!(places[0]["requests"], 5);
    assert!(
        places[0]["queue_p50_s"].is_null(),
        "HTTP reports no queue time"
    );
    assert!(stdout
        .contains("by place in a burst (requests with one timestamp), medians: 1st 5 req: TTFT "));
    // The server's counters say where the hits came from: all from the device tier.
    let delta = &v["counters"]["server_metrics_delta"];
    assert_eq!(
        delta["kvstore_cached_prompt_tokens_total{tier=\"device\"}"],
        30.0
    );
}

/// In process, the same fixture gets the same hits as over HTTP (the same engine, found the
/// same way); a second arm without the cache draws both arms in one plot (`--compare`), and
/// says that the two ran with different device KV budgets.
#[test]
fn in_process_arms_share_a_plot() {
    let dir = tempfile::tempdir().unwrap();
    let tiny = Path::new(env!("CARGO_MANIFEST_DIR")).join("../engine/tests/goldens/tiny-qwen3");
    let f = fixture();
    let (first, second, svg, steps) = (
        dir.path().join("a.json"),
        dir.path().join("b.json"),
        dir.path().join("ab.svg"),
        dir.path().join("a.steps.jsonl"),
    );
    let run = |extra: &[&str]| {
        let mut args = vec![
            "bench",
            "trace",
            f.to_str().unwrap(),
            "--speed",
            "1000",
            "--max-concurrency",
            "1",
            "--token-scale",
            "0.015625",
            "--block-size",
            "8",
            "--model",
            tiny.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        let out = kvstore(&args);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let cached = run(&[
        "--label",
        "cached",
        "--kv-budget",
        "64MiB",
        "--json",
        first.to_str().unwrap(),
        "--step-log",
        steps.to_str().unwrap(),
    ]);
    assert!(!cached.contains("note:"), "{cached}");
    // The arms' device KV budgets differ (64 MiB against the default 4 GiB): said.
    let cold = run(&[
        "--no-cache",
        "--label",
        "cold",
        "--compare",
        first.to_str().unwrap(),
        "--json",
        second.to_str().unwrap(),
        "--svg",
        svg.to_str().unwrap(),
    ]);
    assert!(
        cold.contains("ran with a device KV budget of 64MiB, this run with 4GiB"),
        "{cold}"
    );
    let hits = |p: &Path| -> Vec<u64> {
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap();
        v["requests"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["cached_tokens"].as_u64().unwrap())
            .collect()
    };
    assert_eq!(hits(&first), vec![0, 0, 15, 0, 15]);
    assert_eq!(hits(&second), vec![0; 5]);
    // The store's own policy simulated at the tiers' budget (here far above the fixture's
    // 64 prompt tokens, so it hits the ideal's 40), beside what the run got (30 of 64).
    let json = |p: &Path| -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap()
    };
    let (a, b) = (json(&first), json(&second));
    assert_eq!(a["policy_simulated"], "freq-admit");
    assert_eq!(a["overall"]["policy_share"], 0.625);
    assert_eq!(a["overall"]["policy_share"], a["overall"]["ideal_share"]);
    assert!(
        cached.contains("freq-admit with one perfect tier 62.5% (the run got 0.750 of it)"),
        "{cached}"
    );
    // The step log names every request's prefill by the id its JSON carries: each of the
    // five requests (one at a time) is prefilled in a step of engine 0, after the replay
    // began, and its steps run in order.
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&steps)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let ids: Vec<u64> = a["requests"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["request_id"].as_u64().expect("a request without its id"))
        .collect();
    let prefilled: Vec<u64> = lines
        .iter()
        .filter_map(|l| l["step"]["prefilled"][0].as_u64())
        .collect();
    assert_eq!(prefilled, ids, "{lines:?}");
    let at: Vec<f64> = lines.iter().map(|l| l["t_s"].as_f64().unwrap()).collect();
    assert!(
        at[0] >= 0.0 && at.windows(2).all(|w| w[0] <= w[1]),
        "{at:?}"
    );
    assert!(lines.iter().all(|l| l["engine"] == 0));
    // Without a cache there is no policy to simulate.
    assert!(b["policy_simulated"].is_null() && b["overall"]["policy_share"].is_null());
    // The transfer pool's threads are recorded where copies go through a driver (CUDA),
    // null on the CPU.
    let v = a;
    assert_eq!(v["target"]["device_tier"], "inclusive");
    let threads = v["target"]
        .get("transfer_threads")
        .expect("no transfer_threads in the target");
    assert!(
        threads.is_null() || threads.as_u64().is_some_and(|n| n >= 1),
        "{threads}"
    );
    let svg = std::fs::read_to_string(&svg).unwrap();
    for name in [
        ">cached<",
        ">cold<",
        ">cached (5 requests)<",
        ">cold (5 requests)<",
    ] {
        assert!(svg.contains(name), "{name} missing: {svg}");
    }
}

/// Output piped into a reader that stops early (`| head -1`) ends kvstore quietly, as it
/// does other Unix tools: killed by SIGPIPE, not a panic about a broken pipe.
#[test]
fn a_reader_that_stops_early_ends_the_output_without_a_panic() {
    use std::io::Read;
    use std::os::unix::process::ExitStatusExt;
    use std::process::Stdio;
    let f = fixture();
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvstore"))
        .args(["bench", "trace", f.to_str().unwrap(), "--simulate"])
        .args(["--budget-tokens", "512", "--budget-tokens", "1024"])
        .args(["--budget-tokens", "2048", "--budget-tokens", "4096"])
        .env("RUST_BACKTRACE", "0")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Read nothing: close the pipe at once, so that every line kvstore prints meets it.
    drop(child.stdout.take());
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    let status = child.wait().unwrap();
    assert!(!err.contains("panicked"), "{err}");
    assert!(
        status.success() || status.signal() == Some(libc_sigpipe()),
        "{status:?}: {err}"
    );
}

/// SIGPIPE's number on Linux and macOS.
fn libc_sigpipe() -> i32 {
    13
}

/// `--eviction` takes the store's policy names and refuses others, naming them.
#[test]
fn an_unknown_eviction_policy_is_refused_with_the_names() {
    let f = fixture();
    let with = |policy: &str| {
        let file = f.to_str().unwrap();
        kvstore(&[
            "bench",
            "trace",
            file,
            "--simulate",
            "--budget-tokens",
            "1024",
            "--eviction",
            policy,
        ])
    };
    let out = with("random");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("unknown eviction policy \"random\": one of lru, lfu, freq-admit"),
        "{stderr}"
    );
    for ok in ["lru", "lfu", "freq-admit"] {
        let out = with(ok);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{ok}: {stderr}");
    }
}

#[test]
fn several_engines_need_the_remote_tier_they_share() {
    let f = fixture();
    let file = f.to_str().unwrap();
    let out = kvstore(&["bench", "trace", file, "--engines", "2"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("--engines 2 shares blocks between the engines through the remote tier"),
        "{stderr}"
    );
    let out = kvstore(&["bench", "trace", file, "--engines", "2", "--no-cache"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("not with --url, --peer-python or --no-cache"),
        "{stderr}"
    );
    assert!(!out.status.success());
}

mod peer;

/// The peer arm: the small fixture replayed against mlx_lm.server, started by the benchmark
/// on the tiny model; every request answers, and the report says what it is (its target,
/// the prompts sent as text, and how much of them re-tokenizes to the same ids).
#[test]
fn replay_against_mlx_lm_server_sends_text_and_reports_the_round_trip() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let Some(python) = peer::python() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("peer.json");
    let f = fixture();
    let model = root.join("engine/tests/goldens/tiny-qwen3");
    let out = kvstore(&[
        "bench",
        "trace",
        f.to_str().unwrap(),
        "--token-scale",
        "0.015625",
        "--speed",
        "100",
        "--model",
        model.to_str().unwrap(),
        "--peer-python",
        python.to_str().unwrap(),
        "--kv-budget",
        "4MiB",
        "--json",
        json.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("re-tokenizing the prompts' text gives back"),
        "{stdout}"
    );
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(v["target"]["name"], "mlx_lm.server");
    assert_eq!(v["target"]["prompt_cache_bytes"], 4 << 20);
    let share = v["target"]["retokenized_prefix_share"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&share), "{share}");
    assert_eq!(v["overall"]["requests"], 5);
    assert_eq!(v["overall"]["failed"], 0, "{v}");
    for r in v["requests"].as_array().unwrap() {
        assert!(r["ttft_s"].as_f64().is_some_and(|t| t > 0.0), "{r}");
    }
}
