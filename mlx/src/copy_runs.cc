// Copies of token runs of several arrays as one graph node (`CopyTokenRuns`): output i is
// input i's tokens [lo_i, hi_i) (axis 2 of a 4-D [A, H, T, W] array) in a buffer of its own,
// row-major. What a publication takes of every layer part of a sequence's arenas: one node
// and, on CUDA, one kernel per 32 parts, instead of a view and a copy per part (64 nodes for
// a 32-layer model), each of which costs the engine thread MLX's per-node launch time.
//
// The copies read the inputs as they are when the node runs: a later in-place write into an
// input (the arenas of the batched decode attention) is ordered after it like after any other
// reader, by the stream (the inputs are declared to the encoder).
//
// On CUDA the kernel is compiled by NVRTC (nvrtc.h) once per device; on the CPU the same
// node copies the rows on the CPU stream's thread. An input's last axis must be contiguous
// (stride 1): the arenas and their views are.
//
// The outputs live in one buffer that an MLX op made (zeros, the node's last input), each at
// a 16-byte aligned offset: the shim cannot allocate device memory the way MLX's own kernels
// do (`cu::malloc_async` is not exported), and `allocator::malloc` gives CUDA managed memory,
// which the kernel's writes and the export thread's reads would page through (measured on the
// H100, session 44: the trace's cache arm read back 2.4x slower and its prompt steps took
// twice the engine thread's CPU).
#include "shim.h"

#include "kvstore-mlx/src/ffi.rs.h"

#include <algorithm>
#include <cstring>
#include <limits>
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

#include "mlx/backend/cuda/device.h"
#include "nvrtc.h"
#endif  // KVSTORE_CUDA

namespace kvmlx {
namespace {

namespace mx = mlx::core;

// One output's copy: `a · h · t` rows of `row` bytes, the row (a, h, t) read at
// src + a·s0 + h·s1 + t·s2 (bytes; src already at the run's first token) and written
// consecutively from dst. The kernel's parameter struct, field for field.
struct Run {
  unsigned long long src, dst, s0, s1, s2;
  unsigned int a, h, t, row, unit;
};

constexpr int kRuns = 32;  // runs per launch: the Runs parameter below holds this many
struct Runs {
  Run r[kRuns];
};
// A table entry of `copy_runs_table` is one `Run`: the Rust side sizes tables by this.
static_assert(sizeof(Run) == 64, "mlx/src/copy_runs.rs: HOST_RUN_TABLE_ENTRY");

// The run that copies `in`'s tokens [lo, hi) to `dst`, row-major: checks the layout it
// relies on.
Run run_of(const mx::array& in, int64_t lo, int64_t hi, const char* src, char* dst) {
  const auto& st = in.strides();
  if (in.shape(3) > 1 && st[3] != 1) {
    throw std::invalid_argument("a token run's source must have a contiguous last axis");
  }
  const size_t e = in.itemsize();
  Run r{};
  r.src = reinterpret_cast<unsigned long long>(src + lo * st[2] * e);
  r.dst = reinterpret_cast<unsigned long long>(dst);
  r.s0 = st[0] * e, r.s1 = st[1] * e, r.s2 = st[2] * e;
  r.a = unsigned(in.shape(0)), r.h = unsigned(in.shape(1)), r.t = unsigned(hi - lo);
  r.row = unsigned(in.shape(3) * e);
  // The widest unit every address and stride is a multiple of.
  r.unit = 1;
  for (unsigned u : {16u, 8u, 4u}) {
    if ((r.src | r.dst | r.s0 | r.s1 | r.s2 | r.row) % u == 0) {
      r.unit = u;
      break;
    }
  }
  return r;
}

// Each output made a row-major view of `dest` (bytes) from its byte offset in `offsets`.
void place_outputs(const mx::array& dest, std::vector<mx::array>& outputs, const std::vector<size_t>& offsets) {
  for (size_t i = 0; i < outputs.size(); ++i) {
    mx::array& o = outputs[i];
    mx::Strides strides(o.ndim(), 1);
    for (int d = int(o.ndim()) - 2; d >= 0; --d) strides[d] = strides[d + 1] * o.shape(d + 1);
    mx::array::Flags flags{};
    flags.contiguous = true;
    flags.row_contiguous = true;
    size_t longest = 0;
    for (auto d : o.shape()) longest = std::max<size_t>(longest, size_t(d));
    flags.col_contiguous = o.size() <= 1 || o.size() == longest;
    // The offset counts elements of the output's dtype (array::copy_shared_buffer).
    o.copy_shared_buffer(dest, strides, flags, o.size(), int64_t(offsets[i] / o.itemsize()));
  }
}

// The run of every non-empty output, with its input's index, its addresses from `src_of` and
// `dst_of` (host or device pointers); the outputs are placed in the node's buffer (its last
// input) first.
template <typename Src, typename Dst>
std::vector<std::pair<size_t, Run>> placed_runs(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs,
                                                const std::vector<int64_t>& los, const std::vector<size_t>& offsets,
                                                Src src_of, Dst dst_of) {
  place_outputs(inputs.back(), outputs, offsets);
  std::vector<std::pair<size_t, Run>> runs;
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (outputs[i].nbytes() > 0) {
      runs.emplace_back(i, run_of(inputs[i], los[i], los[i] + outputs[i].shape(2), src_of(inputs[i]),
                                  dst_of(outputs[i])));
    }
  }
  return runs;
}

// Declares to `enc` the node's buffer and the inputs and outputs of `runs`. On CUDA it comes
// before every kernel of the node: MLX's CUDA graph gives a kernel node the dependencies
// declared since the node before it, so a kernel after the first with nothing declared
// would be a root of the graph, free to run before its sources are written and before the
// zeros of its buffer are (a publication's layers past the 16th came out wrong on the H100,
// session 48).
template <typename Encoder>
void declare_runs(Encoder& enc, const std::vector<mx::array>& inputs, const std::vector<mx::array>& outputs,
                  const std::pair<size_t, Run>* runs, size_t n) {
  enc.set_input_array(inputs.back());
  for (size_t j = 0; j < n; ++j) {
    enc.set_input_array(inputs[runs[j].first]);
    enc.set_output_array(outputs[runs[j].first]);
  }
}

void copy_run_host(const Run& r) {
  const auto* src = reinterpret_cast<const char*>(r.src);
  auto* dst = reinterpret_cast<char*>(r.dst);
  for (unsigned a = 0; a < r.a; ++a) {
    for (unsigned h = 0; h < r.h; ++h) {
      for (unsigned t = 0; t < r.t; ++t) {
        std::memcpy(dst, src + a * r.s0 + h * r.s1 + t * r.s2, r.row);
        dst += r.row;
      }
    }
  }
}

// What a `CopyTokenRunsToHost` node writes: run i is source `runs[3i]`'s tokens
// `runs[3i+1]..runs[3i+2]`, row-major at host address `dsts[i]`; on CUDA through a table of
// `Run`s at `table` (page-locked, `table_len` bytes) that the node fills when it runs. Tells
// the Rust side when the node is done with the memory (the destinations and the table).
struct HostRuns {
  std::vector<int64_t> runs;
  std::vector<uint64_t> dsts;
  Run* table;
  size_t table_len;
  uint64_t token;
  HostRuns(std::vector<int64_t> r, std::vector<uint64_t> d, Run* t, size_t tl, uint64_t tok)
      : runs(std::move(r)), dsts(std::move(d)), table(t), table_len(tl), token(tok) {}
  HostRuns(const HostRuns&) = delete;
  HostRuns& operator=(const HostRuns&) = delete;
  ~HostRuns() { release_host_rows(token); }

  // The non-empty runs, their sources' addresses from `src_of` (host or device pointers).
  template <typename Src>
  std::vector<Run> resolved(const std::vector<mx::array>& sources, Src src_of) const {
    std::vector<Run> out;
    for (size_t i = 0; i < dsts.size(); ++i) {
      const mx::array& in = sources[size_t(runs[3 * i])];
      const int64_t lo = runs[3 * i + 1], hi = runs[3 * i + 2];
      if (hi > lo && in.size() > 0) out.push_back(run_of(in, lo, hi, src_of(in), reinterpret_cast<char*>(dsts[i])));
    }
    return out;
  }
};

#ifdef KVSTORE_CUDA

namespace cu = mlx::core::cu;

const char* kSource = R"(
struct Run {
  unsigned long long src, dst, s0, s1, s2;
  unsigned int a, h, t, row, unit;
};
struct Runs { Run r[32]; };
struct alignas(16) W16 { unsigned long long x, y; };

template <typename W>
__device__ void copy_run(const Run& r, unsigned long long first, unsigned long long step) {
  const unsigned int per_row = r.row / sizeof(W);
  const unsigned long long rows = (unsigned long long)r.a * r.h * r.t;
  const unsigned long long total = rows * per_row;
  for (unsigned long long i = first; i < total; i += step) {
    const unsigned long long q = i / per_row;
    const unsigned int c = (unsigned int)(i - q * per_row);
    const unsigned long long ah = q / r.t;
    const unsigned int t = (unsigned int)(q - ah * r.t);
    const unsigned int h = (unsigned int)(ah % r.h);
    const unsigned long long a = ah / r.h;
    const char* s = (const char*)r.src + a * r.s0 + h * r.s1 + t * r.s2;
    reinterpret_cast<W*>(r.dst)[i] = reinterpret_cast<const W*>(s)[c];
  }
}

extern "C" __global__ void copy_runs(const Runs runs) {
  const Run r = runs.r[blockIdx.y];
  const unsigned long long first = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  const unsigned long long step = (unsigned long long)gridDim.x * blockDim.x;
  switch (r.unit) {
    case 16: copy_run<W16>(r, first, step); break;
    case 8: copy_run<unsigned long long>(r, first, step); break;
    case 4: copy_run<unsigned int>(r, first, step); break;
    default: copy_run<unsigned char>(r, first, step); break;
  }
}

// One thread block per run of a table at a time (the runs of a publication written straight
// into host memory: thousands, one per block and part): its first thread reads the run
// (page-locked host memory, over the bus) once for the block, then the block copies it.
extern "C" __global__ void copy_runs_table(const Run* __restrict__ table, unsigned long long n) {
  __shared__ Run r;
  for (unsigned long long e = blockIdx.x; e < n; e += gridDim.x) {
    if (threadIdx.x == 0) r = table[e];
    __syncthreads();
    switch (r.unit) {
      case 16: copy_run<W16>(r, threadIdx.x, blockDim.x); break;
      case 8: copy_run<unsigned long long>(r, threadIdx.x, blockDim.x); break;
      case 4: copy_run<unsigned int>(r, threadIdx.x, blockDim.x); break;
      default: copy_run<unsigned char>(r, threadIdx.x, blockDim.x); break;
    }
    __syncthreads();
  }
}
)";

// The kernels on the current device (`copy_runs`, `copy_runs_table`), compiled once per
// process and device.
const std::vector<CUfunction>& copy_runs_kernels() {
  static std::mutex mu;
  static std::map<int, std::vector<CUfunction>> cache;
  const CUdevice dev = nvrtc::current_device();
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = cache.find(int(dev)); it != cache.end()) return it->second;
  auto fs = nvrtc::compile(kSource, "kvstore_copy_runs.cu", {"copy_runs", "copy_runs_table"}, "the token-run copy");
  return cache.emplace(int(dev), std::move(fs)).first->second;
}

void copy_runs_gpu(mx::Stream s, const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs,
                   const std::vector<int64_t>& los, const std::vector<size_t>& offsets) {
  auto& enc = cu::get_command_encoder(s);
  enc.device().make_current();
  auto runs = placed_runs(
      inputs, outputs, los, offsets, [](const mx::array& a) { return mx::gpu_ptr<char>(a); },
      [](mx::array& a) { return mx::gpu_ptr<char>(a); });
  CUfunction kernel = runs.empty() ? nullptr : copy_runs_kernels()[0];
  for (size_t at = 0; at < runs.size(); at += kRuns) {
    const size_t n = std::min<size_t>(kRuns, runs.size() - at);
    declare_runs(enc, inputs, outputs, runs.data() + at, n);
    Runs p{};
    unsigned long long most = 0;
    for (size_t j = 0; j < n; ++j) {
      p.r[j] = runs[at + j].second;
      const Run& r = p.r[j];
      most = std::max(most, (unsigned long long)r.a * r.h * r.t * (r.row / r.unit));
    }
    const unsigned int blocks = unsigned(std::clamp<unsigned long long>((most + 255) / 256, 1, 1024));
    void* args[] = {&p};
    enc.add_kernel_node_raw(kernel, dim3(blocks, unsigned(n), 1), dim3(256, 1, 1), dim3(1, 1, 1), 0, args);
  }
}

// The host runs on CUDA: the table filled now, then one kernel reading it writes every run
// into host memory over the bus. The destinations and the table stay lent until the command
// buffer has completed.
void copy_runs_to_host_gpu(mx::Stream s, const std::shared_ptr<HostRuns>& host, const std::vector<mx::array>& inputs,
                           mx::array& out) {
  auto& enc = cu::get_command_encoder(s);
  enc.device().make_current();
  if (!nvrtc::unified_addressing()) {
    throw std::runtime_error("this device cannot write page-locked host memory at its host address");
  }
  out.copy_shared_buffer(inputs.back());
  for (const auto& a : inputs) enc.set_input_array(a);
  enc.set_output_array(out);
  const std::vector<mx::array> sources(inputs.begin(), inputs.end() - 1);
  auto runs = host->resolved(sources, [](const mx::array& a) { return mx::gpu_ptr<char>(a); });
  if (runs.empty()) return;
  if (runs.size() * sizeof(Run) > host->table_len) {
    throw std::invalid_argument("a table of " + std::to_string(host->table_len) + " bytes for " +
                                std::to_string(runs.size()) + " token runs");
  }
  std::memcpy(host->table, runs.data(), runs.size() * sizeof(Run));
  const Run* table = host->table;
  unsigned long long n = runs.size();
  const unsigned int blocks = unsigned(std::min<unsigned long long>(n, 8192));
  void* args[] = {&table, &n};
  enc.add_kernel_node_raw(copy_runs_kernels()[1], dim3(blocks, 1, 1), dim3(256, 1, 1), dim3(1, 1, 1), 0, args);
  enc.add_completed_handler([host]() {});
}

#else  // KVSTORE_CUDA

void copy_runs_gpu(mx::Stream, const std::vector<mx::array>&, std::vector<mx::array>&, const std::vector<int64_t>&,
                   const std::vector<size_t>&) {
  throw std::runtime_error(
      "this build has no token-run copy for the GPU (build with the CUDA backend's headers: "
      "scripts/cuda/build.sh)");
}

void copy_runs_to_host_gpu(mx::Stream, const std::shared_ptr<HostRuns>&, const std::vector<mx::array>&,
                           mx::array&) {
  throw std::runtime_error(
      "this build has no token-run copy into host memory for the GPU (build with the CUDA "
      "backend's headers: scripts/cuda/build.sh)");
}

#endif  // KVSTORE_CUDA

class CopyTokenRuns : public mx::Primitive {
 public:
  CopyTokenRuns(mx::Stream s, std::vector<int64_t> los, std::vector<size_t> offsets)
      : mx::Primitive(s), los_(std::move(los)), offsets_(std::move(offsets)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& encoder = mx::cpu::get_command_encoder(stream());
    auto runs = placed_runs(
        inputs, outputs, los_, offsets_, [](const mx::array& a) { return a.data<char>(); },
        [](mx::array& a) { return a.data<char>(); });
    // Every array is declared, the empty outputs too, so that each lives until the copy ran.
    encoder.set_input_array(inputs.back());
    for (size_t i = 0; i < outputs.size(); ++i) {
      encoder.set_input_array(inputs[i]);
      encoder.set_output_array(outputs[i]);
    }
    encoder.dispatch([runs = std::move(runs)]() {
      for (const auto& [_, r] : runs) copy_run_host(r);
    });
  }

  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    copy_runs_gpu(stream(), inputs, outputs, los_, offsets_);
  }

  const char* name() const override { return "CopyTokenRuns"; }
  bool is_equivalent(const mx::Primitive&) const override { return false; }

 private:
  std::vector<int64_t> los_;
  std::vector<size_t> offsets_;
};

// The token runs of several arrays written straight into host memory (`HostRuns`): a
// publication's blocks, each part's plane at the block's own page-locked chunk. Its output is
// a small array that shares the buffer of its last input (zeros): waiting for it is waiting
// for the writes.
class CopyTokenRunsToHost : public mx::UnaryPrimitive {
 public:
  CopyTokenRunsToHost(mx::Stream s, std::shared_ptr<HostRuns> host) : mx::UnaryPrimitive(s), host_(std::move(host)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.copy_shared_buffer(inputs.back());
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    const std::vector<mx::array> sources(inputs.begin(), inputs.end() - 1);
    auto runs = host_->resolved(sources, [](const mx::array& a) { return a.data<char>(); });
    encoder.dispatch([runs = std::move(runs), host = host_]() {
      for (const Run& r : runs) copy_run_host(r);
    });
  }

  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    copy_runs_to_host_gpu(stream(), host_, inputs, out);
  }

  const char* name() const override { return "CopyTokenRunsToHost"; }
  bool is_equivalent(const mx::Primitive&) const override { return false; }

 private:
  std::shared_ptr<HostRuns> host_;
};

}  // namespace

#ifdef KVSTORE_CUDA
bool copy_runs_kernel_built() { return true; }
#else
bool copy_runs_kernel_built() { return false; }
#endif

std::unique_ptr<ArrayList> copy_token_runs(const ArrayList& sources, rust::Slice<const int64_t> ranges) {
  const auto& in = sources.items;
  if (ranges.size() != in.size() * 2) {
    throw std::invalid_argument("copy_token_runs needs a token range for every source");
  }
  std::vector<mx::Shape> shapes;
  std::vector<mx::Dtype> dtypes;
  std::vector<int64_t> los;
  for (size_t i = 0; i < in.size(); ++i) {
    const int64_t lo = ranges[2 * i], hi = ranges[2 * i + 1];
    if (in[i].ndim() != 4) throw std::invalid_argument("copy_token_runs takes 4-D sources [A, H, T, W]");
    if (lo < 0 || lo > hi || hi > in[i].shape(2)) {
      throw std::invalid_argument("tokens " + std::to_string(lo) + ".." + std::to_string(hi) + " of a source of " +
                                  std::to_string(in[i].shape(2)));
    }
    shapes.push_back({in[i].shape(0), in[i].shape(1), int(hi - lo), in[i].shape(3)});
    dtypes.push_back(in[i].dtype());
    los.push_back(lo);
  }
  auto out = std::make_unique<ArrayList>();
  if (in.empty()) return out;
  // One buffer for every output, each at a 16-byte aligned offset.
  std::vector<size_t> offsets;
  size_t total = 0;
  for (size_t i = 0; i < in.size(); ++i) {
    size_t n = mx::size_of(dtypes[i]);
    for (auto d : shapes[i]) n *= size_t(d);
    offsets.push_back(total);
    total += (n + 15) / 16 * 16;
  }
  if (total / 8 > size_t(std::numeric_limits<int>::max())) {
    throw std::invalid_argument("token runs of " + std::to_string(total) + " bytes do not fit one buffer");
  }
  auto stream = mx::default_stream(mx::default_device());
  std::vector<mx::array> inputs = in;
  inputs.push_back(mx::zeros({int(std::max<size_t>(total, 16) / 8)}, mx::uint64, stream));
  out->items = mx::array::make_arrays(std::move(shapes), dtypes,
                                      std::make_shared<CopyTokenRuns>(stream, std::move(los), std::move(offsets)), inputs);
  return out;
}

std::unique_ptr<Array> copy_token_runs_to_host(const ArrayList& sources, rust::Slice<const int64_t> runs,
                                               rust::Slice<const uint64_t> dsts, size_t table, size_t table_len,
                                               uint64_t token) {
  // The host side is made first, so that every refusal below still hands the memory back.
  auto host = std::make_shared<HostRuns>(std::vector<int64_t>(runs.begin(), runs.end()),
                                         std::vector<uint64_t>(dsts.begin(), dsts.end()),
                                         reinterpret_cast<Run*>(table), table_len, token);
  const auto& in = sources.items;
  if (host->runs.size() != host->dsts.size() * 3) {
    throw std::invalid_argument("copy_token_runs_to_host needs a source and a token range for every destination");
  }
  for (const auto& a : in) {
    if (a.ndim() != 4) throw std::invalid_argument("copy_token_runs_to_host takes 4-D sources [A, H, T, W]");
  }
  for (size_t i = 0; i < host->dsts.size(); ++i) {
    const int64_t src = host->runs[3 * i], lo = host->runs[3 * i + 1], hi = host->runs[3 * i + 2];
    if (src < 0 || size_t(src) >= in.size()) {
      throw std::invalid_argument("token run " + std::to_string(i) + " names source " + std::to_string(src) + " of " +
                                  std::to_string(in.size()));
    }
    if (lo < 0 || lo > hi || hi > in[size_t(src)].shape(2)) {
      throw std::invalid_argument("tokens " + std::to_string(lo) + ".." + std::to_string(hi) + " of a source of " +
                                  std::to_string(in[size_t(src)].shape(2)));
    }
    if (hi > lo && host->dsts[i] == 0) throw std::invalid_argument("token run " + std::to_string(i) + " has no destination");
  }
  if (table_len < host->dsts.size() * sizeof(Run)) {
    throw std::invalid_argument("a table of " + std::to_string(table_len) + " bytes for " +
                                std::to_string(host->dsts.size()) + " token runs (" + std::to_string(sizeof(Run)) +
                                " bytes each)");
  }
  auto stream = mx::default_stream(mx::default_device());
  std::vector<mx::array> inputs = in;
  inputs.push_back(mx::zeros({16}, mx::uint8, stream));
  auto node = std::make_shared<CopyTokenRunsToHost>(stream, std::move(host));
  return std::make_unique<Array>(Array{mx::array({16}, mx::uint8, std::move(node), std::move(inputs))});
}

}  // namespace kvmlx
