//! The crate's only `unsafe`: mapping block files read-only.
#![allow(unsafe_code)]

use std::fs::File;
use std::io;

use memmap2::Mmap;

use crate::block::Block;
use crate::codec::{self, DecodeError};

/// Maps `file` read-only.
///
/// # Safety
///
/// The caller guarantees that nobody truncates or writes the file while the map lives:
/// truncation turns reads into `SIGBUS`, writes change bytes under the reader. The store
/// upholds this for block files because it never opens a renamed block file for writing
/// and only ever unlinks it (an unlinked file stays mapped intact); a map lives only for
/// the length of one decode, which copies the bytes out before returning.
pub(crate) unsafe fn map_readonly(file: &File) -> io::Result<Mmap> {
    // SAFETY: forwarded to the caller, see `# Safety` above.
    unsafe { Mmap::map(file) }
}

/// Maps and decodes a block file, verifying the checksum. The outer error is a failure to
/// map (not evidence about the file's contents); the inner one is a verification failure.
pub(crate) fn read_block(file: &File) -> io::Result<Result<Block, DecodeError>> {
    let len = file.metadata()?.len();
    if len < 8 {
        return Ok(Err(DecodeError::Truncated {
            needed: 8,
            found: len,
        }));
    }
    // SAFETY: `file` is a block file, immutable once renamed into place: the store never
    // opens one for writing and only unlinks them. The map is dropped before returning
    // because decode copies the planes out.
    let map = unsafe { map_readonly(file) }?;
    // The whole file is read once, front to back: ask for readahead of all of it up front
    // instead of faulting it in page by page. Advice only; failure changes nothing.
    let _ = map.advise(memmap2::Advice::WillNeed);
    let _ = map.advise(memmap2::Advice::Sequential);
    Ok(codec::decode(&map))
}
