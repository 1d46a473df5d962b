//! The gated MLP's activation for f32 on the CPU: `silu(gate) · up` or `gelu_tanh(gate) ·
//! up` over the stacked output of the gate/up product, vectorized and on rayon's threads.
//!
//! MLX's CPU element-wise ops run a transcendental one element at a time on one thread
//! (`simd::exp<float, 1>` with a libm `fmaf`), its `compile` included: at SmolLM2's agent
//! turn (500 tokens, 1,536 features) `silu · mul` took ~12.5 ms a layer, more than the
//! gate/up product itself (docs/benchmarks.md, session 17). Like [`crate::cpu_attention`]
//! this runs outside MLX's graph on evaluated host slices.

use rayon::prelude::*;

use crate::cpu_attention::exp_nonpositive;

/// Rows a task takes (a few hundred KB of input each).
const ROWS_PER_TASK: usize = 16;

/// The gate's activation, both of the form `x · σ(k(x))`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gate {
    /// `silu(x) = x · σ(x)` (llama, qwen).
    Silu,
    /// The tanh GELU, `0.5 · x · (1 + tanh(z))` with `z = √(2/π) · (x + 0.044715 · x³)`,
    /// which is `x · σ(2z)` (Gemma).
    GeluTanh,
}

/// `out[r, j] = act(y[r, j]) · y[r, inter + j]` for the rows of `y` `[rows, 2 · inter]`
/// (the gate in the first half of each row, the up projection in the second); `out` is
/// `[rows, inter]`. σ comes from one exponential of a non-positive argument either side of
/// 0, so it never overflows.
pub fn gated_mul_rows(gate: Gate, y: &[f32], inter: usize, out: &mut [f32]) -> Result<(), String> {
    if inter == 0 || y.len() != 2 * out.len() || !out.len().is_multiple_of(inter) {
        return Err(format!(
            "a gated activation over {} stacked values into {} outputs of rows of {inter}",
            y.len(),
            out.len()
        ));
    }
    let kernel = row_kernel(gate);
    out.par_chunks_mut(ROWS_PER_TASK * inter)
        .zip(y.par_chunks(ROWS_PER_TASK * 2 * inter))
        .for_each(|(o, y)| {
            for (o, y) in o.chunks_exact_mut(inter).zip(y.chunks_exact(2 * inter)) {
                let (g, u) = y.split_at(inter);
                kernel(g, u, o);
            }
        });
    Ok(())
}

type RowKernel = fn(&[f32], &[f32], &mut [f32]);

/// The row kernel of `gate` for this CPU: the generic code compiled for AVX-512 or AVX2 +
/// FMA when the CPU has them (the crate's baseline target is SSE2), else as is.
fn row_kernel(gate: Gate) -> RowKernel {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        if has!("avx512f") && has!("avx2") && has!("fma") {
            // SAFETY (both): the CPU has AVX-512F, AVX2 and FMA (checked just above).
            return match gate {
                Gate::Silu => |g, u, o| unsafe { row_avx512::<false>(g, u, o) },
                Gate::GeluTanh => |g, u, o| unsafe { row_avx512::<true>(g, u, o) },
            };
        }
        if has!("avx2") && has!("fma") {
            // SAFETY (both): the CPU has AVX2 and FMA (checked just above).
            return match gate {
                Gate::Silu => |g, u, o| unsafe { row_avx2::<false>(g, u, o) },
                Gate::GeluTanh => |g, u, o| unsafe { row_avx2::<true>(g, u, o) },
            };
        }
    }
    match gate {
        Gate::Silu => row::<false>,
        Gate::GeluTanh => row::<true>,
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
fn row_avx512<const GELU: bool>(gate: &[f32], up: &[f32], out: &mut [f32]) {
    row::<GELU>(gate, up, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn row_avx2<const GELU: bool>(gate: &[f32], up: &[f32], out: &mut [f32]) {
    row::<GELU>(gate, up, out)
}

/// `2 · √(2/π)`: the tanh GELU's σ argument is this times `x + 0.044715 · x³`.
const GELU_K: f32 = 1.595_769;

#[inline(always)]
fn row<const GELU: bool>(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        let w = if GELU {
            GELU_K * (g + 0.044_715 * g * g * g)
        } else {
            g
        };
        // e = exp(−|w|) ≤ 1; σ(w) = 1 / (1 + e) for w ≥ 0, e / (1 + e) below.
        let e = exp_nonpositive(-w.abs());
        let num = if w >= 0.0 { 1.0 } else { e };
        *o = g * (num / (1.0 + e)) * u;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(gate: Gate, f: impl Fn(f64) -> f64) {
        let (rows, inter) = (37, 50);
        let y: Vec<f32> = (0..rows * 2 * inter)
            .map(|i| ((i * 7919) % 2003) as f32 / 40.0 - 25.0)
            .collect();
        let mut out = vec![0f32; rows * inter];
        gated_mul_rows(gate, &y, inter, &mut out).unwrap();
        for r in 0..rows {
            for j in 0..inter {
                let (g, u) = (
                    y[r * 2 * inter + j] as f64,
                    y[r * 2 * inter + inter + j] as f64,
                );
                let want = f(g) * u;
                let got = out[r * inter + j] as f64;
                assert!(
                    (got - want).abs() <= 2e-6 * want.abs().max(1e-3),
                    "{gate:?} ({r}, {j}): {got} vs {want}"
                );
            }
        }
        let mut y = vec![100.0f32, -100.0, 0.0, f32::MAX.sqrt()];
        y.extend([1.0f32; 4]);
        let mut out = [0f32; 4];
        gated_mul_rows(gate, &y, 4, &mut out).unwrap();
        assert_eq!(out[0], 100.0, "{gate:?}");
        assert!(
            out[1].abs() < 1e-30 && out[2] == 0.0 && out[3].is_finite(),
            "{gate:?}"
        );
        assert!(gated_mul_rows(gate, &[0.0; 6], 2, &mut [0.0; 2]).is_err());
    }

    #[test]
    fn silu_mul_matches_its_definition_in_f64() {
        check(Gate::Silu, |g| g / (1.0 + (-g).exp()));
    }

    #[test]
    fn gelu_tanh_mul_matches_its_definition_in_f64() {
        let c = (2.0 / std::f64::consts::PI).sqrt();
        check(Gate::GeluTanh, |g| {
            0.5 * g * (1.0 + (c * (g + 0.044715 * g * g * g)).tanh())
        });
    }
}
