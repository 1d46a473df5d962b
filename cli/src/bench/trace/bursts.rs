//! TTFT by place in a burst: the Mooncake trace sends its requests in bursts (every request
//! of a burst has the same timestamp), so a request's TTFT depends on how many of its burst
//! came before it. Grouping the answered requests by that place shows where a burst's
//! queue forms: in the admission queue (`queue_s`, in process) or in the passes after it.

use serde::Serialize;

use super::report::{Percentiles, Row};

/// Places in a burst, as ranges of 1-based places: the first request, the next three, the
/// four after, the rest.
const PLACES: [(usize, usize, &str); 4] = [
    (1, 1, "1st"),
    (2, 4, "2nd-4th"),
    (5, 8, "5th-8th"),
    (9, usize::MAX, "9th+"),
];

/// The answered requests at some places in their bursts.
#[derive(Debug, Clone, Serialize)]
pub struct BurstPlace {
    /// The places, e.g. `2nd-4th`.
    pub places: &'static str,
    /// Answered requests at those places.
    pub requests: usize,
    /// Their median TTFT, seconds.
    pub ttft_p50_s: f64,
    /// Their median wait for admission, seconds, where the target reports it (in process).
    pub queue_p50_s: Option<f64>,
}

/// Each answered request of `rows` (in trace order) by its place among the requests with
/// its timestamp; places with no request are left out.
pub fn burst_places(rows: &[Row]) -> Vec<BurstPlace> {
    let mut place = Vec::with_capacity(rows.len());
    for (i, r) in rows.iter().enumerate() {
        let first = i == 0 || rows[i - 1].timestamp_ms != r.timestamp_ms;
        place.push(if first { 1 } else { place[i - 1] + 1 });
    }
    PLACES
        .iter()
        .filter_map(|&(lo, hi, name)| {
            let at: Vec<&Row> = rows
                .iter()
                .zip(&place)
                .filter(|(r, &p)| (lo..=hi).contains(&p) && r.sent.outcome.ttft_s.is_some())
                .map(|(r, _)| r)
                .collect();
            if at.is_empty() {
                return None;
            }
            let ttft: Vec<f64> = at.iter().filter_map(|r| r.sent.outcome.ttft_s).collect();
            let queue: Vec<f64> = at
                .iter()
                .filter_map(|r| r.sent.outcome.ttft_parts.map(|p| p.queue_s))
                .collect();
            Some(BurstPlace {
                places: name,
                requests: at.len(),
                ttft_p50_s: Percentiles::of(&ttft).p50,
                queue_p50_s: (!queue.is_empty()).then(|| Percentiles::of(&queue).p50),
            })
        })
        .collect()
}

/// The places as one line of the report.
pub fn describe(places: &[BurstPlace]) -> String {
    let cells: Vec<String> = places
        .iter()
        .map(|p| {
            let queue = p
                .queue_p50_s
                .map_or(String::new(), |q| format!(", queue {q:.3} s"));
            format!(
                "{} {} req: TTFT {:.3} s{queue}",
                p.places, p.requests, p.ttft_p50_s
            )
        })
        .collect();
    format!(
        "by place in a burst (requests with one timestamp), medians: {}",
        cells.join("; ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::trace::dispatch::{Outcome, Sent, TtftParts};

    fn row(timestamp_ms: u64, ttft: Option<f64>, queue: f64) -> Row {
        Row {
            index: 0,
            timestamp_ms,
            prompt_len: 1,
            ideal_tokens: 0,
            lru_tokens: None,
            policy_tokens: None,
            sent: Sent {
                scheduled_s: 0.0,
                sent_s: 0.0,
                unsent: false,
                outcome: Outcome {
                    ttft_s: ttft,
                    ttft_parts: Some(TtftParts {
                        queue_s: queue,
                        ..TtftParts::default()
                    }),
                    ..Outcome::default()
                },
            },
        }
    }

    /// Two bursts: at 0 ms five requests, at 10 ms two (the second failed, no TTFT). Places:
    /// 1, 2, 3, 4, 5 and 1, 2. So 1st: the two firsts; 2nd-4th: three answered (the 10 ms
    /// burst's second has no TTFT); 5th-8th: one; 9th+: none, left out.
    #[test]
    fn places_by_timestamp_by_hand() {
        let rows = vec![
            row(0, Some(0.1), 0.0),
            row(0, Some(0.2), 0.01),
            row(0, Some(0.3), 0.02),
            row(0, Some(0.4), 0.03),
            row(0, Some(0.5), 0.04),
            row(10, Some(0.15), 0.0),
            row(10, None, 0.0),
        ];
        let p = burst_places(&rows);
        assert_eq!(p.len(), 3);
        assert_eq!((p[0].places, p[0].requests), ("1st", 2));
        // Nearest rank of two: the smaller.
        assert_eq!(p[0].ttft_p50_s, 0.1);
        assert_eq!((p[1].places, p[1].requests), ("2nd-4th", 3));
        assert_eq!((p[1].ttft_p50_s, p[1].queue_p50_s), (0.3, Some(0.02)));
        assert_eq!(
            (p[2].places, p[2].requests, p[2].ttft_p50_s),
            ("5th-8th", 1, 0.5)
        );
        assert_eq!(
            describe(&p[..1]),
            "by place in a burst (requests with one timestamp), medians: 1st 2 req: TTFT 0.100 s, queue 0.000 s"
        );
    }
}
