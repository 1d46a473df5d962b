// One decode step's attention for a batch of rows, each over its own KV arena, as one graph
// node (`RowsDecodeAttention`) that runs two CUDA kernels per 32 rows: the batch's cost on
// the host is one node per layer instead of a write, a view and an attention per row.
//
// Built only when the shim is compiled against the CUDA backend's headers (`KVSTORE_CUDA`,
// set by build.rs when KVSTORE_CUDA_INCLUDE names the CUDA runtime headers; see
// scripts/cuda/build.sh). Elsewhere `rows_attention_kernel_built()` is false and the cache
// attends row by row.
//
// What it relies on (MLX 0.32.4's CUDA backend, headers in the wheel):
// - `cu::get_command_encoder(stream)`, `CommandEncoder::{set_input_array, set_output_array,
//   add_kernel_node_raw, add_temporary}` and `Device::make_current` are exported by libmlx.
//   The encoder orders graph nodes by the buffers they declare: the arenas this node writes
//   are declared as outputs, so a later reader of an arena waits for it.
// - NVRTC and the driver API are already loaded by libmlx (it links libnvrtc.so.13 and
//   libcuda.so.1); their entry points are looked up with dlsym, nothing is linked here.
// - Writing into the arenas in place is safe only when no other array shares their buffer:
//   the caller (the cache, which tracks its arenas' holders) decides it before it builds the node.
#include "shim.h"

#include "kvstore-mlx/src/ffi.rs.h"

#include <stdexcept>
#include <string>

#ifdef KVSTORE_CUDA

#include <dlfcn.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>

#include "mlx/backend/cuda/device.h"
#include "mlx/primitives.h"

namespace kvmlx {
namespace {

namespace mx = mlx::core;
namespace cu = mlx::core::cu;

constexpr int kRows = 32;  // rows per launch: the Table parameter below holds this many
constexpr int kWarps = 4;

const char* kSource =
#include "rows_attention.cu.h"
    ;

// The kernel's parameter structs, field for field (rows_attention.cu.h).
struct RowKv {
  unsigned long long k, v, pk, pv;
  long long khs, vhs, pkhs, pvhs;
  int len, plen;
};
struct Table {
  RowKv r[kRows];
};
struct Strides {
  long long qb, qh, kb, kh, vb, vh;
};

// NVRTC's C API, declared here (libnvrtc is loaded by libmlx; its header is not shipped).
using nvrtcProgram = void*;
using NvrtcCreate = int (*)(nvrtcProgram*, const char*, const char*, int, const char* const*,
                            const char* const*);
using NvrtcCompile = int (*)(nvrtcProgram, int, const char* const*);
using NvrtcSize = int (*)(nvrtcProgram, size_t*);
using NvrtcGet = int (*)(nvrtcProgram, char*);
using NvrtcDestroy = int (*)(nvrtcProgram*);

void* lookup(const char* name) {
  void* p = dlsym(RTLD_DEFAULT, name);
  if (!p) {
    throw std::runtime_error(std::string("the batched decode attention needs ") + name +
                             ", which is not loaded (libmlx's CUDA backend links it)");
  }
  return p;
}

struct Kernels {
  CUfunction partial;
  CUfunction combine;
};

// The kernels for (dtype, D, NREP) on the current device, compiled once per process.
Kernels kernels(mx::Dtype dtype, int d, int nrep) {
  static std::mutex mu;
  static std::map<std::tuple<int, int, int, int>, Kernels> cache;
  auto cu_ctx_get_device = reinterpret_cast<CUresult (*)(CUdevice*)>(lookup("cuCtxGetDevice"));
  CUdevice dev = 0;
  if (cu_ctx_get_device(&dev) != 0) throw std::runtime_error("cuCtxGetDevice failed");
  auto key = std::make_tuple(int(dev), int(dtype.val()), d, nrep);
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = cache.find(key); it != cache.end()) return it->second;

  auto attr = reinterpret_cast<CUresult (*)(int*, CUdevice_attribute, CUdevice)>(
      lookup("cuDeviceGetAttribute"));
  int major = 0, minor = 0;
  attr(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev);
  attr(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev);

  std::string type, load, store;
  if (dtype == mx::float32) {
    type = "float", load = "f32_load", store = "f32_store";
  } else if (dtype == mx::bfloat16) {
    type = "unsigned short", load = "bf16_load", store = "bf16_store";
  } else if (dtype == mx::float16) {
    type = "unsigned short", load = "f16_load", store = "f16_store";
  } else {
    throw std::invalid_argument("the batched decode attention takes f32, bf16 or f16");
  }
  std::string src = "#define T " + type + "\n#define LOAD " + load + "\n#define STORE " +
                    store + "\n#define D " + std::to_string(d) + "\n#define NREP " +
                    std::to_string(nrep) + "\n" + kSource;
  std::string arch =
      "--gpu-architecture=compute_" + std::to_string(major) + std::to_string(minor);
  const char* opts[] = {arch.c_str(), "--std=c++17"};

  auto create = reinterpret_cast<NvrtcCreate>(lookup("nvrtcCreateProgram"));
  auto compile = reinterpret_cast<NvrtcCompile>(lookup("nvrtcCompileProgram"));
  auto ptx_size = reinterpret_cast<NvrtcSize>(lookup("nvrtcGetPTXSize"));
  auto get_ptx = reinterpret_cast<NvrtcGet>(lookup("nvrtcGetPTX"));
  auto log_size = reinterpret_cast<NvrtcSize>(lookup("nvrtcGetProgramLogSize"));
  auto get_log = reinterpret_cast<NvrtcGet>(lookup("nvrtcGetProgramLog"));
  auto destroy = reinterpret_cast<NvrtcDestroy>(lookup("nvrtcDestroyProgram"));
  nvrtcProgram prog = nullptr;
  if (create(&prog, src.c_str(), "kvstore_rows_attention.cu", 0, nullptr, nullptr) != 0) {
    throw std::runtime_error("nvrtcCreateProgram failed");
  }
  if (compile(prog, 2, opts) != 0) {
    size_t n = 0;
    log_size(prog, &n);
    std::string log(n, '\0');
    get_log(prog, log.data());
    destroy(&prog);
    throw std::runtime_error("NVRTC could not compile the batched decode attention: " + log);
  }
  size_t n = 0;
  ptx_size(prog, &n);
  std::string ptx(n, '\0');
  get_ptx(prog, ptx.data());
  destroy(&prog);

  auto load_module = reinterpret_cast<CUresult (*)(CUmodule*, const void*)>(
      lookup("cuModuleLoadData"));
  auto get_function = reinterpret_cast<CUresult (*)(CUfunction*, CUmodule, const char*)>(
      lookup("cuModuleGetFunction"));
  CUmodule module = nullptr;
  if (load_module(&module, ptx.data()) != 0) {
    throw std::runtime_error("cuModuleLoadData failed for the batched decode attention");
  }
  Kernels k{};
  if (get_function(&k.partial, module, "rows_partial") != 0 ||
      get_function(&k.combine, module, "rows_combine") != 0) {
    throw std::runtime_error("the batched decode attention's module lacks its kernels");
  }
  cache.emplace(key, k);
  return k;
}

// How a row's KV lies among the node's inputs (after q, keys, values): its own K and V
// arenas, then its prefix's K and V views when it has one.
struct RowMeta {
  int64_t start;   // the arena position of the row's first own token
  int64_t len;     // own tokens before this step (the new one goes at start + len)
  int64_t prefix;  // 1: the row has a shared prefix (two more inputs)
};

// The element stride of `a`'s head axis, after checking that its tokens are rows of `d`
// contiguous elements ([1, H, T, d] with strides (.., hs, d, 1)).
long long head_stride(const mx::array& a, int d, const char* what) {
  const auto& st = a.strides();
  if (a.ndim() != 4 || a.shape(3) != d || st[3] != 1 || (a.shape(2) > 1 && st[2] != d)) {
    throw std::invalid_argument(std::string("the batched decode attention needs ") + what +
                                " whose tokens are contiguous rows of the head dimension");
  }
  return st[1];
}

class RowsDecodeAttention : public mx::UnaryPrimitive {
 public:
  RowsDecodeAttention(mx::Stream s, float scale, std::vector<RowMeta> rows)
      : mx::UnaryPrimitive(s), scale_(scale), rows_(std::move(rows)) {}

  void eval_cpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("RowsDecodeAttention runs on a CUDA GPU only");
  }

  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    auto& enc = cu::get_command_encoder(stream());
    enc.device().make_current();
    const auto &q = inputs[0], &kn = inputs[1], &vn = inputs[2];
    const int b = q.shape(0), hq = q.shape(1), d = q.shape(3), hkv = kn.shape(1);
    const int nrep = hq / hkv;
    Kernels kern = kernels(q.dtype(), d, nrep);

    // Each row's whole sequence (prefix, own keys, the new one) and the split size.
    int64_t longest = 1;
    std::vector<int> plens(b, 0);
    {
      size_t at = 3;
      for (int r = 0; r < b; ++r) {
        at += 2;
        if (rows_[r].prefix) {
          plens[r] = inputs[at].shape(2);
          at += 2;
        }
        longest = std::max<int64_t>(longest, plens[r] + rows_[r].len + 1);
      }
    }
    int chunk = 64;
    auto blocks = [&](int c) { return int64_t(b) * hkv * ((longest + c - 1) / c); };
    while (chunk < 4096 && blocks(chunk) > 2048) chunk *= 2;
    const int splits = int((longest + chunk - 1) / chunk);

    out.set_data(mx::allocator::malloc(out.nbytes()));
    mx::array part({b, hq, splits, d + 2}, mx::float32, nullptr, {});
    part.set_data(mx::allocator::malloc(part.nbytes()));
    enc.add_temporary(part);

    Strides st{q.strides()[0], q.strides()[1], kn.strides()[0], kn.strides()[1],
               vn.strides()[0], vn.strides()[1]};
    if (q.strides()[3] != 1 || kn.strides()[3] != 1 || vn.strides()[3] != 1) {
      throw std::invalid_argument("the batched decode attention needs q, k and v with a contiguous last axis");
    }
    const size_t esize = q.itemsize();
    size_t at = 3;
    for (int row0 = 0; row0 < b; row0 += kRows) {
      const int n = std::min(kRows, b - row0);
      Table tab{};
      enc.set_input_array(q);
      enc.set_input_array(kn);
      enc.set_input_array(vn);
      for (int i = 0; i < n; ++i) {
        const RowMeta& m = rows_[row0 + i];
        const mx::array& ka = inputs[at];
        const mx::array& va = inputs[at + 1];
        at += 2;
        RowKv& rk = tab.r[i];
        rk.khs = head_stride(ka, d, "key arenas");
        rk.vhs = head_stride(va, d, "value arenas");
        if (m.start + m.len + 1 > ka.shape(2) || m.start + m.len + 1 > va.shape(2)) {
          throw std::invalid_argument("the batched decode attention's arena has no room for the new token");
        }
        rk.k = reinterpret_cast<unsigned long long>(mx::gpu_ptr<char>(ka) + m.start * d * esize);
        rk.v = reinterpret_cast<unsigned long long>(mx::gpu_ptr<char>(va) + m.start * d * esize);
        rk.len = int(m.len);
        enc.set_input_array(ka);
        enc.set_input_array(va);
        enc.set_output_array(ka);
        enc.set_output_array(va);
        if (m.prefix) {
          const mx::array& pk = inputs[at];
          const mx::array& pv = inputs[at + 1];
          at += 2;
          rk.pkhs = head_stride(pk, d, "prefix keys");
          rk.pvhs = head_stride(pv, d, "prefix values");
          rk.pk = reinterpret_cast<unsigned long long>(mx::gpu_ptr<void>(pk));
          rk.pv = reinterpret_cast<unsigned long long>(mx::gpu_ptr<void>(pv));
          rk.plen = pk.shape(2);
          enc.set_input_array(pk);
          enc.set_input_array(pv);
        }
      }
      enc.set_output_array(part);
      {
        const void* qp = mx::gpu_ptr<void>(q);
        const void* kp = mx::gpu_ptr<void>(kn);
        const void* vp = mx::gpu_ptr<void>(vn);
        void* pp = mx::gpu_ptr<void>(part);
        int r0 = row0, sp = splits, ch = chunk, h = hkv;
        float sc = scale_;
        void* args[] = {&qp, &kp, &vp, &pp, &tab, &st, &r0, &sp, &ch, &sc, &h};
        enc.add_kernel_node_raw(kern.partial, dim3(splits, hkv, n), dim3(kWarps * 32, 1, 1),
                                dim3(1, 1, 1), 0, args);
      }
      enc.set_input_array(part);
      enc.set_output_array(out);
      {
        const void* pp = mx::gpu_ptr<void>(part);
        void* op = mx::gpu_ptr<void>(out);
        int r0 = row0, sp = splits, h = hq;
        void* args[] = {&pp, &op, &r0, &sp, &h};
        enc.add_kernel_node_raw(kern.combine, dim3(hq, n, 1), dim3(d, 1, 1), dim3(1, 1, 1), 0,
                                args);
      }
    }
  }

  const char* name() const override { return "RowsDecodeAttention"; }
  bool is_equivalent(const mx::Primitive&) const override { return false; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  float scale_;
  std::vector<RowMeta> rows_;
};

}  // namespace

bool rows_attention_kernel_built() { return true; }

std::unique_ptr<Array> rows_decode_attention(const Array& q, const Array& k, const Array& v,
                                             const ArrayList& kv,
                                             rust::Slice<const int64_t> meta, float scale) {
  const auto &qa = q.inner, &ka = k.inner, &va = v.inner;
  if (qa.ndim() != 4 || ka.ndim() != 4 || va.ndim() != 4 || qa.shape(2) != 1 ||
      ka.shape() != va.shape() || ka.shape(2) != 1 || qa.shape(0) != ka.shape(0) ||
      qa.shape(3) != ka.shape(3) || ka.shape(1) == 0 || qa.shape(1) % ka.shape(1) != 0) {
    throw std::invalid_argument(
        "the batched decode attention takes q [B, Hq, 1, D] and k, v [B, Hkv, 1, D]");
  }
  const int b = qa.shape(0), d = qa.shape(3), nrep = qa.shape(1) / ka.shape(1);
  if (d % 32 != 0 || d > 256 || nrep > 8 || qa.dtype() != ka.dtype() ||
      qa.dtype() != va.dtype()) {
    throw std::invalid_argument(
        "the batched decode attention takes one dtype, a head dimension that is a multiple "
        "of 32 up to 256 and at most 8 q heads per kv head");
  }
  if (meta.size() != size_t(b) * 3) {
    throw std::invalid_argument("the batched decode attention needs 3 numbers per row");
  }
  std::vector<RowMeta> rows(b);
  std::vector<mx::array> inputs = {qa, ka, va};
  size_t at = 0;
  for (int r = 0; r < b; ++r) {
    rows[r] = {meta[3 * r], meta[3 * r + 1], meta[3 * r + 2]};
    size_t need = rows[r].prefix ? 4 : 2;
    if (at + need > kv.items.size()) {
      throw std::invalid_argument("the batched decode attention got too few KV arrays");
    }
    for (size_t j = 0; j < need; ++j) {
      const auto& a = kv.items[at + j];
      if (a.dtype() != qa.dtype() || a.ndim() != 4 || a.shape(1) != ka.shape(1) ||
          a.shape(3) != d) {
        throw std::invalid_argument(
            "the batched decode attention's arenas must match the step's keys in dtype, "
            "heads and head dimension");
      }
      inputs.push_back(a);
    }
    at += need;
  }
  if (at != kv.items.size()) {
    throw std::invalid_argument("the batched decode attention got too many KV arrays");
  }
  auto stream = mx::default_stream(mx::default_device());
  return std::make_unique<Array>(Array{mx::array(
      qa.shape(), qa.dtype(), std::make_shared<RowsDecodeAttention>(stream, scale, std::move(rows)),
      std::move(inputs))});
}

}  // namespace kvmlx

#else  // KVSTORE_CUDA

namespace kvmlx {

bool rows_attention_kernel_built() { return false; }

std::unique_ptr<Array> rows_decode_attention(const Array&, const Array&, const Array&,
                                             const ArrayList&, rust::Slice<const int64_t>,
                                             float) {
  throw std::runtime_error(
      "this build has no batched decode attention kernel (build with the CUDA backend's "
      "headers: scripts/cuda/build.sh)");
}

}  // namespace kvmlx

#endif  // KVSTORE_CUDA
