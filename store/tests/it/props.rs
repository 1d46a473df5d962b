//! Random operation sequences against a simple model.

use std::collections::HashMap;
use std::sync::Arc;

use proptest::prelude::*;
use store::{
    Block, EvictionPolicy, ReadOutcome, SsdOptions, SsdTier, Store, StoreConfig, WriteOutcome,
    WritePolicy,
};

use crate::common;

#[derive(Debug, Clone)]
enum Op {
    Put(usize),
    Get(usize),
    Reopen,
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(
        prop_oneof![
            4 => (0usize..24).prop_map(Op::Put),
            3 => (0usize..24).prop_map(Op::Get),
            1 => Just(Op::Reopen),
        ],
        1..40,
    )
}

/// Blocks of three sizes (1, 2 and 3 file-system blocks of plane data).
fn universe() -> Vec<Block> {
    let ds = [
        common::desc("p1", 64),
        common::desc("p2", 128),
        common::desc("p3", 192),
    ];
    (0..24)
        .map(|i| {
            let d = &ds[i % 3];
            let t = common::tokens(i as u64, 0, 4);
            common::block(d, d.id().0, 0, t, i as u64)
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, .. ProptestConfig::default() })]

    /// SSD tier vs a model LRU: every get returns exactly what was put; the physical bytes
    /// on disk never exceed the budget; the blocks present are always the most recently
    /// used ones, across reopens (the LRU order persists).
    #[test]
    fn ssd_tier_matches_an_lru_model(ops in ops()) {
        let dir = tempfile::tempdir().unwrap();
        let budget = 40 * 1024;
        let opts = SsdOptions { read_only: false, budget };
        let blocks = universe();
        let mut tier = SsdTier::open(dir.path(), opts).unwrap();
        // Model: access order of blocks that were ever written, least recent first.
        let mut order: Vec<usize> = Vec::new();
        for op in ops {
            match op {
                Op::Put(i) => {
                    let out = tier.put(&blocks[i]).unwrap();
                    if out == WriteOutcome::AlreadyPresent {
                        prop_assert!(order.contains(&i));
                    }
                    order.retain(|&j| j != i);
                    order.push(i);
                }
                Op::Get(i) => {
                    let b = &blocks[i];
                    match tier.get(b.meta.namespace, b.meta.key) {
                        ReadOutcome::Hit(got) => {
                            prop_assert_eq!(&got, b);
                            order.retain(|&j| j != i);
                            order.push(i);
                        }
                        ReadOutcome::Miss => {}
                        ReadOutcome::Corrupt { error, .. } => prop_assert!(false, "corrupt: {}", error),
                    }
                }
                Op::Reopen => {
                    drop(tier);
                    tier = SsdTier::open(dir.path(), opts).unwrap();
                }
            }
            prop_assert!(common::physical(dir.path()) <= budget);
            prop_assert_eq!(tier.used_bytes(), common::physical(dir.path()));
            // Present blocks form a suffix of the model's access order.
            let present: Vec<bool> = order
                .iter()
                .map(|&j| tier.contains(blocks[j].meta.namespace, blocks[j].meta.key))
                .collect();
            if let Some(first) = present.iter().position(|&p| p) {
                prop_assert!(present[first..].iter().all(|&p| p), "not LRU: {:?} {:?}", order, present);
            }
            // The most recent block always fits, so it is present.
            if let Some(&last) = order.last() {
                prop_assert!(*present.last().unwrap(), "most recent block {} missing", last);
            }
        }
    }

    /// The whole store (RAM + SSD, both write policies) under LRU eviction: loads return
    /// exactly what was inserted, both budgets hold, and after a flush and reopen the last
    /// insert survives unless a block left RAM after it. A block that leaves RAM reaches the
    /// SSD as of the time it left (a victim cache), while one the SSD already holds keeps
    /// its last use there, so a later departure can outrank the last insert on a full SSD
    /// (found by this test, in one run of four of the same operations: the SSD holds 18 after
    /// a reopen; Put 10, Put 21, Put 17 (RAM evicts 10), Put 18 (RAM evicts 21), Get 23
    /// (evicts 17), Get 9 (evicts 18), reopen: the SSD keeps 17 and 21, which left RAM after
    /// 18's last use, and gives 18 up; which blocks a group commit finds to evict depends on
    /// how many writes were queued together).
    #[test]
    fn store_matches_a_map_model(ops in ops(), through in any::<bool>()) {
        store_against_a_map_model(ops, through, EvictionPolicy::Lru)?;
    }

    /// The same under freq-admit, the default, last insert included unless a block left RAM
    /// after it: a block the RAM tier's gate refuses is spilled to SSD at once, and the
    /// write-back flush after it writes RAM's blocks with their RAM recency, older than the
    /// refused block's (unless loaded since), so the SSD gives up older blocks first
    /// (docs/prefix-reuse.md, "Eviction"). A block that leaves RAM later (a load's promotion
    /// or a later insert making room) reaches the SSD as of the time it left, as a victim
    /// cache takes it, so it outranks the refused insert there: with the SSD full, the
    /// refused insert can be the one it gives up (found by this test: Put 0, Put 23,
    /// reopen, Put 16, Put 10, Put 4 refused, Get 23 evicting 16 and 10, reopen). Once a
    /// reopen could not expect it, no later reopen does before the next insert (found by
    /// this test: Put 0, Put 4, Put 18, reopen, Get 18, Put 20, Put 2, Get 4 evicting from
    /// RAM, reopen, reopen: the model expected 2 back at the second reopen). Written
    /// through, an insert's SSD copy is stamped after the blocks its insert displaced from
    /// RAM (found by this test: Put 3, 19, 14, 0, Get 14, Put 8, Get 14, reopen lost 8,
    /// whose write was stamped before its victims' spills and refused by a full SSD).
    #[test]
    fn store_under_freq_admit_matches_a_map_model(ops in ops(), through in any::<bool>()) {
        store_against_a_map_model(ops, through, EvictionPolicy::FreqAdmit)?;
    }
}

fn store_against_a_map_model(
    ops: Vec<Op>,
    through: bool,
    eviction: EvictionPolicy,
) -> Result<(), TestCaseError> {
    let dir = tempfile::tempdir().unwrap();
    let blocks = universe();
    let cfg = StoreConfig::default()
        .root(dir.path())
        .ram_budget(20_000)
        .ssd_budget(48 * 1024)
        .eviction(eviction)
        .write_policy(if through {
            WritePolicy::WriteThrough
        } else {
            WritePolicy::WriteBack
        });
    let mut s: Store = Store::open(cfg.clone()).unwrap();
    let ds = [
        common::desc("p1", 64),
        common::desc("p2", 128),
        common::desc("p3", 192),
    ];
    for d in &ds {
        s.register_namespace(d).unwrap();
    }
    let mut inserted: HashMap<usize, ()> = HashMap::new();
    let mut last = None;
    // RAM evictions counted right after the last insert.
    let mut left_ram_at_last = 0;
    for op in ops {
        match op {
            Op::Put(i) => {
                s.insert(Arc::new(blocks[i].clone())).unwrap();
                inserted.insert(i, ());
                last = Some(i);
                left_ram_at_last = s.stats().ram_evictions;
            }
            Op::Get(i) => {
                let b = &blocks[i];
                let got = s.load_prefix(
                    b.meta.namespace,
                    &[b.meta.key],
                    std::slice::from_ref(&b.meta.tokens),
                );
                if let Some((p, _)) = got.blocks.first() {
                    prop_assert!(inserted.contains_key(&i));
                    prop_assert_eq!(&**p, b);
                } else {
                    prop_assert!(
                        matches!(got.stopped, Some(store::StopReason::Missing { .. })),
                        "{:?}",
                        got.stopped
                    );
                }
            }
            Op::Reopen => {
                let left_since = s.stats().ram_evictions > left_ram_at_last;
                s.flush().unwrap();
                drop(s);
                s = Store::open(cfg.clone()).unwrap();
                left_ram_at_last = 0;
                let kept = !left_since;
                if !kept {
                    // It may have been given up now, and a later reopen cannot bring it
                    // back: the property holds again from the next insert.
                    last = None;
                }
                if let Some(i) = last {
                    let b = &blocks[i];
                    prop_assert!(
                        s.lookup(b.meta.namespace, &[b.meta.key]).blocks() == 1,
                        "last insert lost"
                    );
                }
            }
        }
        let st = s.stats();
        prop_assert!(st.ram_bytes <= 20_000);
        prop_assert!(common::physical(dir.path()) <= 48 * 1024);
    }
    Ok(())
}

/// Cases proptest found under freq-admit, replayed as they are. The first: the insert of 2
/// displaced 3, 12 and 13, which the spill stamped after 2's own use, so the flush wrote 2
/// as older than them and the full SSD gave it up (fixed: an insert that displaces blocks
/// is stamped after them). The second: 4 is refused, then a load of 23 displaces 16 and 10
/// after it (the property leaves that case out: see `store_under_freq_admit_matches_a_map_model`).
#[test]
fn freq_admit_cases_found_by_proptest() {
    use Op::{Get, Put, Reopen};
    let cases = [
        vec![
            Put(12),
            Put(3),
            Put(13),
            Get(13),
            Put(6),
            Put(2),
            Get(12),
            Reopen,
        ],
        vec![
            Put(0),
            Put(23),
            Reopen,
            Put(16),
            Put(10),
            Put(4),
            Get(23),
            Reopen,
        ],
    ];
    for ops in cases {
        store_against_a_map_model(ops.clone(), false, EvictionPolicy::FreqAdmit)
            .unwrap_or_else(|e| panic!("{ops:?}: {e}"));
    }
}
