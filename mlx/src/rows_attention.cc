// One decode step's attention for a batch of rows, each over its own KV arena, as one graph
// node (`RowsDecodeAttention`) that runs two CUDA kernels per 32 rows: the batch's cost on
// the host is one node per layer instead of a write, a view and an attention per row.
//
// The CUDA kernels are built only when the shim is compiled against the CUDA backend's
// headers (`KVSTORE_CUDA`, set by build.rs when KVSTORE_CUDA_INCLUDE names the CUDA runtime
// headers; see scripts/cuda/build.sh); elsewhere `rows_attention_kernel_built()` is false.
// On the CPU the same node, in every build, copies each row's new key and value into its
// arenas and attends through the Rust kernel (`cpu_decode_attention::attend_parts`), f32.
//
// What it relies on (MLX 0.32.4's CUDA backend, headers in the wheel):
// - `cu::get_command_encoder(stream)`, `CommandEncoder::{set_input_array, set_output_array,
//   add_kernel_node_raw, add_temporary}` and `Device::make_current` are exported by libmlx.
//   The encoder orders graph nodes by the buffers they declare: the arenas this node writes
//   are declared as outputs, so a later reader of an arena waits for it.
// - NVRTC and the driver API are already loaded by libmlx (it links libnvrtc.so.13 and
//   libcuda.so.1); their entry points are looked up with dlsym (nvrtc.h), nothing is linked here.
// - Writing into the arenas in place is safe only when no other array shares their buffer:
//   the caller (the cache, which tracks its arenas' holders) decides it before it builds the node.
#include "shim.h"

#include "kvstore-mlx/src/ffi.rs.h"

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"

#ifdef KVSTORE_CUDA

#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>

#include "mlx/backend/cuda/device.h"
#include "nvrtc.h"
#endif  // KVSTORE_CUDA

namespace kvmlx {
namespace {

namespace mx = mlx::core;

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

// The CPU evaluation: each row's new key and value copied into its arenas at start + len,
// then every row attended over its prefix and its own len + 1 tokens by the Rust kernel
// (`rows_attend_host`), which reads the arenas in place. Runs as one task on the CPU
// stream's thread, after every earlier node and before every later one.
void rows_attend_cpu(const std::vector<mx::array>& in, const std::vector<RowMeta>& rows,
                     float scale, float* out, size_t n) {
  const mx::array &q = in[0], &kn = in[1], &vn = in[2];
  const int b = q.shape(0), hq = q.shape(1), d = q.shape(3), hkv = kn.shape(1);
  std::vector<float> qs, ks, vs;
  const float* qp = row_major(q, qs);
  const float* kp = row_major(kn, ks);
  const float* vp = row_major(vn, vs);
  // What rows_attend_host reads: q heads, kv heads, head dim, rows; per row its parts; per
  // part keys (address, values reached, head stride, token stride), values (the same four)
  // and positions.
  std::vector<size_t> meta = {size_t(hq), size_t(hkv), size_t(d), size_t(b)};
  // A part of no positions (an empty prefix view) reaches nothing; the kernel skips it.
  auto part = [&](const float* k, long long khs, const float* v, long long vhs, size_t len) {
    const size_t reach_k = len == 0 ? 0 : size_t(hkv - 1) * size_t(khs) + len * size_t(d);
    const size_t reach_v = len == 0 ? 0 : size_t(hkv - 1) * size_t(vhs) + len * size_t(d);
    meta.insert(meta.end(), {reinterpret_cast<size_t>(k), reach_k, size_t(khs), size_t(d),
                             reinterpret_cast<size_t>(v), reach_v, size_t(vhs), size_t(d), len});
  };
  size_t at = 3;
  for (int r = 0; r < b; ++r) {
    const RowMeta& m = rows[r];
    const mx::array& ka = in[at];
    const mx::array& va = in[at + 1];
    at += 2;
    const long long khs = head_stride(ka, d, "key arenas");
    const long long vhs = head_stride(va, d, "value arenas");
    if (m.start + m.len + 1 > ka.shape(2) || m.start + m.len + 1 > va.shape(2)) {
      throw std::invalid_argument("the batched decode attention's arena has no room for the new token");
    }
    // The caller (the cache) made sure no other array shares these buffers.
    float* kw = const_cast<float*>(ka.data<float>()) + m.start * d;
    float* vw = const_cast<float*>(va.data<float>()) + m.start * d;
    for (int h = 0; h < hkv; ++h) {
      std::memcpy(kw + h * khs + m.len * d, kp + (size_t(r) * hkv + h) * d, sizeof(float) * d);
      std::memcpy(vw + h * vhs + m.len * d, vp + (size_t(r) * hkv + h) * d, sizeof(float) * d);
    }
    meta.push_back(m.prefix ? 2 : 1);
    if (m.prefix) {
      const mx::array& pk = in[at];
      const mx::array& pv = in[at + 1];
      at += 2;
      part(pk.data<float>(), head_stride(pk, d, "prefix keys"), pv.data<float>(),
           head_stride(pv, d, "prefix values"), size_t(pk.shape(2)));
    }
    part(kw, khs, vw, vhs, size_t(m.len) + 1);
  }
  rows_attend_host(rust::Slice<const float>(qp, q.size()),
                   rust::Slice<const size_t>(meta.data(), meta.size()), scale,
                   rust::Slice<float>(out, n));
}

// Where the rows' inputs are: after q, k and v, each row's key and value arenas and, with a
// shared prefix, the prefix's keys and values. `longest`: the longest row's whole sequence
// (prefix, own keys, the new one); `end`: the index after the last row input (a scratch for
// the partials may follow).
struct RowSpans {
  int64_t longest = 1;
  size_t end = 3;
  std::vector<int64_t> totals;  // each row's whole sequence: prefix, own keys, the new one
};

RowSpans row_spans(const std::vector<RowMeta>& rows, const std::vector<mx::array>& inputs) {
  RowSpans s;
  for (const RowMeta& row : rows) {
    s.end += 2;
    int64_t plen = 0;
    if (row.prefix) {
      plen = inputs[s.end].shape(2);
      s.end += 2;
    }
    s.longest = std::max<int64_t>(s.longest, plen + row.len + 1);
    s.totals.push_back(plen + row.len + 1);
  }
  return s;
}

// A whole number from the environment variable `name` in lo..hi, `fallback` where unset.
int env_int(const char* name, int fallback, int lo, int hi) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == 0) return fallback;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  if (*end != 0 || n < lo || n > hi) {
    throw std::invalid_argument(std::string(name) + "=" + v + " is not a whole number from " +
                                std::to_string(lo) + " to " + std::to_string(hi));
  }
  return int(n);
}

int min_split() {
  static const int n = env_int("KVSTORE_DECODE_MIN_SPLIT", 16, 1, 4096);
  return n;
}

// The keys each split of the partial kernel takes and how many splits the longest row needs:
// splits of 16 keys (one pass of a block's four warps, four keys each) and more, doubled
// until at most 2,048 blocks of work. Short splits keep the GPU's SMs busy in a decode step of
// one row: at 512 keys and 8 kv heads, 64-key splits gave 64 blocks for 132 SMs, each warp
// walking 16 keys one load after the other. At long contexts they lengthen the merge, whose
// threads walk every split of their head in turn (256 a head at 8,192 keys): the 8B's step
// there was no shorter than with 64-key splits (docs/benchmarks.md, session 54).
//
// KVSTORE_DECODE_MAX_BLOCKS sets the 2,048 (fewer blocks: longer splits, a shorter merge).
//
// Variables for measuring against the kernel before session 54 in one run:
// KVSTORE_DECODE_MIN_SPLIT=64 (the shortest split), KVSTORE_DECODE_KEYS_PER_LOAD=1 (keys a
// warp loads at once; 1 walks the keys in the old loop's order) and
// KVSTORE_DECODE_VECTOR_LOADS=0 (element by element; a lane now holds adjacent elements,
// where it held every 32nd before).
std::pair<int, int> split_of(int b, int hkv, int64_t longest) {
  static const int max_blocks = env_int("KVSTORE_DECODE_MAX_BLOCKS", 2048, 1, 1 << 20);
  int chunk = min_split();
  auto blocks = [&](int c) { return int64_t(b) * hkv * ((longest + c - 1) / c); };
  while (chunk < 4096 && blocks(chunk) > max_blocks) chunk *= 2;
  return {chunk, int((longest + chunk - 1) / chunk)};
}

#ifdef KVSTORE_CUDA

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

struct Kernels {
  CUfunction partial;
  CUfunction combine;
  int resident;  // blocks of the partial kernel the device holds at once
};

// KVSTORE_DECODE_BALANCED=1 (read once): the partial kernel's blocks take equal runs of all
// rows' keys, one wave of them (the source's BAL), instead of fixed splits of each row.
bool balanced() {
  static const bool on = env_int("KVSTORE_DECODE_BALANCED", 0, 0, 1) == 1;
  return on;
}

// Keys a warp loads at once (the source's KPW, which it takes from here alone):
// KVSTORE_DECODE_KEYS_PER_LOAD, else 4, or 2 at head dimension above 128 (registers).
int keys_per_load(int d) {
  static const int kpw = env_int("KVSTORE_DECODE_KEYS_PER_LOAD", 0, 0, 16);
  return kpw > 0 ? kpw : (d > 128 ? 2 : 4);
}

// How a launch of balanced blocks cuts its rows' keys: runs of `per` keys (whole passes of
// the block's warps), `blocks` of them.
struct Runs {
  int64_t per;
  int blocks;
};

// The runs of a row group whose sequences are `totals` (kv heads `hkv` each): as many keys a
// block as make one wave of `resident` blocks, in whole passes of `pass` keys.
Runs runs_of(const int64_t* totals, int n, int hkv, int resident, int pass) {
  int64_t all = 0;
  for (int i = 0; i < n; ++i) all += int64_t(hkv) * totals[i];
  int64_t per = (all + resident - 1) / resident;
  per = std::max<int64_t>(pass, (per + pass - 1) / pass * pass);
  return {per, int((all + per - 1) / per)};
}

// The most splits any (row, head) of the group gets from runs of `per` keys: the runs its
// keys span.
int runs_splits(const int64_t* totals, int n, int hkv, int64_t per) {
  int64_t off = 0;
  int most = 1;
  for (int i = 0; i < n; ++i) {
    for (int h = 0; h < hkv; ++h) {
      const int64_t hs = off + int64_t(h) * totals[i];
      most = std::max<int>(most, int((hs + totals[i] - 1) / per - hs / per + 1));
    }
    off += int64_t(hkv) * totals[i];
  }
  return most;
}

// The merge kernel's split groups at head dimension `d` (its block is d × groups threads,
// 256-512): 8 up to 64, 4 up to 128, 2 beyond; the source takes them as `MG`.
// KVSTORE_DECODE_MERGE_GROUPS=1 merges a head's splits in one walk, as before session 55.
int merge_groups(int d) {
  static const int set = env_int("KVSTORE_DECODE_MERGE_GROUPS", 0, 0, 32);
  const int g = set > 0 ? set : (d > 128 ? 2 : (d > 64 ? 4 : 8));
  if (d * g > 1024) {
    throw std::invalid_argument("KVSTORE_DECODE_MERGE_GROUPS=" + std::to_string(g) +
                                " makes more than 1,024 threads a block at head dimension " +
                                std::to_string(d));
  }
  return g;
}

// The kernels for (dtype, D, NREP) on the current device, compiled once per process.
Kernels kernels(mx::Dtype dtype, int d, int nrep) {
  static std::mutex mu;
  static std::map<std::tuple<int, int, int, int>, Kernels> cache;
  const CUdevice dev = nvrtc::current_device();
  auto key = std::make_tuple(int(dev), int(dtype.val()), d, nrep);
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = cache.find(key); it != cache.end()) return it->second;

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
  // 0: no floor on the partial kernel's blocks per SM (the compiler picks its registers)
  static const int minb = env_int("KVSTORE_DECODE_MIN_BLOCKS_PER_SM", 0, 0, 16);
  // 1: a pass's dot products summed across the warp together (the source's XSUM)
  static const int xsum = env_int("KVSTORE_DECODE_SUMS_TOGETHER", 0, 0, 1);
  // 1: each warp loads its next pass while it computes with this one (the source's PREF)
  static const int pref = env_int("KVSTORE_DECODE_PREFETCH", 0, 0, 1);
  // 1: 16-bit keys and values stay the words read until used (the source's PACK), where a
  // lane holds an even number of elements (head dimension a multiple of 64)
  static const int packed = env_int("KVSTORE_DECODE_PACKED", 0, 0, 1);
  const bool pack = packed == 1 && dtype != mx::float32 && d % 64 == 0;
  std::string src = (pack ? std::string("#define PACK 1\n") : std::string()) +
                    (balanced() ? std::string("#define BAL 1\n") : std::string()) +
                    "#define KPW " + std::to_string(keys_per_load(d)) + "\n" +
                    (minb > 0 ? "#define MINB " + std::to_string(minb) + "\n" : std::string()) +
                    "#define XSUM " + std::to_string(xsum) + "\n#define PREF " +
                    std::to_string(pref) + "\n" +
                    "#define MG " + std::to_string(merge_groups(d)) + "\n" +
                    "#define T " + type + "\n#define LOAD " + load + "\n#define STORE " +
                    store + "\n#define D " + std::to_string(d) + "\n#define NREP " +
                    std::to_string(nrep) + "\n" + kSource;
  auto fns = nvrtc::compile(src, "kvstore_rows_attention.cu", {"rows_partial", "rows_combine"},
                            "the batched decode attention");
  Kernels k{fns[0], fns[1], nvrtc::resident_blocks(fns[0], kWarps * 32)};
  cache.emplace(key, k);
  return k;
}

// Whether the partial kernel may read rows with vector loads: each lane's D / 32 elements
// are 4, 8, 16 or 32 bytes and every row it reads starts at a multiple of that (every base
// address and every stride in elements a multiple of D / 32). `KVSTORE_DECODE_VECTOR_LOADS=0`
// reads element by element, for measuring both.
bool vector_loads(int d, size_t esize, std::initializer_list<const void*> bases,
                  const Strides& st, const Table& tab, int n) {
  static const bool on = env_int("KVSTORE_DECODE_VECTOR_LOADS", 1, 0, 1) == 1;
  const long long e = d / 32;
  const size_t bytes = size_t(e) * esize;
  if (!on || (bytes != 4 && bytes != 8 && bytes != 16 && bytes != 32)) return false;
  auto aligned = [&](const void* p) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; };
  auto whole = [&](long long stride) { return stride % e == 0; };
  for (const void* p : bases) {
    if (!aligned(p)) return false;
  }
  for (long long x : {st.qb, st.qh, st.kb, st.kh, st.vb, st.vh}) {
    if (!whole(x)) return false;
  }
  for (int i = 0; i < n; ++i) {
    const RowKv& r = tab.r[i];
    if (!aligned(reinterpret_cast<const void*>(r.k)) || !aligned(reinterpret_cast<const void*>(r.v)) ||
        !whole(r.khs) || !whole(r.vhs)) {
      return false;
    }
    if (r.plen > 0 && (!aligned(reinterpret_cast<const void*>(r.pk)) ||
                       !aligned(reinterpret_cast<const void*>(r.pv)) || !whole(r.pkhs) ||
                       !whole(r.pvhs))) {
      return false;
    }
  }
  return true;
}

// How a node's partial kernels cut its rows' keys: fixed splits of `chunk` keys, or with
// balanced blocks each row group's runs; `splits` is the most a (row, head) gets either way
// (the partials' stride).
struct NodePlan {
  int chunk = 0;
  int splits = 1;
  std::vector<Runs> groups;  // balanced only: one a group of kRows rows
};

NodePlan node_plan(int b, int hkv, const RowSpans& spans, int resident, int d) {
  NodePlan plan;
  if (!balanced()) {
    std::tie(plan.chunk, plan.splits) = split_of(b, hkv, spans.longest);
    return plan;
  }
  for (int row0 = 0; row0 < b; row0 += kRows) {
    const int n = std::min(kRows, b - row0);
    const Runs runs = runs_of(spans.totals.data() + row0, n, hkv, resident, kWarps * keys_per_load(d));
    plan.splits = std::max(plan.splits, runs_splits(spans.totals.data() + row0, n, hkv, runs.per));
    plan.groups.push_back(runs);
  }
  return plan;
}

int scratch_splits(mx::Stream s, const std::vector<RowMeta>& rows,
                   const std::vector<mx::array>& inputs, mx::Dtype dtype, int b, int hkv, int d,
                   int nrep) {
  const RowSpans spans = row_spans(rows, inputs);
  if (!balanced()) return split_of(b, hkv, spans.longest).second;
  cu::get_command_encoder(s).device().make_current();
  return node_plan(b, hkv, spans, kernels(dtype, d, nrep).resident, d).splits;
}

// The GPU evaluation: two kernels per 32 rows, the arenas written in place.
void rows_attend_gpu(mx::Stream s, const std::vector<mx::array>& inputs, mx::array& out,
                     float scale, const std::vector<RowMeta>& rows) {
  auto& enc = cu::get_command_encoder(s);
  enc.device().make_current();
  const auto &q = inputs[0], &kn = inputs[1], &vn = inputs[2];
  const int b = q.shape(0), hq = q.shape(1), d = q.shape(3), hkv = kn.shape(1);
  const int nrep = hq / hkv;
  Kernels kern = kernels(q.dtype(), d, nrep);

  // Each row's whole sequence (prefix, own keys, the new one) and the split size.
  const RowSpans spans = row_spans(rows, inputs);
  const NodePlan plan = node_plan(b, hkv, spans, kern.resident, d);
  const int splits = plan.splits;

  // No buffer from allocator::malloc, which on CUDA is managed memory (and moving a recycled
  // device buffer there synchronizes the device: docs/benchmarks.md, session 44). The output
  // takes q's buffer where q is this node's alone (the combine kernel writes a row group's
  // output only after the partial kernel has read its queries); the partials live in the
  // thread's scratch, the node's last input, made by an MLX op.
  // Without a scratch input (KVSTORE_DECODE_ALLOC=0) both come from allocator::malloc, as
  // before, for measuring both.
  const bool scratched = inputs.size() == spans.end + 1;
  if (scratched && q.is_donatable() && q.flags().row_contiguous && q.itemsize() == out.itemsize() &&
      q.size() == out.size()) {
    out.copy_shared_buffer(q);
  } else {
    out.set_data(mx::allocator::malloc(out.nbytes()));
  }
  mx::array part({b, hq, splits, d + 2}, mx::float32, nullptr, {});
  if (scratched) {
    const mx::array& scratch = inputs.back();
    if (scratch.dtype() != mx::float32 || scratch.size() < size_t(b) * hq * splits * (d + 2)) {
      throw std::invalid_argument("the batched decode attention's partials do not fit its scratch");
    }
    mx::Strides strides = {int64_t(hq) * splits * (d + 2), int64_t(splits) * (d + 2), d + 2, 1};
    mx::array::Flags flags{};
    flags.contiguous = true;
    flags.row_contiguous = true;
    part.copy_shared_buffer(scratch, strides, flags, part.size(), 0);
    enc.set_input_array(scratch);
    enc.set_output_array(scratch);
  } else {
    part.set_data(mx::allocator::malloc(part.nbytes()));
    enc.add_temporary(part);
  }

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
      const RowMeta& m = rows[row0 + i];
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
      int r0 = row0, sp = splits, ch = plan.chunk, h = hkv, nr = n, per = 0;
      int vec = vector_loads(d, esize, {qp, kp, vp}, st, tab, n) ? 1 : 0;
      float sc = scale;
      dim3 grid(splits, hkv, n);
      if (balanced()) {
        const Runs& runs = plan.groups[row0 / kRows];
        per = int(runs.per);
        grid = dim3(runs.blocks, 1, 1);
      }
      void* args[] = {&qp, &kp, &vp, &pp, &tab, &st, &r0, &sp, &ch, &sc, &h, &vec, &per, &nr};
      enc.add_kernel_node_raw(kern.partial, grid, dim3(kWarps * 32, 1, 1), dim3(1, 1, 1), 0, args);
    }
    enc.set_input_array(part);
    // The scratch is every node's of this thread. MLX's graph orders a node after the last
    // node that wrote a buffer it names, never after one that only read it: declared as
    // written here too, the next partial kernel to write the scratch (another row group, or
    // another node: rows a batch sends row by row are independent nodes) waits until this
    // merge has read it. Without it the next node's partials overwrote these before the
    // merge read them (`device.sh rk`, session 54: 17 of 37 rows wrong at step 0).
    if (scratched) enc.set_output_array(part);
    enc.set_output_array(out);
    {
      const void* pp = mx::gpu_ptr<void>(part);
      void* op = mx::gpu_ptr<void>(out);
      int r0 = row0, sp = splits, h = hq, kvh = hkv;
      int per = balanced() ? int(plan.groups[row0 / kRows].per) : 0;
      void* plain[] = {&pp, &op, &r0, &sp, &h};
      void* with_runs[] = {&pp, &op, &r0, &sp, &h, &tab, &per, &kvh};
      enc.add_kernel_node_raw(kern.combine, dim3(hq, n, 1), dim3(d, merge_groups(d), 1),
                              dim3(1, 1, 1), 0, balanced() ? with_runs : plain);
    }
  }
}

#else  // KVSTORE_CUDA

int scratch_splits(mx::Stream, const std::vector<RowMeta>& rows,
                   const std::vector<mx::array>& inputs, mx::Dtype, int b, int hkv, int, int) {
  return split_of(b, hkv, row_spans(rows, inputs).longest).second;
}

void rows_attend_gpu(mx::Stream, const std::vector<mx::array>&, mx::array&, float,
                     const std::vector<RowMeta>&) {
  throw std::runtime_error(
      "this build has no batched decode attention kernel for the GPU (build with the CUDA "
      "backend's headers: scripts/cuda/build.sh)");
}

#endif  // KVSTORE_CUDA

// The calling thread's scratch for the partials of every batched decode attention node it
// builds: a float32 array of at least `n` elements, made by an MLX op (device memory on a GPU)
// once and again only when a step needs more. Nodes write it in stream order (each declares
// it as an output), and consecutive layers depend on each other anyway.
mx::array partial_scratch(size_t n, mx::Stream stream) {
  thread_local std::optional<mx::array> scratch;
  if (!scratch || scratch->size() < n) {
    const size_t want = std::max<size_t>(n, scratch ? scratch->size() * 2 : size_t(1) << 16);
    scratch = mx::zeros({int(want)}, mx::float32, stream);
  }
  return *scratch;
}

class RowsDecodeAttention : public mx::UnaryPrimitive {
 public:
  RowsDecodeAttention(mx::Stream s, float scale, std::vector<RowMeta> rows)
      : mx::UnaryPrimitive(s), scale_(scale), rows_(std::move(rows)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    std::vector<mx::array> in;
    for (const auto& a : inputs) {
      encoder.set_input_array(a);
      in.push_back(mx::array::unsafe_weak_copy(a));
    }
    encoder.set_output_array(out);
    encoder.dispatch([in = std::move(in), rows = rows_, scale = scale_, op = out.data<float>(),
                      n = out.size()]() { rows_attend_cpu(in, rows, scale, op, n); });
  }

  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    rows_attend_gpu(stream(), inputs, out, scale_, rows_);
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

#ifdef KVSTORE_CUDA
bool rows_attention_kernel_built() { return true; }
#else
bool rows_attention_kernel_built() { return false; }
#endif

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
  if (qa.dtype() != ka.dtype() || qa.dtype() != va.dtype()) {
    throw std::invalid_argument("the batched decode attention takes q, k and v of one dtype");
  }
  const auto device = mx::default_device();
  if (device == mx::Device::cpu && qa.dtype() != mx::float32) {
    throw std::invalid_argument("the batched decode attention takes f32 on the CPU");
  }
  if (device != mx::Device::cpu && (d % 32 != 0 || d > 256 || nrep > 8)) {
    throw std::invalid_argument(
        "the batched decode attention takes, on a GPU, a head dimension that is a multiple "
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
  auto stream = mx::default_stream(device);
  // KVSTORE_DECODE_ALLOC=0 (read once) leaves the scratch out: the GPU evaluation then
  // allocates as before, for measuring both.
  static const bool scratch_on = [] {
    const char* v = std::getenv("KVSTORE_DECODE_ALLOC");
    return !(v && std::string(v) == "0");
  }();
  if (device != mx::Device::cpu && scratch_on) {
    // The partials' scratch (see rows_attend_gpu), sized as the kernel will split the rows.
    const int splits = scratch_splits(stream, rows, inputs, qa.dtype(), b, ka.shape(1), d,
                                      qa.shape(1) / ka.shape(1));
    inputs.push_back(partial_scratch(size_t(b) * qa.shape(1) * splits * (d + 2), stream));
  }
  return std::make_unique<Array>(Array{mx::array(
      qa.shape(), qa.dtype(), std::make_shared<RowsDecodeAttention>(stream, scale, std::move(rows)),
      std::move(inputs))});
}

}  // namespace kvmlx
