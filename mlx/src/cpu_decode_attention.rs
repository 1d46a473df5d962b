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
        q_heads,
        kv_heads,
        len,
        head_dim: d,
    } = dims;
    if batch == 0 || kv_heads == 0 || len == 0 || d == 0 || !q_heads.is_multiple_of(kv_heads) {
        return Err(format!("attention of shape {dims:?}"));
    }
    let q_len = batch * q_heads * d;
    if q.len() != q_len || out.len() != q_len {
        return Err(format!(
            "{} query and {} output values for {dims:?}",
            q.len(),
            out.len()
        ));
    }
    let reach = |s: ViewStrides| (batch - 1) * s[0] + (kv_heads - 1) * s[1] + (len - 1) * s[2] + d;
    if k.len() < reach(k_strides) || v.len() < reach(v_strides) {
        return Err(format!(
            "keys of {} and values of {} values do not reach {dims:?} through strides {k_strides:?} / {v_strides:?}",
            k.len(),
            v.len()
        ));
    }
    let group = q_heads / kv_heads;
    let chunks = len.div_ceil(CHUNK);
    let kernel = chunk_kernel();
    // Every (batch row, kv head, chunk of keys): its partial softmax per q head of the group.
    let partials: Vec<Partial> = (0..batch * kv_heads * chunks)
        .into_par_iter()
        .map(|unit| {
            let (bh, c) = (unit / chunks, unit % chunks);
            let (b, h) = (bh / kv_heads, bh % kv_heads);
            let (from, to) = (c * CHUNK, ((c + 1) * CHUNK).min(len));
            let qs = &q[(b * q_heads + h * group) * d..(b * q_heads + (h + 1) * group) * d];
            let k0 = b * k_strides[0] + h * k_strides[1];
            let v0 = b * v_strides[0] + h * v_strides[1];
            let mut part = Partial::new(group, d);
            kernel(
                qs,
                Rows {
                    data: k,
                    start: k0 + from * k_strides[2],
                    stride: k_strides[2],
                },
                Rows {
                    data: v,
                    start: v0 + from * v_strides[2],
                    stride: v_strides[2],
                },
                to - from,
                d,
                scale,
                &mut part,
            );
            part
        })
        .collect();
    // Merge the chunks of each (batch row, kv head): weights exp(m_c − m) of the chunks' sums.
    for (bh, parts) in partials.chunks(chunks).enumerate() {
        let (b, h) = (bh / kv_heads, bh % kv_heads);
        for g in 0..group {
            let m = parts
                .iter()
                .map(|p| p.max[g])
                .fold(f32::NEG_INFINITY, f32::max);
            let o = &mut out[(b * q_heads + h * group + g) * d..][..d];
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
