//! Pins: block keys kept out of eviction until a deadline (Anthropic's `cache_control`
//! breakpoints, OpenAI's `prompt_cache_retention: "24h"`).
//!
//! A pin names a block by key, whether or not any tier holds it yet: a request pins its
//! prompt's keys before it runs, and the blocks it then publishes are protected wherever
//! they land. Every tier consults the one [`Pins`] of its store when it chooses what to
//! evict (the RAM tier, the SSD tier, the device tier in the cache crate); none evicts a
//! pinned block to make room. A block that does not fit beside the pinned ones is refused
//! by that tier instead (RAM hands it to the SSD writer, the SSD writer reports
//! [`WriteError::Pinned`](crate::WriteError::Pinned)), so pins never push a tier over
//! its budget.
//!
//! Pins expire on their own: an expired pin protects nothing and is dropped the next time
//! it is looked at. Pinning a key again extends its pin, never shortens it. Durable pins
//! (for the SSD tier: a 24 h retention must survive a restart) are kept in
//! [`PINS_FILE`](crate::format::PINS_FILE) at the store's root, rewritten atomically when
//! a durable pin is added or extended by more than [`PERSIST_SLACK`].

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::block::now_unix_ms;
use crate::format;
use crate::fs::RealFs;
use crate::key::{BlockKey, NamespaceId};
use crate::ssd::{parse_canonical, write_atomic};

type Id = (NamespaceId, BlockKey);

/// A durable pin extended by less than this is not rewritten to disk: a session that pins
/// its prefix every turn writes the file about once a minute, not once a request.
pub const PERSIST_SLACK: Duration = Duration::from_secs(60);

/// Most pins the file may hold when read back; more is a damaged or foreign file.
const MAX_PERSISTED: usize = 1 << 20;

/// Expired pins nobody looks at again are swept when the set has doubled since the last
/// sweep (and holds at least this many).
const SWEEP_MIN: usize = 4096;

#[derive(Clone, Copy, Debug)]
struct Pin {
    until_ms: u64,
    durable: bool,
}

/// The pin set of a store. All methods take `&self`.
#[derive(Debug, Default)]
pub struct Pins {
    map: Mutex<HashMap<Id, Pin>>,
    /// Size of the set at which [`Pins::pin`] sweeps expired pins next.
    sweep_at: std::sync::atomic::AtomicUsize,
    /// Where durable pins persist; `None` without a writable SSD tier.
    root: Option<PathBuf>,
}

#[derive(Serialize, Deserialize)]
struct PinFile {
    version: u32,
    pins: Vec<PinRecord>,
}

#[derive(Serialize, Deserialize)]
struct PinRecord {
    namespace: String,
    key: String,
    until_unix_ms: u64,
}

const PIN_FILE_VERSION: u32 = 1;

/// What is pinned now, per tier of the store ([`Store::pinned_bytes`](crate::Store::pinned_bytes)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PinnedBytes {
    /// Keys pinned (held by some tier or not).
    pub keys: usize,
    /// Bytes of pinned blocks in the RAM tier.
    pub ram_bytes: u64,
    /// Physical bytes of pinned blocks in the SSD tier.
    pub ssd_bytes: u64,
}

impl Pins {
    /// An empty pin set that persists nothing.
    pub fn new() -> Self {
        Self::default()
    }

    /// The pin set persisted at `root` (a writable store root): the durable pins still
    /// in force. A missing file is an empty set; an unreadable or malformed one is logged
    /// and ignored (pins are a retention hint: losing them costs hits, never correctness).
    pub fn open(root: &Path) -> Self {
        Self {
            map: Mutex::new(read_file(root)),
            sweep_at: SWEEP_MIN.into(),
            root: Some(root.to_path_buf()),
        }
    }

    /// The durable pins persisted at `root`, for a read-only store: consulted, never written.
    pub fn read_only(root: &Path) -> Self {
        Self {
            map: Mutex::new(read_file(root)),
            sweep_at: SWEEP_MIN.into(),
            root: None,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Id, Pin>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Pins `keys` of namespace `ns` for `ttl` from now (extending pins that end sooner).
    /// `durable` pins persist across restarts (when the store has a writable root).
    /// Returns how many keys were newly pinned or extended. A failure to persist is logged:
    /// the pins hold in memory either way.
    pub fn pin(&self, ns: NamespaceId, keys: &[BlockKey], ttl: Duration, durable: bool) -> usize {
        let until_ms = now_unix_ms().saturating_add(ttl.as_millis() as u64);
        let slack = PERSIST_SLACK.as_millis() as u64;
        let mut changed = 0;
        let mut persist = false;
        let snapshot = {
            let mut map = self.lock();
            let sweep_at = self.sweep_at.load(std::sync::atomic::Ordering::Relaxed);
            if map.len() + keys.len() > sweep_at.max(SWEEP_MIN) {
                let now = now_unix_ms();
                map.retain(|_, p| p.until_ms > now);
                self.sweep_at.store(
                    2 * (map.len() + keys.len()),
                    std::sync::atomic::Ordering::Relaxed,
                );
            }
            for &key in keys {
                let pin = map.entry((ns, key)).or_insert(Pin {
                    until_ms: 0,
                    durable: false,
                });
                if until_ms > pin.until_ms {
                    if durable && (!pin.durable || until_ms > pin.until_ms.saturating_add(slack)) {
                        persist = true;
                    }
                    pin.until_ms = until_ms;
                    changed += 1;
                }
                if durable && !pin.durable {
                    pin.durable = true;
                    persist = true;
                }
            }
            (persist && self.root.is_some()).then(|| records(&map))
        };
        if let (Some(records), Some(root)) = (snapshot, &self.root) {
            if let Err(e) = write_file(root, records) {
                tracing::warn!(error = %e, "persisting the durable pins failed; they hold in memory");
            }
        }
        changed
    }

    /// Whether `key` is pinned now. An expired pin is dropped here.
    pub fn is_pinned(&self, ns: NamespaceId, key: BlockKey) -> bool {
        let mut map = self.lock();
        match map.get(&(ns, key)) {
            Some(p) if p.until_ms > now_unix_ms() => true,
            Some(_) => {
                map.remove(&(ns, key));
                false
            }
            None => false,
        }
    }

    /// How long `key`'s pin still holds (`None`: not pinned, or expired).
    pub fn remaining(&self, ns: NamespaceId, key: BlockKey) -> Option<std::time::Duration> {
        let until = self.lock().get(&(ns, key))?.until_ms;
        let left = until.checked_sub(now_unix_ms()).filter(|&ms| ms > 0)?;
        Some(std::time::Duration::from_millis(left))
    }

    /// The keys pinned now (expired pins are dropped).
    pub fn pinned(&self) -> Vec<(NamespaceId, BlockKey)> {
        let now = now_unix_ms();
        let mut map = self.lock();
        map.retain(|_, p| p.until_ms > now);
        map.keys().copied().collect()
    }

    /// Whether any pin is held, expired or not (a cheap check before looking keys up).
    pub fn any(&self) -> bool {
        !self.lock().is_empty()
    }

    /// How many keys are pinned now.
    pub fn len(&self) -> usize {
        self.pinned().len()
    }

    /// Whether no key is pinned now.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The durable pins in force, as file records.
fn records(map: &HashMap<Id, Pin>) -> Vec<PinRecord> {
    let now = now_unix_ms();
    let mut out: Vec<PinRecord> = map
        .iter()
        .filter(|(_, p)| p.durable && p.until_ms > now)
        .map(|((ns, key), p)| PinRecord {
            namespace: ns.to_string(),
            key: key.to_string(),
            until_unix_ms: p.until_ms,
        })
        .collect();
    out.sort_by(|a, b| (&a.namespace, &a.key).cmp(&(&b.namespace, &b.key)));
    out
}

fn write_file(root: &Path, pins: Vec<PinRecord>) -> std::io::Result<()> {
    let bytes = serde_json::to_vec(&PinFile {
        version: PIN_FILE_VERSION,
        pins,
    })
    .map_err(std::io::Error::other)?;
    // The pins file is written on the real file system, also under a test's SimFs store.
    write_atomic(
        &RealFs,
        &root.join(format::TMP_DIR),
        root,
        format::PINS_FILE,
        &bytes,
    )
}

fn read_file(root: &Path) -> HashMap<Id, Pin> {
    let path = root.join(format::PINS_FILE);
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return HashMap::new(),
        Err(e) => {
            tracing::warn!(path = %crate::escape_path(&path), error = %e, "cannot read the pins file; starting without durable pins");
            return HashMap::new();
        }
    };
    let file = match serde_json::from_slice::<PinFile>(&bytes) {
        Ok(f) if f.version == PIN_FILE_VERSION && f.pins.len() <= MAX_PERSISTED => f,
        _ => {
            tracing::warn!(path = %crate::escape_path(&path), "the pins file is malformed or of another version; starting without durable pins");
            return HashMap::new();
        }
    };
    let now = now_unix_ms();
    file.pins
        .into_iter()
        .filter(|r| r.until_unix_ms > now)
        .filter_map(|r| {
            let ns = parse_canonical::<NamespaceId>(&r.namespace)?;
            let key = parse_canonical::<BlockKey>(&r.key)?;
            Some((
                (ns, key),
                Pin {
                    until_ms: r.until_unix_ms,
                    durable: true,
                },
            ))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(i: u8) -> (NamespaceId, BlockKey) {
        (NamespaceId([1; 32]), BlockKey([i; 32]))
    }

    #[test]
    fn a_pin_protects_until_it_expires_and_is_then_dropped() {
        let pins = Pins::new();
        let (ns, k) = id(1);
        assert!(!pins.is_pinned(ns, k));
        assert_eq!(pins.pin(ns, &[k], Duration::from_millis(40), false), 1);
        assert!(pins.is_pinned(ns, k));
        std::thread::sleep(Duration::from_millis(60));
        assert!(!pins.is_pinned(ns, k));
        assert!(pins.is_empty());
    }

    #[test]
    fn pinning_again_extends_and_never_shortens() {
        let pins = Pins::new();
        let (ns, k) = id(2);
        pins.pin(ns, &[k], Duration::from_secs(3600), false);
        assert_eq!(pins.pin(ns, &[k], Duration::from_millis(1), false), 0);
        std::thread::sleep(Duration::from_millis(5));
        assert!(pins.is_pinned(ns, k));
    }

    #[test]
    fn durable_pins_survive_a_reopen_and_others_do_not() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join(format::TMP_DIR)).unwrap();
        let (ns, a) = id(3);
        let (_, b) = id(4);
        let (_, c) = id(5);
        {
            let pins = Pins::open(dir.path());
            pins.pin(ns, &[a], Duration::from_secs(86_400), true);
            pins.pin(ns, &[b], Duration::from_secs(300), false);
            pins.pin(ns, &[c], Duration::from_millis(30), true);
        }
        std::thread::sleep(Duration::from_millis(50));
        let pins = Pins::open(dir.path());
        assert!(pins.is_pinned(ns, a), "a 24 h pin was lost on reopen");
        assert!(!pins.is_pinned(ns, b), "an in-memory pin persisted");
        assert!(!pins.is_pinned(ns, c), "an expired durable pin came back");
    }

    #[test]
    fn expired_pins_nobody_looks_at_are_swept() {
        let pins = Pins::new();
        let ns = NamespaceId([9; 32]);
        let keys = |from: u32, n: usize| -> Vec<BlockKey> {
            (from..from + n as u32)
                .map(|i| BlockKey(*blake3::hash(&i.to_le_bytes()).as_bytes()))
                .collect()
        };
        pins.pin(ns, &keys(0, SWEEP_MIN), Duration::from_millis(20), false);
        std::thread::sleep(Duration::from_millis(40));
        // The set doubles: the expired pins go, the new ones stay.
        let fresh = keys(1 << 20, SWEEP_MIN + 1);
        pins.pin(ns, &fresh, Duration::from_secs(60), false);
        assert_eq!(pins.lock().len(), fresh.len());
        assert!(pins.is_pinned(ns, fresh[0]));
    }

    #[test]
    fn a_damaged_pins_file_is_ignored() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(format::PINS_FILE), b"{not json").unwrap();
        assert!(Pins::open(dir.path()).is_empty());
    }
}
