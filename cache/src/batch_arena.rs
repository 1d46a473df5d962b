//! [`BatchArena`]: the keys and values of a decode batch as one `[B, H, T, D]` pair per
//! layer, rows right-aligned, so a batched decode step writes every row's new token with one
//! update and attends with one masked attention per layer, instead of one of each per row
//! (docs/cache.md, "Batched decode on a GPU").
//!
//! The rows' paged caches stay the home of their KV. An arena is built from them when a
//! batch starts decoding (one copy of each row's KV); a row that joins later is copied in
//! ([`BatchArena::join`]), one that leaves gets the tokens decoded since it was last written
//! back ([`BatchArena::retain`]), and [`BatchArena::sync`] writes back every row before a
//! row is read. So a step costs no copy of any row's KV, and a row's cache is exact
//! whenever anyone outside the batch sees it.

use mlx::{Array, Dtype};

use crate::{CacheError, KvCache, PagedKvCache};

/// Columns an arena grows by when full (and the headroom a new one starts with).
const GROW: usize = 256;

/// One layer's arena: keys and values `[B, H, cap, D]`; columns `start_b .. end` hold row
/// b's tokens.
struct LayerArena {
    keys: Array,
    values: Array,
    end: usize,
}

/// The arenas of a decode batch (see the module docs).
pub(crate) struct BatchArena {
    layers: Vec<Option<LayerArena>>,
    /// Column of each row's first token, in every layer.
    starts: Vec<usize>,
    /// Per row, the column up to which its paged cache holds its tokens too.
    synced: Vec<usize>,
    /// The column the rows ended at when the arena was built.
    built_end: usize,
    /// The current step's additive mask `[B, 1, 1, end]` (0 where a row attends, -inf
    /// elsewhere), for the `end` it was made for.
    mask: Option<(usize, Array)>,
}

impl BatchArena {
    /// An arena for `rows` when they can share one: float KV, no state layers, no windows,
    /// every attention layer as long as the row, and no more padding than real tokens
    /// (rows of very different lengths decode one by one instead). `None` otherwise.
    pub(crate) fn plan(rows: &[PagedKvCache]) -> Option<BatchArena> {
        let layers = rows.first()?.layers();
        if !rows.iter().all(|r| eligible(r, layers)) {
            return None;
        }
        let lens: Vec<usize> = rows.iter().map(|r| r.offset()).collect();
        let end = lens.iter().copied().max()?;
        if !padding_fits(rows.len(), end, lens.iter().sum()) {
            return None;
        }
        Some(BatchArena {
            layers: (0..layers).map(|_| None).collect(),
            starts: lens.iter().map(|l| end - l).collect(),
            synced: vec![end; rows.len()],
            built_end: end,
            mask: None,
        })
    }

    /// The column every row ends at (between steps, the same in every layer).
    fn end(&self) -> usize {
        self.layers
            .iter()
            .flatten()
            .map(|a| a.end)
            .max()
            .unwrap_or(self.built_end)
    }

    /// Tokens row `b` holds here beyond its paged cache.
    pub(crate) fn unsynced(&self, b: usize) -> usize {
        self.end() - self.synced.get(b).copied().unwrap_or(self.end())
    }

    /// Whether every layer has its arena (after the first step).
    fn built(&self) -> bool {
        self.layers.iter().all(Option::is_some)
    }

    /// Takes `row` in as the last row: its KV copied into every layer's arena, ending where
    /// the others end. `false` (nothing changed) when it cannot join: the arena is not
    /// built yet, the row is longer than the others or not eligible, or the batch would
    /// hold more padding than tokens; then the caller starts a new arena.
    pub(crate) fn join(&mut self, row: &PagedKvCache) -> Result<bool, CacheError> {
        let end = self.end();
        let len = row.offset();
        let lens: usize = self.starts.iter().map(|s| end - s).sum();
        let fits = self.built()
            && eligible(row, self.layers.len())
            && len <= end
            && padding_fits(self.starts.len() + 1, end, lens + len);
        if !fits {
            return Ok(false);
        }
        for (layer, slot) in self.layers.iter_mut().enumerate() {
            let Some(a) = slot else { return Ok(false) };
            let (k, v) = row.fetch(layer)?.ok_or_else(|| {
                CacheError::Config(format!("layer {layer} of a joining row holds nothing"))
            })?;
            let cap = a.keys.shape()[2] as usize;
            let slab = |x: &Array| -> Result<Array, CacheError> {
                let s = x.shape();
                let before = mlx::ops::zeros(&[1, s[1], (end - len) as i32, s[3]], x.dtype())?;
                let after = mlx::ops::zeros(&[1, s[1], (cap - end) as i32, s[3]], x.dtype())?;
                Ok(mlx::ops::concatenate(&[&before, x, &after], 2)?)
            };
            a.keys = mlx::ops::concatenate(&[&a.keys, &slab(&k)?], 0)?;
            a.values = mlx::ops::concatenate(&[&a.values, &slab(&v)?], 0)?;
        }
        self.starts.push(end - len);
        self.synced.push(end);
        self.mask = None;
        Ok(true)
    }

    /// Keeps the rows at `keep` (in that order): the others first get their tokens written
    /// back to their caches. `false` when the arena should go (no row left, not built, or
    /// the rows left would hold more padding than tokens; the kept rows are then not written
    /// back yet: [`BatchArena::sync`] does that).
    pub(crate) fn retain(
        &mut self,
        rows: &mut [PagedKvCache],
        keep: &[usize],
    ) -> Result<bool, CacheError> {
        let leaving: Vec<usize> = (0..rows.len()).filter(|i| !keep.contains(i)).collect();
        self.sync_rows(rows, &leaving)?;
        let end = self.end();
        let lens: usize = keep.iter().map(|&i| end - self.starts[i]).sum();
        if keep.is_empty() || !self.built() || !padding_fits(keep.len(), end, lens) {
            return Ok(false);
        }
        let idx: Vec<i32> = keep.iter().map(|&i| i as i32).collect();
        let idx = Array::from_slice(&idx, &[idx.len() as i32])?;
        for a in self.layers.iter_mut().flatten() {
            a.keys = a.keys.take(&idx, 0)?;
            a.values = a.values.take(&idx, 0)?;
        }
        self.starts = keep.iter().map(|&i| self.starts[i]).collect();
        self.synced = keep.iter().map(|&i| self.synced[i]).collect();
        self.mask = None;
        Ok(true)
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
        let mask = self.mask_for(end, queries.dtype())?;
        masked_attention(queries, &k, &v, &mask, scale)
    }

    /// The additive mask `[B, 1, 1, end]` of a step whose rows end at column `end`, in
    /// `dtype`: made once per step, shared by its layers.
    fn mask_for(&mut self, end: usize, dtype: Dtype) -> Result<Array, CacheError> {
        if let Some((e, m)) = &self.mask {
            if *e == end && m.dtype() == dtype {
                return Ok(m.clone());
            }
        }
        let starts: Vec<i32> = self.starts.iter().map(|&s| s as i32).collect();
        let starts = Array::from_slice(&starts, &[starts.len() as i32, 1, 1, 1])?;
        let cols = mlx::ops::arange(0.0, end as f64, 1.0, Dtype::I32)?;
        let visible = cols.reshape(&[1, 1, 1, end as i32])?.ge(&starts)?;
        let zero = mlx::ops::full(&[1], 0.0, dtype)?;
        let hidden = mlx::ops::full(&[1], f64::NEG_INFINITY, dtype)?;
        let m = mlx::ops::where_(&visible, &zero, &hidden)?;
        self.mask = Some((end, m.clone()));
        Ok(m)
    }

    /// Writes the tokens decoded since the last sync back to each row's paged cache.
    pub(crate) fn sync(&mut self, rows: &mut [PagedKvCache]) -> Result<(), CacheError> {
        let all: Vec<usize> = (0..rows.len()).collect();
        self.sync_rows(rows, &all)
    }

    /// [`BatchArena::sync`] of the rows at `which`.
    fn sync_rows(&mut self, rows: &mut [PagedKvCache], which: &[usize]) -> Result<(), CacheError> {
        let end = self.end();
        for &b in which {
            let (Some(row), Some(&from)) = (rows.get_mut(b), self.synced.get(b)) else {
                continue;
            };
            if from >= end {
                continue;
            }
            let bi = b as i32;
            for (layer, a) in self.layers.iter().enumerate() {
                let Some(a) = a else { continue };
                let (ks, vs) = (a.keys.shape(), a.values.shape());
                let (f, t) = (from as i32, a.end as i32);
                let k = a.keys.slice(&[bi, 0, f, 0], &[bi + 1, ks[1], t, ks[3]])?;
                let v = a.values.slice(&[bi, 0, f, 0], &[bi + 1, vs[1], t, vs[3]])?;
                row.append(layer, &k, &v)?;
            }
            self.synced[b] = end;
        }
        Ok(())
    }
}

/// Whether `row` can decode in an arena of `layers` layers: float KV, no state layers, no
/// windows, every layer as long as the row, and at least one token.
fn eligible(row: &PagedKvCache, layers: usize) -> bool {
    row.config().format == crate::KvFormat::Float
        && row.state_layers() == 0
        && !row.has_windows()
        && row.layers() == layers
        && (0..layers).all(|l| row.layer_offset(l) == row.offset())
        && row.offset() > 0
}

/// Whether `rows` rows ending at column `end` and holding `tokens` tokens together pad no
/// more columns than they fill.
fn padding_fits(rows: usize, end: usize, tokens: usize) -> bool {
    rows * end <= 2 * tokens
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
    })
}

/// `softmax(q kᵀ · scale + mask) v` for queries `[B, Hq, 1, D]` over keys and values
/// `[B, Hkv, T, D]` (grouped: Hq a multiple of Hkv), `mask` `[B, 1, 1, T]` additive: 0
/// where a row may attend, -inf elsewhere. Written as matmuls rather than MLX's fused attention: with a mask array
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
    let scores = q.matmul(&keys.transpose(&[0, 1, 3, 2])?)?.add(mask)?;
    let p = scores.softmax(-1, true)?;
    let out = p.matmul(values)?;
    Ok(out.reshape(&[b, hq, 1, values.shape()[3]])?)
}
