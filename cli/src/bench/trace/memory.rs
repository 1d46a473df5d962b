//! MLX's memory over an in-process replay: active bytes (arrays alive) and its buffer cache
//! (freed buffers kept for reuse), sampled on a thread of its own, and the peak.
//!
//! A replay that fails steps with "out of memory" on a GPU whose KV and cache budgets are a
//! fraction of its memory (docs/benchmarks.md, session 30) needs to show where the memory
//! went and when; the counters are MLX's own, read without touching any array.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::Serialize;

/// Seconds between samples.
const INTERVAL: Duration = Duration::from_secs(1);

/// One sample: seconds since the start, active bytes, buffer-cache bytes.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct MemorySample {
    pub t_s: f64,
    pub active_bytes: usize,
    pub cache_bytes: usize,
}

/// What the sampler saw over a run.
#[derive(Debug, Clone, Serialize)]
pub struct MemorySummary {
    /// MLX's peak active bytes over the run (its own counter, reset at the start).
    pub peak_bytes: usize,
    /// The largest sampled active bytes, and when.
    pub max_active: MemorySample,
    /// The largest sampled buffer-cache bytes.
    pub max_cache_bytes: usize,
    /// Every sample, one a second.
    pub samples: Vec<MemorySample>,
}

/// Samples MLX's memory counters until stopped.
pub struct MemorySampler {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<Vec<MemorySample>>,
}

impl MemorySampler {
    /// Resets MLX's peak and starts sampling.
    pub fn start() -> anyhow::Result<Self> {
        mlx::reset_peak_memory()?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let t0 = Instant::now();
        let thread = std::thread::Builder::new()
            .name("kvstore-memory".into())
            .spawn(move || {
                let mut samples = Vec::new();
                loop {
                    if let (Ok(active_bytes), Ok(cache_bytes)) =
                        (mlx::active_memory(), mlx::cache_memory())
                    {
                        samples.push(MemorySample {
                            t_s: t0.elapsed().as_secs_f64(),
                            active_bytes,
                            cache_bytes,
                        });
                    }
                    // Sleep in short steps, so that a stop is seen at once.
                    let next = Instant::now() + INTERVAL;
                    while Instant::now() < next {
                        if flag.load(Ordering::Acquire) {
                            return samples;
                        }
                        std::thread::sleep(Duration::from_millis(20));
                    }
                }
            })?;
        Ok(Self { stop, thread })
    }

    /// Stops sampling and sums up.
    pub fn finish(self) -> anyhow::Result<MemorySummary> {
        self.stop.store(true, Ordering::Release);
        let samples = self
            .thread
            .join()
            .map_err(|_| anyhow::anyhow!("the memory sampler panicked"))?;
        Ok(summarize(mlx::peak_memory()?, samples))
    }
}

/// The summary of `samples` with MLX's `peak_bytes`.
fn summarize(peak_bytes: usize, samples: Vec<MemorySample>) -> MemorySummary {
    let none = MemorySample {
        t_s: 0.0,
        active_bytes: 0,
        cache_bytes: 0,
    };
    let max_active = samples
        .iter()
        .copied()
        .max_by_key(|s| s.active_bytes)
        .unwrap_or(none);
    let max_cache_bytes = samples.iter().map(|s| s.cache_bytes).max().unwrap_or(0);
    MemorySummary {
        peak_bytes,
        max_active,
        max_cache_bytes,
        samples,
    }
}

impl MemorySummary {
    /// The report's line.
    pub fn line(&self) -> String {
        const GIB: f64 = (1u64 << 30) as f64;
        format!(
            "MLX memory over the run: peak {:.2} GiB; sampled each second, active up to {:.2} GiB \
             (at {:.0} s), buffer cache up to {:.2} GiB",
            self.peak_bytes as f64 / GIB,
            self.max_active.active_bytes as f64 / GIB,
            self.max_active.t_s,
            self.max_cache_bytes as f64 / GIB
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summary_takes_the_largest_samples() {
        let s = |t_s, active_bytes, cache_bytes| MemorySample {
            t_s,
            active_bytes,
            cache_bytes,
        };
        let m = summarize(900, vec![s(0.0, 10, 5), s(1.0, 30, 1), s(2.0, 20, 7)]);
        assert_eq!((m.max_active.t_s, m.max_active.active_bytes), (1.0, 30));
        assert_eq!(m.max_cache_bytes, 7);
        assert_eq!(m.peak_bytes, 900);
        let empty = summarize(0, Vec::new());
        assert_eq!(empty.max_active.active_bytes, 0);
        assert!(empty.line().contains("peak 0.00 GiB"), "{}", empty.line());
    }

    #[test]
    fn a_sampler_samples_at_once_and_stops_when_asked() {
        let sampler = MemorySampler::start().unwrap();
        std::thread::sleep(Duration::from_millis(50));
        let m = sampler.finish().unwrap();
        assert!(
            !m.samples.is_empty(),
            "the first sample is taken at the start"
        );
    }
}
