//! An exclusive device tier (`DeviceTier::Exclusive`): a finished sequence's blocks reach
//! the host tiers when it leaves the device, not when they are published, and a request
//! restored from them decodes exactly what a cold engine decodes.

use engine::{load, DeviceTier, Engine, EngineConfig, KvTiers, LoadOptions, Request};

use crate::common::{goldens, no_eos, reuse_config};

const BS: usize = 8;

fn run(engine: &Engine, prompt: &[u32], n: usize) -> engine::Completion {
    engine
        .submit(Request::new(prompt.to_vec(), no_eos(n)))
        .unwrap()
        .wait()
        .unwrap()
}

/// An engine on a fresh store with the device tier `tier` and `budget_tokens` tokens of
/// device KV.
fn engine_with(store: &std::path::Path, tier: DeviceTier, budget_tokens: u64) -> Engine {
    engine_staging(store, tier, budget_tokens, engine::DEFAULT_STAGING_BYTES)
}

/// [`engine_with`] whose staged restores may hold `staging_bytes` at once.
fn engine_staging(
    store: &std::path::Path,
    tier: DeviceTier,
    budget_tokens: u64,
    staging_bytes: u64,
) -> Engine {
    let (model, tok) = load(&goldens().join("tiny-llama"), &LoadOptions::default()).unwrap();
    let config = EngineConfig {
        max_batch: 1,
        batch_arena: Some(false),
        ..EngineConfig::default()
    };
    let mut reuse = reuse_config(store, BS);
    reuse.device_tier = tier;
    reuse.kv_budget_bytes = 1 << 30;
    reuse.staging_bytes = staging_bytes;
    let tiers = KvTiers::open(&model, &tok, reuse).unwrap();
    let engine = Engine::open(model, tok, Some(tiers), config).unwrap();
    // The budget in tokens of this model's KV.
    let per_token = engine.reservation(BS, 0) / BS as u64;
    engine
        .kv_tiers()
        .unwrap()
        .set_kv_budget(budget_tokens * per_token)
        .unwrap();
    engine
}

#[test]
fn an_exclusive_device_tier_exports_a_sequence_when_it_leaves_the_device() {
    let a: Vec<u32> = (0..40u32).map(|i| (i * 13 + 5) % 200 + 3).collect();
    let b: Vec<u32> = (0..40u32).map(|i| (i * 7 + 11) % 200 + 3).collect();
    let cold = {
        let (model, tok) = load(&goldens().join("tiny-llama"), &LoadOptions::default()).unwrap();
        let engine = Engine::open(model, tok, None, EngineConfig::default()).unwrap();
        run(&engine, &a, 8).tokens
    };
    let dir = tempfile::tempdir().unwrap();
    // Room for one finished sequence (an arena of 16 blocks: 128 tokens) beside a short
    // request, not beside a request that reserves 140 tokens.
    let engine = engine_with(dir.path(), DeviceTier::Exclusive, 200);
    let tiers = engine.kv_tiers().unwrap();

    let first = run(&engine, &a, 8);
    assert_eq!(first.tokens, cold);
    assert_eq!(first.reuse.published_blocks, 0, "published at once");
    assert_eq!(tiers.resident_stats().sequences, 1);
    assert_eq!(tiers.stats().ram_blocks, 0, "the host tiers hold a copy");

    // `b` reserves 140 tokens: `a` leaves the device, and its blocks reach RAM: the 47 it
    // held (40 prompt tokens and 7 of its 8 generated ones) make 5 full blocks.
    run(&engine, &b, 100);
    let s = tiers.resident_stats();
    assert!(s.evictions >= 1, "{s:?}");
    engine.flush().unwrap();
    assert!(tiers.stats().ram_blocks >= 5, "{:?}", tiers.stats());

    // `a` again: restored from RAM (it is not resident), decoded as cold.
    let again = run(&engine, &a, 8);
    assert_eq!(again.reuse.cached_device_tokens, 0, "{:?}", again.reuse);
    assert_eq!(again.reuse.cached_ram_tokens, 32, "{:?}", again.reuse);
    assert_eq!(again.tokens, cold);
    assert_staged(&again.reuse);
}

/// A restore loaded at submission (the queue was empty) from block 0 was checked and
/// assembled by the I/O worker; the engine thread only installed it.
fn assert_staged(r: &engine::ReuseReport) {
    assert!(r.prefetched, "{r:?}");
    assert!(r.staged_s > 0.0, "the I/O worker staged the restore: {r:?}");
}

#[test]
fn an_exclusive_device_tier_exports_what_is_resident_at_a_flush() {
    let a: Vec<u32> = (0..40u32).map(|i| (i * 5 + 1) % 200 + 3).collect();
    let dir = tempfile::tempdir().unwrap();
    {
        let engine = engine_with(dir.path(), DeviceTier::Exclusive, 1 << 20);
        run(&engine, &a, 8);
        let tiers = engine.kv_tiers().unwrap();
        assert_eq!(tiers.stats().ram_blocks, 0);
        // A flush while the engine runs: its thread exports the resident sequence (device
        // copies are its MLX work), which stays resident.
        engine.flush().unwrap();
        assert_eq!(tiers.stats().ram_blocks, 5, "{:?}", tiers.stats());
        assert_eq!(tiers.resident_stats().sequences, 1);
        // Closing flushes too: nothing more to export; the blocks reach the SSD.
        engine.close().unwrap();
    }
    // A new engine on the same store finds them on the SSD.
    let engine = engine_with(dir.path(), DeviceTier::Exclusive, 1 << 20);
    let again = run(&engine, &a, 8);
    assert_eq!(again.reuse.cached_ssd_tokens, 32, "{:?}", again.reuse);
    assert_staged(&again.reuse);
}

#[test]
fn an_inclusive_device_tier_exports_blocks_as_they_are_published() {
    let a: Vec<u32> = (0..40u32).map(|i| (i * 5 + 1) % 200 + 3).collect();
    let dir = tempfile::tempdir().unwrap();
    let engine = engine_with(dir.path(), DeviceTier::Inclusive, 1 << 20);
    let first = run(&engine, &a, 8);
    assert_eq!(first.reuse.published_blocks, 5, "{:?}", first.reuse);
    let tiers = engine.kv_tiers().unwrap();
    assert_eq!(tiers.resident_stats().sequences, 1);
    engine.flush().unwrap();
    assert_eq!(tiers.stats().ram_blocks, 5, "{:?}", tiers.stats());
}

/// Past the staging budget a load is not staged: the engine thread assembles it at
/// admission, and the request decodes the same.
#[test]
fn a_load_past_the_staging_budget_is_assembled_at_admission() {
    let a: Vec<u32> = (0..40u32).map(|i| (i * 3 + 2) % 200 + 3).collect();
    let dir = tempfile::tempdir().unwrap();
    let first = {
        let engine = engine_with(dir.path(), DeviceTier::Exclusive, 1 << 20);
        let first = run(&engine, &a, 8);
        engine.close().unwrap();
        first
    };
    // The blocks' bytes are more than one byte: nothing is staged.
    let engine = engine_staging(dir.path(), DeviceTier::Exclusive, 1 << 20, 1);
    let again = run(&engine, &a, 8);
    assert_eq!(again.reuse.cached_ssd_tokens, 32, "{:?}", again.reuse);
    assert!(again.reuse.prefetched, "{:?}", again.reuse);
    assert_eq!(again.reuse.staged_s, 0.0, "{:?}", again.reuse);
    assert_eq!(again.tokens, first.tokens);
}
