//! Reading and writing tensor files with MLX's loaders: safetensors and GGUF.
//!
//! GGUF tensors in Q4_0, Q4_1 and Q8_0 come back in MLX's affine layout: a tensor
//! `blk.0.attn_q.weight` yields `blk.0.attn_q.weight` (packed uint32) plus
//! `blk.0.attn_q.scales` and `blk.0.attn_q.biases` (the `.weight` suffix replaced).
//!
//! Model files are untrusted: both loaders open the file read-only, refuse anything but a
//! regular file, and check its header with [`crate::validate`] before libmlx parses it; MLX
//! then reads the bytes that were checked, never the path again (see [`load_gguf`]).

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufReader, Seek};
use std::path::{Path, PathBuf};

use cxx::UniquePtr;

use crate::array::Array;
use crate::error::check;
use crate::ffi::ffi;
use crate::{Error, Result};

/// Tensors and string metadata of a safetensors file.
#[derive(Debug, Default)]
pub struct SafetensorsFile {
    /// Tensors by name.
    pub tensors: BTreeMap<String, Array>,
    /// The `__metadata__` entries of the header.
    pub metadata: BTreeMap<String, String>,
}

/// One GGUF metadata value.
#[derive(Debug)]
pub enum GgufValue {
    /// A number, a bool or an array of numbers, as an MLX array.
    Array(Array),
    /// A string.
    String(String),
    /// An array of strings (e.g. the tokenizer vocabulary).
    Strings(Vec<String>),
    /// A value MLX does not convert.
    Empty,
}

/// Tensors and metadata of a GGUF file.
#[derive(Debug, Default)]
pub struct GgufFile {
    /// Tensors by name (quantized ones split into packed values, `.scales` and `.biases`).
    pub tensors: BTreeMap<String, Array>,
    /// Metadata by key.
    pub metadata: BTreeMap<String, GgufValue>,
}

fn path_str(path: &Path) -> Result<&str> {
    path.to_str()
        .ok_or_else(|| Error::NonUtf8Path(path.to_path_buf()))
}

fn tensors(op: &'static str, l: &ffi::Loaded) -> Result<BTreeMap<String, Array>> {
    let n = check(op, ffi::loaded_len(l))?;
    let mut out = BTreeMap::new();
    for i in 0..n {
        let name = check(op, ffi::loaded_name(l, i))?;
        out.insert(name, Array::wrap(op, ffi::loaded_array(l, i))?);
    }
    Ok(out)
}

fn loaded(
    op: &'static str,
    r: std::result::Result<UniquePtr<ffi::Loaded>, cxx::Exception>,
) -> Result<UniquePtr<ffi::Loaded>> {
    let l = check(op, r)?;
    if l.is_null() {
        return Err(Error::Mlx {
            op,
            message: "returned nothing".into(),
        });
    }
    Ok(l)
}

fn io_error(path: &Path) -> impl Fn(std::io::Error) -> Error + '_ {
    move |source| Error::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Opens a model file read-only and returns it with its length; a directory, FIFO, socket
/// or device (`/dev/zero`) is refused before it is opened. Links are followed: model
/// folders (the Hugging Face cache) are made of them.
fn open_model_file(path: &Path, format: &'static str) -> Result<(File, u64)> {
    let not_regular = || Error::InvalidFile {
        path: path.to_path_buf(),
        format,
        reason: "not a regular file".into(),
    };
    if !std::fs::metadata(path).map_err(io_error(path))?.is_file() {
        return Err(not_regular());
    }
    let f = File::open(path).map_err(io_error(path))?;
    let meta = f.metadata().map_err(io_error(path))?;
    if !meta.is_file() {
        return Err(not_regular());
    }
    Ok((f, meta.len()))
}

/// A path that names an open file itself rather than whatever sits at its name now
/// (`/proc/self/fd/N` on Linux), so MLX opens exactly the inode that was checked.
fn descriptor_path(f: &File, fallback: &Path) -> PathBuf {
    #[cfg(target_os = "linux")]
    {
        let _ = fallback;
        use std::os::fd::AsRawFd;
        PathBuf::from(format!("/proc/self/fd/{}", f.as_raw_fd()))
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = f;
        fallback.to_path_buf()
    }
}

/// Loads every tensor of a safetensors file (on the CPU stream) and its metadata, after
/// checking its header ([`crate::validate::safetensors`]).
pub fn load_safetensors(path: &Path) -> Result<SafetensorsFile> {
    let op = "load_safetensors";
    let (mut f, len) = open_model_file(path, "safetensors")?;
    crate::validate::safetensors(BufReader::new(&mut f), len).map_err(|e| Error::InvalidFile {
        path: path.to_path_buf(),
        format: "safetensors",
        reason: e.reason,
    })?;
    let l = loaded(
        op,
        ffi::load_safetensors(path_str(&descriptor_path(&f, path))?),
    )?;
    drop(f);
    let mut metadata = BTreeMap::new();
    for i in 0..check(op, ffi::loaded_meta_len(&l))? {
        metadata.insert(
            check(op, ffi::loaded_meta_key(&l, i))?,
            check(op, ffi::loaded_meta_string(&l, i))?,
        );
    }
    Ok(SafetensorsFile {
        tensors: tensors(op, &l)?,
        metadata,
    })
}

/// Writes tensors and string metadata to a safetensors file.
pub fn save_safetensors(
    path: &Path,
    tensors: &[(&str, &Array)],
    metadata: &[(&str, &str)],
) -> Result<()> {
    let op = "save_safetensors";
    let mut l = loaded(op, ffi::loaded_new())?;
    for (name, a) in tensors {
        check(op, ffi::loaded_push_array(l.pin_mut(), name, a.inner()))?;
    }
    for (k, v) in metadata {
        check(op, ffi::loaded_push_meta(l.pin_mut(), k, v))?;
    }
    check(op, ffi::save_safetensors(path_str(path)?, &l))
}

/// A private, writable copy of a GGUF file: libmlx's GGUF reader (gguflib) opens its file
/// `O_RDWR|O_APPEND` and maps it shared and writable, which fails on a read-only file or
/// volume and would let a bug write into the model. The copy lives in the temporary
/// directory (`$TMPDIR`), unnamed on Linux, and goes away when dropped.
struct PrivateCopy {
    file: File,
    #[cfg(not(target_os = "linux"))]
    named: tempfile::NamedTempFile,
}

impl PrivateCopy {
    fn of(mut src: File, len: u64, path: &Path) -> Result<PrivateCopy> {
        let tmp_error = |source: std::io::Error| Error::Io {
            path: std::env::temp_dir(),
            source: std::io::Error::new(
                source.kind(),
                format!(
                    "copying {} to a private temporary file failed ({source}); set TMPDIR to \
                     a directory with room for the model",
                    path.display()
                ),
            ),
        };
        #[cfg(target_os = "linux")]
        let mut file = tempfile::tempfile().map_err(tmp_error)?;
        #[cfg(not(target_os = "linux"))]
        let named = tempfile::NamedTempFile::new().map_err(tmp_error)?;
        #[cfg(not(target_os = "linux"))]
        let mut file = named.reopen().map_err(tmp_error)?;
        let copied =
            std::io::copy(&mut std::io::Read::take(&mut src, len), &mut file).map_err(tmp_error)?;
        if copied != len {
            return Err(Error::Io {
                path: path.to_path_buf(),
                source: std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    format!("the file shrank while being read ({copied} of {len} bytes)"),
                ),
            });
        }
        file.rewind().map_err(tmp_error)?;
        Ok(PrivateCopy {
            file,
            #[cfg(not(target_os = "linux"))]
            named,
        })
    }

    fn path(&self) -> PathBuf {
        #[cfg(target_os = "linux")]
        {
            descriptor_path(&self.file, Path::new(""))
        }
        #[cfg(not(target_os = "linux"))]
        {
            self.named.path().to_path_buf()
        }
    }
}

/// Loads every tensor and metadata value of a GGUF file.
///
/// The file is opened read-only and copied to a private temporary file (see
/// [`PrivateCopy`]); the copy is checked ([`crate::validate::gguf`]) and only then handed to
/// MLX, so MLX parses exactly the bytes that passed. Costs one extra read and write of the
/// file at load.
pub fn load_gguf(path: &Path) -> Result<GgufFile> {
    let op = "load_gguf";
    let (src, len) = open_model_file(path, "GGUF")?;
    let mut copy = PrivateCopy::of(src, len, path)?;
    crate::validate::gguf(BufReader::new(&mut copy.file), len).map_err(|e| Error::InvalidFile {
        path: path.to_path_buf(),
        format: "GGUF",
        reason: e.reason,
    })?;
    let l = loaded(op, ffi::load_gguf(path_str(&copy.path())?))?;
    drop(copy);
    let mut metadata = BTreeMap::new();
    for i in 0..check(op, ffi::loaded_meta_len(&l))? {
        let key = check(op, ffi::loaded_meta_key(&l, i))?;
        let value = match check(op, ffi::loaded_meta_kind(&l, i))? {
            1 => GgufValue::Array(Array::wrap(op, ffi::loaded_meta_array(&l, i))?),
            2 => GgufValue::String(check(op, ffi::loaded_meta_string(&l, i))?),
            3 => GgufValue::Strings(check(op, ffi::loaded_meta_list(&l, i))?),
            _ => GgufValue::Empty,
        };
        metadata.insert(key, value);
    }
    Ok(GgufFile {
        tensors: tensors(op, &l)?,
        metadata,
    })
}
