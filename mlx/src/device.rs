//! The default device (CPU or GPU) and MLX's memory counters.

use crate::error::check;
use crate::ffi::ffi;
use crate::Result;

/// Where MLX runs ops that do not name a stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    /// The CPU backend.
    Cpu,
    /// The GPU backend (Metal on macOS, CUDA on Linux with mlx-cuda).
    Gpu,
}

/// Makes `device` the default for all later ops on this thread's streams.
pub fn set_default_device(device: Device) -> Result<()> {
    check(
        "set_default_device",
        ffi::set_default_device(device == Device::Gpu),
    )
}

/// The current default device.
pub fn default_device() -> Result<Device> {
    let gpu = check("default_device", ffi::default_device_is_gpu())?;
    Ok(if gpu { Device::Gpu } else { Device::Cpu })
}

/// Whether this libmlx has a usable GPU backend.
pub fn gpu_available() -> Result<bool> {
    check("gpu_available", ffi::gpu_available())
}

/// Unit roundoff of the operands of an f32 matrix product on the default device: the
/// largest relative error with which MLX's matmul reads an f32 input.
///
/// - CPU, and Metal on macOS: `2^-24`, plain f32 (the products are exact f32 operands).
/// - CUDA (a GPU on Linux): `2^-10`. mlx-cuda runs f32 matmuls on TF32 tensor cores, which
///   read each operand with 10 explicit mantissa bits: `2^-11` if the conversion rounds to
///   nearest, `2^-10` if it truncates; the larger is returned (the H200 measurement that
///   shows TF32 is in docs/cuda.md).
///
/// Tests derive their tolerances from it (docs/cuda.md, "Tolerances on the GPU").
pub fn f32_matmul_unit_roundoff() -> Result<f32> {
    let tf32 = default_device()? == Device::Gpu && !cfg!(target_os = "macos");
    Ok(if tf32 {
        2f32.powi(-10)
    } else {
        f32::EPSILON / 2.0
    })
}

/// The MLX version string of the linked libmlx.
pub fn version() -> Result<String> {
    check("version", ffi::version())
}

/// Bytes held by live arrays.
pub fn active_memory() -> Result<usize> {
    check("active_memory", ffi::active_memory())
}

/// The highest active memory since start or the last [`reset_peak_memory`].
pub fn peak_memory() -> Result<usize> {
    check("peak_memory", ffi::peak_memory())
}

/// Restarts peak tracking from the current active memory.
pub fn reset_peak_memory() -> Result<()> {
    check("reset_peak_memory", ffi::reset_peak_memory())
}

/// Bytes MLX keeps in its buffer cache for reuse.
pub fn cache_memory() -> Result<usize> {
    check("cache_memory", ffi::cache_memory())
}

/// Caps the buffer cache; returns the previous limit.
pub fn set_cache_limit(bytes: usize) -> Result<usize> {
    check("set_cache_limit", ffi::set_cache_limit(bytes))
}

/// The default device's total memory in bytes as MLX's `device_info` reports it (the GPU's
/// on CUDA and Metal), `None` where it reports none (the CPU, in MLX 0.32).
pub fn device_memory_size() -> Result<Option<u64>> {
    let n = check("device_memory_size", ffi::device_memory_size())?;
    Ok((n > 0).then_some(n as u64))
}

/// Frees the buffer cache.
pub fn clear_cache() -> Result<()> {
    check("clear_cache", ffi::clear_cache())
}

/// Whether large host ⇄ device copies go through the CUDA driver directly (a CUDA libmlx,
/// MLX 0.32's buffer layout, and not switched off): one DMA copy instead of MLX's move into
/// managed memory and page faults (docs/mlx.md, "Host ⇄ device transfers on CUDA").
pub fn direct_transfers() -> bool {
    ffi::direct_transfers_available()
}

/// Switches direct host ⇄ device copies on or off for the process (for measuring both
/// paths); returns whether they were on. Where they are unavailable this changes nothing.
pub fn set_direct_transfers(on: bool) -> bool {
    ffi::set_direct_transfers(on)
}
