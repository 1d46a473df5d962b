//! Fault injection against a serving `kvstore` process (docs/reliability.md).
//!
//! - SIGKILL at random points while clients drive heavy store writes, then restart and
//!   replay: every greedy output equals the cold output, orphaned temp files are gone after
//!   the next open, the SSD budget is never exceeded.
//! - A full file system (a 1 MiB tmpfs), a read-only store, the store directory deleted
//!   while serving, and a second server on the same store.
//!
//! `KVSTORE_FAULT_KILLS` (default 20) sets the number of kills; the long run in
//! docs/reliability.md uses 200. `KVSTORE_FAULT_SEED` replays a run. Each test prints a
//! `FIGURES {json}` line with its counts.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvstore_tests::prerequisite;
use kvstore_tests::serve::{files, Serve};
use kvstore_tests::tiny_model;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

const MAX_TOKENS: usize = 6;
/// 128 blocks of the tiny model (8 KiB of KV each at block size 8) and their headers.
const SSD_BUDGET: u64 = 1 << 20;

fn model() -> PathBuf {
    tiny_model("tiny-qwen3")
}

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn seed() -> u64 {
    let seed = env_or("KVSTORE_FAULT_SEED", rand::random::<u32>() as u64);
    println!("KVSTORE_FAULT_SEED={seed}");
    seed
}

/// Families of prompts sharing long prefixes (an agent's turns), 150-400 tokens each.
fn prompts() -> Vec<String> {
    let mut out = Vec::new();
    for family in 0..6 {
        let mut text = format!(
            "Session {family}. You are a careful agent working on a storage engine; \
             you read files, run tests and report what you changed in a few words. "
        );
        for turn in 0..4 {
            text.push_str(&format!(
                "Turn {turn}: the tool returned {} lines of output about module {}. ",
                17 * (family + 1) + turn,
                ["store", "cache", "engine", "server"][turn]
            ));
            out.push(text.clone());
        }
    }
    out
}

fn text(v: &Value) -> String {
    v["choices"][0]["text"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

/// The cold outputs: every prompt through a server without a cache.
fn cold_outputs(prompts: &[String]) -> BTreeMap<String, String> {
    let server = Serve::start(&model(), &["--no-cache"]).unwrap();
    prompts
        .iter()
        .map(|p| {
            let v = server.complete(p, MAX_TOKENS).unwrap();
            (p.clone(), text(&v))
        })
        .collect()
}

/// Starts a server on `store` with small budgets; flags in `extra` replace the defaults.
fn start(store: &Path, extra: &[&str]) -> Result<Serve, String> {
    let store = store.display().to_string();
    let budget = SSD_BUDGET.to_string();
    let defaults = [
        ["--store", store.as_str()],
        ["--block-size", "8"],
        ["--ram-budget", "64KiB"],
        ["--ssd-budget", budget.as_str()],
        ["--max-batch", "4"],
        // The faults are in the host tiers: every block found must be read, not skipped by
        // the restore-or-recompute estimate.
        ["--restore", "always"],
    ];
    let mut args: Vec<&str> = defaults
        .iter()
        .filter(|[flag, _]| !extra.contains(flag))
        .flatten()
        .copied()
        .collect();
    args.extend_from_slice(extra);
    Serve::start(&model(), &args)
}

fn ext_is(p: &Path, ext: &str) -> bool {
    p.extension().is_some_and(|e| e == ext)
}

/// Allocated bytes of the block files (what the SSD budget counts).
fn block_bytes(store: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    files(store)
        .iter()
        .filter(|p| {
            ext_is(p, "safetensors") && !p.components().any(|c| c.as_os_str() == "quarantine")
        })
        .filter_map(|p| std::fs::metadata(p).ok())
        .map(|m| m.blocks() * 512)
        .sum()
}

/// Bytes of temporary files (writes a kill interrupted).
fn temp_bytes(store: &Path) -> u64 {
    files(store)
        .iter()
        .filter(|p| ext_is(p, "tmp"))
        .filter_map(|p| std::fs::metadata(p).ok())
        .map(|m| m.len())
        .sum()
}

/// Store directories are 0700 and files 0600: prompts' KV is private to the user.
fn assert_private(store: &Path) {
    use std::os::unix::fs::PermissionsExt;
    let mode = |p: &Path| std::fs::metadata(p).map(|m| m.permissions().mode() & 0o777);
    for f in files(store) {
        if let Ok(m) = mode(&f) {
            assert_eq!(m, 0o600, "{} has mode {m:o}", f.display());
        }
    }
    for d in walk_dirs(store) {
        if let Ok(m) = mode(&d) {
            assert_eq!(m, 0o700, "{} has mode {m:o}", d.display());
        }
    }
}

/// Every file under `dir` with its bytes.
fn contents(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    files(dir)
        .into_iter()
        .map(|p| (p.clone(), std::fs::read(&p).unwrap()))
        .collect()
}

fn walk_dirs(dir: &Path) -> Vec<PathBuf> {
    let mut out = vec![dir.to_path_buf()];
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if e.path().is_dir() {
            out.extend(walk_dirs(&e.path()));
        }
    }
    out
}

#[test]
fn sigkill_while_serving_then_replay_matches_cold() {
    let kills = env_or("KVSTORE_FAULT_KILLS", 20) as usize;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed());
    let prompts = Arc::new(prompts());
    let cold = Arc::new(cold_outputs(&prompts));
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");

    let compared = Arc::new(AtomicUsize::new(0));
    let wrong: Arc<Mutex<Vec<String>>> = Arc::default();
    let mut replayed = 0;
    let mut orphan_bytes_at_kill = Vec::new();
    let mut recover_s = Vec::new();
    let mut max_block_bytes = 0;
    for kill in 0..=kills {
        // Restart: the store is opened again; orphans of the killed writer must be gone.
        let t = Instant::now();
        let server = start(&store, &[]).unwrap_or_else(|log| panic!("kill {kill}: {log}"));
        recover_s.push(t.elapsed().as_secs_f64());
        assert_eq!(
            temp_bytes(&store),
            0,
            "kill {kill}: orphaned temp files survived the open"
        );
        assert!(
            block_bytes(&store) <= SSD_BUDGET,
            "kill {kill}: over the SSD budget"
        );
        assert_private(&store);
        // Replay: prompts answered from whatever the killed server left must equal cold.
        let last = kill == kills;
        let replay: Vec<&String> = if last {
            prompts.iter().collect()
        } else {
            (0..2)
                .map(|_| &prompts[rng.gen_range(0..prompts.len())])
                .collect()
        };
        for p in replay {
            let v = server.complete(p, MAX_TOKENS).unwrap();
            replayed += 1;
            if text(&v) != cold[p] {
                wrong
                    .lock()
                    .unwrap()
                    .push(format!("replay after kill {kill}: {p:?}"));
            }
        }
        if last {
            break;
        }
        // Heavy writes: clients send distinct long prompts while the server publishes.
        let stop = Arc::new(AtomicBool::new(false));
        let clients: Vec<_> = (0..3)
            .map(|c| {
                let (stop, prompts, cold, compared, wrong) = (
                    stop.clone(),
                    prompts.clone(),
                    cold.clone(),
                    compared.clone(),
                    wrong.clone(),
                );
                let port = server.port;
                let mut rng = rand::rngs::StdRng::seed_from_u64(kill as u64 * 10 + c);
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        let p = &prompts[rng.gen_range(0..prompts.len())];
                        let body = json!({"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0});
                        let Ok((200, body)) = kvstore_tests::serve::http(
                            port,
                            "POST",
                            "/v1/completions",
                            &body.to_string(),
                        ) else {
                            continue; // the kill cut this request off
                        };
                        let Ok(v) = serde_json::from_str::<Value>(&body) else {
                            continue;
                        };
                        compared.fetch_add(1, Ordering::Relaxed);
                        if text(&v) != cold[p] {
                            wrong.lock().unwrap().push(format!("under load: {p:?}"));
                        }
                    }
                })
            })
            .collect();
        // Kill at a random point once writes are under way: after the first answer of
        // this round (its blocks are being published), however slow the machine is.
        let before = compared.load(Ordering::Relaxed);
        let t = Instant::now();
        while compared.load(Ordering::Relaxed) == before && t.elapsed() < Duration::from_secs(30) {
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_millis(rng.gen_range(0..500)));
        let mut server = server;
        server.kill();
        stop.store(true, Ordering::Relaxed);
        for c in clients {
            c.join().unwrap();
        }
        orphan_bytes_at_kill.push(temp_bytes(&store));
        let bytes = block_bytes(&store);
        max_block_bytes = max_block_bytes.max(bytes);
        assert!(
            bytes <= SSD_BUDGET,
            "kill {kill}: {bytes} bytes of blocks, budget {SSD_BUDGET}"
        );
    }
    let wrong = wrong.lock().unwrap();
    let leaked: u64 = orphan_bytes_at_kill.iter().sum();
    let figures = json!({
        "test": "sigkill_while_serving",
        "kills": kills,
        "outputs_compared": compared.load(Ordering::Relaxed) + replayed,
        "wrong_outputs": wrong.len(),
        "kills_leaving_temp_files": orphan_bytes_at_kill.iter().filter(|b| **b > 0).count(),
        "temp_bytes_left_by_kills": leaked,
        "temp_bytes_after_reopen": 0,
        "max_block_bytes": max_block_bytes,
        "ssd_budget": SSD_BUDGET,
        "restart_to_listening_s": {
            "median": median(&mut recover_s.clone()),
            "max": recover_s.iter().cloned().fold(0.0, f64::max),
        },
    });
    println!("FIGURES {figures}");
    assert!(
        wrong.is_empty(),
        "{} wrong outputs: {:?}",
        wrong.len(),
        &wrong[..wrong.len().min(5)]
    );
    assert!(
        compared.load(Ordering::Relaxed) >= kills,
        "the clients got no answer in some rounds; the kills did not hit a writing server"
    );
}

fn median(xs: &mut [f64]) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs.get(xs.len() / 2).copied().unwrap_or(0.0)
}

/// Mounts a tmpfs of `size` at `dir` (root only); `None`, after
/// [`prerequisite::missing`] said why, when the sandbox does not allow it (under CI, which
/// runs as root on a fresh VM, the test fails instead).
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(dir: &Path, size: &str) -> Option<Tmpfs> {
        std::fs::create_dir_all(dir).unwrap();
        let status = Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size},mode=0700"),
                "tmpfs",
            ])
            .arg(dir)
            .output();
        match status {
            Ok(o) if o.status.success() => Some(Tmpfs(dir.to_path_buf())),
            other => {
                prerequisite::missing(
                    &format!("`mount -t tmpfs` is not permitted here ({other:?})"),
                    "run it as root where mounts are allowed",
                );
                None
            }
        }
    }

    fn remount_read_only(&self) {
        let ok = Command::new("mount")
            .args(["-o", "remount,ro"])
            .arg(&self.0)
            .status()
            .unwrap();
        assert!(ok.success(), "remount read-only failed");
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

#[test]
fn a_full_disk_shrinks_the_ssd_tier_and_keeps_serving_correct_outputs() {
    let dir = tempfile::tempdir().unwrap();
    let Some(_fs) = Tmpfs::mount(&dir.path().join("mnt"), "1m") else {
        return;
    };
    let store = dir.path().join("mnt/store");
    let prompts = prompts();
    let cold = cold_outputs(&prompts);
    // The budget is far above what the file system holds: the disk, not the budget, fills.
    let mut server = start(&store, &["--ssd-budget", "1GiB"]).unwrap();
    for round in 0..2 {
        for p in &prompts {
            let v = server.complete(p, MAX_TOKENS).unwrap();
            assert_eq!(text(&v), cold[p], "round {round}: {p:?}");
        }
        let (status, body) = server.http("POST", "/admin/cache/flush", "").unwrap();
        // A flush that could not write everything says so; the server keeps going.
        assert!(status == 200 || status >= 500, "{status} {body}");
    }
    // The tier shrank its budget to what the file system holds instead of failing writes.
    let stats = server.store_stats();
    let budget = stats["ssd_budget"].as_u64().unwrap();
    assert!(
        budget < 1 << 20,
        "the SSD budget did not shrink to the disk: {stats}"
    );
    assert!(stats["ssd_evictions"].as_u64().unwrap() > 0, "{stats}");
    assert!(server.running());
    let log = server.log();
    assert!(
        log.contains("the file system is full"),
        "the log does not say why: {log}"
    );
    let exit = server.terminate().unwrap();
    // The journal gave way to the full disk; the graceful shutdown still flushes and exits 0.
    assert!(exit.success(), "{exit}: {}", server.log());
    // What reached the disk verifies, and a restart on the full disk serves correctly.
    let inspect = Command::new(kvstore_tests::kvstore_bin())
        .args(["inspect", "--verify", "--store"])
        .arg(&store)
        .output()
        .unwrap();
    assert!(
        inspect.status.success(),
        "{}{}",
        String::from_utf8_lossy(&inspect.stdout),
        String::from_utf8_lossy(&inspect.stderr)
    );
    assert_eq!(temp_bytes(&store), 0);
    let server = start(&store, &["--ssd-budget", "1GiB"]).unwrap();
    for p in &prompts {
        assert_eq!(text(&server.complete(p, MAX_TOKENS).unwrap()), cold[p]);
    }
    println!(
        "FIGURES {}",
        json!({"test": "enospc", "tmpfs_bytes": 1 << 20, "budget_shrunk_to": budget, "write_errors": stats["write_errors"], "blocks_written": stats["blocks_written"], "ssd_evictions": stats["ssd_evictions"], "wrong_outputs": 0})
    );
}

#[test]
fn a_read_only_store_is_served_without_writing() {
    let dir = tempfile::tempdir().unwrap();
    let Some(fs) = Tmpfs::mount(&dir.path().join("mnt"), "16m") else {
        return;
    };
    let store = dir.path().join("mnt/store");
    let prompts = prompts();
    let cold = cold_outputs(&prompts[..4]);
    let mut server = start(&store, &["--ram-budget", "0"]).unwrap();
    for p in &prompts[..4] {
        server.complete(p, MAX_TOKENS).unwrap();
    }
    assert!(server.terminate().unwrap().success());
    let before = contents(&store);
    fs.remount_read_only();

    let server =
        start(&store, &[]).unwrap_or_else(|log| panic!("refused a read-only store: {log}"));
    assert!(
        server.log().contains("read-only"),
        "no warning about the read-only store: {}",
        server.log()
    );
    for p in &prompts[..4] {
        let v = server.complete(p, MAX_TOKENS).unwrap();
        assert_eq!(text(&v), cold[p]);
        assert!(
            v["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap()
                > 0,
            "the read-only store's blocks were not used: {v}"
        );
    }
    // New prompts are answered too (their blocks stay in RAM).
    let fresh = format!("{} A new question nobody asked before.", prompts[7]);
    assert!(server.complete(&fresh, MAX_TOKENS).is_ok());
    drop(server);
    let after = contents(&store);
    assert_eq!(before, after, "a read-only store changed");
}

#[test]
fn deleting_the_store_while_serving_loses_nothing_but_the_cache() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let prompts = prompts();
    let cold = cold_outputs(&prompts);
    let mut server = start(&store, &[]).unwrap();
    for p in &prompts[..8] {
        assert_eq!(text(&server.complete(p, MAX_TOKENS).unwrap()), cold[p]);
    }
    server.http("POST", "/admin/cache/flush", "").unwrap();
    std::fs::remove_dir_all(&store).unwrap();
    for round in 0..2 {
        for p in &prompts {
            let v = server.complete(p, MAX_TOKENS).unwrap();
            assert_eq!(text(&v), cold[p], "round {round}");
        }
    }
    assert!(server.running(), "the server died: {}", server.log());
    let (status, health) = server.http("GET", "/health", "").unwrap();
    assert_eq!(status, 200, "{health}");
    let exit = server.terminate().unwrap();
    // The flush at shutdown cannot succeed, and says why (exit status 1).
    assert!(!exit.success());
    assert!(
        server.log().contains("the store directory is gone"),
        "{}",
        server.log()
    );
    // The next start makes a fresh store where the old one was and serves correctly.
    let server = start(&store, &[]).unwrap();
    for p in &prompts[..4] {
        assert_eq!(text(&server.complete(p, MAX_TOKENS).unwrap()), cold[p]);
    }
}

#[test]
fn a_second_server_on_the_same_store_is_refused_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let prompts = prompts();
    let cold = cold_outputs(&prompts[..2]);
    let first = start(&store, &[]).unwrap();
    first.complete(&prompts[0], MAX_TOKENS).unwrap();
    let err = match start(&store, &[]) {
        Ok(_) => panic!("two servers opened one store for writing"),
        Err(log) => log,
    };
    assert!(err.contains("already open for writing"), "{err}");
    assert!(err.contains(&format!("pid {}", first.pid())), "{err}");
    // The first one is unharmed.
    for p in &prompts[..2] {
        assert_eq!(text(&first.complete(p, MAX_TOKENS).unwrap()), cold[p]);
    }
}
