//! Safe Rust arrays over MLX's C++ API.
//!
//! MLX is linked from the `libmlx` of an official MLX wheel (mlx-cpu on Linux, mlx-cuda-13
//! on Linux with NVIDIA GPUs, mlx-metal on macOS) found at build time; see `build.rs`.
//! The binding is a small `cxx` shim (`src/shim.cc`, private module `ffi`): every bridged
//! call returns a `Result`, so an MLX exception becomes [`Error::Mlx`] with MLX's message.
//!
//! Main types: [`Array`] (a lazy MLX array; ops are methods or free functions in
//! [`ops`]), [`Dtype`], and the fused kernels in [`fast`].
//!
//! ```no_run
//! use mlx::{Array, fast};
//! let x = Array::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[1, 4])?;
//! let y = fast::rms_norm(&x, None, 1e-5)?;
//! let host: Vec<f32> = y.to_vec()?;
//! # Ok::<(), mlx::Error>(())
//! ```

mod array;
pub mod copy_runs;
pub mod cpu_activation;
pub mod cpu_attention;
pub mod cpu_decode_attention;
pub mod cpu_rope;
pub mod cpu_row_product;
mod cuda_graphs;
mod device;
mod dtype;
mod error;
pub mod fast;
#[doc(hidden)]
pub mod fuzzing;
// The bridge file holds exactly one `ffi` module, as cxx_build expects.
#[allow(clippy::module_inception)]
mod ffi;
pub mod host_upload;
pub mod io;
pub mod ops;
pub mod padded_attention;
mod pinned;
mod quantized;
pub mod random;
pub mod rows_attention;
pub mod validate;

pub use array::{
    async_eval, eval, pending_primitives, pending_small_leaves, synchronize, write_rows_direct,
    zeroed_on_device, Array, HostBuffer, RowsWrite,
};
pub use cuda_graphs::{
    cuda_graphs_enabled, default_cuda_graphs, default_graph_mb, vars_set_for_kvstore,
    CUDA_GRAPHS_VAR, GRAPH_MB_VAR, KVSTORE_GRAPH_MB,
};
pub use device::{
    active_memory, cache_memory, clear_cache, default_device, device_memory_size, direct_transfers,
    f32_matmul_unit_roundoff, gpu_available, peak_memory, reset_peak_memory, set_cache_limit,
    set_default_device, set_direct_transfers, version, Device,
};
pub use dtype::{Dtype, Element};
pub use error::{Error, Result};
pub use pinned::PinnedBuffer;
pub use quantized::{dequantize, quantize, quantized_matmul, QuantSpec, Quantized};
