//! Concurrent requests that branch from one resident prefix share its physical KV (the
//! device tier hands each a view of the resident arenas, docs/cache.md "Shared prefixes")
//! and decode, batched, exactly what a cold engine decodes.

use engine::{load, Engine, EngineConfig, Event, GenerateParams, KvTiers, LoadOptions, Request};

use crate::common::{assert_cold_greedy, goldens, no_eos, reuse_config};

/// Greedy tokens of each prompt, submitted together to `engine` and decoded in one batch.
fn together(engine: &Engine, prompts: &[Vec<u32>], n: usize) -> Vec<(Vec<u32>, usize)> {
    let handles: Vec<_> = prompts
        .iter()
        .map(|p| engine.submit(Request::new(p.clone(), no_eos(n))).unwrap())
        .collect();
    handles
        .into_iter()
        .map(|h| {
            let c = h.wait().unwrap();
            (c.tokens, c.cached_tokens)
        })
        .collect()
}

fn check(name: &str) {
    let dir = tempfile::tempdir().unwrap();
    let path = goldens().join(name);
    let config = EngineConfig {
        max_batch: 2,
        batch_arena: Some(false),
        ..EngineConfig::default()
    };
    let base: Vec<u32> = (0..40u32).map(|i| (i * 13 + 5) % 200 + 3).collect();
    // Two requests branch from the resident sequence after 27 tokens (inside block 3).
    let prompts: Vec<Vec<u32>> = [17u32, 91]
        .iter()
        .map(|&t| base[..27].iter().copied().chain([t, t + 1, 4, t]).collect())
        .collect();
    let cold = {
        let (model, tok) = load(&path, &LoadOptions::default()).unwrap();
        let engine = Engine::open(model, tok, None, config.clone()).unwrap();
        together(&engine, &prompts, 16)
    };
    let engine = sharing_engine(&path, dir.path(), config.clone(), &base);
    let before = engine.metrics();
    let warm = together(&engine, &prompts, 16);
    let after = engine.metrics();
    for (i, ((got, cached), (want, _))) in warm.iter().zip(&cold).enumerate() {
        assert_eq!(
            *cached, 27,
            "{name}: request {i} reused the resident prefix"
        );
        let what = format!("{name}: request {i}: shared prefix vs cold");
        assert_cold_greedy(&path, &prompts[i], got, want, &what);
    }
    assert!(
        after.decode_rows - before.decode_rows > after.decode_steps - before.decode_steps,
        "{name}: the two requests decoded in one batch: {after:?}"
    );
    let tiers = engine.kv_tiers().unwrap();
    let stats = tiers.resident_stats();
    assert_eq!(stats.shares, 2, "{name}: both hits shared: {stats:?}");
    assert_eq!(stats.forks, 0, "{name}: {stats:?}");
    // Both finished and were parked as sharers of the entry (a refcount tree): every count
    // equals the resident sequences that read it, and the source is counted once.
    let counts = tiers.resident().unwrap().share_counts();
    let source = counts
        .iter()
        .find(|c| c.sharers > 0)
        .unwrap_or_else(|| panic!("{name}: no parked sharer: {counts:?}"));
    let readers = counts
        .iter()
        .filter(|c| c.source == Some(source.entry))
        .count();
    assert_eq!(source.sharers, readers, "{name}: {counts:?}");
    let dir = tempfile::tempdir().unwrap();
    let engine = sharing_engine(&path, dir.path(), config, &base);
    reservations_leave_out_the_shared_prefix(name, &engine, &prompts);
}

/// An engine that shares device hits from 1 token on (8-token blocks), `base` resident.
fn sharing_engine(
    path: &std::path::Path,
    store: &std::path::Path,
    config: EngineConfig,
    base: &[u32],
) -> Engine {
    let (model, tok) = load(path, &LoadOptions::default()).unwrap();
    let mut reuse = reuse_config(store, 8);
    reuse.share_min_tokens = 1;
    let tiers = KvTiers::open(&model, &tok, reuse).unwrap();
    let engine = Engine::open(model, tok, Some(tiers), config).unwrap();
    // The prefix becomes resident: a finished request is parked on the device.
    let params = GenerateParams {
        max_tokens: 8,
        stop_at_eos: false,
        ..GenerateParams::default()
    };
    engine
        .submit(Request::new(base.to_vec(), params))
        .unwrap()
        .wait()
        .unwrap();
    engine
}

/// One budget, the prefix counted once: while two requests read the resident prefix, each
/// one's reservation leaves out the prefix's whole blocks (3 blocks of 8 of the 27 tokens).
fn reservations_leave_out_the_shared_prefix(name: &str, engine: &Engine, prompts: &[Vec<u32>]) {
    let params = GenerateParams {
        max_tokens: 300,
        stop_at_eos: false,
        ..GenerateParams::default()
    };
    let mut handles: Vec<_> = prompts
        .iter()
        .map(|p| {
            engine
                .submit(Request::new(p.clone(), params.clone()))
                .unwrap()
        })
        .collect();
    for h in &mut handles {
        match h.recv_blocking() {
            Some(Event::Started { cached_tokens, .. }) => assert_eq!(cached_tokens, 27),
            other => panic!("{name}: the request did not start: {other:?}"),
        }
    }
    // Both are admitted and decoding (300 tokens each): their reservations are the gauge.
    let reserved = engine.metrics().kv_reserved_bytes;
    let each = engine.reservation(prompts[0].len(), 300) - engine.reservation(24, 0);
    assert_eq!(
        reserved,
        2 * each,
        "{name}: whole prompt and budget {} each, minus the shared blocks {}",
        engine.reservation(prompts[0].len(), 300),
        engine.reservation(24, 0)
    );
    for h in handles {
        assert_eq!(h.wait().unwrap().tokens.len(), 300, "{name}");
    }
}

#[test]
fn concurrent_requests_sharing_a_resident_prefix_decode_as_cold_llama() {
    check("tiny-llama");
}

#[test]
fn concurrent_requests_sharing_a_resident_prefix_decode_as_cold_qwen2() {
    check("tiny-qwen2");
}

#[test]
fn concurrent_requests_sharing_a_resident_prefix_decode_as_cold_qwen3() {
    check("tiny-qwen3");
}
