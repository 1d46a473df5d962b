//! Random bit flips and truncations across the block files of a real conversation: every
//! one is detected, no corrupted block is restored, and the greedy output still equals the
//! cold output (docs/reliability.md).
//!
//! Each trial restores the pristine store, damages one block file (a flipped bit anywhere,
//! a flipped bit in the header, or a truncation), opens the prefix cache as a fresh process
//! would, and serves the conversation's next prompt through the same path the server uses
//! (`KvTiers::prepare` then generation). `KVSTORE_FAULT_FLIPS` sets the trial count
//! (default 1000); `KVSTORE_FAULT_SEED` replays a run.

use std::path::{Path, PathBuf};
use std::time::Instant;

use engine::{generate, load, KvTiers, LoadOptions, Model, ReuseConfig, Tokenizer};
use kvstore_tests::tiny_model;
use kvstore_tests::turns::params;
use rand::{Rng, SeedableRng};
use serde_json::json;
use store::StoreConfig;

const BLOCK: usize = 8;

fn open(model: &Model, tok: &Tokenizer, root: &Path) -> KvTiers {
    let config = ReuseConfig {
        store: StoreConfig::default().root(root),
        block_size: BLOCK,
        // Every corrupt block must be read to be detected: no estimate may skip it.
        restore_always: true,
        ..ReuseConfig::default()
    };
    KvTiers::open(model, tok, config).unwrap()
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap().flatten() {
        let target = to.join(e.file_name());
        if e.path().is_dir() {
            copy_dir(&e.path(), &target);
        } else {
            std::fs::copy(e.path(), &target).unwrap();
        }
    }
}

/// The safetensors header's length (the first 8 bytes, little-endian) plus those 8 bytes.
fn header_end(bytes: &[u8]) -> usize {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    (8 + n).min(bytes.len())
}

#[test]
fn every_flip_and_truncation_is_detected_and_never_served() {
    let trials = std::env::var("KVSTORE_FAULT_FLIPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000usize);
    let seed = std::env::var("KVSTORE_FAULT_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(rand::random::<u32>) as u64;
    println!("KVSTORE_FAULT_SEED={seed}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let (model, tok) = load(&tiny_model("tiny-qwen3"), &LoadOptions::default()).unwrap();

    // A first turn publishes its blocks; the next prompt extends it past every block.
    let dir = tempfile::tempdir().unwrap();
    let pristine = dir.path().join("pristine");
    let first = tok
        .encode(
            "An agent's first turn: read the file store/src/ssd.rs and explain the write path \
             in order: temp file, fsync, rename, directory fsync, journal record.",
            true,
        )
        .unwrap();
    {
        let prefix = open(&model, &tok, &pristine);
        let mut p = prefix.prepare(&first).unwrap();
        let out = generate(&model, &tok, &mut p.cache, &first, &params(4), &mut |_| {
            true
        })
        .unwrap();
        let all: Vec<u32> = first.iter().chain(&out.tokens).copied().collect();
        prefix.publish(&mut p.chain, &mut p.cache, &all).unwrap();
        prefix.flush().unwrap();
    }
    let mut next = first.clone();
    next.extend(tok.encode(" Now list the crash cases.", false).unwrap());
    let cold = {
        let mut cache = model.new_cache();
        generate(&model, &tok, &mut cache, &next, &params(4), &mut |_| true)
            .unwrap()
            .tokens
    };

    // Every block file, with its position in the prompt's chain.
    let (files, ns_keys) = {
        let prefix = open(&model, &tok, &pristine);
        let ssd = prefix.store().ssd().unwrap();
        let reusable = &next[..next.len() - 1];
        let keys = store::chain_keys(prefix.namespace(), reusable, BLOCK);
        let files: Vec<(usize, PathBuf)> = keys
            .iter()
            .enumerate()
            .map(|(i, k)| (i, ssd.block_path(prefix.namespace(), *k)))
            .filter(|(_, p)| p.is_file())
            .collect();
        let report = prefix.prepare(&next).unwrap().report;
        assert_eq!(report.cached_ssd_tokens, files.len() * BLOCK, "{report:?}");
        (files, keys.len())
    };
    assert!(files.len() >= 8, "only {} block files", files.len());
    println!("{} block files on the chain of {ns_keys} keys", files.len());

    let live = dir.path().join("live");
    let (mut flips, mut header_flips, mut truncations) = (0, 0, 0);
    let mut wrong = Vec::new();
    let mut undetected = Vec::new();
    let mut served = Vec::new();
    let start = Instant::now();
    for trial in 0..trials {
        let _ = std::fs::remove_dir_all(&live);
        copy_dir(&pristine, &live);
        let (index, path) = &files[rng.gen_range(0..files.len())];
        let path = live.join(path.strip_prefix(&pristine).unwrap());
        let mut bytes = std::fs::read(&path).unwrap();
        let what = match rng.gen_range(0..4) {
            0 => {
                let len = rng.gen_range(0..bytes.len());
                bytes.truncate(len);
                truncations += 1;
                format!("truncated to {len}")
            }
            1 => {
                let at = rng.gen_range(0..header_end(&bytes));
                let bit = rng.gen_range(0..8);
                bytes[at] ^= 1 << bit;
                header_flips += 1;
                format!("header bit {bit} of byte {at}")
            }
            _ => {
                let at = rng.gen_range(0..bytes.len());
                let bit = rng.gen_range(0..8);
                bytes[at] ^= 1 << bit;
                flips += 1;
                format!("bit {bit} of byte {at}")
            }
        };
        std::fs::write(&path, &bytes).unwrap();

        let prefix = open(&model, &tok, &live);
        let p = prefix.prepare(&next).unwrap();
        let (mut cache, report) = (p.cache, p.report);
        let out = generate(&model, &tok, &mut cache, &next, &params(4), &mut |_| true).unwrap();
        let stats = prefix.stats();
        let case = format!("trial {trial}: block {index}, {what}");
        if out.tokens != cold {
            wrong.push(case.clone());
        }
        if report.cached_tokens > index * BLOCK {
            served.push(format!("{case}: {} tokens restored", report.cached_tokens));
        }
        let detected = stats.verify_failures > 0
            || stats.quarantined > 0
            || stats.ssd_blocks < files.len() as u64;
        if !detected {
            undetected.push(format!("{case}: {stats:?}"));
        }
    }
    let figures = json!({
        "test": "bit_flips",
        "trials": trials,
        "bit_flips": flips,
        "header_bit_flips": header_flips,
        "truncations": truncations,
        "undetected": undetected.len(),
        "corrupt_blocks_served": served.len(),
        "wrong_outputs": wrong.len(),
        "seconds": start.elapsed().as_secs_f64(),
    });
    println!("FIGURES {figures}");
    assert!(
        undetected.is_empty(),
        "undetected: {:?}",
        &undetected[..undetected.len().min(5)]
    );
    assert!(
        served.is_empty(),
        "served: {:?}",
        &served[..served.len().min(5)]
    );
    assert!(
        wrong.is_empty(),
        "wrong outputs: {:?}",
        &wrong[..wrong.len().min(5)]
    );
}
