// The CUDA source of the batched decode attention (rows_attention.cc), compiled at run time
// by NVRTC with `T`, `LOAD`, `STORE`, `D` and `NREP` defined in front of it. It includes no
// header (NVRTC has none of the CUDA toolkit's here): 16-bit floats are converted by hand.
//
// `rows_partial`: grid (splits, kv heads, rows), 128 threads. Block (s, h, r) first writes
// row r's new key and value of head h at position `len` of its own arena (split 0 only), then
// attends the NREP query heads of kv head h over keys s·chunk .. (s+1)·chunk of the row's
// whole sequence: its shared prefix (`plen` keys), its own keys (`len`) and the new key,
// taken from the step's input rather than the arena (no block reads what another writes).
// With BAL the grid is one wave of blocks, each taking an equal run of all rows' keys (see
// the kernel). Each warp takes KPW consecutive keys at a time: it issues all their loads before the first
// dot product, so a warp waits for memory once per KPW keys instead of once per key (a
// decode step is latency-bound: a split holds few keys). Lane j holds elements j·E .. j·E +
// E - 1 of a row (E = D / 32), read with one or two vector loads of 4-32 bytes where the host
// found every row aligned for it (`vec`), so a warp reads a key row in one or two loads.
// Each warp keeps an online softmax over its keys; the warps' states are merged and written
// as (acc[D], max, sum) per query head and split. Variants for measuring, off by default
// (rows_attention.cc sets them from KVSTORE_DECODE_ variables): XSUM (a pass's dot products
// summed across the warp together), MINB (blocks an SM must hold: caps the registers), PREF
// (the next pass loaded before this one is used), PACK (16-bit keys and values kept as the
// words read until used, so that a pass of 8 keys fits fewer registers: 128 against 146 at
// head dimension 128 and 4 query heads a kv head; at 4 keys both take 96).
//
// `rows_combine`: grid (q heads, rows), D × MG threads: merges a row's splits into its
// output. Thread (e, g) merges element e of splits g, g + MG, g + 2·MG, ... (two passes: their
// largest max, then the rescaled sums), and the MG groups' states are merged through shared
// memory. One group walked all of a head's splits in turn before session 55: 256 a head at
// 8,192 keys, two dependent walks of L2 loads per layer.
R"KVSRC(
#define WARPS 4
#define ROWS 32
#define NEG_INF (-__int_as_float(0x7f800000))
// keys a warp loads at once: set by the host, rows_attention.cc's keys_per_load
#ifndef KPW
#error "KPW (keys a warp loads at once) is defined by the host"
#endif
// 1: the partial kernel's blocks take equal runs of all rows' keys (see rows_partial)
#ifndef BAL
#define BAL 0
#endif
// blocks of the partial kernel an SM should hold at once (caps its registers; 1: no cap);
// 5 where the blocks are balanced, whose loop over runs would take 125 registers (4 blocks
// an SM) where 96 make do without spilling
#ifndef MINB
#if BAL
#define MINB 5
#else
#define MINB 1
#endif
#endif
#if MINB > 1
#define BOUNDS __launch_bounds__(WARPS * 32, MINB)
#else
#define BOUNDS __launch_bounds__(WARPS * 32)
#endif
// 1: the NREP × KPW dot products of a pass are summed across the warp together (a
// reduce-scatter, then a broadcast: NREP·KPW - 1 + log2(32 / (NREP·KPW)) + NREP·KPW
// shuffles) instead of each by its own butterfly (5 · NREP · KPW); only where NREP · KPW is
// a power of two up to 32
#ifndef XSUM
#define XSUM 0
#endif
#define NDOT (NREP * KPW)
// 1: each warp loads its next pass's keys and values before it computes with this one's
#ifndef PREF
#define PREF 0
#endif
// 1: a warp keeps its pass's keys and values as the 16-bit words it read until it uses them
// (half the registers of floats while they are in flight); the host sets it only for 16-bit
// rows of a multiple of 64 elements
#ifndef PACK
#define PACK 0
#endif
#if XSUM && ((NDOT & (NDOT - 1)) != 0 || NDOT > 32)
#undef XSUM
#define XSUM 0
#endif
// split groups of the merge (D × MG threads a block): set by the host, rows_attention.cc's
// merge_groups, the one place that chooses them
#ifndef MG
#error "MG (the merge's split groups) is defined by the host"
#endif

struct RowKv {
  unsigned long long k, v, pk, pv;
  long long khs, vhs, pkhs, pvhs;
  int len, plen;
};
struct Table {
  RowKv r[ROWS];
};
struct Strides {
  long long qb, qh, kb, kh, vb, vh;
};

__device__ __forceinline__ float bf16_load(const unsigned short* p) {
  return __uint_as_float(((unsigned)*p) << 16);
}
__device__ __forceinline__ void bf16_store(unsigned short* p, float f) {
  unsigned u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    *p = 0x7fc0;
    return;
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  *p = (unsigned short)(u >> 16);
}
__device__ __forceinline__ float f16_load(const unsigned short* p) {
  float f;
  asm("{ cvt.f32.f16 %0, %1; }" : "=f"(f) : "h"(*p));
  return f;
}
__device__ __forceinline__ void f16_store(unsigned short* p, float f) {
  unsigned short h;
  asm("{ cvt.rn.f16.f32 %0, %1; }" : "=h"(h) : "f"(f));
  *p = h;
}
__device__ __forceinline__ float f32_load(const float* p) { return *p; }
__device__ __forceinline__ void f32_store(float* p, float f) { *p = f; }
// A 16-bit element's value from its bits, named after its pointer load (LOAD##_val).
__device__ __forceinline__ float bf16_load_val(unsigned short h) {
  return __uint_as_float(((unsigned)h) << 16);
}
__device__ __forceinline__ float f16_load_val(unsigned short h) {
  float f;
  asm("{ cvt.f32.f16 %0, %1; }" : "=f"(f) : "h"(h));
  return f;
}
#define VAL_OF_(load) load##_val
#define VAL_OF(load) VAL_OF_(load)

// Elements of a row each lane holds.
constexpr int E = D / 32;
struct alignas(16) Bytes16 {
  unsigned a, b, c, d;
};
struct alignas(8) Bytes8 {
  unsigned a, b;
};

// Lane `lane`'s E elements of the row at `p` as floats: elements lane·E .. lane·E + E - 1,
// in one or two vector loads where `vec` (the host checked every row's alignment), else one
// element at a time.
__device__ __forceinline__ void load_row(const T* p, int lane, int vec, float (&x)[E]) {
  const T* at = p + lane * E;
  constexpr int BYTES = E * (int)sizeof(T);
  if (vec) {
    alignas(16) T tmp[E];
    if constexpr (BYTES % 16 == 0) {
#pragma unroll
      for (int j = 0; j < BYTES / 16; ++j) {
        reinterpret_cast<Bytes16*>(tmp)[j] = reinterpret_cast<const Bytes16*>(at)[j];
      }
    } else if constexpr (BYTES == 8) {
      *reinterpret_cast<Bytes8*>(tmp) = *reinterpret_cast<const Bytes8*>(at);
    } else if constexpr (BYTES == 4) {
      *reinterpret_cast<unsigned*>(tmp) = *reinterpret_cast<const unsigned*>(at);
    } else {
#pragma unroll
      for (int i = 0; i < E; ++i) tmp[i] = at[i];
    }
#pragma unroll
    for (int i = 0; i < E; ++i) x[i] = LOAD(&tmp[i]);
  } else {
#pragma unroll
    for (int i = 0; i < E; ++i) x[i] = LOAD(at + i);
  }
}

#if PACK
// Words of a lane's part of a row: two 16-bit elements each.
constexpr int W = E / 2;
static_assert(sizeof(T) == 2 && E % 2 == 0, "PACK takes 16-bit rows of a multiple of 64 elements");

// Lane `lane`'s E elements of the row at `p` as the W words that hold them, in one or two
// vector loads where `vec`, else two elements at a time.
__device__ __forceinline__ void load_words(const T* p, int lane, int vec, unsigned (&w)[W]) {
  const T* at = p + lane * E;
  if (vec) {
    if constexpr (W % 4 == 0) {
#pragma unroll
      for (int j = 0; j < W / 4; ++j) {
        const Bytes16 b = reinterpret_cast<const Bytes16*>(at)[j];
        w[4 * j] = b.a, w[4 * j + 1] = b.b, w[4 * j + 2] = b.c, w[4 * j + 3] = b.d;
      }
    } else if constexpr (W == 2) {
      const Bytes8 b = *reinterpret_cast<const Bytes8*>(at);
      w[0] = b.a, w[1] = b.b;
    } else {
#pragma unroll
      for (int j = 0; j < W; ++j) w[j] = reinterpret_cast<const unsigned*>(at)[j];
    }
  } else {
#pragma unroll
    for (int j = 0; j < W; ++j) w[j] = (unsigned)at[2 * j] | ((unsigned)at[2 * j + 1] << 16);
  }
}

// Element i of a row part held as words.
__device__ __forceinline__ float word_half(const unsigned (&w)[W], int i) {
  return VAL_OF(LOAD)((unsigned short)(i % 2 ? w[i / 2] >> 16 : w[i / 2] & 0xffffu));
}

// A warp's pass: KPW keys and values as the words read, and which keys are in range.
struct Pass {
  unsigned k[KPW][W], v[KPW][W];
  bool ok[KPW];
  __device__ __forceinline__ float key(int u, int i) const { return word_half(k[u], i); }
  __device__ __forceinline__ float val(int u, int i) const { return word_half(v[u], i); }
  __device__ __forceinline__ void read(int u, const T* kp, const T* vp, int lane, int vec) {
    load_words(kp, lane, vec, k[u]);
    load_words(vp, lane, vec, v[u]);
  }
  __device__ __forceinline__ void clear(int u) {
#pragma unroll
    for (int j = 0; j < W; ++j) k[u][j] = v[u][j] = 0u;
  }
};
#else
// A warp's pass: KPW keys and values as floats, and which keys are in range.
struct Pass {
  float k[KPW][E], v[KPW][E];
  bool ok[KPW];
  __device__ __forceinline__ float key(int u, int i) const { return k[u][i]; }
  __device__ __forceinline__ float val(int u, int i) const { return v[u][i]; }
  __device__ __forceinline__ void read(int u, const T* kp, const T* vp, int lane, int vec) {
    load_row(kp, lane, vec, k[u]);
    load_row(vp, lane, vec, v[u]);
  }
  __device__ __forceinline__ void clear(int u) {
#pragma unroll
    for (int i = 0; i < E; ++i) k[u][i] = v[u][i] = 0.f;
  }
};
#endif

// Loads a warp's pass of KPW keys and values starting at key `tb` of the row's whole
// sequence (its shared prefix, its own keys, then the step's new key); keys at `t1` and
// beyond are zeros, marked not `ok`.
__device__ __forceinline__ void load_pass(const RowKv& row, int h, const T* knew, const T* vnew,
                                          int tb, int t1, int lane, int vec, Pass& ps) {
#pragma unroll
  for (int u = 0; u < KPW; ++u) {
    const int t = tb + u;
    ps.ok[u] = t < t1;
    const T* kp;
    const T* vp;
    if (t < row.plen) {
      kp = (const T*)row.pk + h * row.pkhs + (long long)t * D;
      vp = (const T*)row.pv + h * row.pvhs + (long long)t * D;
    } else if (t < row.plen + row.len) {
      const long long w = t - row.plen;
      kp = (const T*)row.k + h * row.khs + w * D;
      vp = (const T*)row.v + h * row.vhs + w * D;
    } else {
      kp = knew;
      vp = vnew;
    }
    if (ps.ok[u]) {
      ps.read(u, kp, vp, lane, vec);
    } else {
      ps.clear(u);
    }
  }
}

// Attends the NREP query heads over a pass of keys: the dot products summed across the
// warp, then each head's online softmax and accumulator updated.
__device__ __forceinline__ void attend_pass(const Pass& ps, const float (&qv)[NREP][E],
                                            float (&acc)[NREP][E], float (&m)[NREP],
                                            float (&l)[NREP], int lane) {
#if XSUM
  // Every lane's part of every dot product of the pass, summed across the warp together:
  // each step halves the values a lane keeps (the upper half where its lane bit is set)
  // and adds its partner's; after log2(NDOT) steps lane j holds value j >> (5 - log2(NDOT))
  // summed over its group, the remaining steps sum that one value over the whole warp, and
  // each value is then read from the first lane that holds it.
  float all[NDOT];
#pragma unroll
  for (int g = 0; g < NREP; ++g) {
#pragma unroll
    for (int u = 0; u < KPW; ++u) {
      float d = 0.f;
#pragma unroll
      for (int i = 0; i < E; ++i) d += qv[g][i] * ps.key(u, i);
      all[g * KPW + u] = d;
    }
  }
  constexpr int LOGN = NDOT >= 32 ? 5 : NDOT >= 16 ? 4 : NDOT >= 8 ? 3 : NDOT >= 4 ? 2 : NDOT >= 2 ? 1 : 0;
#pragma unroll
  for (int k = 0, n = NDOT; k < LOGN; ++k, n >>= 1) {
    const int o = 16 >> k;
    const bool upper = lane & o;
#pragma unroll
    for (int j = 0; j < n / 2; ++j) {
      const float send = upper ? all[j] : all[j + n / 2];
      const float keep = upper ? all[j + n / 2] : all[j];
      all[j] = keep + __shfl_xor_sync(0xffffffffu, send, o);
    }
  }
#pragma unroll
  for (int o = 16 >> LOGN; o > 0; o >>= 1) all[0] += __shfl_xor_sync(0xffffffffu, all[0], o);
  const float mine = all[0];
#pragma unroll
  for (int j = 0; j < NDOT; ++j) all[j] = __shfl_sync(0xffffffffu, mine, j << (5 - LOGN));
#endif
#pragma unroll
  for (int g = 0; g < NREP; ++g) {
    float dot[KPW];
#if XSUM
#pragma unroll
    for (int u = 0; u < KPW; ++u) dot[u] = all[g * KPW + u];
#else
#pragma unroll
    for (int u = 0; u < KPW; ++u) {
      dot[u] = 0.f;
#pragma unroll
      for (int i = 0; i < E; ++i) dot[u] += qv[g][i] * ps.key(u, i);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
      for (int u = 0; u < KPW; ++u) dot[u] += __shfl_xor_sync(0xffffffffu, dot[u], o);
    }
#endif
    // key tb is always in range, so the new maximum is finite and m[g] = -inf scales by 0
    float mn = m[g];
#pragma unroll
    for (int u = 0; u < KPW; ++u) {
      if (ps.ok[u]) mn = fmaxf(mn, dot[u]);
    }
    const float c = __expf(m[g] - mn);
    l[g] *= c;
#pragma unroll
    for (int i = 0; i < E; ++i) acc[g][i] *= c;
#pragma unroll
    for (int u = 0; u < KPW; ++u) {
      if (!ps.ok[u]) continue;
      const float p = __expf(dot[u] - mn);
      l[g] += p;
#pragma unroll
      for (int i = 0; i < E; ++i) acc[g][i] += p * ps.val(u, i);
    }
    m[g] = mn;
  }
}

// The sequence length of table row `row`: its shared prefix, its own keys and the new one.
__device__ __forceinline__ int total_of(const RowKv& row) { return row.plen + row.len + 1; }

// Attends the NREP query heads of kv head h of table row rl (batch row row0 + rl) over keys
// t0 .. t1 of the row's whole sequence and writes their state as split s of each query head.
// The split that starts the row's keys (t0 = 0) first writes the step's new key and value
// into the row's arena. Every thread of the block calls it with the same arguments.
__device__ __forceinline__ void attend_split(
    const T* __restrict__ q, const T* __restrict__ kn, const T* __restrict__ vn,
    float* __restrict__ part, const Table& tab, const Strides& st, int row0, int rl, int h,
    int t0, int t1, int s, int splits, float scale, int hkv, int vec) {
  const int r = row0 + rl;
  const RowKv& row = tab.r[rl];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int hq = hkv * NREP;
  const T* knew = kn + r * st.kb + h * st.kh;
  const T* vnew = vn + r * st.vb + h * st.vh;
  if (t0 == 0) {
    T* kd = (T*)row.k + h * row.khs + (long long)row.len * D;
    T* vd = (T*)row.v + h * row.vhs + (long long)row.len * D;
    for (int e = threadIdx.x; e < D; e += blockDim.x) {
      kd[e] = knew[e];
      vd[e] = vnew[e];
    }
  }

  float qv[NREP][E], acc[NREP][E], m[NREP], l[NREP];
#pragma unroll
  for (int g = 0; g < NREP; ++g) {
    load_row(q + r * st.qb + (h * NREP + g) * st.qh, lane, vec, qv[g]);
#pragma unroll
    for (int i = 0; i < E; ++i) {
      qv[g][i] *= scale;
      acc[g][i] = 0.f;
    }
    m[g] = NEG_INF;
    l[g] = 0.f;
  }
#if PREF
  // The next pass's keys and values are loaded before this pass's are used, so each warp
  // keeps two passes of loads in flight.
  Pass next;
  int tb = t0 + warp * KPW;
  if (tb < t1) load_pass(row, h, knew, vnew, tb, t1, lane, vec, next);
  for (; tb < t1; tb += WARPS * KPW) {
    const Pass cur = next;
    if (tb + WARPS * KPW < t1) load_pass(row, h, knew, vnew, tb + WARPS * KPW, t1, lane, vec, next);
    attend_pass(cur, qv, acc, m, l, lane);
  }
#else
  for (int tb = t0 + warp * KPW; tb < t1; tb += WARPS * KPW) {
    Pass ps;
    load_pass(row, h, knew, vnew, tb, t1, lane, vec, ps);
    attend_pass(ps, qv, acc, m, l, lane);
  }
#endif

  __shared__ float sm[WARPS][NREP][D + 2];
#pragma unroll
  for (int g = 0; g < NREP; ++g) {
#pragma unroll
    for (int i = 0; i < E; ++i) sm[warp][g][lane * E + i] = acc[g][i];
    if (lane == 0) {
      sm[warp][g][D] = m[g];
      sm[warp][g][D + 1] = l[g];
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < NREP * D; idx += blockDim.x) {
    const int g = idx / D, e = idx % D;
    float mx = NEG_INF;
    for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, sm[w][g][D]);
    float a = 0.f, sum = 0.f;
    if (mx != NEG_INF) {
      for (int w = 0; w < WARPS; ++w) {
        const float mw = sm[w][g][D];
        if (mw == NEG_INF) continue;
        const float c = __expf(mw - mx);
        a += sm[w][g][e] * c;
        sum += sm[w][g][D + 1] * c;
      }
    }
    float* out = part + ((long long)(r * hq + h * NREP + g) * splits + s) * (D + 2);
    out[e] = a;
    if (e == 0) {
      out[D] = mx;
      out[D + 1] = sum;
    }
  }
#if BAL
  // the next split this block attends reuses the shared memory
  __syncthreads();
#endif
}

// Grid (splits, kv heads, rows): block (s, h, r) attends keys s·chunk .. (s+1)·chunk of kv
// head h of row r. With BAL (the host's KVSTORE_DECODE_BALANCED=1), grid (blocks): the
// launch's rows × kv heads × keys, laid end to end (row by row, head by head), are cut into
// runs of `per` keys, block b taking run b, so that every block has the same work and the
// host sizes `per` for one wave of the blocks that fit the GPU at once; a run that crosses
// from one (row, head) to the next is attended as a split of each, split b - ⌊start / per⌋
// of the (row, head) whose keys start at `start`.
extern "C" __global__ void BOUNDS rows_partial(
    const T* __restrict__ q, const T* __restrict__ kn, const T* __restrict__ vn,
    float* __restrict__ part, const __grid_constant__ Table tab,
    const __grid_constant__ Strides st, int row0, int splits, int chunk, float scale,
    int hkv, int vec, int per, int nrows) {
#if BAL
  long long all = 0;
  for (int i = 0; i < nrows; ++i) all += (long long)hkv * total_of(tab.r[i]);
  long long f0 = (long long)blockIdx.x * per;
  const long long f1 = min(f0 + per, all);
  // the row where the run starts, and where that row's keys start
  int rl = 0;
  long long off = 0;
  while (rl < nrows && off + (long long)hkv * total_of(tab.r[rl]) <= f0) {
    off += (long long)hkv * total_of(tab.r[rl]);
    ++rl;
  }
  while (f0 < f1) {
    const int tot = total_of(tab.r[rl]);
    const int h = int((f0 - off) / tot);
    const long long hs = off + (long long)h * tot;
    const long long he = hs + tot;
    const int s = int(blockIdx.x - hs / per);
    attend_split(q, kn, vn, part, tab, st, row0, rl, h, int(f0 - hs), int(min(f1, he) - hs), s,
                 splits, scale, hkv, vec);
    f0 = min(f1, he);
    if (f0 == off + (long long)hkv * tot) {
      off = f0;
      ++rl;
    }
  }
#else
  const int s = blockIdx.x, rl = blockIdx.z;
  const int t0 = s * chunk;
  const int t1 = min(t0 + chunk, total_of(tab.r[rl]));
  attend_split(q, kn, vn, part, tab, st, row0, rl, blockIdx.y, t0, t1, s, splits, scale, hkv, vec);
#endif
}

// With BAL the table, `per` and the kv heads come too: a (row, head) has the splits of the
// runs its keys span, fewer than `splits` (the partials' stride).
extern "C" __global__ void rows_combine(const float* __restrict__ part, T* __restrict__ out,
                                        int row0, int splits, int hq
#if BAL
                                        , const __grid_constant__ Table tab, int per, int hkv
#endif
) {
  const int hqi = blockIdx.x, r = row0 + blockIdx.y, e = threadIdx.x, g = threadIdx.y;
  const float* p = part + (long long)(r * hq + hqi) * splits * (D + 2);
  int n = splits;
#if BAL
  {
    long long off = 0;
    for (int i = 0; i < (int)blockIdx.y; ++i) off += (long long)hkv * total_of(tab.r[i]);
    const int tot = total_of(tab.r[blockIdx.y]);
    const long long hs = off + (long long)(hqi / NREP) * tot;
    n = int((hs + tot - 1) / per - hs / per + 1);
  }
#endif
  float mx = NEG_INF;
#pragma unroll 8
  for (int s = g; s < n; s += MG) mx = fmaxf(mx, p[s * (D + 2) + D]);
  float a = 0.f, sum = 0.f;
#pragma unroll 8
  for (int s = g; s < n; s += MG) {
    const float ms = p[s * (D + 2) + D];
    if (ms == NEG_INF) continue;
    const float c = __expf(ms - mx);
    a += p[s * (D + 2) + e] * c;
    sum += p[s * (D + 2) + D + 1] * c;
  }
#if MG > 1
  // The groups' states, merged by group 0: a group whose splits were all empty (or that had
  // none, where splits < MG) has max -inf and adds nothing.
  __shared__ float ga[MG][D];
  __shared__ float gm[MG], gsum[MG];
  ga[g][e] = a;
  if (e == 0) gm[g] = mx, gsum[g] = sum;
  __syncthreads();
  if (g != 0) return;
  mx = NEG_INF;
#pragma unroll
  for (int i = 0; i < MG; ++i) mx = fmaxf(mx, gm[i]);
  a = 0.f, sum = 0.f;
#pragma unroll
  for (int i = 0; i < MG; ++i) {
    if (gm[i] == NEG_INF) continue;
    const float c = __expf(gm[i] - mx);
    a += ga[i][e] * c;
    sum += gsum[i] * c;
  }
#endif
  STORE(out + (long long)(r * hq + hqi) * D + e, a / sum);
}
)KVSRC"
