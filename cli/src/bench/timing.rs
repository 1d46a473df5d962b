//! Measurement helpers shared by the benchmarks: medians of repeated timings, seeded random
//! inputs, and the f32 matmul rate that FLOP shares are measured against.

use std::time::{Duration, Instant};

use anyhow::Result;
use mlx::{Array, Dtype};

/// Median wall time of `reps` calls after one warm-up call.
pub fn median(reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<Duration> {
    f()?;
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t = Instant::now();
        f()?;
        times.push(t.elapsed());
    }
    Ok(median_of(&mut times))
}

/// The median of `times` (sorted in place).
pub fn median_of(times: &mut [Duration]) -> Duration {
    times.sort();
    times[times.len() / 2]
}

/// A standard-normal f32 array of `shape` from `seed`, evaluated.
pub fn random(shape: &[i32], seed: u64) -> Result<Array> {
    let a = mlx::random::normal(shape, Dtype::F32, &mlx::random::key(seed)?)?;
    a.eval()?;
    Ok(a)
}

/// GFLOP/s of an f32 `n × n` by `n × n` matmul: the median of `reps` after a warm-up.
pub fn matmul_gflops(n: usize, reps: usize) -> Result<f64> {
    let (a, b) = (
        random(&[n as i32, n as i32], 1)?,
        random(&[n as i32, n as i32], 2)?,
    );
    let t = median(reps, || Ok(a.matmul(&b)?.eval()?))?;
    Ok(2.0 * (n as f64).powi(3) / t.as_secs_f64() / 1e9)
}
