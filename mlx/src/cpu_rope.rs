//! RoPE's rotation of f32 heads on the CPU as one graph node, with the cosines and sines
//! made once a step ([`crate::fast::rope_angles`]).
//!
//! MLX runs RoPE on the CPU as its fallback: slices, four products with broadcast angles, a
//! difference, a sum and a concatenation, about thirteen nodes a call (twenty-nine with the
//! angles). A SmolLM2 decode step rotates queries and keys in each of its 30 layers: 780 of
//! its 1,544 nodes were rotations, each scheduled and run one by one on MLX's CPU stream.
//! This kernel does the same arithmetic in one pass over the heads, in the same order and
//! with the same roundings (a product, then the difference or sum, no fused multiply-add),
//! so its output equals MLX's rotation bit for bit. It runs inside MLX's graph as the C++
//! shim's `RopeRotate` primitive on MLX's CPU stream.

use rayon::prelude::*;

/// Values of `x` above which the rows are split over rayon's threads (a prefill chunk's
/// heads); below, one thread rotates them all (a decode step's few heads).
const PARALLEL_VALUES: usize = 1 << 16;

/// Where the rotation reads and what it rotates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RopeLayout {
    /// `x`'s shape `[B, H, T, D]`.
    pub shape: [usize; 4],
    /// `x`'s element strides, one per axis (a transposed or sliced view reads in place).
    pub strides: [usize; 4],
    /// Feature dimensions rotated from the front of the last axis (even, at most `D`); the
    /// rest are copied.
    pub dims: usize,
    /// Rotate interleaved pairs `(x[2i], x[2i+1])` instead of the halves `(x[i], x[i +
    /// dims/2])`.
    pub traditional: bool,
    /// The angles hold a set per batch row (`[B, 1, T, dims/2]`) instead of one for all
    /// rows (`[T, dims/2]`).
    pub per_row: bool,
}

impl RopeLayout {
    /// The checks the kernel relies on; `Err` says which failed.
    fn check(&self, x: usize, angles: usize, out: usize) -> Result<(), String> {
        let [b, h, t, d] = self.shape;
        let half = self.dims / 2;
        if self.dims == 0 || !self.dims.is_multiple_of(2) || self.dims > d {
            return Err(format!("rotating {} of {d} features", self.dims));
        }
        if out != b * h * t * d {
            return Err(format!("{out} outputs for a [{b}, {h}, {t}, {d}] input"));
        }
        let want = if self.per_row { b } else { 1 } * t * half;
        if angles != want {
            return Err(format!("{angles} angles where the layout needs {want}"));
        }
        if b * h * t * d > 0 {
            let reach = 1
                + (0..4)
                    .map(|i| (self.shape[i] - 1) * self.strides[i])
                    .sum::<usize>();
            if x < reach {
                return Err(format!("{x} input values where the strides reach {reach}"));
            }
        }
        Ok(())
    }
}

/// Rotates `x` (laid out as `layout` says) into `out` (`[B, H, T, D]`, row-major):
/// `(x₁, x₂) → (x₁·cos − x₂·sin, x₁·sin + x₂·cos)` for each rotated pair at each row's
/// angles, the features past `dims` copied.
pub fn rotate(
    x: &[f32],
    cos: &[f32],
    sin: &[f32],
    layout: RopeLayout,
    out: &mut [f32],
) -> Result<(), String> {
    if cos.len() != sin.len() {
        return Err(format!("{} cosines beside {} sines", cos.len(), sin.len()));
    }
    layout.check(x.len(), cos.len(), out.len())?;
    let [_, h, t, d] = layout.shape;
    if out.is_empty() {
        return Ok(());
    }
    let row = |(r, o): (usize, &mut [f32])| {
        let (bh, ti) = (r / t, r % t);
        let (bi, hi) = (bh / h, bh % h);
        let s = layout.strides;
        let from = bi * s[0] + hi * s[1] + ti * s[2];
        let half = layout.dims / 2;
        let at = (if layout.per_row { bi * t } else { 0 } + ti) * half;
        rotate_row(
            &x[from..],
            s[3],
            &cos[at..at + half],
            &sin[at..at + half],
            layout.traditional,
            o,
        );
    };
    if out.len() >= PARALLEL_VALUES {
        out.par_chunks_mut(d).enumerate().for_each(row);
    } else {
        out.chunks_mut(d).enumerate().for_each(row);
    }
    Ok(())
}

/// One row of `D` features read at `step` apart from `x`, rotated into `o`.
fn rotate_row(x: &[f32], step: usize, cos: &[f32], sin: &[f32], traditional: bool, o: &mut [f32]) {
    let half = cos.len();
    let at = |i: usize| x[i * step];
    for i in 0..half {
        let (a, b) = if traditional {
            (2 * i, 2 * i + 1)
        } else {
            (i, i + half)
        };
        let (x1, x2, c, s) = (at(a), at(b), cos[i], sin[i]);
        o[a] = x1 * c - x2 * s;
        o[b] = x1 * s + x2 * c;
    }
    for (i, v) in o.iter_mut().enumerate().skip(2 * half) {
        *v = at(i);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pair_turns_by_its_angle_and_the_tail_is_copied() {
        // [1, 1, 1, 6], 4 rotated dims: pairs (0, 2) and (1, 3), features 4-5 copied.
        let x = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let (cos, sin) = ([0.0, 0.5], [1.0, 0.25]);
        let layout = RopeLayout {
            shape: [1, 1, 1, 6],
            strides: [6, 6, 6, 1],
            dims: 4,
            traditional: false,
            per_row: false,
        };
        let mut out = [0.0; 6];
        rotate(&x, &cos, &sin, layout, &mut out).unwrap();
        assert_eq!(out, [-3.0, 0.0, 1.0, 2.5, 5.0, 6.0]);
        // Interleaved: pairs (0, 1) and (2, 3).
        let mut out = [0.0; 6];
        let traditional = RopeLayout {
            traditional: true,
            ..layout
        };
        rotate(&x, &cos, &sin, traditional, &mut out).unwrap();
        assert_eq!(out, [-2.0, 1.0, 0.5, 2.75, 5.0, 6.0]);
    }

    #[test]
    fn layouts_that_do_not_fit_are_refused() {
        let layout = RopeLayout {
            shape: [2, 1, 3, 4],
            strides: [12, 12, 4, 1],
            dims: 4,
            traditional: false,
            per_row: true,
        };
        let (x, a, mut out) = (vec![0.0; 24], vec![0.0; 12], vec![0.0; 24]);
        rotate(&x, &a, &a, layout, &mut out).unwrap();
        let shared = RopeLayout {
            per_row: false,
            ..layout
        };
        assert!(rotate(&x, &a, &a, shared, &mut out).is_err());
        let odd = RopeLayout { dims: 3, ..layout };
        assert!(rotate(&x, &a, &a, odd, &mut out).is_err());
        assert!(rotate(&x[..23], &a, &a, layout, &mut out).is_err());
        assert!(rotate(&x, &a, &a[..11], layout, &mut out).is_err());
    }
}
