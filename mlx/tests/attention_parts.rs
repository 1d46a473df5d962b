//! `fast::attention_over_parts` (attention over a sequence's KV held in several arrays)
//! against one attention over the concatenated KV, on both of its paths: the fused CPU
//! attention walking the parts in turn, and the per-part attention merged by log-sum-exp.
//! Each test prints its seed; set KVSTORE_TEST_SEED to replay one.

use mlx::fast::{self, AttentionMask};
use mlx::{Array, Dtype};
use rand::rngs::StdRng;
use rand::Rng;

mod common;
use common::rng;

fn randn(rng: &mut StdRng, shape: &[i32]) -> Array {
    let n: i32 = shape.iter().product();
    let data: Vec<f32> = (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
    Array::from_slice(&data, shape).unwrap()
}

fn host(a: &Array) -> Vec<f32> {
    a.astype(Dtype::F32).unwrap().to_vec::<f32>().unwrap()
}

/// The reference: MLX's kernel over the concatenated parts.
fn reference(q: &Array, parts: &[(Array, Array)], scale: f32, causal: bool) -> Vec<f32> {
    let ks: Vec<&Array> = parts.iter().map(|(k, _)| k).collect();
    let vs: Vec<&Array> = parts.iter().map(|(_, v)| v).collect();
    let k = mlx::ops::concatenate(&ks, 2).unwrap();
    let v = mlx::ops::concatenate(&vs, 2).unwrap();
    let mask = match causal {
        true => AttentionMask::Causal,
        false => AttentionMask::None,
    };
    host(&fast::mlx_scaled_dot_product_attention(q, &k, &v, scale, mask).unwrap())
}

/// Key lengths of the parts of each case; the last part is extended by the queries' count
/// (a cache's own part holds the tokens being attended from).
const PART_LENGTHS: &[&[i32]] = &[
    &[300, 0],
    &[1, 0],
    &[0, 5],
    &[37, 1],
    &[64, 0, 200],
    &[513, 31],
];

#[test]
fn attention_over_parts_equals_one_attention_over_the_concatenated_kv() {
    let mut r = rng("attention_over_parts_equals_one_attention_over_the_concatenated_kv");
    // On CUDA, f32 attention's products run on TF32: q·k and weights·v add ~6u (the bound
    // of `sdpa_matches_naive_*`, docs/cuda.md "Tolerances on the GPU"); on the CPU u is 2^-24.
    let u = mlx::f32_matmul_unit_roundoff().unwrap();
    // Both paths: the fused CPU attention (on where the device is the CPU) and the merge
    // (the switch off; also what every GPU call and every single query take).
    for fused in [true, false] {
        let before = fast::set_cpu_attention(fused);
        for (batch, q_heads, kv_heads, head_dim) in [(1, 9, 3, 64), (2, 6, 2, 128), (1, 4, 4, 64)] {
            for q_len in [1, 2, 7, 130] {
                for lengths in PART_LENGTHS {
                    let mut parts = Vec::new();
                    for (i, &len) in lengths.iter().enumerate() {
                        let len = if i + 1 == lengths.len() {
                            len + q_len
                        } else {
                            len
                        };
                        let shape = [batch, kv_heads, len, head_dim];
                        parts.push((randn(&mut r, &shape), randn(&mut r, &shape)));
                    }
                    let q = randn(&mut r, &[batch, q_heads, q_len, head_dim]);
                    let scale = 1.0 / (head_dim as f32).sqrt();
                    let refs: Vec<(&Array, &Array)> = parts.iter().map(|(k, v)| (k, v)).collect();
                    for causal in [false, true] {
                        let got = fast::attention_over_parts(&q, &refs, scale, causal).unwrap();
                        assert_eq!(got.shape(), q.shape());
                        assert_eq!(got.dtype(), Dtype::F32);
                        let (got, want) = (host(&got), reference(&q, &parts, scale, causal));
                        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                            assert!(
                                (g - w).abs() <= 2e-5 + 6.0 * u + 1e-4 * w.abs(),
                                "fused={fused} q {batch}x{q_heads}x{q_len}x{head_dim}, kv \
                                 heads {kv_heads}, parts {lengths:?}, causal={causal}: \
                                 element {i}: {g} vs {w}"
                            );
                        }
                    }
                }
            }
        }
        fast::set_cpu_attention(before);
    }
}

#[test]
fn attention_over_parts_keeps_the_dtype_of_bf16_queries() {
    let mut r = rng("attention_over_parts_keeps_the_dtype_of_bf16_queries");
    let bf = |a: Array| a.astype(Dtype::BF16).unwrap();
    let parts = [
        (
            bf(randn(&mut r, &[1, 2, 40, 64])),
            bf(randn(&mut r, &[1, 2, 40, 64])),
        ),
        (
            bf(randn(&mut r, &[1, 2, 9, 64])),
            bf(randn(&mut r, &[1, 2, 9, 64])),
        ),
    ];
    let q = bf(randn(&mut r, &[1, 6, 9, 64]));
    let refs: Vec<(&Array, &Array)> = parts.iter().map(|(k, v)| (k, v)).collect();
    // Prefill queries (the merge) and one decode query (the joined scores, products in
    // bf16 as MLX's unfused attention computes them).
    for q in [q, bf(randn(&mut r, &[1, 6, 1, 64]))] {
        let got = fast::attention_over_parts(&q, &refs, 0.125, true).unwrap();
        assert_eq!(got.dtype(), Dtype::BF16);
        let (got, want) = (host(&got), reference(&q, &parts, 0.125, true));
        for (g, w) in got.iter().zip(&want) {
            // bf16 holds 8 bits of mantissa: each path rounds once more than the kernel.
            assert!((g - w).abs() <= 2e-2 + 2e-2 * w.abs(), "{g} vs {w}");
        }
    }
}

#[test]
fn attention_over_parts_refuses_bad_shapes_with_an_error() {
    let mut r = rng("attention_over_parts_refuses_bad_shapes_with_an_error");
    let q = randn(&mut r, &[1, 6, 4, 64]);
    let k = randn(&mut r, &[1, 2, 3, 64]);
    let wrong_heads = randn(&mut r, &[1, 4, 3, 64]);
    let wrong_dim = randn(&mut r, &[1, 2, 3, 32]);
    // Causal with fewer keys in the last part than queries.
    assert!(fast::attention_over_parts(&q, &[(&k, &k)], 0.1, true).is_err());
    assert!(
        fast::attention_over_parts(&q, &[(&k, &k), (&wrong_heads, &wrong_heads)], 0.1, false)
            .is_err()
    );
    assert!(fast::attention_over_parts(&q, &[(&wrong_dim, &wrong_dim)], 0.1, false).is_err());
    assert!(fast::attention_over_parts(&q, &[], 0.1, false).is_err());
    let empty = randn(&mut r, &[1, 2, 0, 64]);
    assert!(fast::attention_over_parts(&q, &[(&empty, &empty)], 0.1, false).is_err());
}
