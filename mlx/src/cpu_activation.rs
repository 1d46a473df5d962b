//! The gated MLP's activation for f32 on the CPU: `silu(gate) · up` over the stacked
//! output of the gate/up product, vectorized and on rayon's threads.
//!
//! MLX's CPU element-wise ops run a transcendental one element at a time on one thread
//! (`simd::exp<float, 1>` with a libm `fmaf`), its `compile` included: at SmolLM2's agent
//! turn (500 tokens, 1,536 features) `silu · mul` took 15 ms a layer, as long as the
//! gate/up product itself (docs/benchmarks.md, session 17). Like [`crate::cpu_attention`]
//! this runs outside MLX's graph on evaluated host slices.

use rayon::prelude::*;

use crate::cpu_attention::exp_nonpositive;

/// Rows a task takes (a few hundred KB of input each).
const ROWS_PER_TASK: usize = 16;

/// `out[r, j] = silu(y[r, j]) · y[r, inter + j]` for the `rows` rows of `y` `[rows,
/// 2 · inter]` (the gate in the first half of each row, the up projection in the second);
/// `out` is `[rows, inter]`. `silu(x) = x · σ(x)` with σ from one exponential of a
/// non-positive argument either side of 0, so it never overflows.
pub fn silu_mul_rows(y: &[f32], inter: usize, out: &mut [f32]) -> Result<(), String> {
    if inter == 0 || y.len() != 2 * out.len() || !out.len().is_multiple_of(inter) {
        return Err(format!(
            "silu_mul over {} stacked values into {} outputs of rows of {inter}",
            y.len(),
            out.len()
        ));
    }
    let kernel = row_kernel();
    out.par_chunks_mut(ROWS_PER_TASK * inter)
        .zip(y.par_chunks(ROWS_PER_TASK * 2 * inter))
        .for_each(|(o, y)| {
            for (o, y) in o.chunks_exact_mut(inter).zip(y.chunks_exact(2 * inter)) {
                let (gate, up) = y.split_at(inter);
                kernel(gate, up, o);
            }
        });
    Ok(())
}

type RowKernel = fn(&[f32], &[f32], &mut [f32]);

/// The row kernel for this CPU: the generic code compiled for AVX-512 or AVX2 + FMA when
/// the CPU has them (the crate's baseline target is SSE2), else as is.
fn row_kernel() -> RowKernel {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        if has!("avx512f") && has!("avx2") && has!("fma") {
            return |g, u, o| {
                // SAFETY: the CPU has AVX-512F, AVX2 and FMA (checked just above).
                unsafe { silu_mul_row_avx512(g, u, o) }
            };
        }
        if has!("avx2") && has!("fma") {
            return |g, u, o| {
                // SAFETY: the CPU has AVX2 and FMA (checked just above).
                unsafe { silu_mul_row_avx2(g, u, o) }
            };
        }
    }
    silu_mul_row
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
fn silu_mul_row_avx512(gate: &[f32], up: &[f32], out: &mut [f32]) {
    silu_mul_row(gate, up, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn silu_mul_row_avx2(gate: &[f32], up: &[f32], out: &mut [f32]) {
    silu_mul_row(gate, up, out)
}

#[inline(always)]
fn silu_mul_row(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        // e = exp(−|g|) ≤ 1; σ(g) = 1 / (1 + e) for g ≥ 0, e / (1 + e) below.
        let e = exp_nonpositive(-g.abs());
        let num = if g >= 0.0 { 1.0 } else { e };
        *o = g * (num / (1.0 + e)) * u;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn silu_mul_matches_its_definition_in_f64() {
        let (rows, inter) = (37, 50);
        let y: Vec<f32> = (0..rows * 2 * inter)
            .map(|i| ((i * 7919) % 2003) as f32 / 40.0 - 25.0)
            .collect();
        let mut out = vec![0f32; rows * inter];
        silu_mul_rows(&y, inter, &mut out).unwrap();
        for r in 0..rows {
            for j in 0..inter {
                let (g, u) = (
                    y[r * 2 * inter + j] as f64,
                    y[r * 2 * inter + inter + j] as f64,
                );
                let want = g / (1.0 + (-g).exp()) * u;
                let got = out[r * inter + j] as f64;
                assert!(
                    (got - want).abs() <= 1e-6 * want.abs().max(1e-3),
                    "({r}, {j}): {got} vs {want}"
                );
            }
        }
        let big = [100.0f32, -100.0, 0.0, f32::MAX.sqrt()];
        let mut y = big.to_vec();
        y.extend([1.0f32; 4]);
        let mut out = [0f32; 4];
        silu_mul_rows(&y, 4, &mut out).unwrap();
        assert_eq!(out[0], 100.0);
        assert!(out[1].abs() < 1e-30 && out[2] == 0.0 && out[3].is_finite());
        assert!(silu_mul_rows(&[0.0; 6], 2, &mut [0.0; 2]).is_err());
    }
}
