//! [`BatchArena`]: the keys and values of a decode batch as one `[B, H, T, D]` pair per
//! layer, rows right-aligned, so a batched decode step writes every row's new token with one
//! update and attends with one masked attention per layer, instead of one of each per row
//! (docs/cache.md, "Batched decode on a GPU").
//!
//! While a row is in the arena, the arena is the only home of its KV: a layer's arena is
//! built from the rows' paged caches at the batch's first step (one copy of each row's KV),
//! and each row then gives that layer's pool up ([`PagedKvCache::lend`]); a row that joins
//! later is copied in and gives its pools up likewise ([`BatchArena::join`]). A row that
//! leaves gets its whole KV back, one write per layer part from its slice of the arena
//! ([`BatchArena::retain`], [`BatchArena::give_back`]). So a step costs no copy of any
//! row's KV, the batch's KV is on the device once, and the arena never holds more bytes
//! than its rows' KV reservations together (when the rows have them).

use mlx::{Array, Dtype};

use crate::{CacheError, KvCache, PagedKvCache};

/// Columns an arena grows by when full (and the headroom a new one starts with), as far
/// as the rows' reservations allow.
const GROW: usize = 256;

/// One layer's arena: keys and values `[B, H, cap, D]`; columns `start_b .. end` hold row
/// b's tokens.
struct LayerArena {
    keys: Array,
    values: Array,
    end: usize,
}

impl LayerArena {
    /// Columns it has room for.
    fn cap(&self) -> usize {
        self.keys.shape()[2] as usize
    }
}

/// The arenas of a decode batch (see the module docs).
pub(crate) struct BatchArena {
    layers: Vec<Option<LayerArena>>,
    /// Column of each row's first token, in every layer.
    starts: Vec<usize>,
    /// Each row's KV reservation in bytes (`None`: unbounded).
    reserved: Vec<Option<u64>>,
    /// Bytes one token of one row takes over every layer's keys and values.
    column_bytes: u64,
    /// The column the rows ended at when the arena was planned.
    built_end: usize,
    /// The current step's additive mask `[B, 1, 1, end]` (0 where a row attends, -inf
    /// elsewhere), for the `end` it was made for.
    mask: Option<(usize, Array)>,
}

impl BatchArena {
    /// An arena for `rows` (whose KV reservations are `reserved`, in bytes) when they can
    /// share one: float KV, no state layers, no windows, every attention layer as long as
    /// the row, no more padding than real tokens (rows of very different lengths decode
    /// one by one instead), and room for at least one more token within the reservations.
    /// `None` otherwise.
    pub(crate) fn plan(rows: &[PagedKvCache], reserved: &[Option<u64>]) -> Option<BatchArena> {
        let layers = rows.first()?.layers();
        if !rows.iter().all(|r| eligible(r, layers)) || reserved.len() != rows.len() {
            return None;
        }
        let lens: Vec<usize> = rows.iter().map(|r| r.offset()).collect();
        let end = lens.iter().copied().max()?;
        if !padding_fits(rows.len(), end, lens.iter().sum()) {
            return None;
        }
        let column_bytes = rows
            .iter()
            .map(column_bytes)
            .collect::<Option<Vec<u64>>>()?
            .into_iter()
            .max()?;
        let arena = BatchArena {
            layers: (0..layers).map(|_| None).collect(),
            starts: lens.iter().map(|l| end - l).collect(),
            reserved: reserved.to_vec(),
            column_bytes,
            built_end: end,
            mask: None,
        };
        (arena.columns_allowed(reserved) > end).then_some(arena)
    }

    /// The most columns an arena of rows with these reservations may have so that its
    /// bytes stay within them (`usize::MAX` when any is unbounded).
    fn columns_allowed(&self, reserved: &[Option<u64>]) -> usize {
        let total: Option<u64> = reserved.iter().copied().sum();
        match (total, reserved.len() as u64 * self.column_bytes) {
            (Some(t), per) if per > 0 => (t / per).min(usize::MAX as u64) as usize,
            _ => usize::MAX,
        }
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

    /// Whether every layer has its arena (after the first step).
    fn built(&self) -> bool {
        self.layers.iter().all(Option::is_some)
    }

    /// Device bytes the arena holds (every built layer's keys and values).
    pub(crate) fn device_bytes(&self) -> u64 {
        self.layers
            .iter()
            .flatten()
            .map(|a| (a.keys.nbytes() + a.values.nbytes()) as u64)
            .sum()
    }

    /// Whether `layer` can take one more token per row within the rows' reservations
    /// (every layer can or none: they grow in step).
    pub(crate) fn has_room(&self, layer: usize) -> bool {
        match self.layers.get(layer) {
            Some(Some(a)) => a.end < a.cap() || self.columns_allowed(&self.reserved) > a.cap(),
            _ => true,
        }
    }

    /// Takes `row` (with KV reservation `reserved` bytes) in as the last row: its KV copied
    /// into every layer's arena, ending where the others end, and its pools given up.
    /// `false` (nothing changed) when it cannot join: the arena is not built yet, the row
    /// is longer than the others or not eligible, the batch would hold more padding than
    /// tokens, or the arena would outgrow the rows' reservations; then the caller starts a
    /// new arena.
    pub(crate) fn join(
        &mut self,
        row: &mut PagedKvCache,
        reserved: Option<u64>,
    ) -> Result<bool, CacheError> {
        let end = self.end();
        let len = row.offset();
        let lens: usize = self.starts.iter().map(|s| end - s).sum();
        let mut with_row = self.reserved.clone();
        with_row.push(reserved);
        let allowed = self.columns_allowed(&with_row);
        let fits = self.built()
            && eligible(row, self.layers.len())
            && column_bytes(row) == Some(self.column_bytes)
            && len <= end
            && allowed > end
            && padding_fits(self.starts.len() + 1, end, lens + len);
        if !fits {
            return Ok(false);
        }
        // Every layer's new arrays first, so a failure changes nothing.
        let mut joined = Vec::with_capacity(self.layers.len());
        for (layer, a) in self.layers.iter().enumerate() {
            let Some(a) = a else { return Ok(false) };
            let (k, v) = row.fetch(layer)?.ok_or_else(|| {
                CacheError::Config(format!("layer {layer} of a joining row holds nothing"))
            })?;
            let cap = a.cap().min(allowed);
            let with_slab = |all: &Array, x: &Array| -> Result<Array, CacheError> {
                let (s, a) = (x.shape(), all.shape());
                let before = mlx::ops::zeros(&[1, s[1], (end - len) as i32, s[3]], x.dtype())?;
                let after = mlx::ops::zeros(&[1, s[1], (cap - end) as i32, s[3]], x.dtype())?;
                let slab = mlx::ops::concatenate(&[&before, x, &after], 2)?;
                let all = all.slice(&[0, 0, 0, 0], &[a[0], a[1], cap as i32, a[3]])?;
                Ok(mlx::ops::concatenate(&[&all, &slab], 0)?)
            };
            joined.push((with_slab(&a.keys, &k)?, with_slab(&a.values, &v)?));
        }
        for (layer, (slot, (k, v))) in self.layers.iter_mut().zip(joined).enumerate() {
            if let Some(a) = slot {
                a.keys = k;
                a.values = v;
            }
            row.lend(layer)?;
        }
        self.starts.push(end - len);
        self.reserved = with_row;
        self.mask = None;
        Ok(true)
    }

    /// Keeps the rows at `keep` (in that order): the others first get their KV back. `false`
    /// when the arena should go (no row left, not built, the rows left would hold more
    /// padding than tokens, or the arena would outgrow their reservations; the kept rows
    /// are then not given back yet: [`BatchArena::give_back`] does that).
    pub(crate) fn retain(
        &mut self,
        rows: &mut [PagedKvCache],
        keep: &[usize],
    ) -> Result<bool, CacheError> {
        let leaving: Vec<usize> = (0..rows.len()).filter(|i| !keep.contains(i)).collect();
        self.give_back_rows(rows, &leaving)?;
        let end = self.end();
        let lens: usize = keep.iter().map(|&i| end - self.starts[i]).sum();
        let reserved: Vec<Option<u64>> = keep.iter().map(|&i| self.reserved[i]).collect();
        let allowed = self.columns_allowed(&reserved);
        if keep.is_empty()
            || !self.built()
            || !padding_fits(keep.len(), end, lens)
            || allowed <= end
        {
            return Ok(false);
        }
        let idx: Vec<i32> = keep.iter().map(|&i| i as i32).collect();
        let idx = Array::from_slice(&idx, &[idx.len() as i32])?;
        let mut kept = Vec::with_capacity(self.layers.len());
        for a in self.layers.iter().flatten() {
            // The gather makes new arrays of the kept rows only, no wider than allowed.
            let cap = a.cap().min(allowed) as i32;
            let gather = |x: &Array| -> Result<Array, CacheError> {
                let s = x.shape();
                Ok(x.slice(&[0, 0, 0, 0], &[s[0], s[1], cap, s[3]])?
                    .take(&idx, 0)?)
            };
            kept.push((gather(&a.keys)?, gather(&a.values)?));
        }
        for (a, (k, v)) in self.layers.iter_mut().flatten().zip(kept) {
            a.keys = k;
            a.values = v;
        }
        self.starts = keep.iter().map(|&i| self.starts[i]).collect();
        self.reserved = reserved;
        self.mask = None;
        Ok(true)
    }

    /// Appends every row's new key and value (`keys`, `values` `[B, H, 1, D]`) to `layer`
    /// and attends each row's query (`queries` `[B, Hq, 1, D]`) over its own tokens: one
    /// write and one masked attention for the whole batch. The layer's arena is built at
    /// its first step (the rows then give that layer's pools up). Returns
    /// `[B, Hq, 1, D]`; fails when the layer has no room left ([`Self::has_room`]).
    pub(crate) fn attend(
        &mut self,
        rows: &mut [PagedKvCache],
        layer: usize,
        queries: &Array,
        keys: &Array,
        values: &Array,
        scale: f32,
    ) -> Result<Array, CacheError> {
        let b = rows.len() as i32;
        let layers = self.layers.len();
        let allowed = self.columns_allowed(&self.reserved);
        let slot = self
            .layers
            .get_mut(layer)
            .ok_or(CacheError::NoSuchLayer { layer, layers })?;
        if slot.is_none() {
            let cap = (self.built_end + GROW).min(allowed);
            *slot = Some(build(rows, layer, &self.starts, self.built_end, cap)?);
            for row in rows.iter_mut() {
                row.lend(layer)?;
            }
        }
        let Some(mut a) = slot.take() else {
            return Err(CacheError::Config(
                "a batch arena layer went missing".into(),
            ));
        };
        let (s, held) = (keys.shape(), a.keys.shape());
        let (h, d) = (s[1], s[3]);
        let fits = s[0] == held[0]
            && h == held[1]
            && d == held[3]
            && values.shape() == s
            && a.values.shape()[3] == d
            && keys.dtype() == a.keys.dtype()
            && values.dtype() == a.values.dtype();
        if !fits {
            let msg = format!(
                "a step's keys {s:?} {} for a batch arena of {held:?} {}",
                keys.dtype(),
                a.keys.dtype()
            );
            *slot = Some(a);
            return Err(CacheError::Shape(msg));
        }
        if a.end == a.cap() {
            let cap = (a.cap() + GROW).min(allowed);
            if cap <= a.end {
                *slot = Some(a);
                return Err(CacheError::Config(format!(
                    "the batch arena of layer {layer} is full: {cap} columns are all its \
                     rows' reservations allow"
                )));
            }
            let more = (cap - a.end) as i32;
            let grow = |x: &Array| -> Result<Array, CacheError> {
                let zeros = mlx::ops::zeros(&[b, h, more, x.shape()[3]], x.dtype())?;
                Ok(mlx::ops::concatenate(&[x, &zeros], 2)?)
            };
            let grown = grow(&a.keys).and_then(|k| Ok((k, grow(&a.values)?)));
            match grown {
                Ok((k, v)) => {
                    a.keys = k;
                    a.values = v;
                }
                Err(e) => {
                    *slot = Some(a);
                    return Err(e);
                }
            }
        }
        // Checked above, so the in-place updates (which take the arrays) cannot fail on
        // shapes.
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
        for row in rows.iter_mut() {
            row.lent_grew(layer, 1)?;
        }
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

    /// Gives every row its KV back (the caller then drops the arena). On an error the rows
    /// given back so far keep theirs; calling it again gives back the rest.
    pub(crate) fn give_back(&mut self, rows: &mut [PagedKvCache]) -> Result<(), CacheError> {
        let all: Vec<usize> = (0..rows.len()).collect();
        self.give_back_rows(rows, &all)
    }

    /// [`BatchArena::give_back`] of the rows at `which`: each lent layer gets its row's
    /// slice of the arena, one write per part.
    fn give_back_rows(
        &mut self,
        rows: &mut [PagedKvCache],
        which: &[usize],
    ) -> Result<(), CacheError> {
        for &b in which {
            let (Some(row), Some(&start)) = (rows.get_mut(b), self.starts.get(b)) else {
                continue;
            };
            let bi = b as i32;
            for (layer, a) in self.layers.iter().enumerate() {
                let Some(a) = a else { continue };
                if !row.layer_lent(layer) {
                    continue;
                }
                let (ks, vs) = (a.keys.shape(), a.values.shape());
                let (f, t) = (start as i32, a.end as i32);
                let k = a.keys.slice(&[bi, 0, f, 0], &[bi + 1, ks[1], t, ks[3]])?;
                let v = a.values.slice(&[bi, 0, f, 0], &[bi + 1, vs[1], t, vs[3]])?;
                row.take_back(layer, &k, &v)?;
            }
        }
        // The copies start now, so the arena's buffers need not outlive them until the
        // rows are next read.
        let copies: Vec<&Array> = which
            .iter()
            .filter_map(|&b| rows.get(b))
            .flat_map(|r| (0..self.layers.len()).filter_map(|l| r.pool(l)))
            .flat_map(|p| p.arrays())
            .collect();
        if !copies.is_empty() {
            mlx::async_eval(&copies)?;
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

/// Bytes one token of `row` takes over all its layers' keys and values.
fn column_bytes(row: &PagedKvCache) -> Option<u64> {
    let bs = row.config().block_size;
    Some((row.projected_bytes(bs)? / bs.max(1)) as u64)
}

/// Whether `rows` rows ending at column `end` and holding `tokens` tokens together pad no
/// more columns than they fill.
fn padding_fits(rows: usize, end: usize, tokens: usize) -> bool {
    rows * end <= 2 * tokens
}

/// A layer's arena from the rows' paged caches: row b's tokens right-aligned to end at
/// `end`, zeros before them and free columns after, `cap` columns in all.
fn build(
    rows: &[PagedKvCache],
    layer: usize,
    starts: &[usize],
    end: usize,
    cap: usize,
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
            let after = mlx::ops::zeros(&[1, s[1], (cap - end) as i32, s[3]], x.dtype())?;
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
