//! MLX ops from Rust checked against naive Rust references on fresh random inputs.
//! Each test prints its seed; set KVSTORE_TEST_SEED to replay one.

// Naive references index like the math they check.
#![allow(clippy::needless_range_loop)]

use half::{bf16, f16};
use mlx::cpu_attention::{attend, Dims};
use mlx::cpu_decode_attention::{attend_one_query, OneQueryDims};
use mlx::fast::{self, AttentionMask, Rope, RopeOffset};
use mlx::{Array, Dtype, Error, QuantSpec};
use rand::rngs::StdRng;
use rand::Rng;

mod common;
use common::rng;

fn randn(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect()
}

fn arr(data: &[f32], shape: &[i32]) -> Array {
    Array::from_slice(data, shape).unwrap()
}

fn host(a: &Array) -> Vec<f32> {
    a.astype(Dtype::F32).unwrap().to_vec::<f32>().unwrap()
}

/// Asserts |a - b| <= atol + rtol |b| element-wise, naming the first mismatch.
fn assert_close(got: &[f32], want: &[f32], atol: f32, rtol: f32) {
    assert_eq!(got.len(), want.len(), "length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= atol + rtol * w.abs(),
            "element {i}: got {g}, want {w} (atol {atol}, rtol {rtol})"
        );
    }
}

/// Extra absolute error of an f32 matrix product of `k` terms with operands in [-1, 1] on
/// the default device (0 in effect on the CPU; TF32 on CUDA, docs/cuda.md).
///
/// Reading a and b with relative errors |δ| ≤ u changes each term by a·b·(δa + δb), at most
/// 2u|ab|. The inputs are random, so the k errors have independent signs: their sum has a
/// standard deviation of about sqrt(E[(ab)²]·2u²/3)·sqrt(k) = 0.27·u·sqrt(k) for uniform
/// operands. 2u·sqrt(k) is 7 standard deviations; a wrong index or a missing term is off by
/// O(1).
fn product_slack(k: usize) -> f32 {
    2.0 * mlx::f32_matmul_unit_roundoff().unwrap() * (k as f32).sqrt()
}

/// Extra absolute error of attention with q, k, v in [-1, 1] and scale 1/sqrt(d) on the
/// default device: q·k has the slack of a product of d terms times the scale, 2u; softmax
/// turns a score error e into at most 2e·max|v| in the output, 4u; the weights times v
/// (weights summing to 1) add at most 2u. On the CPU this is ~4e-7.
fn attention_slack() -> f32 {
    6.0 * mlx::f32_matmul_unit_roundoff().unwrap()
}

fn naive_matmul(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            let mut acc = 0.0f64;
            for p in 0..k {
                acc += a[i * k + p] as f64 * b[p * n + j] as f64;
            }
            out[i * n + j] = acc as f32;
        }
    }
    out
}

#[test]
fn matmul_matches_naive() {
    let mut r = rng("matmul_matches_naive");
    for _ in 0..5 {
        let (m, k, n) = (r.gen_range(1..70), r.gen_range(1..90), r.gen_range(1..60));
        let a = randn(&mut r, m * k);
        let b = randn(&mut r, k * n);
        let got = host(
            &arr(&a, &[m as i32, k as i32])
                .matmul(&arr(&b, &[k as i32, n as i32]))
                .unwrap(),
        );
        let atol = 1e-5 + product_slack(k);
        assert_close(&got, &naive_matmul(&a, &b, m, k, n), atol, 1e-4);
    }
}

/// Naive attention for q [B,Hq,Lq,D], k/v [B,Hkv,Lk,D]; `mask(b,h,i,j)` is additive.
#[allow(clippy::too_many_arguments)]
fn naive_sdpa(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    (b, hq, hkv, lq, lk, d): (usize, usize, usize, usize, usize, usize),
    scale: f32,
    mask: &dyn Fn(usize, usize, usize, usize) -> f32,
) -> Vec<f32> {
    let mut out = vec![0.0f32; b * hq * lq * d];
    let group = hq / hkv;
    for bi in 0..b {
        for h in 0..hq {
            let kh = h / group;
            for i in 0..lq {
                let qrow = &q[((bi * hq + h) * lq + i) * d..][..d];
                let scores: Vec<f64> = (0..lk)
                    .map(|j| {
                        let krow = &k[((bi * hkv + kh) * lk + j) * d..][..d];
                        let dot: f64 = qrow
                            .iter()
                            .zip(krow)
                            .map(|(x, y)| *x as f64 * *y as f64)
                            .sum();
                        dot * scale as f64 + mask(bi, h, i, j) as f64
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let exps: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let total: f64 = exps.iter().sum();
                for t in 0..d {
                    let mut acc = 0.0f64;
                    for j in 0..lk {
                        acc += exps[j] / total * v[((bi * hkv + kh) * lk + j) * d + t] as f64;
                    }
                    out[((bi * hq + h) * lq + i) * d + t] = acc as f32;
                }
            }
        }
    }
    out
}

#[test]
fn sdpa_matches_naive_gqa_causal_mask_and_single_query() {
    let mut r = rng("sdpa_matches_naive_gqa_causal_mask_and_single_query");
    let atol = 1e-5 + attention_slack();
    // (B, Hq, Hkv, Lq, Lk, D): GQA 4:1 and 3:1, one query against many keys, square causal.
    let cases = [
        (1, 4, 1, 7, 7, 64),
        (2, 6, 2, 1, 300, 64),
        (1, 3, 3, 5, 9, 128),
        (2, 8, 2, 16, 40, 64),
    ];
    for dims @ (b, hq, hkv, lq, lk, d) in cases {
        let q = randn(&mut r, b * hq * lq * d);
        let k = randn(&mut r, b * hkv * lk * d);
        let v = randn(&mut r, b * hkv * lk * d);
        let (qa, ka, va) = (
            arr(&q, &[b as i32, hq as i32, lq as i32, d as i32]),
            arr(&k, &[b as i32, hkv as i32, lk as i32, d as i32]),
            arr(&v, &[b as i32, hkv as i32, lk as i32, d as i32]),
        );
        let scale = 1.0 / (d as f32).sqrt();

        let none =
            fast::scaled_dot_product_attention(&qa, &ka, &va, scale, AttentionMask::None).unwrap();
        assert_close(
            &host(&none),
            &naive_sdpa(&q, &k, &v, dims, scale, &|_, _, _, _| 0.0),
            atol,
            1e-4,
        );

        let causal =
            fast::scaled_dot_product_attention(&qa, &ka, &va, scale, AttentionMask::Causal)
                .unwrap();
        let offset = lk - lq;
        let want = naive_sdpa(&q, &k, &v, dims, scale, &|_, _, i, j| {
            if j <= i + offset {
                0.0
            } else {
                f32::NEG_INFINITY
            }
        });
        assert_close(&host(&causal), &want, atol, 1e-4);

        // Additive float mask [B, 1, Lq, Lk], broadcast over heads.
        let add: Vec<f32> = (0..b * lq * lk)
            .map(|_| {
                if r.gen_bool(0.2) {
                    -1e9
                } else {
                    r.gen_range(-2.0..2.0)
                }
            })
            .collect();
        let add = {
            let mut m = add;
            for row in m.chunks_mut(lk) {
                row[0] = 0.0; // every query sees at least one key
            }
            m
        };
        let mask = arr(&add, &[b as i32, 1, lq as i32, lk as i32]);
        let got =
            fast::scaled_dot_product_attention(&qa, &ka, &va, scale, AttentionMask::Array(&mask))
                .unwrap();
        let want = naive_sdpa(&q, &k, &v, dims, scale, &|bi, _, i, j| {
            add[(bi * lq + i) * lk + j]
        });
        assert_close(&host(&got), &want, atol, 1e-4);

        // Boolean mask: true = attend.
        let allow: Vec<bool> = (0..lq * lk)
            .map(|x| x % lk == 0 || r.gen_bool(0.6))
            .collect();
        let bytes: Vec<u8> = allow.iter().map(|&a| a as u8).collect();
        let bmask = Array::from_bytes(&bytes, &[lq as i32, lk as i32], Dtype::Bool).unwrap();
        let got =
            fast::scaled_dot_product_attention(&qa, &ka, &va, scale, AttentionMask::Array(&bmask))
                .unwrap();
        let want = naive_sdpa(&q, &k, &v, dims, scale, &|_, _, i, j| {
            if allow[i * lk + j] {
                0.0
            } else {
                f32::NEG_INFINITY
            }
        });
        assert_close(&host(&got), &want, atol, 1e-4);
    }
}

/// (B, Hq, Hkv, Lq, Lk, D) for the fused CPU attention: one query, Lq = Lk, a cached
/// prefix (Lq < Lk), GQA 3:1 and 1:1, head dims 64 and 128, lengths that are not multiples
/// of its 64-query and 256-key blocks, batches of two.
const FUSED_SHAPES: [(usize, usize, usize, usize, usize, usize); 9] = [
    (1, 9, 3, 1, 300, 64),
    (2, 3, 3, 1, 17, 128),
    (1, 9, 3, 45, 45, 64),
    (1, 2, 2, 257, 257, 128),
    (1, 9, 3, 37, 601, 64),
    (2, 4, 4, 33, 290, 128),
    (2, 6, 2, 70, 70, 64),
    (1, 3, 1, 5, 1000, 128),
    (1, 1, 1, 2, 3, 64),
];

fn attention_dims((batch, q_heads, kv_heads, q_len, kv_len, head_dim): Shape6) -> Dims {
    Dims {
        batch,
        q_heads,
        kv_heads,
        q_len,
        kv_len,
        head_dim,
    }
}

type Shape6 = (usize, usize, usize, usize, usize, usize);

/// q (scaled by 3, so the softmax is peaked enough that a wrong key shows), k and v, and
/// the naive f64-accumulated outputs without mask and with the causal mask.
fn attention_case(r: &mut StdRng, shape: Shape6) -> (Dims, [Vec<f32>; 3], [Vec<f32>; 2]) {
    let d = attention_dims(shape);
    let q: Vec<f32> = randn(r, d.q_size()).iter().map(|x| 3.0 * x).collect();
    let (k, v) = (randn(r, d.kv_size()), randn(r, d.kv_size()));
    let scale = 1.0 / (d.head_dim as f32).sqrt();
    let offset = d.kv_len as isize - d.q_len as isize;
    let none = naive_sdpa(&q, &k, &v, shape, scale, &|_, _, _, _| 0.0);
    let causal = naive_sdpa(&q, &k, &v, shape, scale, &|_, _, i, j| {
        if j as isize <= i as isize + offset {
            0.0
        } else {
            f32::NEG_INFINITY
        }
    });
    (d, [q, k, v], [none, causal])
}

/// The fused path's tolerance, |got − want| ≤ 2e-6 + 2e-5·|want|: scores of |s| ≲ 10 carry
/// ~1e-6 absolute error in f32 (u = 2^-24 per operation, d ≤ 128 terms), the exp
/// polynomial 4e-7 relative, f32 sums over ≤ 1,000 weights and products ~1e-6 relative;
/// outputs are ≤ 1. A wrong key, a key too many under the mask or a wrong head moves an
/// output by ~1e-2.
const FUSED_ATOL: f32 = 2e-6;
const FUSED_RTOL: f32 = 2e-5;

#[test]
fn fused_cpu_attention_matches_naive() {
    let mut r = rng("fused_cpu_attention_matches_naive");
    for shape in FUSED_SHAPES {
        let (d, [q, k, v], wants) = attention_case(&mut r, shape);
        let scale = 1.0 / (d.head_dim as f32).sqrt();
        for (causal, want) in [false, true].into_iter().zip(&wants) {
            let mut out = vec![f32::NAN; d.q_size()];
            attend(&q, &k, &v, &mut out, d, scale, causal).unwrap();
            assert_close(&out, want, FUSED_ATOL, FUSED_RTOL);
        }
    }
}

#[test]
fn sdpa_takes_the_fused_path_on_the_cpu_and_agrees_with_mlx_kernel() {
    let mut r = rng("sdpa_takes_the_fused_path_on_the_cpu_and_agrees_with_mlx_kernel");
    let fused_on = mlx::default_device().unwrap() == mlx::Device::Cpu && fast::cpu_attention();
    for shape in FUSED_SHAPES {
        let (d, [q, k, v], wants) = attention_case(&mut r, shape);
        let (qa, ka, va) = (
            arr(
                &q,
                &[d.batch, d.q_heads, d.q_len, d.head_dim].map(|x| x as i32),
            ),
            arr(
                &k,
                &[d.batch, d.kv_heads, d.kv_len, d.head_dim].map(|x| x as i32),
            ),
            arr(
                &v,
                &[d.batch, d.kv_heads, d.kv_len, d.head_dim].map(|x| x as i32),
            ),
        );
        let scale = 1.0 / (d.head_dim as f32).sqrt();
        let masks = [(AttentionMask::None, false), (AttentionMask::Causal, true)];
        for ((mask, causal), want) in masks.into_iter().zip(&wants) {
            let got = fast::scaled_dot_product_attention(&qa, &ka, &va, scale, mask).unwrap();
            assert_eq!(got.shape(), qa.shape());
            let got = host(&got);
            let mlx =
                host(&fast::mlx_scaled_dot_product_attention(&qa, &ka, &va, scale, mask).unwrap());
            // Both paths against the naive reference (MLX's at its own tolerance).
            assert_close(&mlx, want, 1e-5 + attention_slack(), 1e-4);
            assert_close(&got, want, 1e-5 + attention_slack(), 1e-4);
            // Which path ran: the fused ones are deterministic, so the output is exactly what
            // `attend` (more than one query) or `attend_one_query` (one) writes; a GPU stays
            // with MLX's kernel.
            if fused_on && d.q_len > 1 {
                let mut fused = vec![0f32; d.q_size()];
                attend(&q, &k, &v, &mut fused, d, scale, causal).unwrap();
                assert_eq!(got, fused, "{d:?} causal={causal}: the fused path");
            } else if fused_on {
                let mut fused = vec![0f32; d.q_size()];
                let row = [
                    d.kv_heads * d.kv_len * d.head_dim,
                    d.kv_len * d.head_dim,
                    d.head_dim,
                ];
                let dims = OneQueryDims {
                    batch: d.batch,
                    q_heads: d.q_heads,
                    kv_heads: d.kv_heads,
                    len: d.kv_len,
                    head_dim: d.head_dim,
                };
                attend_one_query(&q, &k, row, &v, row, dims, scale, &mut fused).unwrap();
                assert_eq!(got, fused, "{d:?} causal={causal}: the one-query kernel");
            } else {
                assert_eq!(got, mlx, "{d:?} causal={causal}: MLX's kernel");
            }
        }
    }
}

#[test]
fn fused_cpu_attention_reads_transposed_and_sliced_inputs() {
    // The engine's q is a transpose of [B, L, H, D] and its k, v may be slices of a longer
    // cache: the dispatch must make them row-major before it reads their buffers.
    let mut r = rng("fused_cpu_attention_reads_transposed_and_sliced_inputs");
    let shape = (1, 6, 2, 40, 90, 64);
    let (d, [q, k, v], [_, want]) = attention_case(&mut r, shape);
    let spare = Array::from_slice(&vec![7f32; 2 * 10 * 64], &[1, 2, 10, 64]).unwrap();
    let cut = |x: &[f32]| {
        let longer = mlx::ops::concatenate(&[&arr(x, &[1, 2, 90, 64]), &spare], 2).unwrap();
        longer.slice(&[0, 0, 0, 0], &[1, 2, 90, 64]).unwrap()
    };
    let qt = arr(&q, &[1, 6, 40, 64])
        .transpose(&[0, 2, 1, 3])
        .unwrap()
        .contiguous()
        .unwrap()
        .transpose(&[0, 2, 1, 3])
        .unwrap();
    let scale = 1.0 / (d.head_dim as f32).sqrt();
    let got =
        fast::scaled_dot_product_attention(&qt, &cut(&k), &cut(&v), scale, AttentionMask::Causal)
            .unwrap();
    assert_close(&host(&got), &want, 1e-5 + attention_slack(), 1e-4);
}

/// A decode step's attention reads k and v in place through their views: slices of a
/// longer arena (heads not adjacent) and, where the last axis is not contiguous (a
/// transpose), a gathered copy; both give the naive result.
#[test]
fn one_query_attention_reads_arena_slices_and_transposed_views() {
    let mut r = rng("one_query_attention_reads_arena_slices_and_transposed_views");
    let shape = (2, 9, 3, 1, 300, 64);
    let (d, [q, k, v], [want, _]) = attention_case(&mut r, shape);
    let (b, h, s) = (d.batch as i32, d.kv_heads as i32, d.kv_len as i32);
    let spare =
        Array::from_slice(&vec![7f32; (b * h * 20 * 64) as usize], &[b, h, 20, 64]).unwrap();
    let cut = |x: &[f32]| {
        let longer = mlx::ops::concatenate(&[&arr(x, &[b, h, s, 64]), &spare], 2).unwrap();
        longer.slice(&[0, 0, 0, 0], &[b, h, s, 64]).unwrap()
    };
    let transposed = |x: &[f32]| {
        arr(x, &[b, h, s, 64])
            .transpose(&[0, 1, 3, 2])
            .unwrap()
            .contiguous()
            .unwrap()
            .transpose(&[0, 1, 3, 2])
            .unwrap()
    };
    let qa = arr(&q, &[b, 9, 1, 64]);
    let scale = 1.0 / 8.0;
    for (k, v) in [(cut(&k), cut(&v)), (transposed(&k), transposed(&v))] {
        let got =
            fast::scaled_dot_product_attention(&qa, &k, &v, scale, AttentionMask::None).unwrap();
        if fast::cpu_attention() && mlx::default_device().unwrap() == mlx::Device::Cpu {
            let names = mlx::pending_primitives(&[&got]).unwrap();
            assert!(names.iter().any(|p| p == "OneQueryAttention"), "{names:?}");
        }
        assert_close(&host(&got), &want, 1e-5 + attention_slack(), 1e-4);
    }
}

#[test]
fn sdpa_leaves_other_dtypes_array_masks_and_bad_shapes_to_mlx() {
    let mut r = rng("sdpa_leaves_other_dtypes_array_masks_and_bad_shapes_to_mlx");
    let (q, k, v) = (
        randn(&mut r, 4 * 12 * 64),
        randn(&mut r, 2 * 20 * 64),
        randn(&mut r, 2 * 20 * 64),
    );
    let (qa, ka, va) = (
        arr(&q, &[1, 4, 12, 64]),
        arr(&k, &[1, 2, 20, 64]),
        arr(&v, &[1, 2, 20, 64]),
    );
    // bf16: MLX's kernel, bit for bit.
    let bf = |a: &Array| a.astype(Dtype::BF16).unwrap();
    let (qb, kb, vb) = (bf(&qa), bf(&ka), bf(&va));
    let got =
        fast::scaled_dot_product_attention(&qb, &kb, &vb, 0.125, AttentionMask::Causal).unwrap();
    assert_eq!(got.dtype(), Dtype::BF16);
    let mlx = fast::mlx_scaled_dot_product_attention(&qb, &kb, &vb, 0.125, AttentionMask::Causal)
        .unwrap();
    assert_eq!(got.to_vec::<bf16>().unwrap(), mlx.to_vec::<bf16>().unwrap());
    // An array mask: MLX's kernel, bit for bit.
    let allow: Vec<u8> = (0..12 * 20)
        .map(|i| (i % 3 != 1 || i % 20 == 0) as u8)
        .collect();
    let mask = Array::from_bytes(&allow, &[12, 20], Dtype::Bool).unwrap();
    let got = fast::scaled_dot_product_attention(&qa, &ka, &va, 0.125, AttentionMask::Array(&mask))
        .unwrap();
    let mlx =
        fast::mlx_scaled_dot_product_attention(&qa, &ka, &va, 0.125, AttentionMask::Array(&mask))
            .unwrap();
    assert_eq!(host(&got), host(&mlx));
    // q and k of different head dims: MLX's error, not a panic.
    let k32 = Array::from_slice(&vec![0f32; 2 * 20 * 32], &[1, 2, 20, 32]).unwrap();
    let result = fast::scaled_dot_product_attention(&qa, &k32, &k32, 0.125, AttentionMask::None)
        .and_then(|a| a.eval());
    assert!(
        result.is_err(),
        "q with D = 64 against k with D = 32 must fail"
    );
}

#[test]
fn fused_cpu_attention_refuses_shapes_it_cannot_compute() {
    let ok = attention_dims((1, 4, 2, 3, 5, 8));
    let (q, kv) = (vec![0f32; ok.q_size()], vec![0f32; ok.kv_size()]);
    let mut out = vec![0f32; ok.q_size()];
    let err = attend(&q[1..], &kv, &kv, &mut out, ok, 1.0, false).unwrap_err();
    assert!(err.contains("q holds"), "{err}");
    let err = attend(&q, &kv, &kv[1..], &mut out, ok, 1.0, false).unwrap_err();
    assert!(err.contains("v holds"), "{err}");
    let odd = Dims { q_heads: 3, ..ok };
    let n = odd.q_size();
    let err = attend(&q[..n], &kv, &kv, &mut out[..n], odd, 1.0, false).unwrap_err();
    assert!(err.contains("not a multiple"), "{err}");
    // Causal with more queries than keys: the first queries would see no key.
    let wide = Dims {
        q_len: 6,
        kv_len: 5,
        ..ok
    };
    let (qw, mut ow) = (vec![0f32; wide.q_size()], vec![0f32; wide.q_size()]);
    let err = attend(&qw, &kv, &kv, &mut ow, wide, 1.0, true).unwrap_err();
    assert!(err.contains("no key"), "{err}");
    attend(&qw, &kv, &kv, &mut ow, wide, 1.0, false).unwrap();
    let empty = Dims { kv_len: 0, ..ok };
    assert!(attend(&q, &[], &[], &mut out, empty, 1.0, false).is_err());
}

/// Naive RoPE on [B, H, L, D]; positions are (offset(b) + l) * scale; `inv_freq[i]` per pair.
fn naive_rope(
    x: &[f32],
    (b, h, l, d): (usize, usize, usize, usize),
    dims: usize,
    traditional: bool,
    inv_freq: &[f64],
    scale: f64,
    offset: &dyn Fn(usize) -> i32,
) -> Vec<f32> {
    let mut out = x.to_vec();
    for bi in 0..b {
        for hi in 0..h {
            for li in 0..l {
                let row = ((bi * h + hi) * l + li) * d;
                let pos = (offset(bi) as f64 + li as f64) * scale;
                for i in 0..dims / 2 {
                    let (a, c) = if traditional {
                        (row + 2 * i, row + 2 * i + 1)
                    } else {
                        (row + i, row + i + dims / 2)
                    };
                    let theta = pos * inv_freq[i];
                    let (x1, x2) = (x[a] as f64, x[c] as f64);
                    out[a] = (x1 * theta.cos() - x2 * theta.sin()) as f32;
                    out[c] = (x1 * theta.sin() + x2 * theta.cos()) as f32;
                }
            }
        }
    }
    out
}

/// MLX computes the angle pos · inv_freq in f32: its error grows with the position
/// (≈ pos · 2⁻²³ rad, times |x| ≤ 1 and √2 for the pair), on top of a small base tolerance.
fn angle_tolerance(max_pos: i32) -> f32 {
    2e-4 + (max_pos as f32 + 8.0) * 1.2e-7 * 2.0
}

#[test]
fn rope_matches_naive_both_modes_scalar_and_per_row_offsets() {
    let mut r = rng("rope_matches_naive_both_modes_scalar_and_per_row_offsets");
    let (b, h, l, d) = (3, 2, 5, 64);
    let x = randn(&mut r, b * h * l * d);
    let xa = arr(&x, &[b as i32, h as i32, l as i32, d as i32]);
    for traditional in [false, true] {
        for dims in [64usize, 32] {
            let base = 10000.0f32;
            let inv: Vec<f64> = (0..dims / 2)
                .map(|i| (base as f64).powf(-2.0 * i as f64 / dims as f64))
                .collect();
            let cfg = Rope {
                dims: dims as i32,
                traditional,
                base,
                scale: 1.0,
                freqs: None,
            };
            let off = r.gen_range(0..5000);
            let got = fast::rope(&xa, &cfg, RopeOffset::Scalar(off)).unwrap();
            let want = naive_rope(&x, (b, h, l, d), dims, traditional, &inv, 1.0, &|_| off);
            assert_close(&host(&got), &want, angle_tolerance(off), 1e-4);

            let offs: Vec<i32> = (0..b).map(|_| r.gen_range(0..3000)).collect();
            let oa = Array::from_slice(&offs, &[b as i32]).unwrap();
            let got = fast::rope(&xa, &cfg, RopeOffset::PerRow(&oa)).unwrap();
            let want = naive_rope(&x, (b, h, l, d), dims, traditional, &inv, 1.0, &|bi| {
                offs[bi]
            });
            assert_close(&host(&got), &want, angle_tolerance(3000), 1e-4);
        }
        // Explicit frequencies (as Llama 3 scaling passes them): theta = pos / freqs[i].
        let freqs: Vec<f32> = (0..d / 2)
            .map(|i| 10000f32.powf(2.0 * i as f32 / d as f32) * r.gen_range(1.0..4.0))
            .collect();
        let fa = arr(&freqs, &[(d / 2) as i32]);
        let cfg = Rope {
            dims: d as i32,
            traditional,
            base: 0.0,
            scale: 0.5,
            freqs: Some(&fa),
        };
        let got = fast::rope(&xa, &cfg, RopeOffset::Scalar(17)).unwrap();
        let inv: Vec<f64> = freqs.iter().map(|f| 1.0 / *f as f64).collect();
        let want = naive_rope(&x, (b, h, l, d), d, traditional, &inv, 0.5, &|_| 17);
        assert_close(&host(&got), &want, 2e-4, 1e-4);
    }
}

/// `fast::rope_with_angles` (angles made once, as the engine makes them a step) equals
/// `fast::rope` bit for bit and the naive rotation to float rounding, both modes, all or
/// half the features, one offset or one per row, over views read in place (the transpose
/// of `[B, T, H, D]` heads sliced out of wider rows, as a step's q/k/v are) and a prefill's
/// worth of heads (the kernel's threads). On the CPU an f32 rotation is one `RopeRotate`
/// node.
#[test]
fn rope_with_angles_equals_rope_bit_for_bit_in_one_cpu_node() {
    let mut r = rng("rope_with_angles_equals_rope_bit_for_bit_in_one_cpu_node");
    let on_cpu = mlx::default_device().unwrap() == mlx::Device::Cpu && fast::cpu_attention();
    for (b, h, l, d) in [
        (3usize, 4usize, 1usize, 16usize),
        (1, 4, 7, 16),
        (1, 8, 1024, 16),
    ] {
        // Rows of [q | k] per token: the heads are the first h·d values of each.
        let wide = randn(&mut r, b * l * 2 * h * d);
        let rows = arr(&wide, &[b as i32, l as i32, (2 * h * d) as i32]);
        let x = rows
            .slice(&[0, 0, 0], &[b as i32, l as i32, (h * d) as i32])
            .unwrap()
            .reshape(&[b as i32, l as i32, h as i32, d as i32])
            .unwrap()
            .transpose(&[0, 2, 1, 3])
            .unwrap();
        let mut plain = vec![0f32; b * h * l * d];
        for (bi, li, hi, di) in (0..b)
            .flat_map(|bi| (0..l).map(move |li| (bi, li)))
            .flat_map(|(bi, li)| (0..h).flat_map(move |hi| (0..d).map(move |di| (bi, li, hi, di))))
        {
            plain[((bi * h + hi) * l + li) * d + di] =
                wide[(bi * l + li) * 2 * h * d + hi * d + di];
        }
        mlx::eval(&[&x]).unwrap();
        for traditional in [false, true] {
            for dims in [d, d / 2] {
                let cfg = Rope {
                    dims: dims as i32,
                    traditional,
                    base: 10000.0,
                    scale: 1.0,
                    freqs: None,
                };
                let inv: Vec<f64> = (0..dims / 2)
                    .map(|i| 10000f64.powf(-2.0 * i as f64 / dims as f64))
                    .collect();
                let offs: Vec<i32> = (0..b).map(|_| r.gen_range(0..3000)).collect();
                let oa = Array::from_slice(&offs, &[b as i32]).unwrap();
                let cases = [
                    (RopeOffset::Scalar(offs[0]), offs[0..1].repeat(b)),
                    (RopeOffset::PerRow(&oa), offs.clone()),
                ];
                for (offset, at) in cases {
                    let angles = fast::rope_angles(&cfg, offset, l as i32, Dtype::F32).unwrap();
                    let got = fast::rope_with_angles(&x, &cfg, &angles).unwrap();
                    if on_cpu {
                        // The angles and the heads are inputs made before it: one node.
                        let (cos, sin) = angles.parts();
                        mlx::eval(&[cos, sin]).unwrap();
                        let names = mlx::pending_primitives(&[&got]).unwrap();
                        assert_eq!(names, vec!["RopeRotate".to_string()]);
                    }
                    let want = fast::rope(&x, &cfg, offset).unwrap();
                    let what = format!("[{b}, {h}, {l}, {d}], dims {dims}, {traditional}");
                    if on_cpu {
                        assert_eq!(host(&got), host(&want), "{what}");
                    }
                    let naive =
                        naive_rope(&plain, (b, h, l, d), dims, traditional, &inv, 1.0, &|bi| {
                            at[bi]
                        });
                    assert_close(&host(&got), &naive, angle_tolerance(3000 + l as i32), 1e-4);
                }
            }
        }
    }
    // Shapes that do not fit are errors, not a crash.
    let cfg = Rope {
        dims: 8,
        traditional: false,
        base: 10000.0,
        scale: 1.0,
        freqs: None,
    };
    let angles = fast::rope_angles(&cfg, RopeOffset::Scalar(0), 3, Dtype::F32).unwrap();
    let short = arr(&[0.0; 2 * 4 * 2 * 8], &[2, 4, 2, 8]);
    if on_cpu {
        assert!(fast::rope_with_angles(&short, &cfg, &angles).is_err());
    }
}

/// `fast::gated_mul_stacked` against each activation's f64 definition for a decode step's
/// row, a few rows, a prefill's rows and a strided view of them, both gates, and against MLX's
/// ops over the halves (`fast::gated_mul`); on the CPU an f32 call is one `GatedMulStacked`
/// node whatever its rows.
#[test]
fn gated_mul_stacked_matches_its_definition_in_one_cpu_node() {
    let mut r = rng("gated_mul_stacked_matches_its_definition_in_one_cpu_node");
    let on_cpu = mlx::default_device().unwrap() == mlx::Device::Cpu && fast::cpu_attention();
    let c = (2.0 / std::f64::consts::PI).sqrt();
    for (gate, f) in [
        (
            fast::Gate::Silu,
            Box::new(|g: f64| g / (1.0 + (-g).exp())) as Box<dyn Fn(f64) -> f64>,
        ),
        (
            fast::Gate::GeluTanh,
            Box::new(move |g: f64| 0.5 * g * (1.0 + (c * (g + 0.044715 * g * g * g)).tanh())),
        ),
    ] {
        for (rows, inter) in [(1usize, 96usize), (3, 40), (40, 24)] {
            let y: Vec<f32> = randn(&mut r, rows * 2 * inter)
                .iter()
                .map(|v| v * 4.0)
                .collect();
            let want: Vec<f32> = (0..rows * inter)
                .map(|i| {
                    let (row, j) = (i / inter, i % inter);
                    let (g, u) = (
                        y[row * 2 * inter + j] as f64,
                        y[row * 2 * inter + inter + j] as f64,
                    );
                    (f(g) * u) as f32
                })
                .collect();
            // Contiguous [1, rows, 2·inter], and the same values as the transpose of a
            // [2·inter, rows] array (read through strides).
            let mut yt = vec![0f32; y.len()];
            for row in 0..rows {
                for j in 0..2 * inter {
                    yt[j * rows + row] = y[row * 2 * inter + j];
                }
            }
            let inputs = [
                arr(&y, &[1, rows as i32, (2 * inter) as i32]),
                arr(&yt, &[(2 * inter) as i32, rows as i32])
                    .transpose(&[1, 0])
                    .unwrap(),
            ];
            for ya in inputs {
                mlx::eval(&[&ya]).unwrap();
                let got = fast::gated_mul_stacked(gate, &ya).unwrap();
                let mut shape = ya.shape();
                *shape.last_mut().unwrap() = inter as i32;
                assert_eq!(got.shape(), shape);
                if on_cpu {
                    let names = mlx::pending_primitives(&[&got]).unwrap();
                    assert_eq!(
                        names,
                        vec!["GatedMulStacked".to_string()],
                        "{gate:?} {rows}"
                    );
                }
                assert_close(&host(&got), &want, 1e-5, 2e-6);
                // MLX's ops over the halves agree to float rounding.
                let w = ya.shape().len() - 1;
                let (mut a, mut b) = (vec![0; w + 1], ya.shape());
                b[w] = inter as i32;
                let g = ya.slice(&a, &b).unwrap();
                (a[w], b[w]) = (inter as i32, 2 * inter as i32);
                let u = ya.slice(&a, &b).unwrap();
                let theirs = fast::gated_mul(gate, &g, &u).unwrap();
                assert_close(&host(&got), &host(&theirs), 1e-5, 1e-5);
            }
        }
    }
    assert!(fast::gated_mul_stacked(fast::Gate::Silu, &arr(&[1.0; 6], &[2, 3])).is_err());
}

#[test]
fn rms_norm_matches_naive() {
    let mut r = rng("rms_norm_matches_naive");
    let (rows, n) = (7, 576);
    let x = randn(&mut r, rows * n);
    let w = randn(&mut r, n);
    let eps = 1e-5f32;
    let got = host(
        &fast::rms_norm(
            &arr(&x, &[rows as i32, n as i32]),
            Some(&arr(&w, &[n as i32])),
            eps,
        )
        .unwrap(),
    );
    let mut want = vec![0.0; rows * n];
    for i in 0..rows {
        let row = &x[i * n..][..n];
        let ms: f64 = row.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / n as f64;
        let inv = 1.0 / (ms + eps as f64).sqrt();
        for j in 0..n {
            want[i * n + j] = (row[j] as f64 * inv * w[j] as f64) as f32;
        }
    }
    assert_close(&got, &want, 1e-5, 1e-4);
    let unweighted = host(&fast::rms_norm(&arr(&x, &[rows as i32, n as i32]), None, eps).unwrap());
    let want_unweighted: Vec<f32> = want.iter().enumerate().map(|(i, v)| v / w[i % n]).collect();
    assert_close(&unweighted, &want_unweighted, 1e-4, 1e-3);
}

/// Unpacks MLX's affine layout by hand: `bits`-bit values, lowest bits first in each u32.
fn naive_dequantize(
    packed: &[u32],
    scales: &[f32],
    biases: &[f32],
    rows: usize,
    cols: usize,
    spec: QuantSpec,
) -> Vec<f32> {
    let bits = spec.bits as usize;
    let per_word = 32 / bits;
    let words_per_row = cols / per_word;
    let mut out = vec![0.0f32; rows * cols];
    for i in 0..rows {
        for j in 0..cols {
            let word = packed[i * words_per_row + j / per_word];
            let q = (word >> ((j % per_word) * bits)) & ((1u32 << bits) - 1);
            let g = i * (cols / spec.group_size as usize) + j / spec.group_size as usize;
            out[i * cols + j] = q as f32 * scales[g] + biases[g];
        }
    }
    out
}

#[test]
fn quantize_round_trip_and_quantized_matmul_match_naive() {
    let mut r = rng("quantize_round_trip_and_quantized_matmul_match_naive");
    let (rows, cols) = (48, 256);
    let w = randn(&mut r, rows * cols);
    let wa = arr(&w, &[rows as i32, cols as i32]);
    let x = randn(&mut r, 5 * cols);
    let xa = arr(&x, &[5, cols as i32]);
    for (group, bits) in [(32, 4), (64, 4), (32, 8), (64, 8)] {
        let spec = QuantSpec::new(group, bits).unwrap();
        let q = mlx::quantize(&wa, spec).unwrap();
        assert_eq!(
            q.packed.shape(),
            vec![rows as i32, (cols * bits as usize / 32) as i32]
        );
        assert_eq!(q.scales.shape(), vec![rows as i32, cols as i32 / group]);
        let packed = q.packed.to_vec::<u32>().unwrap();
        let scales = host(&q.scales);
        let biases = host(&q.biases);
        let naive = naive_dequantize(&packed, &scales, &biases, rows, cols, spec);

        // MLX's dequantize is exactly the documented affine map of the packed values.
        assert_close(&host(&mlx::dequantize(&q).unwrap()), &naive, 1e-6, 1e-6);
        // MLX anchors each group's grid at its larger-magnitude edge (bias = edge, scale
        // stretched so the edge is exact), so the far end can lose up to one step.
        for (i, (a, b)) in w.iter().zip(&naive).enumerate() {
            let step = scales[i / group as usize].abs();
            assert!(
                (a - b).abs() <= step + 1e-5,
                "element {i}: {a} vs {b}, step {step}, bits {bits}"
            );
        }
        // x @ w.T without dequantizing equals the matmul with the dequantized matrix.
        let got = host(&mlx::quantized_matmul(&xa, &q, true).unwrap());
        let mut wt = vec![0.0f32; cols * rows];
        for i in 0..rows {
            for j in 0..cols {
                wt[j * rows + i] = naive[i * cols + j];
            }
        }
        assert_close(&got, &naive_matmul(&x, &wt, 5, cols, rows), 1e-4, 1e-3);
    }
    assert!(QuantSpec::new(48, 4).is_err());
}

#[test]
fn take_take_along_axis_and_concatenate_match_naive() {
    let mut r = rng("take_take_along_axis_and_concatenate_match_naive");
    let (n, d) = (10, 6);
    let x = randn(&mut r, n * d);
    let xa = arr(&x, &[n as i32, d as i32]);
    let idx: Vec<i32> = (0..7).map(|_| r.gen_range(0..n as i32)).collect();
    let got = host(&xa.take(&Array::from_slice(&idx, &[7]).unwrap(), 0).unwrap());
    let want: Vec<f32> = idx
        .iter()
        .flat_map(|&i| x[i as usize * d..][..d].to_vec())
        .collect();
    assert_eq!(got, want);

    let along: Vec<u32> = (0..n * 2).map(|_| r.gen_range(0..d as u32)).collect();
    let got = host(
        &xa.take_along_axis(&Array::from_slice(&along, &[n as i32, 2]).unwrap(), 1)
            .unwrap(),
    );
    let want: Vec<f32> = (0..n * 2)
        .map(|p| x[(p / 2) * d + along[p] as usize])
        .collect();
    assert_eq!(got, want);

    let y = randn(&mut r, 3 * d);
    let ya = arr(&y, &[3, d as i32]);
    let got = host(&mlx::ops::concatenate(&[&xa, &ya], 0).unwrap());
    assert_eq!(got, [x.clone(), y.clone()].concat());
    let z = randn(&mut r, n * 2);
    let got = mlx::ops::concatenate(&[&xa, &arr(&z, &[n as i32, 2])], 1).unwrap();
    assert_eq!(got.shape(), vec![n as i32, d as i32 + 2]);
    let want: Vec<f32> = (0..n)
        .flat_map(|i| [x[i * d..][..d].to_vec(), z[i * 2..][..2].to_vec()].concat())
        .collect();
    assert_eq!(host(&got), want);
}

#[test]
fn slice_update_writes_the_slice_in_place_when_it_owns_the_buffer() {
    let mut r = rng("slice_update_writes_the_slice_in_place_when_it_owns_the_buffer");
    let base = randn(&mut r, 8 * 4);
    let upd = randn(&mut r, 3 * 4);
    let mut want = base.clone();
    want[2 * 4..5 * 4].copy_from_slice(&upd);

    // Sole owner: the result reuses the buffer. On the CPU always. On a GPU (CUDA), the
    // backend keeps its own reference to the arrays a kernel used until a completion
    // callback runs, which can come after `eval` returns: MLX then sees a second owner and
    // copies. Seen on the H200 in the first run of a fresh process (kernels compiled on
    // first use), never after. There the test asks for one in-place update in 5 tries.
    let tries = if mlx::default_device().unwrap() == mlx::Device::Cpu {
        1
    } else {
        5
    };
    let mut in_place = 0;
    for _ in 0..tries {
        let a = arr(&base, &[8, 4]).add_scalar(0.0).unwrap(); // an MLX-owned buffer
        a.eval().unwrap();
        let addr = a.data_addr().unwrap();
        let b = a
            .slice_update(&arr(&upd, &[3, 4]), &[2, 0], &[5, 4])
            .unwrap();
        b.eval().unwrap();
        assert_eq!(host(&b), want);
        in_place += usize::from(b.data_addr().unwrap() == addr);
    }
    assert!(
        in_place > 0,
        "slice_update copied although it owned the buffer ({tries} tries)"
    );

    // A live clone forces a copy and keeps its own contents.
    let a = arr(&base, &[8, 4]).add_scalar(0.0).unwrap();
    a.eval().unwrap();
    let keep = a.clone();
    let b = a
        .slice_update(&arr(&upd, &[3, 4]), &[2, 0], &[5, 4])
        .unwrap();
    b.eval().unwrap();
    assert_eq!(host(&b), want);
    assert_eq!(host(&keep), base);
    assert_ne!(b.data_addr().unwrap(), keep.data_addr().unwrap());
}

/// Naive scatter of `updates` `[B, 1, H, 1, D]` into `a` `[S, H, C, D]` at row `slots[b]`,
/// column `cols[b]` (a batch arena's decode write).
fn naive_scatter_rows(
    a: &[f32],
    (s, h, c, d): (usize, usize, usize, usize),
    slots: &[usize],
    cols: &[usize],
    updates: &[f32],
) -> Vec<f32> {
    let mut out = a.to_vec();
    assert_eq!(out.len(), s * h * c * d);
    for (b, (&slot, &col)) in slots.iter().zip(cols).enumerate() {
        for hh in 0..h {
            for dd in 0..d {
                out[((slot * h + hh) * c + col) * d + dd] = updates[(b * h + hh) * d + dd];
            }
        }
    }
    out
}

#[test]
fn scatter_writes_each_row_at_its_own_column_like_a_naive_reference() {
    let mut r = rng("scatter_writes_each_row_at_its_own_column_like_a_naive_reference");
    let (s, h, c, d) = (6usize, 3usize, 9usize, 4usize);
    let base = randn(&mut r, s * h * c * d);
    let slots = [4usize, 0, 5, 2];
    let cols: Vec<usize> = slots.iter().map(|_| r.gen_range(0..c)).collect();
    let upd = randn(&mut r, slots.len() * h * d);
    let want = naive_scatter_rows(&base, (s, h, c, d), &slots, &cols, &upd);
    let idx = |v: &[usize]| {
        let v: Vec<i32> = v.iter().map(|&x| x as i32).collect();
        Array::from_slice(&v, &[v.len() as i32]).unwrap()
    };
    let (si, ci) = (idx(&slots), idx(&cols));
    let updates = arr(&upd, &[slots.len() as i32, 1, h as i32, 1, d as i32]);
    let shape = [s as i32, h as i32, c as i32, d as i32];

    let a = arr(&base, &shape).add_scalar(0.0).unwrap();
    a.eval().unwrap();
    let addr = a.data_addr().unwrap();
    let got = a.scatter(&[&si, &ci], &updates, &[0, 2]).unwrap();
    got.eval().unwrap();
    assert_eq!(host(&got), want);
    if mlx::default_device().unwrap() == mlx::Device::Cpu {
        assert_eq!(
            got.data_addr().unwrap(),
            addr,
            "scatter copied its sole-owned input"
        );
    }
    // Unchecked: the same writes for indices in range.
    let a = arr(&base, &shape);
    // SAFETY: every slot is < 6 and every column < 9.
    let got = unsafe { a.scatter_unchecked(&[&si, &ci], &updates, &[0, 2]) }.unwrap();
    assert_eq!(host(&got), want);

    // Out-of-range indices are clamped into the array, never written outside it.
    let far = idx(&[s + 7, 0, 3, 2]);
    let far_cols = idx(&[c + 3, cols[1], cols[2], cols[3]]);
    let clamped = naive_scatter_rows(
        &base,
        (s, h, c, d),
        &[s - 1, 0, 3, 2],
        &[c - 1, cols[1], cols[2], cols[3]],
        &upd,
    );
    let got = arr(&base, &shape)
        .scatter(&[&far, &far_cols], &updates, &[0, 2])
        .unwrap();
    assert_eq!(host(&got), clamped);

    // One index array per axis, or an error.
    assert!(arr(&base, &shape)
        .scatter(&[&si], &updates, &[0, 2])
        .is_err());
    assert!(arr(&base, &shape)
        .scatter(&[&si, &ci], &updates, &[0, 7])
        .is_err());
}

#[test]
fn dtype_round_trips_are_exact() {
    let mut r = rng("dtype_round_trips_are_exact");
    let f: Vec<f32> = randn(&mut r, 33);
    assert_eq!(
        Array::from_slice(&f, &[3, 11])
            .unwrap()
            .to_vec::<f32>()
            .unwrap(),
        f
    );
    let h: Vec<f16> = f.iter().map(|v| f16::from_f32(*v)).collect();
    assert_eq!(
        Array::from_slice(&h, &[33])
            .unwrap()
            .to_vec::<f16>()
            .unwrap(),
        h
    );
    let bh: Vec<bf16> = f.iter().map(|v| bf16::from_f32(*v)).collect();
    assert_eq!(
        Array::from_slice(&bh, &[33])
            .unwrap()
            .to_vec::<bf16>()
            .unwrap(),
        bh
    );
    let i: Vec<i32> = (0..33).map(|_| r.gen()).collect();
    assert_eq!(
        Array::from_slice(&i, &[33])
            .unwrap()
            .to_vec::<i32>()
            .unwrap(),
        i
    );
    let u: Vec<u32> = (0..33).map(|_| r.gen()).collect();
    assert_eq!(
        Array::from_slice(&u, &[33])
            .unwrap()
            .to_vec::<u32>()
            .unwrap(),
        u
    );
    let b: Vec<u8> = (0..33).map(|_| r.gen()).collect();
    assert_eq!(
        Array::from_slice(&b, &[33])
            .unwrap()
            .to_vec::<u8>()
            .unwrap(),
        b
    );

    // astype rounds like the `half` crate (round to nearest even).
    let a = Array::from_slice(&f, &[33]).unwrap();
    assert_eq!(a.astype(Dtype::BF16).unwrap().to_vec::<bf16>().unwrap(), bh);
    assert_eq!(a.astype(Dtype::F16).unwrap().to_vec::<f16>().unwrap(), h);
    let back = a
        .astype(Dtype::BF16)
        .unwrap()
        .astype(Dtype::F32)
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    assert_eq!(back, bh.iter().map(|v| v.to_f32()).collect::<Vec<_>>());

    // A strided view is copied out row-major.
    let m = Array::from_slice(&f[..30], &[5, 6])
        .unwrap()
        .transpose(&[1, 0])
        .unwrap();
    let want: Vec<f32> = (0..30).map(|p| f[(p % 5) * 6 + p / 5]).collect();
    assert_eq!(m.to_vec::<f32>().unwrap(), want);
}

#[test]
fn elementwise_softmax_argmax_topk_match_naive() {
    let mut r = rng("elementwise_softmax_argmax_topk_match_naive");
    let (rows, n) = (4, 50);
    let x: Vec<f32> = randn(&mut r, rows * n).iter().map(|v| v * 4.0).collect();
    let xa = arr(&x, &[rows as i32, n as i32]);
    let naive = |f: &dyn Fn(f64) -> f64| x.iter().map(|v| f(*v as f64) as f32).collect::<Vec<_>>();
    assert_close(&host(&xa.exp().unwrap()), &naive(&|v| v.exp()), 1e-6, 1e-5);
    assert_close(
        &host(&xa.abs().unwrap().log().unwrap()),
        &naive(&|v| v.abs().ln()),
        1e-5,
        1e-5,
    );
    assert_close(
        &host(&xa.silu().unwrap()),
        &naive(&|v| v / (1.0 + (-v).exp())),
        1e-6,
        1e-5,
    );
    let gelu = |v: f64| {
        0.5 * v * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (v + 0.044715 * v.powi(3))).tanh())
    };
    assert_close(&host(&xa.gelu_tanh().unwrap()), &naive(&gelu), 1e-5, 1e-5);
    let y = randn(&mut r, rows * n);
    let ya = arr(&y, &[rows as i32, n as i32]);
    let prod: Vec<f32> = x.iter().zip(&y).map(|(a, b)| a * b).collect();
    assert_eq!(host(&xa.mul(&ya).unwrap()), prod);
    let sum: Vec<f32> = x.iter().zip(&y).map(|(a, b)| a + b).collect();
    assert_eq!(host(&xa.add(&ya).unwrap()), sum);

    let sm = host(&xa.softmax(-1, true).unwrap());
    let am: Vec<u32> = xa.argmax(-1, false).unwrap().to_vec().unwrap();
    let tk = xa.topk(3, -1).unwrap().sort(-1).unwrap();
    let tk = host(&tk);
    for i in 0..rows {
        let row = &x[i * n..][..n];
        let max = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let total: f64 = row.iter().map(|v| ((v - max) as f64).exp()).sum();
        let want: Vec<f32> = row
            .iter()
            .map(|v| (((v - max) as f64).exp() / total) as f32)
            .collect();
        assert_close(&sm[i * n..][..n], &want, 1e-6, 1e-5);
        let best = row
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .unwrap()
            .0;
        assert_eq!(am[i] as usize, best);
        let mut sorted = row.to_vec();
        sorted.sort_by(|a, b| a.total_cmp(b));
        assert_eq!(&tk[i * 3..][..3], &sorted[n - 3..]);
    }
}

#[test]
fn categorical_sampling_is_reproducible_with_a_seeded_key() {
    let mut r = rng("categorical_sampling_is_reproducible_with_a_seeded_key");
    let logits = arr(&randn(&mut r, 8 * 100), &[8, 100]);
    let seed = r.gen();
    let draw = |seed| {
        mlx::random::categorical(&logits, -1, &mlx::random::key(seed).unwrap())
            .unwrap()
            .to_vec::<u32>()
            .unwrap()
    };
    assert_eq!(draw(seed), draw(seed));
    let draws: std::collections::HashSet<Vec<u32>> =
        (0..5u64).map(|s| draw(seed.wrapping_add(s))).collect();
    assert!(draws.len() > 1, "different keys gave identical samples");
    // A distribution with all mass on one index always yields it.
    let mut peaked = vec![-1e30f32; 100];
    peaked[37] = 0.0;
    let p = arr(&peaked, &[1, 100]);
    for s in 0..10 {
        let got = mlx::random::categorical(&p, -1, &mlx::random::key(s).unwrap())
            .unwrap()
            .to_vec::<u32>()
            .unwrap();
        assert_eq!(got, vec![37]);
    }
}

#[test]
fn safetensors_written_by_an_independent_writer_load_exactly() {
    let mut r = rng("safetensors_written_by_an_independent_writer_load_exactly");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.safetensors");
    let a = randn(&mut r, 6);
    let b: Vec<bf16> = randn(&mut r, 4)
        .iter()
        .map(|v| bf16::from_f32(*v))
        .collect();
    let a_bytes: Vec<u8> = bytemuck_bytes(&a);
    let b_bytes: Vec<u8> = b.iter().flat_map(|v| v.to_le_bytes()).collect();
    let views = vec![
        (
            "a",
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![2, 3], &a_bytes)
                .unwrap(),
        ),
        (
            "b",
            safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, vec![4], &b_bytes)
                .unwrap(),
        ),
    ];
    let meta =
        std::collections::HashMap::from([("format".to_string(), "kvstore-test".to_string())]);
    safetensors::serialize_to_file(views, &Some(meta), &path).unwrap();

    let file = mlx::io::load_safetensors(&path).unwrap();
    assert_eq!(file.tensors["a"].shape(), vec![2, 3]);
    assert_eq!(file.tensors["a"].to_vec::<f32>().unwrap(), a);
    assert_eq!(file.tensors["b"].to_vec::<bf16>().unwrap(), b);
    assert_eq!(file.metadata["format"], "kvstore-test");

    // And MLX's own writer round-trips through the same loader.
    let path2 = dir.path().join("u.safetensors");
    mlx::io::save_safetensors(&path2, &[("x", &file.tensors["a"])], &[("k", "v")]).unwrap();
    let back = mlx::io::load_safetensors(&path2).unwrap();
    assert_eq!(back.tensors["x"].to_vec::<f32>().unwrap(), a);
    assert_eq!(back.metadata["k"], "v");
}

fn bytemuck_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

#[test]
fn gguf_loads_the_default_model_with_quantized_tensors_and_metadata() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        path.is_file(),
        "{} is missing: run `bash scripts/setup.sh`",
        path.display()
    );
    let file = mlx::io::load_gguf(&path).unwrap();
    match &file.metadata["general.architecture"] {
        mlx::io::GgufValue::String(s) => assert_eq!(s, "llama"),
        other => panic!("general.architecture is {other:?}"),
    }
    match &file.metadata["tokenizer.ggml.tokens"] {
        mlx::io::GgufValue::Strings(v) => assert_eq!(v.len(), 49152),
        other => panic!("tokenizer.ggml.tokens is {other:?}"),
    }
    match &file.metadata["llama.block_count"] {
        mlx::io::GgufValue::Array(a) => assert_eq!(a.item_i32().unwrap(), 30),
        other => panic!("llama.block_count is {other:?}"),
    }
    // Q4_1 keeps its quantization: packed uint32 plus scales and biases.
    let q = &file.tensors["blk.0.attn_q.weight"];
    assert_eq!(q.dtype(), Dtype::U32);
    assert_eq!(q.shape(), vec![576, 576 * 4 / 32]);
    assert!(file.tensors.contains_key("blk.0.attn_q.scales"));
    assert!(file.tensors.contains_key("blk.0.attn_q.biases"));
}

#[test]
fn errors_carry_mlx_messages_instead_of_aborting() {
    let a = arr(&[1.0, 2.0, 3.0, 4.0], &[2, 2]);
    let b = arr(&[1.0, 2.0, 3.0], &[3, 1]);
    match a.matmul(&b) {
        Err(Error::Mlx { op, message }) => {
            assert_eq!(op, "matmul");
            assert!(
                message.contains("(2,2)") && message.contains("(3,1)"),
                "{message}"
            );
        }
        other => panic!("expected an MLX error, got {other:?}"),
    }
    assert!(matches!(
        a.reshape(&[3, 3]),
        Err(Error::Mlx { op: "reshape", .. })
    ));
    assert!(matches!(
        Array::from_bytes(&[0u8; 7], &[2], Dtype::F32),
        Err(Error::Mlx { .. })
    ));
    assert!(matches!(
        a.to_vec::<i32>(),
        Err(Error::DtypeMismatch {
            expected: Dtype::I32,
            actual: Dtype::F32
        })
    ));
    assert!(
        mlx::io::load_safetensors(std::path::Path::new("/nonexistent/file.safetensors")).is_err()
    );
    // A lazy graph with a bad op fails when built, not later during eval.
    let bad = a.slice(&[0, 0], &[2, 2]).unwrap().reshape(&[5]);
    assert!(bad.is_err());
}

#[test]
fn memory_counters_track_live_arrays() {
    let before = mlx::active_memory().unwrap();
    let big = mlx::ops::full(&[1024, 1024], 1.5, Dtype::F32).unwrap();
    big.eval().unwrap();
    assert!(
        mlx::active_memory().unwrap() >= big.nbytes(),
        "active memory below one live 4 MiB array (before: {before})"
    );
    assert!(mlx::peak_memory().unwrap() >= 4 << 20);
    drop(big);
    mlx::set_cache_limit(0).unwrap();
    mlx::clear_cache().unwrap();
    assert_eq!(mlx::cache_memory().unwrap(), 0);
    // MLX defaults to the GPU where its backend has one (mlx-cuda), else to the CPU.
    let expected = if mlx::gpu_available().unwrap() {
        mlx::Device::Gpu
    } else {
        mlx::Device::Cpu
    };
    assert_eq!(mlx::default_device().unwrap(), expected);
}

/// Large host ⇄ device copies (the KV of a restore or a publication) round-trip bit for bit,
/// through the CUDA driver where that path is live and through MLX's own otherwise, and the
/// two paths give the same array. On a CUDA libmlx the direct path must be live: without it
/// restores and publications fall back to page-faulted managed memory (docs/mlx.md).
#[test]
fn large_transfers_round_trip_on_both_paths() {
    let cuda = mlx::gpu_available().unwrap() && !cfg!(target_os = "macos");
    assert_eq!(
        mlx::direct_transfers(),
        cuda,
        "direct transfers live iff on CUDA"
    );
    let mut rng = rng("large_transfers");
    // 3 MiB of f32 (above the 1 MiB direct-upload threshold) and a bf16 array read as bytes.
    let data = randn(&mut rng, 3 << 18);
    let shape = [2, 3, 1 << 17];
    let mut outs = Vec::new();
    for direct in [true, false] {
        let was = mlx::set_direct_transfers(direct);
        let a = arr(&data, &shape);
        assert_eq!(host(&a), data, "round trip (direct {direct})");
        // Computing on the uploaded array and reading a strided slice of the result.
        let b = a.add(&Array::scalar(1.0, Dtype::F32).unwrap()).unwrap();
        let s = b.slice(&[0, 1, 0], &[2, 3, 1 << 17]).unwrap();
        outs.push(host(&s));
        let bf = a.astype(Dtype::BF16).unwrap();
        let bytes = bf.to_bytes().unwrap();
        let back = Array::from_bytes(&bytes, &shape, Dtype::BF16).unwrap();
        assert_eq!(
            back.to_bytes().unwrap(),
            bytes,
            "bf16 bytes (direct {direct})"
        );
        mlx::set_direct_transfers(was);
    }
    assert_eq!(outs[0], outs[1], "direct and ordinary paths agree");
    // Page-locked host memory exactly where direct transfers run; uploads from it and reads
    // into it are the same bytes.
    let bytes: &[u8] = bytemuck::cast_slice(&data);
    match mlx::PinnedBuffer::new(bytes.len()) {
        Some(mut pinned) => {
            assert!(cuda);
            pinned.copy_from_slice(bytes);
            let a = Array::from_bytes(&pinned, &shape, Dtype::F32).unwrap();
            let doubled = a.add(&a).unwrap();
            doubled.read_into(&mut pinned).unwrap();
            let want: Vec<f32> = data.iter().map(|x| x + x).collect();
            assert_eq!(&pinned[..], bytemuck::cast_slice::<f32, u8>(&want));
        }
        None => assert!(!cuda, "no page-locked memory on CUDA"),
    }
    let want: Vec<f32> = (0..2)
        .flat_map(|i| {
            let row = &data[(i * 3 + 1) << 17..(i * 3 + 3) << 17];
            row.iter().map(|x| x + 1.0).collect::<Vec<_>>()
        })
        .collect();
    assert_eq!(outs[0], want);
}

/// Rows written into zeros on the device land at their pitch, bit for bit, and the rest
/// stays zero (a restore's blocks at the start of each head's room), several arrays in one
/// call; with direct transfers off, or on the CPU, nothing is written and the call says so.
#[test]
fn rows_written_into_device_zeros_land_at_their_pitch() {
    let cuda = mlx::gpu_available().unwrap() && !cfg!(target_os = "macos");
    let mut rng = rng("rows_written_into_device_zeros");
    // 3 heads × room for 40 rows of 16 f32; 25 rows a head are written. The second array
    // has no gap between heads (room = rows): one plain copy.
    let (heads, rows, width) = (3usize, 25usize, 16usize);
    let data = randn(&mut rng, heads * rows * width);
    let bytes: &[u8] = bytemuck::cast_slice(&data);
    let rooms = [40usize, rows];
    let shapes: Vec<[i32; 3]> = rooms
        .iter()
        .map(|&r| [heads as i32, r as i32, width as i32])
        .collect();
    let zeros = || {
        let s: Vec<(&[i32], Dtype)> = shapes.iter().map(|s| (&s[..], Dtype::F32)).collect();
        mlx::zeroed_on_device(&s).unwrap()
    };
    // Every head's 25 rows into each array, at the array's room.
    let write = |dsts: &[Array]| {
        let w: Vec<mlx::RowsWrite> = dsts
            .iter()
            .zip(rooms)
            .map(|(dst, room)| mlx::RowsWrite {
                dst,
                src: bytes,
                width: rows * width * 4,
                height: heads,
                pitch: room * width * 4,
            })
            .collect();
        mlx::write_rows_direct(&w)
    };
    let dsts = zeros();
    let wrote = write(&dsts).unwrap();
    assert_eq!(wrote, cuda, "written iff direct transfers run (CUDA)");
    for (dst, room) in dsts.iter().zip(rooms) {
        let mut want = vec![0f32; heads * room * width];
        if wrote {
            for h in 0..heads {
                want[h * room * width..][..rows * width]
                    .copy_from_slice(&data[h * rows * width..][..rows * width]);
            }
        }
        assert_eq!(host(dst), want, "rows at their pitch (room {room})");
    }
    // Rows that would overrun an array are refused, and nothing is written.
    let small = mlx::zeroed_on_device(&[(&[2, 4, 4], Dtype::F32)])
        .unwrap()
        .remove(0);
    // 3 rows of 16 bytes at a pitch of 64 span 144 bytes; the array has 128.
    let ones = vec![1u8; 3 * 16];
    let over = mlx::RowsWrite {
        dst: &small,
        src: &ones,
        width: 16,
        height: 3,
        pitch: 64,
    };
    match mlx::write_rows_direct(&[over]) {
        Err(e) => assert!(cuda && e.to_string().contains("overrun"), "{e}"),
        Ok(wrote) => assert!(!cuda && !wrote),
    }
    assert!(host(&small).iter().all(|&x| x == 0.0));
    // Switched off: the caller is told to take the ordinary path.
    let was = mlx::set_direct_transfers(false);
    let dsts = zeros();
    let wrote = write(&dsts);
    mlx::set_direct_transfers(was);
    assert!(!wrote.unwrap());
    assert!(dsts.iter().all(|d| host(d).iter().all(|&x| x == 0.0)));
}

/// `split` cuts an array into equal views along an axis, in order.
#[test]
fn split_cuts_equal_pieces_in_order() {
    let a = arr(&(0..24).map(|x| x as f32).collect::<Vec<_>>(), &[4, 2, 3]);
    let parts = mlx::ops::split(&a, 4, 0).unwrap();
    assert_eq!(parts.len(), 4);
    for (i, p) in parts.iter().enumerate() {
        assert_eq!(p.shape(), vec![1, 2, 3]);
        let want: Vec<f32> = (i * 6..(i + 1) * 6).map(|x| x as f32).collect();
        assert_eq!(host(p), want);
    }
    assert!(
        mlx::ops::split(&a, 3, 0).is_err(),
        "4 rows do not split in 3"
    );
}

/// Past MLX's ten pieces a node, `split` still gives the pieces in order (against slices
/// of the host data) on either axis, and builds a slice and a split a group of ten instead
/// of a node a piece.
#[test]
fn split_into_more_than_ten_pieces_is_exact_and_builds_few_nodes() {
    for parts in [10usize, 11, 16, 23] {
        let n = parts * 2 * 3;
        let data: Vec<f32> = (0..n).map(|x| x as f32).collect();
        let a = arr(&data, &[parts as i32, 2, 3]);
        let pieces = mlx::ops::split(&a, parts, 0).unwrap();
        assert_eq!(pieces.len(), parts);
        for (i, p) in pieces.iter().enumerate() {
            assert_eq!(p.shape(), vec![1, 2, 3]);
            assert_eq!(
                host(p),
                data[i * 6..(i + 1) * 6].to_vec(),
                "{parts} parts, piece {i}"
            );
        }
        let refs: Vec<&mlx::Array> = pieces.iter().collect();
        let nodes = mlx::pending_primitives(&refs).unwrap();
        let groups = parts.div_ceil(mlx::ops::SPLIT_NODE_PARTS);
        let most = if parts <= mlx::ops::SPLIT_NODE_PARTS {
            1
        } else {
            2 * groups
        };
        assert!(
            nodes.len() <= most,
            "{parts} pieces built {} nodes: {nodes:?}",
            nodes.len()
        );
        // The last axis, counted from the end.
        let b = arr(&data, &[2, 3, parts as i32]);
        let cols = mlx::ops::split(&b, parts, -1).unwrap();
        assert_eq!(cols.len(), parts);
        let all = host(&b);
        for (i, c) in cols.iter().enumerate() {
            let want: Vec<f32> = (0..6).map(|r| all[r * parts + i]).collect();
            assert_eq!(host(c), want, "{parts} columns, column {i}");
        }
    }
    let a = arr(&[0.0; 22], &[22, 1]);
    assert!(mlx::ops::split(&a, 11, 0).is_ok());
    assert!(
        mlx::ops::split(&a, 12, 0).is_err(),
        "22 rows do not split in 12"
    );
}

/// `x · wᵀ` through `fast::matmul_weight_t` against a naive product for 1 to
/// `cpu_row_product::max_rows()` + 2 rows, x contiguous, batched ([2, r, k]) and a
/// transposed view: on the CPU up to `max_rows()` rows are one `RowsTimesWeightT` node (the
/// kernel, in register tiles from 9 rows with AVX-512), more rows MLX's matmul; the two
/// agree to float rounding.
#[test]
fn matmul_weight_t_matches_naive_on_the_row_kernel_and_mlx() {
    let mut r = rng("matmul_weight_t_matches_naive_on_the_row_kernel_and_mlx");
    let on_cpu = mlx::default_device().unwrap() == mlx::Device::Cpu && fast::cpu_attention();
    for rows in 1..=mlx::cpu_row_product::max_rows() + 2 {
        let (k, n) = (r.gen_range(1..300), r.gen_range(1..200));
        let x = randn(&mut r, rows * k);
        let w = randn(&mut r, n * k);
        let mut wt = vec![0f32; k * n];
        for o in 0..n {
            for i in 0..k {
                wt[i * n + o] = w[o * k + i];
            }
        }
        let want = naive_matmul(&x, &wt, rows, k, n);
        let wa = arr(&w, &[n as i32, k as i32]);
        // The same rows as [rows, k], and as the transpose of a [k, rows] array.
        let mut xt = vec![0f32; k * rows];
        for row in 0..rows {
            for i in 0..k {
                xt[i * rows + row] = x[row * k + i];
            }
        }
        let inputs = [
            arr(&x, &[rows as i32, k as i32]),
            arr(&xt, &[k as i32, rows as i32])
                .transpose(&[1, 0])
                .unwrap(),
        ];
        for xa in inputs {
            let got = fast::matmul_weight_t(&xa, &wa).unwrap();
            assert_eq!(got.shape(), vec![rows as i32, n as i32]);
            let kernel = on_cpu && rows <= mlx::cpu_row_product::max_rows();
            let names = mlx::pending_primitives(&[&got]).unwrap();
            assert_eq!(
                names.iter().any(|p| p == "RowsTimesWeightT"),
                kernel,
                "{rows} rows: {names:?}"
            );
            assert_close(&host(&got), &want, 1e-5 + product_slack(k), 1e-4);
        }
        if rows % 2 == 0 {
            let batched = arr(&x, &[2, (rows / 2) as i32, k as i32]);
            let got = fast::matmul_weight_t(&batched, &wa).unwrap();
            assert_eq!(got.shape(), vec![2, (rows / 2) as i32, n as i32]);
            assert_close(&host(&got), &want, 1e-5 + product_slack(k), 1e-4);
        }
    }
    // Off the fused CPU paths the product is MLX's matmul, bit for bit.
    let x = arr(&randn(&mut r, 3 * 40), &[3, 40]);
    let w = arr(&randn(&mut r, 7 * 40), &[7, 40]);
    let on = fast::set_cpu_attention(false);
    let off = host(&fast::matmul_weight_t(&x, &w).unwrap());
    fast::set_cpu_attention(on);
    assert_eq!(
        off,
        host(&x.matmul(&w.transpose(&[1, 0]).unwrap()).unwrap())
    );
    // Shapes that do not fit are errors, not a crash.
    assert!(fast::matmul_weight_t(&arr(&[1.0; 6], &[2, 3]), &arr(&[1.0; 8], &[2, 4])).is_err());
}

/// `zeroed_on_device` over shapes of different ranks and dtypes (their dimensions travel
/// to the shim flattened, each shape's rank beside it): each array has its own shape,
/// dtype and zeros, whatever the shapes before it.
#[test]
fn zeroed_arrays_keep_each_shape_and_dtype() {
    let shapes: [(&[i32], Dtype); 4] = [
        (&[2, 3], Dtype::F32),
        (&[5], Dtype::BF16),
        (&[1, 2, 3, 4], Dtype::F16),
        (&[3, 1, 2], Dtype::F32),
    ];
    let arrays = mlx::zeroed_on_device(&shapes).unwrap();
    assert_eq!(arrays.len(), shapes.len());
    for (a, (shape, dtype)) in arrays.iter().zip(shapes) {
        assert_eq!(a.shape(), shape.to_vec());
        assert_eq!(a.dtype(), dtype);
        let n: i32 = shape.iter().product();
        let values = a.astype(Dtype::F32).unwrap().to_vec::<f32>().unwrap();
        assert_eq!(values, vec![0f32; n as usize], "{shape:?} {dtype:?}");
    }
    assert!(mlx::zeroed_on_device(&[]).unwrap().is_empty());
}

/// An evaluated array's buffer is at least its bytes, and no more than MLX's buffer cache
/// hands over (a freed buffer at most two pages, or twice the size, larger than asked for),
/// which the array then holds whole: what `PagedKvCache::buffer_bytes` counts for an arena
/// (docs/server.md, "Memory after a load").
#[test]
fn buffer_bytes_are_the_whole_buffer_an_evaluated_array_holds() {
    let one = arr(&[1.0], &[1]);
    let unevaluated = mlx::ops::full(&[1024], 1.0, Dtype::F32).unwrap();
    assert_eq!(unevaluated.buffer_bytes(), 0, "no buffer before evaluation");
    // A buffer of 33,500 floats, freed into MLX's cache, then an array of 32,768 floats
    // (2,928 bytes fewer) computed: it may take that buffer (alone in this process it does;
    // other tests' buffers may come first), never one beyond the cache's limit.
    let big = mlx::ops::full(&[33_500], 2.0, Dtype::F32)
        .unwrap()
        .add(&one)
        .unwrap();
    big.eval().unwrap();
    assert!(
        big.buffer_bytes() >= big.nbytes(),
        "{} < {}",
        big.buffer_bytes(),
        big.nbytes()
    );
    drop(big);
    let small = mlx::ops::full(&[32_768], 3.0, Dtype::F32)
        .unwrap()
        .add(&one)
        .unwrap();
    small.eval().unwrap();
    assert_eq!(host(&small)[0], 4.0);
    let (n, b) = (small.nbytes(), small.buffer_bytes());
    assert!(b >= n && b <= n + 2 * 16384, "{n} bytes in a buffer of {b}");
    // A view reports its base's whole buffer.
    let view = small.slice(&[0], &[16]).unwrap();
    view.eval().unwrap();
    assert_eq!(view.buffer_bytes(), b);
}

/// MLX reports a GPU's memory, which an engine checks its budgets against; for the CPU
/// MLX 0.32's `device_info` names no memory, and the binding says so (`None`) instead of 0.
#[test]
fn the_device_reports_its_memory_on_a_gpu_only() {
    let total = mlx::device_memory_size().unwrap();
    if mlx::default_device().unwrap() == mlx::Device::Gpu {
        assert!(total.is_some_and(|n| n >= 1 << 30), "{total:?}");
    } else {
        assert_eq!(total, None);
    }
}
