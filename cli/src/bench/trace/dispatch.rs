//! Sending a trace's requests at their (compressed) arrival times to a [`Target`], with at
//! most `max_concurrency` in flight: a request whose slot is not free yet waits and is sent
//! late (its lateness is recorded; TTFT counts from the actual send, as a client sees it).
//! With a deadline, nothing is sent after it: a run that cannot keep up with the arrivals
//! still ends (the requests in flight finish) and reports the rest as unsent.

use std::sync::{Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use serde::Serialize;

/// What one request got back. Tier counts are `None` where the target does not report them
/// (the HTTP API reports only the total).
#[derive(Debug, Clone, Default, Serialize)]
pub struct Outcome {
    /// Prompt tokens (as the target counted them).
    pub prompt_tokens: usize,
    /// Prompt tokens served from the cache.
    pub cached_tokens: usize,
    /// Of those, resident on the device.
    pub cached_device_tokens: Option<usize>,
    /// Of those, restored from host RAM.
    pub cached_ram_tokens: Option<usize>,
    /// Of those, restored from SSD.
    pub cached_ssd_tokens: Option<usize>,
    /// Of those, fetched from the remote tier.
    pub cached_remote_tokens: Option<usize>,
    /// Cached host-RAM tokens (whole blocks) left unrestored because the cost model
    /// estimated recomputing them faster.
    pub skipped_ram_tokens: Option<usize>,
    /// The same for SSD blocks.
    pub skipped_ssd_tokens: Option<usize>,
    /// The same for remote-tier blocks.
    pub skipped_remote_tokens: Option<usize>,
    /// Tokens generated.
    pub completion_tokens: usize,
    /// Seconds from sending to the first generated token.
    pub ttft_s: Option<f64>,
    /// Seconds from sending to the last byte of the answer.
    pub e2e_s: Option<f64>,
    /// Where the time to first token went, when the target reports it (in process).
    pub ttft_parts: Option<TtftParts>,
    /// Why the request failed, if it did.
    pub error: Option<String>,
    /// The engine's id of the request (in process), as its step log names it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub request_id: Option<u64>,
    /// Which of several engines in this process served it (in turn order).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub engine: Option<usize>,
}

/// The parts of an in-process request's time to first token, as the engine counted them.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct TtftParts {
    /// Waiting in the engine's queue for admission (behind the I/O workers' lookup and
    /// load, a free row, the KV budget).
    pub queue_s: f64,
    /// Of `queue_s`'s span: from submission until the I/O workers had the cached prefix
    /// looked up and loaded (0 where it was not prefetched).
    pub prefetch_s: f64,
    /// Finding the cached prefix (keys, index lookups).
    pub lookup_s: f64,
    /// Reading and restoring the cached blocks into the device.
    pub restore_s: f64,
    /// Of `restore_s`, the engine thread's import of the loaded blocks into device memory.
    pub import_s: f64,
    /// The import's host half (checks and assembly) done ahead on an I/O worker while the
    /// request queued (a staged restore; not part of the TTFT's sum): 0 where the engine
    /// thread assembled the blocks.
    pub staged_s: f64,
    /// Prefilling the rest and picking the first token (the engine's time on its chunks).
    pub prefill_s: f64,
    /// The rest of the time to first token: the decoding rows' and other prompts' share of
    /// the steps the prompt waited through, its own chunks' steps included. At least 0; a
    /// lower bound where the lookup and load ran while the request queued.
    pub other_work_s: f64,
}

impl Outcome {
    /// A failed request.
    pub fn failed(why: impl Into<String>) -> Outcome {
        Outcome {
            error: Some(why.into()),
            ..Outcome::default()
        }
    }
}

/// Something requests can be sent to: the engine in this process, or a server.
pub trait Target: Sync {
    /// Sends one prompt with `max_tokens` to generate and waits for the whole answer.
    /// MUST NOT panic on a failed request: it returns [`Outcome::failed`].
    fn send(&self, prompt: Vec<u32>, max_tokens: usize) -> Outcome;
}

/// One request as sent.
#[derive(Debug, Clone, Serialize)]
pub struct Sent {
    /// Seconds after the start when the trace says to send it.
    pub scheduled_s: f64,
    /// Seconds after the start when it was sent (NaN when it was not).
    pub sent_s: f64,
    /// Not sent: the deadline came before its time or before a slot was free.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub unsent: bool,
    /// What came back.
    #[serde(flatten)]
    pub outcome: Outcome,
}

/// Sends request `i` at `times[i]` seconds after the start (`make(i)` gives its prompt and
/// `max_tokens`), at most `max_concurrency` at once; returns them in trace order. With a
/// `deadline` (after the start), no request is sent after it: those left are returned
/// [`Sent::unsent`]; the ones in flight finish.
pub fn replay<T: Target>(
    times: &[f64],
    make: &(dyn Fn(usize) -> (Vec<u32>, usize) + Sync),
    target: &T,
    max_concurrency: usize,
    deadline: Option<Duration>,
) -> Vec<Sent> {
    let start = Instant::now();
    let stop = deadline.map(|d| start + d);
    let busy = Mutex::new(0usize);
    let freed = Condvar::new();
    let results: Mutex<Vec<Option<Sent>>> = Mutex::new(vec![None; times.len()]);
    let report_every = (times.len() / 20).max(1);
    let mut sent_all = times.len();
    std::thread::scope(|scope| {
        for (i, &at) in times.iter().enumerate() {
            let due = start + Duration::from_secs_f64(at.max(0.0));
            if stop.is_some_and(|stop| due >= stop) {
                sent_all = i;
                break;
            }
            if let Some(wait) = due.checked_duration_since(Instant::now()) {
                std::thread::sleep(wait);
            }
            if !take_slot(&busy, &freed, max_concurrency.max(1), stop) {
                sent_all = i;
                break;
            }
            let (prompt, max_tokens) = make(i);
            let sent_s = start.elapsed().as_secs_f64();
            if i % report_every == 0 {
                let so_far = progress(&results.lock().unwrap_or_else(PoisonError::into_inner));
                eprintln!(
                    "request {}/{} at {sent_s:.1} s ({:.1} s late){so_far}",
                    i + 1,
                    times.len(),
                    (sent_s - at).max(0.0)
                );
            }
            let (busy, freed, results) = (&busy, &freed, &results);
            scope.spawn(move || {
                let outcome = target.send(prompt, max_tokens);
                results.lock().unwrap_or_else(PoisonError::into_inner)[i] = Some(Sent {
                    scheduled_s: at,
                    sent_s,
                    unsent: false,
                    outcome,
                });
                *busy.lock().unwrap_or_else(PoisonError::into_inner) -= 1;
                freed.notify_one();
            });
        }
    });
    results
        .into_inner()
        .unwrap_or_else(PoisonError::into_inner)
        .into_iter()
        .zip(times)
        .enumerate()
        .map(|(i, (s, &at))| {
            s.unwrap_or_else(|| Sent {
                scheduled_s: at,
                sent_s: f64::NAN,
                unsent: i >= sent_all,
                outcome: if i >= sent_all {
                    Outcome::default()
                } else {
                    Outcome::failed("the sending thread ended without a result")
                },
            })
        })
        .collect()
}

/// What the requests finished so far got, for a progress line (so that a run stopped before
/// its report still says something): how many finished (and failed), the share of their
/// prompt tokens served from the cache and their median TTFT. Empty before the first.
fn progress(results: &[Option<Sent>]) -> String {
    let done: Vec<&Outcome> = results.iter().flatten().map(|s| &s.outcome).collect();
    if done.is_empty() {
        return String::new();
    }
    let failed = done.iter().filter(|o| o.error.is_some()).count();
    let prompt: usize = done.iter().map(|o| o.prompt_tokens).sum();
    let cached: usize = done.iter().map(|o| o.cached_tokens).sum();
    let mut ttft: Vec<f64> = done.iter().filter_map(|o| o.ttft_s).collect();
    ttft.sort_by(f64::total_cmp);
    let median = match ttft.len() {
        0 => "-".to_string(),
        n => format!("{:.3} s", ttft[(n - 1) / 2]),
    };
    format!(
        "; {} finished ({failed} failed), {:.1}% of their prompt tokens cached, TTFT P50 {median}",
        done.len(),
        100.0 * cached as f64 / prompt.max(1) as f64,
    )
}

/// Waits until fewer than `max` requests are in flight and counts one more; `false` (and
/// nothing counted) when `stop` comes first.
fn take_slot(busy: &Mutex<usize>, freed: &Condvar, max: usize, stop: Option<Instant>) -> bool {
    let mut n = busy.lock().unwrap_or_else(PoisonError::into_inner);
    while *n >= max {
        n = match stop {
            None => freed.wait(n).unwrap_or_else(PoisonError::into_inner),
            Some(stop) => {
                let Some(left) = stop.checked_duration_since(Instant::now()) else {
                    return false;
                };
                freed
                    .wait_timeout(n, left)
                    .unwrap_or_else(PoisonError::into_inner)
                    .0
            }
        };
    }
    *n += 1;
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Counts how many sends overlap; answers with the prompt's length as cached tokens.
    struct Probe {
        now: AtomicUsize,
        max: AtomicUsize,
    }

    impl Target for Probe {
        fn send(&self, prompt: Vec<u32>, max_tokens: usize) -> Outcome {
            let n = self.now.fetch_add(1, Ordering::SeqCst) + 1;
            self.max.fetch_max(n, Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(5));
            self.now.fetch_sub(1, Ordering::SeqCst);
            Outcome {
                prompt_tokens: prompt.len(),
                cached_tokens: prompt.len() / 2,
                completion_tokens: max_tokens,
                ..Outcome::default()
            }
        }
    }

    #[test]
    fn results_come_back_in_trace_order_within_the_concurrency_limit() {
        let probe = Probe {
            now: AtomicUsize::new(0),
            max: AtomicUsize::new(0),
        };
        let times = vec![0.0; 12];
        let make = |i: usize| (vec![7; i + 1], i + 100);
        let out = replay(&times, &make, &probe, 3, None);
        assert_eq!(out.len(), 12);
        for (i, s) in out.iter().enumerate() {
            assert_eq!(s.outcome.prompt_tokens, i + 1);
            assert_eq!(s.outcome.completion_tokens, i + 100);
            assert!(s.sent_s >= s.scheduled_s);
        }
        let max = probe.max.load(Ordering::SeqCst);
        assert!((1..=3).contains(&max), "{max} in flight");
    }

    #[test]
    fn a_progress_line_sums_the_finished_requests_only() {
        let done = |prompt, cached, ttft: Option<f64>, error: Option<&str>| {
            Some(Sent {
                scheduled_s: 0.0,
                sent_s: 0.0,
                unsent: false,
                outcome: Outcome {
                    prompt_tokens: prompt,
                    cached_tokens: cached,
                    ttft_s: ttft,
                    error: error.map(str::to_string),
                    ..Outcome::default()
                },
            })
        };
        assert_eq!(progress(&[None, None]), "");
        let results = [
            done(100, 50, Some(0.4), None),
            None,
            done(300, 0, Some(0.1), None),
            done(0, 0, None, Some("refused")),
            done(600, 150, Some(2.0), None),
        ];
        // 200 of 1,000 prompt tokens cached; TTFTs 0.1, 0.4, 2.0: the median 0.4.
        assert_eq!(
            progress(&results),
            "; 4 finished (1 failed), 20.0% of their prompt tokens cached, TTFT P50 0.400 s"
        );
        assert_eq!(
            progress(&[done(0, 0, None, Some("x"))]),
            "; 1 finished (1 failed), 0.0% of their prompt tokens cached, TTFT P50 -"
        );
    }

    /// Sleeps `ms` per request.
    struct Slow(u64);

    impl Target for Slow {
        fn send(&self, prompt: Vec<u32>, _max_tokens: usize) -> Outcome {
            std::thread::sleep(Duration::from_millis(self.0));
            Outcome {
                prompt_tokens: prompt.len(),
                ..Outcome::default()
            }
        }
    }

    #[test]
    fn nothing_is_sent_after_the_deadline_and_the_rest_is_reported_unsent() {
        let make = |i: usize| (vec![1; i + 1], 1);
        // Request 2's time comes an hour after a 1-second deadline.
        let out = replay(
            &[0.0, 0.0, 3600.0],
            &make,
            &Slow(1),
            4,
            Some(Duration::from_secs(1)),
        );
        let unsent: Vec<bool> = out.iter().map(|s| s.unsent).collect();
        assert_eq!(unsent, [false, false, true]);
        assert_eq!(out[1].outcome.prompt_tokens, 2);
        assert!(out[2].sent_s.is_nan() && out[2].outcome.error.is_none());
        // One slot, held 400 ms by the first request: the deadline at 50 ms passes while
        // the second and third wait for it.
        let out = replay(
            &[0.0; 3],
            &make,
            &Slow(400),
            1,
            Some(Duration::from_millis(50)),
        );
        let unsent: Vec<bool> = out.iter().map(|s| s.unsent).collect();
        assert_eq!(unsent, [false, true, true]);
        assert_eq!(out[0].outcome.prompt_tokens, 1);
    }
}
