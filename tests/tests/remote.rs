//! The remote tier end to end: two engines with separate local stores share one
//! `redis-server` or a 3-master Redis Cluster (started here on free loopback ports). Every output with a restored
//! prefix is compared with the same request served cold.

use std::path::Path;

use engine::{
    generate_with_reuse, GenerateParams, LoadOptions, Model, PrefixCache, ReuseConfig, ReuseReport,
    Tokenizer,
};
use kvstore_tests::redis_server::{dead_url, RedisCluster, RedisServer};
use kvstore_tests::tiny_model;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use store::{RemoteConfig, StoreConfig};

const BS: usize = 8;

fn params(max_tokens: usize) -> GenerateParams {
    GenerateParams {
        max_tokens,
        stop_at_eos: false,
        ..GenerateParams::default()
    }
}

fn engine(model: &Model, tok: &Tokenizer, dir: &Path, url: &str) -> PrefixCache {
    let config = ReuseConfig {
        store: StoreConfig::default()
            .root(dir)
            .ram_budget(64 << 20)
            .ssd_budget(256 << 20)
            .remote(Some(RemoteConfig::new(url).io_timeout_ms(500))),
        block_size: BS,
        ..ReuseConfig::default()
    };
    PrefixCache::open(model, tok, config).unwrap()
}

fn cold(model: &Model, tok: &Tokenizer, prompt: &[u32], n: usize) -> Vec<u32> {
    generate_with_reuse(model, tok, None, prompt, &params(n), &mut |_| true)
        .unwrap()
        .0
        .tokens
}

fn run(
    model: &Model,
    tok: &Tokenizer,
    pc: &PrefixCache,
    prompt: &[u32],
    n: usize,
) -> (Vec<u32>, ReuseReport) {
    let (g, r) =
        generate_with_reuse(model, tok, Some(pc), prompt, &params(n), &mut |_| true).unwrap();
    (g.tokens, r)
}

fn rng(test: &str) -> StdRng {
    let seed = std::env::var("KVSTORE_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random::<u64>);
    eprintln!("{test}: KVSTORE_TEST_SEED={seed}");
    StdRng::seed_from_u64(seed)
}

fn random_tokens(r: &mut StdRng, n: usize) -> Vec<u32> {
    (0..n).map(|_| r.gen_range(3..320)).collect()
}

fn next_turn(r: &mut StdRng, prev: &[u32], out: &[u32]) -> Vec<u32> {
    prev.iter()
        .chain(out)
        .copied()
        .chain(random_tokens(r, 29))
        .collect()
}

#[test]
fn a_second_engine_gets_remote_hits_for_the_first_ones_conversation() {
    let mut r = rng("a_second_engine_gets_remote_hits_for_the_first_ones_conversation");
    let (model, tok) = engine::load(&tiny_model("tiny-llama"), &LoadOptions::default()).unwrap();
    let redis = RedisServer::start();
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let a = engine(&model, &tok, da.path(), &redis.url());
    let b = engine(&model, &tok, db.path(), &redis.url());

    let turn1 = random_tokens(&mut r, 77);
    let out1_cold = cold(&model, &tok, &turn1, 20);
    let (out1, rep) = run(&model, &tok, &a, &turn1, 20);
    assert_eq!(out1, out1_cold);
    assert_eq!(rep.published_blocks, 12);
    a.flush().unwrap();
    assert_eq!(a.stats().remote_blocks_written, 12);

    // B has never seen the conversation: its whole reusable prefix comes from Redis.
    let (out1_b, rep) = run(&model, &tok, &b, &turn1, 20);
    assert_eq!(
        out1_b, out1_cold,
        "remote-restored prefix changed the output"
    );
    assert_eq!(rep.cached_tokens, 72, "{rep:?}");
    assert_eq!(rep.cached_remote_tokens, 72, "{rep:?}");
    assert!(rep.stopped.is_none(), "{rep:?}");

    // A's turn 2, then B's: B's own blocks are local, the rest is A's, from Redis.
    let turn2 = next_turn(&mut r, &turn1, &out1_cold);
    let out2_cold = cold(&model, &tok, &turn2, 20);
    let (out2, _) = run(&model, &tok, &a, &turn2, 20);
    assert_eq!(out2, out2_cold);
    a.flush().unwrap();
    let (out2_b, rep) = run(&model, &tok, &b, &turn2, 20);
    assert_eq!(out2_b, out2_cold);
    assert!(rep.cached_ram_tokens >= 72, "{rep:?}");
    assert!(rep.cached_remote_tokens > 0, "{rep:?}");
    assert_eq!(rep.cached_tokens, (turn2.len() - 1) / BS * BS, "{rep:?}");
    let st = b.stats();
    assert!(
        st.remote_hits > 0 && st.remote_verify_failures == 0,
        "{st:?}"
    );
}

#[test]
fn redis_killed_mid_run_the_engines_serve_correctly_from_local_tiers() {
    let mut r = rng("redis_killed_mid_run_the_engines_serve_correctly_from_local_tiers");
    let (model, tok) = engine::load(&tiny_model("tiny-llama"), &LoadOptions::default()).unwrap();
    let mut redis = RedisServer::start();
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let a = engine(&model, &tok, da.path(), &redis.url());
    let b = engine(&model, &tok, db.path(), &redis.url());

    let turn1 = random_tokens(&mut r, 77);
    let out1_cold = cold(&model, &tok, &turn1, 20);
    run(&model, &tok, &a, &turn1, 20);
    a.flush().unwrap();
    let (out1_b, rep) = run(&model, &tok, &b, &turn1, 20);
    assert_eq!(out1_b, out1_cold);
    assert_eq!(rep.cached_remote_tokens, 72, "{rep:?}");

    redis.kill();
    let turn2 = next_turn(&mut r, &turn1, &out1_cold);
    let out2_cold = cold(&model, &tok, &turn2, 20);
    for pc in [&a, &b] {
        let (out2, rep) = run(&model, &tok, pc, &turn2, 20);
        assert_eq!(out2, out2_cold, "output changed after Redis died");
        assert!(rep.cached_ram_tokens >= 72, "{rep:?}");
        assert_eq!(rep.cached_remote_tokens, 0, "{rep:?}");
        pc.flush().unwrap();
    }
    assert!(b.stats().remote_errors >= 1, "{:?}", b.stats());
}

#[test]
fn a_corrupt_value_in_redis_is_detected_not_served_and_output_stays_correct() {
    let mut r = rng("a_corrupt_value_in_redis_is_detected_not_served_and_output_stays_correct");
    let (model, tok) = engine::load(&tiny_model("tiny-llama"), &LoadOptions::default()).unwrap();
    let redis = RedisServer::start();
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let a = engine(&model, &tok, da.path(), &redis.url());
    let b = engine(&model, &tok, db.path(), &redis.url());

    let turn1 = random_tokens(&mut r, 77);
    let out1_cold = cold(&model, &tok, &turn1, 20);
    run(&model, &tok, &a, &turn1, 20);
    a.flush().unwrap();

    // Overwrite block 3 with garbage of a plausible length.
    let keys = store::chain_keys(a.namespace(), &turn1[..76], BS);
    let k = store::remote::redis_key(a.namespace(), keys[3]);
    redis.command(&[b"SET", k.as_bytes(), &vec![0xAB; 4096]]);

    let (out, rep) = run(&model, &tok, &b, &turn1, 20);
    assert_eq!(out, out1_cold, "a corrupt remote block changed the output");
    assert_eq!(rep.cached_remote_tokens, 3 * BS, "{rep:?}");
    assert!(
        rep.stopped.as_deref().is_some_and(|s| s.contains("Remote")),
        "{rep:?}"
    );
    assert_eq!(b.stats().remote_verify_failures, 1);
}

#[test]
fn redis_not_running_at_start_the_engine_works_locally() {
    let mut r = rng("redis_not_running_at_start_the_engine_works_locally");
    let (model, tok) = engine::load(&tiny_model("tiny-llama"), &LoadOptions::default()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let pc = engine(&model, &tok, dir.path(), &dead_url());
    let turn1 = random_tokens(&mut r, 77);
    let out1_cold = cold(&model, &tok, &turn1, 20);
    let (out1, _) = run(&model, &tok, &pc, &turn1, 20);
    assert_eq!(out1, out1_cold);
    let turn2 = next_turn(&mut r, &turn1, &out1_cold);
    let (out2, rep) = run(&model, &tok, &pc, &turn2, 20);
    assert_eq!(out2, cold(&model, &tok, &turn2, 20));
    assert_eq!(rep.cached_ram_tokens, 96, "{rep:?}");
    pc.flush().unwrap();
    let st = pc.stats();
    assert!(
        st.remote_errors >= 1 && st.remote_blocks_written == 0,
        "{st:?}"
    );
}

#[test]
fn two_engines_share_a_conversation_through_a_redis_cluster_and_survive_a_dead_master() {
    let mut r =
        rng("two_engines_share_a_conversation_through_a_redis_cluster_and_survive_a_dead_master");
    let (model, tok) = engine::load(&tiny_model("tiny-llama"), &LoadOptions::default()).unwrap();
    let mut cluster = RedisCluster::start(3);
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let a = engine(&model, &tok, da.path(), &cluster.url());
    let b = engine(&model, &tok, db.path(), &cluster.url());

    let turn1 = random_tokens(&mut r, 77);
    let out1_cold = cold(&model, &tok, &turn1, 20);
    let (out1, _) = run(&model, &tok, &a, &turn1, 20);
    assert_eq!(out1, out1_cold);
    a.flush().unwrap();
    assert_eq!(a.stats().remote_blocks_written, 12);
    let per_node = cluster.keys_per_node();
    assert!(per_node.iter().all(|&k| k > 0), "{per_node:?}");

    let (out1_b, rep) = run(&model, &tok, &b, &turn1, 20);
    assert_eq!(
        out1_b, out1_cold,
        "cluster-restored prefix changed the output"
    );
    assert_eq!(rep.cached_remote_tokens, 72, "{rep:?}");
    let st = b.stats();
    assert_eq!(st.remote_fetches, 1, "one fetch for the chain: {st:?}");

    // A master dies: both engines keep answering correctly from their local tiers.
    cluster.nodes[0].kill();
    let turn2 = next_turn(&mut r, &turn1, &out1_cold);
    let out2_cold = cold(&model, &tok, &turn2, 20);
    for pc in [&a, &b] {
        let (out2, rep) = run(&model, &tok, pc, &turn2, 20);
        assert_eq!(out2, out2_cold, "output changed after a master died");
        assert!(rep.cached_ram_tokens >= 72, "{rep:?}");
        pc.flush().unwrap();
    }
    assert!(b.stats().remote_errors >= 1, "{:?}", b.stats());
}
