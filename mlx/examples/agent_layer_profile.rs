//! Times the pieces of one SmolLM2-135M decoder layer (f32, random weights) at an agent
//! turn's prefill shape, each evaluated on its own through this crate: the fused q/k/v and
//! gate/up projections, the output and down projections, norms and RoPE, and attention
//! over the cache through MLX's kernel and through the fused CPU path.
//!
//! `cargo run --release -p kvstore-mlx --example agent_layer_profile -- [cached] [new] [reps]`
//! (defaults 4096 500 5). docs/benchmarks.md, "Fused CPU attention", has the figures.

use std::time::Instant;

use mlx::fast::{self, AttentionMask, Rope, RopeOffset};
use mlx::{Array, Dtype, Result};

const HIDDEN: i32 = 576;
const INTERMEDIATE: i32 = 1536;
const HEADS: i32 = 9;
const KV_HEADS: i32 = 3;
const HEAD_DIM: i32 = 64;

fn random(shape: &[i32], seed: u64) -> Result<Array> {
    let key = mlx::random::key(seed)?;
    let a = mlx::random::normal(shape, Dtype::F32, &key)?.mul_scalar(0.05)?;
    a.eval()?;
    Ok(a)
}

/// Median seconds of `reps` runs of `f` (after one warm-up run).
fn time(reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    let mut t = Vec::with_capacity(reps);
    for _ in 0..reps {
        let start = Instant::now();
        f()?;
        t.push(start.elapsed().as_secs_f64());
    }
    t.sort_by(f64::total_cmp);
    Ok(t[reps / 2])
}

fn main() -> Result<()> {
    let arg = |i: usize, default: usize| {
        std::env::args()
            .nth(i)
            .and_then(|s| s.parse().ok())
            .unwrap_or(default)
    };
    let (cached, new, reps) = (arg(1, 4096), arg(2, 500), arg(3, 5).max(1));
    let (l, lk) = (new as i32, (cached + new) as i32);
    let kv_width = KV_HEADS * HEAD_DIM;
    let x = random(&[1, l, HIDDEN], 1)?;
    let w_qkv = random(&[HIDDEN + 2 * kv_width, HIDDEN], 2)?;
    let w_o = random(&[HIDDEN, HIDDEN], 3)?;
    let w_gate_up = random(&[2 * INTERMEDIATE, HIDDEN], 4)?;
    let w_down = random(&[HIDDEN, INTERMEDIATE], 5)?;
    let norm = random(&[HIDDEN], 6)?;
    let h = random(&[1, l, INTERMEDIATE], 7)?;
    let q = random(&[1, HEADS, l, HEAD_DIM], 8)?;
    let k = random(&[1, KV_HEADS, lk, HEAD_DIM], 9)?;
    let v = random(&[1, KV_HEADS, lk, HEAD_DIM], 10)?;
    let linear = |x: &Array, w: &Array| x.matmul(&w.transpose(&[1, 0])?);
    let gflop = |flop: f64, s: f64| flop / s / 1e9;
    let t = l as f64;

    let qkv = time(reps, || linear(&x, &w_qkv)?.eval())?;
    let o = time(reps, || linear(&x, &w_o)?.eval())?;
    let gate_up = time(reps, || {
        let y = linear(&x, &w_gate_up)?;
        let parts = mlx::ops::split(&y, 2, 2)?;
        parts[0].silu()?.mul(&parts[1])?.eval()
    })?;
    let gate_up_fused = time(reps, || {
        let y = linear(&x, &w_gate_up)?;
        let parts = mlx::ops::split(&y, 2, 2)?;
        fast::silu_mul(&parts[0], &parts[1])?.eval()
    })?;
    let gate_up_stacked = time(reps, || {
        fast::gated_mul_stacked(fast::Gate::Silu, &linear(&x, &w_gate_up)?)?.eval()
    })?;
    let gate_up_only = time(reps, || linear(&x, &w_gate_up)?.eval())?;
    let down = time(reps, || linear(&h, &w_down)?.eval())?;
    let rope = Rope {
        dims: HEAD_DIM,
        traditional: false,
        base: 100_000.0,
        scale: 1.0,
        freqs: None,
    };
    let norms_rope = time(reps, || {
        let n1 = fast::rms_norm(&x, Some(&norm), 1e-5)?;
        let n2 = fast::rms_norm(&n1, Some(&norm), 1e-5)?;
        let qr = fast::rope(&q, &rope, RopeOffset::Scalar(cached as i32))?;
        let kr = fast::rope(
            &k.slice(&[0, 0, 0, 0], &[1, KV_HEADS, l, HEAD_DIM])?,
            &rope,
            RopeOffset::Scalar(cached as i32),
        )?;
        mlx::eval(&[&n2, &qr, &kr])
    })?;
    let scale = 1.0 / (HEAD_DIM as f32).sqrt();
    let attn_mlx = time(reps, || {
        fast::mlx_scaled_dot_product_attention(&q, &k, &v, scale, AttentionMask::Causal)?.eval()
    })?;
    let attn_fused = time(reps, || {
        fast::scaled_dot_product_attention(&q, &k, &v, scale, AttentionMask::Causal)?.eval()
    })?;
    // The fused kernel alone on host copies (what the dispatch adds: making q, k, v
    // row-major and wrapping the output in an array), called directly so that one query
    // (a decode step, which the dispatch leaves to MLX) is measured too.
    let dims = mlx::cpu_attention::Dims {
        batch: 1,
        q_heads: HEADS as usize,
        kv_heads: KV_HEADS as usize,
        q_len: new,
        kv_len: cached + new,
        head_dim: HEAD_DIM as usize,
    };
    let (qh, kh, vh) = (q.to_vec::<f32>()?, k.to_vec::<f32>()?, v.to_vec::<f32>()?);
    let mut out = vec![0f32; dims.q_size()];
    let attn_kernel = time(reps, || {
        mlx::cpu_attention::attend(&qh, &kh, &vh, &mut out, dims, scale, true).map_err(|message| {
            mlx::Error::InvalidArgument {
                op: "attend",
                message,
            }
        })
    })?;
    let big = random(&[2048, 2048], 12)?;
    let gemm = time(reps, || big.matmul(&big)?.eval())?;

    // FLOPs: 2 per weight and token; attention 2 · 2 · D per (head, query, visible key).
    let hd = HIDDEN as f64;
    let kvw = kv_width as f64;
    let inter = INTERMEDIATE as f64;
    let visible: f64 = (0..new).map(|i| (cached + i + 1) as f64).sum();
    let attn_flop = 4.0 * HEAD_DIM as f64 * HEADS as f64 * visible;
    let rows = [
        ("q/k/v projection", qkv, 2.0 * t * hd * (hd + 2.0 * kvw)),
        ("o projection", o, 2.0 * t * hd * hd),
        ("gate/up + silu·mul", gate_up, 2.0 * t * hd * 2.0 * inter),
        (
            "gate/up + fast::silu_mul",
            gate_up_fused,
            2.0 * t * hd * 2.0 * inter,
        ),
        (
            "gate/up + gated_mul_stacked",
            gate_up_stacked,
            2.0 * t * hd * 2.0 * inter,
        ),
        ("  gate/up alone", gate_up_only, 2.0 * t * hd * 2.0 * inter),
        ("down projection", down, 2.0 * t * inter * hd),
        ("2 rms norms + rope q, k", norms_rope, 0.0),
        ("attention, MLX kernel", attn_mlx, attn_flop),
        ("attention, fused CPU path", attn_fused, attn_flop),
        ("  its kernel on host slices", attn_kernel, attn_flop),
        ("2048³ matmul", gemm, 2.0 * 2048f64.powi(3)),
    ];
    println!("one layer, {cached} cached + {new} new tokens, median of {reps}:");
    for (name, s, flop) in rows {
        println!(
            "{name:28} {:9.2} ms  {:7.1} GFLOP/s  x30 layers {:6.2} s",
            s * 1e3,
            gflop(flop, s),
            30.0 * s
        );
    }
    Ok(())
}
