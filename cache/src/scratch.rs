//! A reusable host buffer per thread for the bulk transfers of cache/src/host.rs.
//!
//! A fresh `Vec` of tens of megabytes is paid for twice: the kernel maps and zeroes every
//! page on first touch, which on the H200's host ran at ~1.5 GB/s and was most of a
//! publication's or restore's time once the copies to and from the GPU went through the
//! driver (docs/benchmarks.md, "Host ⇄ device copies"). Each thread that publishes or
//! restores (the export thread, the engine thread) keeps one buffer and reuses it.

use std::cell::RefCell;

/// Buffers up to this size stay with their thread between uses; a larger request gets a
/// buffer of its own, freed afterwards.
const KEEP_BYTES: usize = 256 << 20;

thread_local! {
    static SCRATCH: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` on a host buffer of `len` bytes whose contents are unspecified (the caller
/// overwrites all of it).
pub(crate) fn with_scratch<R>(len: usize, f: impl FnOnce(&mut [u8]) -> R) -> R {
    if len > KEEP_BYTES {
        return f(&mut vec![0u8; len]);
    }
    SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut buf) => {
            if buf.len() < len {
                buf.resize(len, 0);
            }
            f(&mut buf[..len])
        }
        // Re-entered on this thread (not done today): a buffer of its own.
        Err(_) => f(&mut vec![0u8; len]),
    })
}
