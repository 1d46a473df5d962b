//! [`LayerStates`]: the state a sequence's non-attention layers carry beside its paged KV
//! (a short convolution's last inputs, a recurrent state matrix), and what rewinding it
//! means.
//!
//! An attention layer keeps every token's keys and values, so dropping the last tokens is
//! cutting its table. A recurrent or convolutional layer keeps one fixed-size state that
//! folds every token in: it cannot be cut back. What can be rewound is a state that was
//! kept: every update pushes the state it replaces onto a short history (`depth` entries,
//! array handles only, no copy), and [`LayerStates::rewind`] returns to one of them. The
//! generation loops compute one step ahead and drop that step when the token before it
//! ended the sequence (`trim(1)`): a depth of [`DEFAULT_STATE_HISTORY`] covers that.
//! Rewinding to zero tokens is always possible (the empty state).
//!
//! Snapshots: with [`LayerStates::with_snapshots`], a layer also keeps its state whenever
//! the tokens it folded in reach a multiple of the interval (the model splits its steps
//! there, see `Model::forward`), for as long as the sequence lives. A sequence can then be
//! rewound to any snapshot too: the device tier forks a hybrid's resident sequence at the
//! latest snapshot inside the shared prefix and recomputes the rest. Anything else is
//! refused with [`CacheError::Rewind`] and changes nothing.

use std::collections::{BTreeMap, VecDeque};

use mlx::Array;

use crate::CacheError;

/// Earlier states each layer keeps for rewinding: the one-step-ahead decode drops at most
/// one step; the second entry covers a step queued behind it.
pub const DEFAULT_STATE_HISTORY: usize = 2;

/// The state of one non-attention layer: its arrays, as the layer's forward pass defines
/// them (opaque to the cache), each with the batch on axis 0.
pub type LayerState = Vec<Array>;

#[derive(Clone, Debug, Default)]
struct Slot {
    /// Tokens folded into `current`.
    len: usize,
    current: Option<LayerState>,
    /// Earlier `(len, state)` pairs, oldest first.
    history: VecDeque<(usize, Option<LayerState>)>,
    /// States at multiples of the snapshot interval, by tokens folded in.
    snapshots: BTreeMap<usize, LayerState>,
}

/// The states of a sequence's non-attention layers ("state layers", numbered `0..` in
/// model order, apart from the attention layers' numbering).
///
/// `Clone` is cheap (array handles) and gives independent states.
#[derive(Clone, Debug, Default)]
pub struct LayerStates {
    slots: Vec<Slot>,
    depth: usize,
    snapshot_every: Option<usize>,
}

impl LayerStates {
    /// Empty states for `layers` state layers, each keeping `depth` earlier states.
    pub fn new(layers: usize, depth: usize) -> Self {
        Self {
            slots: vec![Slot::default(); layers],
            depth,
            snapshot_every: None,
        }
    }

    /// These states, keeping a snapshot every `tokens` tokens (none for 0).
    pub fn with_snapshots(mut self, tokens: usize) -> Self {
        self.snapshot_every = (tokens > 0).then_some(tokens);
        self
    }

    /// Tokens between snapshots, if snapshots are kept.
    pub fn snapshot_every(&self) -> Option<usize> {
        self.snapshot_every
    }

    /// The state of `layer` after its first `tokens` tokens, if a snapshot (or the current
    /// state) holds exactly that.
    pub fn state_at(&self, layer: usize, tokens: usize) -> Option<&LayerState> {
        let s = self.slots.get(layer)?;
        if s.len == tokens {
            return s.current.as_ref();
        }
        s.snapshots.get(&tokens)
    }

    /// State layers.
    pub fn layers(&self) -> usize {
        self.slots.len()
    }

    fn slot(&self, layer: usize) -> Result<&Slot, CacheError> {
        let layers = self.slots.len();
        self.slots
            .get(layer)
            .ok_or(CacheError::NoSuchLayer { layer, layers })
    }

    /// Tokens folded into the state of `layer` (0 for a layer past the end).
    pub fn len(&self, layer: usize) -> usize {
        self.slots.get(layer).map_or(0, |s| s.len)
    }

    /// The state of `layer`; `None` before its first token.
    pub fn get(&self, layer: usize) -> Result<Option<&LayerState>, CacheError> {
        Ok(self.slot(layer)?.current.as_ref())
    }

    /// Sets the state of `layer` after `tokens` more tokens, keeping the state it replaces
    /// for [`LayerStates::rewind`].
    pub fn update(
        &mut self,
        layer: usize,
        tokens: usize,
        state: LayerState,
    ) -> Result<(), CacheError> {
        let layers = self.slots.len();
        let depth = self.depth;
        let s = self
            .slots
            .get_mut(layer)
            .ok_or(CacheError::NoSuchLayer { layer, layers })?;
        if depth > 0 {
            s.history.push_back((s.len, s.current.take()));
            while s.history.len() > depth {
                s.history.pop_front();
            }
        }
        s.len += tokens;
        if self
            .snapshot_every
            .is_some_and(|every| s.len.is_multiple_of(every))
        {
            s.snapshots.insert(s.len, state.clone());
        }
        s.current = Some(state);
        Ok(())
    }

    /// Whether every layer can drop its last `tokens` tokens (see [`LayerStates::rewind`]).
    pub fn can_rewind(&self, tokens: usize) -> bool {
        self.slots.iter().all(|s| s.target(tokens).is_some())
    }

    /// The most tokens, at most `max`, that every layer can be rewound to: `max` itself when
    /// there are no state layers, else the latest kept point at or before it (0 at worst).
    pub fn rewind_point(&self, max: usize) -> usize {
        let Some(first) = self.slots.first() else {
            return max;
        };
        std::iter::once(first.len)
            .chain(first.history.iter().map(|(l, _)| *l))
            .chain(first.snapshots.keys().copied())
            .filter(|&t| t <= max && self.slots.iter().all(|s| s.len >= t))
            .filter(|&t| self.slots.iter().all(|s| s.target(s.len - t).is_some()))
            .max()
            .unwrap_or(0)
    }

    /// Drops the last `tokens` tokens of every layer (all of them if fewer are held) by
    /// returning to a kept earlier state. Refused, with nothing changed, when a layer kept
    /// no state at that point.
    pub fn rewind(&mut self, tokens: usize) -> Result<(), CacheError> {
        if let Some(s) = self.slots.iter().find(|s| s.target(tokens).is_none()) {
            return Err(CacheError::Rewind {
                tokens,
                held: s.len,
                kept: s
                    .history
                    .iter()
                    .map(|(l, _)| *l)
                    .chain(s.snapshots.keys().copied())
                    .collect(),
            });
        }
        for s in &mut self.slots {
            match s.target(tokens) {
                Some(Target::Keep) | None => {}
                Some(Target::Empty) => *s = Slot::default(),
                Some(Target::Kept(i)) => {
                    let (len, state) = s.history.remove(i).unwrap_or_default();
                    s.history.truncate(i);
                    s.len = len;
                    s.current = state;
                    s.snapshots.split_off(&(len + 1));
                }
                Some(Target::Snapshot(len)) => {
                    s.current = s.snapshots.get(&len).cloned();
                    s.len = len;
                    s.history.retain(|(l, _)| *l < len);
                    s.snapshots.split_off(&(len + 1));
                }
            }
        }
        Ok(())
    }

    /// Sets every layer's state after its first `tokens` tokens (a restore from a snapshot
    /// block): earlier history goes, the state is kept as a snapshot there.
    pub fn restore(&mut self, tokens: usize, states: Vec<LayerState>) -> Result<(), CacheError> {
        if states.len() != self.slots.len() {
            return Err(CacheError::Restore {
                position: 0,
                reason: format!(
                    "{} layer states for {} state layers",
                    states.len(),
                    self.slots.len()
                ),
            });
        }
        for (s, state) in self.slots.iter_mut().zip(states) {
            s.history.clear();
            s.snapshots.split_off(&tokens);
            s.snapshots.insert(tokens, state.clone());
            s.len = tokens;
            s.current = Some(state);
        }
        Ok(())
    }

    /// Device bytes of the current states and snapshots (the short history shares most of
    /// its arrays with them and is not counted).
    pub fn nbytes(&self) -> u64 {
        self.slots
            .iter()
            .flat_map(|s| s.current.iter().chain(s.snapshots.values()))
            .flatten()
            .map(|a| a.nbytes() as u64)
            .sum()
    }

    /// Forgets every state (a sequence started over).
    pub fn clear(&mut self) {
        for s in &mut self.slots {
            *s = Slot::default();
        }
    }
}

enum Target {
    Keep,
    Empty,
    Kept(usize),
    Snapshot(usize),
}

impl Slot {
    fn target(&self, tokens: usize) -> Option<Target> {
        let want = self.len.saturating_sub(tokens);
        if want == self.len {
            return Some(Target::Keep);
        }
        if want == 0 {
            return Some(Target::Empty);
        }
        match self.history.iter().rposition(|(l, _)| *l == want) {
            Some(i) => Some(Target::Kept(i)),
            None => self
                .snapshots
                .contains_key(&want)
                .then_some(Target::Snapshot(want)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::KvCache;

    fn state(v: f32) -> LayerState {
        vec![Array::from_slice(&[v], &[1, 1]).unwrap()]
    }

    fn value(s: &LayerStates, layer: usize) -> Option<f32> {
        s.get(layer)
            .unwrap()
            .map(|st| st[0].to_vec::<f32>().unwrap()[0])
    }

    #[test]
    fn rewinding_one_step_returns_the_state_before_it() {
        let mut s = LayerStates::new(2, 2);
        for layer in 0..2 {
            s.update(layer, 5, state(1.0)).unwrap();
            s.update(layer, 1, state(2.0)).unwrap();
            s.update(layer, 1, state(3.0)).unwrap();
        }
        s.rewind(1).unwrap();
        assert_eq!((s.len(0), value(&s, 0)), (6, Some(2.0)));
        s.rewind(1).unwrap();
        assert_eq!((s.len(1), value(&s, 1)), (5, Some(1.0)));
        // Nothing kept before 5 tokens but the empty state.
        assert!(!s.can_rewind(1));
        s.rewind(5).unwrap();
        assert_eq!((s.len(0), value(&s, 0)), (0, None));
    }

    #[test]
    fn rewinding_past_the_history_is_refused_and_changes_nothing() {
        let mut s = LayerStates::new(1, 1);
        s.update(0, 4, state(1.0)).unwrap();
        s.update(0, 1, state(2.0)).unwrap();
        s.update(0, 1, state(3.0)).unwrap();
        let err = s.rewind(2).unwrap_err();
        assert!(
            matches!(
                err,
                CacheError::Rewind {
                    tokens: 2,
                    held: 6,
                    ..
                }
            ),
            "{err}"
        );
        assert_eq!((s.len(0), value(&s, 0)), (6, Some(3.0)));
        // A multi-token step can only be undone whole.
        s.rewind(1).unwrap();
        assert_eq!(value(&s, 0), Some(2.0));
        assert!(s.can_rewind(5));
        assert_eq!(s.rewind_point(100), 5);
        assert_eq!(s.rewind_point(4), 0);
        assert_eq!(LayerStates::new(0, 2).rewind_point(7), 7);
    }

    fn kv(len: i32) -> Array {
        mlx::ops::zeros(&[1, 1, len, 2], mlx::Dtype::F32).unwrap()
    }

    /// One forward step of a hybrid with one attention and one state layer.
    fn step(cache: &mut crate::PagedKvCache, tokens: usize, v: f32) {
        cache
            .update_and_fetch(0, &kv(tokens as i32), &kv(tokens as i32))
            .unwrap();
        cache.set_layer_state(0, tokens, state(v)).unwrap();
    }

    #[test]
    fn a_paged_cache_trims_its_kv_and_its_layer_state_together_or_not_at_all() {
        let mut c = crate::PagedKvCache::with_default_config(1).with_state_layers(1);
        step(&mut c, 40, 1.0);
        step(&mut c, 1, 2.0);
        step(&mut c, 1, 3.0);
        assert_eq!(c.rewind_point(41), 41);
        assert_eq!(c.rewind_point(40), 40);
        assert_eq!(c.rewind_point(39), 0);
        assert!(matches!(c.trim(5), Err(CacheError::Rewind { .. })));
        assert_eq!((c.offset(), value(c.states(), 0)), (42, Some(3.0)));
        assert_eq!(c.trim(1).unwrap(), 1);
        assert_eq!((c.offset(), value(c.states(), 0)), (41, Some(2.0)));
    }

    #[test]
    fn snapshot_blocks_carry_the_states_and_a_restore_resumes_at_the_last_one() {
        let config = crate::PagedConfig {
            block_size: 4,
            ..crate::PagedConfig::default()
        };
        let fresh = || {
            crate::PagedKvCache::new(1, config)
                .unwrap()
                .with_state_layers(1)
        };
        let mut c = fresh().with_state_snapshots(2);
        // 13 one-token steps; the state's value is the tokens folded in.
        for t in 1..=13 {
            step(&mut c, 1, t as f32);
        }
        let mut chain = crate::Chain::new(store::NamespaceId([0; 32]), 4);
        let blocks = c.publish(&mut chain, &[7; 13]).unwrap();
        // Snapshots every 8 tokens: block 1 (tokens 4..8) carries the state, 0 and 2 not.
        let planes: Vec<usize> = blocks.iter().map(|b| b.planes.len()).collect();
        assert_eq!(planes, vec![2, 3, 2]);
        assert_eq!(blocks[1].planes[2].name, "states.0.0");
        let r = fresh().restore_onto(&blocks).unwrap();
        assert_eq!((r.blocks, r.state_cut), (2, 1));
        assert_eq!(r.cache.offset(), 8);
        assert_eq!(value(r.cache.states(), 0), Some(8.0));
        // Without a snapshot block nothing resumes.
        let r = fresh().restore_onto(&blocks[..1]).unwrap();
        assert_eq!((r.blocks, r.state_cut, r.cache.offset()), (0, 1, 0));
        // The K/V planes are a plain block's: a cache without state layers reads them (the
        // store keeps namespaces apart, so only tests mix them).
        let plain = crate::PagedKvCache::new(1, config).unwrap();
        assert_eq!(plain.restore_onto(&blocks).unwrap().blocks, 3);
    }

    #[test]
    fn rows_stack_each_rows_state_and_split_the_batched_update_back() {
        let mut rows = crate::PagedKvRows::new();
        for v in [1.0, 2.0] {
            let mut c = crate::PagedKvCache::with_default_config(1).with_state_layers(1);
            step(&mut c, 3, v);
            rows.push(c).unwrap();
        }
        let stacked = rows.layer_states(0).unwrap().unwrap();
        assert_eq!(stacked[0].shape(), &[2, 1]);
        assert_eq!(stacked[0].to_vec::<f32>().unwrap(), vec![1.0, 2.0]);
        let next = Array::from_slice(&[5.0f32, 6.0], &[2, 1]).unwrap();
        rows.set_layer_states(0, 1, &[next]).unwrap();
        assert_eq!(value(rows.row(1).unwrap().states(), 0), Some(6.0));
        assert_eq!(rows.row(0).unwrap().states().len(0), 4);
        // A row without state layers cannot join.
        assert!(rows
            .push(crate::PagedKvCache::with_default_config(1))
            .is_err());
        let wrong = Array::from_slice(&[5.0f32], &[1, 1]).unwrap();
        assert!(rows.set_layer_states(0, 1, &[wrong]).is_err());
    }

    #[test]
    fn snapshots_are_kept_at_every_interval_and_rewound_to() {
        let mut s = LayerStates::new(1, 1).with_snapshots(4);
        for (n, v) in [(4, 1.0), (3, 2.0), (1, 3.0), (1, 4.0), (3, 5.0)] {
            s.update(0, n, state(v)).unwrap();
        }
        // 12 tokens: snapshots at 4 and 8, history at 9.
        assert_eq!(s.rewind_point(11), 9);
        assert_eq!(s.rewind_point(7), 4);
        assert_eq!(s.state_at(0, 8).map(|st| st.len()), Some(1));
        assert!(s.state_at(0, 7).is_none());
        s.rewind(4).unwrap();
        assert_eq!((s.len(0), value(&s, 0)), (8, Some(3.0)));
        s.rewind(4).unwrap();
        assert_eq!((s.len(0), value(&s, 0)), (4, Some(1.0)));
        // The snapshot at 8 went with the tokens after 4.
        assert!(s.state_at(0, 8).is_none());
        assert!(s.rewind(1).is_err());
    }

    #[test]
    fn a_state_layer_past_the_end_is_an_error() {
        let mut s = LayerStates::new(1, 2);
        assert!(matches!(
            s.update(3, 1, state(0.0)),
            Err(CacheError::NoSuchLayer {
                layer: 3,
                layers: 1
            })
        ));
        assert!(s.get(1).is_err());
    }
}
