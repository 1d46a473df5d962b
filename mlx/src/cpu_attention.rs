//! Fused scaled-dot-product attention for f32 on the CPU: flash-attention tiling over host
//! slices, so the scores never leave the cache.
//!
//! MLX's CPU `scaled_dot_product_attention` is its unfused fallback: it writes the whole
//! `[B, Hq, Lq, Lk]` score array, masks it, soft-maxes it and reads it again, with
//! single-threaded element-wise passes (docs/mlx.md, "Attention on the CPU"). MLX has no
//! custom-kernel API on the CPU (`fast::metal_kernel` and `fast::cuda_kernel` are GPU-only),
//! so this runs outside MLX's graph: [`crate::fast::scaled_dot_product_attention`] evaluates
//! q, k and v, hands their buffers here and wraps the result in a new array. (A primitive of
//! the shim's own can run a kernel inside the graph: [`crate::cpu_row_product`] does.)
//!
//! The work is split into units of (batch row, kv head, block of query positions); a unit
//! stacks the query rows of every q head that shares its kv head (grouped-query attention),
//! so each block of keys is read once for all of them. Per unit, keys are visited in
//! blocks with an online softmax in f32 (running max and sum, the accumulated output
//! rescaled when the max grows). The two products of a block, `Q Kᵀ` and `P V`, go
//! through `matrixmultiply`'s packed f32 GEMM; units run on rayon's pool. Only the tiling,
//! the masking and the softmax (with a vectorizable `exp`) are written here.

use rayon::prelude::*;

/// Query positions per unit and q head (a unit holds `group × QUERY_BLOCK` rows). With
/// the key block, measured at SmolLM2's agent-turn shape (9 q / 3 kv heads, d = 64, 500
/// queries over 4,596 keys): 64 × 256 took 8 % less CPU time than 32 × 256; 64 × 128,
/// 128 × 128 and 128 × 256 were within 3 % of it.
const QUERY_BLOCK: usize = 64;
/// Keys per online-softmax step (the scores of a step are `rows × KEY_BLOCK` f32).
const KEY_BLOCK: usize = 256;

/// The shape of one attention call: q `[batch, q_heads, q_len, head_dim]`, k and v
/// `[batch, kv_heads, kv_len, head_dim]`, the output shaped like q.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dims {
    /// Batch rows.
    pub batch: usize,
    /// Query heads (a multiple of `kv_heads`).
    pub q_heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Query positions.
    pub q_len: usize,
    /// Key positions.
    pub kv_len: usize,
    /// Features per head (of q, k and v alike).
    pub head_dim: usize,
}

impl Dims {
    /// Elements of q (and of the output).
    pub fn q_size(&self) -> usize {
        self.batch * self.q_heads * self.q_len * self.head_dim
    }

    /// Elements of k (and of v).
    pub fn kv_size(&self) -> usize {
        self.batch * self.kv_heads * self.kv_len * self.head_dim
    }

    /// Why this shape cannot be computed here, if it cannot.
    pub fn check(&self, causal: bool) -> Result<(), String> {
        if self.batch == 0 || self.q_heads == 0 || self.kv_heads == 0 {
            return Err(format!("empty batch or heads: {self:?}"));
        }
        if self.q_len == 0 || self.kv_len == 0 || self.head_dim == 0 {
            return Err(format!("empty sequence or head dimension: {self:?}"));
        }
        if !self.q_heads.is_multiple_of(self.kv_heads) {
            return Err(format!(
                "{} q heads are not a multiple of {} kv heads",
                self.q_heads, self.kv_heads
            ));
        }
        if causal && self.q_len > self.kv_len {
            return Err(format!(
                "causal attention of {} queries over {} keys leaves the first queries no key",
                self.q_len, self.kv_len
            ));
        }
        Ok(())
    }
}

/// `out = softmax(q kᵀ · scale + mask) v`, the mask causal and bottom-right aligned when
/// `causal` (query i sees keys `0 ..= i + kv_len − q_len`), none otherwise. q head h reads
/// kv head `h / (q_heads / kv_heads)`. Slices are row-major in the shapes of [`Dims`].
///
/// Returns an error (and leaves `out` alone) when a slice length does not match `dims` or
/// [`Dims::check`] refuses the shape.
pub fn attend(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &mut [f32],
    dims: Dims,
    scale: f32,
    causal: bool,
) -> Result<(), String> {
    dims.check(causal)?;
    let part = KvPart {
        k,
        v,
        len: dims.kv_len,
    };
    attend_parts(q, &[part], out, dims, scale, causal)
}

/// The keys and values of one part of a sequence: row-major `[batch, kv_heads, len,
/// head_dim]` each.
#[derive(Clone, Copy, Debug)]
pub struct KvPart<'a> {
    /// Keys.
    pub k: &'a [f32],
    /// Values.
    pub v: &'a [f32],
    /// Key positions in the part.
    pub len: usize,
}

/// [`attend`] over the union of `parts` (in order; one softmax over all their keys), with
/// `dims.kv_len` their total length. The causal mask, when `causal`, applies to the last
/// part only and is bottom-right aligned with it (query i sees every key of the earlier
/// parts and keys `0 ..= i + len − q_len` of the last), so the last part must hold at
/// least `q_len` keys. Parts of 0 keys are skipped.
pub fn attend_parts(
    q: &[f32],
    parts: &[KvPart<'_>],
    out: &mut [f32],
    dims: Dims,
    scale: f32,
    causal: bool,
) -> Result<(), String> {
    dims.check(false)?;
    let total: usize = parts.iter().map(|p| p.len).sum();
    if total != dims.kv_len {
        return Err(format!(
            "parts hold {total} keys, {dims:?} says {}",
            dims.kv_len
        ));
    }
    let last = parts.last().map_or(0, |p| p.len);
    if causal && last < dims.q_len {
        return Err(format!(
            "causal attention of {} queries needs a last part of as many keys, not {last}",
            dims.q_len
        ));
    }
    for (name, len, want) in [
        ("q", q.len(), dims.q_size()),
        ("out", out.len(), dims.q_size()),
    ] {
        if len != want {
            return Err(format!(
                "{name} holds {len} elements, {dims:?} needs {want}"
            ));
        }
    }
    let per_token = dims.batch * dims.kv_heads * dims.head_dim;
    for (i, p) in parts.iter().enumerate() {
        for (name, len) in [("k", p.k.len()), ("v", p.v.len())] {
            if len != p.len * per_token {
                return Err(format!(
                    "{name} holds {len} elements, {dims:?} needs {} (part {i} of {} keys)",
                    p.len * per_token,
                    p.len
                ));
            }
        }
    }
    // Keys transposed per (batch, kv head), `[B, Hkv, D, Lk]`: with them, and the queries
    // and scores kept transposed too, every panel the GEMM packs is a run of contiguous
    // elements (a packed GEMM copies its operands into panels; gathering them with a stride
    // cost as much as the products at d = 64).
    let kts: Vec<Vec<f32>> = parts
        .iter()
        .map(|p| {
            let span = p.len * dims.head_dim;
            let mut kt = vec![0f32; p.k.len()];
            if span > 0 {
                kt.par_chunks_mut(span)
                    .zip(p.k.par_chunks(span))
                    .for_each(|(t, src)| transpose(src, p.len, dims.head_dim, t));
            }
            kt
        })
        .collect();
    let blocks = dims.q_len.div_ceil(QUERY_BLOCK);
    let units: Vec<Unit> = (0..dims.batch)
        .flat_map(|b| (0..dims.kv_heads).map(move |kvh| (b, kvh)))
        .flat_map(|(b, kvh)| {
            (0..blocks).map(move |blk| {
                let start = blk * QUERY_BLOCK;
                Unit {
                    batch: b,
                    kv_head: kvh,
                    start,
                    len: QUERY_BLOCK.min(dims.q_len - start),
                }
            })
        })
        .collect();
    let inputs = Inputs {
        q,
        parts: parts
            .iter()
            .zip(&kts)
            .map(|(p, kt)| PartInput {
                kt,
                v: p.v,
                len: p.len,
            })
            .collect(),
        dims,
        scale,
        causal,
    };
    let results: Vec<Vec<f32>> = units
        .par_iter()
        .map_init(Scratch::default, |scratch, unit| inputs.unit(unit, scratch))
        .collect();
    // Scatter each unit's rows (head-major within the unit) to out[b, h, pos, :].
    let (d, group) = (dims.head_dim, dims.q_heads / dims.kv_heads);
    for (unit, rows) in units.iter().zip(&results) {
        for g in 0..group {
            let h = unit.kv_head * group + g;
            let dst = ((unit.batch * dims.q_heads + h) * dims.q_len + unit.start) * d;
            let src = g * unit.len * d;
            out[dst..dst + unit.len * d].copy_from_slice(&rows[src..src + unit.len * d]);
        }
    }
    Ok(())
}

/// `t[c][r] = src[r][c]` for `src` of `rows × cols`, in tiles that stay in L1.
fn transpose(src: &[f32], rows: usize, cols: usize, t: &mut [f32]) {
    const TILE: usize = 16;
    for r0 in (0..rows).step_by(TILE) {
        for c0 in (0..cols).step_by(TILE) {
            for r in r0..(r0 + TILE).min(rows) {
                for c in c0..(c0 + TILE).min(cols) {
                    t[c * rows + r] = src[r * cols + c];
                }
            }
        }
    }
}

/// One piece of work: query positions `start .. start + len` of every q head that reads
/// kv head `kv_head` of batch row `batch`.
struct Unit {
    batch: usize,
    kv_head: usize,
    start: usize,
    len: usize,
}

/// A thread's buffers, reused across its units.
#[derive(Default)]
struct Scratch {
    /// The unit's query rows, scaled and transposed: `[head_dim, rows]`.
    qt: Vec<f32>,
    /// Scores, then probabilities, of one key block, transposed: `[KEY_BLOCK, rows]`.
    st: Vec<f32>,
    /// Per row: the running max and sum of the online softmax, and the factor that
    /// rescales what was accumulated before the current block.
    max: Vec<f32>,
    sum: Vec<f32>,
    rescale: Vec<f32>,
}

/// One part's keys (transposed, `[B, Hkv, D, len]`) and values.
struct PartInput<'a> {
    kt: &'a [f32],
    v: &'a [f32],
    len: usize,
}

struct Inputs<'a> {
    q: &'a [f32],
    parts: Vec<PartInput<'a>>,
    dims: Dims,
    scale: f32,
    causal: bool,
}

impl Inputs<'_> {
    /// The output rows of one unit, `[group, unit.len, head_dim]`.
    fn unit(&self, unit: &Unit, scratch: &mut Scratch) -> Vec<f32> {
        let Dims {
            q_heads,
            kv_heads,
            q_len,
            head_dim: d,
            ..
        } = self.dims;
        let group = q_heads / kv_heads;
        let rows = group * unit.len;
        // 1. The unit's query rows (head-major) as columns, with the scale folded in.
        scratch.qt.resize(d * rows, 0.0);
        for g in 0..group {
            let h = unit.kv_head * group + g;
            let at = ((unit.batch * q_heads + h) * q_len + unit.start) * d;
            for i in 0..unit.len {
                let r = g * unit.len + i;
                for (c, x) in self.q[at + i * d..at + (i + 1) * d].iter().enumerate() {
                    scratch.qt[c * rows + r] = x * self.scale;
                }
            }
        }
        scratch.st.resize(KEY_BLOCK * rows, 0.0);
        for (buf, init) in [
            (&mut scratch.max, f32::NEG_INFINITY),
            (&mut scratch.sum, 0.0),
            (&mut scratch.rescale, 0.0),
        ] {
            buf.clear();
            buf.resize(rows, init);
        }
        let mut out = vec![0f32; rows * d];
        let softmax = block_kernel();
        let last = self.parts.len().saturating_sub(1);
        for (pi, part) in self.parts.iter().enumerate() {
            let len = part.len;
            if len == 0 {
                continue;
            }
            // The causal mask applies to the last part: query i sees its keys ..= i + shift;
            // the unit's last query bounds the keys read.
            let causal = self.causal && pi == last;
            let shift = len - q_len.min(len);
            let keys = if causal {
                (unit.start + unit.len + shift).min(len)
            } else {
                len
            };
            let kv_at = (unit.batch * kv_heads + unit.kv_head) * len * d;
            let (kt, v) = (
                &part.kt[kv_at..kv_at + len * d],
                &part.v[kv_at..kv_at + len * d],
            );
            for first in (0..keys).step_by(KEY_BLOCK) {
                let n = KEY_BLOCK.min(keys - first);
                let st = &mut scratch.st[..n * rows];
                // 2. Scores of the block, transposed: Sᵀ[n, rows] = K[first..first + n] · Qᵀ.
                gemm(
                    (n, d, rows),
                    (&kt[first..], 1, len),
                    (&scratch.qt, rows, 1),
                    0.0,
                    (st, rows, 1),
                );
                // 3. The causal mask: key `first + j` is hidden from query positions below
                //    `first + j − shift` (only blocks past the unit's first query's last key).
                if causal && first + n > unit.start + shift + 1 {
                    for (j, scores) in st.chunks_exact_mut(rows).enumerate() {
                        let hidden = (first + j).saturating_sub(shift + unit.start).min(unit.len);
                        for g in 0..group {
                            scores[g * unit.len..g * unit.len + hidden].fill(f32::NEG_INFINITY);
                        }
                    }
                }
                // 4. Online softmax, vectorized across the rows.
                softmax(st, &mut scratch.max, &mut scratch.sum, &mut scratch.rescale);
                for (o, &f) in out.chunks_exact_mut(d).zip(&scratch.rescale) {
                    if f != 1.0 {
                        o.iter_mut().for_each(|x| *x *= f);
                    }
                }
                // 5. Accumulate: O[rows, d] += P[rows, n] · V[first..first + n].
                gemm(
                    (rows, n, d),
                    (st, 1, rows),
                    (&v[first * d..(first + n) * d], d, 1),
                    1.0,
                    (&mut out, d, 1),
                );
            }
        }
        // 6. Normalize (every row saw a key of the first non-empty part, so its sum is ≥ its
        //    largest term, 1).
        for (o, sum) in out.chunks_exact_mut(d).zip(&scratch.sum) {
            let inv = 1.0 / sum;
            o.iter_mut().for_each(|x| *x *= inv);
        }
        out
    }
}

/// `c = a · b + beta · c` for `(m, k, n)`, each matrix given as (slice, row stride, column
/// stride). Every index the strides reach is checked against its slice first.
fn gemm(
    (m, k, n): (usize, usize, usize),
    a: (&[f32], usize, usize),
    b: (&[f32], usize, usize),
    beta: f32,
    c: (&mut [f32], usize, usize),
) {
    let last = |rows: usize, cols: usize, rs: usize, cs: usize| {
        (rows.max(1) - 1) * rs + (cols.max(1) - 1) * cs
    };
    assert!(m > 0 && k > 0 && n > 0, "empty product {m}x{k}x{n}");
    assert!(last(m, k, a.1, a.2) < a.0.len(), "A out of bounds");
    assert!(last(k, n, b.1, b.2) < b.0.len(), "B out of bounds");
    assert!(last(m, n, c.1, c.2) < c.0.len(), "C out of bounds");
    // SAFETY: the asserts above keep every element the strides address inside its slice;
    // `c` is a unique borrow, so it aliases neither input.
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            1.0,
            a.0.as_ptr(),
            a.1 as isize,
            a.2 as isize,
            b.0.as_ptr(),
            b.1 as isize,
            b.2 as isize,
            beta,
            c.0.as_mut_ptr(),
            c.1 as isize,
            c.2 as isize,
        );
    }
}

/// One key block's step of the online softmax over transposed scores `st` `[n, rows]`:
/// per row r, `max[r]` grows to the block's largest score, `st[.., r]` becomes
/// `exp(st − max[r])`, `rescale[r] = exp(old max − new max)` and
/// `sum[r] = sum[r] · rescale[r] + Σ st[.., r]`. Hidden scores (−∞) become 0.
type BlockKernel = fn(&mut [f32], &mut [f32], &mut [f32], &mut [f32]);

/// The block kernel for this CPU: the generic code compiled for AVX-512 or AVX2 + FMA when
/// the CPU has them (the crate's baseline target is SSE2), else as is.
fn block_kernel() -> BlockKernel {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        if has!("avx512f") && has!("avx2") && has!("fma") {
            return |st, max, sum, rescale| {
                // SAFETY: the CPU has AVX-512F, AVX2 and FMA (checked just above).
                unsafe { softmax_block_avx512(st, max, sum, rescale) }
            };
        }
        if has!("avx2") && has!("fma") {
            return |st, max, sum, rescale| {
                // SAFETY: the CPU has AVX2 and FMA (checked just above).
                unsafe { softmax_block_avx2(st, max, sum, rescale) }
            };
        }
    }
    softmax_block
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
fn softmax_block_avx512(st: &mut [f32], max: &mut [f32], sum: &mut [f32], rescale: &mut [f32]) {
    softmax_block(st, max, sum, rescale)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn softmax_block_avx2(st: &mut [f32], max: &mut [f32], sum: &mut [f32], rescale: &mut [f32]) {
    softmax_block(st, max, sum, rescale)
}

#[inline(always)]
fn softmax_block(st: &mut [f32], max: &mut [f32], sum: &mut [f32], rescale: &mut [f32]) {
    let rows = max.len();
    // The old max goes to `rescale` until the new one is known.
    rescale.copy_from_slice(max);
    for scores in st.chunks_exact(rows) {
        for (m, &x) in max.iter_mut().zip(scores) {
            *m = if x > *m { x } else { *m };
        }
    }
    for ((f, s), &m) in rescale.iter_mut().zip(sum.iter_mut()).zip(max.iter()) {
        // The first block: nothing accumulated (old max −∞), so the factor is 0.
        *f = exp_nonpositive(*f - m);
        *s *= *f;
    }
    for scores in st.chunks_exact_mut(rows) {
        for ((x, s), &m) in scores.iter_mut().zip(sum.iter_mut()).zip(max.iter()) {
            *x = exp_nonpositive(*x - m);
            *s += *x;
        }
    }
}

/// `e^x` for `x ≤ 0` to about 2 ulp, branch-free so that loops over it vectorize:
/// `x = n ln 2 + r` with `|r| ≤ ln 2 / 2`, `e^r` by its degree-6 Taylor polynomial (truncation error
/// below 1.2e-7 · e^r), `2^n` built in the exponent bits. Arguments below −87 (and −∞) give 0
/// instead of a denormal: a softmax sums them against its maximum, whose term is 1.
#[inline(always)]
pub(crate) fn exp_nonpositive(x: f32) -> f32 {
    // 1.5 · 2^23: adding it rounds to an integer, which then sits in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    let tiny = x < -87.0;
    let x = x.max(-87.0);
    let t = x.mul_add(std::f32::consts::LOG2_E, ROUND);
    let n = t - ROUND;
    let r = n.mul_add(-LN2_LO, n.mul_add(-LN2_HI, x));
    let mut p: f32 = 1.0 / 720.0;
    for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        p = p.mul_add(r, c);
    }
    // n is in −126 ..= 0, so n + 127 is a valid biased exponent.
    let two_n = f32::from_bits(t.to_bits().wrapping_sub(ROUND.to_bits()).wrapping_add(127) << 23);
    if tiny {
        0.0
    } else {
        p * two_n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_nonpositive_matches_std_exp() {
        let mut worst = 0f64;
        for i in 0..=870_000 {
            let x = -(i as f32) * 1e-4;
            let want = (x as f64).exp();
            let got = exp_nonpositive(x) as f64;
            worst = worst.max((got - want).abs() / want);
        }
        assert!(worst < 4e-7, "relative error {worst}");
        assert_eq!(exp_nonpositive(0.0), 1.0);
        assert!(exp_nonpositive(f32::NEG_INFINITY) < 1e-37);
    }

    #[test]
    fn block_kernel_equals_a_plain_online_softmax_step() {
        let (n, rows) = (21, 19);
        let mut st: Vec<f32> = (0..n * rows)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.7)
            .collect();
        st[3 * rows + 4] = f32::NEG_INFINITY;
        let plain = st.clone();
        let old_max: Vec<f32> = (0..rows).map(|r| r as f32 * 0.5 - 4.0).collect();
        let old_sum: Vec<f32> = (0..rows).map(|r| 1.0 + r as f32).collect();
        let (mut max, mut sum, mut rescale) = (old_max.clone(), old_sum.clone(), vec![0.0; rows]);
        block_kernel()(&mut st, &mut max, &mut sum, &mut rescale);
        for r in 0..rows {
            let col = (0..n).map(|j| plain[j * rows + r]);
            let m = col.clone().fold(old_max[r], f32::max);
            assert_eq!(max[r], m, "row {r}");
            let f = ((old_max[r] - m) as f64).exp();
            assert!((rescale[r] as f64 - f).abs() <= 1e-6 * f, "row {r}");
            let mut total = old_sum[r] as f64 * f;
            for (j, x) in col.enumerate() {
                let want = ((x - m) as f64).exp();
                let got = st[j * rows + r] as f64;
                assert!(
                    (got - want).abs() <= 1e-6 * want,
                    "row {r} key {j}: {got} vs {want}"
                );
                total += want;
            }
            assert!((sum[r] as f64 - total).abs() <= 1e-5 * total, "row {r} sum");
        }
        assert_eq!(st[3 * rows + 4], 0.0, "a hidden score weighs 0");
    }
}
