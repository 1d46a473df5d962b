//! A shared prefix: the read-only first tokens of a resident sequence that a live cache
//! starts with instead of a copy (docs/cache.md, "Shared prefixes").
//!
//! The [`ResidentPool`](crate::ResidentPool) entry keeps one [`ShareHandle`]'s counter; every
//! cache holding a view of its arenas holds a clone. The entry's live sharers are the clones
//! outside it, so a cache that ends (dropped, or parked and later evicted) releases its
//! share without telling the pool, and a parked sharer keeps its source referenced while it
//! is resident (a refcount tree).

use std::sync::Arc;

use mlx::Array;

use crate::pool::BlockShape;

/// A reference to a resident entry whose arenas a cache reads its prefix from.
#[derive(Clone, Debug)]
pub struct ShareHandle {
    entry: u64,
    count: Arc<()>,
}

impl ShareHandle {
    /// The entry's own handle (no sharer yet).
    pub(crate) fn new(entry: u64) -> Self {
        Self {
            entry,
            count: Arc::new(()),
        }
    }

    /// The resident entry's id.
    pub fn entry(&self) -> u64 {
        self.entry
    }

    /// Handles alive besides this one (the entry's own): its live sharers.
    pub(crate) fn others(&self) -> usize {
        Arc::strong_count(&self.count) - 1
    }
}

/// One layer's shared prefix: views of a resident sequence's arena parts (K parts then V
/// parts, `[1, H, len, width]` each, in the storage format) covering its first `len` tokens.
#[derive(Clone, Debug)]
pub(crate) struct LayerPrefix {
    /// The views; never written (the entry is not altered while it has sharers).
    pub(crate) parts: Vec<Array>,
    /// Tokens they cover.
    pub(crate) len: usize,
    /// The resident pool's block shape.
    pub(crate) shape: BlockShape,
    /// Keeps the resident pool from writing its arenas in place while the views are alive
    /// ([`crate::pool::BlockPool::view_token`]).
    pub(crate) _holds: Arc<()>,
}

impl LayerPrefix {
    /// The first `len` tokens of this prefix (views of views: no copy).
    pub(crate) fn cut(&self, len: usize) -> Result<Self, mlx::Error> {
        let parts = self
            .parts
            .iter()
            .map(|p| {
                let s = p.shape();
                p.slice(&[0, 0, 0, 0], &[s[0], s[1], len as i32, s[3]])
            })
            .collect::<Result<_, _>>()?;
        Ok(Self {
            parts,
            len,
            shape: self.shape,
            _holds: Arc::clone(&self._holds),
        })
    }

    /// Positions `from..to` of the prefix, per part (views).
    pub(crate) fn range(&self, from: usize, to: usize) -> Result<Vec<Array>, mlx::Error> {
        self.parts
            .iter()
            .map(|p| {
                let s = p.shape();
                p.slice(&[0, 0, from as i32, 0], &[s[0], s[1], to as i32, s[3]])
            })
            .collect()
    }
}
