//! Helpers: namespaces, deterministic blocks, and views of the files on disk.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use store::{
    Block, BlockMeta, Dtype, NamespaceDescription, NamespaceId, Plane, PlaneSpec, SsdOptions,
    SsdTier,
};

/// A namespace with two planes of `rows x 8` f32 and block size 4.
pub fn desc(model: &str, rows: u64) -> NamespaceDescription {
    let mut d = NamespaceDescription::new(model, Dtype::F32, 4);
    d.layers = vec!["global".into()];
    d.planes = vec![
        PlaneSpec::new("l0.k", Dtype::F32, vec![rows, 8]),
        PlaneSpec::new("l0.v", Dtype::F32, vec![rows, 8]),
    ];
    d
}

/// Deterministic plane bytes from a seed.
pub fn bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A block of `d`'s layout with the given parent, position and tokens.
pub fn block(
    d: &NamespaceDescription,
    parent: [u8; 32],
    position: u32,
    tokens: Vec<u32>,
    seed: u64,
) -> Block {
    let ns = d.id();
    let meta = BlockMeta::new(ns, parent, position, tokens);
    let planes = d
        .planes
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let len = s.byte_len().unwrap() as usize;
            Plane::new(
                s.name.clone(),
                s.dtype,
                s.shape.clone(),
                bytes(seed * 31 + i as u64, len),
            )
        })
        .collect();
    Block { meta, planes }
}

/// Tokens of block `i` of chain `seed`.
pub fn tokens(seed: u64, i: usize, block_size: usize) -> Vec<u32> {
    (0..block_size)
        .map(|j| (seed as u32).wrapping_mul(7919) ^ (i * block_size + j) as u32)
        .collect()
}

/// A chain of `n` blocks; returns blocks and their token lists.
pub fn chain(d: &NamespaceDescription, n: usize, seed: u64) -> (Vec<Block>, Vec<Vec<u32>>) {
    let ns: NamespaceId = d.id();
    let mut parent = ns.0;
    let mut blocks = Vec::new();
    let mut toks = Vec::new();
    for i in 0..n {
        let t = tokens(seed, i, d.block_size as usize);
        let b = block(d, parent, i as u32, t.clone(), seed * 1000 + i as u64);
        parent = b.meta.key.0;
        blocks.push(b);
        toks.push(t);
    }
    (blocks, toks)
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let p = e.path();
        if p.is_dir() {
            walk(&p, out);
        } else {
            out.push(p);
        }
    }
}

/// Every file under `root`.
pub fn files(root: &Path) -> Vec<PathBuf> {
    let mut v = Vec::new();
    walk(root, &mut v);
    v.sort();
    v
}

/// Block files (`*.safetensors` outside quarantine).
pub fn block_files(root: &Path) -> Vec<PathBuf> {
    files(root)
        .into_iter()
        .filter(|p| {
            p.extension().is_some_and(|e| e == "safetensors")
                && !p.components().any(|c| c.as_os_str() == "quarantine")
        })
        .collect()
}

/// Temporary files anywhere.
pub fn temp_files(root: &Path) -> Vec<PathBuf> {
    files(root)
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "tmp"))
        .collect()
}

/// Physical bytes of the block files, measured from the file system.
pub fn physical(root: &Path) -> u64 {
    block_files(root)
        .iter()
        .filter_map(|p| std::fs::metadata(p).ok())
        .map(|m| m.blocks() * 512)
        .sum()
}

/// Whether this process runs as root.
pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .map(|l| l.split_whitespace().nth(2) == Some("0"))
        })
        .unwrap_or(false)
}

/// Physical bytes one small block file takes here (file systems differ).
pub fn per_block(d: &store::NamespaceDescription) -> u64 {
    let dir = tempfile::tempdir().unwrap();
    let ssd = SsdTier::open(
        dir.path(),
        SsdOptions {
            read_only: false,
            budget: 1 << 30,
        },
    )
    .unwrap();
    let (blocks, _) = chain(d, 1, 99);
    ssd.put(&blocks[0]).unwrap();
    ssd.used_bytes()
}
