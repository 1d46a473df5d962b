//! One conformance suite for every tier (`store::BlockTier`): host RAM, the SSD and a real
//! `redis-server`. Each runs the same checks of the contract in store/src/tier.rs.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use store::{
    Block, BlockKey, BlockTier, NamespaceId, RamTier, RemoteConfig, SsdOptions, SsdTier, TierRead,
};

use crate::common;
use crate::redis_server::RedisServer;

/// Damages the stored bytes of one block, as a disk or a stranger writing to Redis would.
type Corrupt<'a> = &'a dyn Fn(NamespaceId, BlockKey);

fn hit(t: &dyn BlockTier, b: &Block) -> bool {
    match t.get(b.meta.namespace, b.meta.key) {
        TierRead::Hit(got) => {
            assert_eq!(
                *got,
                *b,
                "{}: a hit must be the block that was put",
                t.name()
            );
            true
        }
        TierRead::Miss => false,
        other => panic!("{}: {:?} for an intact block", t.name(), other),
    }
}

fn held(t: &dyn BlockTier) -> BTreeSet<(NamespaceId, BlockKey)> {
    t.keys().unwrap().into_iter().collect()
}

/// The contract, checked on a fresh tier `t` whose budget (if any) holds more than 3 and
/// fewer than 12 of the suite's blocks.
fn conformance(t: &dyn BlockTier, corrupt: Option<Corrupt<'_>>) {
    let d = common::desc("tier-contract", 4);
    let (blocks, _) = common::chain(&d, 12, 77);
    let name = t.name();

    // Empty.
    assert!(held(t).is_empty(), "{name}: a fresh tier holds nothing");
    assert!(!t.contains(d.id(), blocks[0].meta.key));
    assert!(!hit(t, &blocks[0]));

    // Put and read back, bit for bit; putting again changes nothing.
    for b in &blocks[..3] {
        t.put(Arc::new(b.clone())).unwrap();
    }
    for b in &blocks[..3] {
        assert!(t.contains(d.id(), b.meta.key), "{name}");
        assert!(hit(t, b), "{name}: a block just put must hit");
    }
    let (keys, used) = (held(t), t.used_bytes());
    assert_eq!(
        keys,
        blocks[..3]
            .iter()
            .map(|b| (b.meta.namespace, b.meta.key))
            .collect(),
        "{name}: keys lists what was put"
    );
    t.put(Arc::new(blocks[1].clone())).unwrap();
    assert_eq!(
        held(t),
        keys,
        "{name}: a second put of a block adds nothing"
    );
    assert_eq!(t.used_bytes(), used, "{name}");

    // Remove.
    assert!(t.remove(d.id(), blocks[1].meta.key).unwrap(), "{name}");
    assert!(!t.contains(d.id(), blocks[1].meta.key), "{name}");
    assert!(!hit(t, &blocks[1]), "{name}: a removed block must miss");
    assert!(!t.remove(d.id(), blocks[1].meta.key).unwrap(), "{name}");
    assert!(t.used_bytes() < used, "{name}: removing frees its bytes");

    // The budget holds after every put; what stays is intact and listed.
    for b in &blocks {
        t.put(Arc::new(b.clone())).unwrap();
        if let Some(budget) = t.budget() {
            assert!(
                t.used_bytes() <= budget,
                "{name}: {} > {budget}",
                t.used_bytes()
            );
        }
    }
    let kept = held(t);
    if t.budget().is_some() {
        assert!(
            kept.len() < blocks.len(),
            "{name}: the budget must have evicted"
        );
        assert!(
            kept.len() >= 3,
            "{name}: the budget holds more than 3 blocks"
        );
    } else {
        assert_eq!(kept.len(), blocks.len(), "{name}");
    }
    for b in &blocks {
        let listed = kept.contains(&(b.meta.namespace, b.meta.key));
        assert_eq!(hit(t, b), listed, "{name}: keys and get agree");
    }

    // Damaged bytes are reported, never served, and not served again.
    if let Some(corrupt) = corrupt {
        let victim = blocks
            .iter()
            .find(|b| kept.contains(&(b.meta.namespace, b.meta.key)))
            .unwrap();
        corrupt(victim.meta.namespace, victim.meta.key);
        match t.get(victim.meta.namespace, victim.meta.key) {
            TierRead::Corrupt(_) => {}
            other => panic!("{name}: damaged bytes read as {other:?}"),
        }
        let again = t.get(victim.meta.namespace, victim.meta.key);
        assert!(
            !matches!(again, TierRead::Hit(_)),
            "{name}: damaged bytes served on a second read"
        );
    }
}

fn budget_for(blocks: usize) -> u64 {
    let d = common::desc("tier-contract", 4);
    let (chain, _) = common::chain(&d, 1, 77);
    chain[0].data_len() * blocks as u64
}

#[test]
fn the_ram_tier_keeps_the_contract() {
    let t = Mutex::new(RamTier::new(budget_for(6) + 1));
    conformance(&t, None);
}

#[test]
fn the_ssd_tier_keeps_the_contract() {
    let dir = tempfile::tempdir().unwrap();
    // The budget counts file bytes on disk: measure one block's, then allow six and a half.
    let per_block = {
        let probe = SsdTier::open(
            dir.path().join("probe"),
            SsdOptions {
                read_only: false,
                budget: 1 << 30,
            },
        )
        .unwrap();
        let d = common::desc("tier-contract", 4);
        let (chain, _) = common::chain(&d, 1, 77);
        probe.put(&chain[0]).unwrap();
        probe.used_bytes()
    };
    let t = SsdTier::open(
        dir.path().join("store"),
        SsdOptions {
            read_only: false,
            budget: per_block * 13 / 2,
        },
    )
    .unwrap();
    let corrupt = |ns: NamespaceId, key: BlockKey| {
        let path = t.block_path(ns, key);
        let mut bytes = std::fs::read(&path).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 0x10;
        std::fs::write(&path, bytes).unwrap();
    };
    conformance(&t, Some(&corrupt));
}

#[test]
fn the_ssd_tier_keeps_the_contract_on_the_in_memory_file_system() {
    use store::fs::SimFs;
    let fs = SimFs::new();
    // SimFs pages are 4 KiB and one suite block fits in one: six and a half blocks.
    let t = SsdTier::open_in(
        fs.clone(),
        "/store",
        SsdOptions {
            read_only: false,
            budget: 4096 * 13 / 2,
        },
    )
    .unwrap();
    let corrupt = |ns: NamespaceId, key: BlockKey| {
        let path = t.block_path(ns, key);
        let mut bytes = fs.files()[&path].clone();
        let last = bytes.len() - 1;
        bytes[last] ^= 0x10;
        fs.damage(&path, bytes).unwrap();
    };
    conformance(&t, Some(&corrupt));
}

#[test]
fn the_remote_tier_keeps_the_contract() {
    let redis = RedisServer::start();
    let t = store::remote_tier(RemoteConfig::new(redis.url())).unwrap();
    let corrupt = |ns: NamespaceId, key: BlockKey| {
        let k = store::remote::redis_key(ns, key);
        redis.command(&[b"SET", k.as_bytes(), b"not a block file"]);
    };
    conformance(&t, Some(&corrupt));
}
