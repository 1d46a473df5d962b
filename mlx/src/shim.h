// C++ side of the cxx bridge in ffi.rs. Thin wrappers over mlx::core: every function may
// throw, and every one is declared `Result` on the Rust side so an MLX exception becomes a
// Rust error instead of an abort.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "mlx/mlx.h"
#include "rust/cxx.h"

namespace kvmlx {

enum class UnaryOp : uint8_t;
enum class BinaryOp : uint8_t;
enum class ReduceOp : uint8_t;

// One MLX array handle (a shared node of MLX's lazy graph).
struct Array {
  mlx::core::array inner;
};

// An ordered list of arrays; also stands in for "optional array" (empty or one element).
struct ArrayList {
  std::vector<mlx::core::array> items;
};

// Tensors and metadata read from a safetensors or GGUF file.
struct Loaded {
  std::vector<std::string> names;
  std::vector<mlx::core::array> arrays;
  std::vector<std::string> meta_keys;
  // 0 = empty, 1 = array, 2 = string, 3 = list of strings.
  std::vector<uint8_t> meta_kinds;
  std::vector<std::string> meta_strings;
  std::vector<std::vector<std::string>> meta_lists;
  std::vector<mlx::core::array> meta_arrays;
};

// Host memory from MLX's allocator that an array adopts without a copy. `buf` is null once
// adopted (or when empty).
struct HostBuffer {
  mlx::core::allocator::Buffer buf{nullptr};
  size_t len = 0;
  ~HostBuffer();
};

// Arrays and lists.
std::unique_ptr<Array> array_from_bytes(rust::Slice<const uint8_t> data, rust::Slice<const int32_t> shape, uint8_t dtype);
std::unique_ptr<Array> array_scalar(double value, uint8_t dtype);
std::unique_ptr<Array> array_clone(const Array& a);
void array_read_into(const Array& a, rust::Slice<uint8_t> out);
std::unique_ptr<HostBuffer> host_buffer_new(size_t n);
size_t host_buffer_addr(const HostBuffer& b);
std::unique_ptr<Array> array_from_host_buffer(std::unique_ptr<HostBuffer> b, rust::Slice<const int32_t> shape, uint8_t dtype);
size_t host_buffers_live();
bool arrays_write_rows(const ArrayList& dsts, rust::Slice<const size_t> at);
std::unique_ptr<ArrayList> zeroed_off_queue(rust::Slice<const int32_t> dims, rust::Slice<const size_t> ranks,
                                            rust::Slice<const uint8_t> dtypes);
bool direct_transfers_available();
bool set_direct_transfers(bool on);
size_t pinned_alloc(size_t n);
void pinned_free(size_t p);
rust::Vec<int32_t> array_shape(const Array& a);
uint8_t array_dtype(const Array& a);
size_t array_nbytes(const Array& a);
size_t array_buffer_bytes(const Array& a);
size_t array_data_addr(const Array& a);
std::unique_ptr<ArrayList> list_new();
void list_push(ArrayList& list, const Array& a);
size_t list_len(const ArrayList& list);
std::unique_ptr<Array> list_get(const ArrayList& list, size_t i);

// Construction and shape.
std::unique_ptr<Array> zeros(rust::Slice<const int32_t> shape, uint8_t dtype);
std::unique_ptr<Array> full(rust::Slice<const int32_t> shape, double value, uint8_t dtype);
std::unique_ptr<Array> arange(double start, double stop, double step, uint8_t dtype);
std::unique_ptr<Array> reshape(const Array& a, rust::Slice<const int32_t> shape);
std::unique_ptr<Array> transpose(const Array& a, rust::Slice<const int32_t> axes);
std::unique_ptr<Array> expand_dims(const Array& a, int32_t axis);
std::unique_ptr<Array> squeeze(const Array& a, int32_t axis);
std::unique_ptr<Array> broadcast_to(const Array& a, rust::Slice<const int32_t> shape);
std::unique_ptr<Array> slice(const Array& a, rust::Slice<const int32_t> start, rust::Slice<const int32_t> stop, rust::Slice<const int32_t> strides);
std::unique_ptr<Array> slice_update(std::unique_ptr<Array> src, const Array& update, rust::Slice<const int32_t> start, rust::Slice<const int32_t> stop);
std::unique_ptr<Array> scatter(std::unique_ptr<Array> src, const ArrayList& indices, const Array& updates, rust::Slice<const int32_t> axes, bool clamp);
std::unique_ptr<Array> take(const Array& a, const Array& indices, int32_t axis);
std::unique_ptr<Array> take_along_axis(const Array& a, const Array& indices, int32_t axis);
std::unique_ptr<Array> concatenate(const ArrayList& arrays, int32_t axis);
std::unique_ptr<Array> stack(const ArrayList& arrays, int32_t axis);
std::unique_ptr<ArrayList> split_equal(const Array& a, int32_t parts, int32_t axis);
std::unique_ptr<Array> astype(const Array& a, uint8_t dtype);
std::unique_ptr<Array> contiguous(const Array& a);

// Arithmetic.
std::unique_ptr<Array> unary(UnaryOp op, const Array& a);
std::unique_ptr<Array> binary(BinaryOp op, const Array& a, const Array& b);
std::unique_ptr<Array> where_(const Array& cond, const Array& a, const Array& b);
std::unique_ptr<Array> reduce(ReduceOp op, const Array& a, int32_t axis, bool keepdims);
std::unique_ptr<Array> matmul(const Array& a, const Array& b);
std::unique_ptr<Array> softmax(const Array& a, int32_t axis, bool precise);
std::unique_ptr<Array> topk(const Array& a, int32_t k, int32_t axis);
std::unique_ptr<Array> argsort(const Array& a, int32_t axis);
std::unique_ptr<Array> sort(const Array& a, int32_t axis);
std::unique_ptr<Array> cumsum(const Array& a, int32_t axis, bool reverse, bool inclusive);

// Random.
std::unique_ptr<Array> random_key(uint64_t seed);
std::unique_ptr<ArrayList> random_split(const Array& key);
std::unique_ptr<Array> random_categorical(const Array& logits, int32_t axis, const Array& key);
std::unique_ptr<Array> random_uniform(rust::Slice<const int32_t> shape, float low, float high, uint8_t dtype, const Array& key);
std::unique_ptr<Array> random_normal(rust::Slice<const int32_t> shape, uint8_t dtype, const Array& key);

// Quantization.
std::unique_ptr<ArrayList> quantize(const Array& w, int32_t group_size, int32_t bits);
std::unique_ptr<Array> dequantize(const Array& w, const Array& scales, const ArrayList& biases, int32_t group_size, int32_t bits);
std::unique_ptr<Array> quantized_matmul(const Array& x, const Array& w, const Array& scales, const ArrayList& biases, bool transpose, int32_t group_size, int32_t bits);

// Fast kernels.
std::unique_ptr<Array> rms_norm(const Array& x, const ArrayList& weight, float eps);
std::unique_ptr<Array> rope(const Array& x, int32_t dims, bool traditional, float base, bool has_base, float scale, int32_t offset, const ArrayList& freqs);
std::unique_ptr<Array> rope_offsets(const Array& x, int32_t dims, bool traditional, float base, bool has_base, float scale, const Array& offsets, const ArrayList& freqs);
std::unique_ptr<Array> sdpa(const Array& q, const Array& k, const Array& v, float scale, rust::Str mask_mode, const ArrayList& mask);

// Evaluation.
void eval(const ArrayList& arrays);
void async_eval(const ArrayList& arrays);
void synchronize();
bool array_same_node(const Array& a, const Array& b);
std::unique_ptr<ArrayList> rope_angles(int32_t t, const Array& offset, int32_t dims, float base, bool has_base, float scale, const ArrayList& freqs, uint8_t dtype);
std::unique_ptr<Array> rope_apply(const Array& x, const Array& cos, const Array& sin, int32_t dims, bool traditional);
std::unique_ptr<Array> gated_mul_stacked_cpu(const Array& y, bool silu);
std::unique_ptr<Array> rope_rotate(const Array& x, const Array& cos, const Array& sin, int32_t dims, bool traditional);
bool array_is_available(const Array& a);
std::unique_ptr<Array> gated_activation(UnaryOp op, const Array& gate, const Array& up);
// x [.., k] (at most `max_rows` rows) times wᵀ for w [n, k], both f32, on the CPU stream, as
// one node whose CPU evaluation runs the crate's row-product kernel (cpu_row_product.rs).
// The f32 values of `a` in row-major order: its own memory when it is row-contiguous, else
// gathered through its strides into `scratch` (for the shim's CPU primitives).
const float* row_major(const mlx::core::array& a, std::vector<float>& scratch);
std::unique_ptr<Array> rows_times_weight_t(const Array& x, const Array& w, size_t max_rows);
// One query per head over f32 keys and values read in place, on the CPU stream, as one node
// whose CPU evaluation runs the crate's kernel (cpu_decode_attention.rs).
std::unique_ptr<Array> one_query_attention(const Array& q, const Array& k, const Array& v, float scale);

// The dtype of a crate dtype code (dtype.rs), for the other shim files.
mlx::core::Dtype dtype_from_code(uint8_t code);

// host_upload.cc: an array of zeros with host rows in it, read when its node runs (on CUDA a
// kernel reading page-locked host memory); `release_host_rows(token)` once they are read.
bool host_rows_kernel_built();
std::unique_ptr<Array> host_rows_upload(rust::Slice<const int32_t> shape, uint8_t dtype, size_t src, size_t len,
                                        size_t width, size_t height, size_t pitch, uint64_t token);
// The same for rows scattered over host memory: `entries` (source address, output offset)
// pairs at `table`, each row `width` bytes.
std::unique_ptr<Array> host_rows_gather(rust::Slice<const int32_t> shape, uint8_t dtype, size_t table,
                                        size_t entries, size_t width, uint64_t token);

// rows_attention.cc: one decode step's attention over every row's own arena (CUDA only).
bool rows_attention_kernel_built();
std::unique_ptr<Array> rows_decode_attention(const Array& q, const Array& k, const Array& v,
                                             const ArrayList& kv, rust::Slice<const int64_t> meta,
                                             float scale);
// copy_runs.cc: copies of token runs of several arrays as one node (a kernel on CUDA).
bool copy_runs_kernel_built();
std::unique_ptr<ArrayList> copy_token_runs(const ArrayList& sources, rust::Slice<const int64_t> ranges);
// The same runs written straight into host memory as one node (a kernel reading a table of
// runs from page-locked memory on CUDA); `release_host_rows(token)` once they are written.
std::unique_ptr<Array> copy_token_runs_to_host(const ArrayList& sources, rust::Slice<const int64_t> runs,
                                               rust::Slice<const uint64_t> dsts, size_t table, size_t table_len,
                                               uint64_t token);
rust::Vec<rust::String> pending_primitives(const ArrayList& arrays);

// Files.
std::unique_ptr<Loaded> load_safetensors(rust::Str path);
std::unique_ptr<Loaded> load_gguf(rust::Str path);
void save_safetensors(rust::Str path, const Loaded& contents);
std::unique_ptr<Loaded> loaded_new();
void loaded_push_array(Loaded& l, rust::Str name, const Array& a);
void loaded_push_meta(Loaded& l, rust::Str key, rust::Str value);
size_t loaded_len(const Loaded& l);
rust::String loaded_name(const Loaded& l, size_t i);
std::unique_ptr<Array> loaded_array(const Loaded& l, size_t i);
size_t loaded_meta_len(const Loaded& l);
rust::String loaded_meta_key(const Loaded& l, size_t i);
uint8_t loaded_meta_kind(const Loaded& l, size_t i);
rust::String loaded_meta_string(const Loaded& l, size_t i);
rust::Vec<rust::String> loaded_meta_list(const Loaded& l, size_t i);
std::unique_ptr<Array> loaded_meta_array(const Loaded& l, size_t i);

// Devices and memory.
void set_default_device(bool gpu);
bool default_device_is_gpu();
bool gpu_available();
size_t active_memory();
size_t peak_memory();
void reset_peak_memory();
size_t cache_memory();
size_t set_cache_limit(size_t limit);
size_t device_memory_size();
void clear_cache();
rust::String version();

}  // namespace kvmlx
