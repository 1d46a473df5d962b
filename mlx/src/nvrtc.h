// Run-time compiled CUDA kernels for the shim's own graph nodes (rows_attention.cc,
// copy_runs.cc): NVRTC and the driver API, both loaded by libmlx's CUDA backend, reached
// through dlsym so that nothing is linked here. Only in builds with the CUDA backend's
// headers (KVSTORE_CUDA).
#pragma once

#ifdef KVSTORE_CUDA
#include <cuda.h>

#include <string>
#include <vector>

namespace kvmlx::nvrtc {

// The entry point `name` of the driver API or NVRTC; `what` names the node that needs it
// in the error when it is not loaded.
void* lookup(const char* name, const char* what);

// The device of the current context.
CUdevice current_device();

// Whether the current device reads and writes page-locked host memory at its host address
// (unified addressing: every 64-bit Linux GPU MLX's CUDA backend runs on).
bool unified_addressing();

// Blocks of `threads` threads of kernel `f` the current device runs at once: its SMs times
// the blocks an SM holds (the driver's occupancy calculator, no dynamic shared memory).
int resident_blocks(CUfunction f, int threads);

// `source` compiled for the current device's architecture and loaded, its kernels `names`
// in that order. Compiles every time it is called: callers keep what it returns.
std::vector<CUfunction> compile(const std::string& source, const char* file,
                                const std::vector<const char*>& names, const char* what);

}  // namespace kvmlx::nvrtc

#endif  // KVSTORE_CUDA
