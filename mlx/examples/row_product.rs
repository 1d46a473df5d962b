//! A decode step's products on the CPU: `fast::matmul_weight_t` (the row kernel) against
//! MLX's matmul over a transposed view, SmolLM2-135M's weight shapes, ms per step's worth.
//! `cargo run --release -p kvstore-mlx --example row_product -- [rows] [reps]`
use mlx::{fast, Array, Dtype};
use std::time::Instant;

fn main() -> mlx::Result<()> {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let rows = args.first().copied().unwrap_or(1) as i32;
    let reps = args.get(1).copied().unwrap_or(5);
    // One layer's stacked q/k/v, o, stacked gate/up and down; 30 layers; then the LM head.
    let mut shapes: Vec<(i32, i32)> = Vec::new();
    for _ in 0..30 {
        shapes.extend([(960, 576), (576, 576), (3072, 576), (576, 1536)]);
    }
    shapes.push((49152, 576));
    let key = mlx::random::key(7)?;
    let ws: Vec<Array> = shapes
        .iter()
        .map(|&(n, k)| mlx::random::normal(&[n, k], Dtype::F32, &key))
        .collect::<mlx::Result<_>>()?;
    let xs: Vec<Array> = [576, 1536]
        .iter()
        .map(|&k| mlx::random::normal(&[rows, k], Dtype::F32, &key))
        .collect::<mlx::Result<_>>()?;
    mlx::eval(&ws.iter().chain(&xs).collect::<Vec<_>>())?;
    let bytes: usize = shapes.iter().map(|&(n, k)| (n * k) as usize * 4).sum();
    for kernel in [false, true, false, true] {
        let mut best = f64::MAX;
        for _ in 0..reps {
            let t = Instant::now();
            let outs: Vec<Array> = ws
                .iter()
                .map(|w| {
                    let x = if w.shape()[1] == 1536 { &xs[1] } else { &xs[0] };
                    if kernel {
                        fast::matmul_weight_t(x, w)
                    } else {
                        x.matmul(&w.transpose(&[1, 0])?)
                    }
                })
                .collect::<mlx::Result<_>>()?;
            mlx::eval(&outs.iter().collect::<Vec<_>>())?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        println!(
            "{} rows {rows}: {:.2} ms, {:.1} GB/s",
            if kernel { "row kernel" } else { "mlx matmul" },
            best * 1e3,
            bytes as f64 / best / 1e9
        );
    }
    Ok(())
}
