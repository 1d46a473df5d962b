// Implementation of shim.h. Each function converts arguments, calls one mlx::core op and
// wraps the result; exceptions propagate to cxx, which turns them into Rust errors.
#include "shim.h"
#include "direct_copy.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"

#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <variant>
#include <stdexcept>
#include <unordered_set>
#include <utility>

#include "kvstore-mlx/src/ffi.rs.h"

namespace mx = mlx::core;

namespace kvmlx {
namespace {

mx::Dtype to_dtype(uint8_t code) {
  switch (code) {
    case 0: return mx::bool_;
    case 1: return mx::uint8;
    case 2: return mx::uint16;
    case 3: return mx::uint32;
    case 4: return mx::uint64;
    case 5: return mx::int8;
    case 6: return mx::int16;
    case 7: return mx::int32;
    case 8: return mx::int64;
    case 9: return mx::float16;
    case 10: return mx::float32;
    case 11: return mx::float64;
    case 12: return mx::bfloat16;
    case 13: return mx::complex64;
  }
  throw std::invalid_argument("unknown dtype code " + std::to_string(code));
}

uint8_t from_dtype(mx::Dtype d) { return static_cast<uint8_t>(d.val()); }

mx::Shape to_shape(rust::Slice<const int32_t> s) { return mx::Shape(s.begin(), s.end()); }

std::unique_ptr<Array> wrap(mx::array a) {
  return std::unique_ptr<Array>(new Array{std::move(a)});
}

std::optional<mx::array> optional(const ArrayList& l) {
  if (l.items.empty()) return std::nullopt;
  if (l.items.size() > 1) throw std::invalid_argument("optional array given more than one array");
  return l.items[0];
}

std::unique_ptr<Loaded> from_pairs(std::unordered_map<std::string, mx::array> arrays) {
  auto out = std::make_unique<Loaded>();
  for (auto& [name, a] : arrays) {
    out->names.push_back(name);
    out->arrays.push_back(a);
  }
  return out;
}

// Throws unless an array of `sh` and `dt` takes exactly `bytes` bytes.
void check_host_bytes(const mx::Shape& sh, mx::Dtype dt, size_t bytes) {
  size_t count = 1;
  for (auto d : sh) {
    if (d < 0) throw std::invalid_argument("negative dimension in shape");
    count *= static_cast<size_t>(d);
  }
  if (count * dt.size() != bytes) {
    throw std::invalid_argument("host buffer holds " + std::to_string(bytes) + " bytes, shape and dtype need " +
                                std::to_string(count * dt.size()));
  }
}

}  // namespace

mx::Dtype dtype_from_code(uint8_t code) { return to_dtype(code); }

// Host buffers from this size on are uploaded with one driver copy on CUDA (smaller ones,
// token ids and scalars, take MLX's ordinary path).
constexpr size_t kDirectUploadMin = 1 << 20;

std::unique_ptr<Array> array_from_bytes(rust::Slice<const uint8_t> data, rust::Slice<const int32_t> shape, uint8_t dtype) {
  auto dt = to_dtype(dtype);
  auto sh = to_shape(shape);
  check_host_bytes(sh, dt, data.size());
  // Large buffers go straight into CUDA device memory where possible (direct_copy.h).
  if (data.size() >= kDirectUploadMin) {
    if (auto a = direct::upload(data.data(), data.size(), sh, dt)) return wrap(std::move(*a));
  }
  // One copy, into memory from MLX's allocator that the array then owns (a malloc'd copy
  // handed to MLX's `array(void*, ..., deleter)` is copied a second time on the CPU, whose
  // allocator cannot wrap foreign memory).
  auto buf = mx::allocator::allocator().malloc(data.size() == 0 ? 1 : data.size());
  if (buf.ptr() == nullptr || buf.raw_ptr() == nullptr) throw std::bad_alloc();
  if (data.size() > 0) std::memcpy(buf.raw_ptr(), data.data(), data.size());
  return wrap(mx::array(mx::allocator::Data(buf, [](mx::allocator::Buffer b) { mx::allocator::allocator().free(b); }),
                        std::move(sh), dt));
}

namespace {
// Host buffers allocated and not yet freed (by their owner or by the array that adopted
// them): lets tests check that each is freed exactly once.
std::atomic<size_t> host_buffers{0};

void free_host(mx::allocator::Buffer b) {
  mx::allocator::allocator().free(b);
  host_buffers.fetch_sub(1, std::memory_order_relaxed);
}
}  // namespace

HostBuffer::~HostBuffer() {
  if (buf.ptr() != nullptr) free_host(buf);
}

// Memory from MLX's own allocator (not malloc): on the CPU its arrays point straight into
// such a buffer, so the array below takes it over without copying (MLX's `array(void*,
// ..., deleter)` constructor copies unless the allocator can wrap foreign memory, which
// the CPU allocator cannot). Zeroed: the caller may leave bytes unwritten.
std::unique_ptr<HostBuffer> host_buffer_new(size_t n) {
  auto out = std::make_unique<HostBuffer>();
  auto b = mx::allocator::allocator().malloc(n == 0 ? 1 : n);
  if (b.ptr() == nullptr || b.raw_ptr() == nullptr) throw std::bad_alloc();
  host_buffers.fetch_add(1, std::memory_order_relaxed);
  out->buf = b;
  out->len = n;
  std::memset(b.raw_ptr(), 0, n);
  return out;
}

size_t host_buffer_addr(const HostBuffer& b) {
  auto buf = b.buf;
  return reinterpret_cast<size_t>(buf.raw_ptr());
}

std::unique_ptr<Array> array_from_host_buffer(std::unique_ptr<HostBuffer> b, rust::Slice<const int32_t> shape, uint8_t dtype) {
  auto dt = to_dtype(dtype);
  auto sh = to_shape(shape);
  if (b == nullptr || b->buf.ptr() == nullptr) throw std::invalid_argument("host buffer already given away");
  check_host_bytes(sh, dt, b->len);
  // From here the array owns the buffer and frees it (once) when its data goes.
  auto buf = std::exchange(b->buf, mx::allocator::Buffer{nullptr});
  return wrap(mx::array(mx::allocator::Data(buf, free_host), std::move(sh), dt));
}

size_t host_buffers_live() { return host_buffers.load(std::memory_order_relaxed); }

// The f64 scalar is cast on the CPU stream: MLX's GPU backends (CUDA, Metal) have no
// float64, so a cast on the default GPU stream fails with "float64 is not supported on the
// GPU". The cast of one element costs nothing; the result feeds GPU ops as usual.
std::unique_ptr<Array> array_scalar(double value, uint8_t dtype) {
  return wrap(mx::astype(mx::array(value, mx::float64), to_dtype(dtype), mx::Device::cpu));
}

std::unique_ptr<Array> array_clone(const Array& a) { return wrap(a.inner); }

void array_read_into(const Array& a, rust::Slice<uint8_t> out) {
  // An evaluated row-contiguous array is read directly, without building a graph node, so
  // several threads may read the same immutable (published) array at once.
  const mx::array* src = &a.inner;
  mx::array c = a.inner;
  if (!(a.inner.is_available() && a.inner.flags().row_contiguous)) {
    c = mx::contiguous(a.inner);
    c.eval();
    if (!c.flags().row_contiguous) throw std::runtime_error("array is not row-contiguous after contiguous()");
    src = &c;
  }
  if (out.size() != src->nbytes()) {
    throw std::invalid_argument("host buffer of " + std::to_string(out.size()) + " bytes for an array of " +
                                std::to_string(src->nbytes()) + " bytes");
  }
  if (out.size() > 0 && !direct::read(*src, out.data(), out.size())) {
    std::memcpy(out.data(), src->data<uint8_t>(), out.size());
  }
}

bool arrays_write_rows(const ArrayList& dsts, rust::Slice<const size_t> at) {
  // Per array: the source's address and length, the rows' width, their count and pitch.
  if (at.size() != dsts.items.size() * 5) throw std::invalid_argument("5 numbers per array expected");
  std::vector<direct::RowsWrite> writes;
  for (size_t i = 0; i < dsts.items.size(); ++i) {
    const size_t* m = at.data() + i * 5;
    if (m[1] != m[2] * m[3]) {
      throw std::invalid_argument("host rows hold " + std::to_string(m[1]) + " bytes, " + std::to_string(m[3]) +
                                  " rows of " + std::to_string(m[2]) + " need " + std::to_string(m[2] * m[3]));
    }
    writes.push_back({&dsts.items[i], reinterpret_cast<const uint8_t*>(m[0]), m[2], m[3], m[4]});
  }
  return direct::write_rows(writes);
}
std::unique_ptr<ArrayList> zeroed_off_queue(rust::Slice<const int32_t> dims, rust::Slice<const size_t> ranks,
                                            rust::Slice<const uint8_t> dtypes) {
  if (ranks.size() != dtypes.size()) throw std::invalid_argument("one rank per dtype expected");
  std::vector<std::pair<mx::Shape, mx::Dtype>> shapes;
  size_t at = 0;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (at + ranks[i] > dims.size()) throw std::invalid_argument("ranks cover more dimensions than given");
    shapes.emplace_back(mx::Shape(dims.begin() + at, dims.begin() + at + ranks[i]), to_dtype(dtypes[i]));
    at += ranks[i];
  }
  if (at != dims.size()) throw std::invalid_argument("dimensions left over after the ranks");
  auto out = std::make_unique<ArrayList>();
  out->items = direct::zeroed_off_queue(shapes);
  return out;
}
bool direct_transfers_available() { return direct::available(); }
bool set_direct_transfers(bool on) { return direct::set_enabled(on); }
size_t pinned_alloc(size_t n) {
  try {
    return reinterpret_cast<size_t>(direct::pinned_alloc(n));
  } catch (...) {
    return 0;  // no page-locked memory: the caller uses ordinary memory
  }
}
void pinned_free(size_t p) {
  try {
    direct::pinned_free(reinterpret_cast<uint8_t*>(p));
  } catch (...) {
    // Freeing cannot be retried; the driver reclaims it at exit.
  }
}

rust::Vec<int32_t> array_shape(const Array& a) {
  rust::Vec<int32_t> out;
  for (auto d : a.inner.shape()) out.push_back(d);
  return out;
}

uint8_t array_dtype(const Array& a) { return from_dtype(a.inner.dtype()); }
size_t array_nbytes(const Array& a) { return a.inner.nbytes(); }
// The whole allocator buffer behind an evaluated array: every array MLX computes or this
// shim makes lives in memory from MLX's allocator, whose `size` knows each buffer's length.
size_t array_buffer_bytes(const Array& a) {
  if (!a.inner.is_available() || !a.inner.data_shared_ptr()) return 0;
  auto buf = a.inner.buffer();
  if (buf.ptr() == nullptr) return 0;
  return mx::allocator::allocator().size(buf);
}

size_t array_data_addr(const Array& a) {
  if (!a.inner.is_available()) throw std::runtime_error("array is not evaluated");
  return reinterpret_cast<size_t>(a.inner.data<uint8_t>());
}

std::unique_ptr<ArrayList> list_new() { return std::make_unique<ArrayList>(); }
void list_push(ArrayList& list, const Array& a) { list.items.push_back(a.inner); }
size_t list_len(const ArrayList& list) { return list.items.size(); }
std::unique_ptr<Array> list_get(const ArrayList& list, size_t i) { return wrap(list.items.at(i)); }

std::unique_ptr<Array> zeros(rust::Slice<const int32_t> shape, uint8_t dtype) { return wrap(mx::zeros(to_shape(shape), to_dtype(dtype))); }
std::unique_ptr<Array> full(rust::Slice<const int32_t> shape, double value, uint8_t dtype) {
  auto dt = to_dtype(dtype);
  return wrap(mx::full(to_shape(shape), mx::astype(mx::array(value, mx::float64), dt, mx::Device::cpu), dt));
}
std::unique_ptr<Array> arange(double start, double stop, double step, uint8_t dtype) { return wrap(mx::arange(start, stop, step, to_dtype(dtype))); }
std::unique_ptr<Array> reshape(const Array& a, rust::Slice<const int32_t> shape) { return wrap(mx::reshape(a.inner, to_shape(shape))); }
std::unique_ptr<Array> transpose(const Array& a, rust::Slice<const int32_t> axes) { return wrap(mx::transpose(a.inner, std::vector<int>(axes.begin(), axes.end()))); }
std::unique_ptr<Array> expand_dims(const Array& a, int32_t axis) { return wrap(mx::expand_dims(a.inner, axis)); }
std::unique_ptr<Array> squeeze(const Array& a, int32_t axis) { return wrap(mx::squeeze(a.inner, axis)); }
std::unique_ptr<Array> broadcast_to(const Array& a, rust::Slice<const int32_t> shape) { return wrap(mx::broadcast_to(a.inner, to_shape(shape))); }

std::unique_ptr<Array> slice(const Array& a, rust::Slice<const int32_t> start, rust::Slice<const int32_t> stop, rust::Slice<const int32_t> strides) {
  return wrap(mx::slice(a.inner, to_shape(start), to_shape(stop), to_shape(strides)));
}

std::unique_ptr<Array> slice_update(std::unique_ptr<Array> src, const Array& update, rust::Slice<const int32_t> start, rust::Slice<const int32_t> stop) {
  // Move the handle into the op and drop ours, so the graph holds the only reference and
  // MLX can donate the buffer (update in place) at evaluation.
  mx::array target = std::move(src->inner);
  src.reset();
  return wrap(mx::slice_update(std::move(target), update.inner, to_shape(start), to_shape(stop)));
}

std::unique_ptr<Array> scatter(std::unique_ptr<Array> src, const ArrayList& indices, const Array& updates, rust::Slice<const int32_t> axes, bool clamp) {
  // As slice_update: the graph holds the only reference, so MLX can write in place.
  mx::array target = std::move(src->inner);
  src.reset();
  std::vector<int> ax(axes.begin(), axes.end());
  std::vector<mx::array> idx = indices.items;
  if (clamp) {
    // MLX does not check scatter indices; out-of-range ones would write outside the array.
    for (size_t i = 0; i < idx.size() && i < ax.size(); i++) {
      int a = ax[i] < 0 ? ax[i] + static_cast<int>(target.ndim()) : ax[i];
      if (a < 0 || a >= static_cast<int>(target.ndim())) {
        throw std::invalid_argument("scatter: axis out of range");
      }
      int top = target.shape(a) - 1;
      idx[i] = mx::clip(idx[i], mx::array(0, idx[i].dtype()), mx::array(top, idx[i].dtype()));
    }
  }
  return wrap(mx::scatter(std::move(target), idx, updates.inner, ax));
}

std::unique_ptr<Array> take(const Array& a, const Array& indices, int32_t axis) { return wrap(mx::take(a.inner, indices.inner, axis)); }
std::unique_ptr<Array> take_along_axis(const Array& a, const Array& indices, int32_t axis) { return wrap(mx::take_along_axis(a.inner, indices.inner, axis)); }
std::unique_ptr<Array> concatenate(const ArrayList& arrays, int32_t axis) { return wrap(mx::concatenate(arrays.items, axis)); }
std::unique_ptr<Array> stack(const ArrayList& arrays, int32_t axis) { return wrap(mx::stack(arrays.items, axis)); }
std::unique_ptr<Array> astype(const Array& a, uint8_t dtype) { return wrap(mx::astype(a.inner, to_dtype(dtype))); }
std::unique_ptr<Array> contiguous(const Array& a) { return wrap(mx::contiguous(a.inner)); }

namespace {

mx::array silu_of(const mx::array& x) { return mx::multiply(x, mx::sigmoid(x)); }

// 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), computed in x's dtype.
mx::array gelu_tanh_of(const mx::array& x) {
  auto dt = x.dtype();
  auto c = mx::array(0.7978845608028654, dt);
  auto inner = mx::multiply(c, mx::add(x, mx::multiply(mx::array(0.044715, dt), mx::multiply(x, mx::square(x)))));
  return mx::multiply(mx::multiply(mx::array(0.5, dt), x), mx::add(mx::array(1.0, dt), mx::tanh(inner)));
}

std::vector<mx::array> silu_mul_graph(const std::vector<mx::array>& in) {
  return {mx::multiply(silu_of(in.at(0)), in.at(1))};
}

std::vector<mx::array> gelu_tanh_mul_graph(const std::vector<mx::array>& in) {
  return {mx::multiply(gelu_tanh_of(in.at(0)), in.at(1))};
}

}  // namespace

std::unique_ptr<Array> unary(UnaryOp op, const Array& a) {
  const auto& x = a.inner;
  switch (op) {
    case UnaryOp::Negative: return wrap(mx::negative(x));
    case UnaryOp::Abs: return wrap(mx::abs(x));
    case UnaryOp::Exp: return wrap(mx::exp(x));
    case UnaryOp::Log: return wrap(mx::log(x));
    case UnaryOp::Sqrt: return wrap(mx::sqrt(x));
    case UnaryOp::Rsqrt: return wrap(mx::rsqrt(x));
    case UnaryOp::Square: return wrap(mx::square(x));
    case UnaryOp::Tanh: return wrap(mx::tanh(x));
    case UnaryOp::Sigmoid: return wrap(mx::sigmoid(x));
    case UnaryOp::Sin: return wrap(mx::sin(x));
    case UnaryOp::Cos: return wrap(mx::cos(x));
    case UnaryOp::LogicalNot: return wrap(mx::logical_not(x));
    case UnaryOp::Silu: return wrap(silu_of(x));
    case UnaryOp::GeluTanh: return wrap(gelu_tanh_of(x));
  }
  throw std::invalid_argument("unknown unary op");
}

std::unique_ptr<Array> binary(BinaryOp op, const Array& a, const Array& b) {
  const auto& x = a.inner;
  const auto& y = b.inner;
  switch (op) {
    case BinaryOp::Add: return wrap(mx::add(x, y));
    case BinaryOp::Subtract: return wrap(mx::subtract(x, y));
    case BinaryOp::Multiply: return wrap(mx::multiply(x, y));
    case BinaryOp::Divide: return wrap(mx::divide(x, y));
    case BinaryOp::Maximum: return wrap(mx::maximum(x, y));
    case BinaryOp::Minimum: return wrap(mx::minimum(x, y));
    case BinaryOp::Power: return wrap(mx::power(x, y));
    case BinaryOp::Equal: return wrap(mx::equal(x, y));
    case BinaryOp::NotEqual: return wrap(mx::not_equal(x, y));
    case BinaryOp::Less: return wrap(mx::less(x, y));
    case BinaryOp::LessEqual: return wrap(mx::less_equal(x, y));
    case BinaryOp::Greater: return wrap(mx::greater(x, y));
    case BinaryOp::GreaterEqual: return wrap(mx::greater_equal(x, y));
    case BinaryOp::LogicalAnd: return wrap(mx::logical_and(x, y));
    case BinaryOp::LogicalOr: return wrap(mx::logical_or(x, y));
  }
  throw std::invalid_argument("unknown binary op");
}

std::unique_ptr<Array> where_(const Array& cond, const Array& a, const Array& b) { return wrap(mx::where(cond.inner, a.inner, b.inner)); }

std::unique_ptr<Array> reduce(ReduceOp op, const Array& a, int32_t axis, bool keepdims) {
  const auto& x = a.inner;
  switch (op) {
    case ReduceOp::Sum: return wrap(mx::sum(x, axis, keepdims));
    case ReduceOp::Mean: return wrap(mx::mean(x, axis, keepdims));
    case ReduceOp::Max: return wrap(mx::max(x, axis, keepdims));
    case ReduceOp::Min: return wrap(mx::min(x, axis, keepdims));
    case ReduceOp::Argmax: return wrap(mx::argmax(x, axis, keepdims));
    case ReduceOp::Argmin: return wrap(mx::argmin(x, axis, keepdims));
    case ReduceOp::Logsumexp: return wrap(mx::logsumexp(x, axis, keepdims));
  }
  throw std::invalid_argument("unknown reduction");
}

std::unique_ptr<Array> matmul(const Array& a, const Array& b) { return wrap(mx::matmul(a.inner, b.inner)); }
std::unique_ptr<Array> softmax(const Array& a, int32_t axis, bool precise) { return wrap(mx::softmax(a.inner, axis, precise)); }
std::unique_ptr<Array> topk(const Array& a, int32_t k, int32_t axis) { return wrap(mx::topk(a.inner, k, axis)); }
std::unique_ptr<Array> argsort(const Array& a, int32_t axis) { return wrap(mx::argsort(a.inner, axis)); }
std::unique_ptr<Array> sort(const Array& a, int32_t axis) { return wrap(mx::sort(a.inner, axis)); }
std::unique_ptr<Array> cumsum(const Array& a, int32_t axis, bool reverse, bool inclusive) { return wrap(mx::cumsum(a.inner, axis, reverse, inclusive)); }

std::unique_ptr<Array> random_key(uint64_t seed) { return wrap(mx::random::key(seed)); }
std::unique_ptr<ArrayList> split_equal(const Array& a, int32_t parts, int32_t axis) {
  auto out = std::make_unique<ArrayList>();
  out->items = mx::split(a.inner, parts, axis);
  return out;
}

std::unique_ptr<ArrayList> random_split(const Array& key) {
  auto [a, b] = mx::random::split(key.inner);
  auto out = std::make_unique<ArrayList>();
  out->items.push_back(a);
  out->items.push_back(b);
  return out;
}
std::unique_ptr<Array> random_categorical(const Array& logits, int32_t axis, const Array& key) { return wrap(mx::random::categorical(logits.inner, axis, key.inner)); }
std::unique_ptr<Array> random_uniform(rust::Slice<const int32_t> shape, float low, float high, uint8_t dtype, const Array& key) {
  auto dt = to_dtype(dtype);
  return wrap(mx::random::uniform(mx::array(low, dt), mx::array(high, dt), to_shape(shape), dt, key.inner));
}
std::unique_ptr<Array> random_normal(rust::Slice<const int32_t> shape, uint8_t dtype, const Array& key) {
  return wrap(mx::random::normal(to_shape(shape), to_dtype(dtype), 0.0f, 1.0f, key.inner));
}

std::unique_ptr<ArrayList> quantize(const Array& w, int32_t group_size, int32_t bits) {
  auto parts = mx::quantize(w.inner, group_size, bits, "affine");
  auto out = std::make_unique<ArrayList>();
  out->items = std::move(parts);
  return out;
}
std::unique_ptr<Array> dequantize(const Array& w, const Array& scales, const ArrayList& biases, int32_t group_size, int32_t bits) {
  return wrap(mx::dequantize(w.inner, scales.inner, optional(biases), group_size, bits, "affine"));
}
std::unique_ptr<Array> quantized_matmul(const Array& x, const Array& w, const Array& scales, const ArrayList& biases, bool transpose, int32_t group_size, int32_t bits) {
  return wrap(mx::quantized_matmul(x.inner, w.inner, scales.inner, optional(biases), transpose, group_size, bits, "affine"));
}

namespace {

// RMSNorm as MLX runs it on the CPU (its fallback: in f32, then the output dtype times the
// weight), written as one function for `compile`: x, the weight in the output dtype, eps.
std::vector<mx::array> rms_norm_graph(const std::vector<mx::array>& in) {
  auto xf = mx::astype(in.at(0), mx::float32);
  auto y = mx::multiply(xf, mx::rsqrt(mx::add(mx::mean(mx::square(xf), -1, true), in.at(2))));
  return {mx::multiply(mx::astype(y, in.at(1).dtype()), in.at(1))};
}

}  // namespace

std::unique_ptr<Array> rms_norm(const Array& x, const ArrayList& weight, float eps) {
  if (mx::default_device() != mx::Device(mx::Device::cpu)) {
    return wrap(mx::fast::rms_norm(x.inner, optional(weight), eps));
  }
  // MLX's CPU RMSNorm is its fallback graph, 11 nodes a call. The same ops compiled
  // (shapeless) are 4 nodes with the element-wise tail fused, and give the same bits
  // (checked against mx::fast::rms_norm for f32, f16 and bf16).
  const auto& a = x.inner;
  if (a.ndim() == 0 || !mx::issubdtype(a.dtype(), mx::floating)) {
    throw std::invalid_argument("rms_norm needs a floating input of at least one dimension");
  }
  mx::Dtype out = a.dtype();
  mx::array w = mx::array(1, out);
  if (!weight.items.empty()) {
    const auto& given = weight.items.front();
    if (given.ndim() != 1 || given.shape(0) != a.shape(-1)) {
      throw std::invalid_argument("rms_norm's weight must be one-dimensional, as long as the input's last axis");
    }
    out = mx::promote_types(a.dtype(), given.dtype());
    w = mx::astype(given, out);
  }
  static const auto compiled = mx::compile(rms_norm_graph, /* shapeless= */ true);
  static std::mutex lock;
  std::lock_guard<std::mutex> guard(lock);
  return wrap(compiled({mx::astype(a, out), w, mx::array(eps, mx::float32)}).at(0));
}

std::unique_ptr<Array> rope(const Array& x, int32_t dims, bool traditional, float base, bool has_base, float scale, int32_t offset, const ArrayList& freqs) {
  std::optional<float> b = has_base ? std::optional<float>(base) : std::nullopt;
  return wrap(mx::fast::rope(x.inner, dims, traditional, b, scale, offset, optional(freqs)));
}
std::unique_ptr<Array> rope_offsets(const Array& x, int32_t dims, bool traditional, float base, bool has_base, float scale, const Array& offsets, const ArrayList& freqs) {
  std::optional<float> b = has_base ? std::optional<float>(base) : std::nullopt;
  return wrap(mx::fast::rope(x.inner, dims, traditional, b, scale, offsets.inner, optional(freqs)));
}

std::unique_ptr<Array> sdpa(const Array& q, const Array& k, const Array& v, float scale, rust::Str mask_mode, const ArrayList& mask) {
  return wrap(mx::fast::scaled_dot_product_attention(q.inner, k.inner, v.inner, scale, std::string(mask_mode), optional(mask)));
}

std::unique_ptr<Array> gated_activation(UnaryOp op, const Array& gate, const Array& up) {
  if (gate.inner.shape() != up.inner.shape() || gate.inner.dtype() != up.inner.dtype()) {
    throw std::invalid_argument("a gated activation needs a gate and an input of one shape and dtype");
  }
  // Compiled once per process, shapeless: one fused node per call whatever the shape (a new
  // dtype traces again). MLX's compile cache is global state: one caller at a time.
  static const auto silu_mul = mx::compile(silu_mul_graph, /* shapeless= */ true);
  static const auto gelu_tanh_mul = mx::compile(gelu_tanh_mul_graph, /* shapeless= */ true);
  static std::mutex lock;
  std::lock_guard<std::mutex> guard(lock);
  switch (op) {
    case UnaryOp::Silu: return wrap(silu_mul({gate.inner, up.inner}).at(0));
    case UnaryOp::GeluTanh: return wrap(gelu_tanh_mul({gate.inner, up.inner}).at(0));
    default: throw std::invalid_argument("a gated activation is silu or gelu_tanh");
  }
}

// The f32 values of `a` in row-major order: its own memory when it is row-contiguous, else
// gathered through its strides into `scratch`.
const float* row_major(const mx::array& a, std::vector<float>& scratch) {
  if (a.flags().row_contiguous) return a.data<float>();
  scratch.resize(a.size());
  const float* base = a.data<float>();
  const auto& shape = a.shape();
  const auto& strides = a.strides();
  std::vector<int64_t> index(shape.size(), 0);
  for (size_t i = 0; i < a.size(); ++i) {
    int64_t at = 0;
    for (size_t d = 0; d < shape.size(); ++d) at += index[d] * strides[d];
    scratch[i] = base[at];
    for (size_t d = shape.size(); d-- > 0;) {
      if (++index[d] < shape[d]) break;
      index[d] = 0;
    }
  }
  return scratch.data();
}

namespace {


// `x · wᵀ` for a few f32 rows on the CPU: the graph node of `rows_times_weight_t`. Its CPU
// evaluation queues one task on the stream's thread, which runs the Rust kernel (itself on
// rayon's threads); the input buffers stay alive until the task has run because MLX's CPU
// evaluation queues the release of a node's inputs after the node's own tasks.
class RowsTimesWeightT : public mx::UnaryPrimitive {
 public:
  explicit RowsTimesWeightT(mx::Stream s) : mx::UnaryPrimitive(s) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array& x = inputs[0];
    const mx::array& w = inputs[1];
    const size_t k = static_cast<size_t>(w.shape(1));
    const size_t n = static_cast<size_t>(w.shape(0));
    const size_t rows = x.size() / k;
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(x);
    encoder.set_input_array(w);
    encoder.set_output_array(out);
    // A view that is not row-contiguous (a transpose's output, a slice) is gathered into
    // rows first. The engine's weights are contiguous (loaded, or stacked at load); a
    // weight handed as a view would be gathered too, correct but at a copy per call.
    encoder.dispatch([x = mx::array::unsafe_weak_copy(x), w = mx::array::unsafe_weak_copy(w),
                      op = out.data<float>(), rows, k, n]() {
      std::vector<float> xs, ws;
      const float* xp = row_major(x, xs);
      const float* wp = row_major(w, ws);
      rows_times_weight_t_host(rust::Slice<const float>(xp, rows * k),
                               rust::Slice<const float>(wp, n * k), rows, k,
                               rust::Slice<float>(op, rows * n));
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("RowsTimesWeightT runs on the CPU only");
  }

  const char* name() const override { return "RowsTimesWeightT"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    mx::Shape s = inputs[0].shape();
    s.back() = inputs[1].shape(0);
    return {s};
  }
};

// A [B, H, S, D] view read in place when its last axis is contiguous (an arena's slice),
// else gathered row-major: its values from the returned pointer, the element strides of
// its first three axes and how many values they reach.
struct KvRead {
  const float* data;
  std::array<size_t, 3> strides;
  size_t span;
};

KvRead kv_read(const mx::array& a, std::vector<float>& scratch) {
  const auto& sh = a.shape();
  const auto& st = a.strides();
  bool in_place = st[3] == 1;
  for (int i = 0; i < 3; ++i) in_place = in_place && st[i] >= 0;
  if (!in_place) {
    const float* p = row_major(a, scratch);
    size_t d = sh[3], s = sh[2], h = sh[1];
    return {p, {h * s * d, s * d, d}, a.size()};
  }
  size_t span = sh[3];
  for (int i = 0; i < 3; ++i) span += static_cast<size_t>(sh[i] - 1) * st[i];
  return {a.data<float>(), {size_t(st[0]), size_t(st[1]), size_t(st[2])}, span};
}

// softmax(q kᵀ · scale) v for one query per head: the graph node of `one_query_attention`,
// evaluated as one task on the CPU stream's thread that runs the Rust kernel.
class OneQueryAttention : public mx::UnaryPrimitive {
 public:
  OneQueryAttention(mx::Stream s, float scale) : mx::UnaryPrimitive(s), scale_(scale) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& in : inputs) encoder.set_input_array(in);
    encoder.set_output_array(out);
    const auto& qs = inputs[0].shape();
    const auto& ks = inputs[1].shape();
    std::array<size_t, 5> dims = {size_t(qs[0]), size_t(qs[1]), size_t(ks[1]), size_t(ks[2]),
                                  size_t(qs[3])};
    encoder.dispatch([q = mx::array::unsafe_weak_copy(inputs[0]),
                      k = mx::array::unsafe_weak_copy(inputs[1]),
                      v = mx::array::unsafe_weak_copy(inputs[2]), op = out.data<float>(),
                      n = out.size(), dims, scale = scale_]() {
      std::vector<float> qs_, ks_, vs_;
      const float* qp = row_major(q, qs_);
      KvRead kr = kv_read(k, ks_);
      KvRead vr = kv_read(v, vs_);
      // The keys' and values' strides, then the shape (what one_query_host reads).
      std::array<size_t, 11> at = {kr.strides[0], kr.strides[1], kr.strides[2], vr.strides[0],
                                   vr.strides[1], vr.strides[2], dims[0], dims[1], dims[2],
                                   dims[3], dims[4]};
      one_query_host(rust::Slice<const float>(qp, q.size()),
                     rust::Slice<const float>(kr.data, kr.span),
                     rust::Slice<const float>(vr.data, vr.span),
                     rust::Slice<const size_t>(at.data(), at.size()), scale,
                     rust::Slice<float>(op, n));
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("OneQueryAttention runs on the CPU only");
  }

  const char* name() const override { return "OneQueryAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return scale_ == static_cast<const OneQueryAttention&>(other).scale_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  float scale_;
};

// A gated MLP's activation over the stacked gate/up product of f32 rows: the graph node of
// `gated_mul_stacked_cpu`, one task on the CPU stream's thread that runs the Rust kernel
// (`cpu_activation::gated_mul_rows`, vectorized, on rayon's threads).
class GatedMulStacked : public mx::UnaryPrimitive {
 public:
  GatedMulStacked(mx::Stream s, bool silu) : mx::UnaryPrimitive(s), silu_(silu) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(inputs[0]);
    encoder.set_output_array(out);
    encoder.dispatch([y = mx::array::unsafe_weak_copy(inputs[0]), op = out.data<float>(),
                      n = out.size(), silu = silu_]() {
      std::vector<float> ys;
      const float* yp = row_major(y, ys);
      const size_t inter = static_cast<size_t>(y.shape(-1) / 2);
      gated_mul_host(silu, rust::Slice<const float>(yp, y.size()), inter,
                     rust::Slice<float>(op, n));
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("GatedMulStacked runs on the CPU only");
  }

  const char* name() const override { return "GatedMulStacked"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return silu_ == static_cast<const GatedMulStacked&>(other).silu_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    mx::Shape s = inputs[0].shape();
    s.back() /= 2;
    return {s};
  }

 private:
  bool silu_;
};

// RoPE's rotation of f32 heads with angles made once a step: the graph node of
// `rope_rotate`, one task on the CPU stream's thread that runs the Rust kernel (which reads
// the input through its strides, so a transposed or sliced view is not gathered first).
class RopeRotate : public mx::UnaryPrimitive {
 public:
  RopeRotate(mx::Stream s, int dims, bool traditional)
      : mx::UnaryPrimitive(s), dims_(dims), traditional_(traditional) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& in : inputs) encoder.set_input_array(in);
    encoder.set_output_array(out);
    encoder.dispatch([x = mx::array::unsafe_weak_copy(inputs[0]),
                      cos = mx::array::unsafe_weak_copy(inputs[1]),
                      sin = mx::array::unsafe_weak_copy(inputs[2]), op = out.data<float>(),
                      n = out.size(), dims = dims_, traditional = traditional_]() {
      std::vector<float> xs, cs, ss;
      const auto& sh = x.shape();
      const auto& st = x.strides();
      bool in_place = true;
      for (int i = 0; i < 4; ++i) in_place = in_place && st[i] >= 0;
      const float* xp;
      std::array<size_t, 4> strides;
      size_t span = x.size() == 0 ? 0 : 1;
      if (in_place) {
        xp = x.data<float>();
        for (int i = 0; i < 4; ++i) {
          strides[i] = static_cast<size_t>(st[i]);
          if (x.size() > 0) span += static_cast<size_t>(sh[i] - 1) * strides[i];
        }
      } else {
        xp = row_major(x, xs);
        strides = {size_t(sh[1]) * sh[2] * sh[3], size_t(sh[2]) * sh[3], size_t(sh[3]), 1};
        span = x.size();
      }
      std::array<size_t, 11> at = {strides[0], strides[1], strides[2], strides[3],
                                   size_t(sh[0]), size_t(sh[1]), size_t(sh[2]), size_t(sh[3]),
                                   size_t(dims), traditional ? 1u : 0u, cos.ndim() == 4 ? 1u : 0u};
      const float* cp = row_major(cos, cs);
      const float* sp = row_major(sin, ss);
      rope_rotate_host(rust::Slice<const float>(xp, span),
                       rust::Slice<const float>(cp, cos.size()),
                       rust::Slice<const float>(sp, sin.size()),
                       rust::Slice<const size_t>(at.data(), at.size()), rust::Slice<float>(op, n));
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("RopeRotate runs on the CPU only");
  }

  const char* name() const override { return "RopeRotate"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const RopeRotate&>(other);
    return dims_ == o.dims_ && traditional_ == o.traditional_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  int dims_;
  bool traditional_;
};

}  // namespace

std::unique_ptr<Array> gated_mul_stacked_cpu(const Array& y, bool silu) {
  const auto& a = y.inner;
  if (a.dtype() != mx::float32 || a.ndim() == 0 || a.shape(-1) == 0 || a.shape(-1) % 2 != 0) {
    throw std::invalid_argument("the CPU gated activation takes f32 rows of an even width");
  }
  mx::Shape shape = a.shape();
  shape.back() /= 2;
  auto stream = mx::default_stream(mx::Device::cpu);
  return wrap(mx::array(std::move(shape), mx::float32,
                        std::make_shared<GatedMulStacked>(stream, silu), {a}));
}

std::unique_ptr<Array> rope_rotate(const Array& x, const Array& cos, const Array& sin, int32_t dims, bool traditional) {
  const auto &a = x.inner, &c = cos.inner, &s = sin.inner;
  if (a.dtype() != mx::float32 || c.dtype() != mx::float32 || s.dtype() != mx::float32) {
    throw std::invalid_argument("the CPU rotation takes f32 heads and f32 angles");
  }
  if (a.ndim() != 4 || dims <= 0 || dims % 2 != 0 || dims > a.shape(3)) {
    throw std::invalid_argument("the CPU rotation needs [B, H, T, D] input and even dims <= D");
  }
  const int b = a.shape(0), t = a.shape(2), half = dims / 2;
  const bool shared = c.shape() == mx::Shape{t, half};
  const bool per_row = c.shape() == mx::Shape{b, 1, t, half};
  if (c.shape() != s.shape() || !(shared || per_row)) {
    throw std::invalid_argument("the CPU rotation's angles must be [T, dims/2] or [B, 1, T, dims/2]");
  }
  auto stream = mx::default_stream(mx::Device::cpu);
  return wrap(mx::array(a.shape(), mx::float32,
                        std::make_shared<RopeRotate>(stream, dims, traditional), {a, c, s}));
}

std::unique_ptr<Array> one_query_attention(const Array& q, const Array& k, const Array& v, float scale) {
  const auto &qa = q.inner, &ka = k.inner, &va = v.inner;
  for (const auto* a : {&qa, &ka, &va}) {
    if (a->dtype() != mx::float32 || a->ndim() != 4) {
      throw std::invalid_argument("one-query attention takes 4-D f32 q, k and v");
    }
  }
  if (qa.shape(2) != 1 || ka.shape() != va.shape() || qa.shape(0) != ka.shape(0) ||
      qa.shape(3) != ka.shape(3) || ka.shape(1) == 0 || ka.shape(2) == 0 ||
      qa.shape(1) % ka.shape(1) != 0) {
    throw std::invalid_argument(
        "one-query attention takes q [B, Hq, 1, D] and k, v [B, Hkv, S, D] with Hq a multiple of Hkv");
  }
  auto stream = mx::default_stream(mx::Device::cpu);
  return wrap(mx::array(qa.shape(), mx::float32, std::make_shared<OneQueryAttention>(stream, scale),
                        {qa, ka, va}));
}

std::unique_ptr<Array> rows_times_weight_t(const Array& x, const Array& w, size_t max_rows) {
  const auto& xa = x.inner;
  const auto& wa = w.inner;
  if (xa.dtype() != mx::float32 || wa.dtype() != mx::float32) {
    throw std::invalid_argument("the row product takes f32 rows and an f32 weight");
  }
  if (wa.ndim() != 2 || xa.ndim() < 1 || xa.shape(-1) != wa.shape(1) || wa.shape(1) == 0) {
    throw std::invalid_argument("the row product takes rows [.., k] and a weight [n, k]");
  }
  const size_t rows = xa.size() / static_cast<size_t>(wa.shape(1));
  if (rows == 0 || rows > max_rows) {
    throw std::invalid_argument("the row product takes 1 to " + std::to_string(max_rows) +
                                " rows, got " + std::to_string(rows));
  }
  mx::Shape shape = xa.shape();
  shape.back() = wa.shape(0);
  auto stream = mx::default_stream(mx::Device::cpu);
  return wrap(mx::array(std::move(shape), mx::float32,
                        std::make_shared<RowsTimesWeightT>(stream), {xa, wa}));
}

void eval(const ArrayList& arrays) { mx::eval(arrays.items); }
void async_eval(const ArrayList& arrays) { mx::async_eval(arrays.items); }
void synchronize() { mx::synchronize(); }

bool array_same_node(const Array& a, const Array& b) { return a.inner.id() == b.inner.id(); }

// RoPE's angles for positions (offset + 0..t) * scale, the same ops in the same order and
// dtypes as MLX's own RoPE on the CPU (its fallback), so that what rope_apply makes of them
// equals mx::fast::rope bit for bit; computed once, they serve every layer of a step.
std::unique_ptr<ArrayList> rope_angles(int32_t t, const Array& offset, int32_t dims, float base, bool has_base, float scale, const ArrayList& freqs, uint8_t dtype) {
  if (dims <= 0 || dims % 2 != 0) throw std::invalid_argument("rope dims must be positive and even");
  const int half = dims / 2;
  mx::array off = offset.inner;
  if (off.ndim() > 1) throw std::invalid_argument("a rope offset is a scalar or one per row");
  if (off.size() > 1) off = mx::expand_dims(off, {-1, -2});
  mx::array positions = mx::multiply(mx::add(mx::arange(t, mx::float32), off), mx::array(scale, mx::float32));
  mx::array inv = has_base
      ? mx::exp(mx::multiply(mx::arange(0, -half, -1, mx::float32), mx::array(std::log(base) / half, mx::float32)))
      : mx::reciprocal(freqs.items.at(0));
  mx::array theta = mx::multiply(mx::expand_dims(positions, -1), inv);
  auto dt = to_dtype(dtype);
  auto out = std::make_unique<ArrayList>();
  out->items.push_back(mx::astype(mx::cos(theta), dt));
  out->items.push_back(mx::astype(mx::sin(theta), dt));
  return out;
}

std::unique_ptr<Array> rope_apply(const Array& x, const Array& cos, const Array& sin, int32_t dims, bool traditional) {
  const mx::array& a = x.inner;
  if (a.ndim() != 4 || dims <= 0 || dims % 2 != 0 || dims > a.shape(3)) {
    throw std::invalid_argument("rope_apply needs [B, H, T, D] input and even dims <= D");
  }
  const auto shape = a.shape();
  const int b = shape[0], n = shape[1], t = shape[2], half = dims / 2;
  auto rotate = [&](const mx::array& x1, const mx::array& x2) {
    return std::vector<mx::array>{
        mx::subtract(mx::multiply(x1, cos.inner), mx::multiply(x2, sin.inner)),
        mx::add(mx::multiply(x1, sin.inner), mx::multiply(x2, cos.inner))};
  };
  mx::array out = a;
  if (traditional) {
    auto parts = rotate(mx::slice(a, {0, 0, 0, 0}, {b, n, t, dims}, {1, 1, 1, 2}),
                        mx::slice(a, {0, 0, 0, 1}, {b, n, t, dims}, {1, 1, 1, 2}));
    for (auto& p : parts) p = mx::expand_dims(p, -1);
    out = mx::reshape(mx::concatenate(parts, -1), {b, n, t, dims});
    if (dims < shape[3]) out = mx::concatenate({out, mx::slice(a, {0, 0, 0, dims}, shape)}, -1);
  } else {
    auto parts = rotate(mx::slice(a, {0, 0, 0, 0}, {b, n, t, half}),
                        mx::slice(a, {0, 0, 0, half}, {b, n, t, dims}));
    if (dims < shape[3]) parts.push_back(mx::slice(a, {0, 0, 0, dims}, shape));
    out = mx::concatenate(parts, -1);
  }
  return wrap(mx::reshape(out, shape));
}
bool array_is_available(const Array& a) { return a.inner.is_available(); }

// The primitive of every node an eval of `arrays` would run (not yet scheduled, one entry
// per primitive: the outputs of a multi-output op share one), walking inputs from `arrays`.
rust::Vec<rust::String> pending_primitives(const ArrayList& arrays) {
  std::unordered_set<std::uintptr_t> seen_arrays;
  std::unordered_set<std::uintptr_t> seen_primitives;
  std::unordered_set<std::uintptr_t> seen_leaves;
  std::vector<mx::array> stack(arrays.items.begin(), arrays.items.end());
  rust::Vec<rust::String> names;
  while (!stack.empty()) {
    mx::array a = stack.back();
    stack.pop_back();
    if (!seen_arrays.insert(a.id()).second || !a.has_primitive() ||
        a.status() != mx::array::Status::unscheduled) {
      continue;
    }
    if (seen_primitives.insert(a.primitive_id()).second) {
      names.push_back(rust::String(a.primitive().name()));
    }
    for (const auto& i : a.inputs()) {
      // A small computed input of a pending node: mostly a constant the host made for this
      // graph (a scalar operand, an offset), whose bytes a CUDA device reads from managed
      // memory; also a small result of an earlier graph (a previous step's pick).
      if (!i.has_primitive() && i.nbytes() <= 64 && seen_leaves.insert(i.id()).second) {
        names.push_back(rust::String("(small leaf)"));
      }
      stack.push_back(i);
    }
  }
  return names;
}

std::unique_ptr<Loaded> load_safetensors(rust::Str path) {
  // Read on the default device's stream, as MLX's own loader chooses on CUDA: there the
  // tensors land in device memory. Read on the CPU stream they would live in CUDA managed
  // memory, and a kernel touching part of a tensor the device never read whole (a decode
  // step's embedding row) waits for a page migration each time (docs/benchmarks.md,
  // session 53: ~0.3 ms an 8B decode step). Without CUDA (the CPU, Metal's unified
  // memory) MLX reads on the CPU stream either way.
  auto [arrays, meta] = mx::load_safetensors(std::string(path), mx::default_device());
  auto out = from_pairs(std::move(arrays));
  for (auto& [k, v] : meta) {
    out->meta_keys.push_back(k);
    out->meta_kinds.push_back(2);
    out->meta_strings.push_back(v);
    out->meta_lists.emplace_back();
    out->meta_arrays.push_back(mx::array(0));
  }
  return out;
}

std::unique_ptr<Loaded> load_gguf(rust::Str path) {
  auto [arrays, meta] = mx::load_gguf(std::string(path), mx::Device(mx::Device::cpu));
#ifdef KVSTORE_CUDA
  // MLX builds GGUF tensors on the host, in CUDA managed memory: copied (lazily, each when
  // it is first evaluated) into device memory, as load_safetensors reads them, so that no
  // kernel waits on a page migration (a decode step's embedding row).
  if (mx::default_device() == mx::Device(mx::Device::gpu)) {
    for (auto& [name, a] : arrays) a = mx::copy(a, mx::default_device());
  }
#endif
  auto out = from_pairs(std::move(arrays));
  for (auto& [k, v] : meta) {
    out->meta_keys.push_back(k);
    uint8_t kind = 0;
    std::string s;
    std::vector<std::string> list;
    mx::array arr = mx::array(0);
    if (auto* p = std::get_if<mx::array>(&v)) { kind = 1; arr = *p; }
    else if (auto* p = std::get_if<std::string>(&v)) { kind = 2; s = *p; }
    else if (auto* p = std::get_if<std::vector<std::string>>(&v)) { kind = 3; list = *p; }
    out->meta_kinds.push_back(kind);
    out->meta_strings.push_back(std::move(s));
    out->meta_lists.push_back(std::move(list));
    out->meta_arrays.push_back(arr);
  }
  return out;
}

void save_safetensors(rust::Str path, const Loaded& contents) {
  std::unordered_map<std::string, mx::array> arrays;
  for (size_t i = 0; i < contents.names.size(); ++i) arrays.insert({contents.names[i], contents.arrays[i]});
  std::unordered_map<std::string, std::string> meta;
  for (size_t i = 0; i < contents.meta_keys.size(); ++i) meta.insert({contents.meta_keys[i], contents.meta_strings[i]});
  mx::save_safetensors(std::string(path), std::move(arrays), std::move(meta));
}

std::unique_ptr<Loaded> loaded_new() { return std::make_unique<Loaded>(); }
void loaded_push_array(Loaded& l, rust::Str name, const Array& a) {
  l.names.emplace_back(name);
  l.arrays.push_back(a.inner);
}
void loaded_push_meta(Loaded& l, rust::Str key, rust::Str value) {
  l.meta_keys.emplace_back(key);
  l.meta_kinds.push_back(2);
  l.meta_strings.emplace_back(value);
  l.meta_lists.emplace_back();
  l.meta_arrays.push_back(mx::array(0));
}
size_t loaded_len(const Loaded& l) { return l.names.size(); }
rust::String loaded_name(const Loaded& l, size_t i) { return rust::String(l.names.at(i)); }
std::unique_ptr<Array> loaded_array(const Loaded& l, size_t i) { return wrap(l.arrays.at(i)); }
size_t loaded_meta_len(const Loaded& l) { return l.meta_keys.size(); }
rust::String loaded_meta_key(const Loaded& l, size_t i) { return rust::String(l.meta_keys.at(i)); }
uint8_t loaded_meta_kind(const Loaded& l, size_t i) { return l.meta_kinds.at(i); }
rust::String loaded_meta_string(const Loaded& l, size_t i) { return rust::String::lossy(l.meta_strings.at(i)); }
rust::Vec<rust::String> loaded_meta_list(const Loaded& l, size_t i) {
  rust::Vec<rust::String> out;
  for (const auto& s : l.meta_lists.at(i)) out.push_back(rust::String::lossy(s));
  return out;
}
std::unique_ptr<Array> loaded_meta_array(const Loaded& l, size_t i) { return wrap(l.meta_arrays.at(i)); }

void set_default_device(bool gpu) { mx::set_default_device(mx::Device(gpu ? mx::Device::gpu : mx::Device::cpu)); }
bool default_device_is_gpu() { return mx::default_device().type == mx::Device::gpu; }
bool gpu_available() { return mx::is_available(mx::Device(mx::Device::gpu)); }
size_t active_memory() { return mx::get_active_memory(); }
size_t peak_memory() { return mx::get_peak_memory(); }
void reset_peak_memory() { mx::reset_peak_memory(); }
size_t cache_memory() { return mx::get_cache_memory(); }
size_t set_cache_limit(size_t limit) { return mx::set_cache_limit(limit); }
size_t device_memory_size() {
  // MLX 0.32's device_info names the total "total_memory" or "memory_size" by backend.
  const auto& info = mx::device_info(mx::default_device());
  for (const char* key : {"total_memory", "memory_size"}) {
    auto it = info.find(key);
    if (it != info.end()) {
      if (const size_t* v = std::get_if<size_t>(&it->second)) return *v;
    }
  }
  return 0;
}
void clear_cache() { mx::clear_cache(); }
rust::String version() { return rust::String(mx::version()); }

}  // namespace kvmlx
