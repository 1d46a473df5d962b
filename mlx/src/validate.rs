//! Checks of model files before libmlx parses them.
//!
//! Model files come from the internet. libmlx's GGUF reader (gguflib) trusts every length in
//! the file: a key or tensor-name length of 2^60, a tensor count of 2^32 or a tensor with
//! eight dimensions makes it read past its mapping or assert, killing the process. Its
//! safetensors reader trusts the header's offsets the same way. The checks here walk a file's
//! header, metadata and tensor table in Rust with every length and count bounded by the bytes
//! actually left in the file and every size overflow-checked, so a file that passes can only
//! describe tensors that lie inside it, in types and shapes MLX reads.
//!
//! [`gguf`] and [`safetensors`] read only the header part of a file (never the tensor bytes)
//! through a reader and take the file's length from the caller.

use std::collections::HashSet;
use std::io::Read;

/// Why a model file was refused. `reason` names the field and the value that is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason}")]
pub struct InvalidFile {
    /// What is wrong, naming the field.
    pub reason: String,
}

fn bad(reason: impl Into<String>) -> InvalidFile {
    InvalidFile {
        reason: reason.into(),
    }
}

/// Largest GGUF metadata key, bytes (llama.cpp's keys are under 64).
pub const MAX_GGUF_KEY_LEN: u64 = 1024;
/// Largest GGUF tensor name, bytes (llama.cpp's `GGML_MAX_NAME` is 64).
pub const MAX_GGUF_NAME_LEN: u64 = 256;
/// Most dimensions of a GGUF tensor (ggml's `GGML_MAX_DIMS`); gguflib asserts past it.
pub const MAX_GGUF_DIMS: u32 = 4;
/// Largest safetensors header, bytes (the `safetensors` crate's own limit).
pub const MAX_SAFETENSORS_HEADER: u64 = 100_000_000;
/// Largest single dimension: MLX shapes are `i32`.
pub const MAX_DIM: u64 = i32::MAX as u64;

/// The GGML tensor types MLX 0.32 loads from GGUF: (code, name, elements per block, bytes
/// per block). Quantized types are read as MLX affine quantization; others are refused.
const GGML_TYPES: &[(u32, &str, u64, u64)] = &[
    (0, "F32", 1, 4),
    (1, "F16", 1, 2),
    (2, "Q4_0", 32, 18),
    (3, "Q4_1", 32, 20),
    (8, "Q8_0", 32, 34),
    (30, "BF16", 1, 2),
];

/// Names of GGML types MLX does not read, for the message.
fn ggml_type_name(code: u32) -> String {
    match code {
        6 => "Q5_0".into(),
        7 => "Q5_1".into(),
        9 => "Q8_1".into(),
        10 => "Q2_K".into(),
        11 => "Q3_K".into(),
        12 => "Q4_K".into(),
        13 => "Q5_K".into(),
        14 => "Q6_K".into(),
        15 => "Q8_K".into(),
        c => match GGML_TYPES.iter().find(|t| t.0 == c) {
            Some(t) => t.1.into(),
            None => format!("type code {c}"),
        },
    }
}

/// One tensor of a checked GGUF file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GgufTensor {
    /// Its name.
    pub name: String,
    /// Dimensions as stored (innermost first, GGUF order).
    pub dims: Vec<u64>,
    /// GGML type name (`F32`, `Q4_1`, ...).
    pub ggml_type: &'static str,
    /// Absolute offset of its bytes in the file.
    pub offset: u64,
    /// Its length in bytes.
    pub bytes: u64,
}

/// What a checked GGUF file holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GgufLayout {
    /// Format version (2 or 3).
    pub version: u32,
    /// Number of metadata entries.
    pub metadata_entries: u64,
    /// Tensors in file order.
    pub tensors: Vec<GgufTensor>,
    /// Where the tensor data starts.
    pub data_offset: u64,
}

/// A reader that knows how many bytes of the file are left, so no length read from the file
/// can make it allocate or skip more than the file holds.
struct Cursor<R> {
    r: R,
    pos: u64,
    len: u64,
}

impl<R: Read> Cursor<R> {
    fn left(&self) -> u64 {
        self.len - self.pos
    }

    fn need(&self, n: u64, what: &str) -> Result<(), InvalidFile> {
        if n > self.left() {
            return Err(bad(format!(
                "{what} needs {n} bytes at offset {} but the file has {} left (truncated or \
                 corrupt)",
                self.pos,
                self.left()
            )));
        }
        Ok(())
    }

    fn bytes(&mut self, n: u64, what: &str) -> Result<Vec<u8>, InvalidFile> {
        self.need(n, what)?;
        let mut buf = vec![0u8; n as usize];
        self.r
            .read_exact(&mut buf)
            .map_err(|e| bad(format!("reading {what} at offset {}: {e}", self.pos)))?;
        self.pos += n;
        Ok(buf)
    }

    fn skip(&mut self, n: u64, what: &str) -> Result<(), InvalidFile> {
        self.need(n, what)?;
        let copied = std::io::copy(&mut (&mut self.r).take(n), &mut std::io::sink())
            .map_err(|e| bad(format!("reading {what} at offset {}: {e}", self.pos)))?;
        if copied != n {
            return Err(bad(format!("{what}: the file ended early")));
        }
        self.pos += n;
        Ok(())
    }

    fn u32(&mut self, what: &str) -> Result<u32, InvalidFile> {
        let b = self.bytes(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self, what: &str) -> Result<u64, InvalidFile> {
        let b = self.bytes(8, what)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(&b);
        Ok(u64::from_le_bytes(a))
    }

    /// A GGUF string: u64 length then bytes, the length bounded by `max` and the file.
    fn string(&mut self, max: u64, what: &str) -> Result<Vec<u8>, InvalidFile> {
        let n = self.u64(what)?;
        if n > max {
            return Err(bad(format!(
                "{what} claims {n} bytes, more than the {max} allowed"
            )));
        }
        self.bytes(n, what)
    }
}

/// GGUF's float64 metadata type. libmlx 0.32's reader keeps such a value (scalar or array
/// element) as float32 and steps over the 4 bytes of that, not the 8 of the file, so every
/// later key is read from the wrong place (past its mapping: found by the `model_file`
/// fuzz target). Refused until a libmlx reads it right.
const GGUF_FLOAT64: u32 = 12;

/// Most elements of a GGUF metadata array: libmlx reads the count as an `int`.
const MAX_GGUF_ARRAY_LEN: u64 = i32::MAX as u64;

/// Size in bytes of a GGUF scalar metadata type; `None` for string (8) and array (9).
fn gguf_scalar_len(t: u32) -> Option<u64> {
    match t {
        0 | 1 | 7 => Some(1),
        2 | 3 => Some(2),
        4..=6 => Some(4),
        10..=12 => Some(8),
        _ => None,
    }
}

fn float64_refused(what: &str) -> InvalidFile {
    bad(format!(
        "{what}: float64 metadata values are not supported (libmlx 0.32 misreads them and \
         loses its place in the file); convert them to float32"
    ))
}

fn utf8(bytes: Vec<u8>, what: &str) -> Result<String, InvalidFile> {
    String::from_utf8(bytes).map_err(|_| bad(format!("{what} is not valid UTF-8")))
}

/// Checks a GGUF file's header, metadata and tensor table, reading from `r` (positioned at
/// the start of a file of `file_len` bytes). Tensor bytes are not read.
pub fn gguf(r: impl Read, file_len: u64) -> Result<GgufLayout, InvalidFile> {
    let mut c = Cursor {
        r,
        pos: 0,
        len: file_len,
    };
    if file_len < 4 || c.bytes(4, "magic")? != b"GGUF" {
        return Err(bad("not a GGUF file (no GGUF magic)"));
    }
    let version = c.u32("version")?;
    if !(2..=3).contains(&version) {
        return Err(bad(format!(
            "GGUF version {version} is not supported (2 or 3, little-endian)"
        )));
    }
    let tensor_count = c.u64("tensor_count")?;
    let kv_count = c.u64("metadata_kv_count")?;
    // The smallest metadata entry is 8 (key length) + 1 (key) + 4 (type) + 1 (a u8) bytes,
    // the smallest tensor entry 8 + 1 + 4 + 8 + 4 + 8: counts past what fits are lies.
    if kv_count > c.left() / 14 {
        return Err(bad(format!(
            "metadata_kv_count is {kv_count}, but the file has room for at most {}",
            c.left() / 14
        )));
    }
    if tensor_count > c.left() / 33 {
        return Err(bad(format!(
            "tensor_count is {tensor_count}, but the file has room for at most {}",
            c.left() / 33
        )));
    }

    let mut keys = HashSet::new();
    let mut alignment: u64 = 32;
    for _ in 0..kv_count {
        let key = utf8(
            c.string(MAX_GGUF_KEY_LEN, "a metadata key")?,
            "a metadata key",
        )?;
        let what = format!("metadata {key:?}");
        if !keys.insert(key.clone()) {
            return Err(bad(format!("metadata key {key:?} appears twice")));
        }
        let t = c.u32(&what)?;
        match t {
            8 => {
                // Skipped, not read: a value may be as long as the file.
                let n = c.u64(&what)?;
                c.skip(n, &what)?;
            }
            9 => {
                let et = c.u32(&what)?;
                let n = c.u64(&what)?;
                if et == GGUF_FLOAT64 {
                    return Err(float64_refused(&what));
                }
                let too_long = || {
                    bad(format!(
                        "{what}: an array of {n} elements, more than the {MAX_GGUF_ARRAY_LEN} \
                         MLX reads"
                    ))
                };
                match (et, gguf_scalar_len(et)) {
                    (_, Some(size)) => {
                        if n > MAX_GGUF_ARRAY_LEN {
                            return Err(too_long());
                        }
                        let total = n.checked_mul(size).ok_or_else(|| {
                            bad(format!("{what}: an array of {n} elements overflows"))
                        })?;
                        c.skip(total, &what)?;
                    }
                    (8, None) => {
                        if n > c.left() / 8 {
                            return Err(bad(format!(
                                "{what}: an array of {n} strings does not fit in the {} bytes \
                                 left",
                                c.left()
                            )));
                        }
                        if n > MAX_GGUF_ARRAY_LEN {
                            return Err(too_long());
                        }
                        for _ in 0..n {
                            let len = c.u64(&what)?;
                            c.skip(len, &what)?;
                        }
                    }
                    (9, None) => {
                        return Err(bad(format!("{what}: arrays of arrays are not supported")))
                    }
                    (other, None) => {
                        return Err(bad(format!("{what}: unknown array element type {other}")))
                    }
                }
            }
            GGUF_FLOAT64 => return Err(float64_refused(&what)),
            _ => {
                let Some(size) = gguf_scalar_len(t) else {
                    return Err(bad(format!("{what}: unknown value type {t}")));
                };
                let b = c.bytes(size, &what)?;
                let mut a = [0u8; 8];
                a[..b.len()].copy_from_slice(&b);
                let v = u64::from_le_bytes(a);
                if key == "general.alignment" {
                    if t != 4 || v == 0 || !v.is_power_of_two() || v > 1 << 16 {
                        return Err(bad(format!(
                            "general.alignment must be a u32 power of two up to 65536, found \
                             {v} (type {t})"
                        )));
                    }
                    alignment = v;
                }
            }
        }
    }

    let mut names = HashSet::new();
    let mut infos = Vec::new();
    for _ in 0..tensor_count {
        let name = utf8(
            c.string(MAX_GGUF_NAME_LEN, "a tensor name")?,
            "a tensor name",
        )?;
        if !names.insert(name.clone()) {
            return Err(bad(format!("tensor {name:?} appears twice")));
        }
        let ndim = c.u32(&name)?;
        if ndim == 0 || ndim > MAX_GGUF_DIMS {
            return Err(bad(format!(
                "tensor {name:?} has {ndim} dimensions (1 to {MAX_GGUF_DIMS} allowed)"
            )));
        }
        let mut dims = Vec::with_capacity(ndim as usize);
        for _ in 0..ndim {
            let d = c.u64(&name)?;
            if d == 0 || d > MAX_DIM {
                return Err(bad(format!(
                    "tensor {name:?} has a dimension of {d} (1 to {MAX_DIM} allowed)"
                )));
            }
            dims.push(d);
        }
        let code = c.u32(&name)?;
        let Some(&(_, tname, block, block_bytes)) = GGML_TYPES.iter().find(|t| t.0 == code) else {
            return Err(bad(format!(
                "tensor {name:?} has type {}, which MLX does not read (F32, F16, BF16, Q4_0, \
                 Q4_1 and Q8_0 only; convert K-quant files first, e.g. bash scripts/setup.sh \
                 --with-gemma for Gemma 3)",
                ggml_type_name(code)
            )));
        };
        if dims[0] % block != 0 {
            return Err(bad(format!(
                "tensor {name:?} ({tname}) has a first dimension of {}, not a multiple of its \
                 block of {block}",
                dims[0]
            )));
        }
        let elements = dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| bad(format!("tensor {name:?}: dimensions {dims:?} overflow")))?;
        let bytes = (elements / block)
            .checked_mul(block_bytes)
            .ok_or_else(|| bad(format!("tensor {name:?}: byte size overflows")))?;
        let offset = c.u64(&name)?;
        if offset % alignment != 0 {
            return Err(bad(format!(
                "tensor {name:?} has offset {offset}, not a multiple of the alignment \
                 {alignment}"
            )));
        }
        infos.push(GgufTensor {
            name,
            dims,
            ggml_type: tname,
            offset,
            bytes,
        });
    }
    let data_offset = c.pos.div_ceil(alignment) * alignment;
    // Bounds use the later of the file's alignment and GGUF's default of 32, so a reader
    // that ignores general.alignment stays inside the file too.
    let latest_start = data_offset.max(c.pos.div_ceil(32) * 32);
    if latest_start > file_len && !infos.is_empty() {
        return Err(bad(format!(
            "the tensor data would start at {latest_start}, past the end of the file \
             ({file_len} bytes)"
        )));
    }
    let data_len = file_len.saturating_sub(latest_start);
    let mut total: u64 = 0;
    for t in &mut infos {
        let end = t.offset.checked_add(t.bytes);
        if end.is_none_or(|e| e > data_len) {
            return Err(bad(format!(
                "tensor {:?} ({} bytes at data offset {}) ends past the end of the file (the \
                 data section holds {data_len} bytes): truncated or corrupt",
                t.name, t.bytes, t.offset
            )));
        }
        t.offset += data_offset;
        total = total.saturating_add(t.bytes);
    }
    if total > data_len {
        return Err(bad(format!(
            "the tensors claim {total} bytes but the data section holds {data_len}"
        )));
    }
    Ok(GgufLayout {
        version,
        metadata_entries: kv_count,
        tensors: infos,
        data_offset,
    })
}

/// Element size of the safetensors dtypes MLX reads.
fn safetensors_dtype_len(dtype: &str) -> Option<u64> {
    Some(match dtype {
        "BOOL" | "U8" | "I8" | "F8_E4M3" => 1,
        "U16" | "I16" | "F16" | "BF16" => 2,
        "U32" | "I32" | "F32" => 4,
        "U64" | "I64" | "F64" => 8,
        _ => return None,
    })
}

/// One tensor of a checked safetensors file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SafetensorsTensor {
    /// Its name.
    pub name: String,
    /// Its dtype as written (`F32`, `BF16`, ...).
    pub dtype: String,
    /// Its shape.
    pub shape: Vec<u64>,
    /// Its length in bytes.
    pub bytes: u64,
}

/// Checks a safetensors file's header: its length, JSON, dtypes, shapes, and that every
/// tensor's byte range lies inside the file and matches its shape. Reads only the header.
pub fn safetensors(mut r: impl Read, file_len: u64) -> Result<Vec<SafetensorsTensor>, InvalidFile> {
    if file_len < 8 {
        return Err(bad(format!(
            "{file_len} bytes is too short for a safetensors file (8-byte header length)"
        )));
    }
    let mut len8 = [0u8; 8];
    r.read_exact(&mut len8)
        .map_err(|e| bad(format!("reading the header length: {e}")))?;
    let n = u64::from_le_bytes(len8);
    if n > MAX_SAFETENSORS_HEADER || n > file_len - 8 {
        return Err(bad(format!(
            "the header length is {n} bytes, but the file has {} after it (and at most \
             {MAX_SAFETENSORS_HEADER} are allowed)",
            file_len - 8
        )));
    }
    let mut header = vec![0u8; n as usize];
    r.read_exact(&mut header)
        .map_err(|e| bad(format!("reading the {n}-byte header: {e}")))?;
    let json: serde_json::Value = serde_json::from_slice(&header)
        .map_err(|e| bad(format!("the header is not valid JSON: {e}")))?;
    let obj = json
        .as_object()
        .ok_or_else(|| bad("the header is not a JSON object"))?;
    let data_len = file_len - 8 - n;
    let mut out = Vec::new();
    for (name, v) in obj {
        if name == "__metadata__" {
            let ok = v
                .as_object()
                .is_some_and(|m| m.values().all(serde_json::Value::is_string));
            if !ok {
                return Err(bad("__metadata__ must map names to strings"));
            }
            continue;
        }
        let dtype = v
            .get("dtype")
            .and_then(serde_json::Value::as_str)
            .ok_or_else(|| bad(format!("tensor {name:?} has no dtype string")))?;
        let size = safetensors_dtype_len(dtype).ok_or_else(|| {
            bad(format!(
                "tensor {name:?} has dtype {dtype:?}, which MLX does not read"
            ))
        })?;
        let shape = v
            .get("shape")
            .and_then(serde_json::Value::as_array)
            .ok_or_else(|| bad(format!("tensor {name:?} has no shape list")))?;
        if shape.len() > 8 {
            return Err(bad(format!(
                "tensor {name:?} has {} dimensions (at most 8)",
                shape.len()
            )));
        }
        let mut dims = Vec::with_capacity(shape.len());
        for d in shape {
            match d.as_u64() {
                Some(d) if d <= MAX_DIM => dims.push(d),
                _ => {
                    return Err(bad(format!(
                        "tensor {name:?} has a dimension of {d} (0 to {MAX_DIM} allowed)"
                    )))
                }
            }
        }
        let bytes = dims
            .iter()
            .try_fold(size, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| bad(format!("tensor {name:?}: shape {dims:?} overflows")))?;
        let offsets = v
            .get("data_offsets")
            .and_then(serde_json::Value::as_array)
            .filter(|a| a.len() == 2)
            .and_then(|a| Some((a[0].as_u64()?, a[1].as_u64()?)))
            .ok_or_else(|| bad(format!("tensor {name:?} has no [begin, end] data_offsets")))?;
        let (begin, end) = offsets;
        if begin > end || end > data_len {
            return Err(bad(format!(
                "tensor {name:?} has data_offsets [{begin}, {end}] outside the {data_len} data \
                 bytes of the file: truncated or corrupt"
            )));
        }
        if end - begin != bytes {
            return Err(bad(format!(
                "tensor {name:?}: shape {dims:?} of {dtype} needs {bytes} bytes, data_offsets \
                 give {}",
                end - begin
            )));
        }
        out.push(SafetensorsTensor {
            name: name.clone(),
            dtype: dtype.to_string(),
            shape: dims,
            bytes,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gguf_bytes(kv: &[(&str, u32, Vec<u8>)], tensors: &[(&str, &[u64], u32, u64)]) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend(3u32.to_le_bytes());
        b.extend((tensors.len() as u64).to_le_bytes());
        b.extend((kv.len() as u64).to_le_bytes());
        for (k, t, v) in kv {
            b.extend((k.len() as u64).to_le_bytes());
            b.extend(k.as_bytes());
            b.extend(t.to_le_bytes());
            b.extend(v);
        }
        for (name, dims, t, off) in tensors {
            b.extend((name.len() as u64).to_le_bytes());
            b.extend(name.as_bytes());
            b.extend((dims.len() as u32).to_le_bytes());
            for d in *dims {
                b.extend(d.to_le_bytes());
            }
            b.extend(t.to_le_bytes());
            b.extend(off.to_le_bytes());
        }
        while !b.len().is_multiple_of(32) {
            b.push(0);
        }
        b
    }

    fn check(b: &[u8]) -> Result<GgufLayout, InvalidFile> {
        gguf(b, b.len() as u64)
    }

    #[test]
    fn a_small_valid_gguf_passes() {
        let mut b = gguf_bytes(
            &[("llama.block_count", 4, 2u32.to_le_bytes().to_vec())],
            &[("w", &[32, 2], 0, 0), ("q", &[32], 2, 256)],
        );
        b.extend(vec![0u8; 256 + 18]);
        let l = check(&b).unwrap();
        assert_eq!(l.tensors.len(), 2);
        assert_eq!(l.tensors[1].bytes, 18);
        assert_eq!(l.metadata_entries, 1);
    }

    #[test]
    fn the_crafted_35_byte_file_of_issue_21_is_refused() {
        let mut b = b"GGUF".to_vec();
        b.extend(3u32.to_le_bytes());
        b.extend(0u64.to_le_bytes());
        b.extend(1u64.to_le_bytes());
        b.extend((1u64 << 32).to_le_bytes());
        b.extend(b"abc");
        let e = check(&b).unwrap_err();
        assert!(e.reason.contains("metadata_kv_count"), "{e}");
    }

    #[test]
    fn lengths_counts_dims_and_offsets_are_bounded() {
        let huge_key = {
            let mut b = b"GGUF".to_vec();
            b.extend(3u32.to_le_bytes());
            b.extend(0u64.to_le_bytes());
            b.extend(1u64.to_le_bytes());
            b.extend((1u64 << 60).to_le_bytes());
            b.extend([0u8; 64]);
            b
        };
        assert!(check(&huge_key).unwrap_err().reason.contains("more than"));
        let many_tensors = {
            let mut b = b"GGUF".to_vec();
            b.extend(3u32.to_le_bytes());
            b.extend((1u64 << 32).to_le_bytes());
            b.extend(0u64.to_le_bytes());
            b
        };
        assert!(check(&many_tensors)
            .unwrap_err()
            .reason
            .contains("tensor_count"));
        let ndim = gguf_bytes(&[], &[("w", &[1, 1, 1, 1, 1], 0, 0)]);
        assert!(check(&ndim).unwrap_err().reason.contains("5 dimensions"));
        let past_end = gguf_bytes(&[], &[("w", &[32, 2], 0, 0)]);
        assert!(check(&past_end)
            .unwrap_err()
            .reason
            .contains("ends past the end"));
        let overflow = gguf_bytes(&[], &[("w", &[MAX_DIM, MAX_DIM, MAX_DIM, MAX_DIM], 0, 0)]);
        assert!(check(&overflow).unwrap_err().reason.contains("overflow"));
        let kquant = gguf_bytes(&[], &[("w", &[256], 12, 0)]);
        assert!(check(&kquant).unwrap_err().reason.contains("Q4_K"));
        let align = gguf_bytes(
            &[("general.alignment", 4, 0u32.to_le_bytes().to_vec())],
            &[],
        );
        assert!(check(&align)
            .unwrap_err()
            .reason
            .contains("general.alignment"));
        let strings = gguf_bytes(
            &[("tokenizer.ggml.tokens", 9, {
                let mut v = 8u32.to_le_bytes().to_vec();
                v.extend(u64::MAX.to_le_bytes());
                v
            })],
            &[],
        );
        assert!(check(&strings).unwrap_err().reason.contains("strings"));
    }

    /// libmlx 0.32 steps over a float64 metadata value as 4 bytes, not 8, and reads every
    /// later key from the wrong place (the `model_file` fuzz target's crash): refused, as a
    /// scalar and as an array's element type.
    #[test]
    fn float64_metadata_is_refused_before_libmlx_misreads_it() {
        let scalar = gguf_bytes(
            &[("llama.rope.freq_base", 12, 10_000f64.to_le_bytes().to_vec())],
            &[],
        );
        // A metadata array (type 9) of three zeros of element type `elem`, `width` bytes each.
        let zeros = |elem: u32, width: usize| {
            let mut v = elem.to_le_bytes().to_vec();
            v.extend(3u64.to_le_bytes());
            v.extend(vec![0u8; 3 * width]);
            gguf_bytes(&[("tokenizer.ggml.scores", 9, v)], &[])
        };
        for b in [scalar, zeros(12, 8)] {
            let e = check(&b).unwrap_err().reason;
            assert!(e.contains("float64"), "{e}");
        }
        assert!(check(&zeros(6, 4)).is_ok());
    }

    #[test]
    fn safetensors_offsets_and_shapes_must_agree() {
        let file = |header: &str, data: usize| {
            let mut b = (header.len() as u64).to_le_bytes().to_vec();
            b.extend(header.as_bytes());
            b.extend(vec![0u8; data]);
            b
        };
        let ok = file(
            r#"{"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}}"#,
            16,
        );
        assert_eq!(safetensors(&ok[..], ok.len() as u64).unwrap().len(), 1);
        let past = file(
            r#"{"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}}"#,
            8,
        );
        assert!(safetensors(&past[..], past.len() as u64).is_err());
        let shape = file(
            r#"{"a":{"dtype":"F32","shape":[4,4],"data_offsets":[0,16]}}"#,
            16,
        );
        assert!(safetensors(&shape[..], shape.len() as u64).is_err());
        let mut huge = u64::MAX.to_le_bytes().to_vec();
        huge.extend(b"{}");
        assert!(safetensors(&huge[..], huge.len() as u64)
            .unwrap_err()
            .reason
            .contains("header length"));
    }
}
