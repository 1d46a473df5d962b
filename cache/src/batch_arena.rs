//! [`BatchArena`]: the keys and values of a decode batch as one `[B, H, T, D]` pair per
//! layer, rows right-aligned, so a batched decode step writes every row's new token with one
//! update and attends with one masked attention per layer, instead of one of each per row
//! (docs/cache.md, "Batched decode on a GPU").
//!
//! The rows' paged caches stay the home of their KV. An arena is built from them when a
//! batch starts decoding (one copy of each row's KV), and the tokens decoded since are
//! written back to them ([`BatchArena::sync`]) before a row is read, leaves or the batch
//! changes. So a step costs no copy of any row's KV, and a row's cache is exact whenever
//! anyone outside the batch sees it.

use mlx::{Array, Dtype};

use crate::{CacheError, KvCache, PagedKvCache};

/// Columns an arena grows by when full (and the headroom a new one starts with).
const GROW: usize = 256;

/// One layer's arena: keys and values `[B, H, cap, D]`; columns `start_b .. end` hold row
/// b's tokens, and `.. synced` of them are in the rows' paged caches too.
struct LayerArena {
    keys: Array,
    values: Array,
    end: usize,
    synced: usize,
}

/// The arenas of a decode batch (see the module docs).
pub(crate) struct BatchArena {
    layers: Vec<Option<LayerArena>>,
    /// Column of each row's first token, in every layer.
    starts: Vec<usize>,
    /// The column the rows ended at when the arena was built.
    built_end: usize,
    /// The current step's mask `[B, 1, 1, end]` (true = attend), for the `end` it was made for.
    mask: Option<(usize, Array)>,
}

impl BatchArena {
    /// An arena for `rows` when they can share one: float KV, no state layers, no windows,
    /// every attention layer as long as the row, and no more padding than real tokens
    /// (rows of very different lengths decode one by one instead). `None` otherwise.
    pub(crate) fn plan(rows: &[PagedKvCache]) -> Option<BatchArena> {
        let first = rows.first()?;
        let layers = first.layers();
        let eligible = rows.iter().all(|r| {
            r.config().format == crate::KvFormat::Float
                && r.state_layers() == 0
                && !r.has_windows()
                && r.layers() == layers
                && (0..layers).all(|l| r.layer_offset(l) == r.offset())
                && r.offset() > 0
        });
        if !eligible {
            return None;
        }
        let lens: Vec<usize> = rows.iter().map(|r| r.offset()).collect();
        let end = lens.iter().copied().max()?;
        let total: usize = lens.iter().sum();
        if rows.len() * end > 2 * total {
            return None;
        }
        Some(BatchArena {
            layers: (0..layers).map(|_| None).collect(),
            starts: lens.iter().map(|l| end - l).collect(),
            built_end: end,
            mask: None,
        })
    }

    /// Tokens each row holds here beyond its paged cache (the same for every row).
    pub(crate) fn unsynced(&self) -> usize {
        self.layers
            .iter()
            .flatten()
            .map(|a| a.end - a.synced)
            .max()
            .unwrap_or(0)
    }

    /// Appends every row's new key and value (`keys`, `values` `[B, H, 1, D]`) to `layer`
    /// and attends each row's query (`queries` `[B, Hq, 1, D]`) over its own tokens: one
    /// write and one masked attention for the whole batch. Returns `[B, Hq, 1, D]`.
    pub(crate) fn attend(
        &mut self,
        rows: &[PagedKvCache],
        layer: usize,
        queries: &Array,
        keys: &Array,
        values: &Array,
        scale: f32,
    ) -> Result<Array, CacheError> {
        let b = rows.len() as i32;
        let slot = self.layers.get_mut(layer).ok_or(CacheError::NoSuchLayer {
            layer,
            layers: rows.first().map_or(0, |r| r.layers()),
        })?;
        let mut a = match slot.take() {
            Some(a) => a,
            None => build(rows, layer, &self.starts, self.built_end)?,
        };
        let s = keys.shape();
        let (h, d) = (s[1], s[3]);
        let cap = a.keys.shape()[2] as usize;
        if a.end == cap {
            let grow = |x: Array| -> Result<Array, CacheError> {
                let zeros = mlx::ops::zeros(&[b, h, GROW as i32, x.shape()[3]], x.dtype())?;
                Ok(mlx::ops::concatenate(&[&x, &zeros], 2)?)
            };
            a.keys = grow(a.keys)?;
            a.values = grow(a.values)?;
        }
        let (e, vd) = (a.end as i32, values.shape()[3]);
        a.keys = a
            .keys
            .slice_update(keys, &[0, 0, e, 0], &[b, h, e + 1, d])?;
        a.values = a
            .values
            .slice_update(values, &[0, 0, e, 0], &[b, h, e + 1, vd])?;
        a.end += 1;
        let end = a.end as i32;
        let k = a.keys.slice(&[0, 0, 0, 0], &[b, h, end, d])?;
        let v = a.values.slice(&[0, 0, 0, 0], &[b, h, end, vd])?;
        let end = a.end;
        *slot = Some(a);
        let mask = self.mask_for(end)?;
        masked_attention(queries, &k, &v, &mask, scale)
    }

    /// The mask `[B, 1, 1, end]` of a step whose rows end at column `end`: made once per
    /// step, shared by its layers.
    fn mask_for(&mut self, end: usize) -> Result<Array, CacheError> {
        if let Some((e, m)) = &self.mask {
            if *e == end {
                return Ok(m.clone());
            }
        }
        let starts: Vec<i32> = self.starts.iter().map(|&s| s as i32).collect();
        let starts = Array::from_slice(&starts, &[starts.len() as i32, 1, 1, 1])?;
        let cols = mlx::ops::arange(0.0, end as f64, 1.0, Dtype::I32)?;
        let m = cols.reshape(&[1, 1, 1, end as i32])?.ge(&starts)?;
        self.mask = Some((end, m.clone()));
        Ok(m)
    }

    /// Writes the tokens decoded since the last sync back to each row's paged cache.
    pub(crate) fn sync(&mut self, rows: &mut [PagedKvCache]) -> Result<(), CacheError> {
        for (layer, slot) in self.layers.iter_mut().enumerate() {
            let Some(a) = slot else { continue };
            if a.end == a.synced {
                continue;
            }
            let (ks, vs) = (a.keys.shape(), a.values.shape());
            let (from, to) = (a.synced as i32, a.end as i32);
            for (i, row) in rows.iter_mut().enumerate() {
                let i = i as i32;
                let k = a.keys.slice(&[i, 0, from, 0], &[i + 1, ks[1], to, ks[3]])?;
                let v = a
                    .values
                    .slice(&[i, 0, from, 0], &[i + 1, vs[1], to, vs[3]])?;
                row.append(layer, &k, &v)?;
            }
            a.synced = a.end;
        }
        Ok(())
    }
}

/// A layer's arena from the rows' paged caches: row b's tokens right-aligned to end at
/// `end`, zeros before them and `GROW` free columns after.
fn build(
    rows: &[PagedKvCache],
    layer: usize,
    starts: &[usize],
    end: usize,
) -> Result<LayerArena, CacheError> {
    let mut ks = Vec::with_capacity(rows.len());
    let mut vs = Vec::with_capacity(rows.len());
    for (row, &start) in rows.iter().zip(starts) {
        let (k, v) = row.fetch(layer)?.ok_or_else(|| {
            CacheError::Config(format!("layer {layer} of a decoding row holds nothing"))
        })?;
        let pad = |x: &Array| -> Result<Array, CacheError> {
            let s = x.shape();
            let before = mlx::ops::zeros(&[1, s[1], start as i32, s[3]], x.dtype())?;
            let after = mlx::ops::zeros(&[1, s[1], GROW as i32, s[3]], x.dtype())?;
            Ok(mlx::ops::concatenate(&[&before, x, &after], 2)?)
        };
        ks.push(pad(&k)?);
        vs.push(pad(&v)?);
    }
    let kr: Vec<&Array> = ks.iter().collect();
    let vr: Vec<&Array> = vs.iter().collect();
    Ok(LayerArena {
        keys: mlx::ops::concatenate(&kr, 0)?,
        values: mlx::ops::concatenate(&vr, 0)?,
        end,
        synced: end,
    })
}

/// `softmax(q kᵀ · scale, masked) v` for queries `[B, Hq, 1, D]` over keys and values
/// `[B, Hkv, T, D]` (grouped: Hq a multiple of Hkv), `mask` `[B, 1, 1, T]` true where a
/// row may attend. Written as matmuls rather than MLX's fused attention: with a mask array
/// MLX's CUDA backend leaves its decode kernel for cuDNN, which builds a graph for every new
/// key length, i.e. every step.
fn masked_attention(
    queries: &Array,
    keys: &Array,
    values: &Array,
    mask: &Array,
    scale: f32,
) -> Result<Array, CacheError> {
    let (qs, ks) = (queries.shape(), keys.shape());
    let (b, hq, d) = (qs[0], qs[1], qs[3]);
    let hkv = ks[1];
    if hkv == 0 || hq % hkv != 0 {
        return Err(CacheError::Shape(format!(
            "{hq} query heads over {hkv} key heads"
        )));
    }
    let rep = hq / hkv;
    let q = queries
        .mul_scalar(scale as f64)?
        .reshape(&[b, hkv, rep, d])?;
    let scores = q.matmul(&keys.transpose(&[0, 1, 3, 2])?)?;
    let neg = mlx::ops::full(&[1], f64::NEG_INFINITY, scores.dtype())?;
    let scores = mlx::ops::where_(mask, &scores, &neg)?;
    let p = scores.softmax(-1, true)?;
    let out = p.matmul(values)?;
    Ok(out.reshape(&[b, hq, 1, values.shape()[3]])?)
}
