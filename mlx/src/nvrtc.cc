// See nvrtc.h.
#include "nvrtc.h"

#ifdef KVSTORE_CUDA
#include <dlfcn.h>

#include <algorithm>
#include <stdexcept>

namespace kvmlx::nvrtc {

namespace {

// NVRTC's C API, declared here (libnvrtc is loaded by libmlx; its header is not shipped).
using Program = void*;
using Create = int (*)(Program*, const char*, const char*, int, const char* const*, const char* const*);
using Compile = int (*)(Program, int, const char* const*);
using Size = int (*)(Program, size_t*);
using Get = int (*)(Program, char*);
using Destroy = int (*)(Program*);

}  // namespace

void* lookup(const char* name, const char* what) {
  void* p = dlsym(RTLD_DEFAULT, name);
  if (!p) {
    throw std::runtime_error(std::string(what) + " needs " + name +
                             ", which is not loaded (libmlx's CUDA backend links it)");
  }
  return p;
}

CUdevice current_device() {
  auto ctx_device = reinterpret_cast<CUresult (*)(CUdevice*)>(lookup("cuCtxGetDevice", "a kvstore kernel"));
  CUdevice dev = 0;
  if (ctx_device(&dev) != 0) throw std::runtime_error("cuCtxGetDevice failed");
  return dev;
}

bool unified_addressing() {
  auto attr = reinterpret_cast<CUresult (*)(int*, CUdevice_attribute, CUdevice)>(
      lookup("cuDeviceGetAttribute", "a kvstore kernel"));
  int unified = 0;
  return attr(&unified, CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING, current_device()) == 0 && unified;
}

int resident_blocks(CUfunction f, int threads) {
  const char* what = "the batched decode attention";
  auto occupancy = reinterpret_cast<CUresult (*)(int*, CUfunction, int, size_t)>(
      lookup("cuOccupancyMaxActiveBlocksPerMultiprocessor", what));
  auto attr = reinterpret_cast<CUresult (*)(int*, CUdevice_attribute, CUdevice)>(
      lookup("cuDeviceGetAttribute", what));
  int per_sm = 0, sms = 0;
  if (occupancy(&per_sm, f, threads, 0) != 0 ||
      attr(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, current_device()) != 0) {
    throw std::runtime_error("the driver could not say how many blocks of a kernel fit the GPU");
  }
  return std::max(1, per_sm) * std::max(1, sms);
}

std::vector<CUfunction> compile(const std::string& source, const char* file,
                                const std::vector<const char*>& names, const char* what) {
  const CUdevice dev = current_device();
  auto attr = reinterpret_cast<CUresult (*)(int*, CUdevice_attribute, CUdevice)>(
      lookup("cuDeviceGetAttribute", what));
  int major = 0, minor = 0;
  attr(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev);
  attr(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev);
  std::string arch = "--gpu-architecture=compute_" + std::to_string(major) + std::to_string(minor);
  const char* opts[] = {arch.c_str(), "--std=c++17"};

  auto create = reinterpret_cast<Create>(lookup("nvrtcCreateProgram", what));
  auto compile = reinterpret_cast<Compile>(lookup("nvrtcCompileProgram", what));
  auto ptx_size = reinterpret_cast<Size>(lookup("nvrtcGetPTXSize", what));
  auto get_ptx = reinterpret_cast<Get>(lookup("nvrtcGetPTX", what));
  auto log_size = reinterpret_cast<Size>(lookup("nvrtcGetProgramLogSize", what));
  auto get_log = reinterpret_cast<Get>(lookup("nvrtcGetProgramLog", what));
  auto destroy = reinterpret_cast<Destroy>(lookup("nvrtcDestroyProgram", what));
  Program prog = nullptr;
  if (create(&prog, source.c_str(), file, 0, nullptr, nullptr) != 0) {
    throw std::runtime_error("nvrtcCreateProgram failed");
  }
  if (compile(prog, 2, opts) != 0) {
    size_t n = 0;
    log_size(prog, &n);
    std::string log(n, '\0');
    get_log(prog, log.data());
    destroy(&prog);
    throw std::runtime_error(std::string("NVRTC could not compile ") + what + ": " + log);
  }
  size_t n = 0;
  ptx_size(prog, &n);
  std::string ptx(n, '\0');
  get_ptx(prog, ptx.data());
  destroy(&prog);

  auto load_module = reinterpret_cast<CUresult (*)(CUmodule*, const void*)>(lookup("cuModuleLoadData", what));
  auto get_function = reinterpret_cast<CUresult (*)(CUfunction*, CUmodule, const char*)>(
      lookup("cuModuleGetFunction", what));
  CUmodule module = nullptr;
  if (load_module(&module, ptx.data()) != 0) {
    throw std::runtime_error(std::string("cuModuleLoadData failed for ") + what);
  }
  std::vector<CUfunction> out;
  for (const char* name : names) {
    CUfunction f = nullptr;
    if (get_function(&f, module, name) != 0) {
      throw std::runtime_error(std::string(what) + "'s module lacks its kernel " + name);
    }
    out.push_back(f);
  }
  return out;
}

}  // namespace kvmlx::nvrtc

#endif  // KVSTORE_CUDA
