//! The engine in this process as a replay target: the same `Engine` (continuous batching,
//! prefix reuse over the device pool, RAM, SSD and remote tiers) that `kvstore serve` runs,
//! without HTTP. Every request generates exactly its `max_tokens` (EOS does not stop it), so
//! the load matches the trace's output lengths.

use std::time::Instant;

use engine::{Engine, Event, GenerateParams, Request};

use super::dispatch::{Outcome, Target, TtftParts};

/// Sends requests to an engine.
pub struct EngineTarget<'a> {
    /// The engine requests go to.
    pub engine: &'a Engine,
    /// Tokens in one of its KV blocks (`--block-size`).
    pub block_tokens: usize,
}

impl Target for EngineTarget<'_> {
    fn send(&self, prompt: Vec<u32>, max_tokens: usize) -> Outcome {
        let t0 = Instant::now();
        let params = GenerateParams {
            max_tokens,
            stop_at_eos: false,
            ..GenerateParams::default()
        };
        let mut handle = match self.engine.submit(Request::new(prompt, params)) {
            Ok(h) => h,
            Err(e) => return Outcome::failed(format!("refused: {e}")),
        };
        let request_id = Some(handle.id());
        let mut ttft_s = None;
        while let Some(event) = handle.recv_blocking() {
            match event {
                Event::Token { .. } => {
                    ttft_s.get_or_insert_with(|| t0.elapsed().as_secs_f64());
                }
                Event::Finished(c) => {
                    let r = &c.reuse;
                    return Outcome {
                        prompt_tokens: c.prompt_tokens,
                        cached_tokens: c.cached_tokens,
                        cached_device_tokens: Some(r.cached_device_tokens),
                        cached_ram_tokens: Some(r.cached_ram_tokens),
                        cached_ssd_tokens: Some(r.cached_ssd_tokens),
                        cached_remote_tokens: Some(r.cached_remote_tokens),
                        skipped_ram_tokens: Some(r.ram_blocks_skipped * self.block_tokens),
                        skipped_ssd_tokens: Some(r.ssd_blocks_skipped * self.block_tokens),
                        skipped_remote_tokens: Some(r.remote_blocks_skipped * self.block_tokens),
                        completion_tokens: c.completion_tokens,
                        ttft_s,
                        e2e_s: Some(t0.elapsed().as_secs_f64()),
                        ttft_parts: Some(TtftParts {
                            queue_s: c.queue_s,
                            prefetch_s: r.prefetch_s,
                            lookup_s: r.lookup_s,
                            restore_s: r.restore_s,
                            import_s: r.import_s,
                            staged_s: r.staged_s,
                            prefill_s: r.prefill_s,
                            other_work_s: ttft_s.map_or(0.0, |t| {
                                (t - c.queue_s - r.lookup_s - r.restore_s - r.prefill_s).max(0.0)
                            }),
                        }),
                        error: None,
                        request_id,
                        engine: None,
                    };
                }
                Event::Failed(e) => {
                    return Outcome {
                        request_id,
                        ..Outcome::failed(e.to_string())
                    }
                }
                _ => {}
            }
        }
        Outcome::failed("the engine closed the request's stream without an end")
    }
}

/// Sends requests to several engines in turn (servers behind a round-robin balancer): the
/// k-th request sent goes to engine k mod N.
pub struct RoundRobin<'a> {
    /// The engines, in turn order.
    pub targets: Vec<EngineTarget<'a>>,
    /// Requests sent so far.
    pub next: std::sync::atomic::AtomicUsize,
}

impl Target for RoundRobin<'_> {
    fn send(&self, prompt: Vec<u32>, max_tokens: usize) -> Outcome {
        if self.targets.is_empty() {
            return Outcome::failed("no engine to send to");
        }
        let k = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % self.targets.len();
        Outcome {
            engine: Some(k),
            ..self.targets[k].send(prompt, max_tokens)
        }
    }
}
