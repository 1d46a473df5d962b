//! RoPE's rotations of one step on the CPU: `fast::rope_with_angles` as one node (the
//! kernel) against MLX's ops (`KVSTORE_CPU_ATTENTION=0`'s path), SmolLM2's q and k heads
//! (9 and 3 heads of 64) over 30 layers, ms per step's worth (best of the repetitions).
//! `cargo run --release -p kvstore-mlx --example rope_profile -- [tokens] [rows] [reps]`
use mlx::fast::{self, Rope, RopeOffset};
use mlx::{Array, Dtype};
use std::time::Instant;

fn main() -> mlx::Result<()> {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let tokens = args.first().copied().unwrap_or(1) as i32;
    let rows = args.get(1).copied().unwrap_or(1) as i32;
    let reps = args.get(2).copied().unwrap_or(20);
    let cfg = Rope {
        dims: 64,
        traditional: false,
        base: 100_000.0,
        scale: 1.0,
        freqs: None,
    };
    let key = mlx::random::key(7)?;
    // The stacked q/k/v product of a step, [B, T, (9 + 3 + 3) · 64]; q and k as the engine
    // views them: sliced, split into heads, moved to [B, H, T, D].
    let qkv = mlx::random::normal(&[rows, tokens, 15 * 64], Dtype::F32, &key)?;
    mlx::eval(&[&qkv])?;
    let heads = |from: i32, h: i32| -> mlx::Result<Array> {
        qkv.slice(&[0, 0, from * 64], &[rows, tokens, (from + h) * 64])?
            .reshape(&[rows, tokens, h, 64])?
            .transpose(&[0, 2, 1, 3])
    };
    let (q, k) = (heads(0, 9)?, heads(9, 3)?);
    mlx::eval(&[&q, &k])?;
    let angles = fast::rope_angles(&cfg, RopeOffset::Scalar(4096), tokens, Dtype::F32)?;
    let (cos, sin) = angles.parts();
    mlx::eval(&[cos, sin])?;
    for kernel in [false, true, false, true] {
        fast::set_cpu_attention(kernel);
        let mut best = f64::MAX;
        for _ in 0..reps {
            let t = Instant::now();
            let mut outs = Vec::with_capacity(60);
            for _ in 0..30 {
                outs.push(fast::rope_with_angles(&q, &cfg, &angles)?);
                outs.push(fast::rope_with_angles(&k, &cfg, &angles)?);
            }
            mlx::eval(&outs.iter().collect::<Vec<_>>())?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        let what = if kernel {
            "one node (RopeRotate)"
        } else {
            "MLX's ops"
        };
        println!(
            "{tokens} tokens, {rows} rows: {what:22} {:8.3} ms",
            best * 1e3
        );
    }
    Ok(())
}
