//! Causal attention at a few shapes: a prefill chunk's queries and keys padded so that
//! MLX's CUDA backend reuses a cuDNN graph instead of building one.
//!
//! MLX caches one cuDNN SDPA graph per exact shape and strides of q, k and v, and building
//! one costs 47-75 ms of host time on the H100 (`scripts/cuda/shape_cost_probe.py`); under
//! the Mooncake trace most prefill steps meet a (query, key) length pair no step had before
//! (docs/cuda.md, "One cuDNN graph per attention shape and strides"). Padded here:
//!
//! - the keys at the end, to a whole number of [`KEY_STEP`] tokens (or the room the caller's
//!   arena has past them): read from the arena past the chunk's last key, never written;
//! - the queries at the end by as many rows as the keys, so that MLX's bottom-right causal
//!   mask still aligns each real query with its own key;
//! - the queries at the front, to a power of two: rows before the first real query, which
//!   the bottom-right alignment leaves where it was.
//!
//! Each real row attends exactly the keys it attends unpadded (the padding rows' outputs
//! are dropped), so only the float order of MLX's kernel can differ. Keys past the chunk
//! must be finite: arenas are grown with zeros, and what a trimmed sequence left there was
//! computed (a NaN there would reach real rows through a zero weight).
//!
//! On by default on CUDA (a GPU on Linux), where it halved the 8B's P50 TTFT under the
//! trace (docs/benchmarks.md, session 40); off on the CPU and on Metal, whose attention
//! has no per-shape build to avoid and would only pay for the padding rows.
//! `KVSTORE_PADDED_ATTENTION=0` turns it off, `=1` on, on any device.

use std::sync::OnceLock;

use crate::fast::AttentionMask;
use crate::{ops, Array, Result};

/// Keys are padded to a whole number of this many tokens (MLX's own KV step, mlx-lm's).
pub const KEY_STEP: i32 = 256;

/// Queries are padded to a power of two from this many rows.
pub const MIN_QUERY_ROWS: i32 = 16;

/// How one call is padded: rows before and after the queries (the keys get `back` rows
/// too), and the key count attended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Padding {
    /// Query rows before the first real one.
    pub front: i32,
    /// Query rows after the last real one, and keys after the last real key.
    pub back: i32,
    /// Keys attended: the real keys plus `back`.
    pub keys: i32,
}

impl Padding {
    /// Query rows attended: `front + queries + back`.
    pub fn rows(&self, queries: i32) -> i32 {
        self.front + queries + self.back
    }
}

/// The padding of a causal call of `queries` rows over `keys` keys (the queries being the
/// last `queries` of them) when the arena holds `room` ≥ `keys` key rows from the first
/// key; `None` where nothing can be padded (one query, queries past the keys, no room).
pub fn padding(queries: i32, keys: i32, room: i32) -> Option<Padding> {
    if queries < 2 || queries > keys || room < keys {
        return None;
    }
    let padded_keys = ((keys + KEY_STEP - 1) / KEY_STEP * KEY_STEP).min(room);
    let back = padded_keys - keys;
    let need = queries + back;
    // A power of two, no more rows than keys (cuDNN's bottom-right mask needs that).
    let rows = (need as u32)
        .next_power_of_two()
        .max(MIN_QUERY_ROWS as u32)
        .min(padded_keys as u32) as i32;
    let rows = rows.max(need);
    Some(Padding {
        front: rows - need,
        back,
        keys: padded_keys,
    })
}

/// The variable that overrides the default: `0` off, `1` on (read once).
pub const PADDED_ATTENTION_VAR: &str = "KVSTORE_PADDED_ATTENTION";

/// Whether callers pad now: as [`PADDED_ATTENTION_VAR`] says, else where the default
/// device is a GPU on Linux (CUDA; see the module doc).
pub fn padded_attention_enabled() -> bool {
    static CHOICE: OnceLock<Option<bool>> = OnceLock::new();
    let choice =
        *CHOICE.get_or_init(|| override_of(std::env::var(PADDED_ATTENTION_VAR).ok().as_deref()));
    choice.unwrap_or_else(|| {
        cfg!(target_os = "linux") && matches!(crate::default_device(), Ok(crate::Device::Gpu))
    })
}

/// What a value of [`PADDED_ATTENTION_VAR`] chooses (`None`: unset, or a value that is
/// neither `0` nor `1`, which is warned about once and leaves the default).
fn override_of(value: Option<&str>) -> Option<bool> {
    match value.map(str::trim) {
        None | Some("") => None,
        Some("1") => Some(true),
        Some("0") => Some(false),
        Some(other) => {
            eprintln!(
                "warning: {PADDED_ATTENTION_VAR}={other:?} is neither 0 nor 1; using the default \
                 (padded on CUDA, not elsewhere)"
            );
            None
        }
    }
}

/// `softmax(q kᵀ · scale + causal) v` for q `[1, H, L, D]`, the last `L` of `keys` keys,
/// where `k_room` and `v_room` (`[1, Hkv, room, D]`) hold the keys from the first and at
/// least `keys` rows, padded as [`padding`] says; `None` where it says nothing can be
/// padded (the caller attends unpadded). → `[1, H, L, D]`.
pub fn causal_attention_padded(
    q: &Array,
    k_room: &Array,
    v_room: &Array,
    keys: i32,
    scale: f32,
) -> Result<Option<Array>> {
    let (qs, ks) = (q.shape(), k_room.shape());
    if qs.len() != 4 || ks.len() != 4 || qs[0] != 1 {
        return Ok(None);
    }
    let (heads, queries, width) = (qs[1], qs[2], qs[3]);
    let Some(p) = padding(queries, keys, ks[2].min(v_room.shape()[2])) else {
        return Ok(None);
    };
    let cut = |a: &Array| {
        let s = a.shape();
        a.slice(&[0, 0, 0, 0], &[s[0], s[1], p.keys, s[3]])
    };
    let (k, v) = (cut(k_room)?, cut(v_room)?);
    let rows = |n: i32| ops::zeros(&[1, heads, n, width], q.dtype());
    let padded = match (p.front, p.back) {
        (0, 0) => q.clone(),
        (0, b) => ops::concatenate(&[q, &rows(b)?], 2)?,
        (f, 0) => ops::concatenate(&[&rows(f)?, q], 2)?,
        (f, b) => ops::concatenate(&[&rows(f)?, q, &rows(b)?], 2)?,
    };
    let out = crate::fast::mlx_scaled_dot_product_attention(
        &padded,
        &k,
        &v,
        scale,
        AttentionMask::Causal,
    )?;
    Ok(Some(out.slice(
        &[0, 0, p.front, 0],
        &[1, heads, p.front + queries, width],
    )?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Dtype;

    #[test]
    fn the_variable_overrides_the_default_only_with_0_or_1() {
        assert_eq!(override_of(None), None);
        assert_eq!(override_of(Some("")), None);
        assert_eq!(override_of(Some("1")), Some(true));
        assert_eq!(override_of(Some(" 0 ")), Some(false));
        assert_eq!(override_of(Some("yes")), None);
    }

    #[test]
    fn paddings_keep_each_real_query_on_its_own_key_and_reuse_few_shapes() {
        // 300 queries ending at key 3,000 of an arena with room for 4,096.
        let p = padding(300, 3000, 4096).unwrap();
        assert_eq!(p.keys, 3072, "keys to a whole 256-token step");
        assert_eq!(p.back, 72);
        assert_eq!(p.rows(300), 512, "rows to a power of two");
        // The bottom-right alignment: the first real row still ends at key 3000 - 300.
        assert_eq!(p.keys - p.rows(300) + p.front, 3000 - 300);
        // No room past the keys: nothing padded at the back.
        let p = padding(300, 3000, 3000).unwrap();
        assert_eq!((p.back, p.keys, p.rows(300)), (0, 3000, 512));
        // A first chunk (queries = keys): rows are capped by the keys.
        let p = padding(300, 300, 4096).unwrap();
        assert_eq!((p.keys, p.rows(300), p.front), (512, 512, 0));
        // Lengths that differ fall on the same shape.
        let shapes: std::collections::HashSet<_> = (1000..1100)
            .map(|q| {
                padding(q, q + 2000, 8192)
                    .map(|p| (p.rows(q), p.keys))
                    .unwrap()
            })
            .collect();
        assert!(shapes.len() <= 2, "{shapes:?}");
        // Nothing to pad: one query, queries past the keys, keys past the room.
        assert!(padding(1, 10, 256).is_none());
        assert!(padding(20, 10, 256).is_none());
        assert!(padding(10, 300, 299).is_none());
    }

    fn max_diff(a: &[f32], b: &[f32]) -> f32 {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max)
    }

    fn reference(q: &Array, k: &Array, v: &Array, keys: i32, scale: f32) -> Vec<f32> {
        let s = k.shape();
        let k = k.slice(&[0, 0, 0, 0], &[1, s[1], keys, s[3]]).unwrap();
        let v = v.slice(&[0, 0, 0, 0], &[1, s[1], keys, s[3]]).unwrap();
        crate::fast::mlx_scaled_dot_product_attention(q, &k, &v, scale, AttentionMask::Causal)
            .unwrap()
            .astype(Dtype::F32)
            .unwrap()
            .to_vec::<f32>()
            .unwrap()
    }

    #[test]
    fn padded_attention_gives_each_real_query_what_the_unpadded_call_gives() {
        let key = crate::random::key(7).unwrap();
        let (hq, hkv, d, room) = (4, 2, 32, 700);
        // The padded and unpadded calls are two attention shapes: on CUDA their f32 products
        // (TF32) round differently, by up to ~6u (docs/cuda.md, "Tolerances on the GPU").
        let tol = 1e-5 + 6.0 * crate::f32_matmul_unit_roundoff().unwrap();
        let k = crate::random::normal(&[1, hkv, room, d], Dtype::F32, &key).unwrap();
        let v = crate::random::normal(
            &[1, hkv, room, d],
            Dtype::F32,
            &crate::random::key(8).unwrap(),
        )
        .unwrap();
        for (queries, keys) in [
            (37, 37),
            (37, 300),
            (200, 450),
            (5, 699),
            (64, 700),
            (60, 700),
        ] {
            let q = crate::random::normal(
                &[1, hq, queries, d],
                Dtype::F32,
                &crate::random::key(queries as u64).unwrap(),
            )
            .unwrap();
            let got = causal_attention_padded(&q, &k, &v, keys, 0.17)
                .unwrap()
                .expect("padded")
                .to_vec::<f32>()
                .unwrap();
            let want = reference(&q, &k, &v, keys, 0.17);
            assert_eq!(got.len(), want.len());
            let worst = max_diff(&got, &want);
            assert!(worst < tol, "({queries}, {keys}): {worst}");
        }
        // Keys past the real ones are read but never reach a real row: poison them.
        let poisoned = ops::concatenate(
            &[
                &k.slice(&[0, 0, 0, 0], &[1, hkv, 300, d]).unwrap(),
                &ops::full(&[1, hkv, room - 300, d], 1e4, Dtype::F32).unwrap(),
            ],
            2,
        )
        .unwrap();
        let q = crate::random::normal(&[1, hq, 40, d], Dtype::F32, &key).unwrap();
        let got = causal_attention_padded(&q, &poisoned, &v, 300, 0.17)
            .unwrap()
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        let want = reference(&q, &k, &v, 300, 0.17);
        let worst = max_diff(&got, &want);
        // A poisoned key (1e4) that reached a real row would move it by O(1).
        assert!(worst < tol, "poisoned keys reached a real row: {worst}");
    }
}
