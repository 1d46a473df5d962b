//! `serve --unix PATH`: claiming a socket path without ever removing what is not ours.
//!
//! A lock file beside the socket (`PATH.lock`, an exclusive `flock`) names the one server
//! that owns the path: a second `kvstore serve --unix PATH` fails at once instead of taking
//! over a live server's socket. With the lock held, whatever sits at `PATH` is replaced only
//! when it is a socket of this user that nothing answers on (a server that was killed left
//! it); a live socket of some other program, a regular file, a link or a directory is
//! refused with a message. The lock file stays behind at exit (removing it could let two
//! servers hold locks on different files of the same name); the socket is removed.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

/// The claim on a socket path; dropped, it removes the socket it bound.
pub struct SocketClaim {
    path: PathBuf,
    _lock: File,
    bound: std::sync::atomic::AtomicBool,
}

/// The uid of this process (the owner of `/proc/self`), where the platform tells.
fn own_uid() -> Option<u32> {
    std::fs::metadata("/proc/self").ok().map(|m| m.uid())
}

fn what(meta: &std::fs::Metadata) -> &'static str {
    let t = meta.file_type();
    if t.is_symlink() {
        "a symbolic link"
    } else if t.is_dir() {
        "a directory"
    } else if t.is_file() {
        "a regular file"
    } else {
        "not a socket"
    }
}

impl SocketClaim {
    /// Takes the lock beside `path` and clears a stale socket of ours from it.
    pub fn take(path: &Path) -> Result<SocketClaim> {
        let shown = store::escape_path(path);
        let name = path
            .file_name()
            .with_context(|| format!("--unix {shown} names no file"))?;
        let mut lock_name = name.to_os_string();
        lock_name.push(".lock");
        let lock_path = path.with_file_name(lock_name);
        let mut lock = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(&lock_path)
            .with_context(|| {
                format!(
                    "opening the lock file {} of --unix {shown} (it must be a regular file \
                     the server can create or write)",
                    store::escape_path(&lock_path)
                )
            })?;
        if !lock.metadata()?.is_file() {
            bail!(
                "{} is not a regular file; remove it",
                store::escape_path(&lock_path)
            );
        }
        if !fs4::fs_std::FileExt::try_lock_exclusive(&lock)? {
            let mut holder = String::new();
            let _ = lock.read_to_string(&mut holder);
            let holder = store::escape_control(holder.trim()).into_owned();
            bail!(
                "another kvstore serve ({}) is serving {shown}; stop it, or choose another \
                 --unix path",
                if holder.is_empty() {
                    "holder unknown"
                } else {
                    &holder
                }
            );
        }
        match std::fs::symlink_metadata(path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e).with_context(|| format!("checking --unix {shown}")),
            Ok(meta) if meta.file_type().is_socket() => {
                match std::os::unix::net::UnixStream::connect(path) {
                    Ok(_) => bail!(
                        "a live server answers on {shown} (not a kvstore serve: none holds \
                         its lock); refusing to take its socket: stop it, or choose another \
                         --unix path"
                    ),
                    Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {}
                    Err(e) => return Err(e).with_context(|| format!("probing the socket {shown}")),
                }
                if own_uid().is_some_and(|uid| uid != meta.uid()) {
                    bail!(
                        "{shown} is a stale socket of uid {}, not of this user; refusing to \
                         remove it",
                        meta.uid()
                    );
                }
                tracing::info!(socket = %shown, "removing the stale socket of a server that is gone");
                std::fs::remove_file(path)
                    .with_context(|| format!("removing the stale socket {shown}"))?;
            }
            Ok(meta) => bail!(
                "{shown} exists and is {}; --unix replaces only a stale socket: remove it \
                 yourself, or choose another path",
                what(&meta)
            ),
        }
        lock.set_len(0)?;
        lock.write_all(format!("pid {}\n", std::process::id()).as_bytes())?;
        Ok(SocketClaim {
            path: path.to_path_buf(),
            _lock: lock,
            bound: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Binds the listening socket (inside the async runtime).
    pub fn bind(&self) -> Result<tokio::net::UnixListener> {
        let l = tokio::net::UnixListener::bind(&self.path)
            .with_context(|| format!("listening on {}", store::escape_path(&self.path)))?;
        self.bound.store(true, std::sync::atomic::Ordering::SeqCst);
        Ok(l)
    }
}

impl Drop for SocketClaim {
    fn drop(&mut self) {
        let ours = self.bound.load(std::sync::atomic::Ordering::SeqCst)
            && std::fs::symlink_metadata(&self.path).is_ok_and(|m| m.file_type().is_socket());
        if ours {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}
