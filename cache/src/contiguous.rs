//! [`ContiguousKvCache`]: keys and values concatenated per layer, nothing else. The
//! reference that paged caches are checked against.

use mlx::Array;

use crate::{CacheError, KvCache};

/// A plain KV cache: one growing contiguous array per layer for keys and for values.
#[derive(Clone, Debug)]
pub struct ContiguousKvCache {
    layers: Vec<Option<(Array, Array)>>,
}

impl ContiguousKvCache {
    /// An empty cache for `layers` layers.
    pub fn new(layers: usize) -> Self {
        Self {
            layers: vec![None; layers],
        }
    }
}

fn seq_len(a: &Array) -> usize {
    a.shape().get(2).copied().unwrap_or(0) as usize
}

impl KvCache for ContiguousKvCache {
    fn layers(&self) -> usize {
        self.layers.len()
    }

    fn layer_offset(&self, layer: usize) -> usize {
        match self.layers.get(layer) {
            Some(Some((k, _))) => seq_len(k),
            _ => 0,
        }
    }

    fn update_and_fetch(
        &mut self,
        layer: usize,
        keys: &Array,
        values: &Array,
    ) -> Result<(Array, Array), CacheError> {
        let layers = self.layers.len();
        let slot = self
            .layers
            .get_mut(layer)
            .ok_or(CacheError::NoSuchLayer { layer, layers })?;
        if keys.ndim() != 4 || keys.shape() != values.shape() {
            return Err(CacheError::Shape(format!(
                "keys {:?} and values {:?} must both be [1, kv_heads, L, head_dim]",
                keys.shape(),
                values.shape()
            )));
        }
        let (k, v) = match slot.take() {
            None => (keys.clone(), values.clone()),
            Some((k, v)) => (
                mlx::ops::concatenate(&[&k, keys], 2)?,
                mlx::ops::concatenate(&[&v, values], 2)?,
            ),
        };
        *slot = Some((k.clone(), v.clone()));
        Ok((k, v))
    }

    fn trim(&mut self, tokens: usize) -> Result<usize, CacheError> {
        let mut trimmed = 0;
        for slot in &mut self.layers {
            let Some((k, v)) = slot.take() else {
                continue;
            };
            let len = seq_len(&k);
            let n = tokens.min(len);
            trimmed = trimmed.max(n);
            if n < len {
                let keep = |a: &Array| {
                    let mut stop = a.shape().to_vec();
                    stop[2] = (len - n) as i32;
                    a.slice(&[0, 0, 0, 0], &stop)
                };
                *slot = Some((keep(&k)?, keep(&v)?));
            }
        }
        Ok(trimmed)
    }
}
