//! The remote tier against a real `redis-server`: sharing between stores, file-identical
//! values, verification of corrupt and foreign values, and an unreachable or killed Redis.

use std::sync::Arc;

use store::remote::{inspect_remote, redis_key};
use store::{
    Block, BlockProblem, NamespaceDescription, RemoteConfig, StopReason, Store, StoreConfig, Tier,
};

use crate::common;
use crate::redis_server::{dead_url, RedisServer};

fn open(dir: &std::path::Path, url: &str) -> Store<Block> {
    Store::open(
        StoreConfig::default()
            .root(dir)
            .ram_budget(1 << 20)
            .ssd_budget(1 << 24)
            .remote(Some(RemoteConfig::new(url).io_timeout_ms(500))),
    )
    .unwrap()
}

/// Publishes a chain of `n` blocks through a first store and returns it with its tokens.
fn publish(
    url: &str,
    d: &NamespaceDescription,
    n: usize,
    seed: u64,
) -> (Vec<Block>, Vec<Vec<u32>>) {
    let dir = tempfile::tempdir().unwrap();
    let a = open(dir.path(), url);
    a.register_namespace(d).unwrap();
    let (blocks, toks) = common::chain(d, n, seed);
    for b in &blocks {
        a.insert(Arc::new(b.clone())).unwrap();
    }
    a.flush().unwrap();
    let st = a.stats();
    assert_eq!(st.remote_blocks_written, n as u64, "{st:?}");
    assert_eq!(st.remote_skipped, 0);
    (blocks, toks)
}

fn keys(blocks: &[Block]) -> Vec<store::BlockKey> {
    blocks.iter().map(|b| b.meta.key).collect()
}

#[test]
fn a_second_store_gets_verified_remote_hits_and_promotes_them() {
    let redis = RedisServer::start();
    let d = common::desc("remote-share", 4);
    let (blocks, toks) = publish(&redis.url(), &d, 5, 3);

    let dir = tempfile::tempdir().unwrap();
    let b = open(dir.path(), &redis.url());
    let ns = b.register_namespace(&d).unwrap();
    let ks = keys(&blocks);
    let hit = b.lookup(ns, &ks);
    assert_eq!(hit.tiers, vec![Tier::Remote; 5]);
    assert_eq!(hit.remote_blocks, 5);
    let loaded = b.load_prefix(ns, &ks, &toks);
    assert!(loaded.stopped.is_none(), "{:?}", loaded.stopped);
    for ((got, tier), want) in loaded.blocks.iter().zip(&blocks) {
        assert_eq!(*tier, Tier::Remote);
        assert_eq!(got.meta, want.meta);
        assert_eq!(got.planes, want.planes);
    }
    let st = b.stats();
    assert_eq!(st.remote_hits, 5);
    assert!(st.remote_bytes_read > 0);
    // Promoted: the next lookup is local, and it survives Redis going away.
    assert_eq!(b.lookup(ns, &ks).tiers, vec![Tier::Ram; 5]);
    drop(redis);
    b.flush().unwrap();
    assert_eq!(
        b.stats().ssd_blocks,
        5,
        "promoted blocks reach the SSD tier"
    );
}

#[test]
fn remote_values_are_the_ssd_file_bytes() {
    let redis = RedisServer::start();
    let d = common::desc("remote-bytes", 4);
    let dir = tempfile::tempdir().unwrap();
    let a = open(dir.path(), &redis.url());
    let ns = a.register_namespace(&d).unwrap();
    let (blocks, _) = common::chain(&d, 1, 9);
    a.insert(Arc::new(blocks[0].clone())).unwrap();
    a.flush().unwrap();
    let file = common::block_files(dir.path());
    assert_eq!(file.len(), 1);
    let on_disk = std::fs::read(&file[0]).unwrap();
    let key = redis_key(ns, blocks[0].meta.key);
    let reply = redis.command(&[b"STRLEN", key.as_bytes()]);
    assert_eq!(
        String::from_utf8_lossy(&reply).trim(),
        format!(":{}", on_disk.len())
    );
    let usage = inspect_remote(&redis.url()).unwrap();
    assert_eq!(usage.len(), 1);
    assert_eq!(usage[0].namespace, ns.to_string());
    assert_eq!(usage[0].blocks, 1);
    assert_eq!(usage[0].bytes, on_disk.len() as u64);
}

#[test]
fn corrupt_and_foreign_remote_values_are_refused() {
    let redis = RedisServer::start();
    let d = common::desc("remote-corrupt", 4);
    let (blocks, toks) = publish(&redis.url(), &d, 4, 5);
    let ns = d.id();
    // Garbage in block 1; block 0's value copied over block 2's key (a foreign value).
    redis.command(&[
        b"SET",
        redis_key(ns, blocks[1].meta.key).as_bytes(),
        b"not a block",
    ]);
    let dir = tempfile::tempdir().unwrap();
    let b = open(dir.path(), &redis.url());
    b.register_namespace(&d).unwrap();
    let ks = keys(&blocks);
    let loaded = b.load_prefix(ns, &ks, &toks);
    assert_eq!(loaded.blocks.len(), 1);
    assert!(
        matches!(
            loaded.stopped,
            Some(StopReason::Invalid {
                index: 1,
                tier: Tier::Remote,
                problem: BlockProblem::Corrupt(_)
            })
        ),
        "{:?}",
        loaded.stopped
    );

    // A valid block file stored under another block's key.
    let src = redis_key(ns, blocks[0].meta.key);
    let dst = redis_key(ns, blocks[2].meta.key);
    let reply = redis.command(&[b"COPY", src.as_bytes(), dst.as_bytes(), b"REPLACE"]);
    assert_eq!(reply, b":1\r\n");
    let dir2 = tempfile::tempdir().unwrap();
    let c = open(dir2.path(), &redis.url());
    c.register_namespace(&d).unwrap();
    let loaded = c.load_prefix(ns, &ks[2..], &toks[2..]);
    assert!(loaded.blocks.is_empty());
    assert!(
        matches!(
            loaded.stopped,
            Some(StopReason::Invalid {
                index: 0,
                tier: Tier::Remote,
                problem: BlockProblem::Key(_)
            })
        ),
        "{:?}",
        loaded.stopped
    );
    assert_eq!(b.stats().remote_verify_failures, 1);
    assert_eq!(c.stats().remote_verify_failures, 1);
}

#[test]
fn redis_down_at_start_or_killed_leaves_the_local_tiers_working() {
    let d = common::desc("remote-down", 4);
    let (blocks, toks) = common::chain(&d, 3, 11);
    let ks = keys(&blocks);

    // Nothing listens: open, insert, lookup and load all work locally.
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path(), &dead_url());
    let ns = s.register_namespace(&d).unwrap();
    for b in &blocks {
        s.insert(Arc::new(b.clone())).unwrap();
    }
    s.flush().unwrap();
    assert_eq!(s.lookup(ns, &ks).tiers, vec![Tier::Ram; 3]);
    assert_eq!(s.load_prefix(ns, &ks, &toks).blocks.len(), 3);
    let st = s.stats();
    assert!(st.remote_errors >= 1, "{st:?}");
    assert_eq!(st.remote_blocks_written, 0);

    // Killed mid-run: lookups of absent keys become plain misses, quickly.
    let mut redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path(), &redis.url());
    s.register_namespace(&d).unwrap();
    s.insert(Arc::new(blocks[0].clone())).unwrap();
    s.flush().unwrap();
    assert_eq!(s.stats().remote_blocks_written, 1);
    redis.kill();
    let t = std::time::Instant::now();
    assert_eq!(s.lookup(ns, &ks).tiers, vec![Tier::Ram]);
    let loaded = s.load_prefix(ns, &ks, &toks);
    assert_eq!(loaded.blocks.len(), 1);
    assert!(matches!(
        loaded.stopped,
        Some(StopReason::Missing { index: 1 })
    ));
    assert!(t.elapsed() < std::time::Duration::from_secs(3));
    for b in &blocks[1..] {
        s.insert(Arc::new(b.clone())).unwrap();
    }
    s.flush().unwrap();
    let st = s.stats();
    assert!(st.remote_errors >= 1, "{st:?}");
    assert_eq!(st.remote_skipped, 2, "{st:?}");
}

#[test]
fn an_invalid_remote_url_is_an_open_error() {
    let r =
        Store::<Block>::open(StoreConfig::default().remote(Some(RemoteConfig::new("http://nope"))));
    assert!(r.is_err());
}
