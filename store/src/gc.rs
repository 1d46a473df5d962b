//! Garbage collection under the writer lock: removes corrupt, quarantined, orphaned,
//! foreign and unreachable files, then blocks older than an age, then blocks until under a
//! size: chain leaves before their ancestors, least recently used first. Reports what it deleted and what it failed to delete.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;

use crate::block::now_unix_ms;
use crate::error::OpenError;
use crate::fs::{FileSystem, RealFs};
use crate::inspect::{chain_depths, check_file};
use crate::key::{BlockKey, NamespaceId};
use crate::ssd::{self, SsdOptions, SsdTier};
use crate::stats::Counters;

/// What to collect.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GcOptions {
    /// Delete blocks until the (namespace's, with `namespace`) block files take at most this
    /// many physical bytes: leaves of chains before their ancestors (so every chain keeps a
    /// prefix), least recently used first.
    pub max_bytes: Option<u64>,
    /// Delete blocks not accessed for this long.
    pub older_than: Option<Duration>,
    /// Only touch this namespace's directory.
    pub namespace: Option<NamespaceId>,
    /// Report without deleting.
    pub dry_run: bool,
}

/// Why a file is deleted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum GcReason {
    /// A block file that fails verification (checksum, header, truncation, wrong identity).
    Corrupt,
    /// A kvstore block of another format version, or a safetensors file that is not ours.
    ForeignFormat,
    /// A file in quarantine.
    Quarantined,
    /// A leftover temporary file.
    Orphan,
    /// A file in a namespace directory that is not a block file.
    Foreign,
    /// A block whose parent chain does not reach its namespace root (can never be hit).
    Unreachable,
    /// A block not accessed within `older_than`.
    Age,
    /// A block removed to get under `max_bytes` (a chain leaf, least recently used first).
    Size,
}

/// One file GC deleted (or would delete).
#[derive(Debug, Clone, Serialize)]
pub struct GcItem {
    /// The file.
    pub path: PathBuf,
    /// Physical bytes.
    pub bytes: u64,
    /// Why.
    pub reason: GcReason,
    /// Detail (e.g. the verification error).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

/// A file GC failed to delete.
#[derive(Debug, Clone, Serialize)]
pub struct GcFailure {
    /// The file.
    pub path: PathBuf,
    /// Why it was to be deleted.
    pub reason: GcReason,
    /// The error.
    pub error: String,
}

/// What GC did.
#[derive(Debug, Clone, Serialize)]
pub struct GcReport {
    /// Whether nothing was actually deleted.
    pub dry_run: bool,
    /// Deleted (or, with `dry_run`, to be deleted).
    pub deleted: Vec<GcItem>,
    /// Deletions that failed.
    pub failed: Vec<GcFailure>,
    /// Physical bytes freed (or to be freed).
    pub freed_bytes: u64,
    /// Blocks left.
    pub kept_blocks: u64,
    /// Physical bytes of the blocks left.
    pub kept_bytes: u64,
}

struct Candidate {
    ns: NamespaceId,
    key: BlockKey,
    path: PathBuf,
    bytes: u64,
    rank: usize,
    last_access: u64,
    parent: [u8; 32],
}

/// Collects garbage in the store at `root`, holding the writer lock (fails with
/// [`OpenError::Locked`] while another writer runs). Verifies every block's checksum, so it
/// reads all block data.
pub fn gc(root: &Path, options: &GcOptions) -> Result<GcReport, OpenError> {
    let tier = SsdTier::open_with(
        RealFs,
        root,
        SsdOptions {
            read_only: false,
            budget: u64::MAX,
        },
        Arc::new(Counters::default()),
        false,
    )?;
    let scan = ssd::scan(&RealFs, root).map_err(|source| OpenError::Io {
        path: root.to_owned(),
        source,
    })?;
    let in_scope = |ns: NamespaceId| options.namespace.is_none_or(|n| n == ns);
    let file_bytes = |p: &Path| {
        RealFs
            .symlink_metadata(p)
            .map(|m| m.physical_bytes)
            .unwrap_or(0)
    };
    let mut plan: Vec<(GcItem, Option<(NamespaceId, BlockKey)>)> = Vec::new();
    let mut add = |path: PathBuf, reason, detail, id| {
        let bytes = file_bytes(&path);
        plan.push((
            GcItem {
                path,
                bytes,
                reason,
                detail,
            },
            id,
        ));
    };
    if options.namespace.is_none() {
        for p in scan.temps {
            add(p, GcReason::Orphan, None, None);
        }
        for p in scan.quarantined {
            add(p, GcReason::Quarantined, None, None);
        }
    }
    for p in scan.foreign {
        let ns_of = p
            .strip_prefix(root)
            .ok()
            .and_then(|r| r.components().next())
            .and_then(|c| ssd::parse_canonical::<NamespaceId>(&c.as_os_str().to_string_lossy()));
        if ns_of.is_some_and(in_scope) && !p.is_dir() {
            add(p, GcReason::Foreign, None, None);
        }
    }

    // (LRU rank, last access): the rank follows the journal's sequence, exact even when
    // many accesses share a millisecond.
    let access: HashMap<(NamespaceId, BlockKey), (usize, u64)> = tier
        .entries()
        .into_iter()
        .enumerate()
        .map(|(rank, e)| ((e.namespace, e.key), (rank, e.last_access_unix_ms)))
        .collect();
    let mut live: Vec<Candidate> = Vec::new();
    for (ns, key, meta, path) in scan.blocks {
        if !in_scope(ns) {
            continue;
        }
        match check_file(&path, ns, key, true) {
            Ok(h) => live.push(Candidate {
                ns,
                key,
                bytes: meta.physical_bytes,
                rank: access.get(&(ns, key)).map_or(0, |a| a.0),
                last_access: access.get(&(ns, key)).map_or(0, |a| a.1),
                parent: h.meta.parent,
                path,
            }),
            Err(e) => {
                let reason = if e.foreign {
                    GcReason::ForeignFormat
                } else {
                    GcReason::Corrupt
                };
                add(path, reason, Some(e.message), Some((ns, key)));
            }
        }
    }

    let now = now_unix_ms();
    let mut removed: HashSet<(NamespaceId, BlockKey)> = HashSet::new();
    let remove_unreachable =
        |live: &mut Vec<Candidate>,
         removed: &mut HashSet<(NamespaceId, BlockKey)>,
         plan: &mut Vec<(GcItem, Option<(NamespaceId, BlockKey)>)>| {
            let mut parents: HashMap<NamespaceId, HashMap<BlockKey, [u8; 32]>> = HashMap::new();
            for c in live.iter() {
                parents.entry(c.ns).or_default().insert(c.key, c.parent);
            }
            let depths: HashMap<NamespaceId, HashMap<BlockKey, u64>> = parents
                .iter()
                .map(|(ns, p)| (*ns, chain_depths(*ns, p)))
                .collect();
            live.retain(|c| {
                let reachable = depths.get(&c.ns).is_some_and(|d| d.contains_key(&c.key));
                if !reachable {
                    removed.insert((c.ns, c.key));
                    plan.push((
                        GcItem {
                            path: c.path.clone(),
                            bytes: c.bytes,
                            reason: GcReason::Unreachable,
                            detail: None,
                        },
                        Some((c.ns, c.key)),
                    ));
                }
                reachable
            });
        };
    remove_unreachable(&mut live, &mut removed, &mut plan);
    // Pinned blocks (pins.json: 1 h breakpoints, 24 h retention) are kept by both rules, as
    // the running tiers keep them; a pin covers a whole prefix, so their chains stay whole.
    let pins = crate::pins::Pins::read_only(root);
    let pinned = |c: &Candidate| pins.is_pinned(c.ns, c.key);
    if let Some(age) = options.older_than {
        let cutoff = now.saturating_sub(age.as_millis() as u64);
        live.retain(|c| {
            let keep = c.last_access >= cutoff || pinned(c);
            if !keep {
                removed.insert((c.ns, c.key));
                plan.push((
                    GcItem {
                        path: c.path.clone(),
                        bytes: c.bytes,
                        reason: GcReason::Age,
                        detail: None,
                    },
                    Some((c.ns, c.key)),
                ));
            }
            keep
        });
        remove_unreachable(&mut live, &mut removed, &mut plan);
    }
    if let Some(max) = options.max_bytes {
        // Leaves first: a block goes only once none of its children is left, so what stays
        // of every chain is a prefix (its root last); among leaves, least recently used
        // first, in the SSD tier's own order.
        let index: HashMap<(NamespaceId, BlockKey), usize> = live
            .iter()
            .enumerate()
            .map(|(i, c)| ((c.ns, c.key), i))
            .collect();
        let parent: Vec<Option<usize>> = live
            .iter()
            .map(|c| index.get(&(c.ns, BlockKey(c.parent))).copied())
            .collect();
        let mut children = vec![0usize; live.len()];
        for p in parent.iter().flatten() {
            children[*p] += 1;
        }
        let mut leaves: BTreeSet<(usize, usize)> = (0..live.len())
            .filter(|&i| children[i] == 0 && !pinned(&live[i]))
            .map(|i| (live[i].rank, i))
            .collect();
        let mut total: u64 = live.iter().map(|c| c.bytes).sum();
        while total > max {
            let Some((_, i)) = leaves.pop_first() else {
                break;
            };
            let c = &live[i];
            total -= c.bytes;
            removed.insert((c.ns, c.key));
            plan.push((
                GcItem {
                    path: c.path.clone(),
                    bytes: c.bytes,
                    reason: GcReason::Size,
                    detail: None,
                },
                Some((c.ns, c.key)),
            ));
            if let Some(p) = parent[i] {
                children[p] -= 1;
                if children[p] == 0 && !pinned(&live[p]) {
                    leaves.insert((live[p].rank, p));
                }
            }
        }
        live.retain(|c| !removed.contains(&(c.ns, c.key)));
        remove_unreachable(&mut live, &mut removed, &mut plan);
    }

    let mut report = GcReport {
        dry_run: options.dry_run,
        deleted: Vec::new(),
        failed: Vec::new(),
        freed_bytes: 0,
        kept_blocks: live.len() as u64,
        kept_bytes: live.iter().map(|c| c.bytes).sum(),
    };
    for (item, id) in plan {
        if !options.dry_run {
            let result = match id {
                Some((ns, key)) if item.path == tier.block_path(ns, key) => {
                    tier.remove(ns, key).map(|_| ()).map_err(|e| e.to_string())
                }
                _ => std::fs::remove_file(&item.path).or_else(|e| {
                    if e.kind() == std::io::ErrorKind::NotFound {
                        Ok(())
                    } else {
                        Err(e.to_string())
                    }
                }),
            };
            if let Err(error) = result {
                report.failed.push(GcFailure {
                    path: item.path,
                    reason: item.reason,
                    error,
                });
                continue;
            }
        }
        report.freed_bytes += item.bytes;
        report.deleted.push(item);
    }
    if !options.dry_run {
        let _ = tier.sync();
    }
    Ok(report)
}
