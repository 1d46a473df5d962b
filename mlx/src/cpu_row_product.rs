//! A few f32 rows times a transposed weight matrix on the CPU, `out = x · wᵀ` with `w`
//! `[n, k]` as checkpoints store it: a decode step's linear layers and LM head.
//!
//! With one to a few rows the product reads every weight once and does two flops per
//! weight, so its speed is the memory bandwidth the reads reach. MLX's CPU matmul hands it
//! to BLAS as a GEMM with `M = 1`, which OpenBLAS runs on one thread: 12-13 GB/s on cpu-vm
//! against 19 GB/s for a two-thread GEMV over the same weights (docs/mlx.md, "A decode
//! step's products on the CPU"). This kernel splits the output features over rayon's
//! threads, each streaming its weight rows once for all input rows. It runs inside MLX's
//! graph as a primitive of the C++ shim (`RowsTimesWeightT`) on MLX's CPU stream, so a
//! decode step stays one lazily evaluated graph.

use rayon::prelude::*;

/// The most rows the kernel takes; more rows go to MLX's matmul (BLAS), where a GEMM's
/// reuse of each weight across rows pays.
pub const MAX_ROWS: usize = 8;

/// Weight bytes a task streams (a few hundred KB: enough tasks for every thread, few
/// enough that handing them out costs nothing next to the reads).
const TASK_BYTES: usize = 256 << 10;

/// `out[r · n + o] = Σᵢ x[r · k + i] · w[o · k + i]` for `rows` rows of `x` (`[rows, k]`) and
/// `n = w.len() / k` output features; `out` is `[rows, n]`. The sum runs in 8 or 16
/// interleaved partial sums, added at the end (a different order than BLAS: results agree
/// to float rounding, not bit for bit).
pub fn rows_times_weight_t(
    x: &[f32],
    w: &[f32],
    rows: usize,
    k: usize,
    out: &mut [f32],
) -> Result<(), String> {
    if rows == 0 || rows > MAX_ROWS || k == 0 || !w.len().is_multiple_of(k) {
        return Err(format!(
            "{rows} rows (at most {MAX_ROWS}) of {k} values times a weight of {} values",
            w.len()
        ));
    }
    let n = w.len() / k;
    if x.len() != rows * k || out.len() != rows * n {
        return Err(format!(
            "rows of {} values and an output of {} values for {rows} rows of {k} times {n} features",
            x.len(),
            out.len()
        ));
    }
    let per_task = (TASK_BYTES / (4 * k)).max(1);
    let kernel = dot_kernel(rows);
    // Each task fills its features for every row, feature-major: with one row that is
    // `out`'s own layout; with several the result is transposed into `out` at the end
    // (rows · n values, next to nothing).
    let mut scratch = Vec::new();
    let by_feature: &mut [f32] = if rows == 1 {
        out
    } else {
        scratch.resize(n * rows, 0f32);
        &mut scratch
    };
    by_feature
        .par_chunks_mut(per_task * rows)
        .zip(w.par_chunks(per_task * k))
        .for_each(|(o, w)| {
            for (o, w) in o.chunks_exact_mut(rows).zip(w.chunks_exact(k)) {
                kernel(x, w, k, o);
            }
        });
    for (f, values) in scratch.chunks_exact(rows).enumerate() {
        for (r, &v) in values.iter().enumerate() {
            out[r * n + f] = v;
        }
    }
    Ok(())
}

/// Dot products of one weight row `w` (`k` values) with each row of `x`, into `out`
/// (one value a row).
type DotKernel = fn(&[f32], &[f32], usize, &mut [f32]);

/// The dot kernel for `rows` rows for this CPU: AVX2 + FMA registers when the CPU has them
/// (the crate's baseline target is SSE2; AVX-512 would not read memory faster), else the
/// portable code.
fn dot_kernel(rows: usize) -> DotKernel {
    macro_rules! by_rows {
        ($f:ident) => {
            match rows {
                1 => |x, w, k, o| $f::<1, 2>(x, w, k, o),
                2 => |x, w, k, o| $f::<2, 2>(x, w, k, o),
                3 => |x, w, k, o| $f::<3, 2>(x, w, k, o),
                4 => |x, w, k, o| $f::<4, 1>(x, w, k, o),
                5 => |x, w, k, o| $f::<5, 1>(x, w, k, o),
                6 => |x, w, k, o| $f::<6, 1>(x, w, k, o),
                7 => |x, w, k, o| $f::<7, 1>(x, w, k, o),
                _ => |x, w, k, o| $f::<8, 1>(x, w, k, o),
            }
        };
    }
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        if has!("avx2") && has!("fma") {
            return by_rows!(dots_avx2);
        }
    }
    by_rows!(dots)
}

#[cfg(target_arch = "x86_64")]
fn dots_avx2<const R: usize, const V: usize>(x: &[f32], w: &[f32], k: usize, out: &mut [f32]) {
    assert!(
        x.len() >= R * k && w.len() >= k && out.len() >= R,
        "dot kernel bounds"
    );
    // SAFETY: chosen only when the CPU has AVX2 and FMA (`dot_kernel`); bounds asserted.
    unsafe { dots_avx2_inner::<R, V>(x, w, k, out) }
}

/// [`dots`] with AVX2 + FMA registers: `V` vectors of 8 values a row and step.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dots_avx2_inner<const R: usize, const V: usize>(
    x: &[f32],
    w: &[f32],
    k: usize,
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    let step = 8 * V;
    let whole = k - k % step;
    let (xp, wp) = (x.as_ptr(), w.as_ptr());
    let mut acc = [[_mm256_setzero_ps(); V]; R];
    let mut i = 0;
    while i < whole {
        let mut wv = [_mm256_setzero_ps(); V];
        for (v, wv) in wv.iter_mut().enumerate() {
            *wv = _mm256_loadu_ps(wp.add(i + 8 * v));
        }
        for (r, a) in acc.iter_mut().enumerate() {
            for (v, a) in a.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(_mm256_loadu_ps(xp.add(r * k + i + 8 * v)), wv[v], *a);
            }
        }
        i += step;
    }
    for (r, (o, a)) in out.iter_mut().zip(&acc).enumerate() {
        let mut t = a[0];
        for v in &a[1..] {
            t = _mm256_add_ps(t, *v);
        }
        let lanes: [f32; 8] = std::mem::transmute(t);
        let mut s = lanes.iter().sum::<f32>();
        for j in whole..k {
            s += x[r * k + j] * w[j];
        }
        *o = s;
    }
}

/// `out[r] = Σᵢ x[r · k + i] · w[i]` for the first `R` rows of `x`; the weight row is read
/// once for all of them into eight partial sums a row (the portable code; `V`, the vectors a
/// step of the AVX2 code takes, does not change it).
#[inline(always)]
fn dots<const R: usize, const V: usize>(x: &[f32], w: &[f32], k: usize, out: &mut [f32]) {
    assert!(
        x.len() >= R * k && w.len() >= k && out.len() >= R,
        "dot kernel bounds"
    );
    let whole = k - k % 8;
    let mut acc = [[0f32; 8]; R];
    let (xp, wp) = (x.as_ptr(), w.as_ptr());
    let mut i = 0;
    while i < whole {
        for (r, a) in acc.iter_mut().enumerate() {
            for (l, a) in a.iter_mut().enumerate() {
                // SAFETY: r < R, i + l < whole ≤ k, and x holds R · k values, w k (asserted).
                *a += unsafe { *xp.add(r * k + i + l) * *wp.add(i + l) };
            }
        }
        i += 8;
    }
    for (r, (o, a)) in out.iter_mut().zip(&acc).enumerate() {
        let mut s = a.iter().sum::<f32>();
        for j in whole..k {
            s += x[r * k + j] * w[j];
        }
        *o = s;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `x · wᵀ` in f64, with the sum of `|x| · |w|` each value's rounding is measured against.
    fn naive(x: &[f32], w: &[f32], rows: usize, k: usize) -> Vec<(f64, f64)> {
        let n = w.len() / k;
        let mut out = Vec::with_capacity(rows * n);
        for r in 0..rows {
            for o in 0..n {
                let (mut s, mut mag) = (0f64, 0f64);
                for i in 0..k {
                    let p = x[r * k + i] as f64 * w[o * k + i] as f64;
                    s += p;
                    mag += p.abs();
                }
                out.push((s, mag));
            }
        }
        out
    }

    fn values(len: usize, seed: usize) -> Vec<f32> {
        (0..len)
            .map(|i| (((i + seed) * 7919) % 2003) as f32 / 1001.0 - 1.0)
            .collect()
    }

    /// Asserts `out` is `x · wᵀ` to within f32 rounding of each sum's magnitude.
    fn assert_product(out: &[f32], x: &[f32], w: &[f32], rows: usize, k: usize, what: &str) {
        for (i, (&got, (want, mag))) in out.iter().zip(naive(x, w, rows, k)).enumerate() {
            assert!(
                (got as f64 - want).abs() <= 4.0 * f32::EPSILON as f64 * mag,
                "{what}, value {i}: {got} vs {want}"
            );
        }
    }

    #[test]
    fn matches_a_naive_product_for_every_row_count_and_tail() {
        for rows in 1..=MAX_ROWS {
            // 16 · 37 + 5 values a row: whole lane groups and a tail; 300 features span tasks.
            for (k, n) in [(597, 300), (16, 3), (3, 5), (4096, 70)] {
                let x = values(rows * k, rows);
                let w = values(n * k, 11);
                let mut out = vec![f32::NAN; rows * n];
                rows_times_weight_t(&x, &w, rows, k, &mut out).unwrap();
                assert_product(&out, &x, &w, rows, k, &format!("rows {rows}, k {k}"));
            }
        }
    }

    /// The portable kernel (what a CPU without AVX2 runs) on its own, whatever this CPU has.
    #[test]
    fn the_portable_kernel_matches_a_naive_product() {
        let k = 8 * 37 + 5;
        let kernels: [(usize, DotKernel); 3] = [
            (1, |x, w, k, o| dots::<1, 2>(x, w, k, o)),
            (3, |x, w, k, o| dots::<3, 2>(x, w, k, o)),
            (8, |x, w, k, o| dots::<8, 1>(x, w, k, o)),
        ];
        for (rows, kernel) in kernels {
            let (x, w) = (values(rows * k, rows), values(k, 5));
            let mut out = vec![f32::NAN; rows];
            kernel(&x, &w, k, &mut out);
            assert_product(&out, &x, &w, rows, k, &format!("portable, {rows} rows"));
        }
    }

    #[test]
    fn refuses_shapes_that_do_not_fit() {
        let mut out = [0f32; 2];
        assert!(rows_times_weight_t(&[1.0; 4], &[1.0; 4], 0, 2, &mut out).is_err());
        assert!(rows_times_weight_t(&[1.0; 18], &[1.0; 4], MAX_ROWS + 1, 2, &mut out).is_err());
        assert!(rows_times_weight_t(&[1.0; 4], &[1.0; 5], 2, 2, &mut out).is_err());
        assert!(rows_times_weight_t(&[1.0; 3], &[1.0; 4], 2, 2, &mut out).is_err());
        assert!(rows_times_weight_t(&[1.0; 4], &[1.0; 6], 2, 2, &mut [0f32; 4]).is_err());
        rows_times_weight_t(&[1.0; 4], &[1.0; 4], 2, 2, &mut [0f32; 4]).unwrap();
    }
}
