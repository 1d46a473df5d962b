//! One decode step's attention for a batch of rows, each over its own KV arena, as one graph
//! node per layer (the shim's `RowsDecodeAttention`, `rows_attention.cc`): on a CUDA GPU, two
//! kernels per 32 rows; on the CPU, one task that copies each row's new key and value into
//! its arena and attends every row through [`crate::cpu_decode_attention::attend_parts`].
//!
//! Attending row by row costs every row a write of its new key and value, views of its
//! arena and an attention node per layer: at 20-30 rows on the H200 that is most of a
//! decode step's launch time (docs/benchmarks.md, session 23), and on the CPU every one of
//! those nodes is a task MLX's stream thread schedules. The node takes every row's arena as
//! it is, writes each row's new key and value into it in place and attends each row over
//! its shared prefix, its own keys and the new one. Writing in place is allowed only into
//! arenas no other array shares: the caller knows (the cache tracks who holds its arenas),
//! MLX does not (it keeps an evaluated input alive until the GPU is done with it, so its
//! reference counts say "shared" for most of a pipelined step).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use crate::array::{list, Array};
use crate::ffi::ffi;
use crate::{Device, Dtype, Result};

/// One row of a [`rows_decode_attention`] step.
pub struct RowKv<'a> {
    /// The row's key arena `[1, Hkv, capacity, D]` (row-major, written in place).
    pub keys: &'a Array,
    /// The row's value arena, shaped like `keys`.
    pub values: &'a Array,
    /// The arena position of the row's first own token.
    pub start: usize,
    /// Own tokens before this step: the new key and value go at `start + len`.
    pub len: usize,
    /// Keys and values `[1, Hkv, P, D]` the row attends before its own (a shared prefix's
    /// views), if any.
    pub prefix: Option<(&'a Array, &'a Array)>,
}

/// The process-wide switch: on unless `KVSTORE_ROWS_KERNEL=0` at the first call.
static SWITCH: OnceLock<AtomicBool> = OnceLock::new();

fn switch() -> &'static AtomicBool {
    SWITCH.get_or_init(|| {
        AtomicBool::new(std::env::var("KVSTORE_ROWS_KERNEL").map_or(true, |v| v != "0"))
    })
}

/// Switches the batched decode attention on or off for the process (for measuring both
/// paths); returns whether it was on.
pub fn set_rows_kernel(on: bool) -> bool {
    switch().swap(on, Ordering::Relaxed)
}

/// Whether this build has the GPU kernels (built against the CUDA backend's headers); the
/// CPU's evaluation is in every build.
pub fn rows_kernel_built() -> bool {
    ffi::rows_attention_kernel_built()
}

/// Whether [`rows_decode_attention`] may run now: switched on, and on a GPU built in; on
/// the CPU also while the fused CPU paths are on ([`crate::fast::set_cpu_attention`]).
pub fn rows_kernel_usable() -> bool {
    if !switch().load(Ordering::Relaxed) {
        return false;
    }
    match crate::default_device() {
        Ok(Device::Gpu) => rows_kernel_built(),
        Ok(Device::Cpu) => crate::fast::cpu_attention(),
        Err(_) => false,
    }
}

/// Whether the node takes keys of this dtype and shape on the default device: on a GPU
/// f32, bf16 or f16, a head dimension that is a multiple of 32 up to 256 and at most 8 q
/// heads per kv head; on the CPU f32 of any head dimension and grouping.
pub fn rows_kernel_fits(dtype: Dtype, head_dim: usize, q_heads: usize, kv_heads: usize) -> bool {
    let grouped = head_dim > 0 && kv_heads > 0 && q_heads.is_multiple_of(kv_heads);
    match crate::default_device() {
        Ok(Device::Cpu) => grouped && dtype == Dtype::F32,
        Ok(Device::Gpu) => {
            grouped
                && matches!(dtype, Dtype::F32 | Dtype::BF16 | Dtype::F16)
                && head_dim.is_multiple_of(32)
                && head_dim <= 256
                && q_heads / kv_heads <= 8
        }
        Err(_) => false,
    }
}

/// Writes row b's `[1, Hkv, 1, D]` slice of `keys` / `values` into `rows[b]`'s arenas at
/// `start + len` and returns `softmax(q kᵀ · scale) v` of each row's query (`queries`
/// `[B, Hq, 1, D]`) over its prefix, its `len` own keys and the new one: `[B, Hq, 1, D]`.
/// Only where [`rows_kernel_usable`] and [`rows_kernel_fits`] say so; no other array may
/// share an arena's buffer (the caller's bookkeeping), and every arena must have room for
/// the new token.
pub fn rows_decode_attention(
    queries: &Array,
    keys: &Array,
    values: &Array,
    rows: &[RowKv<'_>],
    scale: f32,
) -> Result<Array> {
    let mut kv: Vec<&Array> = Vec::with_capacity(rows.len() * 4);
    let mut meta = Vec::with_capacity(rows.len() * 3);
    for r in rows {
        kv.push(r.keys);
        kv.push(r.values);
        if let Some((pk, pv)) = r.prefix {
            kv.push(pk);
            kv.push(pv);
        }
        meta.extend([r.start as i64, r.len as i64, r.prefix.is_some() as i64]);
    }
    let kv = list("rows_decode_attention", &kv)?;
    Array::wrap(
        "rows_decode_attention",
        ffi::rows_decode_attention(
            queries.inner(),
            keys.inner(),
            values.inner(),
            &kv,
            &meta,
            scale,
        ),
    )
}
