//! [`Export`]: newly full blocks of a live cache on their way to host bytes, off the thread
//! that runs the model.
//!
//! Publishing has two halves. On the engine thread, [`PagedKvCache::export`] takes device
//! copies of the new blocks (one copy per layer part into fresh buffers, so later writes
//! to the live arenas, in place or not, never reach them and never have to copy around
//! them) and starts computing them ([`mlx::async_eval`]). That costs a few kernel launches
//! and no host synchronization. The [`Export`] then crosses to an export thread, which
//! waits for the copies, reads them to the host in one transfer per layer part, splits
//! them into blocks and hashes them ([`Export::into_blocks`]): the transfer (slow on a
//! discrete GPU) and the hashing never stall a decode step.
//!
//! Why the crossing is sound: [`mlx::async_eval`] detaches every array it schedules from
//! its inputs before it returns, so the export's arrays share no graph node with anything
//! the engine thread still uses; the export thread only waits for them and reads them
//! (`unsafe impl Send for Array` in mlx/src/array.rs, crossing 4).

use mlx::Array;
use store::{Block, BlockMeta};

use crate::export_to_block_memory::BlockMemoryRun;
use crate::{host, CacheError, KvFormat, LayerState};

/// Device copies of a run of newly full blocks and what they become: see the module doc.
pub struct Export {
    /// Per layer, its parts (K parts then V parts), each `[1, H, n · block_size, width]`.
    pub(crate) parts: Vec<Vec<Array>>,
    pub(crate) format: KvFormat,
    pub(crate) block_size: usize,
    pub(crate) metas: Vec<BlockMeta>,
    /// Per block, the layer states a snapshot block carries (hybrids only).
    pub(crate) states: Vec<Option<Vec<LayerState>>>,
    /// Which blocks leave their window layers' planes out ([`host::WindowPlan`]); boxed,
    /// so an export stays small to move through a channel.
    pub(crate) window: Box<WindowExport>,
    /// Whether the blocks are window-trimmed copies that replace stored ones.
    pub(crate) replaces: bool,
    /// The run's planes written by the device straight into block memory (then `parts` is
    /// empty): [`BlockMemoryRun`].
    pub(crate) written: Option<BlockMemoryRun>,
}

/// The owned inputs of a [`host::WindowPlan`], carried to the export thread.
#[derive(Clone, Debug, Default)]
pub(crate) struct WindowExport {
    pub(crate) windows: Vec<Option<usize>>,
    pub(crate) ends: Vec<usize>,
    pub(crate) floor: usize,
}

impl WindowExport {
    fn plan(&self) -> host::WindowPlan<'_> {
        host::WindowPlan {
            windows: &self.windows,
            ends: &self.ends,
            floor: self.floor,
        }
    }
}

impl std::fmt::Debug for Export {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Export")
            .field("blocks", &self.metas.len())
            .field("device_bytes", &self.device_bytes())
            .finish()
    }
}

impl Export {
    /// Blocks in the run.
    pub fn blocks(&self) -> usize {
        self.metas.len()
    }

    /// The namespace and key of each block, in chain order.
    pub fn keys(&self) -> impl Iterator<Item = (store::NamespaceId, store::BlockKey)> + '_ {
        self.metas.iter().map(|m| (m.namespace, m.key))
    }

    /// Of them, those that leave their window layers' planes out.
    pub fn window_trimmed_blocks(&self) -> usize {
        let plan = self.window.plan();
        if plan.widest().is_none() {
            return 0;
        }
        let bs = self.block_size;
        self.metas
            .iter()
            .filter(|m| {
                let start = m.position as usize * bs;
                !plan.keeps(start, start + bs)
            })
            .count()
    }

    /// Whether the blocks are window-trimmed copies of stored blocks, to be inserted in
    /// their place ([`store::Store::insert_replacing`]) rather than beside them.
    pub fn replaces(&self) -> bool {
        self.replaces
    }

    /// The arrays it waits for (the device copies it reads back, or the node writing the
    /// planes into block memory, then any layer states), for a reader that waits for
    /// several exports at once (`mlx::eval` of all of them).
    pub fn device_arrays(&self) -> Vec<&Array> {
        let states = self.states.iter().flatten().flatten().flatten();
        let written = self.written.as_ref().map(BlockMemoryRun::done);
        self.parts
            .iter()
            .flatten()
            .chain(written)
            .chain(states)
            .collect()
    }

    /// Device bytes the copies hold until [`Self::into_blocks`] has read them (none where
    /// the device writes the planes into block memory).
    pub fn device_bytes(&self) -> u64 {
        let states = self.states.iter().flatten().flatten().flatten();
        self.parts
            .iter()
            .flatten()
            .chain(states)
            .map(|a| a.nbytes() as u64)
            .sum()
    }

    /// Whether the device writes the planes straight into page-locked block memory (no
    /// read-back, no split on the host: docs/cache.md, "Publication into block memory").
    pub fn written_to_block_memory(&self) -> bool {
        self.written.is_some()
    }

    /// Waits for the device copies and turns them into host-byte blocks (one transfer per
    /// layer part, split on the host), or waits for the planes written into block memory.
    pub fn into_blocks(self) -> Result<Vec<Block>, CacheError> {
        if let Some(written) = self.written {
            let states: Vec<&Array> = self.states.iter().flatten().flatten().flatten().collect();
            if !states.is_empty() {
                mlx::eval(&states)?;
            }
            let planes = written.into_planes()?;
            return host::assemble_blocks(self.metas, planes, self.states);
        }
        host::blocks_from_run(
            self.parts,
            self.format,
            self.block_size,
            self.metas,
            self.states,
            self.window.plan(),
        )
    }
}
