//! Seeded random numbers: explicit PRNG keys, so results are reproducible.

use crate::array::{unlist, Array};
use crate::error::check;
use crate::ffi::ffi;
use crate::{Dtype, Result};

/// A PRNG key made from a seed.
pub fn key(seed: u64) -> Result<Array> {
    Array::wrap("random_key", ffi::random_key(seed))
}

/// Splits a key into two independent keys.
pub fn split(key: &Array) -> Result<(Array, Array)> {
    let l = check("random_split", ffi::random_split(key.inner()))?;
    let mut v = unlist("random_split", &l)?;
    let b = v.pop();
    let a = v.pop();
    match (a, b) {
        (Some(a), Some(b)) => Ok((a, b)),
        _ => Err(crate::Error::Mlx {
            op: "random_split",
            message: "split did not return two keys".into(),
        }),
    }
}

/// Samples indices from the categorical distribution given by unnormalized `logits`
/// along `axis`.
pub fn categorical(logits: &Array, axis: i32, key: &Array) -> Result<Array> {
    Array::wrap(
        "random_categorical",
        ffi::random_categorical(logits.inner(), axis, key.inner()),
    )
}

/// Uniform samples in `[low, high)`.
pub fn uniform(shape: &[i32], low: f32, high: f32, dtype: Dtype, key: &Array) -> Result<Array> {
    Array::wrap(
        "random_uniform",
        ffi::random_uniform(shape, low, high, dtype.code(), key.inner()),
    )
}

/// Standard normal samples.
pub fn normal(shape: &[i32], dtype: Dtype, key: &Array) -> Result<Array> {
    Array::wrap(
        "random_normal",
        ffi::random_normal(shape, dtype.code(), key.inner()),
    )
}
