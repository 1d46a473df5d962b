//! [`PagedKvRows`]: several sequences decoding together, each in its own paged cache,
//! fetched as one left-padded batch.

use mlx::{Array, Dtype};

use crate::batch_arena::BatchArena;
use crate::mask::visible;
use crate::{CacheError, KvCache, LayerState, PagedKvCache};

/// A batch of rows (sequences) for decoding. Row `b` keeps its own [`PagedKvCache`]; a
/// step appends each row's new keys and values and fetches all rows as one
/// `[B, H, T, D]` batch, left-padded with zeros to the longest row `T`.
///
/// With the batch arena on (the default on a GPU), [`PagedKvRows::attend`] keeps the
/// batch's KV in one right-aligned array per layer while the rows stay the same, and
/// writes the tokens decoded meanwhile back to the rows' caches when the batch changes or
/// a row is read (module `batch_arena`).
#[derive(Default)]
pub struct PagedKvRows {
    rows: Vec<PagedKvCache>,
    /// Whether [`PagedKvRows::attend`] may use a batch arena.
    use_arena: bool,
    arena: Option<BatchArena>,
    /// The rows cannot share an arena (checked once per set of rows).
    no_arena: bool,
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
    /// An empty batch, with the batch arena on where MLX computes on a GPU (there a step's
    /// per-row attention calls cost more in launches than in arithmetic; on the CPU they
    /// do not, and each row attends over its own cache).
    pub fn new() -> Self {
        PagedKvRows {
            use_arena: matches!(mlx::default_device(), Ok(mlx::Device::Gpu)),
            ..Self::default()
        }
    }

    /// Turns the batch arena on or off (tests run it on the CPU; the numbers differ from
    /// per-row attention only by float rounding). Writes back what an arena holds first.
    pub fn set_batch_arena(&mut self, on: bool) -> Result<(), CacheError> {
        self.settle()?;
        self.no_arena = false;
        self.use_arena = on;
        Ok(())
    }

    /// Whether a batch arena holds the batch now.
    pub fn has_arena(&self) -> bool {
        self.arena.is_some()
    }

    /// Writes the tokens an arena holds back to the rows' caches and drops the arena (the
    /// next step builds a new one): before the set of rows changes or a row is read.
    pub fn settle(&mut self) -> Result<(), CacheError> {
        if let Some(mut a) = self.arena.take() {
            a.sync(&mut self.rows)?;
        }
        Ok(())
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
    /// and the row fits it).
    pub fn push(&mut self, row: PagedKvCache) -> Result<(), CacheError> {
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
            match a.join(&row) {
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
        Ok(())
    }

    /// Appends the rows of another batch after this one's.
    pub fn merge(&mut self, other: PagedKvRows) -> Result<(), CacheError> {
        for r in other.into_rows()? {
            self.push(r)?;
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
        // The rows that leave get their tokens back; the arena keeps the others.
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
        Ok(slots.into_iter().flatten().collect())
    }

    /// An independent copy of row `i`.
    pub fn extract(&mut self, i: usize) -> Result<PagedKvCache, CacheError> {
        self.settle()?;
        self.rows
            .get(i)
            .cloned()
            .ok_or_else(|| CacheError::Shape(format!("row {i} of a batch of {}", self.rows.len())))
    }

    /// Row `i` as its cache holds it: without the tokens a batch arena holds and has not
    /// written back yet ([`PagedKvRows::settle`] writes them; [`PagedKvRows::offsets`]
    /// counts them).
    pub fn row(&self, i: usize) -> Option<&PagedKvCache> {
        self.rows.get(i)
    }

    /// Row `i`, mutably (to publish it, for example).
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
        let offs: Vec<i32> = self
            .rows
            .iter()
            .enumerate()
            .map(|(b, r)| (r.offset() + self.ahead(b)) as i32)
            .collect();
        Ok(Array::from_slice(&offs, &[offs.len() as i32])?)
    }

    /// Each row's length in `layer`, with the tokens an arena holds.
    fn lens(&self, layer: usize) -> Vec<usize> {
        self.rows
            .iter()
            .enumerate()
            .map(|(b, r)| r.layer_offset(layer) + self.ahead(b))
            .collect()
    }

    /// Tokens row `b` holds in the batch arena beyond its cache.
    fn ahead(&self, b: usize) -> usize {
        self.arena.as_ref().map_or(0, |a| a.unsynced(b))
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
    /// batch arena (unwindowed layers of rows that fit one), one write and one masked
    /// attention for the whole batch; otherwise one fused attention per row over its own
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
            if self.arena.is_none() {
                self.arena = BatchArena::plan(&self.rows);
                self.no_arena = self.arena.is_none();
            }
            if let Some(a) = &mut self.arena {
                return a.attend(&self.rows, layer, queries, keys, values, scale);
            }
        }
        if self.arena.is_some() {
            self.settle()?;
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
            let (mut rk, mut rv) = row.update_and_fetch(layer, k, v)?;
            let t = rk.shape()[2];
            if let Some(w) = window.filter(|&w| (w as i32) < t) {
                // The query at position t-1 sees keys t-w .. t-1 (visible()).
                let start = t - w as i32;
                rk = rk.slice(&[0, 0, start, 0], &[1, h, t, d])?;
                rv = rv.slice(&[0, 0, start, 0], &[1, h, t, rv.shape()[3]])?;
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
