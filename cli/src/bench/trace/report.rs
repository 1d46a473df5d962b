//! What a replay measured, overall and per minute of trace time: hit share of prompt tokens
//! (per tier where the target reports tiers) beside the ideal and simulated LRU hit shares
//! of the same requests, TTFT and end-to-end latency percentiles, throughput.

use serde::Serialize;

use super::dispatch::{Sent, TtftParts};

/// One request: what was sent, what came back, and what the simulations predict for it.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// Index in the window.
    pub index: usize,
    /// Arrival in the trace, ms from the trace's start.
    pub timestamp_ms: u64,
    /// Prompt tokens sent (after `--token-scale`).
    pub prompt_len: usize,
    /// Hit tokens of an unbounded cache (simulated).
    pub ideal_tokens: usize,
    /// Hit tokens of the simulated LRU at the comparison budget.
    pub lru_tokens: Option<usize>,
    /// Hit tokens of the run's own eviction policy, simulated at the same budget with one
    /// perfect tier (in process, with a cache).
    pub policy_tokens: Option<usize>,
    /// What was sent and what came back.
    #[serde(flatten)]
    pub sent: Sent,
}

/// Nearest-rank percentiles of a sample.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Percentiles {
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
}

impl Percentiles {
    /// Percentiles of `v` (NaN where `v` is empty).
    pub fn of(v: &[f64]) -> Percentiles {
        let mut s: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
        s.sort_by(f64::total_cmp);
        let at = |q: f64| -> f64 {
            if s.is_empty() {
                return f64::NAN;
            }
            let rank = ((q * s.len() as f64).ceil() as usize).clamp(1, s.len());
            s[rank - 1]
        };
        Percentiles {
            p50: at(0.50),
            p90: at(0.90),
            p99: at(0.99),
        }
    }
}

/// Shares of prompt tokens by tier (`None` where the target does not report tiers).
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct TierShares {
    /// Resident on the device.
    pub device: Option<f64>,
    /// Restored from host RAM.
    pub ram: Option<f64>,
    /// Restored from SSD.
    pub ssd: Option<f64>,
    /// Fetched from the remote tier.
    pub remote: Option<f64>,
}

/// A group of requests summed up (the whole run, or one minute).
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    /// Requests in the group.
    pub requests: usize,
    /// Of those, failed (left out of every share and percentile).
    pub failed: usize,
    /// Of those, not sent: `--deadline` came first (left out likewise).
    pub unsent: usize,
    /// Prompt tokens of the requests that succeeded.
    pub prompt_tokens: usize,
    /// Of those, served from the cache.
    pub cached_tokens: usize,
    /// `cached_tokens / prompt_tokens`.
    pub hit_share: f64,
    /// The same by tier.
    pub tiers: TierShares,
    /// Shares of prompt tokens found cached in a host tier but recomputed, because the cost
    /// model estimated that faster than restoring them (in process only).
    pub skipped: TierShares,
    /// An unbounded cache's hit share over the same requests.
    pub ideal_share: f64,
    /// `hit_share / ideal_share`.
    pub of_ideal: f64,
    /// The simulated LRU's hit share over the same requests.
    pub lru_share: Option<f64>,
    /// The run's own eviction policy's hit share, simulated at the same budget with one
    /// perfect tier: what the tiers' mechanics (dropped writes, recomputes chosen, the
    /// split into tiers) leave of it is the gap to `hit_share`.
    pub policy_share: Option<f64>,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// Time to first token, seconds from sending.
    pub ttft_s: Percentiles,
    /// Whole request, seconds from sending.
    pub e2e_s: Percentiles,
    /// Seconds a request was sent after its trace time (waiting for a slot).
    pub late_s: Percentiles,
    /// Medians of the parts of the time to first token, where the target reports them.
    pub ttft_parts_p50: Option<TtftParts>,
    /// The requests that imported loaded blocks, where the target reports them.
    pub imports: Option<Imports>,
}

/// Imports of loaded blocks into device memory over a run's requests.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Imports {
    /// Requests that imported blocks from a host tier.
    pub requests: usize,
    /// Of those, the requests whose import an I/O worker staged (assembled ahead).
    pub staged: usize,
    /// Median of the engine thread's import seconds, over `requests`.
    pub import_s_p50: f64,
    /// Median of the I/O workers' staging seconds, over `staged`.
    pub staged_s_p50: f64,
}

/// Sums up `rows`.
pub fn summarize(rows: &[&Row]) -> Summary {
    let ok: Vec<&&Row> = rows
        .iter()
        .filter(|r| !r.sent.unsent && r.sent.outcome.error.is_none())
        .collect();
    let unsent = rows.iter().filter(|r| r.sent.unsent).count();
    let prompt: usize = ok.iter().map(|r| r.prompt_len).sum();
    let share = |n: usize| {
        if prompt == 0 {
            0.0
        } else {
            n as f64 / prompt as f64
        }
    };
    let tier = |f: fn(&Row) -> Option<usize>| -> Option<f64> {
        let v: Option<Vec<usize>> = ok.iter().map(|r| f(r)).collect();
        v.filter(|v| !v.is_empty()).map(|v| share(v.iter().sum()))
    };
    let cached: usize = ok.iter().map(|r| r.sent.outcome.cached_tokens).sum();
    let ideal = share(ok.iter().map(|r| r.ideal_tokens).sum());
    let lru: Option<Vec<usize>> = ok.iter().map(|r| r.lru_tokens).collect();
    let policy: Option<Vec<usize>> = ok.iter().map(|r| r.policy_tokens).collect();
    let pct = |f: fn(&Row) -> Option<f64>| {
        Percentiles::of(&ok.iter().filter_map(|r| f(r)).collect::<Vec<_>>())
    };
    let parts: Vec<TtftParts> = ok
        .iter()
        .filter_map(|r| r.sent.outcome.ttft_parts)
        .collect();
    let median =
        |f: fn(&TtftParts) -> f64| Percentiles::of(&parts.iter().map(f).collect::<Vec<_>>()).p50;
    let ttft_parts_p50 = (!parts.is_empty()).then(|| TtftParts {
        queue_s: median(|p| p.queue_s),
        prefetch_s: median(|p| p.prefetch_s),
        lookup_s: median(|p| p.lookup_s),
        restore_s: median(|p| p.restore_s),
        prefill_s: median(|p| p.prefill_s),
        other_work_s: median(|p| p.other_work_s),
        import_s: median(|p| p.import_s),
        staged_s: median(|p| p.staged_s),
    });
    let imported: Vec<&TtftParts> = parts.iter().filter(|p| p.import_s > 0.0).collect();
    let staged: Vec<f64> = imported
        .iter()
        .map(|p| p.staged_s)
        .filter(|&s| s > 0.0)
        .collect();
    let imports = (!parts.is_empty()).then(|| Imports {
        requests: imported.len(),
        staged: staged.len(),
        import_s_p50: Percentiles::of(&imported.iter().map(|p| p.import_s).collect::<Vec<_>>()).p50,
        staged_s_p50: Percentiles::of(&staged).p50,
    });
    Summary {
        requests: rows.len(),
        failed: rows.len() - ok.len() - unsent,
        unsent,
        prompt_tokens: prompt,
        cached_tokens: cached,
        hit_share: share(cached),
        tiers: TierShares {
            device: tier(|r| r.sent.outcome.cached_device_tokens),
            ram: tier(|r| r.sent.outcome.cached_ram_tokens),
            ssd: tier(|r| r.sent.outcome.cached_ssd_tokens),
            remote: tier(|r| r.sent.outcome.cached_remote_tokens),
        },
        skipped: TierShares {
            device: None,
            ram: tier(|r| r.sent.outcome.skipped_ram_tokens),
            ssd: tier(|r| r.sent.outcome.skipped_ssd_tokens),
            remote: tier(|r| r.sent.outcome.skipped_remote_tokens),
        },
        ideal_share: ideal,
        of_ideal: if ideal > 0.0 {
            share(cached) / ideal
        } else {
            f64::NAN
        },
        lru_share: lru.filter(|v| !v.is_empty()).map(|v| share(v.iter().sum())),
        policy_share: policy
            .filter(|v| !v.is_empty())
            .map(|v| share(v.iter().sum())),
        completion_tokens: ok.iter().map(|r| r.sent.outcome.completion_tokens).sum(),
        ttft_s: pct(|r| r.sent.outcome.ttft_s),
        e2e_s: pct(|r| r.sent.outcome.e2e_s),
        late_s: pct(|r| Some((r.sent.sent_s - r.sent.scheduled_s).max(0.0))),
        ttft_parts_p50,
        imports,
    }
}

/// Summaries per minute of trace time from `start_ms`, every minute up to the last request
/// (a minute without requests has `requests: 0`).
pub fn per_minute(rows: &[Row], start_ms: u64) -> Vec<Summary> {
    let minute = |r: &Row| (r.timestamp_ms.saturating_sub(start_ms) / 60_000) as usize;
    let n = rows.iter().map(minute).max().map_or(0, |m| m + 1);
    (0..n)
        .map(|m| summarize(&rows.iter().filter(|r| minute(r) == m).collect::<Vec<_>>()))
        .collect()
}

/// `x` as a percentage with one decimal, or `-`.
pub fn pct(x: Option<f64>) -> String {
    match x {
        Some(v) if v.is_finite() => format!("{:.1}%", 100.0 * v),
        _ => "-".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::trace::dispatch::Outcome;

    fn row(i: usize, ts: u64, len: usize, cached: usize, ideal: usize, ttft: f64) -> Row {
        Row {
            index: i,
            timestamp_ms: ts,
            prompt_len: len,
            ideal_tokens: ideal,
            lru_tokens: Some(ideal / 2),
            policy_tokens: Some(ideal * 3 / 4),
            sent: Sent {
                scheduled_s: 1.0,
                sent_s: 1.5,
                unsent: false,
                outcome: Outcome {
                    prompt_tokens: len,
                    cached_tokens: cached,
                    cached_device_tokens: Some(cached),
                    skipped_ssd_tokens: Some(ideal - cached),
                    ttft_s: Some(ttft),
                    e2e_s: Some(2.0 * ttft),
                    ..Outcome::default()
                },
            },
        }
    }

    /// Imports are counted over the requests that imported (an import time above 0), and
    /// staged ones over those with a staging time: medians by hand.
    #[test]
    fn imports_count_the_requests_that_imported_and_those_staged() {
        let parts = [
            (0.0, 0.0),
            (0.004, 0.0),
            (0.001, 0.002),
            (0.002, 0.006),
            (0.003, 0.0),
        ];
        let rows: Vec<Row> = parts
            .iter()
            .enumerate()
            .map(|(i, &(import_s, staged_s))| {
                let mut r = row(i, 0, 10, 0, 0, 0.1);
                r.sent.outcome.ttft_parts = Some(TtftParts {
                    import_s,
                    staged_s,
                    ..TtftParts::default()
                });
                r
            })
            .collect();
        let i = summarize(&rows.iter().collect::<Vec<_>>()).imports.unwrap();
        assert_eq!((i.requests, i.staged), (4, 2));
        // Imports 0.001, 0.002, 0.003, 0.004: the nearest-rank median is the 2nd.
        assert_eq!(i.import_s_p50, 0.002);
        assert_eq!(i.staged_s_p50, 0.002);
        // Without TTFT parts (over HTTP) nothing is said.
        let plain = row(0, 0, 10, 0, 0, 0.1);
        assert!(summarize(&[&plain]).imports.is_none());
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        let p = Percentiles::of(&v);
        assert_eq!((p.p50, p.p90, p.p99), (50.0, 90.0, 99.0));
        let p = Percentiles::of(&[3.0]);
        assert_eq!((p.p50, p.p99), (3.0, 3.0));
        assert!(Percentiles::of(&[]).p50.is_nan());
    }

    #[test]
    fn summaries_skip_failures_and_unsent_requests_and_split_by_minute() {
        let mut rows = vec![
            row(0, 0, 100, 0, 0, 1.0),
            row(1, 30_000, 100, 50, 80, 3.0),
            row(2, 130_000, 200, 100, 100, 2.0),
        ];
        rows.push(Row {
            sent: Sent {
                outcome: Outcome::failed("x"),
                ..rows[0].sent.clone()
            },
            ..row(3, 140_000, 1000, 0, 500, 9.0)
        });
        rows.push(Row {
            sent: Sent {
                unsent: true,
                sent_s: f64::NAN,
                ..rows[0].sent.clone()
            },
            ..row(4, 150_000, 700, 0, 600, 8.0)
        });
        let all = summarize(&rows.iter().collect::<Vec<_>>());
        assert_eq!((all.requests, all.failed, all.unsent), (5, 1, 1));
        assert_eq!(all.prompt_tokens, 400);
        assert_eq!(all.hit_share, 150.0 / 400.0);
        assert_eq!(all.ideal_share, 180.0 / 400.0);
        assert_eq!(all.lru_share, Some(90.0 / 400.0));
        // The shipped policy's tokens of the three answered rows: 3/4 of 0, 80 and 100.
        assert_eq!(all.policy_share, Some(135.0 / 400.0));
        assert_eq!(all.tiers.device, Some(150.0 / 400.0));
        assert_eq!(all.tiers.ram, None);
        assert_eq!(
            all.skipped.ssd,
            Some(30.0 / 400.0),
            "r1's 30 ideal tokens it recomputed"
        );
        assert_eq!(all.skipped.ram, None);
        assert_eq!(all.ttft_s.p50, 2.0);
        assert_eq!(all.late_s.p50, 0.5);
        let m = per_minute(&rows, 0);
        assert_eq!(m.len(), 3);
        assert_eq!(m[0].requests, 2);
        assert_eq!(m[1].requests, 0);
        assert_eq!(
            (m[2].requests, m[2].failed, m[2].unsent, m[2].prompt_tokens),
            (3, 1, 1, 200)
        );
    }
}
