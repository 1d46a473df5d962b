//! Reading and writing tensor files with MLX's loaders: safetensors and GGUF.
//!
//! GGUF tensors in Q4_0, Q4_1 and Q8_0 come back in MLX's affine layout: a tensor
//! `blk.0.attn_q.weight` yields `blk.0.attn_q.weight` (packed uint32) plus
//! `blk.0.attn_q.scales` and `blk.0.attn_q.biases` (the `.weight` suffix replaced).

use std::collections::BTreeMap;
use std::path::Path;

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

/// Loads every tensor of a safetensors file (on the CPU stream) and its metadata.
pub fn load_safetensors(path: &Path) -> Result<SafetensorsFile> {
    let op = "load_safetensors";
    let l = loaded(op, ffi::load_safetensors(path_str(path)?))?;
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

/// Loads every tensor and metadata value of a GGUF file.
pub fn load_gguf(path: &Path) -> Result<GgufFile> {
    let op = "load_gguf";
    let l = loaded(op, ffi::load_gguf(path_str(path)?))?;
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
