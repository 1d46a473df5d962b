// See direct_copy.h. Why this exists: on CUDA, MLX reads an array on the host by moving its
// device buffer into managed memory (`Buffer::raw_ptr` -> `move_to_unified_memory`) and lets
// the host fault the pages in, and it takes host bytes into managed memory that the GPU then
// faults in. Both ran at ~1-3 GB/s on the H200, which made publishing and restoring KV the
// slowest part of a prefix hit. A DMA copy through the driver (`cuMemcpyDtoH` / `cuMemcpyHtoD`)
// does not depend on page faults and leaves the array in device memory.
//
// What it relies on, checked at run time:
// - libcuda.so.1 is already loaded (libmlx's CUDA backend links it); nothing is loaded here.
// - MLX 0.32's CUDA buffer layout: `allocator::Buffer::ptr()` points to
//   `mlx::core::cu::CudaBuffer { void* data; size_t size; int device; }` (device -1: managed
//   or pinned host memory, else a device ordinal). `MirrorBuffer` mirrors it; the version is
//   checked before the first use and every copy checks that the buffer covers the bytes.
// - MLX's streams are non-blocking, and `eval`/`wait` return only when an array's data is
//   ready, so a synchronous copy on the legacy stream after them reads finished data.
#include "direct_copy.h"

#include <dlfcn.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>

namespace mx = mlx::core;

namespace kvmlx::direct {
namespace {

struct MirrorBuffer {
  void* data;
  size_t size;
  int device;
};

using CUresult = int;
using CUdevice = int;
using CUcontext = void*;
using CUdeviceptr = unsigned long long;

// CUDA_MEMCPY2D (cuda.h's `CUDA_MEMCPY2D_st`), field for field: the driver API's stable
// layout. Memory types: 1 host, 2 device.
struct Memcpy2D {
  size_t src_x_bytes;
  size_t src_y;
  int src_memory_type;
  const void* src_host;
  CUdeviceptr src_device;
  void* src_array;
  size_t src_pitch;
  size_t dst_x_bytes;
  size_t dst_y;
  int dst_memory_type;
  void* dst_host;
  CUdeviceptr dst_device;
  void* dst_array;
  size_t dst_pitch;
  size_t width_bytes;
  size_t height;
};

struct Driver {
  CUresult (*device_get)(CUdevice*, int);
  CUresult (*primary_ctx_retain)(CUcontext*, CUdevice);
  CUresult (*ctx_set_current)(CUcontext);
  CUresult (*memcpy_dtoh)(void*, CUdeviceptr, size_t);
  CUresult (*memcpy_htod)(CUdeviceptr, const void*, size_t);
  CUresult (*memcpy_2d_async)(const Memcpy2D*, void*);
  CUresult (*memcpy_htod_async)(CUdeviceptr, const void*, size_t, void*);
  CUresult (*stream_synchronize)(void*);
  CUresult (*error_string)(CUresult, const char**);
  CUresult (*mem_host_alloc)(void**, size_t, unsigned int);
  CUresult (*mem_free_host)(void*);
};

const Driver* driver() {
  static const Driver* d = []() -> const Driver* {
    // Only the MLX version whose CudaBuffer layout MirrorBuffer mirrors.
    if (std::string(mx::version()).rfind("0.32.", 0) != 0) return nullptr;
    if (!mx::is_available(mx::Device(mx::Device::gpu))) return nullptr;
    void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (h == nullptr) return nullptr;  // a CPU or Metal libmlx
    auto* out = new Driver{};
    bool ok = true;
    auto sym = [&](const char* name) {
      void* p = dlsym(h, name);
      ok = ok && p != nullptr;
      return p;
    };
    out->device_get = reinterpret_cast<decltype(out->device_get)>(sym("cuDeviceGet"));
    out->primary_ctx_retain = reinterpret_cast<decltype(out->primary_ctx_retain)>(sym("cuDevicePrimaryCtxRetain"));
    out->ctx_set_current = reinterpret_cast<decltype(out->ctx_set_current)>(sym("cuCtxSetCurrent"));
    out->memcpy_dtoh = reinterpret_cast<decltype(out->memcpy_dtoh)>(sym("cuMemcpyDtoH_v2"));
    out->memcpy_htod = reinterpret_cast<decltype(out->memcpy_htod)>(sym("cuMemcpyHtoD_v2"));
    out->memcpy_2d_async = reinterpret_cast<decltype(out->memcpy_2d_async)>(sym("cuMemcpy2DAsync_v2"));
    out->memcpy_htod_async = reinterpret_cast<decltype(out->memcpy_htod_async)>(sym("cuMemcpyHtoDAsync_v2"));
    out->stream_synchronize = reinterpret_cast<decltype(out->stream_synchronize)>(sym("cuStreamSynchronize"));
    out->error_string = reinterpret_cast<decltype(out->error_string)>(sym("cuGetErrorString"));
    out->mem_host_alloc = reinterpret_cast<decltype(out->mem_host_alloc)>(sym("cuMemHostAlloc"));
    out->mem_free_host = reinterpret_cast<decltype(out->mem_free_host)>(sym("cuMemFreeHost"));
    if (!ok) {
      delete out;
      return nullptr;
    }
    return out;
  }();
  return d;
}

std::atomic<bool> enabled{true};

void check(CUresult r, const char* what) {
  if (r == 0) return;
  const char* s = nullptr;
  driver()->error_string(r, &s);
  throw std::runtime_error(std::string(what) + " failed: " + (s ? s : std::to_string(r)));
}

// Makes the device's primary context (the one the CUDA runtime inside libmlx uses) current on
// this thread; MLX's own threads have it, a thread of ours may not.
void make_current(int device) {
  thread_local int current = -1;
  if (current == device) return;
  CUdevice dev = 0;
  check(driver()->device_get(&dev, device), "cuDeviceGet");
  CUcontext ctx = nullptr;
  check(driver()->primary_ctx_retain(&ctx, dev), "cuDevicePrimaryCtxRetain");
  check(driver()->ctx_set_current(ctx), "cuCtxSetCurrent");
  current = device;
}

// The device buffer behind an evaluated array, or nullptr when it is not in device memory.
const MirrorBuffer* device_buffer(const mx::array& a, size_t n) {
  auto* buf = static_cast<const MirrorBuffer*>(a.buffer().ptr());
  if (buf == nullptr || buf->device < 0 || buf->data == nullptr) return nullptr;
  if (a.offset() < 0 || static_cast<size_t>(a.offset()) + n > buf->size) return nullptr;
  return buf;
}

}  // namespace

bool available() { return enabled.load() && driver() != nullptr; }

bool set_enabled(bool on) { return enabled.exchange(on); }

bool read(const mx::array& a, uint8_t* out, size_t n) {
  if (n == 0 || !available()) return false;
  const MirrorBuffer* buf = device_buffer(a, n);
  if (buf == nullptr) return false;
  make_current(buf->device);
  auto src = reinterpret_cast<CUdeviceptr>(static_cast<char*>(buf->data) + a.offset());
  check(driver()->memcpy_dtoh(out, src, n), "cuMemcpyDtoH");
  return true;
}

std::vector<mx::array> zeroed_off_queue(const std::vector<std::pair<mx::Shape, mx::Dtype>>& shapes) {
  // Zero fills MLX runs on the device (a broadcast zero is a view of one element;
  // `contiguous` gives each a buffer of its own), on a stream of this thread's own: on the
  // default stream, waiting for them would wait for every kernel queued before them, such
  // as the decode step an engine queued one step ahead, and a restore inside a serving
  // step would stall the pipeline for a whole step.
  auto device = mx::default_device();
  mx::StreamOrDevice on = {};
  if (device.type == mx::Device::gpu) {
    thread_local std::optional<mx::Stream> own;
    if (!own) own = mx::new_stream(device);
    on = *own;
  }
  std::vector<mx::array> out;
  out.reserve(shapes.size());
  for (const auto& [shape, dtype] : shapes) out.push_back(mx::contiguous(mx::zeros(shape, dtype, on), false, on));
  mx::eval(out);
  return out;
}

std::optional<mx::array> upload(const uint8_t* data, size_t n, const mx::Shape& shape, mx::Dtype dtype) {
  if (n == 0 || !available() || mx::default_device().type != mx::Device::gpu) return std::nullopt;
  // A fresh device buffer of the right size, zeroed off the default stream's queue.
  mx::array dst = zeroed_off_queue({{shape, dtype}}).front();
  if (!dst.flags().row_contiguous || dst.nbytes() != n) return std::nullopt;
  // One row of all the bytes (a restore's writes, with the same checks and copies).
  if (!write_rows({{&dst, data, n, 1, n}})) return std::nullopt;
  return dst;
}

namespace {
// Where rows go: device memory (a driver copy) or memory the host can write (MLX's managed
// or page-locked buffers, which its allocator also hands out for kernel outputs: a buffer
// freed by a host upload is reused from its cache).
struct Target {
  CUdeviceptr device = 0;
  char* host = nullptr;
};

// Where `height` rows of `width` bytes at a row pitch of `pitch` go in `dst`; neither
// address when it is not an evaluated, row-contiguous array with a buffer. Throws when the
// rows do not fit.
Target rows_target(const mx::array& dst, size_t width, size_t height, size_t pitch) {
  if (width > pitch) throw std::invalid_argument("rows of " + std::to_string(width) + " bytes at a pitch of " +
                                                 std::to_string(pitch));
  size_t span = (height - 1) * pitch + width;
  if (span > dst.nbytes()) {
    throw std::invalid_argument(std::to_string(height) + " rows at a pitch of " + std::to_string(pitch) +
                                " overrun an array of " + std::to_string(dst.nbytes()) + " bytes");
  }
  if (!dst.is_available() || !dst.flags().row_contiguous || dst.offset() < 0) return {};
  auto* buf = static_cast<const MirrorBuffer*>(dst.buffer().ptr());
  if (buf == nullptr || buf->data == nullptr || static_cast<size_t>(dst.offset()) + span > buf->size) return {};
  char* at = static_cast<char*>(buf->data) + dst.offset();
  if (buf->device < 0) return {0, at};
  make_current(buf->device);
  return {reinterpret_cast<CUdeviceptr>(at), nullptr};
}
}  // namespace

bool write_rows(const std::vector<RowsWrite>& writes) {
  if (writes.empty() || !available()) return false;
  std::vector<Target> to;
  to.reserve(writes.size());
  for (const auto& w : writes) {
    if (w.width == 0 || w.height == 0) {
      to.push_back({});
      continue;
    }
    Target t = rows_target(*w.dst, w.width, w.height, w.pitch);
    if (t.device == 0 && t.host == nullptr) return false;  // nothing copied yet
    to.push_back(t);
  }
  // Device copies are queued on the legacy default stream, which MLX's non-blocking streams
  // do not wait for: the arrays are evaluated (nothing of MLX writes them) and the stream is
  // synchronized before returning, so MLX reads them only after the copies.
  for (size_t i = 0; i < writes.size(); ++i) {
    const auto& w = writes[i];
    if (to[i].host != nullptr) {
      for (size_t r = 0; r < w.height; ++r) std::memcpy(to[i].host + r * w.pitch, w.src + r * w.width, w.width);
      continue;
    }
    if (to[i].device == 0) continue;
    if (w.width == w.pitch || w.height == 1) {
      check(driver()->memcpy_htod_async(to[i].device, w.src, w.width * w.height, nullptr), "cuMemcpyHtoDAsync");
      continue;
    }
    Memcpy2D c{};
    c.src_memory_type = 1;
    c.src_host = w.src;
    c.src_pitch = w.width;
    c.dst_memory_type = 2;
    c.dst_device = to[i].device;
    c.dst_pitch = w.pitch;
    c.width_bytes = w.width;
    c.height = w.height;
    if (driver()->memcpy_2d_async(&c, nullptr) == 0) continue;
    // The driver may refuse pitches it did not allocate itself: one copy per row instead.
    for (size_t r = 0; r < w.height; ++r) {
      check(driver()->memcpy_htod_async(to[i].device + r * w.pitch, w.src + r * w.width, w.width, nullptr),
            "cuMemcpyHtoDAsync");
    }
  }
  check(driver()->stream_synchronize(nullptr), "cuStreamSynchronize");
  return true;
}

uint8_t* pinned_alloc(size_t n) {
  if (n == 0 || !available()) return nullptr;
  make_current(0);
  void* p = nullptr;
  // DEVICEMAP (0x02): the device can address the memory too, which the host rows upload's
  // kernel reads (host_upload.cc).
  if (driver()->mem_host_alloc(&p, n, 0x02) != 0) return nullptr;
  return static_cast<uint8_t*>(p);
}

void pinned_free(uint8_t* p) {
  if (p == nullptr || driver() == nullptr) return;
  make_current(0);
  driver()->mem_free_host(p);
}

}  // namespace kvmlx::direct
