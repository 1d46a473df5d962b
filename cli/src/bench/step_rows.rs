//! What a decode-only engine step costs the engine thread as its rows grow: the step log's
//! decode-only steps in buckets of rows, and a least-squares line through them. On a GPU a
//! step's launch is host work (building the graph, then MLX encoding every kernel on the
//! engine thread), so the line's slope is the host cost a row adds to every step, the bound
//! on how many rows the engine can keep decoding (docs/benchmarks.md, session 30).

use serde::Serialize;

/// Decode-only steps whose row count lies in `rows_min..=rows_max`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub(crate) struct RowsCost {
    pub(crate) rows_min: usize,
    pub(crate) rows_max: usize,
    /// Steps in the bucket.
    pub(crate) steps: usize,
    /// Mean launch (queueing the step) and its engine-thread CPU time, seconds.
    pub(crate) launch_s: f64,
    pub(crate) launch_cpu_s: f64,
    /// Mean time building the step's graph, seconds (the rest of the launch waited for the
    /// previous step and handed the graph to MLX, which encodes its kernels).
    pub(crate) build_s: f64,
}

/// `base_s + per_row_s · rows`, fitted by least squares.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub(crate) struct RowsLine {
    pub(crate) base_s: f64,
    pub(crate) per_row_s: f64,
}

impl RowsLine {
    /// The least-squares line through `(rows, seconds)`; `None` with fewer than two
    /// distinct row counts.
    pub(crate) fn fit(points: &[(usize, f64)]) -> Option<RowsLine> {
        let n = points.len() as f64;
        let mean_x = points.iter().map(|p| p.0 as f64).sum::<f64>() / n;
        let mean_y = points.iter().map(|p| p.1).sum::<f64>() / n;
        let sxx: f64 = points.iter().map(|p| (p.0 as f64 - mean_x).powi(2)).sum();
        if points.is_empty() || sxx == 0.0 {
            return None;
        }
        let sxy: f64 = points
            .iter()
            .map(|p| (p.0 as f64 - mean_x) * (p.1 - mean_y))
            .sum();
        let per_row_s = sxy / sxx;
        Some(RowsLine {
            base_s: mean_y - per_row_s * mean_x,
            per_row_s,
        })
    }
}

/// Bucket bounds: a row alone, then ranges of four up to the default batch of 16.
const BUCKETS: [(usize, usize); 6] = [(1, 1), (2, 4), (5, 8), (9, 12), (13, 16), (17, usize::MAX)];

/// One decode-only step's rows and its launch, launch CPU and graph building, microseconds.
pub(crate) type StepCost = (usize, u64, u64, u64);

/// Per-row costs of decode-only steps.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub(crate) struct DecodeRowsCost {
    /// The non-empty buckets, fewest rows first.
    pub(crate) buckets: Vec<RowsCost>,
    /// Launch CPU time and graph building against rows, over every decode-only step.
    pub(crate) launch_cpu: Option<RowsLine>,
    pub(crate) build: Option<RowsLine>,
}

impl DecodeRowsCost {
    /// From each decode-only step's rows, launch, launch CPU and build, in microseconds.
    pub(crate) fn of(steps: &[StepCost]) -> DecodeRowsCost {
        let secs = |us: u64| us as f64 * 1e-6;
        let buckets = BUCKETS
            .iter()
            .filter_map(|&(lo, hi)| {
                let inside: Vec<_> = steps.iter().filter(|s| (lo..=hi).contains(&s.0)).collect();
                let n = inside.len();
                let mean = |f: &dyn Fn(&StepCost) -> u64| {
                    inside.iter().map(|s| secs(f(s))).sum::<f64>() / n as f64
                };
                (n > 0).then(|| RowsCost {
                    rows_min: lo,
                    rows_max: hi.min(inside.iter().map(|s| s.0).max().unwrap_or(lo)),
                    steps: n,
                    launch_s: mean(&|s| s.1),
                    launch_cpu_s: mean(&|s| s.2),
                    build_s: mean(&|s| s.3),
                })
            })
            .collect();
        let line = |f: &dyn Fn(&StepCost) -> u64| {
            RowsLine::fit(&steps.iter().map(|s| (s.0, secs(f(s)))).collect::<Vec<_>>())
        };
        DecodeRowsCost {
            buckets,
            launch_cpu: line(&|s| s.2),
            build: line(&|s| s.3),
        }
    }

    /// One line: each bucket's steps, launch CPU and graph building, then the fitted lines.
    pub(crate) fn summary(&self) -> String {
        let ms = |s: f64| s * 1e3;
        let buckets: Vec<String> = self
            .buckets
            .iter()
            .map(|b| {
                let rows = if b.rows_min == b.rows_max {
                    b.rows_min.to_string()
                } else {
                    format!("{}-{}", b.rows_min, b.rows_max)
                };
                format!(
                    "{rows} rows: {} steps, {:.2} / {:.2} ms",
                    b.steps,
                    ms(b.launch_cpu_s),
                    ms(b.build_s)
                )
            })
            .collect();
        let line = |l: Option<RowsLine>| match l {
            Some(l) => format!("{:.2} ms + {:.3} ms a row", ms(l.base_s), ms(l.per_row_s)),
            None => "-".to_string(),
        };
        format!(
            "decode-only steps by rows (launch CPU / of it building the graph): {}; launch CPU {}, building {}",
            if buckets.is_empty() {
                "none".to_string()
            } else {
                buckets.join("; ")
            },
            line(self.launch_cpu),
            line(self.build),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_line_through_exact_points_is_found() {
        let pts: Vec<(usize, f64)> = (1..=16).map(|r| (r, 0.002 + 0.0005 * r as f64)).collect();
        let l = RowsLine::fit(&pts).unwrap();
        assert!((l.base_s - 0.002).abs() < 1e-12, "{l:?}");
        assert!((l.per_row_s - 0.0005).abs() < 1e-12, "{l:?}");
        // One row count only: no slope to fit.
        assert_eq!(RowsLine::fit(&[(4, 1.0), (4, 2.0)]), None);
        assert_eq!(RowsLine::fit(&[]), None);
    }

    #[test]
    fn steps_fall_into_their_buckets_with_means() {
        // (rows, launch, launch CPU, build) in µs.
        let steps = [
            (1, 3000, 2000, 500),
            (3, 5000, 4000, 700),
            (4, 7000, 6000, 900),
            (14, 20000, 12000, 2000),
        ];
        let c = DecodeRowsCost::of(&steps);
        let got: Vec<(usize, usize, usize)> = c
            .buckets
            .iter()
            .map(|b| (b.rows_min, b.rows_max, b.steps))
            .collect();
        assert_eq!(got, vec![(1, 1, 1), (2, 4, 2), (13, 14, 1)]);
        let b = &c.buckets[1];
        assert!((b.launch_s - 0.006).abs() < 1e-12);
        assert!((b.launch_cpu_s - 0.005).abs() < 1e-12);
        assert!((b.build_s - 0.0008).abs() < 1e-12);
        let l = c.launch_cpu.unwrap();
        assert!(l.per_row_s > 0.0007 && l.per_row_s < 0.0008, "{l:?}");
        let s = c.summary();
        assert!(s.contains("2-4 rows: 2 steps, 5.00 / 0.80 ms"), "{s}");
        assert!(s.contains("13-14 rows: 1 steps"), "{s}");
    }
}
