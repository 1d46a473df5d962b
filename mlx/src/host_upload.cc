// A node whose output is an array of zeros with rows of host bytes in it, read when the node
// runs (`HostRowsUpload`): a restore's upload that the device orders with the rest of the
// graph, so the thread that builds the graph never waits for the bytes to cross the bus.
//
// On CUDA a kernel reads the rows straight from page-locked host memory (mapped into the
// device's address space: `cuMemHostAlloc` with DEVICEMAP, its device address from
// `cuMemHostGetDevicePointer`) into zeros an MLX op made (the node's input, whose device
// buffer the output shares): one kernel node in MLX's graph,
// ordered by the buffers it declares like every other node, so the prefill that reads the
// arrays waits for it on the device. The host bytes are held by the node's source until the
// command buffer that ran it has completed (`CommandEncoder::add_completed_handler`); then
// (or when the node is dropped unevaluated) the Rust side is told it may reuse them
// (`release_host_rows`). On the CPU the same node copies the rows on the CPU stream's thread.
//
// `HostRowsGather` is the same node for rows scattered over many host buffers: a table of
// (source address, offset in the output) pairs, each a row of `width` bytes, so that blocks
// the host tier keeps in page-locked memory are read where they lie, with no assembly.
//
// What it relies on (MLX 0.32.4's CUDA backend, headers in the wheel): the symbols
// rows_attention.cc lists, and `CommandEncoder::add_completed_handler`, exported by libmlx.
// The kernel is compiled by NVRTC (nvrtc.h) once per device.
#include "shim.h"

#include "kvstore-mlx/src/ffi.rs.h"

#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"

#ifdef KVSTORE_CUDA
#include <map>
#include <mutex>

#include "mlx/backend/cuda/device.h"
#include "nvrtc.h"
#endif  // KVSTORE_CUDA

namespace kvmlx {
namespace {

namespace mx = mlx::core;

// The host rows of one node: `height` rows of `width` bytes at `src`, which go at a pitch
// of `pitch` bytes in the output. Tells the Rust side when the node is done with them.
struct Source {
  const uint8_t* src;
  size_t width, height, pitch;
  uint64_t token;
  Source(const uint8_t* s, size_t w, size_t h, size_t p, uint64_t t)
      : src(s), width(w), height(h), pitch(p), token(t) {}
  Source(const Source&) = delete;
  Source& operator=(const Source&) = delete;
  ~Source() { release_host_rows(token); }
};

// The rows into `out`, whose zeros an MLX op made (the node's input, whose buffer it shares).
void copy_host(const Source& s, uint8_t* out) {
  for (size_t r = 0; r < s.height; ++r) std::memcpy(out + r * s.pitch, s.src + r * s.width, s.width);
}

// The rows of one gather node: `entries` pairs at `table` (a row's source address, then
// its offset in the output), each row `width` bytes. Tells the Rust side when the node is
// done with the table and the rows.
struct GatherSource {
  const uint64_t* table;
  size_t entries, width;
  uint64_t token;
  GatherSource(const uint64_t* t, size_t e, size_t w, uint64_t tok) : table(t), entries(e), width(w), token(tok) {}
  GatherSource(const GatherSource&) = delete;
  GatherSource& operator=(const GatherSource&) = delete;
  ~GatherSource() { release_host_rows(token); }
};

void copy_host(const GatherSource& s, uint8_t* out) {
  for (size_t e = 0; e < s.entries; ++e) {
    std::memcpy(out + s.table[2 * e + 1], reinterpret_cast<const uint8_t*>(s.table[2 * e]), s.width);
  }
}

#ifdef KVSTORE_CUDA

namespace cu = mlx::core::cu;

const char* kSource = R"(
struct alignas(16) Word { unsigned long long a, b; };
extern "C" __global__ void host_rows(const unsigned char* __restrict__ src,
                                     unsigned char* __restrict__ dst,
                                     unsigned long long width, unsigned long long height,
                                     unsigned long long pitch, int words) {
  const unsigned long long step = (unsigned long long)gridDim.x * blockDim.x;
  const unsigned long long first = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  const unsigned long long unit = words ? 16 : 1, per_row = width / unit, n = per_row * height;
  for (unsigned long long i = first; i < n; i += step) {
    const unsigned long long row = i / per_row, col = (i - row * per_row) * unit;
    if (words) {
      *reinterpret_cast<Word*>(dst + row * pitch + col) = *reinterpret_cast<const Word*>(src + row * width + col);
    } else {
      dst[row * pitch + col] = src[row * width + col];
    }
  }
}
// One thread block per table entry at a time: its first thread reads the entry (host
// memory, over the bus) once for the block, then the block copies the row.
extern "C" __global__ void host_gather(const unsigned long long* __restrict__ table,
                                       unsigned char* __restrict__ dst,
                                       unsigned long long width, unsigned long long entries, int words) {
  __shared__ unsigned long long entry[2];
  const unsigned long long unit = words ? 16 : 1, per_row = width / unit;
  for (unsigned long long e = blockIdx.x; e < entries; e += gridDim.x) {
    if (threadIdx.x == 0) {
      entry[0] = table[2 * e];
      entry[1] = table[2 * e + 1];
    }
    __syncthreads();
    const unsigned char* src = reinterpret_cast<const unsigned char*>(entry[0]);
    unsigned char* out = dst + entry[1];
    for (unsigned long long i = threadIdx.x; i < per_row; i += blockDim.x) {
      if (words) {
        reinterpret_cast<Word*>(out)[i] = reinterpret_cast<const Word*>(src)[i];
      } else {
        out[i] = src[i];
      }
    }
    __syncthreads();
  }
}
)";

void* lookup(const char* name) { return nvrtc::lookup(name, "the host rows upload"); }

// The kernels on the current device (`host_rows`, `host_gather`), compiled once per
// process and device.
const std::vector<CUfunction>& host_rows_kernels() {
  static std::mutex mu;
  static std::map<int, std::vector<CUfunction>> cache;
  const CUdevice dev = nvrtc::current_device();
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = cache.find(int(dev)); it != cache.end()) return it->second;
  auto fs = nvrtc::compile(kSource, "kvstore_host_rows.cu", {"host_rows", "host_gather"}, "the host rows upload");
  return cache.emplace(int(dev), std::move(fs)).first->second;
}

CUfunction host_rows_kernel() { return host_rows_kernels()[0]; }

void copy_gpu(mx::Stream s, const std::shared_ptr<Source>& source, const mx::array& zeros, mx::array& out) {
  auto& enc = cu::get_command_encoder(s);
  enc.device().make_current();
  auto device_pointer = reinterpret_cast<CUresult (*)(CUdeviceptr*, void*, unsigned int)>(
      lookup("cuMemHostGetDevicePointer_v2"));
  CUdeviceptr src = 0;
  if (device_pointer(&src, const_cast<uint8_t*>(source->src), 0) != 0) {
    // Under unified addressing a mapped page-locked buffer has the same address on both
    // sides (the call may refuse an address inside an allocation rather than its start).
    if (!nvrtc::unified_addressing()) {
      throw std::runtime_error("the host rows are not page-locked memory the device can read");
    }
    src = reinterpret_cast<CUdeviceptr>(source->src);
  }
  // The zeros around the rows come from the input, made by an MLX op in device memory
  // (allocator::malloc would give managed memory: docs/benchmarks.md, session 44).
  out.copy_shared_buffer(zeros);
  enc.set_input_array(zeros);
  enc.set_output_array(out);
  unsigned long long width = source->width, height = source->height, pitch = source->pitch;
  void* dst = mx::gpu_ptr<void>(out);
  int words = width % 16 == 0 && pitch % 16 == 0 && src % 16 == 0 && reinterpret_cast<uintptr_t>(dst) % 16 == 0;
  const unsigned long long units = (words ? width / 16 : width) * height;
  const unsigned int blocks = unsigned(std::min<unsigned long long>((units + 255) / 256, 4096));
  const void* sp = reinterpret_cast<const void*>(src);
  void* args[] = {&sp, &dst, &width, &height, &pitch, &words};
  enc.add_kernel_node_raw(host_rows_kernel(), dim3(std::max(blocks, 1u), 1, 1), dim3(256, 1, 1), dim3(1, 1, 1), 0,
                          args);
  // The host bytes stay lent until the command buffer that reads them has completed.
  enc.add_completed_handler([source]() {});
}

void copy_gpu(mx::Stream s, const std::shared_ptr<GatherSource>& source, const mx::array& zeros,
                     mx::array& out) {
  auto& enc = cu::get_command_encoder(s);
  enc.device().make_current();
  // The table and the rows are page-locked host memory (the caller's contract), read at
  // their host addresses.
  if (!nvrtc::unified_addressing()) {
    throw std::runtime_error("this device cannot read page-locked host memory at its host address");
  }
  out.copy_shared_buffer(zeros);
  enc.set_input_array(zeros);
  enc.set_output_array(out);
  unsigned long long width = source->width, entries = source->entries;
  void* dst = mx::gpu_ptr<void>(out);
  int words = width % 16 == 0 && reinterpret_cast<uintptr_t>(dst) % 16 == 0;
  for (size_t e = 0; words && e < source->entries; ++e) {
    words = source->table[2 * e] % 16 == 0 && source->table[2 * e + 1] % 16 == 0;
  }
  const unsigned int blocks = unsigned(std::min<unsigned long long>(entries, 8192));
  const void* tp = source->table;
  void* args[] = {&tp, &dst, &width, &entries, &words};
  enc.add_kernel_node_raw(host_rows_kernels()[1], dim3(std::max(blocks, 1u), 1, 1), dim3(256, 1, 1),
                          dim3(1, 1, 1), 0, args);
  enc.add_completed_handler([source]() {});
}

#else  // KVSTORE_CUDA

void copy_gpu(mx::Stream, const std::shared_ptr<Source>&, const mx::array&, mx::array&) {
  throw std::runtime_error(
      "this build has no host rows upload for the GPU (build with the CUDA backend's headers: "
      "scripts/cuda/build.sh)");
}

void copy_gpu(mx::Stream, const std::shared_ptr<GatherSource>&, const mx::array&, mx::array&) {
  throw std::runtime_error(
      "this build has no host rows gather for the GPU (build with the CUDA backend's headers: "
      "scripts/cuda/build.sh)");
}

#endif  // KVSTORE_CUDA

// A node whose output shares the buffer of its zeros input and gets host bytes written
// into it from `S` (`Source`: rows of one buffer, `HostRowsUpload`; `GatherSource`: rows
// scattered over host memory, `HostRowsGather`): `copy_host` on the CPU stream's thread,
// `copy_gpu` on CUDA.
template <class S>
class HostBytesNode : public mx::UnaryPrimitive {
 public:
  HostBytesNode(mx::Stream s, std::shared_ptr<S> source, const char* name)
      : mx::UnaryPrimitive(s), source_(std::move(source)), name_(name) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.copy_shared_buffer(inputs[0]);
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(inputs[0]);
    encoder.set_output_array(out);
    encoder.dispatch([source = source_, op = out.data<uint8_t>()]() { copy_host(*source, op); });
  }

  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    copy_gpu(stream(), source_, inputs[0], out);
  }

  const char* name() const override { return name_; }
  bool is_equivalent(const mx::Primitive&) const override { return false; }

 private:
  std::shared_ptr<S> source_;
  const char* name_;
};

}  // namespace

#ifdef KVSTORE_CUDA
bool host_rows_kernel_built() { return true; }
#else
bool host_rows_kernel_built() { return false; }
#endif

namespace {

// The bytes of an array of `dims` and `dt`; a negative dimension is refused (`what` names
// the node).
size_t array_bytes(const mx::Shape& dims, mx::Dtype dt, const char* what) {
  size_t elems = 1;
  for (auto d : dims) {
    if (d < 0) throw std::invalid_argument(std::string("a ") + what + " of a negative dimension");
    elems *= size_t(d);
  }
  return elems * mx::size_of(dt);
}

// The node's array: zeros an MLX op makes (on CUDA device memory from the stream's pool),
// filled from `source` when the node runs.
template <class S>
std::unique_ptr<Array> host_bytes_array(mx::Shape dims, mx::Dtype dt, std::shared_ptr<S> source, const char* name) {
  auto stream = mx::default_stream(mx::default_device());
  auto zeros = mx::zeros(dims, dt, stream);
  auto node = std::make_shared<HostBytesNode<S>>(stream, std::move(source), name);
  return std::make_unique<Array>(Array{mx::array(std::move(dims), dt, std::move(node), {zeros})});
}

}  // namespace

std::unique_ptr<Array> host_rows_upload(rust::Slice<const int32_t> shape, uint8_t dtype, size_t src, size_t len,
                                        size_t width, size_t height, size_t pitch, uint64_t token) {
  // The source is made first, so that every refusal below still hands the bytes back.
  auto source = std::make_shared<Source>(reinterpret_cast<const uint8_t*>(src), width, height, pitch, token);
  mx::Shape dims(shape.begin(), shape.end());
  auto dt = dtype_from_code(dtype);
  const size_t nbytes = array_bytes(dims, dt, "host rows upload");
  if (len != width * height) {
    throw std::invalid_argument("host rows of " + std::to_string(len) + " bytes are not " + std::to_string(height) +
                                " rows of " + std::to_string(width));
  }
  if (height > 0 && (width > pitch || (height - 1) * pitch + width > nbytes)) {
    throw std::invalid_argument(std::to_string(height) + " rows of " + std::to_string(width) + " bytes at a pitch of " +
                                std::to_string(pitch) + " do not fit an array of " + std::to_string(nbytes) +
                                " bytes");
  }
  return host_bytes_array(std::move(dims), dt, std::move(source), "HostRowsUpload");
}

std::unique_ptr<Array> host_rows_gather(rust::Slice<const int32_t> shape, uint8_t dtype, size_t table,
                                        size_t entries, size_t width, uint64_t token) {
  // The source is made first, so that every refusal below still hands the bytes back.
  auto source = std::make_shared<GatherSource>(reinterpret_cast<const uint64_t*>(table), entries, width, token);
  mx::Shape dims(shape.begin(), shape.end());
  auto dt = dtype_from_code(dtype);
  const size_t nbytes = array_bytes(dims, dt, "host rows gather");
  // Every row must land inside the output: the table is host memory, checked here once.
  for (size_t e = 0; e < entries; ++e) {
    const uint64_t at = source->table[2 * e + 1];
    if (width > nbytes || at > nbytes - width) {
      throw std::invalid_argument("a gathered row of " + std::to_string(width) + " bytes at " + std::to_string(at) +
                                  " does not fit an array of " + std::to_string(nbytes) + " bytes");
    }
  }
  return host_bytes_array(std::move(dims), dt, std::move(source), "HostRowsGather");
}

}  // namespace kvmlx
