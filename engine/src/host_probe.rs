//! The host-delay probe: whether a decode step's device work overlaps the host's.
//!
//! With `KVSTORE_PROBE_HOST_US=N` the engine thread spins for N µs right after it queues a
//! decode step, before it reads the previous step's picks: N µs of host work added to every
//! step at the point where a pipelined loop has the device busy with the step just queued.
//! If the device's work overlaps the host's, a step's time does not grow until the host's
//! whole share (building, queueing, reading, emitting, plus N) passes the device's; if it
//! grows by N from the first microseconds, the device waits for the host somewhere in each
//! step. `scripts/cuda/host_delay_mlx_lm.py` adds the same spin to mlx-lm's loop, the
//! reference (docs/benchmarks.md, session 39). Off (0) unless set; read once.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The variable that sets the spin, in µs.
pub const HOST_PROBE_VAR: &str = "KVSTORE_PROBE_HOST_US";

/// The spin after each queued decode step: `KVSTORE_PROBE_HOST_US`, else none.
fn spin() -> Duration {
    static SPIN: OnceLock<Duration> = OnceLock::new();
    *SPIN.get_or_init(|| {
        let us = std::env::var(HOST_PROBE_VAR)
            .ok()
            .and_then(|v| match v.parse::<u64>() {
                Ok(us) => Some(us),
                Err(_) => {
                    tracing::warn!("{HOST_PROBE_VAR}={v:?} is not a whole number of µs: no spin");
                    None
                }
            });
        Duration::from_micros(us.unwrap_or(0))
    })
}

/// Spins the calling thread for the probe's time (nothing when it is off).
pub(crate) fn after_queued_step() {
    let d = spin();
    if d.is_zero() {
        return;
    }
    let until = Instant::now() + d;
    while Instant::now() < until {
        std::hint::spin_loop();
    }
}
