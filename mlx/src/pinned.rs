//! [`PinnedBuffer`]: page-locked host memory for bulk host ⇄ device copies on CUDA.
//!
//! The CUDA driver copies pageable memory through a staging buffer of its own; page-locked
//! memory it reads and writes directly (DMA). A thread that moves KV in bulk (publication,
//! restore) assembles it in one of these and reuses it (cache/src/scratch.rs).

use crate::ffi::ffi;

/// Page-locked host bytes (`cuMemHostAlloc`), freed on drop.
pub struct PinnedBuffer {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer is plain host memory owned by this value alone (no other handle to it
// exists); moving it to another thread and freeing it there is sound, as for a `Vec<u8>`.
unsafe impl Send for PinnedBuffer {}
// SAFETY: a shared reference gives only `&[u8]` (reads of plain host memory); writes need
// `&mut`.
unsafe impl Sync for PinnedBuffer {}

impl PinnedBuffer {
    /// `len` bytes of page-locked memory (contents unspecified), or `None` where direct
    /// transfers are unavailable ([`crate::direct_transfers`]) or the driver refuses.
    pub fn new(len: usize) -> Option<Self> {
        if len == 0 || !crate::direct_transfers() {
            return None;
        }
        let ptr = ffi::pinned_alloc(len) as *mut u8;
        (!ptr.is_null()).then_some(Self { ptr, len })
    }

    /// Bytes in the buffer.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no bytes (never: `new` refuses 0).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl std::ops::Deref for PinnedBuffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len` bytes this value owns until drop.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl std::ops::DerefMut for PinnedBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        ffi::pinned_free(self.ptr as usize);
    }
}

impl std::fmt::Debug for PinnedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedBuffer")
            .field("len", &self.len)
            .finish()
    }
}
