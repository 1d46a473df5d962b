//! Page-locked host memory for the planes of published blocks and for the block files the
//! store reads from the SSD (CUDA): the host tiers then keep blocks where the device can
//! read them, so that a restore from RAM or SSD is one gather node per layer part reading
//! every block where it lies ([`mlx::host_upload::gather_rows`]), with no assembly on the
//! host and nothing waited for on the engine thread. A publication is written into it by
//! the device in the same way (crate::export_to_block_memory).
//!
//! Memory comes in slabs of [`SLAB_BYTES`] up to a cap ([`allow_block_memory`]: an engine
//! on a GPU passes its RAM tier's budget plus its SSD write-behind queue's, or
//! `KVSTORE_PINNED_BLOCKS_MIB`, where 0 keeps every plane in ordinary memory), page-locked
//! when the engine starts ([`prewarm_block_memory`]; else as they are needed), and never
//! freed: unlocking (`cuMemFreeHost`) waits for the whole device. A slab is carved into
//! chunks of a plane's (or a file's) size; a chunk dropped with the last copy of its block
//! goes back to a free list of its size. Past the cap, planes are ordinary memory and
//! restore the ordinary way (docs/cache.md, "Restore from page-locked blocks").

use std::collections::HashMap;
#[cfg(test)]
use std::sync::atomic::AtomicBool;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use mlx::PinnedBuffer;

/// Bytes page-locked at a time.
const SLAB_BYTES: usize = 64 << 20;

/// Every chunk starts at a multiple of this (the gather kernel reads 16-byte words).
const ALIGN: usize = 256;

/// Bytes of page-locked block memory a process may hold (0: none).
static CAP: AtomicUsize = AtomicUsize::new(0);

/// The slabs of every chunk.
static MEMORY: Mutex<Slabs<Slab>> = Mutex::new(Slabs::new());

/// A slab's memory: page-locked, or (this crate's unit tests on the CPU, which has none)
/// ordinary memory standing in for it.
enum Slab {
    Pinned(PinnedBuffer),
    #[cfg(test)]
    Heap(Vec<u8>),
}

impl std::ops::Deref for Slab {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Slab::Pinned(b) => b,
            #[cfg(test)]
            Slab::Heap(v) => v,
        }
    }
}

/// A new slab of `len` bytes: page-locked, else (unit tests that asked) ordinary memory.
fn new_slab(len: usize) -> Option<Slab> {
    if let Some(b) = PinnedBuffer::new(len) {
        return Some(Slab::Pinned(b));
    }
    #[cfg(test)]
    if HEAP_SLABS.load(Ordering::Relaxed) {
        return Some(Slab::Heap(vec![0u8; len]));
    }
    None
}

/// Unit tests: ordinary memory stands in for page-locked slabs (the CPU has none), so that
/// the in-place restore's table and node run on the CPU.
#[cfg(test)]
static HEAP_SLABS: AtomicBool = AtomicBool::new(false);

/// Unit tests: lets blocks' planes take ordinary memory standing in for page-locked slabs,
/// up to 256 MiB, and staged restores read them in place on the CPU.
#[cfg(test)]
pub(crate) fn stand_in_for_tests() {
    HEAP_SLABS.store(true, Ordering::Relaxed);
    allow_block_memory(256 << 20);
}

/// Whether a staged restore may read blocks in place without a GPU: only in this crate's
/// unit tests, after [`stand_in_for_tests`].
pub(crate) fn stands_in() -> bool {
    #[cfg(test)]
    return HEAP_SLABS.load(Ordering::Relaxed);
    #[cfg(not(test))]
    false
}

/// The block memory `KVSTORE_PINNED_BLOCKS_MIB` asks for, in bytes (0: none, every plane
/// in ordinary memory), or `None` where it is unset or not a number: an engine on a GPU then
/// sizes it as its host tiers ([`block_memory_for`]).
pub fn requested_block_memory() -> Option<usize> {
    std::env::var("KVSTORE_PINNED_BLOCKS_MIB")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .map(|mib| mib << 20)
}

/// The block memory of an engine whose RAM tier holds `ram_budget` bytes and whose
/// write-behind queue to the SSD `ssd_queue` (0 without an SSD): `requested` where given,
/// else both budgets, so that every block the host tiers keep in memory can be there (a cap
/// below them would leave the oldest blocks in block memory and every new one outside it,
/// restored the slower way).
pub fn block_memory_for(requested: Option<usize>, ram_budget: u64, ssd_queue: u64) -> usize {
    requested.unwrap_or_else(|| {
        usize::try_from(ram_budget.saturating_add(ssd_queue)).unwrap_or(usize::MAX)
    })
}

/// Lets publication and the store's file reads page-lock up to `bytes` for blocks (whole
/// slabs), or more where an earlier call allowed more (engines of one process share the
/// memory); an engine on a GPU calls it with [`requested_block_memory`].
pub fn allow_block_memory(bytes: usize) {
    CAP.fetch_max(bytes, Ordering::Relaxed);
    if bytes > 0 {
        // Block files the store reads are put in the same memory, so that blocks loaded
        // from the SSD restore in place too.
        static REGISTERED: std::sync::Once = std::sync::Once::new();
        REGISTERED.call_once(|| {
            store::set_block_buffers(Box::new(FileBuffers));
        });
    }
}

/// Page-locks the block memory's slabs up to the cap now (an engine calls it as it starts,
/// after [`allow_block_memory`]), so that no publication or SSD read makes the driver call
/// beside the engine thread's launches (docs/cache.md, "Staged restore": such calls stalled
/// them for up to a second under the trace); returns the bytes page-locked.
pub fn prewarm_block_memory() -> usize {
    let cap = CAP.load(Ordering::Relaxed);
    let Ok(mut m) = MEMORY.lock() else {
        return 0;
    };
    let made = m.reserve(cap, new_slab);
    if m.refused && m.page_locked() + SLAB_BYTES <= cap {
        tracing::warn!(
            page_locked = m.page_locked(),
            asked = cap,
            "the driver page-locked less block memory than the host tiers' budgets ask for \
             (a locked-memory limit: `ulimit -l`, or too little free memory): blocks past it \
             stay in ordinary memory and restore through the staging copies; lower \
             --ram-budget, raise the limit, or set KVSTORE_PINNED_BLOCKS_MIB"
        );
    }
    made
}

/// The store's buffers for block files: chunks of block memory while it has room.
struct FileBuffers;

impl store::BlockBuffers for FileBuffers {
    fn buffer(&self, len: usize) -> Option<Box<dyn store::BlockBuffer>> {
        PinnedChunk::take(len).map(|c| Box::new(c) as Box<dyn store::BlockBuffer>)
    }
}

impl store::BlockBuffer for PinnedChunk {}

/// What the page-locked block memory holds now.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BlockMemory {
    /// The cap ([`allow_block_memory`]).
    pub cap: usize,
    /// Bytes page-locked (whole slabs).
    pub page_locked: usize,
    /// Bytes of chunks held by planes now.
    pub in_use: usize,
}

/// The block memory's figures now.
pub fn block_memory() -> BlockMemory {
    let cap = CAP.load(Ordering::Relaxed);
    MEMORY.lock().map_or(
        BlockMemory {
            cap,
            ..BlockMemory::default()
        },
        |m| BlockMemory {
            cap,
            page_locked: m.page_locked(),
            in_use: m.in_use,
        },
    )
}

/// Slabs of type `S` carved into chunks: generic so that the carving is tested with
/// ordinary memory.
struct Slabs<S> {
    /// Every slab, never freed, with its address range, sorted by address.
    slabs: Vec<(usize, usize, S)>,
    /// The slab being carved (its address, its length and the bytes of it carved so far;
    /// what is left of it when a chunk no longer fits stays unused).
    carving: Option<(usize, usize, usize)>,
    /// Slabs page-locked ahead ([`prewarm_block_memory`]) and not carved yet.
    spare: Vec<(usize, usize)>,
    /// Free chunks by their rounded size.
    free: Option<HashMap<usize, Vec<usize>>>,
    in_use: usize,
    /// Whether a slab was refused (the driver's page-locking limit, or no memory): no
    /// further slab is asked for, so that no later publication pays a failing driver call.
    refused: bool,
}

impl<S: std::ops::Deref<Target = [u8]>> Slabs<S> {
    const fn new() -> Self {
        Self {
            slabs: Vec::new(),
            carving: None,
            spare: Vec::new(),
            free: None,
            in_use: 0,
            refused: false,
        }
    }

    fn page_locked(&self) -> usize {
        self.slabs.iter().map(|(_, len, _)| len).sum()
    }

    /// The address of a chunk of `len` bytes: a free one of its size, else carved from the
    /// current slab, else from a new slab of `alloc` while the slabs stay within `cap`.
    fn take(
        &mut self,
        len: usize,
        cap: usize,
        alloc: impl FnOnce(usize) -> Option<S>,
    ) -> Option<usize> {
        let size = len.checked_next_multiple_of(ALIGN)?;
        if size == 0 || size > SLAB_BYTES {
            return None;
        }
        if let Some(addr) = self.free.as_mut().and_then(|f| f.get_mut(&size)?.pop()) {
            self.in_use += size;
            return Some(addr);
        }
        let room = |c: &Option<(usize, usize, usize)>| {
            c.is_some_and(|(_, slab, used)| slab - used >= size)
        };
        if !room(&self.carving) {
            let (addr, slab_len) = match self.spare.pop() {
                Some(s) => s,
                None => self.add_slab(cap, alloc)?,
            };
            // Page-locked slabs start on a page; others on the alignment's next multiple.
            self.carving = Some((addr, slab_len, addr.next_multiple_of(ALIGN) - addr));
        }
        let (addr, slab_len, used) = self.carving?;
        self.carving = Some((addr, slab_len, used + size));
        self.in_use += size;
        Some(addr + used)
    }

    /// A new slab from `alloc` while the slabs stay within `cap`: its address and length.
    fn add_slab(
        &mut self,
        cap: usize,
        alloc: impl FnOnce(usize) -> Option<S>,
    ) -> Option<(usize, usize)> {
        if self.refused || self.page_locked() + SLAB_BYTES > cap {
            return None;
        }
        let Some(slab) = alloc(SLAB_BYTES) else {
            self.refused = true;
            return None;
        };
        let (addr, slab_len) = (slab.as_ptr() as usize, slab.len());
        let at = self.slabs.partition_point(|(a, _, _)| *a < addr);
        self.slabs.insert(at, (addr, slab_len, slab));
        Some((addr, slab_len))
    }

    /// Allocates slabs up to `cap` now, kept spare for later chunks; returns the bytes made.
    fn reserve(&mut self, cap: usize, mut alloc: impl FnMut(usize) -> Option<S>) -> usize {
        let before = self.page_locked();
        while let Some(s) = self.add_slab(cap, &mut alloc) {
            self.spare.push(s);
        }
        self.page_locked() - before
    }

    /// Takes the chunk at `addr` of `len` bytes back.
    fn give(&mut self, addr: usize, len: usize) {
        let size = len.next_multiple_of(ALIGN);
        self.in_use -= size;
        self.free
            .get_or_insert_with(HashMap::new)
            .entry(size)
            .or_default()
            .push(addr);
    }

    /// Whether `len` bytes at `addr` lie inside one slab.
    fn holds(&self, addr: usize, len: usize) -> bool {
        let at = self.slabs.partition_point(|(a, _, _)| *a <= addr);
        at > 0 && {
            let (start, slab_len, _) = &self.slabs[at - 1];
            addr + len <= start + slab_len
        }
    }
}

/// One plane's bytes in page-locked block memory, given back when dropped (with the last
/// copy of the `bytes::Bytes` that owns it).
pub(crate) struct PinnedChunk {
    addr: usize,
    len: usize,
}

// SAFETY: the chunk's bytes are plain host memory that no other value addresses until the
// chunk is dropped (the slabs hand each address out once and are never freed).
unsafe impl Send for PinnedChunk {}
// SAFETY: a shared reference gives only reads; writes need `&mut`.
unsafe impl Sync for PinnedChunk {}

impl PinnedChunk {
    /// A chunk of `len` bytes (contents unspecified), or `None` where no block memory is
    /// allowed ([`allow_block_memory`]), the cap is reached or the driver refuses.
    pub(crate) fn take(len: usize) -> Option<Self> {
        let cap = CAP.load(Ordering::Relaxed);
        if cap == 0 || len == 0 {
            return None;
        }
        let addr = MEMORY.lock().ok()?.take(len, cap, new_slab)?;
        Some(Self { addr, len })
    }

    /// A chunk for a node's table of at least `len` bytes: a power of two, so that tables
    /// reuse each other's chunks whatever their lengths.
    pub(crate) fn take_table(len: usize) -> Option<Self> {
        Self::take(len.max(1).next_power_of_two())
    }
}

impl AsRef<[u8]> for PinnedChunk {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `len` bytes at `addr` belong to this chunk alone until it is dropped, and
        // the slab holding them is never freed.
        unsafe { std::slice::from_raw_parts(self.addr as *const u8, self.len) }
    }
}

impl AsMut<[u8]> for PinnedChunk {
    fn as_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_ref`, and `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.addr as *mut u8, self.len) }
    }
}

impl Drop for PinnedChunk {
    fn drop(&mut self) {
        if let Ok(mut m) = MEMORY.lock() {
            m.give(self.addr, self.len);
        }
    }
}

/// Whether any block memory is allowed (else no plane can lie in it).
pub(crate) fn allowed() -> bool {
    CAP.load(Ordering::Relaxed) > 0
}

/// Whether every one of `planes` lies in page-locked block memory (planes published while
/// it was allowed, or slices of them); `false` for none or an empty one.
pub(crate) fn all_in_block_memory(planes: &[&[u8]]) -> bool {
    if planes.is_empty() || !allowed() {
        return false;
    }
    let Ok(m) = MEMORY.lock() else {
        return false;
    };
    planes
        .iter()
        .all(|p| !p.is_empty() && m.holds(p.as_ptr() as usize, p.len()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slab(n: usize) -> Option<Vec<u8>> {
        Some(vec![0u8; n])
    }

    #[test]
    fn block_memory_is_sized_as_the_host_tiers_unless_asked_for() {
        assert_eq!(block_memory_for(None, 4 << 30, 1 << 30), 5 << 30);
        assert_eq!(block_memory_for(None, 1 << 30, 0), 1 << 30);
        assert_eq!(block_memory_for(Some(0), 4 << 30, 1 << 30), 0);
        assert_eq!(block_memory_for(Some(8 << 20), 4 << 30, 0), 8 << 20);
        assert_eq!(block_memory_for(None, u64::MAX, 1), usize::MAX);
    }

    #[test]
    fn chunks_are_carved_aligned_reused_by_size_and_held_within_the_cap() {
        let mut s: Slabs<Vec<u8>> = Slabs::new();
        let cap = 2 * SLAB_BYTES;
        let a = s.take(1000, cap, slab).unwrap();
        let b = s.take(1000, cap, slab).unwrap();
        assert_eq!(a % ALIGN, 0);
        assert_eq!(
            b,
            a + 1024,
            "carved one after the other, each rounded to the alignment"
        );
        assert!(s.holds(a, 1000) && s.holds(b + 10, 990));
        assert!(!s.holds(a + SLAB_BYTES, 1), "past the slab");
        assert_eq!(s.in_use, 2048);
        // Given back, a chunk of the same size is reused before anything is carved.
        s.give(a, 1000);
        assert_eq!(s.take(1024, cap, slab), Some(a));
        // A chunk larger than a slab is never made.
        assert_eq!(s.take(SLAB_BYTES + 1, cap, slab), None);
        // A chunk the first slab has no room left for opens a second; another would need a
        // third, past the cap.
        let big = SLAB_BYTES - 2 * ALIGN;
        let c = s.take(big, cap, slab).unwrap();
        assert_eq!(s.page_locked(), 2 * SLAB_BYTES);
        assert!(s.holds(c, big) && !s.holds(a, SLAB_BYTES));
        assert_eq!(s.take(big, cap, slab), None, "the cap is reached");
        // Given back, it serves the next chunk of its size without a new slab.
        s.give(c, big);
        assert_eq!(s.take(big, cap, slab), Some(c));
        // Slabs reserved ahead are carved before any new one is made.
        let mut r: Slabs<Vec<u8>> = Slabs::new();
        assert_eq!(r.reserve(cap, slab), 2 * SLAB_BYTES);
        assert_eq!(r.reserve(cap, slab), 0, "the cap is reached");
        let never = |_| -> Option<Vec<u8>> { panic!("no slab is made past the reserve") };
        let x = r.take(big, cap, never).unwrap();
        let y = r.take(big, cap, never).unwrap();
        assert!(r.holds(x, big) && r.holds(y, big) && x != y);
        assert_eq!(r.take(big, cap, never), None);
        // The driver refusing leaves nothing counted.
        let mut t: Slabs<Vec<u8>> = Slabs::new();
        assert_eq!(t.take(10, cap, |_| None), None);
        assert_eq!((t.page_locked(), t.in_use), (0, 0));
        // ... and is not asked again: no later publication pays a failing driver call.
        assert_eq!(t.take(10, cap, never), None);
        assert_eq!(t.reserve(cap, never), 0);
        // A reserve the driver cuts short keeps what it made, and asks no more after.
        let mut u: Slabs<Vec<u8>> = Slabs::new();
        let mut made = 0;
        let once = |n| {
            made += 1;
            (made == 1).then(|| vec![0u8; n])
        };
        assert_eq!(u.reserve(cap, once), SLAB_BYTES);
        assert!(u.refused);
        assert!(u.take(big, cap, never).is_some(), "the slab made is carved");
        assert_eq!(u.take(big, cap, never), None);
    }

    #[test]
    fn memory_outside_every_slab_is_not_block_memory() {
        assert!(PinnedChunk::take(0).is_none());
        assert!(!all_in_block_memory(&[&[0u8; 16]]));
        assert!(!all_in_block_memory(&[]));
    }
}
