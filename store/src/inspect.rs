//! Read-only inspection of a store directory: namespaces, sizes, access times, chains, and
//! optional full verification. Safe to run beside a live writer (takes no lock).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::block::PlaneSpec;
use crate::codec::{self, BlockHeader, DecodeError, HeaderError};
use crate::error::OpenError;
use crate::fs::RealFs;
use crate::key::{BlockKey, NamespaceId};
use crate::namespace::NamespaceDescription;
use crate::ssd::{self, SsdOptions, SsdTier};

/// One namespace of a store.
#[derive(Debug, Clone, Serialize)]
pub struct NamespaceReport {
    /// Namespace id.
    pub id: NamespaceId,
    /// Its description, if `namespace.json` is present and matches the id.
    pub description: Option<NamespaceDescription>,
    /// Why the description is missing or unusable.
    pub description_error: Option<String>,
    /// Block files.
    pub blocks: u64,
    /// Physical bytes of its block files.
    pub bytes: u64,
    /// Of the blocks, those stored window-trimmed (without their window layers' planes).
    pub window_trimmed_blocks: u64,
    /// Plane bytes the window-trimmed blocks leave out
    /// ([`NamespaceDescription::trimmed_bytes_per_block`] each).
    pub window_trimmed_bytes: u64,
    /// Least recent access (write or read), Unix milliseconds.
    pub oldest_access_unix_ms: Option<u64>,
    /// Most recent access, Unix milliseconds.
    pub newest_access_unix_ms: Option<u64>,
    /// Blocks in the longest chain reachable from the namespace root.
    pub longest_chain: u64,
    /// Blocks whose parent chain does not reach the root (never hit; GC removes them).
    pub unreachable_blocks: u64,
}

/// A file that failed a check.
#[derive(Debug, Clone, Serialize)]
pub struct CorruptFile {
    /// The file.
    pub path: PathBuf,
    /// What was wrong.
    pub error: String,
}

/// Everything `kvstore inspect` shows.
#[derive(Debug, Clone, Serialize)]
pub struct StoreReport {
    /// Store root.
    pub root: PathBuf,
    /// Format version of the store.
    pub format_version: u32,
    /// SSD budget recorded by the last writer, bytes.
    pub ssd_budget_bytes: Option<u64>,
    /// Block files in all namespaces.
    pub blocks: u64,
    /// Physical bytes of all block files.
    pub bytes: u64,
    /// Per namespace.
    pub namespaces: Vec<NamespaceReport>,
    /// Whether plane checksums were verified (`--verify`).
    pub verified: bool,
    /// Block files that failed verification (header checks always; checksums with verify).
    pub corrupt: Vec<CorruptFile>,
    /// Files in quarantine.
    pub quarantined: Vec<PathBuf>,
    /// Temporary files (orphans unless a writer is mid-write).
    pub temp_files: Vec<PathBuf>,
    /// Files inside namespace directories that are not block files.
    pub foreign_files: Vec<PathBuf>,
    /// Entries at the root the store does not know.
    pub unknown_entries: Vec<PathBuf>,
}

/// One block, for `kvstore inspect --block`.
#[derive(Debug, Clone, Serialize)]
pub struct BlockReport {
    /// The file.
    pub path: PathBuf,
    /// Namespace.
    pub namespace: NamespaceId,
    /// Key.
    pub key: BlockKey,
    /// Parent key (hex).
    pub parent: String,
    /// Position in the chain.
    pub position: u32,
    /// Token ids.
    pub tokens: Vec<u32>,
    /// Creation time, Unix milliseconds.
    pub created_unix_ms: u64,
    /// Plane layout.
    pub planes: Vec<PlaneSpec>,
    /// Stored checksum, `blake3:<hex>`.
    pub checksum: String,
    /// Bytes of plane data.
    pub data_bytes: u64,
    /// File length.
    pub file_bytes: u64,
    /// `Ok` if the checksum verified, else why not.
    pub verify: Result<(), String>,
}

/// Depth of every block reachable from its namespace root (1 for position 0).
pub(crate) fn chain_depths(
    ns: NamespaceId,
    parents: &HashMap<BlockKey, [u8; 32]>,
) -> HashMap<BlockKey, u64> {
    let mut depth: HashMap<BlockKey, u64> = HashMap::new();
    for &start in parents.keys() {
        let mut path = Vec::new();
        let mut cur = start;
        let base = loop {
            if let Some(&d) = depth.get(&cur) {
                break Some(d);
            }
            let Some(parent) = parents.get(&cur) else {
                break None;
            };
            path.push(cur);
            if *parent == ns.0 {
                break Some(0);
            }
            if path.len() > parents.len() {
                break None; // a cycle cannot occur with blake3 keys; be safe anyway
            }
            cur = BlockKey(*parent);
        };
        if let Some(mut d) = base {
            for k in path.into_iter().rev() {
                d += 1;
                depth.insert(k, d);
            }
        }
    }
    depth
}

/// Why a block file failed [`check_file`].
#[derive(Debug, Clone)]
pub(crate) struct FileProblem {
    /// Not a kvstore block of this format version (as opposed to a damaged one).
    pub foreign: bool,
    pub message: String,
}

impl From<HeaderError> for FileProblem {
    fn from(e: HeaderError) -> Self {
        let foreign = matches!(
            e,
            HeaderError::Decode(
                DecodeError::Foreign { .. } | DecodeError::UnsupportedVersion { .. }
            )
        );
        FileProblem {
            foreign,
            message: e.to_string(),
        }
    }
}

fn problem(message: String) -> FileProblem {
    FileProblem {
        foreign: false,
        message,
    }
}

/// Inspects the store at `root` read-only; with `verify`, decodes every block file and
/// checks its checksum (reads all data).
pub fn inspect(root: &Path, verify: bool) -> Result<StoreReport, OpenError> {
    let tier = SsdTier::open(
        root,
        SsdOptions {
            read_only: true,
            budget: u64::MAX,
        },
    )?;
    let marker = ssd::read_marker(&RealFs, root)?;
    let scan = ssd::scan(&RealFs, root).map_err(|source| OpenError::Io {
        path: root.to_owned(),
        source,
    })?;
    let access: HashMap<(NamespaceId, BlockKey), u64> = tier
        .entries()
        .into_iter()
        .map(|e| ((e.namespace, e.key), e.last_access_unix_ms))
        .collect();
    let descs: HashMap<NamespaceId, Result<NamespaceDescription, String>> =
        ssd::read_namespaces(&RealFs, root)
            .into_iter()
            .map(|(id, _, d)| (id, d))
            .collect();
    let mut corrupt = Vec::new();
    let mut per_ns: HashMap<NamespaceId, NamespaceReport> = HashMap::new();
    let mut parents: HashMap<NamespaceId, HashMap<BlockKey, [u8; 32]>> = HashMap::new();
    for (id, _) in &scan.namespaces {
        let (description, description_error) = match descs.get(id) {
            Some(Ok(d)) => (Some(d.clone()), None),
            Some(Err(e)) => (None, Some(e.clone())),
            None => (None, Some("namespace.json missing".into())),
        };
        per_ns.insert(
            *id,
            NamespaceReport {
                id: *id,
                description,
                description_error,
                blocks: 0,
                bytes: 0,
                window_trimmed_blocks: 0,
                window_trimmed_bytes: 0,
                oldest_access_unix_ms: None,
                newest_access_unix_ms: None,
                longest_chain: 0,
                unreachable_blocks: 0,
            },
        );
    }
    for (ns, key, meta, path) in &scan.blocks {
        let r = per_ns
            .get_mut(ns)
            .expect("scan lists the namespace of each block");
        r.blocks += 1;
        r.bytes += meta.physical_bytes;
        if let Some(&t) = access.get(&(*ns, *key)) {
            r.oldest_access_unix_ms = Some(r.oldest_access_unix_ms.map_or(t, |o| o.min(t)));
            r.newest_access_unix_ms = Some(r.newest_access_unix_ms.map_or(t, |o| o.max(t)));
        }
        match check_file(path, *ns, *key, verify) {
            Ok(h) => {
                if let Some(d) = r.description.as_ref().filter(|d| d.is_trimmed(&h.planes)) {
                    r.window_trimmed_blocks += 1;
                    r.window_trimmed_bytes += d.trimmed_bytes_per_block();
                }
                parents.entry(*ns).or_default().insert(*key, h.meta.parent);
            }
            Err(p) => corrupt.push(CorruptFile {
                path: path.clone(),
                error: p.message,
            }),
        }
    }
    for (ns, r) in per_ns.iter_mut() {
        let empty = HashMap::new();
        let p = parents.get(ns).unwrap_or(&empty);
        let depths = chain_depths(*ns, p);
        r.longest_chain = depths.values().copied().max().unwrap_or(0);
        r.unreachable_blocks = (p.len() - depths.len()) as u64;
    }
    let mut namespaces: Vec<_> = per_ns.into_values().collect();
    namespaces.sort_by_key(|n| n.id);
    Ok(StoreReport {
        root: root.to_owned(),
        format_version: marker.as_ref().map_or(0, |m| m.version),
        ssd_budget_bytes: marker.and_then(|m| m.ssd_budget_bytes),
        blocks: namespaces.iter().map(|n| n.blocks).sum(),
        bytes: namespaces.iter().map(|n| n.bytes).sum(),
        namespaces,
        verified: verify,
        corrupt,
        quarantined: scan.quarantined,
        temp_files: scan.temps,
        foreign_files: scan.foreign,
        unknown_entries: scan.unknown_root,
    })
}

/// Checks one block file: header always, checksum when `verify`; the identity in the header
/// must match the path.
pub(crate) fn check_file(
    path: &Path,
    ns: NamespaceId,
    key: BlockKey,
    verify: bool,
) -> Result<BlockHeader, FileProblem> {
    let h = codec::read_header(path)?;
    if h.meta.namespace != ns || h.meta.key != key {
        return Err(problem(format!(
            "header names block {} of namespace {}, not the one its path names",
            h.meta.key, h.meta.namespace
        )));
    }
    if verify {
        let file = crate::nofollow::open_read(path).map_err(|e| problem(e.to_string()))?;
        match file
            .metadata()
            .and_then(|m| crate::codec::read_file(&file, m.len()))
        {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return Err(HeaderError::Decode(e).into()),
            Err(e) => return Err(problem(format!("could not read: {e}"))),
        }
    }
    Ok(h)
}

/// Finds a block by key in any namespace and reports its metadata (verifying its checksum).
/// `Ok(None)` when no namespace holds it.
pub fn block(root: &Path, key: BlockKey) -> Result<Option<BlockReport>, OpenError> {
    // Opening validates the directory and its format version.
    SsdTier::open(
        root,
        SsdOptions {
            read_only: true,
            budget: u64::MAX,
        },
    )?;
    for (ns, _, _) in ssd::read_namespaces(&RealFs, root) {
        let path = ssd::block_path(root, ns, key);
        if !path.is_file() {
            continue;
        }
        let h = codec::read_header(&path).map_err(|e| OpenError::Io {
            path: path.clone(),
            source: std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string()),
        })?;
        let verify = check_file(&path, ns, key, true)
            .map(|_| ())
            .map_err(|p| p.message);
        return Ok(Some(BlockReport {
            path,
            namespace: h.meta.namespace,
            key: h.meta.key,
            parent: BlockKey(h.meta.parent).to_string(),
            position: h.meta.position,
            tokens: h.meta.tokens,
            created_unix_ms: h.meta.created_unix_ms,
            planes: h.planes,
            checksum: format!("blake3:{}", BlockKey(h.checksum)),
            data_bytes: h.data_len,
            file_bytes: h.file_len,
            verify,
        }));
    }
    Ok(None)
}
