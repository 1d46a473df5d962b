//! A small trace replayed in process on the tiny random-weight qwen3 test model gives exactly
//! the hits the simulator predicts for an unbounded cache, once the engine's own rules are
//! applied: at least one prompt token is always computed (a hit is at most `len - 1`), and a
//! hit restored from the store counts whole kvstore blocks only.
//!
//! Trace blocks are 8 tokens (`--token-scale 1/64`), kvstore blocks 4: every trace block
//! boundary is a kvstore block boundary, so a hit that ends at a trace block ends at a
//! kvstore block too, and only a partial trace block (a prompt that ended inside it) or the
//! one-token rule can end a hit inside a kvstore block. Requests go one at a time
//! (`--max-concurrency 1`), so each finds every earlier request published; nothing is timed.

use std::path::Path;

use engine::{Engine, EngineConfig, KvTiers, ReuseConfig};
use store::StoreConfig;

use super::dispatch::{self, Outcome};
use super::inprocess::EngineTarget;
use super::parse::TraceRequest;
use super::scale::TokenScale;
use super::sim::{self, SimTrace};
use super::tokens;

/// Tokens per kvstore block in these tests.
const KV_BLOCK: usize = 4;
/// Prompt + generated tokens of every request (each reserves the same device bytes).
const TOTAL: usize = 40;

/// Scaled prompt lengths (input_length / 64, rounded up) and the ideal hit by hand
/// (trace blocks of 8 tokens):
///   r0 [0 1 2]    19 tokens (8 8 3)   nothing cached                                  ->  0
///   r1 [0 1 3 4]  29 tokens (8 8 8 5) blocks 0 1 from r0                              -> 16
///   r2 [0 5]      11 tokens (8 3)     block 0                                         ->  8
///   r3 [0 1 3 6]  32 tokens           blocks 0 1 3 from r1 (which held all of 3)      -> 24
///   r4 [7 8]      16 tokens           another root                                    ->  0
///   r5 [0 1 3 6]  32 tokens           all of r3                                       -> 32
///   r6 [0 1 2 9]  29 tokens           blocks 0 1, then the 3 tokens of 2 r0 held      -> 19
/// Each generates TOTAL - prompt tokens (output_length × 64).
fn fixture() -> Vec<TraceRequest> {
    [
        (&[0u64, 1, 2][..], 1200usize),
        (&[0, 1, 3, 4], 1800),
        (&[0, 5], 700),
        (&[0, 1, 3, 6], 2000),
        (&[7, 8], 1000),
        (&[0, 1, 3, 6], 2000),
        (&[0, 1, 2, 9], 1800),
    ]
    .iter()
    .map(|(ids, len)| {
        let prompt = len.div_ceil(64);
        TraceRequest {
            timestamp: 0,
            input_length: *len,
            output_length: (TOTAL - prompt) * 64,
            hash_ids: ids.to_vec(),
        }
    })
    .collect()
}

fn scale() -> TokenScale {
    TokenScale::new(1.0 / 64.0).unwrap()
}

/// Replays the fixture on an engine whose device KV budget is `kv_budget` bytes.
fn replay(kv_budget: u64) -> (Vec<Outcome>, Vec<Vec<u32>>) {
    let dir = tempfile::tempdir().unwrap();
    let model_dir =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../engine/tests/goldens/tiny-qwen3");
    let (model, tok) = engine::load(&model_dir, &engine::LoadOptions::default()).unwrap();
    let reuse = ReuseConfig {
        store: StoreConfig::default().root(dir.path()),
        block_size: KV_BLOCK,
        kv_budget_bytes: kv_budget,
        // The cost model would recompute host blocks where that is faster (it is, for this
        // model): the test is about which blocks are found, not about that choice.
        restore_always: true,
        ..ReuseConfig::default()
    };
    let prefix = KvTiers::open(&model, &tok, reuse).unwrap();
    let config = EngineConfig {
        max_batch: 1,
        kv_budget_bytes: kv_budget,
        max_queue: 16,
        context_limit: None,
        ..EngineConfig::default()
    };
    let engine = Engine::open(model, tok, Some(prefix), config).unwrap();
    let vocab = engine
        .info()
        .vocab_size
        .min(engine.tokenizer().vocab_size()) as u32;
    let (trace, s) = (fixture(), scale());
    let prompts: Vec<Vec<u32>> = trace.iter().map(|r| tokens::prompt(r, &s, vocab)).collect();
    let make = |i: usize| (prompts[i].clone(), s.output_len(&trace[i]));
    let times = vec![0.0; trace.len()];
    let sent = dispatch::replay(
        &times,
        &make,
        &EngineTarget {
            engine: &engine,
            block_tokens: KV_BLOCK,
        },
        1,
        None,
    );
    engine.shutdown(false).unwrap();
    let out = sent.into_iter().map(|x| x.outcome).collect();
    (out, prompts)
}

fn ideal() -> (Vec<usize>, Vec<usize>) {
    let t = SimTrace::new(&fixture(), &scale());
    (sim::ideal(&t), t.requests.iter().map(|r| r.len).collect())
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[test]
fn the_fixture_is_what_the_comments_say() {
    let (ideal, lens) = ideal();
    assert_eq!(lens, vec![19, 29, 11, 32, 16, 32, 29]);
    assert_eq!(ideal, vec![0, 16, 8, 24, 0, 32, 19]);
}

/// Device KV for every request at once: every finished request stays resident, and the
/// device tier matches token by token (the partial block r0 left counts for r6). A hit is
/// the ideal, at most len - 1 (r5: 31 of its 32 tokens).
#[test]
fn unbounded_replay_hits_what_the_simulator_predicts() {
    let (ideal, lens) = ideal();
    let (out, prompts) = replay(1 << 30);
    // What would make token-granular matching find more than whole trace blocks: two
    // prompts whose tokens agree past the blocks they share. r6 reads on past r0's last
    // prompt token into r0's first generated token, which differs from r6's token 19 (the
    // hit below would be 20 otherwise).
    for (j, b) in prompts.iter().enumerate() {
        for a in &prompts[..j] {
            let tokens = common_prefix(a, b);
            let blocks = tokens / 8;
            assert!(
                tokens == blocks * 8 || tokens == a.len().min(b.len()),
                "r{j}: tokens agree past a shared block ({tokens}): choose other ids"
            );
        }
    }
    for (i, o) in out.iter().enumerate() {
        assert_eq!(o.error, None, "r{i}");
        assert_eq!(o.prompt_tokens, lens[i], "r{i}");
        assert_eq!(o.cached_tokens, ideal[i].min(lens[i] - 1), "r{i}: {o:?}");
        assert_eq!(o.cached_device_tokens, Some(o.cached_tokens), "r{i}: {o:?}");
        // The engine's parts of the TTFT (its own TTFT: queue + lookup + restore +
        // prefill) never exceed the TTFT this client timed around the request, and the
        // rest is `other_work_s`.
        let (ttft, p) = (o.ttft_s.unwrap(), o.ttft_parts.unwrap());
        let engine = p.queue_s + p.lookup_s + p.restore_s + p.prefill_s;
        assert!(
            engine <= ttft,
            "r{i}: engine's parts {engine} > TTFT {ttft}: {p:?}"
        );
        assert!(
            (p.other_work_s - (ttft - engine)).abs() < 1e-9,
            "r{i}: {p:?}"
        );
    }
}

/// Device KV for one request only (every request reserves TOTAL tokens, the whole budget):
/// admitting a request evicts every resident sequence, so every hit is restored from the
/// RAM tier, in whole kvstore blocks: the ideal rounded down to a multiple of 4, at most
/// len - 1 (r5: 28 of 32; r6: 16 of 19, since r0's block 16..20 holds a generated token).
#[test]
fn store_only_replay_hits_the_ideal_in_whole_kvstore_blocks() {
    let (ideal, lens) = ideal();
    // tiny-qwen3 keeps 1,024 bytes of f32 KV per token (2 layers × K,V × 2 heads × 32 × 4).
    let (out, _) = replay((TOTAL * 1024) as u64);
    for (i, o) in out.iter().enumerate() {
        assert_eq!(o.error, None, "r{i}");
        let want = ideal[i].min(lens[i] - 1) / KV_BLOCK * KV_BLOCK;
        assert_eq!(o.cached_tokens, want, "r{i}: {o:?}");
        assert_eq!(o.cached_device_tokens, Some(0), "r{i}: {o:?}");
        assert_eq!(o.cached_ram_tokens, Some(want), "r{i}: {o:?}");
        assert_eq!(o.skipped_ram_tokens, Some(0), "r{i}: {o:?}");
        assert_eq!(o.skipped_ssd_tokens, Some(0), "r{i}: {o:?}");
    }
}

/// A throwaway `redis-server` (shared with the store's tests).
#[path = "../../../../store/tests/it/redis_server.rs"]
#[allow(dead_code)]
mod redis_server;

/// Round robin over engines, every engine's publications made visible (flushed to its
/// store and the remote tier) before the next request is sent.
struct FlushedRoundRobin<'a> {
    inner: super::inprocess::RoundRobin<'a>,
    engines: &'a [Engine],
}

impl dispatch::Target for FlushedRoundRobin<'_> {
    fn send(&self, prompt: Vec<u32>, max_tokens: usize) -> Outcome {
        let out = self.inner.send(prompt, max_tokens);
        for e in self.engines {
            e.flush().unwrap();
        }
        out
    }
}

/// `--engines 2`: the fixture dealt round robin to two engines with their own stores and
/// one Redis. r1 is the only request whose prefix only the other engine computed: it comes
/// from the remote tier (blocks 0 1 of r0: 16 tokens, whole kvstore blocks). Every other
/// hit is on the engine's own device tier: r2, r4, r6 on the first engine (r0's, r0's and
/// r0's prefix), r3 and r5 on the second (r1's, r3's).
#[test]
fn two_engines_sharing_a_remote_tier_hit_each_others_blocks_there() {
    let redis = redis_server::RedisServer::start();
    let (ideal, lens) = ideal();
    let model_dir =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../engine/tests/goldens/tiny-qwen3");
    let dirs = [tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap()];
    let engines: Vec<Engine> = dirs
        .iter()
        .map(|dir| {
            let (model, tok) = engine::load(&model_dir, &engine::LoadOptions::default()).unwrap();
            let reuse = ReuseConfig {
                store: StoreConfig::default()
                    .root(dir.path())
                    .remote(Some(store::RemoteConfig::new(redis.url()))),
                block_size: KV_BLOCK,
                kv_budget_bytes: 1 << 30,
                restore_always: true,
                ..ReuseConfig::default()
            };
            let prefix = KvTiers::open(&model, &tok, reuse).unwrap();
            let config = EngineConfig {
                max_batch: 1,
                kv_budget_bytes: 1 << 30,
                max_queue: 16,
                context_limit: None,
                ..EngineConfig::default()
            };
            Engine::open(model, tok, Some(prefix), config).unwrap()
        })
        .collect();
    let vocab = engines[0]
        .info()
        .vocab_size
        .min(engines[0].tokenizer().vocab_size()) as u32;
    let (trace, s) = (fixture(), scale());
    let prompts: Vec<Vec<u32>> = trace.iter().map(|r| tokens::prompt(r, &s, vocab)).collect();
    let make = |i: usize| (prompts[i].clone(), s.output_len(&trace[i]));
    let target = FlushedRoundRobin {
        inner: super::inprocess::RoundRobin {
            targets: engines
                .iter()
                .map(|engine| EngineTarget {
                    engine,
                    block_tokens: KV_BLOCK,
                })
                .collect(),
            next: Default::default(),
        },
        engines: &engines,
    };
    let sent = dispatch::replay(&vec![0.0; trace.len()], &make, &target, 1, None);
    drop(target);
    for e in engines {
        e.shutdown(false).unwrap();
    }
    for (i, x) in sent.iter().enumerate() {
        let o = &x.outcome;
        assert_eq!(o.error, None, "r{i}");
        assert_eq!(o.cached_tokens, ideal[i].min(lens[i] - 1), "r{i}: {o:?}");
        let remote = if i == 1 { 16 } else { 0 };
        assert_eq!(o.cached_remote_tokens, Some(remote), "r{i}: {o:?}");
        assert_eq!(
            o.cached_device_tokens,
            Some(o.cached_tokens - remote),
            "r{i}: {o:?}"
        );
    }
}
