//! The remote tier against real `redis-server`s: sharing between stores, file-identical
//! values, verification of corrupt and foreign values, an unreachable or killed Redis, a
//! 3-master Redis Cluster, AUTH and TLS.

use std::sync::Arc;

use store::remote::{inspect_remote, redis_key};
use store::{
    Block, BlockProblem, NamespaceDescription, RemoteConfig, StopReason, Store, StoreConfig, Tier,
};

use crate::common;
use crate::redis_server::{dead_url, RedisCluster, RedisServer, ServerOptions, TestCerts};

fn open(dir: &std::path::Path, url: &str) -> Store {
    open_with(dir, RemoteConfig::new(url).io_timeout_ms(500))
}

fn open_with(dir: &std::path::Path, remote: RemoteConfig) -> Store {
    Store::open(
        StoreConfig::default()
            .root(dir)
            .ram_budget(1 << 20)
            .ssd_budget(1 << 24)
            .remote(Some(remote)),
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
    publish_with(RemoteConfig::new(url), d, n, seed)
}

fn publish_with(
    remote: RemoteConfig,
    d: &NamespaceDescription,
    n: usize,
    seed: u64,
) -> (Vec<Block>, Vec<Vec<u32>>) {
    let dir = tempfile::tempdir().unwrap();
    let a = open_with(dir.path(), remote);
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
    let usage = inspect_remote(&RemoteConfig::new(redis.url())).unwrap();
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
fn publications_past_the_queue_bytes_are_skipped_while_redis_stalls() {
    let redis = RedisServer::start();
    let d = common::desc("remote-queue-bytes", 4);
    let (blocks, _) = common::chain(&d, 11, 17);
    let size = blocks[0].data_len();
    assert!(blocks.iter().all(|b| b.data_len() == size));
    let dir = tempfile::tempdir().unwrap();
    let remote = RemoteConfig::new(redis.url())
        .io_timeout_ms(20_000)
        .queue_bytes(3 * size);
    let s = open_with(dir.path(), remote);
    s.register_namespace(&d).unwrap();
    // Redis holds every write for 2 s: the publisher waits on the first block, and the
    // queue counts it (and the next two) until they are put.
    let paused = redis.command(&[b"CLIENT", b"PAUSE", b"2000", b"WRITE"]);
    assert_eq!(paused, b"+OK\r\n");
    for b in &blocks[..10] {
        s.insert(Arc::new(b.clone())).unwrap();
    }
    let st = s.stats();
    assert_eq!(st.remote_queue_full, 7, "{st:?}");
    assert_eq!(st.remote_skipped, 7, "{st:?}");
    s.flush().unwrap();
    let st = s.stats();
    assert_eq!(st.remote_blocks_written, 3, "{st:?}");
    // Written, their bytes leave the queue: the next block is published.
    s.insert(Arc::new(blocks[10].clone())).unwrap();
    s.flush().unwrap();
    let st = s.stats();
    assert_eq!(st.remote_blocks_written, 4, "{st:?}");
    assert_eq!(st.remote_queue_full, 7, "{st:?}");
    let ns = d.id();
    for (i, b) in blocks.iter().enumerate() {
        let stored = redis.command(&[b"EXISTS", redis_key(ns, b.meta.key).as_bytes()]);
        let want: &[u8] = if i < 3 || i == 10 {
            b":1\r\n"
        } else {
            b":0\r\n"
        };
        assert_eq!(stored, want, "block {i}");
    }
}

#[test]
fn an_invalid_remote_url_is_an_open_error() {
    let r = Store::open(StoreConfig::default().remote(Some(RemoteConfig::new("http://nope"))));
    assert!(r.is_err());
}

/// Asserts that a fresh store reading through `remote` gets all of `blocks` as verified
/// remote hits.
fn assert_remote_hits(
    remote: RemoteConfig,
    d: &NamespaceDescription,
    blocks: &[Block],
    toks: &[Vec<u32>],
) {
    let dir = tempfile::tempdir().unwrap();
    let b = open_with(dir.path(), remote);
    let ns = b.register_namespace(d).unwrap();
    let ks = keys(blocks);
    assert_eq!(b.lookup(ns, &ks).tiers, vec![Tier::Remote; blocks.len()]);
    let loaded = b.load_prefix(ns, &ks, toks);
    assert!(loaded.stopped.is_none(), "{:?}", loaded.stopped);
    assert_eq!(loaded.blocks.len(), blocks.len());
    let st = b.stats();
    assert_eq!(st.remote_hits, blocks.len() as u64, "{st:?}");
    assert_eq!(
        st.remote_fetches, 1,
        "one pipelined GET for the chain: {st:?}"
    );
}

#[test]
fn a_redis_cluster_spreads_a_chain_over_its_masters_and_serves_it_in_one_fetch() {
    let mut cluster = RedisCluster::start(3);
    let d = common::desc("remote-cluster", 4);
    let n = 24;
    let (blocks, toks) = publish(&cluster.url(), &d, n, 21);
    let per_node = cluster.keys_per_node();
    assert_eq!(per_node.iter().sum::<u64>(), n as u64, "{per_node:?}");
    assert!(
        per_node.iter().all(|&k| k > 0),
        "no hash tag: a chain's keys spread over every master: {per_node:?}"
    );
    assert_remote_hits(RemoteConfig::new(cluster.url()), &d, &blocks, &toks);
    let usage = inspect_remote(&RemoteConfig::new(cluster.url())).unwrap();
    assert_eq!(usage.len(), 1);
    assert_eq!(usage[0].blocks, n as u64);

    // One master killed: lookups through a connected store fail over to the local tiers,
    // quickly, and publishing keeps the engine going.
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path(), &cluster.url());
    let ns = s.register_namespace(&d).unwrap();
    s.insert(Arc::new(blocks[0].clone())).unwrap();
    s.flush().unwrap();
    cluster.nodes[1].kill();
    let t = std::time::Instant::now();
    let ks = keys(&blocks);
    let hit = s.lookup(ns, &ks);
    assert_eq!(hit.tiers[0], Tier::Ram);
    let loaded = s.load_prefix(ns, &ks, &toks);
    assert!(!loaded.blocks.is_empty());
    assert_eq!(loaded.blocks[0].1, Tier::Ram);
    for (got, want) in loaded.blocks.iter().zip(&blocks) {
        assert_eq!(got.0.meta, want.meta, "only verified blocks are served");
    }
    for b in &blocks[1..4] {
        s.insert(Arc::new(b.clone())).unwrap();
    }
    s.flush().unwrap();
    assert!(
        t.elapsed() < std::time::Duration::from_secs(5),
        "{:?}",
        t.elapsed()
    );
    assert!(s.stats().remote_errors >= 1, "{:?}", s.stats());
    assert_eq!(s.lookup(ns, &ks[..4]).tiers, vec![Tier::Ram; 4]);
}

#[test]
fn auth_a_wrong_password_is_a_logged_miss_and_the_right_one_shares_blocks() {
    let redis = RedisServer::start_with(ServerOptions {
        password: Some("s3cret"),
        ..ServerOptions::default()
    });
    let d = common::desc("remote-auth", 4);
    let (blocks, toks) = publish(&redis.url(), &d, 3, 31);
    assert_remote_hits(RemoteConfig::new(redis.url()), &d, &blocks, &toks);

    for url in [
        format!("redis://:wrong@127.0.0.1:{}", redis.port()),
        format!("redis://127.0.0.1:{}", redis.port()),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let s = open(dir.path(), &url);
        let ns = s.register_namespace(&d).unwrap();
        s.insert(Arc::new(blocks[0].clone())).unwrap();
        let ks = keys(&blocks);
        assert_eq!(s.lookup(ns, &ks).tiers, vec![Tier::Ram], "{url}");
        assert_eq!(s.load_prefix(ns, &ks, &toks).blocks.len(), 1);
        s.flush().unwrap();
        let st = s.stats();
        assert!(
            st.remote_errors >= 1 && st.remote_hits == 0,
            "{url}: {st:?}"
        );
    }
}

#[test]
fn tls_with_a_custom_ca_shares_blocks_and_an_untrusted_server_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let certs = TestCerts::generate(dir.path());
    let redis = RedisServer::start_with(ServerOptions {
        password: Some("tls-pw"),
        tls: Some(&certs),
        ..ServerOptions::default()
    });
    assert!(redis.url().starts_with("rediss://"));
    let tls = || {
        RemoteConfig::new(redis.url())
            .ca_cert(Some(certs.ca.clone()))
            // A TLS handshake in a debug build on a loaded machine can take a while.
            .connect_timeout_ms(10_000)
            .io_timeout_ms(10_000)
    };
    let d = common::desc("remote-tls", 4);
    let (blocks, toks) = publish_with(tls(), &d, 3, 41);
    assert_remote_hits(tls(), &d, &blocks, &toks);
    let usage = inspect_remote(&tls()).unwrap();
    assert_eq!(usage[0].blocks, 3);

    // Without the CA the server's certificate is not trusted: a miss, never plain text.
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path(), &redis.url());
    let ns = s.register_namespace(&d).unwrap();
    assert!(s.lookup(ns, &keys(&blocks)).tiers.is_empty());
    assert!(s.stats().remote_errors >= 1);

    // A CA file that does not exist is an open error naming it.
    let bad = Store::open(StoreConfig::default().remote(Some(
        RemoteConfig::new(redis.url()).ca_cert(Some(dir.path().join("missing.pem"))),
    )));
    let msg = bad
        .err()
        .expect("a missing CA file is an error")
        .to_string();
    assert!(
        msg.contains("missing.pem") && !msg.contains("tls-pw"),
        "{msg}"
    );
}

#[test]
fn tls_on_a_redis_cluster_with_a_custom_ca_shares_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let certs = TestCerts::generate(dir.path());
    let cluster = RedisCluster::start_with(3, Some(&certs));
    assert!(cluster.url().starts_with("rediss+cluster://"));
    let tls = || {
        RemoteConfig::new(cluster.url())
            .ca_cert(Some(certs.ca.clone()))
            // A TLS handshake in a debug build on a loaded machine can take a while.
            .connect_timeout_ms(10_000)
            .io_timeout_ms(10_000)
    };
    let d = common::desc("remote-cluster-tls", 4);
    let (blocks, toks) = publish_with(tls(), &d, 12, 51);
    assert_remote_hits(tls(), &d, &blocks, &toks);
    assert_eq!(inspect_remote(&tls()).unwrap()[0].blocks, 12);
}

#[test]
fn cluster_urls_are_parsed_and_bad_ones_refused() {
    for bad in [
        "redis+cluster://",
        "redis+cluster://:pw@",
        "redis+cluster://h:1/0",
    ] {
        let r = Store::open(StoreConfig::default().remote(Some(RemoteConfig::new(bad))));
        assert!(r.is_err(), "{bad}");
    }
    // Seeds are not contacted at open.
    let ok = Store::open(StoreConfig::default().remote(Some(RemoteConfig::new(
        "redis+cluster://:pw@127.0.0.1:1,127.0.0.1:2",
    ))));
    assert!(ok.is_ok());
}

/// The `TTL` Redis reports for `key` (seconds; -1 without one, -2 when missing).
fn redis_ttl(redis: &RedisServer, key: &str) -> i64 {
    let reply = redis.command(&[b"TTL", key.as_bytes()]);
    let text = String::from_utf8_lossy(&reply);
    text.trim()
        .trim_start_matches(':')
        .parse()
        .unwrap_or_else(|_| panic!("TTL reply {text:?}"))
}

/// Pins reach the remote tier: with `--remote-ttl` 60 s, a block published while pinned
/// for an hour gets the hour, and pinning blocks Redis already holds extends their TTL
/// (never shortens it); unpinned blocks keep the configured 60 s.
#[test]
fn pinned_blocks_outlive_the_remote_ttl() {
    let redis = RedisServer::start();
    let d = common::desc("remote-pins", 4);
    let dir = tempfile::tempdir().unwrap();
    let s = open_with(
        dir.path(),
        RemoteConfig::new(redis.url()).ttl_secs(Some(60)),
    );
    let ns = s.register_namespace(&d).unwrap();
    let (blocks, _) = common::chain(&d, 4, 7);
    let ks = keys(&blocks);
    let hour = std::time::Duration::from_secs(3600);
    // Blocks 0-1 pinned before they are published; 2-3 published unpinned.
    s.pin(ns, &ks[..2], hour, false);
    for b in &blocks {
        s.insert(Arc::new(b.clone())).unwrap();
    }
    s.flush().unwrap();
    let ttl = |i: usize| redis_ttl(&redis, &redis_key(ns, ks[i]));
    for i in 0..2 {
        assert!(ttl(i) > 3000, "block {i}: TTL {}", ttl(i));
    }
    for i in 2..4 {
        assert!((1..=60).contains(&ttl(i)), "block {i}: TTL {}", ttl(i));
    }
    // Pinning a block Redis holds extends its TTL; a shorter pin does not shorten one.
    s.pin(ns, &ks[2..3], hour, false);
    s.pin(ns, &ks[..1], std::time::Duration::from_secs(5), false);
    s.flush().unwrap();
    assert!(ttl(2) > 3000, "TTL {}", ttl(2));
    assert!(ttl(0) > 3000, "TTL {}", ttl(0));
    assert!((1..=60).contains(&ttl(3)), "TTL {}", ttl(3));
}
