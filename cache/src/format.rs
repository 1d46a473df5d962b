//! How keys and values are held in memory: plain floating point, or affine-quantized
//! (KV4/KV8) as packed values plus per-group scales and biases.
//!
//! A tensor in a given format is a list of *parts* sharing their leading dimensions:
//! one part (the values) for a float format; three (packed, scales, biases) for a
//! quantized one. Pools, gathers and published blocks apply the same indexing to every
//! part, and only [`KvFormat::decode`] looks inside.

use mlx::{Array, QuantSpec, Quantized};

use crate::CacheError;

/// The in-memory format of keys and values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvFormat {
    /// Stored as given (the dtype of the first keys appended: f32, f16 or bf16).
    Float,
    /// Affine-quantized along head_dim with `bits` bits (4 or 8) in groups of `group_size`.
    Quantized {
        /// Bits per element: 4 (KV4) or 8 (KV8).
        bits: i32,
        /// Elements per scale/bias group (32 or 64; must divide head_dim). Default 64.
        group_size: i32,
    },
}

impl KvFormat {
    /// KV4 with the default group size of 64.
    pub const KV4: KvFormat = KvFormat::Quantized {
        bits: 4,
        group_size: 64,
    };
    /// KV8 with the default group size of 64.
    pub const KV8: KvFormat = KvFormat::Quantized {
        bits: 8,
        group_size: 64,
    };

    /// Parts per tensor: 1 for float, 3 (packed, scales, biases) for quantized.
    pub fn parts(self) -> usize {
        match self {
            KvFormat::Float => 1,
            KvFormat::Quantized { .. } => 3,
        }
    }

    /// Bytes one token's keys or values of one head take in this format, for float values
    /// of `dtype_size` bytes (packed values plus their scales and biases when quantized).
    pub fn bytes_per_head_token(self, head_dim: usize, dtype_size: usize) -> usize {
        match self {
            KvFormat::Float => head_dim * dtype_size,
            KvFormat::Quantized { bits, group_size } => {
                head_dim * bits as usize / 8
                    + 2 * head_dim.div_ceil(group_size.max(1) as usize) * dtype_size
            }
        }
    }

    /// Suffixes naming the parts in published planes ("", "_scales", "_biases").
    pub fn part_suffixes(self) -> &'static [&'static str] {
        match self {
            KvFormat::Float => &[""],
            KvFormat::Quantized { .. } => &["", "_scales", "_biases"],
        }
    }

    fn spec(self) -> Result<Option<QuantSpec>, CacheError> {
        match self {
            KvFormat::Float => Ok(None),
            KvFormat::Quantized { bits, group_size } => {
                if bits != 4 && bits != 8 {
                    return Err(CacheError::Config(format!(
                        "KV quantization supports 4 or 8 bits, not {bits}"
                    )));
                }
                Ok(Some(QuantSpec::new(group_size, bits)?))
            }
        }
    }

    /// Checks the format against a head dimension.
    pub fn validate(self, head_dim: usize) -> Result<(), CacheError> {
        if let Some(spec) = self.spec()? {
            if !head_dim.is_multiple_of(spec.group_size as usize) {
                return Err(CacheError::Config(format!(
                    "head_dim {head_dim} is not a multiple of the KV quantization group size {}",
                    spec.group_size
                )));
            }
        }
        Ok(())
    }

    /// Converts float `x` (last axis = head_dim) into this format's parts.
    pub fn encode(self, x: &Array) -> Result<Vec<Array>, CacheError> {
        match self.spec()? {
            None => Ok(vec![x.clone()]),
            Some(spec) => {
                let q = mlx::quantize(x, spec)?;
                Ok(vec![q.packed, q.scales, q.biases])
            }
        }
    }

    /// Converts parts back to floating point (the dtype of the scales when quantized).
    pub fn decode(self, parts: &[Array]) -> Result<Array, CacheError> {
        match (self.spec()?, parts) {
            (None, [x]) => Ok(x.clone()),
            (Some(spec), [packed, scales, biases]) => Ok(mlx::dequantize(&Quantized {
                packed: packed.clone(),
                scales: scales.clone(),
                biases: biases.clone(),
                spec,
            })?),
            _ => Err(CacheError::Shape(format!(
                "{} parts given for a {self:?} tensor",
                parts.len()
            ))),
        }
    }
}
