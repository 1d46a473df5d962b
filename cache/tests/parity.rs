//! Parity gates: every paged variant against a plain contiguous KV cache (tolerance 0),
//! plus publication, restore, clone, trim, rows and masks against naive references.
//! Each test prints its seed; KVSTORE_TEST_SEED replays it.

use std::sync::Arc;

use cache::{
    attention_mask, plane_specs, BlockShape, CacheError, Chain, ContiguousKvCache, KvCache,
    KvFormat, Mask, PagedConfig, PagedKvCache, PagedKvRows,
};
use mlx::{Array, Dtype, QuantSpec};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use store::{chain_keys, Block, NamespaceDescription, Store, StoreConfig, Tier};

const H: usize = 2;
const D: usize = 64;

fn rng(test: &str) -> StdRng {
    let seed = std::env::var("KVSTORE_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random::<u64>);
    eprintln!("{test}: KVSTORE_TEST_SEED={seed}");
    StdRng::seed_from_u64(seed)
}

/// Random `[1, H, len, D]` keys or values in `dtype`.
fn kv(r: &mut StdRng, len: usize, dtype: Dtype) -> Array {
    let data: Vec<f32> = (0..H * len * D)
        .map(|_| r.gen_range(-2.0f32..2.0))
        .collect();
    Array::from_slice(&data, &[1, H as i32, len as i32, D as i32])
        .unwrap()
        .astype(dtype)
        .unwrap()
}

fn bytes(a: &Array) -> Vec<u8> {
    a.to_bytes().unwrap()
}

fn config(block_size: usize, format: KvFormat) -> PagedConfig {
    PagedConfig {
        block_size,
        format,
        initial_blocks: 2,
        max_blocks: 1024,
    }
}

/// Appends the same random chunks to both caches (all layers) and checks every fetch is
/// byte-identical.
fn append_and_compare(
    r: &mut StdRng,
    paged: &mut PagedKvCache,
    reference: &mut impl KvCache,
    chunks: usize,
    dtype: Dtype,
) {
    for _ in 0..chunks {
        let len = if r.gen_bool(0.5) {
            1
        } else {
            r.gen_range(1..40)
        };
        for layer in 0..paged.layers() {
            let (k, v) = (kv(r, len, dtype), kv(r, len, dtype));
            let (pk, pv) = paged.update_and_fetch(layer, &k, &v).unwrap();
            let (rk, rv) = reference.update_and_fetch(layer, &k, &v).unwrap();
            assert_eq!(pk.shape(), rk.shape());
            assert_eq!(pk.dtype(), dtype);
            assert!(
                bytes(&pk) == bytes(&rk),
                "keys differ at layer {layer}, offset {}",
                paged.offset()
            );
            assert!(
                bytes(&pv) == bytes(&rv),
                "values differ at layer {layer}, offset {}",
                paged.offset()
            );
        }
    }
}

#[test]
fn paged_fetch_equals_contiguous_exactly_f32_bf16_f16() {
    let mut r = rng("paged_fetch_equals_contiguous_exactly_f32_bf16_f16");
    for dtype in [Dtype::F32, Dtype::BF16, Dtype::F16] {
        for block_size in [1, 7, 16] {
            let mut paged = PagedKvCache::new(3, config(block_size, KvFormat::Float)).unwrap();
            let mut reference = ContiguousKvCache::new(3);
            append_and_compare(&mut r, &mut paged, &mut reference, 12, dtype);
            assert_eq!(paged.offset(), reference.offset());
        }
    }
}

/// A contiguous quantized reference: each chunk quantized on its own, parts concatenated,
/// dequantized on fetch. Quantization groups run along head_dim, so chunking cannot matter.
struct QuantizedReference {
    spec: QuantSpec,
    layers: Vec<Option<[Vec<Array>; 2]>>,
}

impl KvCache for QuantizedReference {
    fn layers(&self) -> usize {
        self.layers.len()
    }
    fn layer_offset(&self, layer: usize) -> usize {
        self.layers[layer]
            .as_ref()
            .map_or(0, |[k, _]| k[0].shape()[2] as usize)
    }
    fn update_and_fetch(
        &mut self,
        layer: usize,
        keys: &Array,
        values: &Array,
    ) -> Result<(Array, Array), CacheError> {
        let q = |x: &Array| {
            let q = mlx::quantize(x, self.spec).unwrap();
            vec![q.packed, q.scales, q.biases]
        };
        let (kq, vq) = (q(keys), q(values));
        let slot = &mut self.layers[layer];
        let next = match slot.take() {
            None => [kq, vq],
            Some([k, v]) => {
                let cat = |old: &[Array], new: &[Array]| -> Vec<Array> {
                    old.iter()
                        .zip(new)
                        .map(|(a, b)| mlx::ops::concatenate(&[a, b], 2).unwrap())
                        .collect()
                };
                [cat(&k, &kq), cat(&v, &vq)]
            }
        };
        let deq = |p: &[Array]| {
            mlx::dequantize(&mlx::Quantized {
                packed: p[0].clone(),
                scales: p[1].clone(),
                biases: p[2].clone(),
                spec: self.spec,
            })
            .unwrap()
        };
        let out = (deq(&next[0]), deq(&next[1]));
        *slot = Some(next);
        Ok(out)
    }

    fn trim(&mut self, tokens: usize) -> Result<usize, CacheError> {
        let mut trimmed = 0;
        for slot in &mut self.layers {
            let Some(parts) = slot.take() else { continue };
            let len = parts[0][0].shape()[2] as usize;
            let n = tokens.min(len);
            trimmed = trimmed.max(n);
            if n < len {
                let keep = |p: &Vec<Array>| -> Vec<Array> {
                    p.iter()
                        .map(|a| {
                            let mut stop = a.shape().to_vec();
                            stop[2] = (len - n) as i32;
                            a.slice(&[0, 0, 0, 0], &stop).unwrap()
                        })
                        .collect()
                };
                *slot = Some([keep(&parts[0]), keep(&parts[1])]);
            }
        }
        Ok(trimmed)
    }
}

#[test]
fn kv4_and_kv8_pools_equal_a_contiguous_quantized_reference_exactly() {
    let mut r = rng("kv4_and_kv8_pools_equal_a_contiguous_quantized_reference_exactly");
    for (bits, group_size) in [(4, 64), (8, 64), (4, 32), (8, 32)] {
        let format = KvFormat::Quantized { bits, group_size };
        let mut paged = PagedKvCache::new(2, config(5, format)).unwrap();
        let mut reference = QuantizedReference {
            spec: QuantSpec::new(group_size, bits).unwrap(),
            layers: vec![None, None],
        };
        append_and_compare(&mut r, &mut paged, &mut reference, 8, Dtype::F32);
    }
    // A group that does not divide head_dim is refused when the pool is made.
    let mut bad = PagedKvCache::new(
        1,
        config(
            4,
            KvFormat::Quantized {
                bits: 4,
                group_size: 128,
            },
        ),
    )
    .unwrap();
    let k = kv(&mut r, 3, Dtype::F32);
    assert!(matches!(
        bad.update_and_fetch(0, &k, &k),
        Err(CacheError::Config(_))
    ));
}

#[test]
fn clones_are_independent_after_appends_on_either_side() {
    let mut r = rng("clones_are_independent_after_appends_on_either_side");
    let mut a = PagedKvCache::new(2, config(4, KvFormat::Float)).unwrap();
    let mut ra = ContiguousKvCache::new(2);
    append_and_compare(&mut r, &mut a, &mut ra, 3, Dtype::F32);
    let mut b = a.clone();
    let mut rb = ra.clone();
    let before: Vec<u8> = bytes(&a.fetch(0).unwrap().unwrap().0);
    append_and_compare(&mut r, &mut b, &mut rb, 4, Dtype::F32);
    assert_eq!(
        bytes(&a.fetch(0).unwrap().unwrap().0),
        before,
        "appending to the clone changed the original"
    );
    let b_now = bytes(&b.fetch(1).unwrap().unwrap().1);
    append_and_compare(&mut r, &mut a, &mut ra, 4, Dtype::F32);
    assert_eq!(
        bytes(&b.fetch(1).unwrap().unwrap().1),
        b_now,
        "appending to the original changed the clone"
    );
}

#[test]
fn trim_then_append_equals_a_fresh_cache_and_exhaustion_is_typed() {
    let mut r = rng("trim_then_append_equals_a_fresh_cache_and_exhaustion_is_typed");
    let mut cfg = config(4, KvFormat::Float);
    cfg.max_blocks = 6;
    let mut paged = PagedKvCache::new(1, cfg).unwrap();
    let keep = kv(&mut r, 10, Dtype::F32);
    let junk = kv(&mut r, 9, Dtype::F32);
    paged.update_and_fetch(0, &keep, &keep).unwrap();
    paged.update_and_fetch(0, &junk, &junk).unwrap();
    assert_eq!(paged.trim(9).unwrap(), 9);
    assert_eq!(paged.offset(), 10);
    assert_eq!(paged.block_table(0).len(), 3, "tail blocks were not freed");
    let tail = kv(&mut r, 5, Dtype::F32);
    let (got, _) = paged.update_and_fetch(0, &tail, &tail).unwrap();
    let mut fresh = ContiguousKvCache::new(1);
    fresh.update_and_fetch(0, &keep, &keep).unwrap();
    let (want, _) = fresh.update_and_fetch(0, &tail, &tail).unwrap();
    assert_eq!(bytes(&got), bytes(&want));

    // 15 tokens use 4 of 6 blocks; 12 more need 3: refused as a whole, nothing changes.
    let more = kv(&mut r, 12, Dtype::F32);
    match paged.update_and_fetch(0, &more, &more) {
        Err(CacheError::PoolExhausted {
            capacity: 6,
            max_blocks: 6,
            block_size: 4,
        }) => {}
        other => panic!("expected PoolExhausted, got {other:?}"),
    }
    assert_eq!(paged.offset(), 15);
    assert_eq!(bytes(&paged.fetch(0).unwrap().unwrap().0), bytes(&want));
    // What fits still fits.
    let fits = kv(&mut r, 9, Dtype::F32);
    paged.update_and_fetch(0, &fits, &fits).unwrap();
    assert_eq!(paged.offset(), 24);
}

fn namespace(
    layers: usize,
    block_size: usize,
    format: KvFormat,
    dtype: Dtype,
) -> NamespaceDescription {
    let mut desc = NamespaceDescription::new("cache-parity", store_dtype(dtype), block_size as u32);
    desc.layers = (0..layers).map(|_| "global".to_string()).collect();
    let shape = BlockShape {
        kv_heads: H,
        block_size,
        head_dim: D,
        dtype,
    };
    desc.planes = plane_specs(layers, shape, format).unwrap();
    if let KvFormat::Quantized { bits, group_size } = format {
        desc.kv_quantization = Some(store::KvQuantization {
            bits: bits as u32,
            group_size: group_size as u32,
        });
    }
    desc
}

fn store_dtype(d: Dtype) -> store::Dtype {
    match d {
        Dtype::F32 => store::Dtype::F32,
        Dtype::F16 => store::Dtype::F16,
        _ => store::Dtype::BF16,
    }
}

#[test]
fn publish_to_disk_restore_and_continue_equals_never_published() {
    let mut r = rng("publish_to_disk_restore_and_continue_equals_never_published");
    for (format, dtype) in [
        (KvFormat::Float, Dtype::F32),
        (KvFormat::Float, Dtype::BF16),
        (KvFormat::KV8, Dtype::F32),
        (KvFormat::KV4, Dtype::F16),
    ] {
        let (layers, bs) = (3, 8);
        let dir = tempfile::tempdir().unwrap();
        let desc = namespace(layers, bs, format, dtype);
        let tokens: Vec<u32> = (0..45).map(|_| r.gen_range(0..50_000)).collect();
        let chunks: Vec<(usize, Vec<(Array, Array)>)> = [20usize, 1, 17, 7]
            .iter()
            .map(|&n| {
                (
                    n,
                    (0..layers)
                        .map(|_| (kv(&mut r, n, dtype), kv(&mut r, n, dtype)))
                        .collect(),
                )
            })
            .collect();
        let continuation: Vec<(Array, Array)> = (0..layers)
            .map(|_| (kv(&mut r, 11, dtype), kv(&mut r, 11, dtype)))
            .collect();

        // Never published: one cache sees everything.
        let mut plain = PagedKvCache::new(layers, config(bs, format)).unwrap();
        for (_, per_layer) in &chunks {
            for (l, (k, v)) in per_layer.iter().enumerate() {
                plain.update_and_fetch(l, k, v).unwrap();
            }
        }

        // Published: the same appends, publishing after each step, into a real store.
        let ns;
        {
            let store: Store = Store::open(
                StoreConfig::default()
                    .root(dir.path())
                    .ram_budget(64 << 20)
                    .ssd_budget(256 << 20),
            )
            .unwrap();
            ns = store.register_namespace(&desc).unwrap();
            let mut chain = Chain::new(ns, bs);
            let mut live = PagedKvCache::new(layers, config(bs, format)).unwrap();
            let mut held = 0;
            let mut published = Vec::new();
            for (n, per_layer) in &chunks {
                for (l, (k, v)) in per_layer.iter().enumerate() {
                    live.update_and_fetch(l, k, v).unwrap();
                }
                held += n;
                for b in live.publish(&mut chain, &tokens[..held]).unwrap() {
                    let b = Arc::new(b);
                    published.push(b.clone());
                    store.insert(b).unwrap();
                }
            }
            assert_eq!(published.len(), 45 / bs);
            assert_eq!(chain.keys(), chain_keys(ns, &tokens, bs).as_slice());
            // Published blocks are host bytes: trimming and overwriting the live cache
            // leaves them as they were.
            let snapshot: Vec<Vec<u8>> = published
                .iter()
                .map(|b| b.planes[0].data.to_vec())
                .collect();
            live.trim(40).unwrap();
            let junk = kv(&mut r, 30, dtype);
            for l in 0..layers {
                live.update_and_fetch(l, &junk, &junk).unwrap();
            }
            let after: Vec<Vec<u8>> = published
                .iter()
                .map(|b| b.planes[0].data.to_vec())
                .collect();
            assert_eq!(
                snapshot, after,
                "a published block changed after trim + append"
            );
            store.flush().unwrap();
        }

        // A new process: empty RAM tier, blocks come from SSD and are verified.
        let store: Store = Store::open(
            StoreConfig::default()
                .root(dir.path())
                .ram_budget(64 << 20)
                .ssd_budget(256 << 20),
        )
        .unwrap();
        assert_eq!(store.register_namespace(&desc).unwrap(), ns);
        let keys = chain_keys(ns, &tokens, bs);
        let per_block: Vec<&[u32]> = tokens.chunks(bs).take(keys.len()).collect();
        let loaded = store.load_prefix(ns, &keys, &per_block);
        assert_eq!(loaded.blocks.len(), 5, "stopped: {:?}", loaded.stopped);
        assert!(loaded.blocks.iter().all(|(_, t)| *t == Tier::Ssd));
        let blocks: Vec<Arc<Block>> = loaded.blocks.into_iter().map(|(b, _)| b).collect();
        let restored = PagedKvCache::restore(layers, config(bs, format), &blocks).unwrap();
        assert_eq!(restored.blocks, 5);
        assert!(restored.stopped.is_none());
        let mut cache = restored.cache;
        assert_eq!(cache.offset(), 40);
        assert_eq!(cache.published_blocks(), 5);

        // Continue both: the restored cache is missing tokens 40..45 (the private tail).
        let tail_start = 40;
        let mut plain_tail = plain.clone();
        plain_tail.trim(45 - tail_start).unwrap();
        for (l, (k, v)) in continuation.iter().enumerate() {
            let (pk, pv) = plain_tail.update_and_fetch(l, k, v).unwrap();
            let (ck, cv) = cache.update_and_fetch(l, k, v).unwrap();
            assert_eq!(
                bytes(&pk),
                bytes(&ck),
                "{format:?} {dtype}: keys differ after restore, layer {l}"
            );
            assert_eq!(
                bytes(&pv),
                bytes(&cv),
                "{format:?} {dtype}: values differ after restore, layer {l}"
            );
        }
    }
}

#[test]
fn restore_stops_at_the_first_block_that_does_not_fit() {
    let mut r = rng("restore_stops_at_the_first_block_that_does_not_fit");
    let (layers, bs) = (2, 4);
    let ns = namespace(layers, bs, KvFormat::Float, Dtype::F32).id();
    let tokens: Vec<u32> = (0..16).collect();
    let mut a = PagedKvCache::new(layers, config(bs, KvFormat::Float)).unwrap();
    let mut b = PagedKvCache::new(layers, config(bs, KvFormat::Float)).unwrap();
    for l in 0..layers {
        let k = kv(&mut r, 16, Dtype::F32);
        a.update_and_fetch(l, &k, &k).unwrap();
        b.update_and_fetch(l, &k, &k).unwrap();
    }
    let good = a.publish(&mut Chain::new(ns, bs), &tokens).unwrap();
    let other_tokens: Vec<u32> = (100..116).collect();
    let foreign = b.publish(&mut Chain::new(ns, bs), &other_tokens).unwrap();
    // Block 2 from another chain: its parent is not block 1.
    let mixed = vec![
        good[0].clone(),
        good[1].clone(),
        foreign[2].clone(),
        good[3].clone(),
    ];
    let restored = PagedKvCache::restore(layers, config(bs, KvFormat::Float), &mixed).unwrap();
    assert_eq!(restored.blocks, 2);
    assert!(matches!(
        restored.stopped,
        Some(CacheError::Restore { position: 2, .. })
    ));
    assert_eq!(restored.cache.offset(), 8);
    // A model with another layer count restores nothing.
    let restored = PagedKvCache::restore(layers + 1, config(bs, KvFormat::Float), &good).unwrap();
    assert_eq!(restored.blocks, 0);
    assert_eq!(restored.cache.offset(), 0);
    // Host planes hold exactly the cache's keys: block 1 of layer 1's values is tokens
    // 4..8 of what was appended, per head.
    let (_, v) = a.fetch(1).unwrap().unwrap();
    let v = v.slice(&[0, 0, 4, 0], &[1, H as i32, 8, D as i32]).unwrap();
    assert_eq!(good[1].planes[3].data.to_vec(), bytes(&v));
}

#[test]
fn rows_merge_filter_extract_equal_per_row_caches_and_masks_match_naive() {
    let mut r = rng("rows_merge_filter_extract_equal_per_row_caches_and_masks_match_naive");
    let layers = 2;
    let lens = [5usize, 13, 1, 9];
    let mut singles = Vec::new();
    let mut refs = Vec::new();
    for &n in &lens {
        let mut p = PagedKvCache::new(layers, config(4, KvFormat::Float)).unwrap();
        let mut c = ContiguousKvCache::new(layers);
        for l in 0..layers {
            let (k, v) = (kv(&mut r, n, Dtype::F32), kv(&mut r, n, Dtype::F32));
            p.update_and_fetch(l, &k, &v).unwrap();
            c.update_and_fetch(l, &k, &v).unwrap();
        }
        singles.push(p);
        refs.push(c);
    }
    // Two batches merged: rows 0,1 and 2,3.
    let mut batch = PagedKvRows::from_rows(singles[..2].to_vec()).unwrap();
    batch
        .merge(PagedKvRows::from_rows(singles[2..].to_vec()).unwrap())
        .unwrap();
    assert_eq!(
        batch.offsets().unwrap().to_vec::<i32>().unwrap(),
        vec![5, 13, 1, 9]
    );

    for step in 0..3 {
        for l in 0..layers {
            let b = batch.len();
            let ks: Vec<Array> = (0..b).map(|_| kv(&mut r, 1, Dtype::F32)).collect();
            let vs: Vec<Array> = (0..b).map(|_| kv(&mut r, 1, Dtype::F32)).collect();
            let kb = mlx::ops::concatenate(&ks.iter().collect::<Vec<_>>(), 0).unwrap();
            let vb = mlx::ops::concatenate(&vs.iter().collect::<Vec<_>>(), 0).unwrap();
            let (gk, gv) = batch.update_and_fetch(l, &kb, &vb).unwrap();
            let pads = batch.padding(l);
            let t = gk.shape()[2] as usize;
            let gk_host: Vec<f32> = gk.to_vec().unwrap();
            let gv_host: Vec<f32> = gv.to_vec().unwrap();
            for (i, reference) in refs.iter_mut().enumerate() {
                let (rk, rv) = reference.update_and_fetch(l, &ks[i], &vs[i]).unwrap();
                let (rk, rv): (Vec<f32>, Vec<f32>) = (rk.to_vec().unwrap(), rv.to_vec().unwrap());
                let len = t - pads[i];
                for h in 0..H {
                    for j in 0..t {
                        for d in 0..D {
                            let got = (
                                gk_host[((i * H + h) * t + j) * D + d],
                                gv_host[((i * H + h) * t + j) * D + d],
                            );
                            let want = if j < pads[i] {
                                (0.0, 0.0)
                            } else {
                                let jj = j - pads[i];
                                (rk[(h * len + jj) * D + d], rv[(h * len + jj) * D + d])
                            };
                            assert_eq!(got, want, "step {step} layer {l} row {i} head {h} key {j}");
                        }
                    }
                }
            }
            // Decode mask: padding hidden, causal, window of 6 when windowed.
            for window in [None, Some(6)] {
                let mask: Vec<u8> = batch.decode_mask(l, 1, window).unwrap().to_bytes().unwrap();
                for (i, &pad) in pads.iter().enumerate() {
                    let len = t - pad;
                    for j in 0..t {
                        let want = j >= pad && window.is_none_or(|w| (j - pad) + w > len - 1);
                        assert_eq!(
                            mask[i * t + j] == 1,
                            want,
                            "row {i} key {j} window {window:?}"
                        );
                    }
                }
            }
        }
    }
    // Filter keeps rows 3 and 1 in that order; extract gives an independent copy.
    let removed = batch.filter(&[3, 1]).unwrap();
    assert_eq!(removed.len(), 2);
    assert_eq!(
        batch.offsets().unwrap().to_vec::<i32>().unwrap(),
        vec![12, 16]
    );
    let row = batch.extract(0).unwrap();
    let (want, _) = refs[3]
        .update_and_fetch(0, &kv(&mut r, 0, Dtype::F32), &kv(&mut r, 0, Dtype::F32))
        .unwrap();
    assert_eq!(bytes(&row.fetch(0).unwrap().unwrap().0), bytes(&want));
    assert!(batch.filter(&[5]).is_err());
}

#[test]
fn step_masks_match_a_naive_reference() {
    for (offset, queries, window) in [
        (0, 1, None),
        (0, 5, None),
        (7, 3, None),
        (0, 9, Some(4)),
        (10, 3, Some(4)),
        (2, 1, Some(2)),
        (3, 2, Some(16)),
    ] {
        let mask = attention_mask(offset, queries, window).unwrap();
        let keys = offset + queries;
        let naive =
            |i: usize, k: usize| k <= offset + i && window.is_none_or(|w| k + w > offset + i);
        match mask {
            Mask::None => {
                for i in 0..queries {
                    for k in 0..keys {
                        assert!(
                            naive(i, k),
                            "None mask hides ({i},{k}) for {offset}/{queries}/{window:?}"
                        );
                    }
                }
            }
            Mask::Causal => {
                for i in 0..queries {
                    for k in 0..keys {
                        assert_eq!(
                            naive(i, k),
                            k <= offset + i,
                            "({i},{k}) for {offset}/{queries}/{window:?}"
                        );
                    }
                }
            }
            Mask::Array(a) => {
                assert_eq!(a.shape(), vec![queries as i32, keys as i32]);
                let m: Vec<u8> = a.to_bytes().unwrap();
                for i in 0..queries {
                    for k in 0..keys {
                        assert_eq!(
                            m[i * keys + k] == 1,
                            naive(i, k),
                            "({i},{k}) for {offset}/{queries}/{window:?}"
                        );
                    }
                }
            }
        }
    }
    assert!(attention_mask(3, 1, Some(0)).is_err());
}

#[test]
fn pool_reads_any_block_table_and_hands_out_blocks_lifo() {
    use cache::BlockPool;
    let mut r = rng("pool_reads_any_block_table_and_hands_out_blocks_lifo");
    let shape = BlockShape {
        kv_heads: H,
        block_size: 4,
        head_dim: D,
        dtype: Dtype::F32,
    };
    let mut pool = BlockPool::new(shape, KvFormat::Float, 2, 5).unwrap();
    let ids: Vec<u32> = (0..3).map(|_| pool.alloc().unwrap()).collect();
    assert_eq!(
        ids,
        vec![0, 1, 2],
        "a fresh pool hands out the lowest ids first"
    );
    assert_eq!(pool.capacity(), 3, "grown ×1.5 from 2");
    pool.free(1);
    assert_eq!(
        pool.alloc().unwrap(),
        1,
        "the last freed block comes back first"
    );
    // Fill blocks 2, 0, 1 with known tokens, then read them in that order, not a run.
    let chunks: Vec<Array> = (0..3).map(|_| kv(&mut r, 4, Dtype::F32)).collect();
    for (chunk, block) in chunks.iter().zip([2u32, 0, 1]) {
        pool.write(
            block,
            0,
            std::slice::from_ref(chunk),
            std::slice::from_ref(chunk),
        )
        .unwrap();
    }
    let got = pool.read(&[2, 0, 1], 10).unwrap();
    let want = mlx::ops::concatenate(&chunks.iter().collect::<Vec<_>>(), 2).unwrap();
    let want = want
        .slice(&[0, 0, 0, 0], &[1, H as i32, 10, D as i32])
        .unwrap();
    assert_eq!(bytes(&got[0]), bytes(&want));
    assert_eq!(bytes(&got[1]), bytes(&want));
    // A copied block is independent of later writes.
    let copy = pool.copy_block(0).unwrap();
    let before = bytes(&copy[0]);
    let other = kv(&mut r, 4, Dtype::F32);
    pool.write(
        0,
        0,
        std::slice::from_ref(&other),
        std::slice::from_ref(&other),
    )
    .unwrap();
    assert_eq!(bytes(&copy[0]), before);
    // Growth stops at the maximum with the typed error.
    assert_eq!(pool.alloc().unwrap(), 3);
    assert_eq!(pool.alloc().unwrap(), 4);
    assert!(matches!(
        pool.alloc(),
        Err(CacheError::PoolExhausted {
            capacity: 5,
            max_blocks: 5,
            ..
        })
    ));
}

/// Past 4,096 tokens every capacity the growth ladder reaches (after the initial one) is a
/// whole number of 256-token steps, what MLX's CUDA attention needs to decode through cuDNN,
/// for any block size; the ladder still grows at least ×1.5 a step and stops at the maximum.
#[test]
fn pool_capacities_past_one_cudnn_step_are_whole_steps() {
    use cache::{ladder_capacity, CUDNN_ARENA_FROM, CUDNN_KV_STEP};
    for bs in [1, 4, 16, 24, 32, 48, 100, 256, 512] {
        for initial in [1, 2, 8, 11] {
            let max = 100_000 / bs + 7;
            let mut last = 0;
            for blocks in 1..(60_000 / bs) {
                let c = ladder_capacity(initial, max, bs, blocks);
                assert!(c >= blocks && c <= max.max(blocks), "{c} for {blocks}");
                assert!(c >= last, "the ladder never shrinks");
                if c != last && last != 0 {
                    assert!(2 * c >= 3 * last, "{last} -> {c} grows ×1.5 at least");
                }
                let tokens = c * bs;
                if c > initial && tokens > CUDNN_ARENA_FROM && c < max {
                    assert_eq!(
                        tokens % CUDNN_KV_STEP,
                        0,
                        "{c} blocks of {bs} (initial {initial})"
                    );
                }
                last = c;
            }
        }
    }
}

/// A run of blocks is read through a view of the arena, except one that starts past the
/// first token of a 16-bit arena whose length is a whole number of 256-token steps: MLX's
/// cuDNN decode would read such a view from its buffer's start, so it is gathered. The
/// bytes are the same either way.
#[test]
fn pool_reads_gather_an_offset_run_that_cudnn_would_misread() {
    use cache::BlockPool;
    let mut r = rng("pool_reads_gather_an_offset_run_that_cudnn_would_misread");
    let inside = |a: &Array, arena: &Array| {
        let (p, base) = (a.data_addr().unwrap(), arena.data_addr().unwrap());
        p >= base && p < base + arena.nbytes()
    };
    // 16 blocks of 16 tokens: one 256-token step.
    for (dtype, gathered) in [(Dtype::BF16, true), (Dtype::F16, true), (Dtype::F32, false)] {
        let shape = BlockShape {
            kv_heads: H,
            block_size: 16,
            head_dim: D,
            dtype,
        };
        let mut pool = BlockPool::new(shape, KvFormat::Float, 16, 16).unwrap();
        let chunks: Vec<Array> = (0..3).map(|_| kv(&mut r, 16, dtype)).collect();
        for (block, chunk) in chunks.iter().enumerate() {
            let c = std::slice::from_ref(chunk);
            pool.write(block as u32, 0, c, c).unwrap();
        }
        let from_one = pool.read(&[1, 2], 20).unwrap();
        let from_zero = pool.read(&[0, 1, 2], 40).unwrap();
        mlx::eval(&[&from_one[0], &from_zero[0], &pool.arrays()[0]]).unwrap();
        let want = mlx::ops::concatenate(&[&chunks[1], &chunks[2]], 2)
            .unwrap()
            .slice(&[0, 0, 0, 0], &[1, H as i32, 20, D as i32])
            .unwrap();
        assert_eq!(bytes(&from_one[0]), bytes(&want), "{dtype}");
        assert_eq!(bytes(&from_one[1]), bytes(&want), "{dtype}");
        let arena = &pool.arrays()[0];
        assert_eq!(
            !inside(&from_one[0], arena),
            gathered,
            "{dtype}: a run from block 1"
        );
        assert!(
            inside(&from_zero[0], arena),
            "{dtype}: a run from block 0 is a view"
        );
    }
}

/// The two halves of a publication: device copies taken on this thread, read back to host
/// bytes on another after the live cache was trimmed and overwritten in place. The blocks are
/// those of a synchronous publish of the cache as it was, for every KV format.
#[test]
fn an_export_finished_on_another_thread_holds_the_cache_as_it_was() {
    let mut r = rng("an_export_finished_on_another_thread_holds_the_cache_as_it_was");
    for (format, dtype) in [
        (KvFormat::Float, Dtype::F32),
        (KvFormat::Float, Dtype::BF16),
        (KvFormat::KV4, Dtype::F16),
    ] {
        let (layers, bs) = (3, 8);
        let tokens: Vec<u32> = (0..43).map(|_| r.gen_range(0..50_000)).collect();
        let mut live = PagedKvCache::new(layers, config(bs, format)).unwrap();
        for l in 0..layers {
            live.update_and_fetch(l, &kv(&mut r, 43, dtype), &kv(&mut r, 43, dtype))
                .unwrap();
        }
        let ns = store::NamespaceId([3; 32]);
        let reference = live
            .clone()
            .publish(&mut Chain::new(ns, bs), &tokens)
            .unwrap();
        assert_eq!(reference.len(), 5);

        let mut chain = Chain::new(ns, bs);
        let export = live.export(&mut chain, &tokens).unwrap().unwrap();
        assert_eq!(export.blocks(), 5);
        assert!(export.device_bytes() > 0);
        // Nothing new to export a second time.
        assert!(live.export(&mut chain, &tokens).unwrap().is_none());
        // Overwrite every block but the first in place before the export is read.
        live.trim(bs).unwrap();
        for l in 0..layers {
            let (k, v) = (kv(&mut r, 35, dtype), kv(&mut r, 35, dtype));
            live.update_and_fetch(l, &k, &v).unwrap();
        }
        for l in 0..layers {
            let arrays: Vec<&Array> = live.pool(l).unwrap().arrays().iter().collect();
            mlx::eval(&arrays).unwrap();
        }
        let blocks = std::thread::spawn(move || export.into_blocks().unwrap())
            .join()
            .unwrap();
        assert_eq!(blocks.len(), reference.len());
        for (got, want) in blocks.iter().zip(&reference) {
            assert_eq!(
                (got.meta.key, got.meta.position, &got.meta.tokens),
                (want.meta.key, want.meta.position, &want.meta.tokens),
                "{format:?}"
            );
            assert_eq!(got.planes, want.planes, "{format:?}");
        }
    }
}

/// Every pool's capacity is a step of one growth ladder, fresh or restored, so arenas holding
/// the same tokens have the same strides (MLX's CUDA attention caches a cuDNN graph per shape
/// and strides).
#[test]
fn restored_pools_have_the_capacity_of_grown_ones() {
    let mut r = rng("restored_pools_have_the_capacity_of_grown_ones");
    let (layers, bs) = (2, 4);
    let cfg = PagedConfig {
        initial_blocks: 3,
        ..config(bs, KvFormat::Float)
    };
    for tokens in [4usize, 12, 13, 40, 77] {
        let ids: Vec<u32> = (0..tokens as u32).collect();
        let mut grown = PagedKvCache::new(layers, cfg).unwrap();
        for l in 0..layers {
            grown
                .update_and_fetch(
                    l,
                    &kv(&mut r, tokens, Dtype::F32),
                    &kv(&mut r, tokens, Dtype::F32),
                )
                .unwrap();
        }
        let blocks = grown
            .clone()
            .publish(&mut Chain::new(store::NamespaceId([5; 32]), bs), &ids)
            .unwrap();
        let restored = PagedKvCache::restore(layers, cfg, &blocks).unwrap().cache;
        let full = tokens / bs;
        let want = cache::ladder_capacity(cfg.initial_blocks, cfg.max_blocks, cfg.block_size, full);
        assert_eq!(
            restored.pool(0).unwrap().capacity(),
            want,
            "{tokens} tokens"
        );
        // A pool grown block by block to the same blocks has that capacity too.
        let mut fresh = PagedKvCache::new(layers, cfg).unwrap();
        for l in 0..layers {
            for _ in 0..full * bs {
                fresh
                    .update_and_fetch(l, &kv(&mut r, 1, Dtype::F32), &kv(&mut r, 1, Dtype::F32))
                    .unwrap();
            }
        }
        if full > 0 {
            assert_eq!(fresh.pool(0).unwrap().capacity(), want, "{tokens} tokens");
        }
    }
}

/// Per layer, its pool's capacity and arena bytes.
type PoolBytes = Vec<(usize, Vec<Vec<u8>>)>;

/// Everything a restored cache holds that a later step reads: offset, published blocks,
/// and per layer the pool's capacity and arena bytes.
fn restored_state(r: &cache::Restored) -> (usize, usize, PoolBytes) {
    let c = &r.cache;
    let layers = (0..c.layers())
        .map(|l| match c.pool(l) {
            Some(p) => (p.capacity(), p.arrays().iter().map(bytes).collect()),
            None => (0, Vec::new()),
        })
        .collect();
    (c.offset(), c.published_blocks(), layers)
}

/// `ids` appended to a fresh cache of `layers` layers with random keys and values of
/// `dtype`, published in namespace `ns`.
fn publish_random(
    r: &mut StdRng,
    layers: usize,
    config: PagedConfig,
    dtype: Dtype,
    ns: store::NamespaceId,
    ids: &[u32],
) -> Vec<Arc<Block>> {
    let mut live = PagedKvCache::new(layers, config).unwrap();
    for l in 0..layers {
        let (k, v) = (kv(r, ids.len(), dtype), kv(r, ids.len(), dtype));
        live.update_and_fetch(l, &k, &v).unwrap();
    }
    let blocks = live
        .publish(&mut Chain::new(ns, config.block_size), ids)
        .unwrap();
    blocks.into_iter().map(Arc::new).collect()
}

/// `restore_streaming` fed `run` against `restore_onto` of the same blocks: the same
/// blocks, stop position and bytes.
fn assert_streamed_equals_batch(
    base: &PagedKvCache,
    run: &[Arc<Block>],
    expected: usize,
    what: &str,
) -> usize {
    let batch = base.clone().restore_onto(run).unwrap();
    let streamed = base
        .clone()
        .restore_streaming(expected, |push| run.iter().for_each(push))
        .unwrap();
    assert_same_restore(&streamed, &batch, what)
}

/// Two restores of the same blocks hold the same blocks, stop at the same position and
/// hold the same bytes; returns the blocks restored.
fn assert_same_restore(streamed: &cache::Restored, batch: &cache::Restored, what: &str) -> usize {
    assert_eq!(streamed.blocks, batch.blocks, "{what}");
    let position = |r: &cache::Restored| match r.stopped {
        Some(CacheError::Restore { position, .. }) => Some(position),
        ref other => {
            assert!(other.is_none(), "{what}: {other:?}");
            None
        }
    };
    assert_eq!(position(streamed), position(batch), "{what}");
    assert!(
        restored_state(streamed) == restored_state(batch),
        "{what}: the restored caches differ"
    );
    streamed.blocks
}

/// `stage_restore` of `run` against `staged_for` on another thread, installed into
/// `base` by `restore_staged`, against `restore_onto` of `base`: the same outcome, and
/// whether the staged run was installed (rather than restored the ordinary way).
fn staged_equals_batch(
    staged_for: &PagedKvCache,
    base: &PagedKvCache,
    run: &[Arc<Block>],
    what: &str,
) -> (usize, bool) {
    let batch = base.clone().restore_onto(run).unwrap();
    let (against, blocks) = (staged_for.clone(), run.to_vec());
    let staged = std::thread::spawn(move || against.stage_restore(&blocks).unwrap())
        .join()
        .unwrap()
        .expect("a cache without layer states stages");
    let installed = base.clone().restore_staged(staged, run).unwrap();
    (
        assert_same_restore(&installed, &batch, what),
        installed.staged,
    )
}

/// Where published blocks live in page-locked block memory (an engine on a GPU allows it),
/// the staged restore reads them where they lie, one gather node per layer part, and the
/// cache it installs equals the batch restore's; a mixed run (one block in ordinary
/// memory) assembles as before. On the CPU nothing is page-locked, so every run assembles:
/// the test checks that too, and says so.
#[test]
fn a_restore_from_page_locked_blocks_reads_them_in_place_and_equals_the_batch_restore() {
    let mut r = rng("a_restore_from_page_locked_blocks_reads_them_in_place");
    let (layers, bs, n) = (3, 16, 9);
    cache::allow_block_memory(256 << 20);
    let gpu = mlx::default_device().unwrap() != mlx::Device::Cpu
        && mlx::direct_transfers()
        && mlx::host_upload::upload_rows_on();
    if !gpu {
        eprintln!("CPU: no page-locked block memory; checking that every restore assembles");
    }
    for (format, dtype) in [
        (KvFormat::Float, Dtype::F32),
        (KvFormat::Float, Dtype::BF16),
        (KvFormat::KV4, Dtype::F32),
    ] {
        let ns = namespace(layers, bs, format, dtype).id();
        let good = publish_random(
            &mut r,
            layers,
            config(bs, format),
            dtype,
            ns,
            &(0..(n * bs) as u32).collect::<Vec<_>>(),
        );
        let fresh = PagedKvCache::new(layers, config(bs, format)).unwrap();
        let what = format!("{format:?} {dtype}");
        let staged = fresh
            .stage_restore(&good)
            .unwrap()
            .expect("a cache without layer states stages");
        assert_eq!(staged.reads_in_place(), gpu, "{what}");
        if gpu {
            assert!(
                cache::block_memory().in_use > 0,
                "{what}: the planes are page-locked"
            );
        }
        let installed = fresh.clone().restore_staged(staged, &good).unwrap();
        let batch = fresh.clone().restore_onto(&good).unwrap();
        assert!(installed.staged, "{what}");
        assert_eq!(assert_same_restore(&installed, &batch, &what), n);
        // One block copied into ordinary memory: the run assembles, with the same outcome.
        let mut mixed = good.clone();
        let mut copy = (*mixed[4]).clone();
        for p in &mut copy.planes {
            p.data = bytes::Bytes::from(p.data.to_vec());
        }
        mixed[4] = Arc::new(copy);
        let staged = fresh.stage_restore(&mixed).unwrap().expect("stages");
        assert!(
            !staged.reads_in_place(),
            "{what}: a block in ordinary memory"
        );
        let installed = fresh.clone().restore_staged(staged, &mixed).unwrap();
        assert_eq!(
            assert_same_restore(&installed, &batch, &format!("{what} mixed")),
            n
        );
    }
}

#[test]
fn a_restore_staged_on_another_thread_equals_the_batch_restore() {
    let mut r = rng("a_restore_staged_on_another_thread_equals_the_batch_restore");
    let (layers, bs, n) = (3, 4, 9);
    for (format, dtype) in [
        (KvFormat::Float, Dtype::F32),
        (KvFormat::Float, Dtype::BF16),
        (KvFormat::KV4, Dtype::F32),
    ] {
        let ns = namespace(layers, bs, format, dtype).id();
        let mut publish =
            |ids: &[u32]| publish_random(&mut r, layers, config(bs, format), dtype, ns, ids);
        let good = publish(&(0..(n * bs) as u32).collect::<Vec<_>>());
        let foreign = publish(&(500..500 + (n * bs) as u32).collect::<Vec<_>>());
        let fresh = PagedKvCache::new(layers, config(bs, format)).unwrap();
        let what = |case: &str| format!("{format:?} {dtype}: {case}");
        assert_eq!(
            staged_equals_batch(&fresh, &fresh, &good, &what("all")),
            (n, true)
        );
        let mut mixed = good.clone();
        mixed[5] = foreign[5].clone();
        assert_eq!(
            staged_equals_batch(&fresh, &fresh, &mixed, &what("foreign block 5")),
            (5, true)
        );
        for fed in [1, 0] {
            let case = what(&format!("{fed} blocks"));
            assert_eq!(
                staged_equals_batch(&fresh, &fresh, &good[..fed], &case),
                (fed, true)
            );
        }
        // Appended to a cache that holds blocks, staged against it.
        let started = fresh.clone().restore_onto(&good[..3]).unwrap().cache;
        assert_eq!(
            staged_equals_batch(&started, &started, &good[3..], &what("onto 3")),
            (6, true)
        );
        // Staged for the model's cache after a device hit of 3 blocks (pools of its own on
        // every layer, as a hand-over or fork leaves them), installed into one: the same
        // as appending to it; into a cache of another length, the ordinary way.
        let after = |hit: usize| {
            let (empty, blocks) = (fresh.clone(), good[hit..].to_vec());
            std::thread::spawn(move || empty.stage_restore_after(hit * bs, &blocks).unwrap())
                .join()
                .unwrap()
                .unwrap()
        };
        let installed = started
            .clone()
            .restore_staged(after(3), &good[3..])
            .unwrap();
        let batch = started.clone().restore_onto(&good[3..]).unwrap();
        assert!(installed.staged, "{}", what("after a hit of 3"));
        assert_eq!(assert_same_restore(&installed, &batch, &what("after 3")), 6);
        let two = fresh.clone().restore_onto(&good[..2]).unwrap().cache;
        let other = two.clone().restore_staged(after(3), &good[2..]).unwrap();
        assert!(!other.staged, "{}", what("a hit of 2, staged after 3"));
        let batch = two.restore_onto(&good[2..]).unwrap();
        assert_eq!(assert_same_restore(&other, &batch, &what("2 for 3")), 7);
        // Staged for an empty cache, installed into one that took arenas meanwhile (a
        // device-tier hit cut back to no token): restored the ordinary way.
        let mut handed = started.clone();
        handed.trim(3 * bs).unwrap();
        assert_eq!(handed.offset(), 0);
        assert_eq!(
            staged_equals_batch(&fresh, &handed, &good, &what("arenas meanwhile")),
            (n, false)
        );
        // Staged for the wrong model (another layer count): nothing, either way.
        let wider = PagedKvCache::new(layers + 1, config(bs, format)).unwrap();
        assert_eq!(
            staged_equals_batch(&wider, &wider, &good, &what("layers")),
            (0, true)
        );
        assert_eq!(
            staged_equals_batch(&fresh, &wider, &good, &what("other")),
            (0, false)
        );
    }
    // A hybrid's layer states become arrays while checked: not staged.
    let hybrid = PagedKvCache::new(layers, config(bs, KvFormat::Float))
        .unwrap()
        .with_state_layers(1);
    let none: Vec<Arc<Block>> = Vec::new();
    assert!(hybrid.stage_restore(&none).unwrap().is_none());
}

#[test]
fn a_streamed_restore_equals_the_batch_restore() {
    let mut r = rng("a_streamed_restore_equals_the_batch_restore");
    let (layers, bs) = (3, 4);
    for (format, dtype) in [
        (KvFormat::Float, Dtype::F32),
        (KvFormat::Float, Dtype::BF16),
        (KvFormat::KV8, Dtype::F32),
    ] {
        let ns = namespace(layers, bs, format, dtype).id();
        let n = 9;
        let tokens: Vec<u32> = (0..(n * bs) as u32).collect();
        let other: Vec<u32> = (500..500 + (n * bs) as u32).collect();
        let mut publish =
            |ids: &[u32]| publish_random(&mut r, layers, config(bs, format), dtype, ns, ids);
        let good = publish(&tokens);
        let foreign = publish(&other);
        let fresh = PagedKvCache::new(layers, config(bs, format)).unwrap();
        let what = |case: &str| format!("{format:?} {dtype}: {case}");
        // Everything, as announced.
        assert_eq!(
            assert_streamed_equals_batch(&fresh, &good, n, &what("all")),
            n
        );
        // A block from another chain in the middle: the run stops there.
        let mut mixed = good.clone();
        mixed[5] = foreign[5].clone();
        let kept = assert_streamed_equals_batch(&fresh, &mixed, n, &what("foreign block 5"));
        assert_eq!(kept, 5);
        // Fewer blocks than announced (a load cut short), down to none: the arenas get the
        // capacity of the blocks that came.
        for fed in [8, 6, 3, 1, 0] {
            let case = what(&format!("{fed} of {n} fed"));
            assert_eq!(
                assert_streamed_equals_batch(&fresh, &good[..fed], n, &case),
                fed
            );
        }
        // More than announced.
        assert_eq!(
            assert_streamed_equals_batch(&fresh, &good, 4, &what("9 of 4")),
            n
        );
        // Onto a cache that already holds blocks: restored after them.
        let started = fresh.clone().restore_onto(&good[..3]).unwrap().cache;
        let rest = &good[3..];
        assert_eq!(
            assert_streamed_equals_batch(&started, rest, rest.len(), &what("onto 3")),
            6
        );
        // The wrong model (another layer count) restores nothing.
        let wider = PagedKvCache::new(layers + 1, config(bs, format)).unwrap();
        assert_eq!(
            assert_streamed_equals_batch(&wider, &good, n, &what("layers")),
            0
        );
    }
}

#[test]
fn a_streamed_restore_from_disk_keeps_the_blocks_before_a_corrupt_file() {
    let mut r = rng("a_streamed_restore_from_disk_keeps_the_blocks_before_a_corrupt_file");
    let (layers, bs, n) = (2, 8, 12);
    let desc = namespace(layers, bs, KvFormat::Float, Dtype::F32);
    let dir = tempfile::tempdir().unwrap();
    let open = || -> Store {
        Store::open(
            StoreConfig::default()
                .root(dir.path())
                .ram_budget(64 << 20)
                .ssd_budget(256 << 20),
        )
        .unwrap()
    };
    let tokens: Vec<u32> = (0..(n * bs) as u32).map(|t| t * 7 + 3).collect();
    let ns;
    let published = {
        let store = open();
        ns = store.register_namespace(&desc).unwrap();
        let mut live = PagedKvCache::new(layers, config(bs, KvFormat::Float)).unwrap();
        for l in 0..layers {
            let (k, v) = (
                kv(&mut r, n * bs, Dtype::F32),
                kv(&mut r, n * bs, Dtype::F32),
            );
            live.update_and_fetch(l, &k, &v).unwrap();
        }
        let blocks: Vec<Arc<Block>> = live
            .publish(&mut Chain::new(ns, bs), &tokens)
            .unwrap()
            .into_iter()
            .map(Arc::new)
            .collect();
        for b in &blocks {
            store.insert(b.clone()).unwrap();
        }
        store.flush().unwrap();
        blocks
    };
    // Flip a bit of block 7's file: it fails verification when read.
    let key = published[7].meta.key.to_string();
    let path = dir
        .path()
        .join(ns.to_string())
        .join(&key[..2])
        .join(format!("{key}.safetensors"));
    let mut file = std::fs::read(&path).unwrap();
    let last = file.len() - 1;
    file[last] ^= 1;
    std::fs::write(&path, &file).unwrap();

    let store = open();
    store.register_namespace(&desc).unwrap();
    let keys = chain_keys(ns, &tokens, bs);
    let per_block: Vec<&[u32]> = tokens.chunks(bs).collect();
    let mut loaded = None;
    let streamed = PagedKvCache::new(layers, config(bs, KvFormat::Float))
        .unwrap()
        .restore_streaming(keys.len(), |push| {
            loaded = Some(store.load_prefix_each(ns, &keys, &per_block, |_, b, _| push(b)));
        })
        .unwrap();
    let loaded = loaded.unwrap();
    assert_eq!(loaded.blocks.len(), 7, "{:?}", loaded.stopped);
    assert!(matches!(
        loaded.stopped,
        Some(store::StopReason::Invalid { index: 7, .. })
    ));
    assert_eq!(streamed.blocks, 7);
    assert!(streamed.stopped.is_none());
    // Bit for bit what the published blocks restore to.
    let batch =
        PagedKvCache::restore(layers, config(bs, KvFormat::Float), &published[..7]).unwrap();
    assert!(restored_state(&streamed) == restored_state(&batch));
    assert_eq!(streamed.cache.offset(), 7 * bs);
}
