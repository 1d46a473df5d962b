//! The batched decode attention ([`mlx::rows_attention`], one graph node per layer) against
//! the row-by-row path over identical rows: on the CPU (f32) in every build, on a GPU in a
//! CUDA build (f32 and bf16). Where the node cannot run (a GPU without the CUDA kernels, the
//! fused CPU paths switched off) the tests say loudly that they did not run, and fail when
//! `KVSTORE_EXPECT_ROWS_KERNEL=1` (scripts/cuda/device.sh sets it on the H200).

use mlx::{Array, Dtype};

use crate::share::ShareHandle;
use crate::{KvCache, PagedConfig, PagedKvCache, PagedKvRows};

/// One batch shape: keys of `dtype`, `kv_heads` × `head_dim`, `q_heads` query heads, rows of
/// `lens` tokens; with `prefix`, row 0 starts with a shared prefix of another cache.
struct Case {
    dtype: Dtype,
    kv_heads: i32,
    q_heads: i32,
    head_dim: i32,
    lens: Vec<i32>,
    prefix: bool,
}

const LAYERS: usize = 2;

/// Held by each test for its whole run: both switch the node off process-wide
/// (`set_rows_kernel`) to compute their reference, which would send the other test's steps
/// row by row if they ran at once (the test threads share the switch).
static SWITCH: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn hold_switch() -> std::sync::MutexGuard<'static, ()> {
    SWITCH.lock().unwrap_or_else(|e| e.into_inner())
}
const STEPS: u64 = 12;

fn normal(shape: &[i32], dtype: Dtype, seed: u64) -> Array {
    mlx::random::normal(shape, Dtype::F32, &mlx::random::key(seed).unwrap())
        .unwrap()
        .astype(dtype)
        .unwrap()
}

fn config() -> PagedConfig {
    PagedConfig {
        block_size: 16,
        initial_blocks: 2,
        ..PagedConfig::default()
    }
}

/// Two sets of identical rows (separate buffers: never clones of each other).
fn rows(case: &Case) -> (PagedKvRows, PagedKvRows) {
    let (h, d) = (case.kv_heads, case.head_dim);
    let source = case.prefix.then(|| {
        let mut c = PagedKvCache::new(LAYERS, config()).unwrap();
        for l in 0..LAYERS {
            let k = normal(&[1, h, 41, d], case.dtype, 500 + l as u64);
            c.append(l, &k, &k.mul_scalar(-0.5).unwrap()).unwrap();
        }
        c
    });
    let mut sets = (PagedKvRows::new(), PagedKvRows::new());
    for set in [&mut sets.0, &mut sets.1] {
        for (i, &n) in case.lens.iter().enumerate() {
            let mut c = match (&source, i) {
                (Some(src), 0) => PagedKvCache::share_prefix(src, 33, ShareHandle::new(7)).unwrap(),
                _ => PagedKvCache::new(LAYERS, config()).unwrap(),
            };
            for l in 0..LAYERS {
                let k = normal(&[1, h, n, d], case.dtype, 1000 * i as u64 + l as u64);
                c.append(l, &k, &k.mul_scalar(2.0).unwrap()).unwrap();
            }
            set.push(c).unwrap();
        }
    }
    sets
}

fn as_f32(a: &Array) -> Vec<f32> {
    a.astype(Dtype::F32).unwrap().to_vec::<f32>().unwrap()
}

fn run(case: &Case) {
    let (mut one, mut each) = rows(case);
    let b = case.lens.len() as i32;
    let (h, hq, d) = (case.kv_heads, case.q_heads, case.head_dim);
    let scale = 1.0 / (d as f32).sqrt();
    // f32: rounding of a few thousand terms; bf16: the output's rounding (2^-8) and its
    // 16-bit inputs' (q is rounded to bf16 before the product in both).
    let tol = if case.dtype == Dtype::F32 {
        2e-5
    } else {
        1.6e-2
    };
    // A clone of row 0 alive for the first two steps: its arenas are shared at step 0, so
    // that step goes row by row; MLX's write then gives row 0 buffers of its own, so step 1
    // goes in one node with the clone still alive.
    let mut clone = Some(one.row(0).unwrap().clone());
    let mut paths = Vec::new();
    for step in 0..STEPS {
        let before = one.decode_paths();
        if step == 2 {
            clone = None;
        }
        for l in 0..LAYERS {
            let seed = 90_000 + step * 10 + l as u64;
            let q = normal(&[b, hq, 1, d], case.dtype, seed);
            let k = normal(&[b, h, 1, d], case.dtype, seed + 1);
            let v = normal(&[b, h, 1, d], case.dtype, seed + 2);
            let got = one.attend(l, &q, &k, &v, scale, None).unwrap();
            let was = mlx::rows_attention::set_rows_kernel(false);
            let want = each.attend(l, &q, &k, &v, scale, None).unwrap();
            mlx::rows_attention::set_rows_kernel(was);
            mlx::eval(&[&got, &want]).unwrap();
            assert_eq!(got.shape(), vec![b, hq, 1, d]);
            // Both against a naive f64 attention over what each row holds after the step
            // (the row-by-row path's f32 products run on TF32 tensor cores: docs/cuda.md).
            let (g, w, qh) = (as_f32(&got), as_f32(&want), as_f32(&q));
            let n = (hq * d) as usize;
            let mut per_row = Vec::new();
            for i in 0..b as usize {
                let (k_all, v_all) = one.row(i).unwrap().fetch(l).unwrap().unwrap();
                let naive = naive_attention(
                    &qh[i * n..(i + 1) * n],
                    &as_f32(&k_all),
                    &as_f32(&v_all),
                    case,
                    scale,
                );
                let off = |x: &[f32]| {
                    x.iter()
                        .zip(&naive)
                        .map(|(a, r)| ((*a as f64 - r).abs() / (1.0 + r.abs())) as f32)
                        .fold(0.0f32, |m, x| if x.is_nan() || x > m { x } else { m })
                };
                per_row.push((off(&g[i * n..(i + 1) * n]), off(&w[i * n..(i + 1) * n])));
            }
            let worst = per_row.iter().map(|p| p.0 as f64).fold(0.0, nan_max);
            if worst > tol {
                assert_same_kv(&one, &each, step);
            }
            assert!(
                worst <= tol,
                "step {step} layer {l}: off by {worst} (tolerance {tol}); by row (one node, row \
                 by row): {per_row:?}; paths {:?}",
                one.decode_paths()
            );
        }
        let after = one.decode_paths();
        paths.push((after.0 - before.0, after.1 - before.1));
    }
    drop(clone);
    assert_same_kv(&one, &each, STEPS);
    // Step 0 went row by row (row 0 was shared; MLX's write gave it buffers of its own), and
    // every later step in one node, arenas grown or not.
    let layers = LAYERS as u64;
    assert_eq!(
        paths[0],
        (0, layers),
        "step 0 shares row 0's arenas: {paths:?}"
    );
    assert!(
        paths[1..].iter().all(|&p| p == (layers, 0)),
        "a step after the first went row by row: {paths:?}"
    );
    assert_eq!(each.decode_paths(), (0, STEPS * layers));
}

/// `softmax(q kᵀ · scale) v` in f64 for one row: `q` `[Hq, D]`, keys and values
/// `[Hkv, T, D]`; q head `h` reads kv head `h / (Hq / Hkv)`. Returns `[Hq, D]`.
fn naive_attention(q: &[f32], k: &[f32], v: &[f32], case: &Case, scale: f32) -> Vec<f64> {
    let (hq, hkv, d) = (
        case.q_heads as usize,
        case.kv_heads as usize,
        case.head_dim as usize,
    );
    let t = k.len() / (hkv * d);
    let mut out = vec![0.0f64; hq * d];
    for h in 0..hq {
        let kv = h / (hq / hkv);
        let scores: Vec<f64> = (0..t)
            .map(|j| {
                let key = &k[(kv * t + j) * d..(kv * t + j + 1) * d];
                let dot: f64 = q[h * d..(h + 1) * d]
                    .iter()
                    .zip(key)
                    .map(|(a, b)| *a as f64 * *b as f64)
                    .sum();
                dot * scale as f64
            })
            .collect();
        let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
        let sum: f64 = e.iter().sum();
        for (j, p) in e.iter().enumerate() {
            let val = &v[(kv * t + j) * d..(kv * t + j + 1) * d];
            for (o, x) in out[h * d..(h + 1) * d].iter_mut().zip(val) {
                *o += p / sum * *x as f64;
            }
        }
    }
    out
}

/// Every row of `one` holds exactly the keys and values of the same row of `each`.
fn assert_same_kv(one: &PagedKvRows, each: &PagedKvRows, step: u64) {
    for i in 0..each.len() {
        let (x, y) = (one.row(i).unwrap(), each.row(i).unwrap());
        assert_eq!(x.offset(), y.offset());
        for l in 0..LAYERS {
            let (xk, xv) = x.fetch(l).unwrap().unwrap();
            let (yk, yv) = y.fetch(l).unwrap().unwrap();
            for (what, a, b) in [("keys", xk, yk), ("values", xv, yv)] {
                let (a, b) = (as_f32(&a), as_f32(&b));
                let first = a
                    .iter()
                    .zip(&b)
                    .position(|(p, q)| p.to_bits() != q.to_bits());
                assert!(
                    first.is_none(),
                    "after step {step}: row {i} layer {l} {what} differ first at element {first:?} \
                     of {} (shape {:?})",
                    a.len(),
                    x.fetch(l).unwrap().unwrap().0.shape()
                );
            }
        }
    }
}

/// The larger of two errors, NaN winning (`f64::max` would drop a NaN output).
fn nan_max(m: f64, x: f64) -> f64 {
    if m.is_nan() || x.is_nan() {
        f64::NAN
    } else {
        m.max(x)
    }
}

/// The 16-bit dtype of the wide cases: bf16 on a GPU; f32 on the CPU, whose node takes f32
/// only (the engine runs f32 there).
fn wide_dtype() -> Dtype {
    match mlx::default_device() {
        Ok(mlx::Device::Cpu) => Dtype::F32,
        _ => Dtype::BF16,
    }
}

/// Whether the kernel can run here; says loudly that `test` did not run when not, and
/// fails where `KVSTORE_EXPECT_ROWS_KERNEL=1` says it should.
fn kernel_or_skip(test: &str) -> bool {
    if mlx::rows_attention::rows_kernel_usable() {
        return true;
    }
    eprintln!(
        "\n*** SKIPPED {test}: the batched decode attention is not usable here: a GPU needs \
         the CUDA build, the CPU the fused CPU paths (built: {}, GPU: {:?}) ***\n",
        mlx::rows_attention::rows_kernel_built(),
        mlx::gpu_available()
    );
    assert_ne!(
        std::env::var("KVSTORE_EXPECT_ROWS_KERNEL").as_deref(),
        Ok("1"),
        "KVSTORE_EXPECT_ROWS_KERNEL=1 but the batched decode attention is not usable"
    );
    false
}

/// Decode steps through one node per layer give the row-by-row outputs within float
/// rounding and leave exactly the same KV: rows of mixed lengths crossing block boundaries
/// and growing their arenas, more rows than one GPU launch takes (32), a row with a shared
/// prefix, f32 at head dimension 64 (3 q heads per kv head) and bf16 (f32 on the CPU) at
/// 128 (4) and 256 (4, one kv head).
#[test]
fn one_node_decode_steps_match_row_by_row() {
    if !kernel_or_skip("one_node_decode_steps_match_row_by_row") {
        return;
    }
    let _switch = hold_switch();
    // Rows at, across and far past block edges; then the same with row 0 on a shared prefix.
    for prefix in [false, true] {
        run(&Case {
            dtype: Dtype::F32,
            kv_heads: 3,
            q_heads: 9,
            head_dim: 64,
            lens: vec![1, 15, 16, 17, 31, 300],
            prefix,
        });
    }
    run(&Case {
        dtype: wide_dtype(),
        kv_heads: 2,
        q_heads: 8,
        head_dim: 128,
        lens: (0..37).map(|i| 1 + (i * 53) % 700).collect(),
        prefix: false,
    });
    // Gemma 3's head dimension: the GPU kernel loads two keys per warp at a time there
    // (four below 256), so splits end inside a warp's pair.
    run(&Case {
        dtype: wide_dtype(),
        kv_heads: 1,
        q_heads: 4,
        head_dim: 256,
        lens: vec![1, 6, 7, 8, 9, 33, 130],
        prefix: true,
    });
}

/// A single sequence's decode step (`KvCache::update_and_attend` with one query, no mask)
/// goes through the same node: bf16 (f32 on the CPU) at head dimension 128 with 4 q heads
/// per kv head (the 8B's shape), on its own and on a shared prefix, against a naive f64 attention and the
/// fused attention of a twin cache, with the same KV left behind.
#[test]
fn a_single_sequence_decodes_in_one_node() {
    if !kernel_or_skip("a_single_sequence_decodes_in_one_node") {
        return;
    }
    let _switch = hold_switch();
    let case = Case {
        dtype: wide_dtype(),
        kv_heads: 2,
        q_heads: 8,
        head_dim: 128,
        lens: vec![45],
        prefix: false,
    };
    let (h, hq, d) = (case.kv_heads, case.q_heads, case.head_dim);
    let scale = 1.0 / (d as f32).sqrt();
    let source = {
        let mut c = PagedKvCache::new(LAYERS, config()).unwrap();
        for l in 0..LAYERS {
            let k = normal(&[1, h, 41, d], case.dtype, 700 + l as u64);
            c.append(l, &k, &k.mul_scalar(0.5).unwrap()).unwrap();
        }
        c
    };
    for shared in [false, true] {
        let make = || {
            let mut c = if shared {
                PagedKvCache::share_prefix(&source, 37, ShareHandle::new(9)).unwrap()
            } else {
                PagedKvCache::new(LAYERS, config()).unwrap()
            };
            for l in 0..LAYERS {
                let k = normal(&[1, h, 45, d], case.dtype, 800 + l as u64);
                c.append(l, &k, &k.mul_scalar(-1.5).unwrap()).unwrap();
            }
            c
        };
        let (mut one, mut fused) = (make(), make());
        let before = crate::decode_path_totals().0;
        for step in 0..STEPS {
            for l in 0..LAYERS {
                let seed = 70_000 + step * 10 + l as u64;
                let q = normal(&[1, hq, 1, d], case.dtype, seed);
                let k = normal(&[1, h, 1, d], case.dtype, seed + 1);
                let v = normal(&[1, h, 1, d], case.dtype, seed + 2);
                let none = mlx::fast::AttentionMask::None;
                let got = one.update_and_attend(l, &q, &k, &v, scale, none).unwrap();
                let was = mlx::rows_attention::set_rows_kernel(false);
                let none = mlx::fast::AttentionMask::None;
                let want = fused.update_and_attend(l, &q, &k, &v, scale, none);
                mlx::rows_attention::set_rows_kernel(was);
                let want = want.unwrap();
                // The node's write of position `len` reaches readers that come after it: a
                // fetch evaluated before `got` would not see the new token (the engine reads
                // each step's token before anything reads that position).
                mlx::eval(&[&got, &want]).unwrap();
                let (k_all, v_all) = one.fetch(l).unwrap().unwrap();
                let naive =
                    naive_attention(&as_f32(&q), &as_f32(&k_all), &as_f32(&v_all), &case, scale);
                for (what, out) in [("one node", &got), ("fused", &want)] {
                    let worst = as_f32(out)
                        .iter()
                        .zip(&naive)
                        .map(|(a, r)| (*a as f64 - r).abs() / (1.0 + r.abs()))
                        .fold(0.0f64, nan_max);
                    assert!(
                        worst <= 1.6e-2,
                        "shared {shared}, step {step}, layer {l}: {what} off by {worst}"
                    );
                }
                let (fk, fv) = fused.fetch(l).unwrap().unwrap();
                assert_eq!(as_f32(&k_all), as_f32(&fk), "keys, step {step} layer {l}");
                assert_eq!(as_f32(&v_all), as_f32(&fv), "values, step {step} layer {l}");
            }
        }
        // Every step in one node: the appends gave the arenas buffers of their own.
        let in_one_node = crate::decode_path_totals().0 - before;
        assert!(
            in_one_node >= STEPS * LAYERS as u64,
            "shared {shared}: {in_one_node} layer steps in one node of {}",
            STEPS * LAYERS as u64
        );
    }
}
