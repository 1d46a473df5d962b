//! Opening files inside the store directory, which is untrusted: anyone who can write into it
//! (another user on a shared volume, a restored backup) could plant a symbolic link under a
//! name the store opens (`LOCK`, the journal, the marker, a block) and make the store read,
//! truncate or overwrite whatever the link points at.
//!
//! Every open in the store goes through [`open`]: the last path component is never followed
//! (`O_NOFOLLOW`: a link fails with `ELOOP`), a FIFO or device cannot block the open
//! (`O_NONBLOCK`, which changes nothing for regular files), and
//! anything that is not a regular file is refused after the open, on the descriptor itself,
//! so a swap between a check and the open cannot slip through. Directories the store writes
//! into (`tmp/`, `quarantine/`, namespace and shard directories) are checked with
//! [`check_dir`]: a link there would move files outside the store.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// What a refused file was, for the message.
fn kind_of(path: &Path) -> &'static str {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_symlink() => "a symbolic link",
        Ok(m) if m.is_dir() => "a directory",
        Ok(_) => "not a regular file (a FIFO, socket or device)",
        Err(_) => "not a regular file",
    }
}

fn refused(path: &Path) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!(
            "{} is {}; the store opens only regular files and never follows links (remove it, \
             or point --store at a directory only kvstore writes to)",
            crate::escape_path(path),
            kind_of(path)
        ),
    )
}

/// Opens `path` with `options`, never following a symbolic link in its last component and
/// refusing anything but a regular file.
pub(crate) fn open(options: &mut OpenOptions, path: &Path) -> io::Result<File> {
    let f = options
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| {
            // ELOOP: the last component is a link. ENXIO: a FIFO without a reader, or a
            // socket. Both mean "not a file the store wrote".
            if matches!(e.raw_os_error(), Some(libc::ELOOP) | Some(libc::ENXIO)) {
                refused(path)
            } else {
                e
            }
        })?;
    if !f.metadata()?.is_file() {
        return Err(refused(path));
    }
    Ok(f)
}

/// Opens `path` for reading (see [`open`]).
pub(crate) fn open_read(path: &Path) -> io::Result<File> {
    open(OpenOptions::new().read(true), path)
}

/// Reads all of `path` (see [`open`]); a file longer than `cap` bytes is refused.
pub(crate) fn read(path: &Path, cap: u64) -> io::Result<Vec<u8>> {
    use std::io::Read;
    let f = open_read(path)?;
    let len = f.metadata()?.len();
    if len > cap {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "{} is {len} bytes, more than the {cap} a store file of this kind can hold",
                crate::escape_path(path)
            ),
        ));
    }
    let mut bytes = Vec::with_capacity(len as usize);
    f.take(cap + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > cap {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "{} grew past {cap} bytes while being read",
                crate::escape_path(path)
            ),
        ));
    }
    Ok(bytes)
}

/// Checks that `path` is a real directory, not a link to one; `Ok(false)` when it is missing.
pub(crate) fn check_dir(path: &Path) -> io::Result<bool> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => Ok(true),
        Ok(_) => Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "{} is {}, not a directory; the store never follows links (remove it)",
                crate::escape_path(path),
                kind_of(path)
            ),
        )),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}
