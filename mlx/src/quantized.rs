//! Affine quantization (MLX's "affine" mode): packed uint32 words plus per-group scales
//! and biases along the last axis.

use crate::array::{list, unlist, Array};
use crate::error::check;
use crate::ffi::ffi;
use crate::{Error, Result};

/// Bits per element and elements per group of an affine quantization.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct QuantSpec {
    /// Elements sharing one scale and bias (32, 64 or 128).
    pub group_size: i32,
    /// Bits per element (2, 3, 4, 5, 6 or 8).
    pub bits: i32,
}

impl QuantSpec {
    /// A checked spec.
    pub fn new(group_size: i32, bits: i32) -> Result<QuantSpec> {
        if ![32, 64, 128].contains(&group_size) || ![2, 3, 4, 5, 6, 8].contains(&bits) {
            return Err(Error::InvalidArgument {
                op: "quantize",
                message: format!(
                    "group size {group_size} / bits {bits}: MLX supports groups of 32, 64, 128 \
                     and 2, 3, 4, 5, 6 or 8 bits"
                ),
            });
        }
        Ok(QuantSpec { group_size, bits })
    }
}

/// A quantized matrix: packed values, scales and biases.
#[derive(Clone, Debug)]
pub struct Quantized {
    /// Packed elements, uint32, last axis = cols × bits / 32.
    pub packed: Array,
    /// One scale per group.
    pub scales: Array,
    /// One bias per group.
    pub biases: Array,
    /// How it was quantized.
    pub spec: QuantSpec,
}

/// Quantizes `w` along its last axis (which must be a multiple of the group size).
pub fn quantize(w: &Array, spec: QuantSpec) -> Result<Quantized> {
    let l = check(
        "quantize",
        ffi::quantize(w.inner(), spec.group_size, spec.bits),
    )?;
    let mut parts = unlist("quantize", &l)?.into_iter();
    match (parts.next(), parts.next(), parts.next()) {
        (Some(packed), Some(scales), Some(biases)) => Ok(Quantized {
            packed,
            scales,
            biases,
            spec,
        }),
        _ => Err(Error::Mlx {
            op: "quantize",
            message: "affine quantize did not return packed, scales and biases".into(),
        }),
    }
}

/// Expands a quantized matrix back to floating point (the dtype of its scales).
pub fn dequantize(q: &Quantized) -> Result<Array> {
    let biases = list("dequantize", &[&q.biases])?;
    Array::wrap(
        "dequantize",
        ffi::dequantize(
            q.packed.inner(),
            q.scales.inner(),
            &biases,
            q.spec.group_size,
            q.spec.bits,
        ),
    )
}

/// `x @ w.T` (when `transpose`) or `x @ w` with `w` quantized, without dequantizing it.
pub fn quantized_matmul(x: &Array, w: &Quantized, transpose: bool) -> Result<Array> {
    let biases = list("quantized_matmul", &[&w.biases])?;
    Array::wrap(
        "quantized_matmul",
        ffi::quantized_matmul(
            x.inner(),
            w.packed.inner(),
            w.scales.inner(),
            &biases,
            transpose,
            w.spec.group_size,
            w.spec.bits,
        ),
    )
}
