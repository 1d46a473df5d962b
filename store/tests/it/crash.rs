//! Crash safety: a child process writing a stream of blocks is SIGKILLed at random points;
//! after each kill the store reopens with every readable block verifying, no temp file
//! left, and the budget holding.

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use store::{ReadOutcome, Store, StoreConfig, WritePolicy};

use crate::common;

const CHILD_ENV: &str = "KVSTORE_CRASH_CHILD_DIR";
const BUDGET: u64 = 2 << 20;
const KILLS: usize = 50;

fn config(dir: &std::path::Path) -> StoreConfig {
    StoreConfig::default()
        .root(dir)
        .ram_budget(64 << 10)
        .ssd_budget(BUDGET)
        .write_policy(WritePolicy::WriteThrough)
        .queue_capacity(4)
}

/// The writer run in the child process. Ignored in normal runs; does nothing unless the
/// parent set the environment variable.
#[test]
#[ignore = "runs only as the child of crash::sigkill_during_writes"]
fn child_writer() {
    let Ok(dir) = std::env::var(CHILD_ENV) else {
        return;
    };
    let seed: u64 = std::env::var("KVSTORE_CRASH_SEED")
        .unwrap()
        .parse()
        .unwrap();
    let s: Store = Store::open(config(dir.as_ref())).unwrap();
    let d = common::desc("crash", 512); // 2 x 16 KiB planes per block
    s.register_namespace(&d).unwrap();
    let start = Instant::now();
    let mut i = 0u64;
    while start.elapsed() < Duration::from_secs(20) {
        let (blocks, _) = common::chain(&d, 4, seed * 100_000 + i);
        for b in blocks {
            s.insert(Arc::new(b)).unwrap();
        }
        if i.is_multiple_of(3) {
            let _ = s.flush();
        }
        i += 1;
    }
}

#[test]
fn sigkill_during_writes() {
    let dir = tempfile::tempdir().unwrap();
    let exe = std::env::current_exe().unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x5EED);
    let d = common::desc("crash", 512);
    let mut max_blocks = 0;
    for kill in 0..KILLS {
        let mut child = Command::new(&exe)
            .args(["--exact", "crash::child_writer", "--ignored", "--nocapture"])
            .env(CHILD_ENV, dir.path())
            .env("KVSTORE_CRASH_SEED", kill.to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(rng.gen_range(5..120)));
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();

        let s: Store = Store::open(config(dir.path())).unwrap();
        assert!(
            common::temp_files(dir.path()).is_empty(),
            "kill {kill}: temp files left: {:?}",
            common::temp_files(dir.path())
        );
        assert!(
            common::physical(dir.path()) <= BUDGET,
            "kill {kill}: over budget"
        );
        let ssd = s.ssd().unwrap();
        let entries = ssd.entries();
        assert_eq!(entries.len(), common::block_files(dir.path()).len());
        for e in &entries {
            match ssd.get(e.namespace, e.key) {
                ReadOutcome::Hit(b) => {
                    assert_eq!(b.meta.namespace, d.id());
                    assert_eq!(b.planes.len(), 2);
                }
                other => panic!("kill {kill}: {} unreadable: {other:?}", e.path.display()),
            }
        }
        assert_eq!(s.stats().quarantined, 0);
        max_blocks = max_blocks.max(entries.len());
    }
    assert!(
        max_blocks > 0,
        "the child never got to write; kill points too early"
    );
}
