//! `kvstore bench cache`: the paged cache against a contiguous one, and the cost of
//! publishing blocks to host bytes and restoring them, against the raw host → device
//! bandwidth.
//!
//! Decode step: one query token (9 query heads over 3 KV heads, head_dim 64: SmolLM2's
//! attention) appended to a cache of N tokens, then fused SDPA over everything held. The
//! baseline is mlx-lm's cache design measured in the same process: a preallocated
//! contiguous buffer updated in place, attended through a slice view (no gather).
//!
//! Restore: a run of blocks (SmolLM2's 30 layers) from host bytes into a fresh cache, in
//! bulk (one array per layer part), against one `from_bytes` of the same number of bytes
//! into a single device array: the host → device bandwidth of this machine.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use cache::{Chain, KvCache, KvFormat, PagedConfig, PagedKvCache, PagedKvRows};
use mlx::fast::{scaled_dot_product_attention, AttentionMask};
use mlx::{Array, Dtype};
use serde::Serialize;

use super::timing::{median, median_of, random};
use store::NamespaceId;

/// Arguments of `kvstore bench cache`.
#[derive(clap::Args)]
pub struct Args {
    /// Small sizes and few repetitions (a smoke run, numbers not meaningful).
    #[arg(long)]
    quick: bool,
    /// Directory on the disk for the SSD → device restore (made if missing; a scratch
    /// subdirectory is created and removed). Default: the system temp directory.
    #[arg(long, value_name = "DIR")]
    dir: Option<std::path::PathBuf>,
    /// Tokens of the prefix restored from SSD.
    #[arg(long, default_value_t = 32768)]
    ssd_tokens: usize,
    /// Run only these parts (repeatable; default: all).
    #[arg(long, value_enum, value_name = "PART")]
    only: Vec<Part>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

/// A part of `bench cache`.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Part {
    /// Paged vs contiguous decode step.
    Decode,
    /// Publish and bulk restore per block vs host → device.
    Blocks,
    /// SSD → device restore vs `dd`.
    Ssd,
    /// Batched decode step: rows attending one by one vs the batch arena vs one
    /// mlx-lm-style batch cache with fused masked attention.
    Batch,
    /// A device-tier hit read as a shared prefix vs forked (copied): decode step and
    /// prefill chunk over it.
    Share,
}

const HQ: i32 = 9;
const HKV: i32 = 3;
const D: i32 = 64;

#[derive(Serialize)]
struct DecodeRow {
    tokens: usize,
    format: String,
    paged_ms: f64,
    contiguous_ms: f64,
    /// paged / contiguous (target ≤ 1.1).
    ratio: f64,
    /// Of `paged_ms`, building the step's graph on the host (the append, the read and the
    /// attention node; evaluation excluded), µs.
    paged_build_us: f64,
    /// The same for the contiguous cache, µs.
    contiguous_build_us: f64,
}

#[derive(Serialize)]
struct BlockRow {
    /// Whether host ⇄ device copies went through the CUDA driver ([`mlx::direct_transfers`]);
    /// on CUDA both paths are measured.
    direct: bool,
    layers: usize,
    block_size: usize,
    blocks: usize,
    block_bytes: usize,
    publish_ms_per_block: f64,
    restore_ms_per_block: f64,
    /// Restore throughput (block bytes / restore time), GB/s.
    restore_gb_s: f64,
    /// One host buffer of the same bytes into one device array, GB/s.
    host_to_device_gb_s: f64,
    /// restore / host → device (target ≥ 0.7).
    restore_share: f64,
    /// Publication throughput (block bytes / publish time), GB/s.
    publish_gb_s: f64,
    /// A staged restore: its host half (`stage_restore`: checks and assembly, the part an
    /// engine's I/O worker does), ms a block. `None` where the run is larger than a staging
    /// may hold on a GPU (an engine restores such a run through its pipeline instead).
    stage_ms_per_block: Option<f64>,
    /// Its install (`restore_staged`, arrays made real: the engine thread's part), ms a
    /// block; `None` where the run was not staged.
    install_ms_per_block: Option<f64>,
    /// Whether the staged restore read the blocks where they lie (page-locked block
    /// memory, one gather node per layer part) instead of assembling them.
    staged_in_place: bool,
    /// Whether the publication was written by the device straight into block memory
    /// (`cache::Export::written_to_block_memory`).
    published_in_place: bool,
    /// Block bytes / (staging + install), GB/s; `None` where the run was not staged.
    staged_gb_s: Option<f64>,
    /// One device array of the same bytes read to the host, GB/s.
    device_to_host_gb_s: f64,
}

#[derive(Serialize)]
struct SsdRow {
    tokens: usize,
    bytes: u64,
    /// Whether the page cache was dropped before each read (needs root).
    cold: bool,
    /// The store's SSD reader threads (`StoreConfig::ssd_readers`).
    readers: usize,
    /// Whether the import consumed the blocks as the load delivered them
    /// (`PagedKvCache::restore_streaming`) rather than after the load.
    streamed: bool,
    /// Store load (read, checksum, verify) + bulk import into a fresh cache, GB/s.
    restore_gb_s: f64,
    /// Up to the end of the store load (open the store, read and verify every block;
    /// streamed: with the assembly of the blocks that arrived), GB/s.
    load_gb_s: f64,
    /// What the restore took after the load (serial: the whole bulk import; streamed: the
    /// hand-over of the assembled arenas), GB/s.
    import_gb_s: f64,
    /// `dd iflag=direct` of a file of the same size on the same disk, measured right before
    /// this restore, GB/s.
    dd_gb_s: f64,
    /// restore / dd (target ≥ 0.7).
    ratio: f64,
    /// The same block files read whole into fresh memory by as many threads as the
    /// store's readers, nothing else done with the bytes (no checksum, no import), measured
    /// right before this restore: what any reader of this layout gets from the disk, GB/s.
    bare_gb_s: f64,
    /// restore / bare reads: what the store's checks and the import cost on top.
    bare_ratio: f64,
}

#[derive(Serialize)]
struct BatchRow {
    rows: usize,
    tokens: usize,
    layers: usize,
    /// A step (every layer: append + attention, evaluated) with each row attending alone.
    per_row_ms: f64,
    /// The same step through the batch arena.
    arena_ms: f64,
    /// The same step over one `[B, H, T, D]` cache per layer with MLX's fused attention
    /// and a padding mask (what mlx-lm's batch cache does).
    batch_cache_ms: f64,
    /// A row joining: copied into the arena, and the next step, above a step (median of 5).
    arena_join_ms: f64,
    /// A row leaving: its KV handed back to its cache (evaluated), and the next step of the
    /// rows left, above a step (median of 5).
    arena_leave_ms: f64,
}

#[derive(Serialize)]
struct Report {
    batch: Vec<BatchRow>,
    decode: Vec<DecodeRow>,
    blocks: Vec<BlockRow>,
    ssd: Vec<SsdRow>,
    share: Vec<ShareRow>,
}

/// One step after a device-tier hit of `tokens` tokens on a resident sequence of twice as
/// many (not a hand-over): the request's cache forked (copy on write) or reading the
/// resident arenas as a shared prefix (docs/cache.md, "Shared prefixes"); one layer of
/// SmolLM2's attention shape, f32, each step through `KvCache::update_and_attend` and
/// trimmed off again.
#[derive(Serialize)]
struct ShareRow {
    tokens: usize,
    /// Queries of the step: 1 (decode) or a prefill chunk.
    queries: usize,
    /// The fork's first step (its copy of the arena) and the median of the rest.
    fork_first_ms: f64,
    fork_ms: f64,
    shared_first_ms: f64,
    shared_ms: f64,
    /// shared_ms / fork_ms.
    ratio: f64,
}

/// A hit of `n` tokens on a resident sequence of `2n`: shared when `share`, else forked.
fn share_hit(n: usize, share: bool) -> Result<PagedKvCache> {
    let config = PagedConfig {
        block_size: 32,
        initial_blocks: 8,
        max_blocks: 8192,
        ..PagedConfig::default()
    };
    let held = 2 * n;
    let tokens: Vec<u32> = (0..held as u32).collect();
    let mut cache = PagedKvCache::new(1, config)?;
    let (k, v) = (
        random(&[1, HKV, held as i32, D], 1)?,
        random(&[1, HKV, held as i32, D], 2)?,
    );
    cache.update_and_fetch(0, &k, &v)?;
    let ns = NamespaceId([9; 32]);
    let mut pool = cache::ResidentPool::new(u64::MAX);
    pool.set_share_min_tokens(if share { 1 } else { usize::MAX });
    pool.park(Chain::of(ns, 32, &[]), tokens.clone(), cache);
    let mut prompt = tokens[..n].to_vec();
    prompt.push(u32::MAX);
    let chain = Chain::of(ns, 32, &prompt[..n]);
    let hit = pool
        .take(&chain, &prompt, n)?
        .ok_or_else(|| anyhow::anyhow!("the resident prefix of {n} tokens was not found"))?;
    anyhow::ensure!(
        hit.tokens == n && hit.shared == share,
        "a hit of {} tokens (shared: {}) instead of {n} (shared: {share})",
        hit.tokens,
        hit.shared
    );
    Ok(hit.cache)
}

/// The first of `reps + 1` steps of `q_len` queries on `cache` and the median of the rest,
/// in ms (each step trimmed off again).
fn share_steps(cache: &mut PagedKvCache, q_len: i32, reps: usize) -> Result<(f64, f64)> {
    let q = random(&[1, HQ, q_len, D], 3)?;
    let (k, v) = (
        random(&[1, HKV, q_len, D], 4)?,
        random(&[1, HKV, q_len, D], 5)?,
    );
    let mask = if q_len > 1 {
        AttentionMask::Causal
    } else {
        AttentionMask::None
    };
    let scale = 1.0 / (D as f32).sqrt();
    let mut times = Vec::with_capacity(reps + 1);
    for _ in 0..reps + 1 {
        let t = Instant::now();
        cache
            .update_and_attend(0, &q, &k, &v, scale, mask)?
            .eval()?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
        cache.trim(q_len as usize)?;
    }
    let first = times.remove(0);
    times.sort_by(f64::total_cmp);
    Ok((first, times[times.len() / 2]))
}

/// Shared vs forked prefix at 1K-32K tokens: a decode step and a 512-token prefill chunk.
fn share_rows(quick: bool) -> Result<Vec<ShareRow>> {
    let sizes = context_sizes(quick);
    let reps = if quick { 3 } else { 15 };
    let mut rows = Vec::new();
    for &n in sizes {
        for q_len in [1, 512] {
            let (mut fork, mut shared) = (share_hit(n, false)?, share_hit(n, true)?);
            let (fork_first_ms, fork_ms) = share_steps(&mut fork, q_len, reps)?;
            let (shared_first_ms, shared_ms) = share_steps(&mut shared, q_len, reps)?;
            rows.push(ShareRow {
                tokens: n,
                queries: q_len as usize,
                fork_first_ms,
                fork_ms,
                shared_first_ms,
                shared_ms,
                ratio: shared_ms / fork_ms,
            });
        }
    }
    Ok(rows)
}

/// A prefix of `tokens` SmolLM2-shaped tokens (30 layers, f32) published to a store on
/// disk, then restored from SSD into a fresh cache in a new store handle, against `dd`
/// reading a file of the same size with direct I/O.
fn ssd_rows(tokens: usize, dir: &std::path::Path) -> Result<Vec<SsdRow>> {
    use store::{NamespaceDescription, StoreConfig};
    let (layers, bs) = (30usize, 32usize);
    let tokens = tokens.div_ceil(bs) * bs;
    let scratch = super::scratch_dir(dir, "kvstore-bench-cache-")?;
    let root = scratch.path().join("store");
    let config = PagedConfig {
        block_size: bs,
        format: KvFormat::Float,
        initial_blocks: tokens / bs,
        max_blocks: tokens / bs + 1,
    };
    let shape = cache::BlockShape {
        kv_heads: HKV as usize,
        block_size: bs,
        head_dim: D as usize,
        dtype: Dtype::F32,
    };
    let mut desc = NamespaceDescription::new("bench-cache-ssd", store::Dtype::F32, bs as u32);
    desc.planes = cache::plane_specs(layers, shape, KvFormat::Float)?;
    let ids: Vec<u32> = (0..tokens as u32).collect();
    // Everything stays in RAM until the flush writes it; the reader is a new handle.
    let store_config = StoreConfig::default()
        .root(&root)
        .ram_budget(64 << 30)
        .ssd_budget(64 << 30);
    let (keys, files, total) = {
        let mut live = PagedKvCache::new(layers, config)?;
        for l in 0..layers {
            let k = random(&[1, HKV, tokens as i32, D], 1000 + l as u64)?;
            let v = random(&[1, HKV, tokens as i32, D], 2000 + l as u64)?;
            live.update_and_fetch(l, &k, &v)?;
        }
        let s: store::Store = store::Store::open(store_config.clone())?;
        let ns = s.register_namespace(&desc)?;
        let blocks = live.publish(&mut Chain::new(ns, bs), &ids)?;
        let keys: Vec<store::BlockKey> = blocks.iter().map(|b| b.meta.key).collect();
        let total: u64 = blocks.iter().map(|b| b.data_len()).sum();
        for b in blocks {
            s.insert(Arc::new(b))?;
        }
        s.flush()?;
        // The block files the restores read, in chain order, for the bare reads.
        let ssd = s
            .ssd()
            .ok_or_else(|| anyhow::anyhow!("the bench's store has no SSD tier"))?;
        let files: Vec<std::path::PathBuf> = keys.iter().map(|&k| ssd.block_path(ns, k)).collect();
        s.close()?;
        (keys, files, total)
    };
    let ddfile = scratch.path().join("dd.bin");
    let mib = 1u64 << 20;
    crate::bench::store::dd_write(&ddfile, mib, total.div_ceil(mib))?;
    let mut rows = Vec::new();
    // One reader (the load reads file after file) against the default read-ahead; the
    // default both serially (load, then import) and streamed (import as blocks arrive).
    let default_readers = StoreConfig::default().ssd_readers;
    for (readers, streamed) in [(1, true), (default_readers, false), (default_readers, true)] {
        // dd right before each restore: the disk's speed drifts on a shared machine.
        let cold = crate::bench::store::drop_caches();
        let dd_gb_s = crate::bench::store::dd_read(&ddfile, mib, total.div_ceil(mib))?;
        crate::bench::store::drop_caches();
        let bare_gb_s = bare_reads(&files, readers)?;
        crate::bench::store::drop_caches();
        let t = Instant::now();
        let s: store::Store = store::Store::open(store_config.clone().ssd_readers(readers))?;
        let ns = s.register_namespace(&desc)?;
        let per_block: Vec<&[u32]> = ids.chunks(bs).collect();
        let mut load_secs = 0.0;
        let mut loaded = None;
        let restored = if streamed {
            PagedKvCache::new(layers, config)?.restore_streaming(keys.len(), |push| {
                loaded = Some(s.load_prefix_each(ns, &keys, &per_block, |_, b, _| push(b)));
                load_secs = t.elapsed().as_secs_f64();
            })?
        } else {
            let l = s.load_prefix(ns, &keys, &per_block);
            load_secs = t.elapsed().as_secs_f64();
            let blocks: Vec<Arc<store::Block>> = l.blocks.iter().map(|(b, _)| b.clone()).collect();
            loaded = Some(l);
            PagedKvCache::restore(layers, config, &blocks)?
        };
        let loaded = loaded.ok_or_else(|| anyhow::anyhow!("the load did not run"))?;
        if loaded.blocks.len() != keys.len() || restored.blocks != keys.len() {
            anyhow::bail!(
                "only {} of {} blocks loaded ({:?}), {} restored ({:?})",
                loaded.blocks.len(),
                keys.len(),
                loaded.stopped,
                restored.blocks,
                restored.stopped
            );
        }
        let mut all = Vec::new();
        for l in 0..layers {
            all.extend(restored.cache.pool(l).into_iter().flat_map(|p| p.arrays()));
        }
        mlx::eval(&all)?;
        let secs = t.elapsed().as_secs_f64();
        let restore_gb_s = total as f64 / secs / 1e9;
        let load_gb_s = total as f64 / load_secs / 1e9;
        let import_gb_s = total as f64 / (secs - load_secs) / 1e9;
        rows.push(SsdRow {
            tokens,
            bytes: total,
            cold,
            readers,
            streamed,
            restore_gb_s,
            load_gb_s,
            import_gb_s,
            dd_gb_s,
            ratio: restore_gb_s / dd_gb_s,
            bare_gb_s,
            bare_ratio: restore_gb_s / bare_gb_s,
        });
    }
    Ok(rows)
}

/// Reads `files` (a run's block files, in chain order) whole into fresh memory on
/// `threads` threads (each takes the next file), keeping every file's bytes to the end as a
/// load does, and returns GB/s: the baseline of a file per block read by a reader that does
/// nothing else, on the same files the restore reads.
fn bare_reads(files: &[std::path::PathBuf], threads: usize) -> Result<f64> {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let t = Instant::now();
    let kept = std::thread::scope(|s| -> Result<Vec<Vec<Vec<u8>>>> {
        let workers: Vec<_> = (0..threads.max(1))
            .map(|_| {
                s.spawn(|| -> std::io::Result<Vec<Vec<u8>>> {
                    // Kept to the end, as a load keeps what it read (freed at once, the
                    // next read would reuse warm memory instead of faulting in fresh).
                    let mut kept = Vec::new();
                    let take = || next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    while let Some(f) = files.get(take()) {
                        kept.push(std::fs::read(f)?);
                    }
                    Ok(kept)
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| {
                w.join()
                    .map_err(|_| anyhow::anyhow!("a bare reader panicked"))?
                    .map_err(Into::into)
            })
            .collect()
    })?;
    let secs = t.elapsed().as_secs_f64();
    let bytes: usize = kept.iter().flatten().map(Vec::len).sum();
    Ok(bytes as f64 / secs / 1e9)
}

/// mlx-lm's KVCache: a buffer grown in steps, written in place, read through a slice.
struct PreallocatedCache {
    keys: Option<Array>,
    values: Option<Array>,
    len: i32,
}

impl PreallocatedCache {
    fn new(capacity: i32) -> Result<Self> {
        let z = || mlx::ops::zeros(&[1, HKV, capacity, D], Dtype::F32);
        Ok(Self {
            keys: Some(z()?),
            values: Some(z()?),
            len: 0,
        })
    }

    fn update_and_fetch(&mut self, k: &Array, v: &Array) -> Result<(Array, Array)> {
        let n = k.shape()[2];
        let (start, stop) = ([0, 0, self.len, 0], [1, HKV, self.len + n, D]);
        let keys = self
            .keys
            .take()
            .ok_or_else(|| anyhow::anyhow!("keys"))?
            .slice_update(k, &start, &stop)?;
        let values = self
            .values
            .take()
            .ok_or_else(|| anyhow::anyhow!("values"))?
            .slice_update(v, &start, &stop)?;
        self.len += n;
        let view = |a: &Array| a.slice(&[0, 0, 0, 0], &[1, HKV, self.len, D]);
        let out = (view(&keys)?, view(&values)?);
        self.keys = Some(keys);
        self.values = Some(values);
        Ok(out)
    }
}

/// Context lengths the decode and share rows measure: issue 15's 1K-32K, or one short one.
fn context_sizes(quick: bool) -> &'static [usize] {
    if quick {
        &[256]
    } else {
        &[1024, 4096, 16384, 32768]
    }
}

fn decode_rows(quick: bool) -> Result<Vec<DecodeRow>> {
    let sizes = context_sizes(quick);
    let reps = if quick { 3 } else { 20 };
    let scale = 1.0 / (D as f32).sqrt();
    let mut rows = Vec::new();
    for &n in sizes {
        for format in [KvFormat::Float, KvFormat::KV8] {
            let prefix_k = random(&[1, HKV, n as i32, D], 1)?;
            let prefix_v = random(&[1, HKV, n as i32, D], 2)?;
            let q = random(&[1, HQ, 1, D], 3)?;
            let step_k = random(&[1, HKV, 1, D], 4)?;
            let step_v = random(&[1, HKV, 1, D], 5)?;

            let config = PagedConfig {
                block_size: 32,
                format,
                initial_blocks: n / 32 + reps + 2,
                max_blocks: n / 32 + 4 * reps + 8,
            };
            let mut paged = PagedKvCache::new(1, config)?;
            paged.update_and_fetch(0, &prefix_k, &prefix_v)?;
            // The contiguous baseline of a quantized cache is the float one: what a request
            // would pay without the paged, quantized pool.
            let mut contiguous = PreallocatedCache::new(n as i32 + 4 * reps as i32 + 8)?;
            contiguous.update_and_fetch(&prefix_k, &prefix_v)?;
            // Alternate the two so load on this shared machine hits both alike.
            let (mut tp, mut tc, mut bp, mut bc) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            for _ in 0..reps + 1 {
                let t = Instant::now();
                let (k, v) = paged.update_and_fetch(0, &step_k, &step_v)?;
                let out = scaled_dot_product_attention(&q, &k, &v, scale, AttentionMask::None)?;
                bp.push(t.elapsed());
                out.eval()?;
                tp.push(t.elapsed());
                let t = Instant::now();
                let (k, v) = contiguous.update_and_fetch(&step_k, &step_v)?;
                let out = scaled_dot_product_attention(&q, &k, &v, scale, AttentionMask::None)?;
                bc.push(t.elapsed());
                out.eval()?;
                tc.push(t.elapsed());
            }
            let (t_paged, t_contiguous) = (
                median_of(&mut tp[1..].to_vec()),
                median_of(&mut tc[1..].to_vec()),
            );
            let (b_paged, b_contiguous) = (
                median_of(&mut bp[1..].to_vec()),
                median_of(&mut bc[1..].to_vec()),
            );
            rows.push(DecodeRow {
                tokens: n,
                format: match format {
                    KvFormat::Float => "f32".into(),
                    KvFormat::Quantized { bits, group_size } => format!("kv{bits}/g{group_size}"),
                },
                paged_ms: t_paged.as_secs_f64() * 1e3,
                contiguous_ms: t_contiguous.as_secs_f64() * 1e3,
                ratio: t_paged.as_secs_f64() / t_contiguous.as_secs_f64(),
                paged_build_us: b_paged.as_secs_f64() * 1e6,
                contiguous_build_us: b_contiguous.as_secs_f64() * 1e6,
            });
        }
    }
    Ok(rows)
}

fn batch_rows(quick: bool) -> Result<Vec<BatchRow>> {
    let shapes: &[(usize, usize)] = if quick {
        &[(4, 128)]
    } else {
        &[(8, 1024), (16, 1024), (8, 4096), (16, 4096)]
    };
    let layers = if quick { 2 } else { 30 };
    let reps = if quick { 3 } else { 12 };
    let scale = 1.0 / (D as f32).sqrt();
    let mut out = Vec::new();
    for &(b, n) in shapes {
        let bi = b as i32;
        let q = random(&[bi, HQ, 1, D], 3)?;
        let step_k = random(&[bi, HKV, 1, D], 4)?;
        let step_v = random(&[bi, HKV, 1, D], 5)?;
        let config = PagedConfig {
            block_size: 16,
            format: KvFormat::Float,
            initial_blocks: (n + 4 * reps + 64) / 16,
            max_blocks: (n + 8 * reps + 512) / 16,
        };
        let make_rows = |arena: bool| -> Result<PagedKvRows> {
            let mut rows = PagedKvRows::new();
            rows.set_batch_arena(arena)?;
            for r in 0..b {
                let mut c = PagedKvCache::new(layers, config)?;
                for l in 0..layers {
                    let k = random(&[1, HKV, n as i32, D], 10 + r as u64)?;
                    c.append(l, &k, &k)?;
                }
                rows.push(c)?;
            }
            Ok(rows)
        };
        let step = |rows: &mut PagedKvRows| -> Result<()> {
            let mut outs = Vec::with_capacity(layers);
            for l in 0..layers {
                outs.push(rows.attend(l, &q, &step_k, &step_v, scale, None)?);
            }
            let refs: Vec<&Array> = outs.iter().collect();
            mlx::eval(&refs)?;
            Ok(())
        };
        let mut per_row = make_rows(false)?;
        let mut arena = make_rows(true)?;
        // mlx-lm's batch cache: one [B, H, cap, D] per layer, written in place.
        let cap = (n + 4 * reps + 64) as i32;
        let mut batch: Vec<(Option<Array>, Option<Array>)> = (0..layers)
            .map(|_| -> Result<_> {
                let k = random(&[bi, HKV, cap, D], 20)?;
                Ok((Some(k.clone()), Some(k)))
            })
            .collect::<Result<_>>()?;
        let mut len = n as i32;
        let mut batch_step = || -> Result<()> {
            let mask = mlx::ops::full(&[bi, 1, 1, len + 1], 1.0, Dtype::Bool)?;
            let mut outs = Vec::with_capacity(layers);
            for (k, v) in batch.iter_mut() {
                let (start, stop) = ([0, 0, len, 0], [bi, HKV, len + 1, D]);
                let kk = k.take().ok_or_else(|| anyhow::anyhow!("keys"))?;
                let vv = v.take().ok_or_else(|| anyhow::anyhow!("values"))?;
                let kk = kk.slice_update(&step_k, &start, &stop)?;
                let vv = vv.slice_update(&step_v, &start, &stop)?;
                let kv = kk.slice(&[0, 0, 0, 0], &[bi, HKV, len + 1, D])?;
                let vv2 = vv.slice(&[0, 0, 0, 0], &[bi, HKV, len + 1, D])?;
                outs.push(scaled_dot_product_attention(
                    &q,
                    &kv,
                    &vv2,
                    scale,
                    AttentionMask::Array(&mask),
                )?);
                *k = Some(kk);
                *v = Some(vv);
            }
            len += 1;
            let refs: Vec<&Array> = outs.iter().collect();
            mlx::eval(&refs)?;
            Ok(())
        };
        let (mut tp, mut ta, mut tb) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..reps + 1 {
            let t = Instant::now();
            step(&mut per_row)?;
            tp.push(t.elapsed());
            let t = Instant::now();
            step(&mut arena)?;
            ta.push(t.elapsed());
            let t = Instant::now();
            batch_step()?;
            tb.push(t.elapsed());
        }
        // Joins and leaves, alternating: a row joins (copied in) and the next step runs;
        // then the first row leaves (its cache gets its KV back, evaluated) and the next
        // step of the rest runs. The joining row is evaluated before the clock starts.
        let qj = random(&[bi + 1, HQ, 1, D], 6)?;
        let kj = random(&[bi + 1, HKV, 1, D], 7)?;
        let (mut tj, mut tl) = (Vec::new(), Vec::new());
        for cycle in 0..if quick { 2 } else { 5 } {
            let mut c = PagedKvCache::new(layers, config)?;
            for l in 0..layers {
                let k = random(&[1, HKV, n as i32, D], 99 + cycle)?;
                c.append(l, &k, &k)?;
            }
            let held: Vec<&Array> = (0..layers)
                .filter_map(|l| c.pool(l))
                .flat_map(|p| p.arrays())
                .collect();
            mlx::eval(&held)?;
            let t = Instant::now();
            arena.push(c)?;
            let mut outs = Vec::with_capacity(layers);
            for l in 0..layers {
                outs.push(arena.attend(l, &qj, &kj, &kj, scale, None)?);
            }
            let refs: Vec<&Array> = outs.iter().collect();
            mlx::eval(&refs)?;
            tj.push(t.elapsed());
            let t = Instant::now();
            let keep: Vec<usize> = (1..=b).collect();
            let gone = arena.filter(&keep)?;
            let held: Vec<&Array> = gone
                .iter()
                .flat_map(|c| (0..layers).filter_map(|l| c.pool(l)))
                .flat_map(|p| p.arrays())
                .collect();
            mlx::eval(&held)?;
            step(&mut arena)?;
            tl.push(t.elapsed());
        }
        let (join, leave) = (median_of(&mut tj), median_of(&mut tl));
        let (p, a, bc) = (
            median_of(&mut tp[1..].to_vec()),
            median_of(&mut ta[1..].to_vec()),
            median_of(&mut tb[1..].to_vec()),
        );
        out.push(BatchRow {
            rows: b,
            tokens: n,
            layers,
            per_row_ms: p.as_secs_f64() * 1e3,
            arena_ms: a.as_secs_f64() * 1e3,
            batch_cache_ms: bc.as_secs_f64() * 1e3,
            arena_join_ms: (join.as_secs_f64() - a.as_secs_f64()) * 1e3,
            arena_leave_ms: (leave.as_secs_f64() - a.as_secs_f64()) * 1e3,
        });
    }
    Ok(out)
}

fn block_rows(quick: bool) -> Result<Vec<BlockRow>> {
    if !mlx::direct_transfers() {
        return block_rows_on(quick, false);
    }
    // Published blocks in page-locked memory, as an engine's RAM tier keeps them on a GPU
    // (the staged restore reads them in place): 8 GiB of it, as session 48 measured (the
    // largest run publishes 1.5 GB a time); KVSTORE_PINNED_BLOCKS_MIB=0 measures the copies.
    cache::allow_block_memory(cache::requested_block_memory().unwrap_or(8 << 30));
    let was = mlx::set_direct_transfers(true);
    let mut rows = block_rows_on(quick, true);
    mlx::set_direct_transfers(false);
    if let Ok(r) = &mut rows {
        match block_rows_on(quick, false) {
            Ok(more) => r.extend(more),
            Err(e) => rows = Err(e),
        }
    }
    mlx::set_direct_transfers(was);
    rows
}

fn block_rows_on(quick: bool, direct: bool) -> Result<Vec<BlockRow>> {
    // SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64, f32 KV.
    let layers = if quick { 4 } else { 30 };
    let mut rows = Vec::new();
    let shapes: &[(usize, usize)] = if quick {
        &[(16, 4), (64, 4)]
    } else {
        &[(16, 32), (64, 32), (32, 1024)]
    };
    for &(block_size, blocks) in shapes {
        let config = PagedConfig {
            block_size,
            format: KvFormat::Float,
            initial_blocks: blocks,
            max_blocks: blocks * 2,
        };
        let tokens: Vec<u32> = (0..(blocks * block_size) as u32).collect();
        let mut cache = PagedKvCache::new(layers, config)?;
        // Each layer's keys and values as host bytes: what every published plane is checked
        // against.
        let mut appended = Vec::with_capacity(layers);
        for l in 0..layers {
            let k = random(&[1, HKV, tokens.len() as i32, D], 10 + l as u64)?;
            let v = random(&[1, HKV, tokens.len() as i32, D], 100 + l as u64)?;
            cache.update_and_fetch(l, &k, &v)?;
            appended.push([k.to_bytes()?, v.to_bytes()?]);
        }
        for l in 0..layers {
            for a in cache.pool(l).into_iter().flat_map(|p| p.arrays()) {
                a.eval()?;
            }
        }
        let ns = NamespaceId([7; 32]);
        // Each publish runs on a fresh clone (nothing published yet, buffers shared).
        let mut published: Vec<Arc<store::Block>> = Vec::new();
        let mut published_in_place = false;
        let publish = median(if quick { 2 } else { 3 }, || {
            // The last rep's blocks go first: their page-locked memory serves this one.
            published.clear();
            let Some(export) = cache
                .clone()
                .export(&mut Chain::new(ns, block_size), &tokens)?
            else {
                anyhow::bail!("nothing to publish");
            };
            published_in_place = export.written_to_block_memory();
            published = export.into_blocks()?.into_iter().map(Arc::new).collect();
            Ok(())
        })?;
        check_published(&published, &appended, block_size)?;
        let restore = median(if quick { 2 } else { 5 }, || {
            let r = PagedKvCache::restore(layers, config, &published)?;
            let mut all = Vec::new();
            for l in 0..layers {
                all.extend(r.cache.pool(l).into_iter().flat_map(|p| p.arrays()));
            }
            mlx::eval(&all)?;
            Ok(())
        })?;
        // The same restore staged: the host half and the install timed apart, each rep
        // on a fresh empty cache. A run larger than a staging may hold (on a GPU) is not
        // staged, and its row says so.
        let (mut stage_t, mut install_t) = (Vec::new(), Vec::new());
        let (mut in_place, mut last_staged) = (false, None);
        for _ in 0..if quick { 2 } else { 5 } {
            let empty = PagedKvCache::new(layers, config)?;
            let t = Instant::now();
            let Some(staged) = empty.stage_restore(&published)? else {
                break;
            };
            stage_t.push(t.elapsed());
            in_place = staged.reads_in_place();
            let t = Instant::now();
            let r = empty.restore_staged(staged, &published)?;
            let mut all = Vec::new();
            for l in 0..layers {
                all.extend(r.cache.pool(l).into_iter().flat_map(|p| p.arrays()));
            }
            mlx::eval(&all)?;
            install_t.push(t.elapsed());
            if !r.staged || r.blocks != blocks {
                anyhow::bail!("the staged restore was not installed ({} blocks)", r.blocks);
            }
            last_staged = Some(r.cache);
        }
        // The staged path (in place or assembled) must restore the batch restore's bytes.
        if let Some(staged) = last_staged.take() {
            let batch = PagedKvCache::restore(layers, config, &published)?.cache;
            for l in 0..layers {
                let pools = staged.pool(l).into_iter().zip(batch.pool(l));
                for (a, b) in pools.flat_map(|(s, b)| s.arrays().iter().zip(b.arrays())) {
                    if a.to_bytes()? != b.to_bytes()? {
                        anyhow::bail!(
                            "layer {l}: the staged restore (in place: {in_place}) differs from the batch restore"
                        );
                    }
                }
            }
        }
        let per_block = |times: &mut Vec<Duration>| {
            (!times.is_empty()).then(|| median_of(times).as_secs_f64() * 1e3 / blocks as f64)
        };
        let (stage, install) = (per_block(&mut stage_t), per_block(&mut install_t));
        let block_bytes = published.first().map_or(0, |b| b.data_len() as usize);
        let total = block_bytes * blocks;
        let host = vec![1u8; total];
        let h2d = median(if quick { 2 } else { 5 }, || {
            Array::from_bytes(&host, &[(total / 4) as i32], Dtype::F32)?.eval()?;
            Ok(())
        })?;
        let on_device = Array::from_bytes(&host, &[(total / 4) as i32], Dtype::F32)?
            .add(&Array::scalar(1.0, Dtype::F32)?)?;
        on_device.eval()?;
        let mut d2h_times = Vec::new();
        for _ in 0..if quick { 2 } else { 5 } {
            // A fresh device array each time: MLX's own read moves the buffer to the host.
            let a = on_device.mul(&Array::scalar(1.0, Dtype::F32)?)?;
            a.eval()?;
            let t = Instant::now();
            std::hint::black_box(a.to_bytes()?);
            d2h_times.push(t.elapsed());
        }
        let d2h = median_of(&mut d2h_times);
        let restore_gb_s = total as f64 / restore.as_secs_f64() / 1e9;
        let h2d_gb_s = total as f64 / h2d.as_secs_f64() / 1e9;
        rows.push(BlockRow {
            direct,
            publish_gb_s: total as f64 / publish.as_secs_f64() / 1e9,
            device_to_host_gb_s: total as f64 / d2h.as_secs_f64() / 1e9,
            layers,
            block_size,
            blocks,
            block_bytes,
            publish_ms_per_block: publish.as_secs_f64() * 1e3 / blocks as f64,
            restore_ms_per_block: restore.as_secs_f64() * 1e3 / blocks as f64,
            restore_gb_s,
            host_to_device_gb_s: h2d_gb_s,
            restore_share: restore_gb_s / h2d_gb_s,
            stage_ms_per_block: stage,
            install_ms_per_block: install,
            staged_in_place: in_place,
            published_in_place,
            staged_gb_s: stage
                .zip(install)
                .map(|(s, i)| block_bytes as f64 / ((s + i) * 1e-3) / 1e9),
        });
    }
    Ok(rows)
}

/// Fails unless every plane of `published` holds its block's tokens of the keys and values
/// appended (`appended[layer]`: K then V, `[1, HKV, T, D]` f32 bytes).
fn check_published(
    published: &[Arc<store::Block>],
    appended: &[[Vec<u8>; 2]],
    bs: usize,
) -> Result<()> {
    let row = D as usize * 4;
    let t = published.len() * bs;
    for (b, block) in published.iter().enumerate() {
        if block.planes.len() != appended.len() * 2 {
            anyhow::bail!("block {b} has {} planes", block.planes.len());
        }
        for (plane, src) in block.planes.iter().zip(appended.iter().flatten()) {
            let heads = (0..HKV as usize).map(|h| {
                let at = (h * t + b * bs) * row;
                &src[at..at + bs * row]
            });
            if !plane.data.chunks(bs * row).eq(heads) {
                anyhow::bail!(
                    "plane {} of block {b} is not its tokens' keys or values",
                    plane.name
                );
            }
        }
    }
    Ok(())
}

/// A staged restore's column: its time, or why there is none.
fn staged_ms(ms: Option<f64>) -> String {
    ms.map_or_else(|| "not staged".to_string(), |ms| format!("{ms:.3}ms"))
}

/// Runs the cache benchmark and prints a table or JSON.
pub fn run(args: Args) -> Result<()> {
    let dir = args.dir.clone().unwrap_or_else(std::env::temp_dir);
    let part = |p: Part| args.only.is_empty() || args.only.contains(&p);
    let report = Report {
        batch: if part(Part::Batch) {
            batch_rows(args.quick)?
        } else {
            Vec::new()
        },
        decode: if part(Part::Decode) {
            decode_rows(args.quick)?
        } else {
            Vec::new()
        },
        blocks: if part(Part::Blocks) {
            block_rows(args.quick)?
        } else {
            Vec::new()
        },
        ssd: if part(Part::Ssd) {
            ssd_rows(if args.quick { 512 } else { args.ssd_tokens }, &dir)?
        } else {
            Vec::new()
        },
        share: if part(Part::Share) {
            share_rows(args.quick)?
        } else {
            Vec::new()
        },
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    if !report.batch.is_empty() {
        println!("batched decode step (every layer: append + attention; 9/3 heads, d64, f32)");
        println!(
            "{:>5} {:>7} {:>7} {:>12} {:>12} {:>12} {:>12} {:>12}",
            "rows",
            "tokens",
            "layers",
            "per row",
            "arena",
            "batch cache",
            "arena join",
            "arena leave"
        );
        for r in &report.batch {
            println!(
                "{:>5} {:>7} {:>7} {:>10.3}ms {:>10.3}ms {:>10.3}ms {:>10.3}ms {:>10.3}ms",
                r.rows,
                r.tokens,
                r.layers,
                r.per_row_ms,
                r.arena_ms,
                r.batch_cache_ms,
                r.arena_join_ms,
                r.arena_leave_ms
            );
        }
        println!();
    }
    println!("decode step (append 1 token + SDPA, 9/3 heads, d64, f32 compute)");
    println!(
        "{:>8} {:>8} {:>12} {:>14} {:>8} {:>22}",
        "tokens", "format", "paged", "contiguous", "ratio", "graph built (µs)"
    );
    for r in &report.decode {
        println!(
            "{:>8} {:>8} {:>10.3}ms {:>12.3}ms {:>7.2}x {:>10.1} / {:>9.1}",
            r.tokens,
            r.format,
            r.paged_ms,
            r.contiguous_ms,
            r.ratio,
            r.paged_build_us,
            r.contiguous_build_us
        );
    }
    println!("\npublish / restore in bulk (f32 KV, 3 KV heads, d64)");
    println!(
        "{:>7} {:>7} {:>6} {:>7} {:>12} {:>14} {:>14} {:>10} {:>10} {:>7} {:>10} {:>10} {:>12} {:>12} {:>10} {:>8} {:>18}",
        "path",
        "layers",
        "block",
        "blocks",
        "block bytes",
        "publish/block",
        "restore/block",
        "restore",
        "host→dev",
        "share",
        "publish",
        "dev→host",
        "staged: host",
        "install",
        "staged",
        "in place",
        "published in place"
    );
    for r in &report.blocks {
        println!(
            "{:>7} {:>7} {:>6} {:>7} {:>12} {:>12.3}ms {:>12.3}ms {:>6.2}GB/s {:>6.2}GB/s {:>6.2} {:>6.2}GB/s {:>6.2}GB/s {:>12} {:>12} {:>10} {:>8} {:>18}",
            if r.direct { "direct" } else { "mlx" },
            r.layers,
            r.block_size,
            r.blocks,
            r.block_bytes,
            r.publish_ms_per_block,
            r.restore_ms_per_block,
            r.restore_gb_s,
            r.host_to_device_gb_s,
            r.restore_share,
            r.publish_gb_s,
            r.device_to_host_gb_s,
            staged_ms(r.stage_ms_per_block),
            staged_ms(r.install_ms_per_block),
            r.staged_gb_s
                .map_or_else(|| "-".to_string(), |g| format!("{g:.2}GB/s")),
            if r.staged_in_place { "yes" } else { "no" },
            if r.published_in_place { "yes" } else { "no" }
        );
    }
    if !report.share.is_empty() {
        println!("\nshared prefix vs fork after a device hit (one layer, 9/3 heads, d64, f32)");
        println!(
            "{:>7} {:>7} {:>12} {:>10} {:>14} {:>10} {:>8}",
            "tokens", "queries", "fork first", "fork", "shared first", "shared", "ratio"
        );
        for r in &report.share {
            println!(
                "{:>7} {:>7} {:>10.2}ms {:>8.3}ms {:>12.2}ms {:>8.3}ms {:>7.2}x",
                r.tokens,
                r.queries,
                r.fork_first_ms,
                r.fork_ms,
                r.shared_first_ms,
                r.shared_ms,
                r.ratio
            );
        }
    }
    for r in &report.ssd {
        println!(
            "\nSSD → device: {} tokens ({:.0} MB, 30 layers, f32), {} reader(s), {}: store load + bulk import {:.2} GB/s (load {:.2}, then {:.2}); dd iflag=direct {:.2} GB/s; ratio {:.2}; bare reads of the block files {:.2} GB/s, ratio {:.2}{}",
            r.tokens,
            r.bytes as f64 / 1e6,
            r.readers,
            if r.streamed { "streamed" } else { "serial" },
            r.restore_gb_s,
            r.load_gb_s,
            r.import_gb_s,
            r.dd_gb_s,
            r.ratio,
            r.bare_gb_s,
            r.bare_ratio,
            if r.cold { "" } else { " (page cache not dropped: not root, reads may be warm)" }
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_rows_time_the_staged_restore_where_the_run_is_staged() {
        // The CPU stages every run; a GPU leaves runs over its staging bound out, and the
        // row says so instead of ending the benchmark.
        let rows = block_rows_on(true, false).unwrap();
        let shapes: Vec<(usize, usize)> = rows.iter().map(|r| (r.block_size, r.blocks)).collect();
        assert_eq!(shapes, [(16, 4), (64, 4)]);
        for r in &rows {
            assert!(
                r.stage_ms_per_block.is_some_and(|ms| ms > 0.0),
                "{}",
                r.block_size
            );
            assert!(
                r.install_ms_per_block.is_some_and(|ms| ms > 0.0),
                "{}",
                r.block_size
            );
        }
        assert_eq!(staged_ms(None), "not staged");
        assert_eq!(staged_ms(Some(1.23456)), "1.235ms");
    }

    #[test]
    fn the_share_rows_compare_a_shared_hit_with_a_fork_of_the_same_tokens() {
        let shared = share_hit(64, true).unwrap();
        assert_eq!(shared.shared_prefix().map(|(_, t)| t), Some(64));
        assert_eq!(shared.offset(), 64);
        let fork = share_hit(64, false).unwrap();
        assert!(fork.shared_prefix().is_none());
        assert_eq!(fork.offset(), 64);
        let rows = share_rows(true).unwrap();
        let shapes: Vec<(usize, usize)> = rows.iter().map(|r| (r.tokens, r.queries)).collect();
        assert_eq!(shapes, [(256, 1), (256, 512)]);
        for r in &rows {
            assert!(r.fork_ms > 0.0 && r.shared_ms > 0.0, "{}", r.tokens);
            assert!((r.ratio - r.shared_ms / r.fork_ms).abs() < 1e-12);
        }
    }
}
