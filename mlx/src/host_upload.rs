//! [`upload_rows`]: an array of zeros with rows of host bytes in it, read when its node runs
//! in the graph, not when it is made.
//!
//! A restore's upload through the driver (`write_rows_direct`) makes the thread that calls
//! it wait for the bytes to cross the bus, and that thread is the engine's. Here the upload
//! is a node (`HostRowsUpload`, mlx/src/host_upload.cc): on CUDA a kernel reads the rows
//! from page-locked host memory that the device can address into zeros an MLX op made,
//! ordered with the prefill that reads the array like any other node. The host bytes are
//! lent to the node: [`upload_rows`] takes a shared handle to their owner and keeps it until
//! the node's command buffer has completed, or the node is dropped unevaluated.

use std::collections::HashMap;
use std::ops::{Deref, Range};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::array::Array;
use crate::dtype::Dtype;
use crate::error::{Error, Result};
use crate::ffi::ffi;

/// What a node holds while it may still read host bytes: the owner of those bytes.
pub(crate) type Lent = Box<dyn Send>;

/// Host bytes lent to nodes, by token.
static LENT: Mutex<Option<HashMap<u64, Lent>>> = Mutex::new(None);

/// The next token.
static NEXT: AtomicU64 = AtomicU64::new(1);

/// Drops the owner lent under `token` (called by the shim when its node is done with the
/// bytes; a token not lent is ignored).
pub(crate) fn release(token: u64) {
    let taken = match LENT.lock() {
        Ok(mut lent) => lent.as_mut().and_then(|m| m.remove(&token)),
        // A panic while the map was held: the bytes stay lent (never freed early).
        Err(_) => None,
    };
    // Dropped outside the lock: an owner's drop may take other locks (a buffer pool).
    drop(taken);
}

/// Owners of host bytes lent to nodes now (tests and diagnostics).
pub fn lent_count() -> usize {
    LENT.lock()
        .ok()
        .and_then(|l| l.as_ref().map(HashMap::len))
        .unwrap_or(0)
}

/// Whether this build has the GPU kernel of [`upload_rows`] (a CUDA build with the backend's
/// headers); the CPU evaluation is in every build.
pub fn upload_rows_kernel_built() -> bool {
    ffi::host_rows_kernel_built()
}

/// Whether a GPU restore from page-locked staging should go through [`upload_rows`]: the
/// kernel is built and `KVSTORE_UPLOAD_NODES` is not `0` (read once; `0` restores through
/// the driver's copies, for measuring both paths).
pub fn upload_rows_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        upload_rows_kernel_built()
            && std::env::var("KVSTORE_UPLOAD_NODES").map_or(true, |v| v != "0")
    })
}

/// An array of `shape` and `dtype` holding zeros except `height` rows of `width` bytes,
/// taken in order from `owner[range]` and placed at a pitch of `pitch` bytes from the
/// array's start: computed when the array is evaluated, on the default device's stream. On
/// CUDA the bytes must be page-locked memory the device can address ([`crate::PinnedBuffer`]);
/// on the CPU any memory. `owner` is kept (and with it the bytes) until the node has read
/// them.
pub fn upload_rows<B>(
    shape: &[i32],
    dtype: Dtype,
    owner: Arc<B>,
    range: Range<usize>,
    width: usize,
    height: usize,
    pitch: usize,
) -> Result<Array>
where
    B: Deref<Target = [u8]> + Send + Sync + 'static,
{
    let Some(src) = owner.get(range.clone()) else {
        return Err(Error::InvalidArgument {
            op: "upload_rows",
            message: format!("bytes {range:?} of a buffer of {}", owner.len()),
        });
    };
    let (addr, len) = (src.as_ptr() as usize, src.len());
    let token = lend("upload_rows", Box::new(owner))?;
    // From here the shim owns the lending: every outcome, an error included, releases it.
    Array::wrap(
        "upload_rows",
        ffi::host_rows_upload(shape, dtype.code(), addr, len, width, height, pitch, token),
    )
}

/// Registers `owner` as lent to a node; returns its token.
pub(crate) fn lend(op: &'static str, owner: Lent) -> Result<u64> {
    let token = NEXT.fetch_add(1, Ordering::Relaxed);
    match LENT.lock() {
        Ok(mut lent) => {
            lent.get_or_insert_with(HashMap::new).insert(token, owner);
            Ok(token)
        }
        Err(_) => Err(Error::InvalidArgument {
            op,
            message: "the registry of lent host bytes is poisoned".into(),
        }),
    }
}

/// One row of [`gather_rows`]: `width` bytes at `src` go to byte `at` of the array.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct GatherRow {
    /// The row's address in host memory.
    pub src: u64,
    /// Its byte offset in the array.
    pub at: u64,
}

/// An array of `shape` and `dtype` holding zeros except the rows of `table`, each `width`
/// bytes read from its `src` and placed at its `at`: computed when the array is evaluated,
/// on the default device's stream, like [`upload_rows`] but from rows scattered over host
/// memory (blocks a host tier keeps where they lie, with no assembly). `owner` is kept
/// until the node has read the rows; rows that land outside the array are refused here.
///
/// # Safety
///
/// `table` and every row it names (`width` bytes from each `src`) must be memory that
/// `owner` keeps alive and unchanged until it is dropped. On CUDA all of it must be
/// page-locked memory the device can read ([`crate::PinnedBuffer`] and memory carved from
/// one); on the CPU any memory.
pub unsafe fn gather_rows<O>(
    shape: &[i32],
    dtype: Dtype,
    owner: Arc<O>,
    table: &[GatherRow],
    width: usize,
) -> Result<Array>
where
    O: Send + Sync + 'static,
{
    let (addr, entries) = (table.as_ptr() as usize, table.len());
    let token = lend("gather_rows", Box::new(owner))?;
    // From here the shim owns the lending: every outcome, an error included, releases it.
    Array::wrap(
        "gather_rows",
        ffi::host_rows_gather(shape, dtype.code(), addr, entries, width, token),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The naive reference: zeros, then each row copied at its pitch.
    fn expected(total: usize, src: &[u8], width: usize, height: usize, pitch: usize) -> Vec<u8> {
        let mut out = vec![0u8; total];
        for r in 0..height {
            out[r * pitch..r * pitch + width].copy_from_slice(&src[r * width..(r + 1) * width]);
        }
        out
    }

    #[test]
    fn the_rows_land_at_their_pitch_with_zeros_around_them_and_the_bytes_come_back_once_read() {
        // [1, 2 heads, 8 tokens, 4] f32: each head's first 3 tokens (48 bytes) at a pitch of
        // 8 tokens (128 bytes), as a restore of 3 tokens into an arena of 8 lays them out.
        let src: Vec<u8> = (0..96u32).map(|i| (i * 7 + 1) as u8).collect();
        let owner = Arc::new(src.clone());
        let a = upload_rows(&[1, 2, 8, 4], Dtype::F32, owner.clone(), 0..96, 48, 2, 128).unwrap();
        // Lent until the node runs: the owner is held by the registry and by us.
        assert!(lent_count() >= 1);
        assert_eq!(Arc::strong_count(&owner), 2);
        let got = a.to_bytes().unwrap();
        assert_eq!(got, expected(256, &src, 48, 2, 128));
        drop(a);
        assert_eq!(Arc::strong_count(&owner), 1, "the node gave the bytes back");
    }

    /// Rows of several buffers and their table, held together as a gather's owner.
    struct Scattered {
        _rows: Vec<Vec<u8>>,
        table: Vec<GatherRow>,
    }

    #[test]
    fn gathered_rows_land_at_their_offsets_with_zeros_elsewhere_and_come_back_once_read() {
        // Three rows of 16 bytes in separate buffers, placed out of order in a [4, 16] u8
        // array, one slot left zero.
        let rows: Vec<Vec<u8>> = (0..3u8)
            .map(|r| (0..16).map(|i| r * 40 + i + 1).collect())
            .collect();
        let table = vec![
            GatherRow {
                src: rows[0].as_ptr() as u64,
                at: 32,
            },
            GatherRow {
                src: rows[1].as_ptr() as u64,
                at: 0,
            },
            GatherRow {
                src: rows[2].as_ptr() as u64,
                at: 48,
            },
        ];
        let mut want = vec![0u8; 64];
        for (r, g) in rows.iter().zip(&table) {
            want[g.at as usize..g.at as usize + 16].copy_from_slice(r);
        }
        let owner = Arc::new(Scattered { _rows: rows, table });
        // SAFETY: the owner keeps the rows and the table; on the CPU any memory is read.
        let a =
            unsafe { gather_rows(&[4, 16], Dtype::U8, owner.clone(), &owner.table, 16) }.unwrap();
        assert_eq!(Arc::strong_count(&owner), 2);
        assert_eq!(a.to_bytes().unwrap(), want);
        drop(a);
        assert_eq!(Arc::strong_count(&owner), 1, "the node gave the rows back");
    }

    #[test]
    fn a_gathered_row_past_the_array_is_refused_and_its_owner_given_back() {
        let row = vec![1u8; 16];
        let table = vec![GatherRow {
            src: row.as_ptr() as u64,
            at: 56,
        }];
        let owner = Arc::new(Scattered {
            _rows: vec![row],
            table,
        });
        // SAFETY: as above.
        let err = unsafe { gather_rows(&[4, 16], Dtype::U8, owner.clone(), &owner.table, 16) }
            .unwrap_err();
        assert!(err.to_string().contains("does not fit"), "{err}");
        assert_eq!(Arc::strong_count(&owner), 1);
    }

    #[test]
    fn a_node_dropped_unevaluated_gives_its_bytes_back() {
        let owner = Arc::new(vec![5u8; 64]);
        let a = upload_rows(&[4, 16], Dtype::U8, owner.clone(), 0..64, 16, 4, 16).unwrap();
        assert_eq!(Arc::strong_count(&owner), 2);
        drop(a);
        assert_eq!(Arc::strong_count(&owner), 1);
    }

    #[test]
    fn rows_that_do_not_fit_are_refused_and_the_bytes_still_come_back() {
        let owner = Arc::new(vec![1u8; 64]);
        // Past the buffer.
        assert!(upload_rows(&[64], Dtype::U8, owner.clone(), 0..65, 65, 1, 65).is_err());
        // Not `height` rows of `width`.
        assert!(upload_rows(&[64], Dtype::U8, owner.clone(), 0..64, 30, 2, 32).is_err());
        // Rows overrunning the array.
        assert!(upload_rows(&[64], Dtype::U8, owner.clone(), 0..64, 32, 2, 48).is_err());
        // A row wider than its pitch.
        assert!(upload_rows(&[128], Dtype::U8, owner.clone(), 0..64, 32, 2, 16).is_err());
        assert_eq!(Arc::strong_count(&owner), 1);
    }
}
