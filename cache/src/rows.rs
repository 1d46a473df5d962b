//! [`PagedKvRows`]: several sequences decoding together, each in its own paged cache,
//! fetched as one left-padded batch.

use std::sync::atomic::{AtomicU64, Ordering};

use mlx::{Array, Dtype};

use crate::batch_arena::BatchArena;
use crate::mask::visible;
use crate::{CacheError, KvCache, LayerState, PagedKvCache};

/// Process-wide decode attention paths where the batched decode attention is usable (a
/// CUDA GPU, the CPU), counted by row and layer: in one node (a batch's or a single
/// sequence's) and otherwise.
static ONE_NODE_LAYERS: AtomicU64 = AtomicU64::new(0);
static ROW_BY_ROW_LAYERS: AtomicU64 = AtomicU64::new(0);

/// Decode attention of one row and unwindowed layer, over the process: how many went
/// through one node ([`mlx::rows_attention`], for a batch or a single sequence) and how
/// many otherwise, where the kernel is usable (what a benchmark reports; both 0 elsewhere).
pub fn decode_path_totals() -> (u64, u64) {
    (
        ONE_NODE_LAYERS.load(Ordering::Relaxed),
        ROW_BY_ROW_LAYERS.load(Ordering::Relaxed),
    )
}

/// Counts `rows` rows' decode attention of one layer in [`decode_path_totals`].
pub(crate) fn count_decode_path(one_node: bool, rows: usize) {
    let counter = if one_node {
        &ONE_NODE_LAYERS
    } else {
        &ROW_BY_ROW_LAYERS
    };
    counter.fetch_add(rows as u64, Ordering::Relaxed);
}

/// The batched decode attention ([`mlx::rows_attention`]) over `rows` (one query each, in
/// order): every row's new key and value written into its own arena and every row
/// attended, in one graph node for the layer. `None` (nothing changed but blocks taken
/// for the new token, which the caller's other path then fills) when the kernel is not
/// built or not on, the shapes do not fit it, or any row's layer cannot be written in
/// place ([`PagedKvCache::decode_row`]).
pub(crate) fn attend_in_one_node(
    rows: &mut [PagedKvCache],
    layer: usize,
    queries: &Array,
    keys: &Array,
    values: &Array,
    scale: f32,
) -> Result<Option<Array>, CacheError> {
    let (ks, qs) = (keys.shape(), queries.shape());
    let fits = mlx::rows_attention::rows_kernel_fits(
        keys.dtype(),
        ks[3] as usize,
        qs[1] as usize,
        ks[1] as usize,
    );
    if !fits || !mlx::rows_attention::rows_kernel_usable() {
        return Ok(None);
    }
    for row in rows.iter_mut() {
        if !row.reserve_decode_token(layer)? {
            return Ok(None);
        }
    }
    let mut kv = Vec::with_capacity(rows.len());
    for row in rows.iter() {
        match row.decode_row(layer) {
            Some(r) if r.keys.dtype() == keys.dtype() => kv.push(r),
            _ => return Ok(None),
        }
    }
    let out = mlx::rows_attention::rows_decode_attention(queries, keys, values, &kv, scale)?;
    drop(kv);
    for row in rows.iter_mut() {
        row.advance_decode(layer)?;
    }
    Ok(Some(out))
}

/// A batch of rows (sequences) for decoding. Row `b` keeps its own [`PagedKvCache`]; a
/// step appends each row's new keys and values and fetches all rows as one
/// `[B, H, T, D]` batch, left-padded with zeros to the longest row `T`.
///
/// With the batch arena on ([`PagedKvRows::set_batch_arena`]), [`PagedKvRows::attend`]
/// keeps the batch's KV in one slotted array per layer, each row left-aligned in its own
/// slot, which is then its only home: the rows' caches give their pools up while they are
/// in it and get their KV back when they leave or are handed out (module `batch_arena`).
/// The arena holds no more bytes than the KV reservations of its rows
/// ([`PagedKvRows::push_reserved`]) together plus an allowance
/// ([`PagedKvRows::set_arena_allowance`]).
///
/// On a CUDA GPU and, for f32, on the CPU, an unwindowed layer's decode step skips the
/// batch: one graph node writes every row's new key and value into its own arena and
/// attends each row there ([`mlx::rows_attention`]), when every row's arena may be written
/// in place.
#[derive(Default)]
pub struct PagedKvRows {
    rows: Vec<PagedKvCache>,
    /// Each row's KV reservation in bytes (`None`: unbounded), which bounds the arena.
    reserved: Vec<Option<u64>>,
    /// Whether [`PagedKvRows::attend`] may use a batch arena.
    use_arena: bool,
    arena: Option<BatchArena>,
    /// The rows cannot share an arena (checked once per set of rows).
    no_arena: bool,
    /// Bytes a batch arena may hold beyond its rows' reservations.
    allowance: u64,
    /// Unwindowed decode layers attended in one node ([`PagedKvRows::attend_in_one_node`])
    /// and row by row, since the batch was made.
    one_node_layers: u64,
    row_by_row_layers: u64,
}

impl std::fmt::Debug for PagedKvRows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PagedKvRows")
            .field("rows", &self.rows)
            .field("use_arena", &self.use_arena)
            .field("arena", &self.arena.is_some())
            .finish()
    }
}

impl PagedKvRows {
    /// An empty batch, its rows attending over their own caches: the batch arena is off
    /// unless [`PagedKvRows::set_batch_arena`] turns it on. It saves GPU launches every
    /// step, but serving mixed lengths it joined, left and fell back so often that it cost
    /// `bench serve` on the H200 about 40 % of its throughput (docs/benchmarks.md, session
    /// 8); on the CPU per-row attention is as fast.
    pub fn new() -> Self {
        Self::default()
    }

    /// Turns the batch arena on or off (tests run it on the CPU; the numbers differ from
    /// per-row attention only by float rounding). Gives the rows their KV back first.
    pub fn set_batch_arena(&mut self, on: bool) -> Result<(), CacheError> {
        self.settle()?;
        self.no_arena = false;
        self.use_arena = on;
        Ok(())
    }

    /// Unwindowed decode layers attended in one graph node (the batched decode attention)
    /// and row by row, since the batch was made (the arena's steps are in neither).
    pub fn decode_paths(&self) -> (u64, u64) {
        (self.one_node_layers, self.row_by_row_layers)
    }

    /// Whether a batch arena holds the batch now.
    pub fn has_arena(&self) -> bool {
        self.arena.is_some()
    }

    /// Lets a batch arena hold up to `bytes` beyond its rows' reservations (its padding:
    /// spare slots, columns of rows shorter than the longest, room to grow). The owner
    /// charges [`PagedKvRows::arena_excess_bytes`] to its KV budget; the scheduler grants
    /// what its budget has left. 0 (the default): the arena stays within the reservations.
    /// An arena that no longer fits is given back at the next step and planned again.
    pub fn set_arena_allowance(&mut self, bytes: u64) {
        if bytes > self.allowance {
            self.no_arena = false;
        }
        self.allowance = bytes;
        if let Some(a) = &mut self.arena {
            a.set_allowance(bytes);
        }
    }

    /// Bytes the batch arena takes beyond its rows' reservations (0 without an arena).
    pub fn arena_excess_bytes(&self) -> u64 {
        self.arena.as_ref().map_or(0, |a| a.excess_bytes())
    }

    /// Bytes of KV copied into or out of the current batch arena (its build, joins,
    /// leaves and growth; not the steps' token writes); 0 without an arena.
    pub fn arena_copied_bytes(&self) -> u64 {
        self.arena.as_ref().map_or(0, |a| a.copied_bytes())
    }

    /// Gives every row its KV back from the batch arena (one write per layer part) and
    /// drops the arena; the next step builds a new one. On an error the arena stays and
    /// holds what it did not give back yet.
    pub fn settle(&mut self) -> Result<(), CacheError> {
        if let Some(a) = &mut self.arena {
            a.give_back(&mut self.rows)?;
        }
        self.arena = None;
        Ok(())
    }

    /// Device bytes of the batch's KV: the batch arena's and those of every row's cache
    /// (a row in the arena holds none of its own).
    pub fn device_bytes(&self) -> u64 {
        self.arena.as_ref().map_or(0, |a| a.device_bytes())
            + self.rows.iter().map(|r| r.device_bytes()).sum::<u64>()
    }

    /// A batch of the given rows.
    pub fn from_rows(rows: Vec<PagedKvCache>) -> Result<Self, CacheError> {
        let mut batch = Self::new();
        for r in rows {
            batch.push(r)?;
        }
        Ok(batch)
    }

    /// Rows in the batch.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// Whether the batch has no rows.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Adds one sequence as the last row (into the batch arena when one holds the batch
    /// and the row fits it), with no bound on the arena's bytes for it.
    pub fn push(&mut self, row: PagedKvCache) -> Result<(), CacheError> {
        self.add(row, None)
    }

    /// [`PagedKvRows::push`] for a row whose KV may take `bytes` on the device (its
    /// reservation in the KV budget): a batch arena never holds more bytes than its rows'
    /// reservations together plus the allowance (a row that would make it do so does not
    /// join it: every row gets its KV back; when a step would, the rows attend one by one).
    pub fn push_reserved(&mut self, row: PagedKvCache, bytes: u64) -> Result<(), CacheError> {
        self.add(row, Some(bytes))
    }

    fn add(&mut self, mut row: PagedKvCache, reserved: Option<u64>) -> Result<(), CacheError> {
        if let Some(first) = self.rows.first() {
            if (first.layers(), first.state_layers()) != (row.layers(), row.state_layers()) {
                return Err(CacheError::Shape(format!(
                    "a row of {} layers ({} with state) cannot join rows of {} ({})",
                    row.layers(),
                    row.state_layers(),
                    first.layers(),
                    first.state_layers()
                )));
            }
        }
        if let Some(a) = &mut self.arena {
            match a.join(&mut row, reserved) {
                Ok(true) => {}
                Ok(false) => self.settle()?,
                Err(e) => {
                    self.settle()?;
                    return Err(e);
                }
            }
        }
        self.no_arena = false;
        self.rows.push(row);
        self.reserved.push(reserved);
        Ok(())
    }

    /// Appends the rows of another batch after this one's (with their reservations).
    pub fn merge(&mut self, mut other: PagedKvRows) -> Result<(), CacheError> {
        other.settle()?;
        for (r, reserved) in other.rows.into_iter().zip(other.reserved) {
            self.add(r, reserved)?;
        }
        Ok(())
    }

    /// Keeps the rows at `keep` (in that order) and returns the others, in their order.
    pub fn filter(&mut self, keep: &[usize]) -> Result<Vec<PagedKvCache>, CacheError> {
        if let Some(&bad) = keep.iter().find(|&&i| i >= self.rows.len()) {
            return Err(CacheError::Shape(format!(
                "row {bad} of a batch of {}",
                self.rows.len()
            )));
        }
        // Checked before anything moves, so a bad `keep` changes nothing.
        let mut seen = vec![false; self.rows.len()];
        for &i in keep {
            if std::mem::replace(&mut seen[i], true) {
                return Err(CacheError::Shape(format!("row {i} kept twice")));
            }
        }
        // The rows that leave get their KV back; the arena keeps the others where they are.
        if let Some(a) = &mut self.arena {
            if !a.retain(&mut self.rows, keep)? {
                self.settle()?;
            }
        }
        self.no_arena = false;
        let mut slots: Vec<Option<PagedKvCache>> = std::mem::take(&mut self.rows)
            .into_iter()
            .map(Some)
            .collect();
        for &i in keep {
            if let Some(row) = slots[i].take() {
                self.rows.push(row);
            }
        }
        self.reserved = keep.iter().map(|&i| self.reserved[i]).collect();
        Ok(slots.into_iter().flatten().collect())
    }

    /// An independent copy of row `i` (every row gets its KV back from the arena first).
    pub fn extract(&mut self, i: usize) -> Result<PagedKvCache, CacheError> {
        self.settle()?;
        self.rows
            .get(i)
            .cloned()
            .ok_or_else(|| CacheError::Shape(format!("row {i} of a batch of {}", self.rows.len())))
    }

    /// Row `i`'s cache, to read its settings and bookkeeping: lengths and offsets (exact,
    /// the tokens a batch arena holds for it included), layer states, publication marks.
    /// While the batch arena holds the row ([`PagedKvCache::is_lent`]) its layers hold no
    /// KV: fetches, publication and trims of it are refused; [`PagedKvRows::row_mut`],
    /// [`PagedKvRows::extract`], [`PagedKvRows::filter`] and [`PagedKvRows::into_rows`]
    /// give it its KV back.
    pub fn row(&self, i: usize) -> Option<&PagedKvCache> {
        self.rows.get(i)
    }

    /// Row `i`, mutably (to publish it, for example), with its KV (every row gets its KV
    /// back from the arena first).
    pub fn row_mut(&mut self, i: usize) -> Result<Option<&mut PagedKvCache>, CacheError> {
        self.settle()?;
        self.no_arena = false;
        Ok(self.rows.get_mut(i))
    }

    /// The rows, in order, with every token decoded so far.
    pub fn into_rows(mut self) -> Result<Vec<PagedKvCache>, CacheError> {
        self.settle()?;
        Ok(self.rows)
    }

    /// Each row's offset (position of its next token) as an int32 `[B]` array: the RoPE
    /// offsets of a batched step.
    pub fn offsets(&self) -> Result<Array, CacheError> {
        let offs: Vec<i32> = self.rows.iter().map(|r| r.offset() as i32).collect();
        Ok(Array::from_slice(&offs, &[offs.len() as i32])?)
    }

    /// Each row's length in `layer`.
    fn lens(&self, layer: usize) -> Vec<usize> {
        self.rows.iter().map(|r| r.layer_offset(layer)).collect()
    }

    /// Left padding of each row in a fetch of `layer`: the longest row's length minus its own.
    pub fn padding(&self, layer: usize) -> Vec<usize> {
        let lens = self.lens(layer);
        let t = lens.iter().copied().max().unwrap_or(0);
        lens.iter().map(|l| t - l).collect()
    }

    /// Appends `[B, H, L, D]` keys and values (row b gets slice b) to `layer` and returns
    /// every row's keys and values, left-padded with zeros to `[B, H, T, D]`.
    pub fn update_and_fetch(
        &mut self,
        layer: usize,
        keys: &Array,
        values: &Array,
    ) -> Result<(Array, Array), CacheError> {
        self.settle()?;
        let s = keys.shape();
        if s.len() != 4 || s[0] as usize != self.rows.len() || values.shape() != s {
            return Err(CacheError::Shape(format!(
                "batched keys {s:?} / values {:?} for {} rows",
                values.shape(),
                self.rows.len()
            )));
        }
        let (h, l, d) = (s[1], s[2], s[3]);
        let mut fetched = Vec::with_capacity(self.rows.len());
        for (b, row) in self.rows.iter_mut().enumerate() {
            let bi = b as i32;
            let k = keys.slice(&[bi, 0, 0, 0], &[bi + 1, h, l, d])?;
            let v = values.slice(&[bi, 0, 0, 0], &[bi + 1, h, l, d])?;
            fetched.push(row.update_and_fetch(layer, &k, &v)?);
        }
        let t = fetched.iter().map(|(k, _)| k.shape()[2]).max().unwrap_or(0);
        let pad = |a: &Array| -> Result<Array, CacheError> {
            let len = a.shape()[2];
            if len == t {
                return Ok(a.clone());
            }
            let zeros = mlx::ops::zeros(&[1, h, t - len, d], a.dtype())?;
            Ok(mlx::ops::concatenate(&[&zeros, a], 2)?)
        };
        let ks: Vec<Array> = fetched
            .iter()
            .map(|(k, _)| pad(k))
            .collect::<Result<_, _>>()?;
        let vs: Vec<Array> = fetched
            .iter()
            .map(|(_, v)| pad(v))
            .collect::<Result<_, _>>()?;
        let kr: Vec<&Array> = ks.iter().collect();
        let vr: Vec<&Array> = vs.iter().collect();
        Ok((
            mlx::ops::concatenate(&kr, 0)?,
            mlx::ops::concatenate(&vr, 0)?,
        ))
    }

    /// One decode step's attention for every row: appends row b's `[1, H, 1, D]` slice of
    /// `keys` / `values` to `layer` and attends row b's query (`queries` `[B, Hq, 1, D]`)
    /// over what row b holds, the last `window` positions only when windowed. With the
    /// batch arena (unwindowed layers of rows that fit one), one scatter per part and one
    /// masked attention for the whole batch; otherwise one fused attention per row over its own
    /// cache through a view. Neither copies a row's KV per step. Returns `[B, Hq, 1, D]`.
    pub fn attend(
        &mut self,
        layer: usize,
        queries: &Array,
        keys: &Array,
        values: &Array,
        scale: f32,
        window: Option<usize>,
    ) -> Result<Array, CacheError> {
        let (s, qs) = (keys.shape(), queries.shape());
        let b = self.rows.len() as i32;
        if s.len() != 4
            || s[0] != b
            || s[2] != 1
            || values.shape() != s
            || qs.len() != 4
            || qs[0] != b
            || qs[2] != 1
        {
            return Err(CacheError::Shape(format!(
                "a decode step of {b} rows needs [B, H, 1, D] queries, keys and values; got \
                 {qs:?}, {s:?}, {:?}",
                values.shape()
            )));
        }
        if window.is_none() && self.use_arena && !self.no_arena {
            // An arena that outgrew its budget (rows left, the allowance shrank) goes at a
            // step's first layer, and a smaller one is planned.
            if layer == 0 && self.arena.as_ref().is_some_and(|a| !a.within_budget()) {
                self.settle()?;
            }
            if self.arena.is_none() {
                self.arena = BatchArena::plan(&self.rows, &self.reserved, self.allowance);
                self.no_arena = self.arena.is_none();
            }
            if let Some(a) = &mut self.arena {
                if a.make_room(&self.rows, layer) {
                    return a.attend(&mut self.rows, layer, queries, keys, values, scale);
                }
                // Growing would take the arena past its budget: these rows attend one by
                // one from here (every layer is full at the same step).
                self.no_arena = true;
            }
        }
        if self.arena.is_some() {
            self.settle()?;
        }
        if window.is_none() {
            // Row by row, each row that can still attends in one node of its own
            // (`PagedKvCache::update_and_attend`), and counts itself.
            if let Some(out) =
                attend_in_one_node(&mut self.rows, layer, queries, keys, values, scale)?
            {
                count_decode_path(true, self.rows.len());
                self.one_node_layers += 1;
                return Ok(out);
            }
            self.row_by_row_layers += 1;
        }
        let (h, d) = (s[1], s[3]);
        let n = self.rows.len();
        // One split per input (a single graph node each) instead of a slice per row.
        let (ks, vs, qs) = (
            mlx::ops::split(keys, n, 0)?,
            mlx::ops::split(values, n, 0)?,
            mlx::ops::split(queries, n, 0)?,
        );
        let mut out = Vec::with_capacity(n);
        for (((row, k), v), q) in self.rows.iter_mut().zip(&ks).zip(&vs).zip(&qs) {
            if window.is_none() {
                // A row with a shared prefix attends over it and its own KV as two parts.
                let none = mlx::fast::AttentionMask::None;
                out.push(row.update_and_attend(layer, q, k, v, scale, none)?);
                continue;
            }
            let (mut rk, mut rv) = row.update_and_fetch(layer, k, v)?;
            let t = rk.shape()[2];
            if let Some(w) = window.filter(|&w| (w as i32) < t) {
                // The query at position t-1 sees keys t-w .. t-1 (visible()).
                let start = t - w as i32;
                rk = rk.slice(&[0, 0, start, 0], &[1, h, t, d])?;
                rv = rv.slice(&[0, 0, start, 0], &[1, h, t, rv.shape()[3]])?;
                // A 16-bit view that starts past its buffer's first token could take MLX's
                // cuDNN decode, which reads it from the buffer's start (docs/cache.md,
                // "Arena lengths and the GPU's decode attention"): the window is copied.
                if matches!(rk.dtype(), mlx::Dtype::F16 | mlx::Dtype::BF16) {
                    (rk, rv) = (rk.contiguous()?, rv.contiguous()?);
                }
            }
            out.push(mlx::fast::scaled_dot_product_attention(
                q,
                &rk,
                &rv,
                scale,
                mlx::fast::AttentionMask::None,
            )?);
        }
        let refs: Vec<&Array> = out.iter().collect();
        Ok(mlx::ops::concatenate(&refs, 0)?)
    }

    /// Every row's state of state layer `layer`, each part stacked along axis 0 into
    /// `[B, ..]`; `None` when no row has one yet (rows that all start empty). Rows whose
    /// states differ in presence or shape are an error.
    pub fn layer_states(&self, layer: usize) -> Result<Option<LayerState>, CacheError> {
        if self.arena.is_some() {
            return Err(CacheError::Config(
                "layer states of a batch held in an arena (settle it first)".into(),
            ));
        }
        let states: Vec<Option<LayerState>> = self
            .rows
            .iter()
            .map(|r| r.layer_state(layer))
            .collect::<Result<_, _>>()?;
        if states.iter().all(Option::is_none) {
            return Ok(None);
        }
        let states: Vec<LayerState> =
            states.into_iter().collect::<Option<_>>().ok_or_else(|| {
                CacheError::Shape(format!(
                    "state layer {layer}: some rows have a state, some not"
                ))
            })?;
        let parts = states[0].len();
        if states.iter().any(|s| s.len() != parts) {
            return Err(CacheError::Shape(format!(
                "state layer {layer}: rows hold different numbers of state arrays"
            )));
        }
        (0..parts)
            .map(|p| {
                let refs: Vec<&Array> = states.iter().map(|s| &s[p]).collect();
                Ok(mlx::ops::concatenate(&refs, 0)?)
            })
            .collect::<Result<_, _>>()
            .map(Some)
    }

    /// Sets every row's state of state layer `layer` after `tokens` more tokens from
    /// batched parts `[B, ..]`: row b gets slice b of each.
    pub fn set_layer_states(
        &mut self,
        layer: usize,
        tokens: usize,
        state: &[Array],
    ) -> Result<(), CacheError> {
        self.settle()?;
        let b = self.rows.len() as i32;
        if let Some(bad) = state.iter().find(|a| a.shape().first() != Some(&b)) {
            return Err(CacheError::Shape(format!(
                "state layer {layer}: a batched state of shape {:?} for {b} rows",
                bad.shape()
            )));
        }
        for (i, row) in self.rows.iter_mut().enumerate() {
            let part = state
                .iter()
                .map(|a| {
                    let mut start = vec![0; a.ndim()];
                    let mut stop = a.shape().to_vec();
                    start[0] = i as i32;
                    stop[0] = i as i32 + 1;
                    a.slice(&start, &stop)
                })
                .collect::<Result<_, _>>()?;
            row.set_layer_state(layer, tokens, part)?;
        }
        Ok(())
    }

    /// The boolean mask `[B, 1, L, T]` for the last `queries` tokens of every row after
    /// [`PagedKvRows::update_and_fetch`] on `layer`: padding hidden, causal, and limited to
    /// the last `window` positions when windowed.
    pub fn decode_mask(
        &self,
        layer: usize,
        queries: usize,
        window: Option<usize>,
    ) -> Result<Array, CacheError> {
        let lens = self.lens(layer);
        let t = lens.iter().copied().max().unwrap_or(0);
        let mut allowed = Vec::with_capacity(lens.len() * queries * t);
        for &len in &lens {
            let pad = t - len;
            for i in 0..queries {
                let q = len.saturating_sub(queries) + i;
                for j in 0..t {
                    allowed.push((j >= pad && visible(q, j - pad, window)) as u8);
                }
            }
        }
        Ok(Array::from_bytes(
            &allowed,
            &[lens.len() as i32, 1, queries as i32, t as i32],
            Dtype::Bool,
        )?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::PagedConfig;

    fn row(tokens: i32, seed: u64) -> PagedKvCache {
        let mut c = PagedKvCache::new(1, PagedConfig::default()).unwrap();
        let k = mlx::random::normal(
            &[1, 2, tokens, 8],
            Dtype::F32,
            &mlx::random::key(seed).unwrap(),
        )
        .unwrap();
        c.append(0, &k, &k).unwrap();
        c
    }

    /// A cache of `layers` layers holding `tokens` random tokens (values: twice the keys).
    fn layered(layers: usize, tokens: i32, seed: u64) -> PagedKvCache {
        let config = PagedConfig {
            block_size: 4,
            initial_blocks: 2,
            ..PagedConfig::default()
        };
        let mut c = PagedKvCache::new(layers, config).unwrap();
        for l in 0..layers {
            let key = mlx::random::key(seed * 10 + l as u64).unwrap();
            let k = mlx::random::normal(&[1, 2, tokens, 8], Dtype::F32, &key).unwrap();
            c.append(l, &k, &k.mul_scalar(2.0).unwrap()).unwrap();
        }
        c
    }

    /// Rows of `(tokens, seed)` with the batch arena on, and copies of them to decode alone.
    fn arena_rows(rows: &[(i32, u64)]) -> (PagedKvRows, Vec<PagedKvCache>) {
        let mut batch = PagedKvRows::new();
        batch.set_batch_arena(true).unwrap();
        let mut alone = Vec::new();
        for &(n, seed) in rows {
            let c = layered(2, n, seed);
            alone.push(c.clone());
            batch.push(c).unwrap();
        }
        (batch, alone)
    }

    /// One decode step of `rows` (random keys and values, through `attend`) and the same
    /// tokens appended to `alone`, row b's to `alone[b]`.
    fn step(rows: &mut PagedKvRows, alone: &mut [&mut PagedKvCache], seed: u64) {
        let b = rows.len() as i32;
        let layers = alone[0].layers();
        for l in 0..layers {
            let key = mlx::random::key(seed * 100 + l as u64).unwrap();
            let k = mlx::random::normal(&[b, 2, 1, 8], Dtype::F32, &key).unwrap();
            let v = k.mul_scalar(-3.0).unwrap();
            let out = rows.attend(l, &k, &k, &v, 0.5, None).unwrap();
            mlx::eval(&[&out]).unwrap();
            for (i, c) in alone.iter_mut().enumerate() {
                let i = i as i32;
                let ki = k.slice(&[i, 0, 0, 0], &[i + 1, 2, 1, 8]).unwrap();
                let vi = v.slice(&[i, 0, 0, 0], &[i + 1, 2, 1, 8]).unwrap();
                c.append(l, &ki, &vi).unwrap();
            }
        }
    }

    /// Asserts that `got` holds exactly the KV `want` holds.
    fn assert_same_kv(got: &PagedKvCache, want: &PagedKvCache) {
        assert!(!got.is_lent());
        assert_eq!(got.offset(), want.offset());
        for l in 0..want.layers() {
            let (gk, gv) = got.fetch(l).unwrap().unwrap();
            let (wk, wv) = want.fetch(l).unwrap().unwrap();
            for (g, w) in [(gk, wk), (gv, wv)] {
                assert_eq!(g.shape(), w.shape());
                assert_eq!(g.to_vec::<f32>().unwrap(), w.to_vec::<f32>().unwrap());
            }
        }
    }

    /// Asserts that the arena is the only home of every row's KV.
    fn assert_all_lent(rows: &PagedKvRows) {
        for i in 0..rows.len() {
            let r = rows.row(i).unwrap();
            assert!(r.is_lent(), "row {i}");
            assert_eq!(r.device_bytes(), 0, "row {i} holds device buffers");
            for l in 0..r.layers() {
                assert!(r.pool(l).is_none() && r.block_table(l).is_empty());
                assert!(r.fetch(l).is_err(), "a lent layer cannot be read");
            }
        }
    }

    #[test]
    fn a_row_in_the_arena_holds_no_pools_and_gets_its_exact_kv_back() {
        let (mut rows, mut alone) = arena_rows(&[(5, 1), (7, 2), (6, 3)]);
        for s in 0..3 {
            step(&mut rows, &mut alone.iter_mut().collect::<Vec<_>>(), s);
            assert!(rows.has_arena());
            assert_all_lent(&rows);
            for (i, a) in alone.iter().enumerate() {
                assert_eq!(rows.row(i).unwrap().offset(), a.offset());
            }
        }
        // The batch's KV is on the device once: 2 layers × K and V × 4 slots (the ladder's
        // rung for 3 rows) × 2 heads × 256 columns × 8 dims × 4 bytes.
        assert_eq!(rows.device_bytes(), 2 * 2 * 4 * 2 * 256 * 8 * 4);
        assert!(rows.row(0).unwrap().clone().trim(1).is_err());
        // A shorter row joins: it gives its pools up at once.
        let c = layered(2, 4, 4);
        alone.push(c.clone());
        rows.push(c).unwrap();
        assert!(rows.has_arena());
        assert_all_lent(&rows);
        step(&mut rows, &mut alone.iter_mut().collect::<Vec<_>>(), 3);
        // A row that leaves gets its whole KV back in a fresh pool; the others stay lent.
        let gone = rows.filter(&[0, 2, 3]).unwrap();
        assert!(rows.has_arena());
        assert_all_lent(&rows);
        assert_same_kv(&gone[0], &alone[1]);
        let pool = gone[0].pool(0).unwrap();
        let blocks = gone[0].offset().div_ceil(4);
        assert_eq!(pool.capacity(), crate::ladder_capacity(2, 4096, 4, blocks));
        let mut alone: Vec<PagedKvCache> = [0, 2, 3].iter().map(|&i| alone[i].clone()).collect();
        step(&mut rows, &mut alone.iter_mut().collect::<Vec<_>>(), 4);
        // A row handed out mutably has its KV, and so has every other row.
        rows.row_mut(1).unwrap().unwrap();
        assert!(!rows.has_arena());
        for (i, a) in alone.iter().enumerate() {
            assert_same_kv(rows.row(i).unwrap(), a);
        }
        step(&mut rows, &mut alone.iter_mut().collect::<Vec<_>>(), 5);
        assert!(rows.has_arena());
        for (got, want) in rows.into_rows().unwrap().iter().zip(&alone) {
            assert_same_kv(got, want);
        }
    }

    /// A windowed decode step of 16-bit rows longer than their window attends each row's
    /// query over exactly its last `window` keys (the window's copy of the arena, made so
    /// that MLX's cuDNN decode never reads an offset view), as attention over those keys
    /// computed alone does.
    #[test]
    fn a_windowed_step_of_bf16_rows_attends_each_rows_last_window() {
        let (window, lens) = (8usize, [13i32, 21]);
        let mut rows = PagedKvRows::new();
        let mut want = Vec::new();
        let key = |s: u64| mlx::random::key(s).unwrap();
        let q = mlx::random::normal(&[2, 4, 1, 8], Dtype::F32, &key(90))
            .unwrap()
            .astype(Dtype::BF16)
            .unwrap();
        let k = mlx::random::normal(&[2, 2, 1, 8], Dtype::F32, &key(91))
            .unwrap()
            .astype(Dtype::BF16)
            .unwrap();
        let v = k.mul_scalar(-2.0).unwrap();
        for (b, &n) in lens.iter().enumerate() {
            let mut c = PagedKvCache::new(1, PagedConfig::default()).unwrap();
            let old = mlx::random::normal(&[1, 2, n, 8], Dtype::F32, &key(b as u64))
                .unwrap()
                .astype(Dtype::BF16)
                .unwrap();
            c.append(0, &old, &old.mul_scalar(3.0).unwrap()).unwrap();
            rows.push(c).unwrap();
            let i = b as i32;
            let kb = k.slice(&[i, 0, 0, 0], &[i + 1, 2, 1, 8]).unwrap();
            let vb = v.slice(&[i, 0, 0, 0], &[i + 1, 2, 1, 8]).unwrap();
            let qb = q.slice(&[i, 0, 0, 0], &[i + 1, 4, 1, 8]).unwrap();
            let all_k = mlx::ops::concatenate(&[&old, &kb], 2).unwrap();
            let all_v = mlx::ops::concatenate(&[&old.mul_scalar(3.0).unwrap(), &vb], 2).unwrap();
            let (t, w) = (n + 1, window as i32);
            let last = |a: &Array| {
                a.slice(&[0, 0, t - w, 0], &[1, 2, t, 8])
                    .unwrap()
                    .contiguous()
                    .unwrap()
            };
            let none = mlx::fast::AttentionMask::None;
            want.push(
                mlx::fast::scaled_dot_product_attention(
                    &qb,
                    &last(&all_k),
                    &last(&all_v),
                    0.5,
                    none,
                )
                .unwrap(),
            );
        }
        let got = rows.attend(0, &q, &k, &v, 0.5, Some(window)).unwrap();
        let want = mlx::ops::concatenate(&want.iter().collect::<Vec<_>>(), 0).unwrap();
        let f = |a: &Array| a.astype(Dtype::F32).unwrap().to_vec::<f32>().unwrap();
        assert_eq!(f(&got), f(&want));
    }

    #[test]
    fn a_bad_filter_changes_nothing() {
        for arena in [false, true] {
            let mut rows = PagedKvRows::new();
            rows.set_batch_arena(arena).unwrap();
            for (n, seed) in [(5, 1), (7, 2), (6, 3)] {
                rows.push(row(n, seed)).unwrap();
            }
            if arena {
                let q = mlx::ops::zeros(&[3, 2, 1, 8], Dtype::F32).unwrap();
                rows.attend(0, &q, &q, &q, 1.0, None).unwrap();
                assert!(rows.has_arena());
            }
            assert!(rows.filter(&[0, 2, 0]).is_err(), "a row kept twice");
            assert!(rows.filter(&[3]).is_err(), "a row that is not there");
            assert_eq!(rows.len(), 3);
            assert_eq!(rows.has_arena(), arena);
            let gone = rows.filter(&[2, 0]).unwrap();
            let lens: Vec<usize> = gone.iter().map(|c| c.offset()).collect();
            let ahead = usize::from(arena);
            assert_eq!(lens, vec![7 + ahead]);
            let kept: Vec<usize> = rows
                .into_rows()
                .unwrap()
                .iter()
                .map(|c| c.offset())
                .collect();
            assert_eq!(kept, vec![6 + ahead, 5 + ahead]);
        }
    }
}

#[cfg(test)]
#[path = "rows_kernel_tests.rs"]
mod rows_kernel_tests;
