//! A publication's run written by the device straight into page-locked block memory: each
//! part's plane of each block lands in the chunk that becomes that plane, through one graph
//! node ([`mlx::copy_runs::copy_token_runs_to_host`]; on CUDA one kernel writing over the
//! bus). The export thread then only waits for the node: it reads nothing back and splits
//! nothing, where the other path (device copies of the run, one read per part into scratch,
//! a split on the host: [`crate::host::blocks_from_run`]) moves every byte twice more on the
//! host's threads, beside the engine thread's launches (docs/cache.md, "Publication into
//! block memory").
//!
//! The engine thread makes the node as part of [`crate::PagedKvCache::export`] and queues it
//! on its own stream, like the copies it replaces; nothing here evaluates anything on
//! another thread.

use std::sync::Arc;

use bytes::Bytes;
use mlx::copy_runs::{HostRun, TokenRun, HOST_RUN_TABLE_ENTRY};
use mlx::Array;
use store::Plane;

use crate::block_memory::PinnedChunk;
use crate::host::{part_names, to_store_dtype};
use crate::{CacheError, KvFormat};

/// Whether publications may be written into block memory: `KVSTORE_PUBLISH_IN_PLACE=0`
/// keeps the copies, read back and split, even with block memory on (read once; for
/// measuring both paths).
pub(crate) fn publish_in_place() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("KVSTORE_PUBLISH_IN_PLACE").map_or(true, |v| v != "0"))
}

/// A run of blocks whose planes the device writes into block memory: see the module doc.
pub(crate) struct BlockMemoryRun {
    /// Evaluated: every plane is written.
    done: Array,
    /// Per layer, its parts in plane order.
    layers: Vec<Vec<PartPlanes>>,
}

/// One layer part's planes of a run: one per block, each its own chunk.
struct PartPlanes {
    name: String,
    dtype: store::Dtype,
    shape: Vec<u64>,
    blocks: Vec<Bytes>,
}

/// What the node is lent until it has written: every plane's chunk and the table.
struct Lent {
    _planes: Vec<Bytes>,
    _table: PinnedChunk,
}

impl BlockMemoryRun {
    /// Queues the writes of `n` blocks of `bs` tokens: `layers[l]` holds layer `l`'s parts
    /// (K parts then V parts) as token runs of the pool's arenas, `n · bs` tokens each.
    /// `None` (nothing queued) where block memory cannot hold every plane and the table, or
    /// a part is not one sequence's (`[1, H, T, W]`).
    pub(crate) fn write(
        layers: &[Vec<TokenRun<'_>>],
        format: KvFormat,
        n: usize,
        bs: usize,
    ) -> Result<Option<Self>, CacheError> {
        let mut sources: Vec<&Array> = Vec::new();
        let mut runs: Vec<HostRun> = Vec::new();
        let mut chunks: Vec<Bytes> = Vec::new();
        let mut out: Vec<Vec<PartPlanes>> = Vec::with_capacity(layers.len());
        for (layer, parts) in layers.iter().enumerate() {
            let names = part_names(layer, format);
            if names.len() != parts.len() {
                return Err(CacheError::Publish(format!(
                    "layer {layer} has {} parts where its format has {}",
                    parts.len(),
                    names.len()
                )));
            }
            let mut planes = Vec::with_capacity(parts.len());
            for (name, part) in names.into_iter().zip(parts) {
                let s = part.source.shape();
                if s.len() != 4 || s[0] != 1 || part.hi - part.lo != n * bs {
                    return Ok(None);
                }
                let (heads, width) = (s[1] as usize, s[3] as usize);
                let dtype = to_store_dtype(part.source.dtype())?;
                let len = heads * bs * width * dtype.size() as usize;
                let source = sources.len();
                sources.push(part.source);
                let mut blocks = Vec::with_capacity(n);
                for b in 0..n {
                    // Chunks taken so far go back to their free lists if one is missing.
                    let Some(mut chunk) = PinnedChunk::take(len) else {
                        return Ok(None);
                    };
                    let lo = part.lo + b * bs;
                    runs.push(HostRun {
                        source,
                        lo,
                        hi: lo + bs,
                        dst: chunk.as_mut().as_mut_ptr() as u64,
                    });
                    let plane = Bytes::from_owner(chunk);
                    chunks.push(plane.clone());
                    blocks.push(plane);
                }
                planes.push(PartPlanes {
                    name,
                    dtype,
                    shape: vec![heads as u64, bs as u64, width as u64],
                    blocks,
                });
            }
            out.push(planes);
        }
        if runs.is_empty() {
            return Ok(None);
        }
        let Some(mut table) = PinnedChunk::take_table(runs.len() * HOST_RUN_TABLE_ENTRY) else {
            return Ok(None);
        };
        let (table_at, table_len) = (table.as_mut().as_mut_ptr(), table.as_ref().len());
        let owner = Arc::new(Lent {
            _planes: chunks,
            _table: table,
        });
        // SAFETY: every destination is a chunk of block memory (page-locked, never freed)
        // of exactly its run's bytes (1 · H · bs rows of W elements), and the table a chunk
        // of at least `runs.len()` entries; `owner` holds all of them until the node has
        // written, and nothing reads the planes before `done` is evaluated (`into_planes`).
        let done = unsafe {
            mlx::copy_runs::copy_token_runs_to_host(&sources, &runs, table_at, table_len, owner)
        }?;
        Ok(Some(Self { done, layers: out }))
    }

    /// The array whose evaluation means every plane is written.
    pub(crate) fn done(&self) -> &Array {
        &self.done
    }

    /// Waits for the writes and hands out the planes, per layer as (block index, plane).
    pub(crate) fn into_planes(self) -> Result<Vec<Vec<(usize, Plane)>>, CacheError> {
        mlx::eval(&[&self.done])?;
        Ok(self
            .layers
            .into_iter()
            .map(|parts| {
                parts
                    .into_iter()
                    .flat_map(|p| {
                        let (name, dtype, shape) = (p.name, p.dtype, p.shape);
                        p.blocks.into_iter().enumerate().map(move |(b, data)| {
                            (b, Plane::new(name.clone(), dtype, shape.clone(), data))
                        })
                    })
                    .collect()
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use crate::{Chain, KvCache, KvFormat, PagedConfig, PagedKvCache};
    use mlx::{Array, Dtype};

    /// A cache of `format` and `dtype` (3 layers, `windows` per layer), filled in two
    /// appends, published: every plane is that block's tokens of the keys and values
    /// appended, in the cache's format, byte for byte (the naive reference: a slice of the
    /// whole appended array). The partial last block is not published. Returns whether the
    /// run was written into block memory.
    fn published_planes_are_the_appended_tokens(
        format: KvFormat,
        dtype: Dtype,
        windows: &[Option<usize>],
    ) -> bool {
        let (layers, bs, n, heads, dim) = (3usize, 4usize, 5usize, 2usize, 64usize);
        let total = n * bs + 1;
        let config = PagedConfig {
            block_size: bs,
            format,
            initial_blocks: 2,
            max_blocks: 16,
        };
        let mut cache = PagedKvCache::new(layers, config)
            .unwrap()
            .with_windows(windows)
            .unwrap();
        let shape = [1, heads as i32, total as i32, dim as i32];
        let kv: Vec<(Array, Array)> = (0..layers)
            .map(|l| {
                let draw = |seed| {
                    let key = mlx::random::key(seed).unwrap();
                    mlx::random::normal(&shape, Dtype::F32, &key).unwrap()
                };
                let (k, v) = (draw(l as u64 * 2), draw(l as u64 * 2 + 1));
                (k.astype(dtype).unwrap(), v.astype(dtype).unwrap())
            })
            .collect();
        let tokens = |a: &Array, lo: usize, hi: usize| {
            a.slice(
                &[0, 0, lo as i32, 0],
                &[1, heads as i32, hi as i32, a.shape()[3]],
            )
            .unwrap()
        };
        for (lo, hi) in [(0, 11), (11, total)] {
            for (l, (k, v)) in kv.iter().enumerate() {
                cache
                    .update_and_fetch(l, &tokens(k, lo, hi), &tokens(v, lo, hi))
                    .unwrap();
            }
        }
        let ids: Vec<u32> = (0..total as u32).collect();
        let mut chain = Chain::new(store::NamespaceId([5; 32]), bs);
        let export = cache.export(&mut chain, &ids).unwrap().unwrap();
        let written = export.written_to_block_memory();
        assert_eq!(export.device_bytes() == 0, written);
        let blocks = export.into_blocks().unwrap();
        assert_eq!(blocks.len(), n);
        for (b, block) in blocks.iter().enumerate() {
            let mut want = Vec::new();
            for (l, (k, v)) in kv.iter().enumerate() {
                let parts = [format.encode(k).unwrap(), format.encode(v).unwrap()].concat();
                let names = crate::host::part_names(l, format);
                for (name, part) in names.into_iter().zip(parts) {
                    let bytes = tokens(&part, b * bs, (b + 1) * bs).to_bytes().unwrap();
                    want.push((name, bytes));
                }
            }
            assert_eq!(block.planes.len(), want.len());
            for (plane, (name, bytes)) in block.planes.iter().zip(want) {
                assert_eq!(plane.name, name);
                assert!(
                    plane.data[..] == bytes[..],
                    "{name} of block {b}, {format:?} {dtype}"
                );
            }
        }
        written
    }

    /// With block memory (ordinary memory standing in for it on the CPU), the device writes
    /// every plane of a run into it, for float, bf16 and KV8 caches.
    #[test]
    fn a_run_written_into_block_memory_holds_each_blocks_tokens_of_every_part() {
        crate::block_memory::stand_in_for_tests();
        let kv8 = KvFormat::Quantized {
            bits: 8,
            group_size: 64,
        };
        for (format, dtype) in [
            (KvFormat::Float, Dtype::F32),
            (KvFormat::Float, Dtype::BF16),
            (kv8, Dtype::F32),
        ] {
            let written = published_planes_are_the_appended_tokens(format, dtype, &[None; 3]);
            assert!(written, "{format:?} {dtype}");
        }
    }

    /// A cache with a window layer publishes through the device copies even with block
    /// memory on (some of its blocks leave that layer's planes out), with the same planes.
    #[test]
    fn a_cache_with_a_window_layer_publishes_through_the_copies() {
        crate::block_memory::stand_in_for_tests();
        let windows = [Some(64), None, None];
        let written =
            published_planes_are_the_appended_tokens(KvFormat::Float, Dtype::F32, &windows);
        assert!(!written);
    }
}
