//! One query per head attending over f32 keys and values read in place (a decode step's
//! attention) on the CPU: `out = softmax(q kᵀ · scale) v`, grouped-query.
//!
//! A decode step reads every cached key and value once for a few flops each, so its speed
//! is the memory reads'. The keys and values are views of a sequence's arena (a slice of
//! its capacity, so their heads are not adjacent); MLX's CPU path for them (a product per
//! kv head, a softmax, a product with the values: [`crate::fast`]) runs on one thread
//! (docs/mlx.md, "Attention on the CPU"). Here the keys of each (batch row,
//! kv head) are split into chunks spread over rayon's threads; a chunk reads each key and
//! value row once for all the q heads that share it, keeps a running maximum, sum and
//! weighted sum of values per q head (online softmax), and the chunks of a head are merged
//! at the end. It runs inside MLX's graph as the shim's `OneQueryAttention` node.

use rayon::prelude::*;

use crate::cpu_attention::exp_nonpositive;

/// Keys a chunk takes (a few hundred KB of keys and values at head dimension 64-128).
const CHUNK: usize = 256;

/// Where a view's element `[b, h, s, 0]` is: `b · strides[0] + h · strides[1] + s ·
/// strides[2]` elements from the start of its slice; the last axis is contiguous.
pub type ViewStrides = [usize; 3];

/// The shape of one call: q `[batch, q_heads, 1, head_dim]` (row-major), keys and values
/// `[batch, kv_heads, len, head_dim]` views, out shaped like q.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OneQueryDims {
    /// Batch rows.
    pub batch: usize,
    /// Query heads (a multiple of `kv_heads`).
    pub q_heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Key positions.
    pub len: usize,
    /// Features per head.
    pub head_dim: usize,
}

/// For every batch row and q head, `softmax(q · kᵀ · scale) · v` over the `len` keys of its
/// kv head (q head `h` reads kv head `h / (q_heads / kv_heads)`), into `out`.
/// `k` and `v` are read through their strides (any view whose last axis is contiguous);
/// `q` and `out` are row-major.
#[allow(clippy::too_many_arguments)]
pub fn attend_one_query(
    q: &[f32],
    k: &[f32],
    k_strides: ViewStrides,
    v: &[f32],
    v_strides: ViewStrides,
    dims: OneQueryDims,
    scale: f32,
    out: &mut [f32],
) -> Result<(), String> {
    let OneQueryDims {
        batch,
        kv_heads,
        len,
        head_dim: d,
        ..
    } = dims;
    if batch == 0 || kv_heads == 0 || len == 0 || d == 0 {
        return Err(format!("attention of shape {dims:?}"));
    }
    let reach = |s: ViewStrides| (batch - 1) * s[0] + (kv_heads - 1) * s[1] + (len - 1) * s[2] + d;
    if k.len() < reach(k_strides) || v.len() < reach(v_strides) {
        return Err(format!(
            "keys of {} and values of {} values do not reach {dims:?} through strides {k_strides:?} / {v_strides:?}",
            k.len(),
            v.len()
        ));
    }
    // Each batch row is one part of its own slice of the views.
    let rows: Vec<[KvPart<'_>; 1]> = (0..batch)
        .map(|b| {
            [KvPart {
                k: &k[b * k_strides[0]..],
                k_strides: [k_strides[1], k_strides[2]],
                v: &v[b * v_strides[0]..],
                v_strides: [v_strides[1], v_strides[2]],
                len,
            }]
        })
        .collect();
    let rows: Vec<&[KvPart<'_>]> = rows.iter().map(|r| &r[..]).collect();
    attend_parts(q, &rows, dims.q_heads, kv_heads, d, scale, out)
}

/// A stretch of keys and values one row attends: `len` positions of each kv head, kv head
/// `h`'s position `s` at `h · strides[0] + s · strides[1]` in `k` / `v` (the last axis
/// contiguous): a shared prefix's view, or the row's own tokens in its arena.
#[derive(Clone, Copy, Debug)]
pub struct KvPart<'a> {
    /// The keys, from the part's first element.
    pub k: &'a [f32],
    /// Elements between kv heads and between positions of `k`.
    pub k_strides: [usize; 2],
    /// The values, from the part's first element.
    pub v: &'a [f32],
    /// Elements between kv heads and between positions of `v`.
    pub v_strides: [usize; 2],
    /// Positions (0: the part adds nothing).
    pub len: usize,
}

/// For every row `r` (`rows[r]`: its parts, attended as one sequence) and q head,
/// `softmax(q · kᵀ · scale) · v` over the keys of all its parts, into `out`; `q` and `out`
/// are row-major `[rows, q_heads, head_dim]`. The keys of each (row, kv head, part) are
/// split into chunks over rayon's threads, each chunk's online softmax merged at the end:
/// the parts of a row are one softmax, as if concatenated.
pub fn attend_parts(
    q: &[f32],
    rows: &[&[KvPart<'_>]],
    q_heads: usize,
    kv_heads: usize,
    d: usize,
    scale: f32,
    out: &mut [f32],
) -> Result<(), String> {
    let batch = rows.len();
    if batch == 0 || kv_heads == 0 || d == 0 || !q_heads.is_multiple_of(kv_heads) {
        return Err(format!(
            "attention of {batch} rows, {q_heads} q heads over {kv_heads} kv heads of {d}"
        ));
    }
    let q_len = batch * q_heads * d;
    if q.len() != q_len || out.len() != q_len {
        return Err(format!(
            "{} query and {} output values for {batch} rows of {q_heads} heads of {d}",
            q.len(),
            out.len()
        ));
    }
    for (r, parts) in rows.iter().enumerate() {
        if parts.iter().all(|p| p.len == 0) {
            return Err(format!("row {r} has no key to attend"));
        }
        for p in parts.iter().filter(|p| p.len > 0) {
            let reach = |s: [usize; 2]| (kv_heads - 1) * s[0] + (p.len - 1) * s[1] + d;
            if p.k.len() < reach(p.k_strides) || p.v.len() < reach(p.v_strides) {
                return Err(format!(
                    "row {r}: a part of {} positions with keys of {} and values of {} values \
                     through strides {:?} / {:?}",
                    p.len,
                    p.k.len(),
                    p.v.len(),
                    p.k_strides,
                    p.v_strides
                ));
            }
        }
    }
    let group = q_heads / kv_heads;
    // Every (row, kv head, part, chunk of keys), in that order; `spans[r · kv_heads + h]`
    // is where (row r, kv head h)'s units end.
    let mut units = Vec::new();
    let mut spans = Vec::with_capacity(batch * kv_heads);
    for (r, parts) in rows.iter().enumerate() {
        for h in 0..kv_heads {
            for (i, p) in parts.iter().enumerate() {
                for from in (0..p.len).step_by(CHUNK) {
                    units.push((r, h, i, from, (from + CHUNK).min(p.len)));
                }
            }
            spans.push(units.len());
        }
    }
    let kernel = chunk_kernel();
    let partials: Vec<Partial> = units
        .par_iter()
        .map(|&(r, h, i, from, to)| {
            let p = &rows[r][i];
            let qs = &q[(r * q_heads + h * group) * d..(r * q_heads + (h + 1) * group) * d];
            let mut part = Partial::new(group, d);
            kernel(
                qs,
                Rows {
                    data: p.k,
                    start: h * p.k_strides[0] + from * p.k_strides[1],
                    stride: p.k_strides[1],
                },
                Rows {
                    data: p.v,
                    start: h * p.v_strides[0] + from * p.v_strides[1],
                    stride: p.v_strides[1],
                },
                to - from,
                d,
                scale,
                &mut part,
            );
            part
        })
        .collect();
    // Merge the chunks of each (row, kv head): weights exp(m_c − m) of the chunks' sums.
    let mut begin = 0;
    for (rh, &end) in spans.iter().enumerate() {
        let (r, h) = (rh / kv_heads, rh % kv_heads);
        let parts = &partials[begin..end];
        begin = end;
        for g in 0..group {
            let m = parts
                .iter()
                .map(|p| p.max[g])
                .fold(f32::NEG_INFINITY, f32::max);
            let o = &mut out[(r * q_heads + h * group + g) * d..][..d];
            o.fill(0.0);
            let mut sum = 0f32;
            for p in parts {
                let w = exp_nonpositive(p.max[g] - m);
                sum += w * p.sum[g];
                for (o, a) in o.iter_mut().zip(&p.acc[g * d..(g + 1) * d]) {
                    *o += w * a;
                }
            }
            let inv = 1.0 / sum;
            for o in o.iter_mut() {
                *o *= inv;
            }
        }
    }
    Ok(())
}

/// Rows of `head_dim` values from `start`, `stride` values apart.
#[derive(Clone, Copy)]
struct Rows<'a> {
    data: &'a [f32],
    start: usize,
    stride: usize,
}

impl Rows<'_> {
    #[inline(always)]
    fn row(&self, j: usize, d: usize) -> &[f32] {
        &self.data[self.start + j * self.stride..][..d]
    }
}

/// A chunk's online softmax per q head: the largest score, the sum of `exp(score − max)`
/// and the values weighted by it (`group × head_dim`).
struct Partial {
    max: Vec<f32>,
    sum: Vec<f32>,
    acc: Vec<f32>,
}

impl Partial {
    fn new(group: usize, d: usize) -> Self {
        Partial {
            max: vec![f32::NEG_INFINITY; group],
            sum: vec![0.0; group],
            acc: vec![0.0; group * d],
        }
    }
}

type ChunkKernel = fn(&[f32], Rows<'_>, Rows<'_>, usize, usize, f32, &mut Partial);

/// The chunk kernel for this CPU: the generic code compiled for AVX-512 or AVX2 + FMA when
/// the CPU has them (the crate's baseline target is SSE2), else as is.
fn chunk_kernel() -> ChunkKernel {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        if has!("avx512f") && has!("avx2") && has!("fma") {
            // SAFETY (both): the CPU has the features the function is compiled for.
            return |q, k, v, n, d, s, p| unsafe { chunk_avx512(q, k, v, n, d, s, p) };
        }
        if has!("avx2") && has!("fma") {
            return |q, k, v, n, d, s, p| unsafe { chunk_avx2(q, k, v, n, d, s, p) };
        }
    }
    chunk
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
fn chunk_avx512(q: &[f32], k: Rows<'_>, v: Rows<'_>, n: usize, d: usize, s: f32, p: &mut Partial) {
    chunk(q, k, v, n, d, s, p)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn chunk_avx2(q: &[f32], k: Rows<'_>, v: Rows<'_>, n: usize, d: usize, s: f32, p: &mut Partial) {
    chunk(q, k, v, n, d, s, p)
}

/// One chunk of `n` keys for the `q.len() / d` q heads of one kv head: the scores of every
/// key first (each key row read once for all heads), then their exponentials and the
/// weighted sum of the value rows (each read once).
#[inline(always)]
fn chunk(q: &[f32], k: Rows<'_>, v: Rows<'_>, n: usize, d: usize, scale: f32, p: &mut Partial) {
    let group = q.len() / d;
    let mut scores = vec![0f32; group * n];
    for j in 0..n {
        let kr = k.row(j, d);
        for (g, qg) in q.chunks_exact(d).enumerate() {
            scores[g * n + j] = dot(qg, kr) * scale;
        }
    }
    for g in 0..group {
        let s = &mut scores[g * n..(g + 1) * n];
        let m = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0f32;
        for x in s.iter_mut() {
            *x = exp_nonpositive(*x - m);
            sum += *x;
        }
        p.max[g] = m;
        p.sum[g] = sum;
    }
    for j in 0..n {
        let vr = v.row(j, d);
        for g in 0..group {
            let w = scores[g * n + j];
            for (a, x) in p.acc[g * d..(g + 1) * d].iter_mut().zip(vr) {
                *a += w * x;
            }
        }
    }
}

/// `a · b` in eight interleaved partial sums (vectorized by the compiler).
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ac
        .remainder()
        .iter()
        .zip(bc.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ac.zip(bc) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(len: usize, seed: usize) -> Vec<f32> {
        (0..len)
            .map(|i| (((i + seed) * 7919) % 2003) as f32 / 1001.0 - 1.0)
            .collect()
    }

    /// softmax(q kᵀ · scale) v in f64 for row-major `[b, h, s, d]` keys and values.
    fn naive(q: &[f32], k: &[f32], v: &[f32], dims: OneQueryDims, scale: f32) -> Vec<f64> {
        let (batch, q_heads, kv_heads) = (dims.batch, dims.q_heads, dims.kv_heads);
        let (len, d) = (dims.len, dims.head_dim);
        let group = q_heads / kv_heads;
        let mut out = vec![0f64; batch * q_heads * d];
        for b in 0..batch {
            for hq in 0..q_heads {
                let h = hq / group;
                let qv = &q[(b * q_heads + hq) * d..][..d];
                let kv = |j: usize| ((b * kv_heads + h) * len + j) * d;
                let s: Vec<f64> = (0..len)
                    .map(|j| {
                        (0..d)
                            .map(|i| qv[i] as f64 * k[kv(j) + i] as f64)
                            .sum::<f64>()
                            * scale as f64
                    })
                    .collect();
                let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for i in 0..d {
                    out[(b * q_heads + hq) * d + i] =
                        (0..len).map(|j| e[j] * v[kv(j) + i] as f64).sum::<f64>() / z;
                }
            }
        }
        out
    }

    #[test]
    fn matches_a_naive_attention_in_place_and_through_a_wider_arena() {
        for (batch, q_heads, kv_heads, len, d) in [
            (1, 9, 3, 600, 64),
            (2, 4, 4, 1, 8),
            (1, 8, 2, 257, 37),
            (3, 2, 1, 40, 16),
        ] {
            let dims = OneQueryDims {
                batch,
                q_heads,
                kv_heads,
                len,
                head_dim: d,
            };
            let q = values(batch * q_heads * d, 3);
            let k = values(batch * kv_heads * len * d, 5);
            let v = values(batch * kv_heads * len * d, 7);
            let scale = 1.0 / (d as f32).sqrt() * 3.0;
            let want = naive(&q, &k, &v, dims, scale);
            let check = |got: &[f32], what: &str| {
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (*g as f64 - w).abs() < 2e-5,
                        "{what} {dims:?} value {i}: {g} vs {w}"
                    );
                }
            };
            let row = [kv_heads * len * d, len * d, d];
            let mut out = vec![f32::NAN; q.len()];
            attend_one_query(&q, &k, row, &v, row, dims, scale, &mut out).unwrap();
            check(&out, "row-major");
            // The same keys and values as the first `len` positions of arenas of capacity
            // len + 5 (a view whose heads are not adjacent).
            let cap = len + 5;
            let widen = |x: &[f32]| {
                let mut w = vec![f32::NAN; batch * kv_heads * cap * d];
                for bh in 0..batch * kv_heads {
                    w[bh * cap * d..][..len * d].copy_from_slice(&x[bh * len * d..][..len * d]);
                }
                w
            };
            let (kw, vw) = (widen(&k), widen(&v));
            let arena = [kv_heads * cap * d, cap * d, d];
            attend_one_query(&q, &kw, arena, &vw, arena, dims, scale, &mut out).unwrap();
            check(&out, "arena view");
        }
    }

    /// A row's keys split in two parts (a prefix view and its own arena, each with other
    /// strides), a part of nothing and rows of different lengths: the same as one softmax over
    /// each row's keys together (the naive attention of the concatenation).
    #[test]
    fn parts_of_a_row_are_one_softmax() {
        let (q_heads, kv_heads, d) = (6, 2, 16);
        let scale = 0.4;
        // Row 0: 300 prefix positions + 45 own; row 1: 0 + 7; row 2: 1 + 0.
        let splits = [(300usize, 45usize), (0, 7), (1, 0)];
        let mut rows_parts = Vec::new();
        let mut out = vec![f32::NAN; splits.len() * q_heads * d];
        let q = values(out.len(), 11);
        let mut want = Vec::new();
        // Per row: prefix keys, prefix values, own key arena, own value arena.
        type Stores = Vec<[Vec<f32>; 4]>;
        let stores: Stores = splits
            .iter()
            .enumerate()
            .map(|(r, &(pl, ol))| {
                // The prefix row-major [kv_heads, pl, d]; the own part in an arena of
                // capacity ol + 3, heads `(ol + 3) · d` apart.
                let pk = values(kv_heads * pl * d, 100 + r);
                let pv = values(kv_heads * pl * d, 200 + r);
                let cap = ol + 3;
                let mut ok = vec![f32::NAN; kv_heads * cap * d];
                let mut ov = vec![f32::NAN; kv_heads * cap * d];
                let (k_own, v_own) = (
                    values(kv_heads * ol * d, 300 + r),
                    values(kv_heads * ol * d, 400 + r),
                );
                for h in 0..kv_heads {
                    ok[h * cap * d..][..ol * d].copy_from_slice(&k_own[h * ol * d..][..ol * d]);
                    ov[h * cap * d..][..ol * d].copy_from_slice(&v_own[h * ol * d..][..ol * d]);
                }
                // The reference: both parts concatenated per head, row-major.
                let t = pl + ol;
                let (mut k, mut v) = (Vec::new(), Vec::new());
                for h in 0..kv_heads {
                    k.extend_from_slice(&pk[h * pl * d..][..pl * d]);
                    k.extend_from_slice(&k_own[h * ol * d..][..ol * d]);
                    v.extend_from_slice(&pv[h * pl * d..][..pl * d]);
                    v.extend_from_slice(&v_own[h * ol * d..][..ol * d]);
                }
                let dims = OneQueryDims {
                    batch: 1,
                    q_heads,
                    kv_heads,
                    len: t,
                    head_dim: d,
                };
                want.extend(naive(
                    &q[r * q_heads * d..][..q_heads * d],
                    &k,
                    &v,
                    dims,
                    scale,
                ));
                [pk, pv, ok, ov]
            })
            .collect();
        for ([pk, pv, ok, ov], &(pl, ol)) in stores.iter().zip(&splits) {
            let cap = ol + 3;
            rows_parts.push([
                KvPart {
                    k: pk,
                    k_strides: [pl * d, d],
                    v: pv,
                    v_strides: [pl * d, d],
                    len: pl,
                },
                KvPart {
                    k: ok,
                    k_strides: [cap * d, d],
                    v: ov,
                    v_strides: [cap * d, d],
                    len: ol,
                },
            ]);
        }
        let rows: Vec<&[KvPart<'_>]> = rows_parts.iter().map(|r| &r[..]).collect();
        attend_parts(&q, &rows, q_heads, kv_heads, d, scale, &mut out).unwrap();
        for (i, (g, w)) in out.iter().zip(&want).enumerate() {
            assert!((*g as f64 - w).abs() < 2e-5, "value {i}: {g} vs {w}");
        }
        // A row with no key at all is refused.
        let empty = [KvPart {
            len: 0,
            ..rows_parts[0][0]
        }];
        let rows: Vec<&[KvPart<'_>]> = vec![&empty];
        let mut one = vec![0f32; q_heads * d];
        assert!(attend_parts(
            &q[..q_heads * d],
            &rows,
            q_heads,
            kv_heads,
            d,
            1.0,
            &mut one
        )
        .is_err());
    }

    #[test]
    fn refuses_shapes_and_views_that_do_not_fit() {
        let dims = OneQueryDims {
            batch: 1,
            q_heads: 2,
            kv_heads: 1,
            len: 4,
            head_dim: 2,
        };
        let row = [8, 8, 2];
        let mut out = [0f32; 4];
        attend_one_query(
            &[0.0; 4], &[0.0; 8], row, &[0.0; 8], row, dims, 1.0, &mut out,
        )
        .unwrap();
        assert!(
            attend_one_query(&[0.0; 3], &[0.0; 8], row, &[0.0; 8], row, dims, 1.0, &mut out)
                .is_err()
        );
        assert!(
            attend_one_query(&[0.0; 4], &[0.0; 7], row, &[0.0; 8], row, dims, 1.0, &mut out)
                .is_err()
        );
        let odd = OneQueryDims {
            q_heads: 3,
            kv_heads: 2,
            ..dims
        };
        assert!(attend_one_query(
            &[0.0; 6],
            &[0.0; 8],
            row,
            &[0.0; 8],
            row,
            odd,
            1.0,
            &mut [0.0; 6]
        )
        .is_err());
    }
}
