//! A few f32 rows times a transposed weight matrix on the CPU, `out = x · wᵀ` with `w`
//! `[n, k]` as checkpoints store it: a decode step's linear layers and LM head.
//!
//! With one to a few rows the product reads every weight once and does two flops per
//! weight, so its speed is the memory bandwidth the reads reach. MLX's CPU matmul hands it
//! to BLAS as a GEMM with `M = 1`, which OpenBLAS runs on one thread: 12-13 GB/s on cpu-vm
//! against 19 GB/s for a two-thread GEMV over the same weights (docs/mlx.md, "A decode
//! step's products on the CPU"). This kernel splits the output features over rayon's
//! threads, each streaming its weight rows once for all input rows; from 9 rows it works
//! in register tiles ([`tile_task`]), where arithmetic, not memory, is the bound. It runs
//! inside MLX's graph as a primitive of the C++ shim (`RowsTimesWeightT`) on MLX's CPU
//! stream, so a decode step stays one lazily evaluated graph.

use rayon::prelude::*;

/// The most rows the kernel takes without register tiles: up to here each weight row is
/// read once for all input rows, which is bound by the memory reads.
const DOT_ROWS: usize = 8;

/// The most rows the kernel takes with register tiles (AVX-512, [`tile_task`]). Measured on
/// cpu-vm (docs/mlx.md): up to here the tiles are faster than MLX's matmul, from about 16
/// rows BLAS's GEMM makes up for copying the whole weight into its packed layout on every
/// call. AVX2 tiles (2 weight rows by 6) were slower than BLAS at 16 rows there, so a CPU
/// without AVX-512 keeps [`DOT_ROWS`].
const TILED_ROWS: usize = 16;

/// Input rows of a register tile.
const TILE_ROWS: usize = 6;

/// Weight rows (output features) of a register tile: with [`TILE_ROWS`], 24 sums of 16
/// lanes in AVX-512's 32 registers.
const TILE_FEATURES: usize = 4;

/// The most rows [`rows_times_weight_t`] takes on this CPU; more rows go to MLX's matmul.
pub fn max_rows() -> usize {
    if has_tiles() {
        TILED_ROWS
    } else {
        DOT_ROWS
    }
}

/// Whether this CPU runs the register tiles (AVX-512).
fn has_tiles() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

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
    let most = max_rows();
    if rows == 0 || rows > most || k == 0 || !w.len().is_multiple_of(k) {
        return Err(format!(
            "{rows} rows (at most {most}) of {k} values times a weight of {} values",
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
    #[cfg(target_arch = "x86_64")]
    let tiled = rows > DOT_ROWS;
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
            #[cfg(target_arch = "x86_64")]
            if tiled {
                return tile_task(x, w, rows, k, o);
            }
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

/// One task's share of a product of many rows: its weight rows `w` (`feats · k` values)
/// times every row of `x`, feature-major into `o` (`feats · rows`), in register tiles of
/// [`TILE_FEATURES`] weight rows by [`TILE_ROWS`] input rows (the last weight rows of a
/// count that is not a multiple one at a time). For each group of input rows the tiles
/// walk the task's weights, which stay in the core's second-level cache after the first
/// group read them from memory; each load then feeds several multiply-adds, as in a GEMM,
/// without BLAS's copy of the whole weight into its packed layout on every call (what a
/// BLAS product of a few rows spends most of its time on: docs/mlx.md). Only on a CPU with
/// AVX-512 ([`has_tiles`]).
#[cfg(target_arch = "x86_64")]
fn tile_task(x: &[f32], w: &[f32], rows: usize, k: usize, o: &mut [f32]) {
    assert!(has_tiles(), "register tiles need AVX-512");
    let feats = w.len() / k;
    let mut sums = [0f32; TILE_FEATURES * TILE_ROWS];
    for r in (0..rows).step_by(TILE_ROWS) {
        let rs = (rows - r).min(TILE_ROWS);
        let mut f = 0;
        while f < feats {
            let fs = if feats - f >= TILE_FEATURES {
                TILE_FEATURES
            } else {
                1
            };
            let (x, w) = (&x[r * k..(r + rs) * k], &w[f * k..(f + fs) * k]);
            assert!(x.len() == rs * k && w.len() == fs * k, "tile bounds");
            // SAFETY: the CPU has AVX-512 (asserted above); the tile reads `fs` rows of `w`
            // and `rs` of `x`, `k` values each, which the slices hold (asserted).
            unsafe { tile_kernel(fs, rs)(x, w, k, &mut sums) };
            for fi in 0..fs {
                let dst = &mut o[(f + fi) * rows + r..][..rs];
                dst.copy_from_slice(&sums[fi * TILE_ROWS..][..rs]);
            }
            f += fs;
        }
    }
}

/// The sums of one tile: `sums[f · TILE_ROWS + r] = Σᵢ x[r · k + i] · w[f · k + i]` for
/// its weight rows `f` and input rows `r`. Unsafe: the CPU must have AVX-512, and `x`
/// and `w` must hold the tile's rows of `k` values.
#[cfg(target_arch = "x86_64")]
type TileKernel = unsafe fn(&[f32], &[f32], usize, &mut [f32]);

/// The tile of `features` weight rows (1 or [`TILE_FEATURES`]) by `rows` input rows (1 to
/// [`TILE_ROWS`]).
#[cfg(target_arch = "x86_64")]
fn tile_kernel(features: usize, rows: usize) -> TileKernel {
    match (features == 1, rows) {
        (true, 1) => tile_avx512::<1, 1>,
        (true, 2) => tile_avx512::<1, 2>,
        (true, 3) => tile_avx512::<1, 3>,
        (true, 4) => tile_avx512::<1, 4>,
        (true, 5) => tile_avx512::<1, 5>,
        (true, _) => tile_avx512::<1, 6>,
        (false, 1) => tile_avx512::<TILE_FEATURES, 1>,
        (false, 2) => tile_avx512::<TILE_FEATURES, 2>,
        (false, 3) => tile_avx512::<TILE_FEATURES, 3>,
        (false, 4) => tile_avx512::<TILE_FEATURES, 4>,
        (false, 5) => tile_avx512::<TILE_FEATURES, 5>,
        (false, _) => tile_avx512::<TILE_FEATURES, 6>,
    }
}

/// One tile with AVX-512 registers: one vector of 16 values a sum, the tail of `k` past the
/// last whole vector in scalar code.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn tile_avx512<const F: usize, const R: usize>(
    x: &[f32],
    w: &[f32],
    k: usize,
    sums: &mut [f32],
) {
    use std::arch::x86_64::*;
    let (xp, wp) = (x.as_ptr(), w.as_ptr());
    let whole = k - k % 16;
    let mut acc = [[_mm512_setzero_ps(); R]; F];
    let mut i = 0;
    while i < whole {
        let mut wv = [_mm512_setzero_ps(); F];
        for (f, wv) in wv.iter_mut().enumerate() {
            *wv = _mm512_loadu_ps(wp.add(f * k + i));
        }
        for r in 0..R {
            let xv = _mm512_loadu_ps(xp.add(r * k + i));
            for (a, wv) in acc.iter_mut().zip(&wv) {
                a[r] = _mm512_fmadd_ps(xv, *wv, a[r]);
            }
        }
        i += 16;
    }
    for (f, a) in acc.iter().enumerate() {
        for (r, a) in a.iter().enumerate() {
            let mut s = _mm512_reduce_add_ps(*a);
            for j in whole..k {
                s += x[r * k + j] * w[f * k + j];
            }
            sums[f * TILE_ROWS + r] = s;
        }
    }
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
        for rows in 1..=max_rows() {
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

    /// The register tiles on their own: rows that fill tiles and leave a part, weight rows
    /// that leave some over, a tail of `k`. Needs AVX-512 (the tiles run nowhere else).
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn the_register_tiles_match_a_naive_product() {
        if !has_tiles() {
            eprintln!(
                "\n*** SKIPPED the_register_tiles_match_a_naive_product: this CPU has no \
                 AVX-512, so the row product never runs the tiles here\n"
            );
            return;
        }
        let (k, n) = (16 * 37 + 5, 13);
        for rows in [1, 5, 6, 7, 12, 17] {
            let (x, w) = (values(rows * k, rows), values(n * k, 3));
            let mut by_feature = vec![f32::NAN; n * rows];
            tile_task(&x, &w, rows, k, &mut by_feature);
            let mut out = vec![f32::NAN; rows * n];
            for (f, v) in by_feature.chunks_exact(rows).enumerate() {
                for (r, &v) in v.iter().enumerate() {
                    out[r * n + f] = v;
                }
            }
            assert_product(&out, &x, &w, rows, k, &format!("tiles, {rows} rows"));
        }
    }

    #[test]
    fn refuses_shapes_that_do_not_fit() {
        let mut out = [0f32; 2];
        assert!(rows_times_weight_t(&[1.0; 4], &[1.0; 4], 0, 2, &mut out).is_err());
        assert!(rows_times_weight_t(&[1.0; 34], &[1.0; 4], max_rows() + 1, 2, &mut out).is_err());
        assert!(rows_times_weight_t(&[1.0; 4], &[1.0; 5], 2, 2, &mut out).is_err());
        assert!(rows_times_weight_t(&[1.0; 3], &[1.0; 4], 2, 2, &mut out).is_err());
        assert!(rows_times_weight_t(&[1.0; 4], &[1.0; 6], 2, 2, &mut [0f32; 4]).is_err());
        rows_times_weight_t(&[1.0; 4], &[1.0; 4], 2, 2, &mut [0f32; 4]).unwrap();
    }
}
