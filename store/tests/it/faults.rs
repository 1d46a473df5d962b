//! Faults the kernel would produce, injected under the SSD tier through `store::fs::SimFs`:
//! power loss (everything not fsync'd is gone), failed `fsync`, `rename` and directory
//! `fsync`, `write` with ENOSPC or EIO, a write torn in the middle.
//!
//! After any fault and a reopen: every block served verifies, every block acknowledged as
//! durable (`put` returned `Ok`) and not evicted or removed since is still there, a failed
//! fsync or rename poisons the writer (it refuses every later write and makes no further
//! file system call), and the byte budget holds.
//!
//! The randomized schedules are seeded: a failing seed is printed with the command that
//! replays it alone (`KVSTORE_FAULT_SEED=<seed> cargo test -p kvstore-store --test it
//! faults::one_schedule -- --ignored --nocapture`). The long run (docs/reliability.md):
//! `KVSTORE_FAULT_SCHEDULES=10000 cargo test -p kvstore-store --test it
//! faults::many_schedules -- --ignored --nocapture`.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::time::Instant;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use store::fs::{Fault, FaultKind, Op, SimFs};
use store::{
    Block, BlockKey, NamespaceId, PutJob, ReadOutcome, SsdOptions, SsdTier, UsedAt, WriteError,
    WriteOutcome,
};

use crate::common;

type Key = (NamespaceId, BlockKey);

fn root() -> PathBuf {
    PathBuf::from("/store")
}

fn open(fs: &SimFs, budget: u64) -> SsdTier<SimFs> {
    SsdTier::open_in(
        fs.clone(),
        root(),
        SsdOptions {
            read_only: false,
            budget,
        },
    )
    .expect("a store on a file system that works again opens")
}

fn key(b: &Block) -> Key {
    (b.meta.namespace, b.meta.key)
}

fn pool(n: usize) -> Vec<Block> {
    let d = common::desc("faults", 4);
    let (mut a, _) = common::chain(&d, n / 2, 11);
    let (b, _) = common::chain(&d, n - n / 2, 12);
    a.extend(b);
    a
}

/// Bytes one block of [`pool`] takes on the sim (4 KiB pages).
const BLOCK_PHYS: u64 = 4096;

/// The blocks by key: what a read must return.
fn index(blocks: &[Block]) -> HashMap<Key, Block> {
    blocks.iter().map(|b| (key(b), b.clone())).collect()
}

/// A fault on the next call of `op`.
fn next(op: Op, kind: FaultKind) -> Fault {
    Fault { op, nth: 0, kind }
}

/// Runs `schedule` for every seed, panicking with the failing seed and how to replay it
/// (tier schedules by `one_schedule`; store schedules share the seeds).
fn for_seeds<T>(
    seeds: std::ops::Range<u64>,
    schedule: impl Fn(u64) -> T + std::panic::RefUnwindSafe,
) -> Vec<T> {
    seeds
        .map(|seed| match std::panic::catch_unwind(|| schedule(seed)) {
            Ok(t) => t,
            Err(e) => {
                let msg = e
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                panic!(
                    "fault schedule seed {seed} failed: {msg}\nreplay: KVSTORE_FAULT_SEED={seed} \
                     cargo test -p kvstore-store --test it faults::one_schedule -- --ignored --nocapture"
                );
            }
        })
        .collect()
}

fn is_block_file(p: &Path) -> bool {
    p.extension().is_some_and(|e| e == "safetensors")
        && !p.starts_with(root().join("tmp"))
        && !p.starts_with(root().join("quarantine"))
}

/// Checks a freshly opened tier against the file system and the blocks acknowledged
/// before the power cut; returns how many blocks it read and verified.
fn check_reopened(
    fs: &SimFs,
    tier: &SsdTier<SimFs>,
    acked: &BTreeSet<Key>,
    by_key: &HashMap<Key, Block>,
) -> u64 {
    let held: BTreeSet<Key> = tier
        .entries()
        .iter()
        .map(|e| (e.namespace, e.key))
        .collect();
    let lost: Vec<_> = acked.difference(&held).collect();
    assert!(
        lost.is_empty(),
        "blocks acknowledged as durable were lost: {lost:?}"
    );
    let files = fs.files();
    assert!(
        !files.keys().any(|p| p.starts_with(root().join("tmp"))
            && p.extension().is_some_and(|e| e == "tmp")),
        "temporary files survive a reopen: {:?}",
        files.keys().collect::<Vec<_>>()
    );
    let on_disk: u64 = files
        .iter()
        .filter(|(p, _)| is_block_file(p))
        .map(|(_, b)| (b.len() as u64).div_ceil(BLOCK_PHYS) * BLOCK_PHYS)
        .sum();
    assert_eq!(
        tier.used_bytes(),
        on_disk,
        "the tier's byte count matches the block files on disk"
    );
    let mut checked = 0;
    for k in &held {
        match tier.get(k.0, k.1) {
            ReadOutcome::Hit(b) => {
                assert_eq!(Some(&b), by_key.get(k), "a block served is the one put");
                checked += 1;
            }
            other => panic!("a block the tier lists after a reopen must verify: {other:?}"),
        }
    }
    checked
}

fn is_poisoned(r: &Result<store::WriteOutcome, WriteError>) -> bool {
    matches!(r, Err(WriteError::Poisoned { .. }))
}

#[test]
fn a_failed_fsync_poisons_the_writer_which_then_refuses_without_touching_the_disk() {
    let fs = SimFs::new();
    let blocks = pool(4);
    let tier = open(&fs, 1 << 20);
    tier.put(&blocks[0]).unwrap();
    fs.inject(next(Op::SyncFile, FaultKind::Eio));
    let r = tier.put(&blocks[1]);
    assert!(is_poisoned(&r), "{r:?}");
    let calls = fs.calls();
    for b in &blocks[1..] {
        assert!(is_poisoned(&tier.put(b)), "later writes are refused");
    }
    assert!(matches!(
        tier.remove(blocks[0].meta.namespace, blocks[0].meta.key),
        Err(WriteError::Poisoned { .. })
    ));
    assert_eq!(
        fs.calls(),
        calls,
        "a poisoned writer never retries the disk"
    );
    drop(tier);
    fs.power_loss(1);
    let tier = open(&fs, 1 << 20);
    let by_key = index(&blocks);
    let acked = BTreeSet::from([key(&blocks[0])]);
    assert_eq!(check_reopened(&fs, &tier, &acked, &by_key), 1);
    tier.put(&blocks[1]).expect("a reopened writer works again");
}

#[test]
fn a_failed_rename_or_directory_fsync_poisons_the_writer() {
    for op in [Op::Rename, Op::SyncDir] {
        let fs = SimFs::new();
        let blocks = pool(3);
        let tier = open(&fs, 1 << 20);
        tier.put(&blocks[0]).unwrap();
        fs.inject(Fault {
            op,
            nth: 0,
            kind: FaultKind::Eio,
        });
        assert!(is_poisoned(&tier.put(&blocks[1])), "{op:?}");
        assert!(is_poisoned(&tier.put(&blocks[2])), "{op:?}");
        drop(tier);
        fs.power_loss(2);
        let tier = open(&fs, 1 << 20);
        let by_key = index(&blocks);
        check_reopened(&fs, &tier, &BTreeSet::from([key(&blocks[0])]), &by_key);
    }
}

#[test]
fn a_write_that_fails_with_eio_or_enospc_leaves_nothing_behind_and_does_not_poison() {
    for kind in [FaultKind::Eio, FaultKind::NoSpace] {
        let fs = SimFs::new();
        let blocks = pool(2);
        let tier = open(&fs, 1 << 20);
        fs.inject(Fault {
            op: Op::Write,
            nth: 0,
            kind,
        });
        let r = tier.put(&blocks[0]);
        assert!(matches!(r, Err(WriteError::Io { .. })), "{kind:?}: {r:?}");
        assert!(
            !fs.files().keys().any(|p| p.starts_with(root().join("tmp"))),
            "{kind:?}: the temporary file is removed"
        );
        tier.put(&blocks[0]).expect("the writer is not poisoned");
        tier.put(&blocks[1]).unwrap();
    }
}

#[test]
fn a_full_disk_during_a_write_evicts_to_fit_and_retries_once() {
    let fs = SimFs::new();
    let blocks = pool(6);
    let tier = open(&fs, 1 << 20);
    for b in &blocks[..5] {
        tier.put(b).unwrap();
    }
    fs.inject(next(Op::Write, FaultKind::NoSpace));
    tier.put(&blocks[5])
        .expect("room is made by eviction, then the write is retried");
    assert!(tier.budget() < 1 << 20, "the budget shrinks to what fits");
    assert!(tier.used_bytes() <= tier.budget());
    assert!(tier.contains(blocks[5].meta.namespace, blocks[5].meta.key));
}

/// Cuts the power at each call of `write` (and once after its last) on a tier holding
/// `blocks[0]`: every block `write` acknowledged (it returns their keys) survives with
/// `blocks[0]`, and afterwards the tier takes `blocks`' last block and keeps it through
/// another cut. `write`'s calls are counted on a probe first; at least `min_calls`.
fn cut_at_every_call(
    blocks: &[Block],
    min_calls: u64,
    write: impl Fn(&SsdTier<SimFs>) -> Vec<Key>,
) {
    let by_key = index(blocks);
    let last = blocks.last().expect("blocks");
    let probe = SimFs::new();
    let t = open(&probe, 1 << 20);
    t.put(&blocks[0]).unwrap();
    let before = probe.calls();
    assert!(!write(&t).is_empty(), "the probe's write was refused");
    let calls = probe.calls() - before;
    assert!(calls >= min_calls, "{calls} calls");
    for nth in 0..=calls {
        let fs = SimFs::new();
        let tier = open(&fs, 1 << 20);
        tier.put(&blocks[0]).unwrap();
        fs.inject(Fault {
            op: Op::Any,
            nth,
            kind: FaultKind::PowerLoss,
        });
        let mut acked = BTreeSet::from([key(&blocks[0])]);
        acked.extend(write(&tier));
        drop(tier);
        fs.power_loss(nth);
        let tier = open(&fs, 1 << 20);
        check_reopened(&fs, &tier, &acked, &by_key);
        // Whatever survived, the store takes new writes and keeps them.
        tier.put(last).unwrap();
        drop(tier);
        fs.power_loss(nth + 1000);
        acked.insert(key(last));
        check_reopened(&fs, &open(&fs, 1 << 20), &acked, &by_key);
    }
}

#[test]
fn a_power_cut_at_every_call_of_a_put_keeps_every_acknowledged_block() {
    let blocks = pool(3);
    // A put creates, writes, syncs, renames, syncs the dir.
    cut_at_every_call(&blocks, 5, |tier| match tier.put(&blocks[1]) {
        Ok(_) => vec![key(&blocks[1])],
        Err(_) => Vec::new(),
    });
}

/// `blocks` as one group of new puts.
fn group(blocks: &[Block]) -> Vec<PutJob<'_>> {
    blocks
        .iter()
        .map(|block| PutJob {
            block,
            replace: false,
            used: None,
        })
        .collect()
}

/// A group commit keeps every block it acknowledged through a power cut at any of its
/// calls, as single puts do.
#[test]
fn a_power_cut_at_every_call_of_a_group_commit_keeps_every_acknowledged_block() {
    let blocks = pool(6);
    cut_at_every_call(&blocks, 4 * 5, |tier| {
        let results = tier.put_many(&group(&blocks[1..5]));
        blocks[1..5]
            .iter()
            .zip(results)
            .filter(|(_, r)| matches!(r, Ok(WriteOutcome::Written { .. })))
            .map(|(b, _)| key(b))
            .collect()
    });
}

/// A group's files are all fsynced before any is renamed into place: a failed fsync of
/// the third file fails the whole group (no block of it is stored, even those whose own
/// fsync succeeded) and poisons the writer, as a failed fsync of a single put does.
#[test]
fn a_group_syncs_all_its_files_before_renaming_any() {
    let blocks = pool(4);
    let fs = SimFs::new();
    let tier = open(&fs, 1 << 20);
    fs.inject(Fault {
        op: Op::SyncFile,
        nth: 2,
        kind: FaultKind::Eio,
    });
    let results = tier.put_many(&group(&blocks));
    assert!(results.iter().all(Result::is_err), "{results:?}");
    assert!(matches!(
        results[0],
        Err(WriteError::Io { .. }) | Err(WriteError::Poisoned { .. })
    ));
    assert_eq!(tier.entries().len(), 0, "a block of the group was stored");
    assert!(
        !fs.files().keys().any(|p| is_block_file(p)),
        "a block file was renamed into place before every fsync of its group succeeded"
    );
    assert!(matches!(
        tier.put(&blocks[0]),
        Err(WriteError::Poisoned { .. })
    ));
}

/// On a full tier a group keeps its blocks together while the room they need comes from
/// blocks less recent than all of them, and ends holding what one put at a time would:
/// the same blocks (the reference run) and the same bytes. Proof that it stayed one group:
/// a failed third fsync fails all four blocks.
#[test]
fn a_group_on_a_full_tier_evicts_as_single_puts_would() {
    let blocks = pool(10);
    let stamped = |bs: &[Block], from: u64| -> Vec<(Block, u64)> {
        bs.iter()
            .enumerate()
            .map(|(i, b)| (b.clone(), from + i as u64))
            .collect()
    };
    let old = stamped(&blocks[..4], 1);
    let new = stamped(&blocks[4..8], 100);
    let held = |t: &SsdTier<SimFs>| -> BTreeSet<Key> {
        t.entries().iter().map(|e| (e.namespace, e.key)).collect()
    };
    let full = |fs: &SimFs| {
        let t = open(fs, 4 * BLOCK_PHYS);
        for (b, s) in &old {
            t.put_at(b, UsedAt::now(*s)).unwrap();
        }
        t
    };
    let jobs: Vec<PutJob<'_>> = new
        .iter()
        .map(|(block, s)| PutJob {
            block,
            replace: false,
            used: Some(UsedAt::now(*s)),
        })
        .collect();
    // Reference: one put at a time.
    let serial = full(&SimFs::new());
    for (b, s) in &new {
        serial.put_at(b, UsedAt::now(*s)).unwrap();
    }
    let fs = SimFs::new();
    let grouped = full(&fs);
    let results = grouped.put_many(&jobs);
    assert!(results
        .iter()
        .all(|r| matches!(r, Ok(WriteOutcome::Written { .. }))));
    assert_eq!(held(&grouped), held(&serial));
    assert_eq!(grouped.used_bytes(), serial.used_bytes());
    assert_eq!(held(&grouped), new.iter().map(|(b, _)| key(b)).collect());

    let fs = SimFs::new();
    let t = full(&fs);
    fs.inject(Fault {
        op: Op::SyncFile,
        nth: 2,
        kind: FaultKind::Eio,
    });
    assert!(t.put_many(&jobs).iter().all(Result::is_err));
    assert!(held(&t)
        .iter()
        .all(|k| !new.iter().any(|(b, _)| key(b) == *k)));
}

#[test]
fn a_torn_write_loses_only_the_block_being_written() {
    let blocks = pool(3);
    let by_key = index(&blocks);
    let fs = SimFs::new();
    let tier = open(&fs, 1 << 20);
    tier.put(&blocks[0]).unwrap();
    tier.put(&blocks[1]).unwrap();
    fs.inject(next(Op::Write, FaultKind::TornWrite));
    assert!(tier.put(&blocks[2]).is_err());
    assert!(
        fs.is_off(),
        "a torn write is a power cut in the middle of a write"
    );
    drop(tier);
    fs.power_loss(7);
    let tier = open(&fs, 1 << 20);
    let acked = BTreeSet::from([key(&blocks[0]), key(&blocks[1])]);
    assert_eq!(check_reopened(&fs, &tier, &acked, &by_key), 2);
}

#[test]
fn a_torn_access_journal_costs_recency_not_blocks() {
    let blocks = pool(4);
    let by_key = index(&blocks);
    for seed in 0..8 {
        let fs = SimFs::new();
        let tier = open(&fs, 1 << 20);
        for b in &blocks {
            tier.put(b).unwrap();
        }
        tier.sync().unwrap();
        for b in blocks.iter().rev() {
            tier.touch(b.meta.namespace, b.meta.key);
        }
        // Dropping flushes the buffered journal records to the page cache; the power cut
        // keeps a random prefix of them.
        drop(tier);
        fs.power_loss(seed);
        let tier = open(&fs, 1 << 20);
        let acked = blocks.iter().map(key).collect();
        assert_eq!(check_reopened(&fs, &tier, &acked, &by_key), 4);
    }
}

/// One seeded schedule on the `Store` facade: inserts, flushes, faults and power cuts.
/// `flush` returning `Ok` acknowledges every block inserted since the previous flush; those
/// must survive every later power cut (the budget is large enough that nothing is evicted).
fn run_store_schedule(seed: u64) -> u64 {
    use std::sync::Arc;
    use store::{Store, StoreConfig, WritePolicy};
    let mut rng = StdRng::seed_from_u64(seed);
    let d = common::desc("faults", 4);
    let blocks = pool(16);
    let by_key = index(&blocks);
    let fs = SimFs::new();
    let policy = if rng.gen_bool(0.5) {
        WritePolicy::WriteBack
    } else {
        WritePolicy::WriteThrough
    };
    let open = || {
        let s = Store::open_in(
            fs.clone(),
            StoreConfig::default()
                .root(root())
                .ram_budget(1 << 30)
                .ssd_budget(1 << 30)
                .queue_capacity(1024)
                .write_policy(policy),
        )
        .expect("the store opens after a power cut");
        // The description may not have been durable; registering again is idempotent.
        let _ = s.register_namespace(&d);
        s
    };
    let mut store = open();
    let (mut acked, mut pending) = (BTreeSet::new(), BTreeSet::new());
    let mut checked = 0;
    // No ENOSPC here: a full disk shrinks the budget and evicts, which may take acknowledged
    // blocks (a cache may); the tier schedules check that case against the evictions.
    let faults = [
        (Op::SyncFile, FaultKind::Eio),
        (Op::SyncDir, FaultKind::Eio),
        (Op::Rename, FaultKind::Eio),
        (Op::Write, FaultKind::Eio),
        (Op::Write, FaultKind::TornWrite),
        (Op::Any, FaultKind::PowerLoss),
    ];
    let steps = rng.gen_range(4..12);
    for step in 0..steps {
        if rng.gen_bool(0.3) {
            let (op, kind) = faults[rng.gen_range(0..faults.len())];
            fs.inject(Fault {
                op,
                nth: rng.gen_range(0..4),
                kind,
            });
        }
        for _ in 0..rng.gen_range(1..4) {
            let b = &blocks[rng.gen_range(0..blocks.len())];
            if store.insert(Arc::new(b.clone())).is_ok() {
                pending.insert(key(b));
            }
        }
        if rng.gen_bool(0.6) {
            match store.flush() {
                Ok(()) => acked.append(&mut pending),
                Err(_) => pending.clear(),
            }
        }
        if fs.is_off() || rng.gen_bool(0.2) || step + 1 == steps {
            assert_eq!(
                store.stats().ssd_evictions,
                0,
                "step {step}: nothing is evicted, so everything acknowledged is owed"
            );
            drop(store);
            fs.power_loss(rng.gen());
            pending.clear();
            store = open();
            let ssd = store.ssd().expect("an SSD tier");
            for k in &acked {
                match ssd.get(k.0, k.1) {
                    ReadOutcome::Hit(b) => assert_eq!(Some(&b), by_key.get(k)),
                    other => panic!(
                        "step {step}: a block acknowledged by flush is {other:?} after a power cut"
                    ),
                }
                checked += 1;
            }
            assert!(ssd.used_bytes() <= ssd.budget());
        }
    }
    checked
}

#[test]
fn every_block_a_successful_flush_acknowledged_survives_power_cuts() {
    let checked: u64 = for_seeds(0..150, run_store_schedule).into_iter().sum();
    assert!(
        checked > 100,
        "the schedules acknowledge and check blocks: {checked}"
    );
}

/// What one schedule did.
#[derive(Debug, Default)]
struct Tally {
    schedules: u64,
    power_cuts: u64,
    faults: BTreeMap<String, u64>,
    blocks_checked: u64,
    puts_acknowledged: u64,
}

impl Tally {
    fn add(&mut self, o: Tally) {
        self.schedules += o.schedules;
        self.power_cuts += o.power_cuts;
        self.blocks_checked += o.blocks_checked;
        self.puts_acknowledged += o.puts_acknowledged;
        for (k, v) in o.faults {
            *self.faults.entry(k).or_default() += v;
        }
    }
}

const FAULTS: [(Op, FaultKind); 11] = [
    (Op::SyncFile, FaultKind::Eio),
    (Op::SyncDir, FaultKind::Eio),
    (Op::Rename, FaultKind::Eio),
    (Op::Write, FaultKind::NoSpace),
    (Op::Write, FaultKind::Eio),
    (Op::Write, FaultKind::TornWrite),
    (Op::Create, FaultKind::NoSpace),
    (Op::Mkdir, FaultKind::NoSpace),
    (Op::Remove, FaultKind::Eio),
    (Op::Read, FaultKind::Eio),
    (Op::Any, FaultKind::PowerLoss),
];

/// One randomized schedule: puts, reads, touches, removes and syncs on a small budget, with
/// faults and power cuts at random calls; checks the invariants after every step and every
/// reopen.
fn run_schedule(seed: u64) -> Tally {
    let mut rng = StdRng::seed_from_u64(seed);
    let blocks = pool(12);
    let by_key = index(&blocks);
    let budget = BLOCK_PHYS * rng.gen_range(3..10);
    let fs = SimFs::new();
    let mut tier = open(&fs, budget);
    let mut tally = Tally {
        schedules: 1,
        ..Tally::default()
    };
    // Acknowledged as durable and, as far as the tier has said, not evicted or removed.
    let mut acked: BTreeSet<Key> = BTreeSet::new();
    let mut poisoned = false;
    let steps = rng.gen_range(10..40);
    for step in 0..steps {
        if rng.gen_bool(0.3) {
            let (op, kind) = FAULTS[rng.gen_range(0..FAULTS.len())];
            let nth = rng.gen_range(0..6);
            fs.inject(Fault { op, nth, kind });
        }
        let evictions_before = tier.stats().ssd_evictions;
        let b = &blocks[rng.gen_range(0..blocks.len())];
        let k = key(b);
        match rng.gen_range(0..10) {
            0..=4 => {
                let r = tier.put(b);
                if poisoned {
                    assert!(is_poisoned(&r), "step {step}: a poisoned writer refuses");
                }
                match r {
                    Ok(_) => {
                        acked.insert(k);
                        tally.puts_acknowledged += 1;
                    }
                    Err(WriteError::Poisoned { .. }) => poisoned = true,
                    Err(_) => {}
                }
            }
            5..=6 => match tier.get(k.0, k.1) {
                ReadOutcome::Hit(got) => assert_eq!(&got, b, "step {step}: a hit is the block put"),
                ReadOutcome::Miss => {}
                ReadOutcome::Corrupt { error, .. } => {
                    panic!("step {step}: nothing damaged the files, yet {error}")
                }
            },
            7 => tier.touch(k.0, k.1),
            8 => {
                let r = tier.remove(k.0, k.1);
                if poisoned {
                    assert!(matches!(r, Err(WriteError::Poisoned { .. })));
                }
                // Removed, or unknown after a failure: no longer owed.
                acked.remove(&k);
            }
            _ => {
                let _ = tier.sync();
            }
        }
        assert!(
            tier.used_bytes() <= tier.budget() && tier.budget() <= budget,
            "step {step}: the budget holds ({} of {} of {budget})",
            tier.used_bytes(),
            tier.budget()
        );
        // What the tier dropped without being asked must be evictions it counted.
        let held: BTreeSet<Key> = tier
            .entries()
            .iter()
            .map(|e| (e.namespace, e.key))
            .collect();
        let dropped = acked.difference(&held).count() as u64;
        assert!(
            dropped <= tier.stats().ssd_evictions - evictions_before,
            "step {step}: {dropped} acknowledged blocks left the index without eviction"
        );
        acked.retain(|k| held.contains(k));

        if fs.is_off() || rng.gen_bool(0.1) || step + 1 == steps {
            drop(tier);
            fs.power_loss(rng.gen());
            tally.power_cuts += 1;
            poisoned = false;
            tier = open(&fs, budget);
            tally.blocks_checked += check_reopened(&fs, &tier, &acked, &by_key);
            // The store enforces the budget after opening: unsynced removals can come back.
            tier.enforce_budget().unwrap();
            assert!(tier.used_bytes() <= budget);
            let held: BTreeSet<Key> = tier
                .entries()
                .iter()
                .map(|e| (e.namespace, e.key))
                .collect();
            acked.retain(|k| held.contains(k));
        }
    }
    for ((op, kind), n) in fs.injected() {
        *tally.faults.entry(format!("{op:?} {kind:?}")).or_default() += n;
    }
    tally
}

/// Runs the tier schedules of seeds `first..first + n` and adds up what they did.
fn run_schedules(first: u64, n: u64) -> Tally {
    let mut total = Tally::default();
    for t in for_seeds(first..first + n, run_schedule) {
        total.add(t);
    }
    total
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

#[test]
fn randomized_fault_schedules_keep_the_invariants() {
    let t = run_schedules(0, 800);
    assert_eq!(t.schedules, 800);
    assert!(t.power_cuts >= 800 && t.blocks_checked > 0, "{t:?}");
    assert!(
        t.faults.len() >= 8,
        "the seed set reaches most fault kinds: {:?}",
        t.faults
    );
}

#[test]
#[ignore = "replays one seed: KVSTORE_FAULT_SEED=<seed>"]
fn one_schedule() {
    let seed = env_u64("KVSTORE_FAULT_SEED").expect("set KVSTORE_FAULT_SEED to the seed to replay");
    println!("{:#?}", run_schedules(seed, 1));
    println!(
        "store schedule: {} blocks checked",
        for_seeds(seed..seed + 1, run_store_schedule)[0]
    );
}

#[test]
#[ignore = "long run (docs/reliability.md): KVSTORE_FAULT_SCHEDULES=10000"]
fn many_schedules() {
    let n = env_u64("KVSTORE_FAULT_SCHEDULES").unwrap_or(10_000);
    let first = env_u64("KVSTORE_FAULT_FIRST_SEED").unwrap_or(0);
    let start = Instant::now();
    let t = run_schedules(first, n);
    println!(
        "schedules {} (seeds {first}..{}), power cuts {}, puts acknowledged {}, blocks read back and verified {}, time {:.1} s",
        t.schedules,
        first + n,
        t.power_cuts,
        t.puts_acknowledged,
        t.blocks_checked,
        start.elapsed().as_secs_f64()
    );
    for (k, v) in &t.faults {
        println!("fault {k}: {v}");
    }
    assert_eq!(t.schedules, n);
    let stores = env_u64("KVSTORE_STORE_SCHEDULES").unwrap_or(n / 5);
    let start = Instant::now();
    let checked: u64 = for_seeds(first..first + stores, run_store_schedule)
        .into_iter()
        .sum();
    println!(
        "store schedules {stores} (seeds {first}..{}), acknowledged blocks checked after power cuts {checked}, time {:.1} s",
        first + stores,
        start.elapsed().as_secs_f64()
    );
}

/// A lookup never waits for an evicted block's file to go: eviction takes its victims out
/// of the index under the tier's lock and removes their files after releasing it (a
/// removal takes about a millisecond under the writer's fsyncs, and every request's lookup
/// reads the index). Here the removal is held while another thread asks the index.
#[test]
fn lookups_do_not_wait_for_an_evictions_file_removals() {
    let fs = SimFs::new();
    let blocks = pool(3);
    let tier = std::sync::Arc::new(open(&fs, 2 * BLOCK_PHYS));
    for b in &blocks[..2] {
        assert!(matches!(tier.put(b), Ok(WriteOutcome::Written { .. })));
    }
    fs.hold_removals();
    let writer = {
        let (tier, b) = (tier.clone(), blocks[2].clone());
        std::thread::spawn(move || tier.put(&b))
    };
    let t0 = Instant::now();
    while fs.removals_waiting() == 0 {
        assert!(t0.elapsed().as_secs() < 30, "the third put evicted nothing");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    let lookup = {
        let (tier, keys) = (tier.clone(), [key(&blocks[0]), key(&blocks[1])]);
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(keys.map(|(ns, k)| tier.contains(ns, k)));
        });
        rx.recv_timeout(std::time::Duration::from_secs(10))
    };
    fs.release_removals();
    assert_eq!(
        lookup.expect("a lookup waited for the eviction's file removal"),
        [false, true],
        "the victim left the index before its file went; the other block stayed"
    );
    assert!(matches!(
        writer.join().unwrap(),
        Ok(WriteOutcome::Written { .. })
    ));
    let (ns, k) = key(&blocks[2]);
    assert!(tier.contains(ns, k));
    let (ns, k) = key(&blocks[0]);
    let victim = tier.block_path(ns, k);
    assert!(
        !fs.files().contains_key(&victim),
        "the victim's file is gone once the put returned"
    );
}

/// A lookup or a read never waits for the access journal's compaction: its temp file's
/// fsync and the directory's run without the tier's lock. Here every fsync is held
/// while a compaction is under way, another thread asks, reads and touches, and the records
/// it appended meanwhile are in the compacted journal the next open reads.
#[test]
fn lookups_and_reads_do_not_wait_for_the_journals_compaction() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let fs = SimFs::new();
    let blocks = pool(3);
    let tier = std::sync::Arc::new(open(&fs, 10 * BLOCK_PHYS));
    for b in &blocks {
        assert!(matches!(tier.put(b), Ok(WriteOutcome::Written { .. })));
    }
    let [k0, k1, k2] = [key(&blocks[0]), key(&blocks[1]), key(&blocks[2])];
    fs.hold_syncs();
    // Touches of block 0 until one of them starts a compaction (the journal passes four
    // records per block) and waits in its fsync.
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let toucher = {
        let (tier, stop) = (tier.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut n = 0u64;
            while !stop.load(Ordering::SeqCst) {
                tier.touch(k0.0, k0.1);
                n += 1;
                assert!(n < 100_000, "no compaction after {n} touches of 3 blocks");
            }
        })
    };
    let t0 = Instant::now();
    while fs.syncs_waiting() == 0 {
        assert!(
            t0.elapsed().as_secs() < 30,
            "the touches started no compaction"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    stop.store(true, Ordering::SeqCst);
    let (asker, asked) = {
        let tier = tier.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        let asker = std::thread::spawn(move || {
            let present = tier.contains(k1.0, k1.1);
            let read = matches!(tier.get(k2.0, k2.1), ReadOutcome::Hit(_));
            tier.touch(k1.0, k1.1);
            let _ = tx.send((present, read));
        });
        (asker, rx.recv_timeout(std::time::Duration::from_secs(10)))
    };
    fs.release_syncs();
    assert_eq!(
        asked.expect("a lookup, read or touch waited for the journal compaction's fsync"),
        (true, true)
    );
    // Both threads gone with their handles on the tier before it is opened again.
    asker.join().unwrap();
    toucher.join().unwrap();
    let journal = fs.files()[&root().join(store::format::JOURNAL_FILE)].len();
    assert!(
        journal < store::format::JOURNAL_HEADER_LEN + 100 * store::format::JOURNAL_RECORD_LEN,
        "the journal was compacted ({journal} bytes)"
    );
    drop(tier);
    let reopened = open(&fs, 10 * BLOCK_PHYS);
    let order: Vec<Key> = reopened
        .entries()
        .iter()
        .map(|e| (e.namespace, e.key))
        .collect();
    assert_eq!(
        order,
        vec![k0, k2, k1],
        "the read of block 2 and the touch of block 1 during the compaction are the newest uses"
    );
}

/// Loads at once share the store's SSD readers file by file: a short load that arrives
/// while a long one holds both readers gets its files read next, not after the long load's
/// 30 (each reader reads one file of a load, then queues that load behind the others).
#[test]
fn a_short_load_is_not_held_behind_a_long_one() {
    use std::sync::Arc;
    use store::{Store, StoreConfig, WritePolicy};
    let fs = SimFs::new();
    let d = common::desc("fair", 2);
    let (long, long_toks) = common::chain(&d, 30, 61);
    let (short, short_toks) = common::chain(&d, 3, 62);
    let config = StoreConfig::default()
        .root(root())
        .ssd_budget(1 << 30)
        .ssd_readers(2);
    {
        let s = Store::open_in(
            fs.clone(),
            config.clone().write_policy(WritePolicy::WriteThrough),
        )
        .unwrap();
        s.register_namespace(&d).unwrap();
        for b in long.iter().chain(&short) {
            s.insert(Arc::new(b.clone())).unwrap();
        }
        s.flush().unwrap();
    }
    // A fresh store on the same disk: every block is on the SSD only.
    let s = Store::open_in(fs.clone(), config).unwrap();
    let ns = d.id();
    let ssd = s.ssd().unwrap();
    let paths = |blocks: &[Block]| -> BTreeSet<PathBuf> {
        blocks
            .iter()
            .map(|b| ssd.block_path(ns, b.meta.key))
            .collect()
    };
    let (long_paths, short_paths) = (paths(&long), paths(&short));
    let keys = |blocks: &[Block]| blocks.iter().map(|b| b.meta.key).collect::<Vec<_>>();
    let (long_keys, short_keys) = (keys(&long), keys(&short));
    fs.record_opens();
    fs.hold_opens();
    let wait_for = |what: &str, done: &dyn Fn() -> bool| {
        let t0 = Instant::now();
        while !done() {
            assert!(t0.elapsed().as_secs() < 30, "timed out waiting for {what}");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    };
    std::thread::scope(|scope| {
        let long_load = scope.spawn(|| s.load_prefix(ns, &long_keys, &long_toks));
        // Both readers inside the long load's first files.
        wait_for("both readers to open a file", &|| fs.opens_waiting() == 2);
        // The short load has queued its reads once its walk misses RAM for its first block.
        let misses = s.stats().ram_misses;
        let short_load = scope.spawn(|| s.load_prefix(ns, &short_keys, &short_toks));
        wait_for("the short load to queue its reads", &|| {
            s.stats().ram_misses > misses
        });
        fs.release_opens();
        assert_eq!(short_load.join().unwrap().blocks.len(), 3);
        assert_eq!(long_load.join().unwrap().blocks.len(), 30);
    });
    let opened = fs.opened();
    let last_short = opened
        .iter()
        .rposition(|p| short_paths.contains(p))
        .expect("the short load's files were read");
    let long_before = opened[..last_short]
        .iter()
        .filter(|p| long_paths.contains(*p))
        .count();
    // The two files in hand, then the readers alternate between the loads: a reader in
    // turn for each of the short load's three files, two or three of the long one's.
    assert!(
        long_before <= 6,
        "{long_before} of the long load's files were opened before the short load's last"
    );
}
