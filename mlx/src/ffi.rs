//! The cxx bridge to shim.h. Private: the safe API lives in the other modules.
//!
//! Every function is declared `Result` so a C++ exception thrown by MLX becomes a
//! `cxx::Exception` carrying MLX's message, never an abort.

#[cxx::bridge(namespace = "kvmlx")]
pub(crate) mod ffi {
    /// Element-wise unary operations.
    #[repr(u8)]
    enum UnaryOp {
        Negative,
        Abs,
        Exp,
        Log,
        Sqrt,
        Rsqrt,
        Square,
        Tanh,
        Sigmoid,
        Sin,
        Cos,
        LogicalNot,
        Silu,
        GeluTanh,
    }

    /// Element-wise binary operations (with broadcasting).
    #[repr(u8)]
    enum BinaryOp {
        Add,
        Subtract,
        Multiply,
        Divide,
        Maximum,
        Minimum,
        Power,
        Equal,
        NotEqual,
        Less,
        LessEqual,
        Greater,
        GreaterEqual,
        LogicalAnd,
        LogicalOr,
    }

    /// Reductions along one axis.
    #[repr(u8)]
    enum ReduceOp {
        Sum,
        Mean,
        Max,
        Min,
        Argmax,
        Argmin,
        Logsumexp,
    }

    extern "Rust" {
        /// The row-product kernel for the shim's `RowsTimesWeightT` node, on MLX's CPU stream.
        fn rows_times_weight_t_host(x: &[f32], w: &[f32], rows: usize, k: usize, out: &mut [f32]);
        /// The one-query attention kernel for the shim's `OneQueryAttention` node; `at` is
        /// the keys' and values' strides (3 each) and the batch, q heads, kv heads, keys and
        /// head dimension.
        fn one_query_host(q: &[f32], k: &[f32], v: &[f32], at: &[usize], s: f32, o: &mut [f32]);
        /// The RoPE kernel for the shim's `RopeRotate` node; `at` is the input's strides (4),
        /// its shape (4), the rotated dims, and 1/0 for traditional and for angles per row.
        fn rope_rotate_host(x: &[f32], cos: &[f32], sin: &[f32], at: &[usize], o: &mut [f32]);
        /// The gated activation kernel for the shim's `GatedMulStacked` node (SiLU, else the
        /// tanh GELU) over rows of `2 · inter` stacked values.
        fn gated_mul_host(silu: bool, y: &[f32], inter: usize, o: &mut [f32]);
        /// The batched decode attention's CPU kernel for the shim's `RowsDecodeAttention`
        /// node; `meta` as `rows_attend_cpu` in rows_attention.cc lays it out.
        fn rows_attend_host(q: &[f32], meta: &[usize], scale: f32, o: &mut [f32]);
        /// The shim's `HostRowsUpload` node is done with the host bytes lent under `token`
        /// (the device has read them, or the node was dropped unevaluated).
        fn release_host_rows(token: u64);
    }

    unsafe extern "C++" {
        include!("shim.h");

        type Array;
        type ArrayList;
        type Loaded;
        type HostBuffer;

        fn array_from_bytes(data: &[u8], shape: &[i32], dtype: u8) -> Result<UniquePtr<Array>>;
        fn array_scalar(value: f64, dtype: u8) -> Result<UniquePtr<Array>>;
        fn array_clone(a: &Array) -> Result<UniquePtr<Array>>;
        fn array_read_into(a: &Array, out: &mut [u8]) -> Result<()>;
        fn host_buffer_new(n: usize) -> Result<UniquePtr<HostBuffer>>;
        fn host_buffer_addr(b: &HostBuffer) -> usize;
        fn array_from_host_buffer(
            b: UniquePtr<HostBuffer>,
            shape: &[i32],
            dtype: u8,
        ) -> Result<UniquePtr<Array>>;
        fn host_buffers_live() -> usize;
        fn arrays_write_rows(dsts: &ArrayList, at: &[usize]) -> Result<bool>;
        fn zeroed_off_queue(
            dims: &[i32],
            ranks: &[usize],
            dtypes: &[u8],
        ) -> Result<UniquePtr<ArrayList>>;
        fn direct_transfers_available() -> bool;
        fn set_direct_transfers(on: bool) -> bool;
        fn pinned_alloc(n: usize) -> usize;
        fn pinned_free(p: usize);
        fn array_shape(a: &Array) -> Result<Vec<i32>>;
        fn array_dtype(a: &Array) -> Result<u8>;
        fn array_nbytes(a: &Array) -> Result<usize>;
        fn array_buffer_bytes(a: &Array) -> Result<usize>;
        fn array_data_addr(a: &Array) -> Result<usize>;
        fn list_new() -> Result<UniquePtr<ArrayList>>;
        fn list_push(list: Pin<&mut ArrayList>, a: &Array) -> Result<()>;
        fn list_len(list: &ArrayList) -> Result<usize>;
        fn list_get(list: &ArrayList, i: usize) -> Result<UniquePtr<Array>>;

        fn zeros(shape: &[i32], dtype: u8) -> Result<UniquePtr<Array>>;
        fn full(shape: &[i32], value: f64, dtype: u8) -> Result<UniquePtr<Array>>;
        fn arange(start: f64, stop: f64, step: f64, dtype: u8) -> Result<UniquePtr<Array>>;
        fn reshape(a: &Array, shape: &[i32]) -> Result<UniquePtr<Array>>;
        fn transpose(a: &Array, axes: &[i32]) -> Result<UniquePtr<Array>>;
        fn expand_dims(a: &Array, axis: i32) -> Result<UniquePtr<Array>>;
        fn squeeze(a: &Array, axis: i32) -> Result<UniquePtr<Array>>;
        fn broadcast_to(a: &Array, shape: &[i32]) -> Result<UniquePtr<Array>>;
        fn slice(
            a: &Array,
            start: &[i32],
            stop: &[i32],
            strides: &[i32],
        ) -> Result<UniquePtr<Array>>;
        fn slice_update(
            src: UniquePtr<Array>,
            update: &Array,
            start: &[i32],
            stop: &[i32],
        ) -> Result<UniquePtr<Array>>;
        fn scatter(
            src: UniquePtr<Array>,
            indices: &ArrayList,
            updates: &Array,
            axes: &[i32],
            clamp: bool,
        ) -> Result<UniquePtr<Array>>;
        fn take(a: &Array, indices: &Array, axis: i32) -> Result<UniquePtr<Array>>;
        fn take_along_axis(a: &Array, indices: &Array, axis: i32) -> Result<UniquePtr<Array>>;
        fn concatenate(arrays: &ArrayList, axis: i32) -> Result<UniquePtr<Array>>;
        fn stack(arrays: &ArrayList, axis: i32) -> Result<UniquePtr<Array>>;
        fn split_equal(a: &Array, parts: i32, axis: i32) -> Result<UniquePtr<ArrayList>>;
        fn astype(a: &Array, dtype: u8) -> Result<UniquePtr<Array>>;
        fn contiguous(a: &Array) -> Result<UniquePtr<Array>>;

        fn unary(op: UnaryOp, a: &Array) -> Result<UniquePtr<Array>>;
        fn binary(op: BinaryOp, a: &Array, b: &Array) -> Result<UniquePtr<Array>>;
        fn where_(cond: &Array, a: &Array, b: &Array) -> Result<UniquePtr<Array>>;
        fn reduce(op: ReduceOp, a: &Array, axis: i32, keepdims: bool) -> Result<UniquePtr<Array>>;
        fn matmul(a: &Array, b: &Array) -> Result<UniquePtr<Array>>;
        fn softmax(a: &Array, axis: i32, precise: bool) -> Result<UniquePtr<Array>>;
        fn topk(a: &Array, k: i32, axis: i32) -> Result<UniquePtr<Array>>;
        fn argsort(a: &Array, axis: i32) -> Result<UniquePtr<Array>>;
        fn sort(a: &Array, axis: i32) -> Result<UniquePtr<Array>>;
        fn cumsum(a: &Array, axis: i32, reverse: bool, inclusive: bool)
            -> Result<UniquePtr<Array>>;

        fn random_key(seed: u64) -> Result<UniquePtr<Array>>;
        fn random_split(key: &Array) -> Result<UniquePtr<ArrayList>>;
        fn random_categorical(logits: &Array, axis: i32, key: &Array) -> Result<UniquePtr<Array>>;
        fn random_uniform(
            shape: &[i32],
            low: f32,
            high: f32,
            dtype: u8,
            key: &Array,
        ) -> Result<UniquePtr<Array>>;
        fn random_normal(shape: &[i32], dtype: u8, key: &Array) -> Result<UniquePtr<Array>>;

        fn quantize(w: &Array, group_size: i32, bits: i32) -> Result<UniquePtr<ArrayList>>;
        fn dequantize(
            w: &Array,
            scales: &Array,
            biases: &ArrayList,
            group_size: i32,
            bits: i32,
        ) -> Result<UniquePtr<Array>>;
        #[allow(clippy::too_many_arguments)]
        fn quantized_matmul(
            x: &Array,
            w: &Array,
            scales: &Array,
            biases: &ArrayList,
            transpose: bool,
            group_size: i32,
            bits: i32,
        ) -> Result<UniquePtr<Array>>;

        fn rms_norm(x: &Array, weight: &ArrayList, eps: f32) -> Result<UniquePtr<Array>>;
        #[allow(clippy::too_many_arguments)]
        fn rope(
            x: &Array,
            dims: i32,
            traditional: bool,
            base: f32,
            has_base: bool,
            scale: f32,
            offset: i32,
            freqs: &ArrayList,
        ) -> Result<UniquePtr<Array>>;
        #[allow(clippy::too_many_arguments)]
        fn rope_offsets(
            x: &Array,
            dims: i32,
            traditional: bool,
            base: f32,
            has_base: bool,
            scale: f32,
            offsets: &Array,
            freqs: &ArrayList,
        ) -> Result<UniquePtr<Array>>;
        fn sdpa(
            q: &Array,
            k: &Array,
            v: &Array,
            scale: f32,
            mask_mode: &str,
            mask: &ArrayList,
        ) -> Result<UniquePtr<Array>>;

        fn eval(arrays: &ArrayList) -> Result<()>;
        fn async_eval(arrays: &ArrayList) -> Result<()>;
        fn synchronize() -> Result<()>;
        fn array_same_node(a: &Array, b: &Array) -> bool;
        #[allow(clippy::too_many_arguments)]
        fn rope_angles(
            t: i32,
            offset: &Array,
            dims: i32,
            base: f32,
            has_base: bool,
            scale: f32,
            freqs: &ArrayList,
            dtype: u8,
        ) -> Result<UniquePtr<ArrayList>>;
        fn rope_apply(
            x: &Array,
            cos: &Array,
            sin: &Array,
            dims: i32,
            traditional: bool,
        ) -> Result<UniquePtr<Array>>;
        fn gated_mul_stacked_cpu(y: &Array, silu: bool) -> Result<UniquePtr<Array>>;
        fn rope_rotate(
            x: &Array,
            cos: &Array,
            sin: &Array,
            dims: i32,
            traditional: bool,
        ) -> Result<UniquePtr<Array>>;
        fn array_is_available(a: &Array) -> bool;
        fn pending_primitives(arrays: &ArrayList) -> Result<Vec<String>>;
        fn gated_activation(op: UnaryOp, gate: &Array, up: &Array) -> Result<UniquePtr<Array>>;
        fn rows_times_weight_t(x: &Array, w: &Array, max_rows: usize) -> Result<UniquePtr<Array>>;
        fn one_query_attention(
            q: &Array,
            k: &Array,
            v: &Array,
            scale: f32,
        ) -> Result<UniquePtr<Array>>;
        fn rows_attention_kernel_built() -> bool;
        fn host_rows_kernel_built() -> bool;
        #[allow(clippy::too_many_arguments)]
        fn host_rows_upload(
            shape: &[i32],
            dtype: u8,
            src: usize,
            len: usize,
            width: usize,
            height: usize,
            pitch: usize,
            token: u64,
        ) -> Result<UniquePtr<Array>>;
        fn host_rows_gather(
            shape: &[i32],
            dtype: u8,
            table: usize,
            entries: usize,
            width: usize,
            token: u64,
        ) -> Result<UniquePtr<Array>>;
        fn rows_decode_attention(
            q: &Array,
            k: &Array,
            v: &Array,
            kv: &ArrayList,
            meta: &[i64],
            scale: f32,
        ) -> Result<UniquePtr<Array>>;
        fn copy_runs_kernel_built() -> bool;
        fn copy_token_runs(sources: &ArrayList, ranges: &[i64]) -> Result<UniquePtr<ArrayList>>;
        fn copy_token_runs_to_host(
            sources: &ArrayList,
            runs: &[i64],
            dsts: &[u64],
            table: usize,
            table_len: usize,
            token: u64,
        ) -> Result<UniquePtr<Array>>;

        fn load_safetensors(path: &str) -> Result<UniquePtr<Loaded>>;
        fn load_gguf(path: &str) -> Result<UniquePtr<Loaded>>;
        fn save_safetensors(path: &str, contents: &Loaded) -> Result<()>;
        fn loaded_new() -> Result<UniquePtr<Loaded>>;
        fn loaded_push_array(l: Pin<&mut Loaded>, name: &str, a: &Array) -> Result<()>;
        fn loaded_push_meta(l: Pin<&mut Loaded>, key: &str, value: &str) -> Result<()>;
        fn loaded_len(l: &Loaded) -> Result<usize>;
        fn loaded_name(l: &Loaded, i: usize) -> Result<String>;
        fn loaded_array(l: &Loaded, i: usize) -> Result<UniquePtr<Array>>;
        fn loaded_meta_len(l: &Loaded) -> Result<usize>;
        fn loaded_meta_key(l: &Loaded, i: usize) -> Result<String>;
        fn loaded_meta_kind(l: &Loaded, i: usize) -> Result<u8>;
        fn loaded_meta_string(l: &Loaded, i: usize) -> Result<String>;
        fn loaded_meta_list(l: &Loaded, i: usize) -> Result<Vec<String>>;
        fn loaded_meta_array(l: &Loaded, i: usize) -> Result<UniquePtr<Array>>;

        fn set_default_device(gpu: bool) -> Result<()>;
        fn default_device_is_gpu() -> Result<bool>;
        fn gpu_available() -> Result<bool>;
        fn active_memory() -> Result<usize>;
        fn peak_memory() -> Result<usize>;
        fn reset_peak_memory() -> Result<()>;
        fn cache_memory() -> Result<usize>;
        fn set_cache_limit(limit: usize) -> Result<usize>;
        fn device_memory_size() -> Result<usize>;
        fn clear_cache() -> Result<()>;
        fn version() -> Result<String>;
    }
}

/// `out = x · wᵀ` through [`crate::cpu_row_product`]. The shim checked the shapes when it made
/// the node, so the kernel cannot refuse them; if it did, the output would be NaN (never
/// stale memory).
fn rows_times_weight_t_host(x: &[f32], w: &[f32], rows: usize, k: usize, out: &mut [f32]) {
    if let Err(message) = crate::cpu_row_product::rows_times_weight_t(x, w, rows, k, out) {
        debug_assert!(false, "the CPU row product refused its inputs: {message}");
        out.fill(f32::NAN);
    }
}

/// `softmax(q kᵀ · s) v` into `o` through [`crate::cpu_decode_attention`], `at` as the
/// bridge's declaration says. The shim checked the shapes when it made the node and computes
/// the views' strides and reach; should the kernel still refuse them, the output is NaN
/// (never stale memory).
fn one_query_host(q: &[f32], k: &[f32], v: &[f32], at: &[usize], s: f32, o: &mut [f32]) {
    use crate::cpu_decode_attention::{attend_one_query, OneQueryDims};
    let result = match at {
        &[k0, k1, k2, v0, v1, v2, batch, q_heads, kv_heads, len, head_dim] => {
            let dims = OneQueryDims {
                batch,
                q_heads,
                kv_heads,
                len,
                head_dim,
            };
            attend_one_query(q, k, [k0, k1, k2], v, [v0, v1, v2], dims, s, o)
        }
        _ => Err(format!("a layout of {} values", at.len())),
    };
    if let Err(message) = result {
        debug_assert!(
            false,
            "the one-query attention refused its inputs: {message}"
        );
        o.fill(f32::NAN);
    }
}

/// RoPE's rotation into `o` through [`crate::cpu_rope`], `at` as the bridge's declaration
/// says. The shim checked the shapes when it made the node; should the kernel still refuse
/// them, the output is NaN (never stale memory).
fn rope_rotate_host(x: &[f32], cos: &[f32], sin: &[f32], at: &[usize], o: &mut [f32]) {
    use crate::cpu_rope::{rotate, RopeLayout};
    let result = match at {
        &[s0, s1, s2, s3, b, h, t, d, dims, traditional, per_row] => {
            let layout = RopeLayout {
                shape: [b, h, t, d],
                strides: [s0, s1, s2, s3],
                dims,
                traditional: traditional != 0,
                per_row: per_row != 0,
            };
            rotate(x, cos, sin, layout, o)
        }
        _ => Err(format!("a layout of {} values", at.len())),
    };
    if let Err(message) = result {
        debug_assert!(false, "the RoPE kernel refused its inputs: {message}");
        o.fill(f32::NAN);
    }
}

fn release_host_rows(token: u64) {
    crate::host_upload::release(token);
}

/// The batched decode attention on the CPU through
/// [`crate::cpu_decode_attention::attend_parts`]. `meta`: q heads, kv heads, head dim and
/// rows, then per row its part count and per part the keys' address, values reached, head
/// and token strides, the values' four, and its positions. Should the layout not parse or
/// the kernel refuse it, the output is NaN (never stale memory).
fn rows_attend_host(q: &[f32], meta: &[usize], scale: f32, o: &mut [f32]) {
    if let Err(message) = rows_attend_parsed(q, meta, scale, o) {
        debug_assert!(
            false,
            "the batched decode attention refused its inputs: {message}"
        );
        o.fill(f32::NAN);
    }
}

fn rows_attend_parsed(q: &[f32], meta: &[usize], scale: f32, o: &mut [f32]) -> Result<(), String> {
    use crate::cpu_decode_attention::{attend_parts, KvPart};
    let mut it = meta.iter().copied();
    let mut next = || it.next().ok_or_else(|| "a short layout".to_string());
    let (q_heads, kv_heads, d, rows) = (next()?, next()?, next()?, next()?);
    let mut all: Vec<Vec<KvPart<'_>>> = Vec::with_capacity(rows);
    for _ in 0..rows {
        let parts = next()?;
        let mut row = Vec::with_capacity(parts);
        for _ in 0..parts {
            let (ka, kn, khs, kts) = (next()?, next()?, next()?, next()?);
            let (va, vn, vhs, vts) = (next()?, next()?, next()?, next()?);
            let len = next()?;
            if ka == 0 || va == 0 {
                return Err("a null part".into());
            }
            // SAFETY: the shim passes the addresses of f32 buffers of the node's inputs,
            // which MLX keeps alive until the node's task has run, and the number of values
            // the part's shape reaches through its strides from there (checked against the
            // arrays' shapes when the node was made); nothing writes them during the call.
            let (k, v) = unsafe {
                (
                    std::slice::from_raw_parts(ka as *const f32, kn),
                    std::slice::from_raw_parts(va as *const f32, vn),
                )
            };
            row.push(KvPart {
                k,
                k_strides: [khs, kts],
                v,
                v_strides: [vhs, vts],
                len,
            });
        }
        all.push(row);
    }
    let rows: Vec<&[KvPart<'_>]> = all.iter().map(Vec::as_slice).collect();
    attend_parts(q, &rows, q_heads, kv_heads, d, scale, o)
}

/// `act(gate) · up` over stacked rows into `o` through [`crate::cpu_activation`]. The shim
/// checked the shape when it made the node; should the kernel still refuse it, the output
/// is NaN (never stale memory).
fn gated_mul_host(silu: bool, y: &[f32], inter: usize, o: &mut [f32]) {
    use crate::cpu_activation::{gated_mul_rows, Gate};
    let gate = if silu { Gate::Silu } else { Gate::GeluTanh };
    if let Err(message) = gated_mul_rows(gate, y, inter, o) {
        debug_assert!(false, "the gated activation refused its inputs: {message}");
        o.fill(f32::NAN);
    }
}
