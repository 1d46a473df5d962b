// graph_probe.so: counts and times what MLX's CUDA backend asks of the driver's graph API,
// for one process, printed to stderr when it exits. A diagnostic for the 8B decode step
// (#16: why larger CUDA graphs leave kvstore's GPU waiting and not mlx-lm's).
//
//   cc -O2 -shared -fPIC -o graph_probe.so scripts/cuda/graph_probe.c -ldl
//   LD_PRELOAD=$PWD/graph_probe.so kvstore bench generate ...
//
// Why it hooks `dlsym`: libmlx links the CUDA runtime statically, and the runtime reaches
// the driver through `cuGetProcAddress`, which it looks up with `dlsym` on libcuda's
// handle; a preloaded `cuGraphLaunch` would never be called. So `dlsym` is wrapped (the
// real one found with `dlvsym`), its answer for `cuGetProcAddress`/`_v2` replaced by a
// wrapper, and that wrapper hands out timing wrappers for the graph calls below. Only
// counts and times are kept; every call goes through with its own arguments and result.
//
// What MLX does with them (mlx/backend/cuda/device.cpp, 0.32): each commit of a recorded
// graph either updates the cached executable graph of the same topology
// (cuGraphExecUpdate) or, where an update fails or the graph holds a node MLX does not
// update (a copy node, a kernel with a 2-D cluster), instantiates a new one; then
// launches it. A failed update is counted apart (its result is not CUDA_SUCCESS).
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

typedef int CUresult;
typedef void* (*dlsym_fn)(void*, const char*);

enum { INSTANTIATE, INSTANTIATE_FLAGS, INSTANTIATE_PARAMS, UPDATE, LAUNCH, EXEC_DESTROY, HOST_FUNC, N_CALLS };
static const char* NAMES[N_CALLS] = {"cuGraphInstantiate", "cuGraphInstantiateWithFlags",
                                     "cuGraphInstantiateWithParams", "cuGraphExecUpdate",
                                     "cuGraphLaunch", "cuGraphExecDestroy", "cuLaunchHostFunc"};
static void* real_fn[N_CALLS];
static atomic_ullong calls[N_CALLS], nanos[N_CALLS], failed[N_CALLS];

static uint64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

static CUresult account(int i, uint64_t start, CUresult r) {
  atomic_fetch_add(&calls[i], 1);
  atomic_fetch_add(&nanos[i], now_ns() - start);
  if (r != 0) atomic_fetch_add(&failed[i], 1);
  return r;
}

// Every hooked call takes at most three pointer-sized arguments.
typedef CUresult (*fn3)(void*, void*, void*);
#define WRAP(idx)                                                   \
  static CUresult wrap_##idx(void* a, void* b, void* c) {           \
    uint64_t t = now_ns();                                          \
    return account(idx, t, ((fn3)real_fn[idx])(a, b, c));           \
  }
WRAP(0) WRAP(1) WRAP(2) WRAP(3) WRAP(4) WRAP(5) WRAP(6)
static void* WRAPPERS[N_CALLS] = {(void*)wrap_0, (void*)wrap_1, (void*)wrap_2, (void*)wrap_3,
                                  (void*)wrap_4, (void*)wrap_5, (void*)wrap_6};

// cuGetProcAddress (v1: symbol, pfn, version, flags; v2 adds a status pointer).
typedef CUresult (*gpa1_fn)(const char*, void**, int, uint64_t);
typedef CUresult (*gpa2_fn)(const char*, void**, int, uint64_t, void*);
static gpa1_fn real_gpa1;
static gpa2_fn real_gpa2;

static void hook(const char* symbol, void** pfn) {
  if (symbol == NULL || pfn == NULL || *pfn == NULL) return;
  for (int i = 0; i < N_CALLS; i++) {
    if (strcmp(symbol, NAMES[i]) == 0) {
      real_fn[i] = *pfn;
      *pfn = WRAPPERS[i];
      return;
    }
  }
}

static CUresult gpa1(const char* symbol, void** pfn, int version, uint64_t flags) {
  CUresult r = real_gpa1(symbol, pfn, version, flags);
  if (r == 0) hook(symbol, pfn);
  return r;
}

static CUresult gpa2(const char* symbol, void** pfn, int version, uint64_t flags, void* status) {
  CUresult r = real_gpa2(symbol, pfn, version, flags, status);
  if (r == 0) hook(symbol, pfn);
  return r;
}

static dlsym_fn real_dlsym(void) {
  static dlsym_fn real;
  if (real == NULL) real = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
  if (real == NULL) real = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
  return real;
}

void* dlsym(void* handle, const char* symbol) {
  void* p = real_dlsym()(handle, symbol);
  if (p == NULL) return p;
  if (strcmp(symbol, "cuGetProcAddress_v2") == 0) {
    real_gpa2 = (gpa2_fn)p;
    return (void*)gpa2;
  }
  if (strcmp(symbol, "cuGetProcAddress") == 0) {
    real_gpa1 = (gpa1_fn)p;
    return (void*)gpa1;
  }
  return p;
}

__attribute__((destructor)) static void report(void) {
  fprintf(stderr, "graph_probe:");
  for (int i = 0; i < N_CALLS; i++) {
    fprintf(stderr, " %s %llu calls %.1f ms (%llu failed);", NAMES[i],
            (unsigned long long)calls[i], nanos[i] / 1e6, (unsigned long long)failed[i]);
  }
  fprintf(stderr, "\n");
}
