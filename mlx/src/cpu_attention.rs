//! Fused scaled-dot-product attention for f32 on the CPU: flash-attention tiling over host
//! slices, so the scores never leave the cache.
//!
//! MLX's CPU `scaled_dot_product_attention` is its unfused fallback: it writes the whole
//! `[B, Hq, Lq, Lk]` score array, masks it, soft-maxes it and reads it again, with
//! single-threaded element-wise passes (docs/mlx.md, "Attention on the CPU"). MLX has no
//! custom-kernel API on the CPU (`fast::metal_kernel` and `fast::cuda_kernel` are GPU-only),
//! so this runs outside MLX's graph: [`crate::fast::scaled_dot_product_attention`] evaluates
//! q, k and v, hands their buffers here and wraps the result in a new array.
//!
//! The work is split into units of (batch row, kv head, block of query positions); a unit
//! stacks the query rows of every q head that shares its kv head (grouped-query attention),
//! so each block of keys is read once for all of them. Per unit, keys are visited in
//! blocks with an online softmax in f32 (running max and sum, the accumulated output
//! rescaled when the max grows). The two products of a block, `Q Kᵀ` and `P V`, go
//! through `matrixmultiply`'s packed f32 GEMM; units run on rayon's pool. Only the tiling,
//! the masking and the softmax (with a vectorizable `exp`) are written here.

use rayon::prelude::*;

/// Query positions per unit and q head (a unit holds `group × QUERY_BLOCK` rows).
const QUERY_BLOCK: usize = 32;
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
    for (name, len, want) in [
        ("q", q.len(), dims.q_size()),
        ("k", k.len(), dims.kv_size()),
        ("v", v.len(), dims.kv_size()),
        ("out", out.len(), dims.q_size()),
    ] {
        if len != want {
            return Err(format!(
                "{name} holds {len} elements, {dims:?} needs {want}"
            ));
        }
    }
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
        k,
        v,
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
    /// The unit's query rows, scaled: `[rows, head_dim]`.
    q: Vec<f32>,
    /// Scores, then probabilities, of one key block: `[rows, KEY_BLOCK]`.
    s: Vec<f32>,
    /// Running max and sum of each row.
    max: Vec<f32>,
    sum: Vec<f32>,
}

struct Inputs<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
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
            kv_len,
            head_dim: d,
            ..
        } = self.dims;
        let group = q_heads / kv_heads;
        let rows = group * unit.len;
        // 1. Gather the unit's query rows (head-major), with the scale folded in.
        scratch.q.clear();
        for g in 0..group {
            let h = unit.kv_head * group + g;
            let at = ((unit.batch * q_heads + h) * q_len + unit.start) * d;
            scratch
                .q
                .extend(self.q[at..at + unit.len * d].iter().map(|x| x * self.scale));
        }
        scratch.s.resize(rows * KEY_BLOCK, 0.0);
        scratch.max.clear();
        scratch.max.resize(rows, f32::NEG_INFINITY);
        scratch.sum.clear();
        scratch.sum.resize(rows, 0.0);
        let mut out = vec![0f32; rows * d];
        // Keys this unit's last query may see: query i sees keys ..= i + kv_len − q_len.
        let shift = kv_len - q_len.min(kv_len);
        let keys = if self.causal {
            (unit.start + unit.len + shift).min(kv_len)
        } else {
            kv_len
        };
        let kv_at = (unit.batch * kv_heads + unit.kv_head) * kv_len * d;
        let (k, v) = (
            &self.k[kv_at..kv_at + kv_len * d],
            &self.v[kv_at..kv_at + kv_len * d],
        );
        let exp_row = row_kernel();
        for first in (0..keys).step_by(KEY_BLOCK) {
            let n = KEY_BLOCK.min(keys - first);
            // 2. Scores of the block: S[rows, n] = Q[rows, d] · K[first..first + n]ᵀ.
            gemm(
                (rows, d, n),
                (&scratch.q, d, 1),
                (&k[first * d..(first + n) * d], 1, d),
                0.0,
                (&mut scratch.s, KEY_BLOCK, 1),
            );
            // 3. Online softmax per row, over the keys the row may see.
            for r in 0..rows {
                let pos = unit.start + r % unit.len;
                let visible = if self.causal {
                    (pos + shift + 1).saturating_sub(first).min(n)
                } else {
                    n
                };
                let s = &mut scratch.s[r * KEY_BLOCK..r * KEY_BLOCK + n];
                let o = &mut out[r * d..(r + 1) * d];
                if visible == 0 {
                    s.fill(0.0);
                    continue;
                }
                let old = scratch.max[r];
                let (new, block_sum) = exp_row(s, visible, old);
                s[visible..].fill(0.0);
                // exp(−∞) = 0 on the first block: nothing accumulated yet to rescale.
                let rescale = (old - new).exp();
                if rescale != 1.0 {
                    o.iter_mut().for_each(|x| *x *= rescale);
                }
                scratch.sum[r] = scratch.sum[r] * rescale + block_sum;
                scratch.max[r] = new;
            }
            // 4. Accumulate: O[rows, d] += P[rows, n] · V[first..first + n].
            gemm(
                (rows, n, d),
                (&scratch.s, KEY_BLOCK, 1),
                (&v[first * d..(first + n) * d], d, 1),
                1.0,
                (&mut out, d, 1),
            );
        }
        // 5. Normalize (every row saw at least key 0, so its sum is ≥ 1).
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

/// One row's step of the online softmax: `s[..visible] = exp(s − new_max)`, returning
/// `(new_max, Σ s[..visible])` where `new_max = max(running_max, s[..visible])`.
type RowKernel = fn(&mut [f32], usize, f32) -> (f32, f32);

/// The row kernel for this CPU: the generic code compiled for AVX2 + FMA when the CPU has
/// them (the crate's baseline target is SSE2), else as is.
fn row_kernel() -> RowKernel {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            return |s, visible, max| {
                // SAFETY: the CPU has AVX2 and FMA (checked just above).
                unsafe { exp_row_avx2(s, visible, max) }
            };
        }
    }
    exp_row
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn exp_row_avx2(s: &mut [f32], visible: usize, running_max: f32) -> (f32, f32) {
    exp_row(s, visible, running_max)
}

/// Lanes of the max and sum accumulators: independent chains the compiler keeps in vector
/// registers (a single f32 accumulator would force in-order scalar adds).
const LANES: usize = 16;

#[inline(always)]
fn exp_row(s: &mut [f32], visible: usize, running_max: f32) -> (f32, f32) {
    let s = &mut s[..visible];
    let mut lanes = [running_max; LANES];
    let mut chunks = s.chunks_exact(LANES);
    for c in &mut chunks {
        for (m, &x) in lanes.iter_mut().zip(c) {
            *m = if x > *m { x } else { *m };
        }
    }
    let mut max = chunks
        .remainder()
        .iter()
        .fold(running_max, |m, &x| m.max(x));
    max = lanes.iter().fold(max, |m, &x| m.max(x));
    let mut sums = [0f32; LANES];
    let mut chunks = s.chunks_exact_mut(LANES);
    for c in &mut chunks {
        for (acc, x) in sums.iter_mut().zip(c) {
            *x = exp_nonpositive(*x - max);
            *acc += *x;
        }
    }
    let mut sum = 0f32;
    for x in chunks.into_remainder() {
        *x = exp_nonpositive(*x - max);
        sum += *x;
    }
    (max, sum + sums.iter().sum::<f32>())
}

/// `e^x` for `x ≤ 0` to about 2 ulp, branch-free so that loops over it vectorize:
/// `x = n ln 2 + r` with `|r| ≤ ln 2 / 2`, `e^r` by its degree-6 Taylor polynomial (truncation error
/// below 1.2e-7 · e^r), `2^n` built in the exponent bits. Arguments below −87 give
/// `e^−87 ≈ 1.6e-38` instead of a denormal or 0; a softmax sums them against its maximum,
/// whose term is 1.
#[inline(always)]
fn exp_nonpositive(x: f32) -> f32 {
    // 1.5 · 2^23: adding it rounds to an integer, which then sits in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
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
    p * two_n
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
    fn row_kernel_equals_plain_softmax_step() {
        let mut s: Vec<f32> = (0..77)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.7)
            .collect();
        let plain = s.clone();
        let (max, sum) = row_kernel()(&mut s, 70, 2.0);
        let want_max = plain[..70].iter().fold(2.0f32, |m, &x| m.max(x));
        assert_eq!(max, want_max);
        let want: Vec<f64> = plain[..70]
            .iter()
            .map(|&x| ((x - want_max) as f64).exp())
            .collect();
        for (g, w) in s[..70].iter().zip(&want) {
            assert!((*g as f64 - w).abs() <= 1e-6 * w.max(1e-30), "{g} vs {w}");
        }
        let want_sum: f64 = want.iter().sum();
        assert!((sum as f64 - want_sum).abs() < 1e-5 * want_sum);
        assert_eq!(&s[70..], &plain[70..], "keys past `visible` are left alone");
    }
}
