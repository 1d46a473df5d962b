//! [`RealFs`]: the operating system's file system, every open through `nofollow.rs`.

use std::fs::{self, DirBuilder, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, FileExt, MetadataExt, OpenOptionsExt};
use std::path::Path;
use std::time::UNIX_EPOCH;

use super::{DirEntry, FileKind, FileStat, FileSystem, LockError, ReadAt, WritableFile};
use crate::format;
use crate::nofollow;

/// The operating system's file system (`std::fs`), the SSD tier's default.
#[derive(Debug, Clone, Copy, Default)]
pub struct RealFs;

fn kind(ft: fs::FileType) -> FileKind {
    if ft.is_file() {
        FileKind::File
    } else if ft.is_dir() {
        FileKind::Dir
    } else {
        FileKind::Other
    }
}

fn stat(meta: &fs::Metadata) -> FileStat {
    FileStat {
        kind: kind(meta.file_type()),
        len: meta.len(),
        physical_bytes: meta.blocks() * 512,
        modified_unix_ms: meta
            .modified()
            .ok()
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0),
    }
}

impl ReadAt for File {
    fn len(&self) -> io::Result<u64> {
        Ok(self.metadata()?.len())
    }

    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        FileExt::read_exact_at(self, buf, offset)
    }
}

impl WritableFile for File {
    fn sync_all(&mut self) -> io::Result<()> {
        File::sync_all(self)
    }

    fn sync_data(&mut self) -> io::Result<()> {
        File::sync_data(self)
    }
}

impl FileSystem for RealFs {
    type Reader = File;
    type Writer = File;
    type Lock = File;

    fn metadata(&self, path: &Path) -> io::Result<FileStat> {
        fs::metadata(path).map(|m| stat(&m))
    }

    fn symlink_metadata(&self, path: &Path) -> io::Result<FileStat> {
        fs::symlink_metadata(path).map(|m| stat(&m))
    }

    fn read_dir(&self, path: &Path) -> io::Result<Vec<DirEntry>> {
        let mut v = Vec::new();
        for e in fs::read_dir(path)? {
            let e = e?;
            v.push(DirEntry {
                name: e.file_name().to_string_lossy().into_owned(),
                kind: kind(e.file_type()?),
            });
        }
        v.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(v)
    }

    fn create_dir(&self, path: &Path) -> io::Result<()> {
        DirBuilder::new().mode(format::DIR_MODE).create(path)
    }

    fn create_dir_all(&self, path: &Path) -> io::Result<()> {
        DirBuilder::new()
            .recursive(true)
            .mode(format::DIR_MODE)
            .create(path)
    }

    fn check_dir(&self, path: &Path) -> io::Result<bool> {
        nofollow::check_dir(path)
    }

    fn open_read(&self, path: &Path) -> io::Result<File> {
        nofollow::open_read(path)
    }

    fn read_capped(&self, path: &Path, cap: u64) -> io::Result<Vec<u8>> {
        nofollow::read(path, cap)
    }

    fn create_new(&self, path: &Path) -> io::Result<File> {
        // O_EXCL never follows a link: an existing name, link or not, is `AlreadyExists`.
        OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(format::FILE_MODE)
            .open(path)
    }

    fn create_truncate(&self, path: &Path) -> io::Result<File> {
        nofollow::open(
            OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(format::FILE_MODE),
            path,
        )
    }

    fn open_append(&self, path: &Path) -> io::Result<File> {
        nofollow::open(OpenOptions::new().append(true), path)
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        fs::rename(from, to)
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        fs::remove_file(path)
    }

    fn sync_dir(&self, path: &Path) -> io::Result<()> {
        File::open(path)?.sync_all()
    }

    fn lock(&self, path: &Path) -> Result<File, LockError> {
        const LOCK_ATTEMPTS: u32 = 25;
        let mut f = nofollow::open(
            OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .mode(format::FILE_MODE),
            path,
        )
        .map_err(LockError::Io)?;
        // A lock can outlive its holder by a moment: a process that forked keeps the
        // descriptor until its child execs. Wait briefly before calling it taken.
        let mut got = false;
        for attempt in 0..LOCK_ATTEMPTS {
            got = fs4::fs_std::FileExt::try_lock_exclusive(&f).map_err(LockError::Io)?;
            if got {
                break;
            }
            if attempt + 1 < LOCK_ATTEMPTS {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
        }
        if !got {
            let mut holder = String::new();
            let _ = f.read_to_string(&mut holder);
            let holder = match holder.trim() {
                "" => "holder unknown".to_owned(),
                h => h.to_owned(),
            };
            return Err(LockError::Held { holder });
        }
        let write_pid = |f: &mut File| -> io::Result<()> {
            f.set_len(0)?;
            f.write_all(format!("pid {}\n", std::process::id()).as_bytes())
        };
        write_pid(&mut f).map_err(LockError::Io)?;
        Ok(f)
    }
}
