//! A reusable host buffer per thread for the bulk transfers of cache/src/host.rs.
//!
//! A fresh `Vec` of tens of megabytes is paid for twice: the kernel maps and zeroes every
//! page on first touch, which on the H200's host ran at ~1.3 GB/s and was most of a
//! publication's or restore's time once the copies to and from the GPU went through the
//! driver (docs/benchmarks.md, "Host ⇄ device copies"). Each thread that publishes or
//! restores (the export thread, the engine thread) keeps one buffer and reuses it. Where
//! direct transfers run (CUDA), the buffer is page-locked ([`mlx::PinnedBuffer`]), so the
//! driver copies it by DMA instead of through a staging buffer of its own.

use std::cell::RefCell;

/// Buffers up to this size stay with their thread between uses; a larger request gets an
/// ordinary buffer of its own, freed afterwards.
pub(crate) const KEEP_BYTES: usize = 256 << 20;

/// A thread's first buffer of ordinary memory has at least this size: a conversation's
/// restores grow from a few blocks to hundreds of megabytes.
const FIRST_BYTES: usize = 16 << 20;

enum Scratch {
    Heap(Vec<u8>),
    Pinned(mlx::PinnedBuffer),
}

impl Scratch {
    /// A buffer of at least `len` bytes: page-locked where possible.
    fn with_len(len: usize) -> Self {
        match mlx::PinnedBuffer::new(len) {
            Some(p) => Scratch::Pinned(p),
            None => Scratch::Heap(vec![0u8; len]),
        }
    }

    fn bytes(&mut self) -> &mut [u8] {
        match self {
            Scratch::Heap(v) => v,
            Scratch::Pinned(p) => p,
        }
    }
}

thread_local! {
    /// Two buffers per thread: a pipelined restore fills one while the other is uploaded.
    static SCRATCH: RefCell<[Option<Scratch>; 2]> = const { RefCell::new([None, None]) };
}

/// The size of the buffer that replaces one of `have` bytes (0: none yet) for a request of
/// `len` bytes (at most [`KEEP_BYTES`]). Page-locked memory goes straight to the kept size,
/// so a thread page-locks once and never frees: page-locking (`cuMemHostAlloc`) and
/// unlocking (`cuMemFreeHost`, which waits for the whole device) are driver calls that held
/// up the engine thread's launches for up to a second (docs/benchmarks.md, session 42).
/// Ordinary memory grows ×1.5 at least, so a run of slowly growing requests reallocates
/// rarely.
fn grown_len(have: usize, len: usize, page_locked: bool) -> usize {
    match page_locked {
        true => KEEP_BYTES,
        false => len.max(have + have / 2).clamp(FIRST_BYTES, KEEP_BYTES),
    }
}

/// `slot`'s buffer with at least `len` bytes (grown by [`grown_len`]), or `None` over the
/// kept size.
fn kept(slot: &mut Option<Scratch>, len: usize) -> Option<&mut [u8]> {
    if len > KEEP_BYTES {
        // Not kept: page-locking it would cost more than the copy it speeds up.
        return None;
    }
    let big_enough = slot.as_mut().is_some_and(|s| s.bytes().len() >= len);
    if !big_enough {
        let have = slot.as_mut().map_or(0, |s| s.bytes().len());
        *slot = Some(Scratch::with_len(grown_len(
            have,
            len,
            mlx::direct_transfers(),
        )));
    }
    slot.as_mut().map(|s| &mut s.bytes()[..len])
}

/// Gives the calling thread's first `slots` buffers (at most 2) their kept size now, where
/// they are page-locked (CUDA), so that no transfer of the thread page-locks memory later
/// (an engine's thread and its export thread call it as they start); returns the bytes
/// page-locked. Nothing where transfers do not go through the driver (the CPU).
pub fn prewarm_scratch(slots: usize) -> usize {
    if !mlx::direct_transfers() {
        return 0;
    }
    SCRATCH.with(|cell| {
        let Ok(mut held) = cell.try_borrow_mut() else {
            return 0;
        };
        let mut made = 0;
        for slot in held.iter_mut().take(slots) {
            let before = slot.as_mut().map_or(0, |s| s.bytes().len());
            if kept(slot, KEEP_BYTES).is_some() {
                made += slot.as_mut().map_or(0, |s| s.bytes().len()) - before;
            }
        }
        made
    })
}

/// Runs `f` on a host buffer of `len` bytes whose contents are unspecified (the caller
/// overwrites all of it).
pub(crate) fn with_scratch<R>(len: usize, f: impl FnOnce(&mut [u8]) -> R) -> R {
    SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut slots) => match kept(&mut slots[0], len) {
            Some(a) => f(a),
            None => f(&mut vec![0u8; len]),
        },
        // Re-entered on this thread (not done today): a buffer of its own.
        Err(_) => f(&mut Scratch::with_len(len.max(1)).bytes()[..len]),
    })
}

/// Runs `f` on two distinct host buffers of `len` bytes each, contents unspecified: one is
/// filled while the other is moved to the device. The second is empty when `len` is 0.
pub(crate) fn with_scratch_pair<R>(len: usize, f: impl FnOnce(&mut [u8], &mut [u8]) -> R) -> R {
    let own = || vec![0u8; len];
    SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut slots) => {
            let [a, b] = &mut *slots;
            match (kept(a, len), kept(b, len)) {
                (Some(a), Some(b)) => f(a, b),
                (Some(a), None) => f(a, &mut own()),
                (None, Some(b)) => f(&mut own(), b),
                (None, None) => f(&mut own(), &mut own()),
            }
        }
        // Re-entered on this thread (not done today): buffers of its own.
        Err(_) => f(
            &mut Scratch::with_len(len.max(1)).bytes()[..len],
            &mut Scratch::with_len(len.max(1)).bytes()[..len],
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_reuses_its_buffer_and_larger_requests_get_their_own() {
        let first = with_scratch(1000, |b| {
            b.fill(7);
            b.as_ptr() as usize
        });
        // Same thread, not larger: the same memory, holding what was written.
        let (again, seen) = with_scratch(500, |b| (b.as_ptr() as usize, b[499]));
        assert_eq!((again, seen), (first, 7));
        // Larger: a new buffer of the size asked.
        assert_eq!(with_scratch(5000, |b| b.len()), 5000);
        assert_eq!(with_scratch(KEEP_BYTES + 1, |b| b.len()), KEEP_BYTES + 1);
    }

    #[test]
    fn page_locked_buffers_grow_once_to_the_kept_size_and_ordinary_ones_by_half() {
        // Page-locked: whatever the request, the first buffer and any replacement are the
        // kept size, so a thread allocates one and frees none.
        assert_eq!(grown_len(0, 1000, true), KEEP_BYTES);
        assert_eq!(grown_len(FIRST_BYTES, FIRST_BYTES + 1, true), KEEP_BYTES);
        // Ordinary memory: at least the first size, then ×1.5, never past the kept size.
        assert_eq!(grown_len(0, 1000, false), FIRST_BYTES);
        assert_eq!(
            grown_len(FIRST_BYTES, FIRST_BYTES + 1, false),
            FIRST_BYTES * 3 / 2
        );
        assert_eq!(grown_len(FIRST_BYTES, 100 << 20, false), 100 << 20);
        assert_eq!(grown_len(200 << 20, 201 << 20, false), KEEP_BYTES);
    }

    #[test]
    fn prewarming_page_locks_the_kept_size_once_and_nothing_on_the_cpu() {
        // Each test runs on a thread of its own: its buffers start unmade.
        let at = |len| with_scratch_pair(len, |a, b| (a.as_ptr() as usize, b.as_ptr() as usize));
        if mlx::direct_transfers() {
            // Prewarming page-locks both buffers at the kept size; a request of any kept size
            // then reuses them, and prewarming again makes nothing. (Before session 54 the
            // test used the buffers first, which on a GPU already made them at the kept
            // size, so the prewarm it checked made nothing and the test failed there.)
            assert_eq!(prewarm_scratch(2), 2 * KEEP_BYTES);
            assert_eq!(at(KEEP_BYTES), at(64));
            assert_eq!(prewarm_scratch(2), 0);
        } else {
            // No page-locked memory: nothing is made and the buffers stay as they were.
            let small = at(64);
            assert_eq!(prewarm_scratch(2), 0);
            assert_eq!(at(64), small);
        }
    }

    #[test]
    fn a_pair_is_two_distinct_buffers_and_its_first_is_the_single_buffer() {
        let single = with_scratch(64, |b| {
            b.fill(3);
            b.as_ptr() as usize
        });
        let (a, b, seen) = with_scratch_pair(64, |a, b| {
            b.fill(9);
            (a.as_ptr() as usize, b.as_ptr() as usize, a[63])
        });
        assert_eq!((a, seen), (single, 3));
        assert_ne!(a, b);
        assert_eq!(
            with_scratch_pair(KEEP_BYTES + 1, |a, b| (a.len(), b.len())),
            (KEEP_BYTES + 1, KEEP_BYTES + 1)
        );
    }
}
