//! [`BatchArena`]: the keys and values of a decode batch as one `[S, H, cap, D]` pair per
//! layer, each row in its own slot and left-aligned at columns `0..len`, so a batched
//! decode step writes every row's new token with one scatter per part and attends with one
//! masked attention per layer, instead of one of each per row (docs/cache.md, "Batched
//! decode on a GPU").
//!
//! While a row is in the arena, the arena is the only home of its KV: a layer's arena is
//! built from the rows' paged caches at the batch's first step (one copy of each row's KV),
//! and each row then gives that layer's pool up ([`PagedKvCache::lend`]). A row that joins
//! later is written into a free slot (one update per layer part, O(row)) and gives its
//! pools up likewise ([`BatchArena::join`]); a row that leaves gets its whole KV back, one
//! write per layer part from its slot ([`BatchArena::retain`], [`BatchArena::give_back`]),
//! and frees its slot. The rows that stay are never copied, and a step copies no row's KV.
//! Slots and columns grow by ladders (amortized); the arena's bytes stay within its rows'
//! reservations plus an allowance the owner grants (the scheduler: what its KV budget has
//! left, charged to the device tier).

use mlx::{Array, Dtype};

use crate::{CacheError, KvCache, PagedKvCache};

/// The first rung of the column ladder, and what every rung is a multiple of.
const COLUMN_RUNG: usize = 256;

/// One layer's arena: keys `[S, H, cap, D]` and values `[S, H, cap, Dv]`; slot s's row holds
/// its tokens at columns `0..len`. A layer may have fewer slots or columns than the arena
/// ([`BatchArena::slots`], [`BatchArena::cap`]) until its next write grows it.
struct LayerArena {
    keys: Array,
    values: Array,
}

impl LayerArena {
    fn slots(&self) -> usize {
        self.keys.shape()[0] as usize
    }

    fn cap(&self) -> usize {
        self.keys.shape()[2] as usize
    }
}

/// The inputs of one step that every layer shares: made at the step's first layer.
struct StepInputs {
    /// Each row's length before the step's token, and the dtype of the queries.
    key: (Vec<usize>, Dtype),
    /// Slots the step attends over (`0..attended`: every slot a row holds).
    attended: usize,
    /// Each row's slot, `[B]` int32 (the scatter's first index, the output gather's).
    slots: Array,
    /// Each row's new column (its length), `[B]` int32.
    columns: Array,
    /// The row each attended slot takes its query from, `[attended]` int32; `None` when row
    /// b is in slot b for every b (no gathers).
    queries_from: Option<Array>,
    /// Additive mask `[attended, 1, 1, T]`: 0 where a slot's row attends, -inf elsewhere (a
    /// free slot sees column 0 only, so its discarded output stays finite).
    mask: Array,
}

/// The arenas of a decode batch (see the module docs).
pub(crate) struct BatchArena {
    layers: Vec<Option<LayerArena>>,
    /// The slot of each row, in the batch's row order.
    slot_of: Vec<usize>,
    /// Slots every layer has (or gets at its next write).
    slots: usize,
    /// Columns every layer has (or gets at its next write).
    cap: usize,
    /// Each row's KV reservation in bytes (`None`: unbounded).
    reserved: Vec<Option<u64>>,
    /// Bytes the arena may hold beyond its rows' reservations.
    allowance: u64,
    /// Bytes one token of one row takes over every layer's keys and values.
    column_bytes: u64,
    step: Option<StepInputs>,
    /// Bytes of KV copied into or out of the arena (builds, joins, leaves, growth), not
    /// counting the steps' token writes.
    copied: u64,
}

impl BatchArena {
    /// An arena for `rows` (whose KV reservations are `reserved`, in bytes) when they can
    /// share one: float KV, no state layers, no windows, every attention layer as long as
    /// the row, and slots and columns for one more token within the reservations plus
    /// `allowance` bytes. Rows of any lengths share one. `None` otherwise.
    pub(crate) fn plan(
        rows: &[PagedKvCache],
        reserved: &[Option<u64>],
        allowance: u64,
    ) -> Option<BatchArena> {
        let layers = rows.first()?.layers();
        if !rows.iter().all(|r| eligible(r, layers)) || reserved.len() != rows.len() {
            return None;
        }
        let longest = rows.iter().map(|r| r.offset()).max()?;
        let column_bytes = rows
            .iter()
            .map(column_bytes)
            .collect::<Option<Vec<u64>>>()?
            .into_iter()
            .max()?;
        let mut arena = BatchArena {
            layers: (0..layers).map(|_| None).collect(),
            slot_of: (0..rows.len()).collect(),
            slots: slot_rung(rows.len()),
            cap: column_rung(longest + 1),
            reserved: reserved.to_vec(),
            allowance,
            column_bytes,
            step: None,
            copied: 0,
        };
        if !arena.fits(arena.slots, arena.cap, &arena.reserved) {
            // Without spare slots, before giving up.
            arena.slots = rows.len();
        }
        arena
            .fits(arena.slots, arena.cap, &arena.reserved)
            .then_some(arena)
    }

    /// Whether an arena of `slots` × `cap` holding rows with these reservations stays
    /// within them plus the allowance.
    fn fits(&self, slots: usize, cap: usize, reserved: &[Option<u64>]) -> bool {
        let Some(total) = reserved.iter().copied().sum::<Option<u64>>() else {
            return true;
        };
        bytes_of(slots, cap, self.column_bytes) <= total.saturating_add(self.allowance)
    }

    /// Whether the arena as it is stays within its rows' reservations plus the allowance
    /// (after rows left, or the allowance shrank, it may not: then it should go).
    pub(crate) fn within_budget(&self) -> bool {
        self.fits(self.slots, self.cap, &self.reserved)
    }

    /// Sets the bytes the arena may hold beyond its rows' reservations.
    pub(crate) fn set_allowance(&mut self, bytes: u64) {
        self.allowance = bytes;
    }

    /// Bytes the arena takes (every layer at its full slots and columns) beyond its rows'
    /// reservations: what its owner charges to its budget. Rows without a reservation
    /// count as reserving nothing.
    pub(crate) fn excess_bytes(&self) -> u64 {
        let reserved: u64 = self.reserved.iter().map(|r| r.unwrap_or(0)).sum();
        bytes_of(self.slots, self.cap, self.column_bytes).saturating_sub(reserved)
    }

    /// Device bytes the arena holds (every built layer's keys and values).
    pub(crate) fn device_bytes(&self) -> u64 {
        self.layers
            .iter()
            .flatten()
            .map(|a| (a.keys.nbytes() + a.values.nbytes()) as u64)
            .sum()
    }

    /// Bytes of KV copied into or out of the arena so far (builds, joins, leaves, growth),
    /// not counting the steps' token writes.
    pub(crate) fn copied_bytes(&self) -> u64 {
        self.copied
    }

    /// Makes room for one more token of every row in `layer` (growing the columns along
    /// their ladder, within the budget); `false` when the budget does not allow it.
    pub(crate) fn make_room(&mut self, rows: &[PagedKvCache], layer: usize) -> bool {
        let need = rows
            .iter()
            .map(|r| r.layer_offset(layer))
            .max()
            .unwrap_or(0)
            + 1;
        if need <= self.cap {
            return true;
        }
        let cap = column_rung(need.max(self.cap + 1));
        if !self.fits(self.slots, cap, &self.reserved) {
            return false;
        }
        self.cap = cap;
        true
    }

    /// Takes `row` (with KV reservation `reserved` bytes) in as the last row: its KV written
    /// into a free slot of every built layer (growing the slots or columns along their
    /// ladders when needed) and those layers' pools given up. `false` (nothing changed)
    /// when it cannot join: the row is not eligible or the arena would outgrow the rows'
    /// reservations plus the allowance; then the caller gives every row back.
    pub(crate) fn join(
        &mut self,
        row: &mut PagedKvCache,
        reserved: Option<u64>,
    ) -> Result<bool, CacheError> {
        let len = row.offset();
        let mut with_row = self.reserved.clone();
        with_row.push(reserved);
        if !eligible(row, self.layers.len()) || column_bytes(row) != Some(self.column_bytes) {
            return Ok(false);
        }
        let slot = (0..self.slots)
            .find(|s| !self.slot_of.contains(s))
            .unwrap_or(self.slots);
        let slots = if slot < self.slots {
            self.slots
        } else {
            slot_rung(slot + 1)
        };
        let cap = if len < self.cap {
            self.cap
        } else {
            column_rung(len + 1)
        };
        if !self.fits(slots, cap, &with_row) {
            return Ok(false);
        }
        // Every layer's KV first and checked, so a bad row changes nothing.
        let mut kv = Vec::with_capacity(self.layers.len());
        for (layer, a) in self.layers.iter().enumerate() {
            let Some(a) = a else {
                kv.push(None);
                continue;
            };
            let (k, v) = row.fetch(layer)?.ok_or_else(|| {
                CacheError::Config(format!("layer {layer} of a joining row holds nothing"))
            })?;
            check_row(a, &k, &v, layer)?;
            kv.push(Some((k, v)));
        }
        self.slots = slots;
        self.cap = cap;
        for (layer, kv) in kv.into_iter().enumerate() {
            let Some((k, v)) = kv else { continue };
            let a = self.layer_at(layer, slots, cap)?;
            let a = write_row(a, slot, &k, &v)?;
            self.copied += (k.nbytes() + v.nbytes()) as u64;
            self.layers[layer] = Some(a);
            row.lend(layer)?;
        }
        self.slot_of.push(slot);
        self.reserved = with_row;
        self.step = None;
        Ok(true)
    }

    /// Keeps the rows at `keep` (in that order): the others get their KV back and free their
    /// slots; the rows that stay are not copied. `false` when no row is left (the arena
    /// should go).
    pub(crate) fn retain(
        &mut self,
        rows: &mut [PagedKvCache],
        keep: &[usize],
    ) -> Result<bool, CacheError> {
        let leaving: Vec<usize> = (0..rows.len()).filter(|i| !keep.contains(i)).collect();
        self.give_back_rows(rows, &leaving)?;
        self.slot_of = keep.iter().map(|&i| self.slot_of[i]).collect();
        self.reserved = keep.iter().map(|&i| self.reserved[i]).collect();
        self.step = None;
        Ok(!keep.is_empty())
    }

    /// Takes `layer`'s arena out, built (from the rows' caches, which then give that layer's
    /// pool up) or grown to `slots` × `cap` as needed.
    fn layer_at(
        &mut self,
        layer: usize,
        slots: usize,
        cap: usize,
    ) -> Result<LayerArena, CacheError> {
        let layers = self.layers.len();
        let a = self
            .layers
            .get_mut(layer)
            .ok_or(CacheError::NoSuchLayer { layer, layers })?
            .take()
            .ok_or_else(|| {
                CacheError::Config(format!("layer {layer} of a batch arena is not built"))
            })?;
        if a.slots() >= slots && a.cap() >= cap {
            return Ok(a);
        }
        let grow = |x: &Array| -> Result<Array, CacheError> {
            let s = x.shape();
            let (more_slots, more_cols) = (slots as i32 - s[0], cap as i32 - s[2]);
            let mut x = x.clone();
            if more_cols > 0 {
                let zeros = mlx::ops::zeros(&[s[0], s[1], more_cols, s[3]], x.dtype())?;
                x = mlx::ops::concatenate(&[&x, &zeros], 2)?;
            }
            if more_slots > 0 {
                let zeros = mlx::ops::zeros(&[more_slots, s[1], cap as i32, s[3]], x.dtype())?;
                x = mlx::ops::concatenate(&[&x, &zeros], 0)?;
            }
            Ok(x)
        };
        let grown = LayerArena {
            keys: grow(&a.keys)?,
            values: grow(&a.values)?,
        };
        self.copied += (grown.keys.nbytes() + grown.values.nbytes()) as u64;
        Ok(grown)
    }

    /// Builds `layer`'s arena from the rows' caches (each row into its slot) for a step whose
    /// keys and values look like `keys` / `values`, and lends the rows' pools of it.
    fn build(
        &mut self,
        rows: &mut [PagedKvCache],
        layer: usize,
        keys: &Array,
        values: &Array,
    ) -> Result<(), CacheError> {
        let (ks, vs) = (keys.shape(), values.shape());
        let (s, c) = (self.slots as i32, self.cap as i32);
        let mut a = LayerArena {
            keys: mlx::ops::zeros(&[s, ks[1], c, ks[3]], keys.dtype())?,
            values: mlx::ops::zeros(&[s, vs[1], c, vs[3]], values.dtype())?,
        };
        let mut fetched = Vec::with_capacity(rows.len());
        for row in rows.iter() {
            let (k, v) = row.fetch(layer)?.ok_or_else(|| {
                CacheError::Config(format!("layer {layer} of a decoding row holds nothing"))
            })?;
            check_row(&a, &k, &v, layer)?;
            fetched.push((k, v));
        }
        for ((k, v), &slot) in fetched.iter().zip(&self.slot_of) {
            a = write_row(a, slot, k, v)?;
            self.copied += (k.nbytes() + v.nbytes()) as u64;
        }
        self.layers[layer] = Some(a);
        for row in rows.iter_mut() {
            row.lend(layer)?;
        }
        Ok(())
    }

    /// Appends every row's new key and value (`keys`, `values` `[B, H, 1, D]`) to `layer`,
    /// each at its own column, and attends each row's query (`queries` `[B, Hq, 1, D]`) over
    /// its own tokens: one scatter per part and one masked attention for the whole batch.
    /// The layer's arena is built at its first step (the rows then give that layer's pools
    /// up). Returns `[B, Hq, 1, D]`; call [`Self::make_room`] first.
    pub(crate) fn attend(
        &mut self,
        rows: &mut [PagedKvCache],
        layer: usize,
        queries: &Array,
        keys: &Array,
        values: &Array,
        scale: f32,
    ) -> Result<Array, CacheError> {
        let layers = self.layers.len();
        if layer >= layers {
            return Err(CacheError::NoSuchLayer { layer, layers });
        }
        if self.layers[layer].is_none() {
            self.build(rows, layer, keys, values)?;
        }
        let lens: Vec<usize> = rows.iter().map(|r| r.layer_offset(layer)).collect();
        if lens.iter().any(|&l| l >= self.cap) {
            return Err(CacheError::Config(format!(
                "the batch arena of layer {layer} has no room for the step's token"
            )));
        }
        let (s, vs) = (keys.shape(), values.shape());
        if let Some(a) = &self.layers[layer] {
            let (hk, hv) = (a.keys.shape(), a.values.shape());
            let fits = s[0] as usize == rows.len()
                && s[1] == hk[1]
                && s[3] == hk[3]
                && vs[0] == s[0]
                && vs[1] == hv[1]
                && vs[2] == 1
                && vs[3] == hv[3]
                && keys.dtype() == a.keys.dtype()
                && values.dtype() == a.values.dtype();
            if !fits {
                return Err(CacheError::Shape(format!(
                    "a step's keys {s:?} {} / values {vs:?} for a batch arena of {hk:?} {} / \
                     {hv:?}",
                    keys.dtype(),
                    a.keys.dtype()
                )));
            }
        }
        let (slots, cap) = (self.slots, self.cap);
        let mut a = self.layer_at(layer, slots, cap)?;
        self.step_inputs(&lens, queries.dtype())?;
        let Some(step) = &self.step else {
            return Err(CacheError::Config(
                "a batch arena step has no inputs".into(),
            ));
        };
        let b = s[0];
        let indices = [&step.slots, &step.columns];
        let k_new = keys.reshape(&[b, 1, s[1], 1, s[3]])?;
        let v_new = values.reshape(&[b, 1, vs[1], 1, vs[3]])?;
        // SAFETY: `step_inputs` made every slot < `self.slots` and every column a row's
        // length, < `self.cap` (checked above); the layer has both (`layer_at`).
        a.keys = unsafe { a.keys.scatter_unchecked(&indices, &k_new, &[0, 2]) }?;
        a.values = unsafe { a.values.scatter_unchecked(&indices, &v_new, &[0, 2]) }?;
        let (n, t) = (step.attended as i32, step.mask.shape()[3]);
        let k = a.keys.slice(&[0, 0, 0, 0], &[n, s[1], t, s[3]])?;
        let v = a.values.slice(&[0, 0, 0, 0], &[n, vs[1], t, vs[3]])?;
        let q = match &step.queries_from {
            Some(from) => queries.take(from, 0)?,
            None => queries.clone(),
        };
        let out = masked_attention(&q, &k, &v, &step.mask, scale)?;
        let out = match &step.queries_from {
            Some(_) => out.take(&step.slots, 0)?,
            None => out,
        };
        self.layers[layer] = Some(a);
        for row in rows.iter_mut() {
            row.lent_grew(layer, 1)?;
        }
        Ok(out)
    }

    /// Makes the step's shared inputs for rows of lengths `lens` (kept while they stay the
    /// same, i.e. for every layer of a step).
    fn step_inputs(&mut self, lens: &[usize], dtype: Dtype) -> Result<(), CacheError> {
        if self
            .step
            .as_ref()
            .is_some_and(|s| s.key.0 == lens && s.key.1 == dtype)
        {
            return Ok(());
        }
        let attended = self.slot_of.iter().max().map_or(0, |&s| s + 1);
        let identity = self.slot_of.iter().enumerate().all(|(b, &s)| b == s);
        let mut slot_len = vec![0i32; attended];
        let mut from = vec![0i32; attended];
        for (b, (&slot, &len)) in self.slot_of.iter().zip(lens).enumerate() {
            slot_len[slot] = len as i32 + 1;
            from[slot] = b as i32;
        }
        let t = lens.iter().max().map_or(1, |&l| l + 1);
        let as_i32 = |v: Vec<i32>| -> Result<Array, CacheError> {
            let n = v.len() as i32;
            Ok(Array::from_slice(&v, &[n])?)
        };
        let visible_to = Array::from_slice(&slot_len, &[attended as i32, 1, 1, 1])?;
        let cols =
            mlx::ops::arange(0.0, t as f64, 1.0, Dtype::I32)?.reshape(&[1, 1, 1, t as i32])?;
        let zero = mlx::ops::full(&[1], 0.0, dtype)?;
        let hidden = mlx::ops::full(&[1], f64::NEG_INFINITY, dtype)?;
        let mask = mlx::ops::where_(&cols.lt(&visible_to)?, &zero, &hidden)?;
        self.step = Some(StepInputs {
            key: (lens.to_vec(), dtype),
            attended,
            slots: as_i32(self.slot_of.iter().map(|&s| s as i32).collect())?,
            columns: as_i32(lens.iter().map(|&l| l as i32).collect())?,
            queries_from: if identity { None } else { Some(as_i32(from)?) },
            mask,
        });
        Ok(())
    }

    /// Gives every row its KV back (the caller then drops the arena). On an error the rows
    /// given back so far keep theirs; calling it again gives back the rest.
    pub(crate) fn give_back(&mut self, rows: &mut [PagedKvCache]) -> Result<(), CacheError> {
        let all: Vec<usize> = (0..rows.len()).collect();
        self.give_back_rows(rows, &all)
    }

    /// [`BatchArena::give_back`] of the rows at `which`: each lent layer gets its row's
    /// columns of its slot, one write per part.
    fn give_back_rows(
        &mut self,
        rows: &mut [PagedKvCache],
        which: &[usize],
    ) -> Result<(), CacheError> {
        for &b in which {
            let (Some(row), Some(&slot)) = (rows.get_mut(b), self.slot_of.get(b)) else {
                continue;
            };
            let s = slot as i32;
            for (layer, a) in self.layers.iter().enumerate() {
                let Some(a) = a else { continue };
                if !row.layer_lent(layer) {
                    continue;
                }
                let (ks, vs) = (a.keys.shape(), a.values.shape());
                let len = row.layer_offset(layer) as i32;
                let k = a.keys.slice(&[s, 0, 0, 0], &[s + 1, ks[1], len, ks[3]])?;
                let v = a.values.slice(&[s, 0, 0, 0], &[s + 1, vs[1], len, vs[3]])?;
                row.take_back(layer, &k, &v)?;
                self.copied += (k.nbytes() + v.nbytes()) as u64;
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

/// Bytes of an arena of `slots` × `cap` columns of `column_bytes` each.
fn bytes_of(slots: usize, cap: usize, column_bytes: u64) -> u64 {
    (slots as u64)
        .saturating_mul(cap as u64)
        .saturating_mul(column_bytes)
}

/// The slot ladder: 1, 2, 4, then half a power of two more per rung (6, 8, 12, 16, 24,
/// 32, ...), up to the first rung that holds `rows` rows.
fn slot_rung(rows: usize) -> usize {
    let mut slots = 1;
    while slots < rows {
        slots = if slots < 4 {
            slots * 2
        } else if slots.is_power_of_two() {
            slots + slots / 2
        } else {
            slots.next_power_of_two()
        };
    }
    slots
}

/// The column ladder: 256, 512, 768, 1,024, then a quarter more per rung rounded up to a
/// multiple of 256 (1,280, 1,792, 2,304, 3,072, 3,840, 4,864, ...), up to the first rung
/// that holds `columns`. A rung pads at most about a quarter above 1,024 columns, and
/// growing one rung at a time copies each column a bounded number of times.
fn column_rung(columns: usize) -> usize {
    let mut cap = COLUMN_RUNG;
    while cap < columns {
        cap = (cap + (cap / 4).max(COLUMN_RUNG)).div_ceil(COLUMN_RUNG) * COLUMN_RUNG;
    }
    cap
}

/// Whether a row's keys `k` and values `v` (`[1, H, len, D]`) fit arena `a`.
fn check_row(a: &LayerArena, k: &Array, v: &Array, layer: usize) -> Result<(), CacheError> {
    let (ks, vs, hk, hv) = (k.shape(), v.shape(), a.keys.shape(), a.values.shape());
    let fits = ks.len() == 4
        && vs.len() == 4
        && ks[0] == 1
        && vs[0] == 1
        && ks[1] == hk[1]
        && ks[3] == hk[3]
        && vs[1] == hv[1]
        && vs[3] == hv[3]
        && ks[2] == vs[2]
        && k.dtype() == a.keys.dtype()
        && v.dtype() == a.values.dtype();
    if fits {
        Ok(())
    } else {
        Err(CacheError::Shape(format!(
            "layer {layer}: a row's keys {ks:?} {} / values {vs:?} for a batch arena of \
             {hk:?} {} / {hv:?}",
            k.dtype(),
            a.keys.dtype()
        )))
    }
}

/// Writes a row's keys and values (`[1, H, len, D]`, checked by [`check_row`]) into
/// `slot` of `a` at columns `0..len` (in place when `a` owns its buffers).
fn write_row(a: LayerArena, slot: usize, k: &Array, v: &Array) -> Result<LayerArena, CacheError> {
    let (s, len) = (slot as i32, k.shape()[2]);
    let (ks, vs) = (a.keys.shape(), a.values.shape());
    Ok(LayerArena {
        keys: a
            .keys
            .slice_update(k, &[s, 0, 0, 0], &[s + 1, ks[1], len, ks[3]])?,
        values: a
            .values
            .slice_update(v, &[s, 0, 0, 0], &[s + 1, vs[1], len, vs[3]])?,
    })
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

/// `softmax(q kᵀ · scale + mask) v` for queries `[B, Hq, 1, D]` over keys and values
/// `[B, Hkv, T, D]` (grouped: Hq a multiple of Hkv), `mask` `[B, 1, 1, T]` additive: 0
/// where a row may attend, -inf elsewhere. Written as matmuls rather than MLX's fused
/// attention: with a mask array MLX's CUDA backend leaves its decode kernel for cuDNN, which
/// builds a graph for every new key length, i.e. every step.
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

#[cfg(test)]
#[path = "batch_arena_tests.rs"]
mod tests;
