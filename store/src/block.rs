//! The block model: ordered, typed byte planes plus metadata. Every tier of the store holds
//! blocks as host bytes; device arrays live in cache/'s pool, never here.

use std::fmt;
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::key::{block_key, BlockKey, NamespaceId};

/// Element type of a plane; names and sizes follow safetensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Dtype {
    /// 32-bit float.
    F32,
    /// 16-bit IEEE float.
    F16,
    /// bfloat16.
    BF16,
    /// Signed 32-bit integer.
    I32,
    /// Unsigned 32-bit integer (packed quantized values).
    U32,
    /// Unsigned byte.
    U8,
}

impl Dtype {
    /// Bytes per element.
    pub fn size(self) -> u64 {
        match self {
            Dtype::F32 | Dtype::I32 | Dtype::U32 => 4,
            Dtype::F16 | Dtype::BF16 => 2,
            Dtype::U8 => 1,
        }
    }

    /// The safetensors name (`"F32"`, `"BF16"`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "F32",
            Dtype::F16 => "F16",
            Dtype::BF16 => "BF16",
            Dtype::I32 => "I32",
            Dtype::U32 => "U32",
            Dtype::U8 => "U8",
        }
    }

    /// Parses a safetensors name; `None` for types the store does not carry.
    pub fn from_name(name: &str) -> Option<Dtype> {
        Some(match name {
            "F32" => Dtype::F32,
            "F16" => Dtype::F16,
            "BF16" => Dtype::BF16,
            "I32" => Dtype::I32,
            "U32" => Dtype::U32,
            "U8" => Dtype::U8,
            _ => return None,
        })
    }

    pub(crate) fn to_safetensors(self) -> safetensors::Dtype {
        match self {
            Dtype::F32 => safetensors::Dtype::F32,
            Dtype::F16 => safetensors::Dtype::F16,
            Dtype::BF16 => safetensors::Dtype::BF16,
            Dtype::I32 => safetensors::Dtype::I32,
            Dtype::U32 => safetensors::Dtype::U32,
            Dtype::U8 => safetensors::Dtype::U8,
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Name, type and shape of a plane, without its bytes.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PlaneSpec {
    /// Plane name, unique within a block (e.g. `"layers.3.k"`).
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape, row-major.
    pub shape: Vec<u64>,
}

impl PlaneSpec {
    /// A spec from its parts.
    pub fn new(name: impl Into<String>, dtype: Dtype, shape: Vec<u64>) -> Self {
        PlaneSpec {
            name: name.into(),
            dtype,
            shape,
        }
    }

    /// Bytes of a plane with this spec; `None` on overflow.
    pub fn byte_len(&self) -> Option<u64> {
        self.shape
            .iter()
            .try_fold(self.dtype.size(), |acc, &d| acc.checked_mul(d))
    }
}

/// One named, typed plane of bytes (row-major, little-endian elements).
#[derive(Clone, PartialEq, Eq)]
pub struct Plane {
    /// Plane name, unique within a block.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape, row-major.
    pub shape: Vec<u64>,
    /// The bytes; length is `dtype.size() * product(shape)`.
    pub data: Bytes,
}

impl Plane {
    /// A plane from its parts (the length is checked when the block is validated).
    pub fn new(
        name: impl Into<String>,
        dtype: Dtype,
        shape: Vec<u64>,
        data: impl Into<Bytes>,
    ) -> Self {
        Plane {
            name: name.into(),
            dtype,
            shape,
            data: data.into(),
        }
    }

    /// This plane's spec.
    pub fn spec(&self) -> PlaneSpec {
        PlaneSpec::new(self.name.clone(), self.dtype, self.shape.clone())
    }
}

impl fmt::Debug for Plane {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Plane")
            .field("name", &self.name)
            .field("dtype", &self.dtype)
            .field("shape", &self.shape)
            .field("bytes", &self.data.len())
            .finish()
    }
}

/// Identity and provenance of a block.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockMeta {
    /// Namespace the block belongs to.
    pub namespace: NamespaceId,
    /// `block_key(parent, tokens)`.
    pub key: BlockKey,
    /// Previous block's key, or the namespace id for position 0.
    pub parent: [u8; 32],
    /// Index of the block in its chain (0 for the first block).
    pub position: u32,
    /// Token ids the block covers.
    pub tokens: Vec<u32>,
    /// Creation time, Unix milliseconds.
    pub created_unix_ms: u64,
}

impl BlockMeta {
    /// Metadata with the key derived from `parent` and `tokens`, created now.
    pub fn new(namespace: NamespaceId, parent: [u8; 32], position: u32, tokens: Vec<u32>) -> Self {
        BlockMeta {
            namespace,
            key: block_key(&parent, &tokens),
            parent,
            position,
            tokens,
            created_unix_ms: now_unix_ms(),
        }
    }
}

/// A block: metadata plus ordered planes in host memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Block {
    /// Identity and provenance.
    pub meta: BlockMeta,
    /// The planes, in the namespace's plane order.
    pub planes: Vec<Plane>,
}

impl AsRef<Block> for Block {
    fn as_ref(&self) -> &Block {
        self
    }
}

impl Block {
    /// Sum of the plane lengths.
    pub fn data_len(&self) -> u64 {
        self.planes.iter().map(|p| p.data.len() as u64).sum()
    }

    /// Plane layout, in order, without the bytes.
    pub fn plane_specs(&self) -> Vec<PlaneSpec> {
        self.planes.iter().map(Plane::spec).collect()
    }
}

/// A plane layout that differs from the namespace's.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LayoutError {
    /// Different number of planes.
    #[error("block has {found} planes, the namespace expects {expected}")]
    PlaneCount {
        /// Planes the namespace expects.
        expected: usize,
        /// Planes found.
        found: usize,
    },
    /// A plane's name, dtype or shape differs.
    #[error("plane {index} is {found:?}, the namespace expects {expected:?}")]
    Plane {
        /// Plane index.
        index: usize,
        /// Expected spec.
        expected: PlaneSpec,
        /// Found spec.
        found: PlaneSpec,
    },
    /// A plane's byte length does not match its dtype and shape.
    #[error("plane {name:?} holds {found} bytes, its dtype and shape need {expected}")]
    ByteLength {
        /// Plane name.
        name: String,
        /// Bytes its spec needs.
        expected: u64,
        /// Bytes present.
        found: u64,
    },
}

/// Checks `found` against `expected`, plane by plane.
pub(crate) fn check_specs(expected: &[PlaneSpec], found: &[PlaneSpec]) -> Result<(), LayoutError> {
    if expected.len() != found.len() {
        return Err(LayoutError::PlaneCount {
            expected: expected.len(),
            found: found.len(),
        });
    }
    for (index, (e, f)) in expected.iter().zip(found).enumerate() {
        if e != f {
            return Err(LayoutError::Plane {
                index,
                expected: e.clone(),
                found: f.clone(),
            });
        }
    }
    Ok(())
}

/// Checks that every plane's byte length matches its dtype and shape.
pub(crate) fn check_lengths(planes: &[Plane]) -> Result<(), LayoutError> {
    for p in planes {
        let expected = p.spec().byte_len().unwrap_or(u64::MAX);
        if expected != p.data.len() as u64 {
            return Err(LayoutError::ByteLength {
                name: p.name.clone(),
                expected,
                found: p.data.len() as u64,
            });
        }
    }
    Ok(())
}

/// Milliseconds since the Unix epoch (0 if the clock is before it).
pub(crate) fn now_unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}
