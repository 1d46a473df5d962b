//! The transfer pool: the few threads that split, assemble and copy KV between host bytes
//! and device memory in bulk where transfers go through the driver (CUDA), apart from
//! rayon's global pool.
//!
//! Why a pool of its own, and a small one: on the H100 under the Mooncake trace the export
//! thread's read-back ran on every core of the global pool (16 threads, each a `cuMemcpyDtoH`
//! and a split of ~60 GB in two minutes), and the engine thread, which launches every step's
//! kernels, ran its steps ~15 % slower than without the host tiers (mean launch 16.2 against
//! 12.6-13.5 ms; TTFT P50 0.486 s against 0.29-0.34 s without a cache). The same binary with
//! the work on 4 threads launched at the no-cache arm's speed (12.9-13.7 ms), read the same
//! bytes back in 17 s instead of 14 and took TTFT P50 to 0.35-0.37 s; on 2 threads the
//! read-back fell behind (30 s, 2-3x the skipped exports). docs/benchmarks.md, session 35.
//!
//! Where transfers are not the driver's (the CPU, Apple's unified memory) the work is host
//! memory copies that compete with nothing of the kind, and the CPU's model kernels need the
//! global pool's threads: [`run`] then leaves the caller where it is.

use std::sync::OnceLock;

/// Threads of the pool: `KVSTORE_TRANSFER_THREADS` where set (at least 1), else a quarter of
/// the machine's cores, between 1 and 4.
pub fn transfer_threads() -> usize {
    let set = std::env::var("KVSTORE_TRANSFER_THREADS")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok());
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    threads_for(set, cores)
}

/// [`transfer_threads`] for an override and a core count.
fn threads_for(set: Option<usize>, cores: usize) -> usize {
    match set {
        Some(n) => n.max(1),
        None => (cores / 4).clamp(1, 4),
    }
}

fn pool() -> Option<&'static rayon::ThreadPool> {
    static POOL: OnceLock<Option<rayon::ThreadPool>> = OnceLock::new();
    POOL.get_or_init(|| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(transfer_threads())
            .thread_name(|i| format!("kvstore-transfer-{i}"))
            .build()
            .map_err(|e| tracing::warn!(error = %e, "no transfer pool: bulk copies use rayon's global pool"))
            .ok()
    })
    .as_ref()
}

/// Runs `f`, its rayon work (`par_iter`, scopes) on the transfer pool where transfers go
/// through the driver ([`mlx::direct_transfers`]); elsewhere as called.
pub(crate) fn run<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    run_if(mlx::direct_transfers(), f)
}

/// [`run`] with the choice made by the caller.
fn run_if<R: Send>(on_pool: bool, f: impl FnOnce() -> R + Send) -> R {
    match pool() {
        Some(p) if on_pool => p.install(f),
        _ => f(),
    }
}

/// `rayon::in_place_scope` whose spawned work runs on the transfer pool where transfers go
/// through the driver (the closure itself stays on the calling thread, as the device copies
/// it makes must); elsewhere on the current pool.
pub(crate) fn in_place_scope<'scope, R>(f: impl FnOnce(&rayon::Scope<'scope>) -> R) -> R {
    in_place_scope_if(mlx::direct_transfers(), f)
}

/// [`in_place_scope`] with the choice made by the caller.
fn in_place_scope_if<'scope, R>(on_pool: bool, f: impl FnOnce(&rayon::Scope<'scope>) -> R) -> R {
    match pool() {
        Some(p) if on_pool => p.in_place_scope(f),
        _ => rayon::in_place_scope(f),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_quarter_of_the_cores_between_one_and_four_unless_set() {
        assert_eq!(threads_for(None, 1), 1);
        assert_eq!(threads_for(None, 2), 1);
        assert_eq!(threads_for(None, 8), 2);
        assert_eq!(threads_for(None, 16), 4);
        assert_eq!(threads_for(None, 128), 4);
        assert_eq!(threads_for(Some(0), 16), 1);
        assert_eq!(threads_for(Some(12), 16), 12);
    }

    #[test]
    fn work_on_the_pool_runs_on_its_own_few_threads() {
        use rayon::prelude::*;
        use std::collections::HashSet;
        let names = |on_pool: bool| -> (u64, HashSet<String>) {
            run_if(on_pool, || {
                let parts: Vec<(u64, String)> = (1..=4000u64)
                    .into_par_iter()
                    .map(|i| {
                        let name = std::thread::current().name().unwrap_or("").to_string();
                        (i, name)
                    })
                    .collect();
                let sum = parts.iter().map(|(i, _)| i).sum();
                (sum, parts.into_iter().map(|(_, n)| n).collect())
            })
        };
        let (sum, on_pool) = names(true);
        assert_eq!(sum, 8_002_000);
        assert!(
            on_pool.iter().all(|n| n.starts_with("kvstore-transfer-")),
            "{on_pool:?}"
        );
        assert!(on_pool.len() <= transfer_threads(), "{on_pool:?}");
        // Off the pool the caller's own pool (rayon's global one here) does the work.
        let (sum, off) = names(false);
        assert_eq!(sum, 8_002_000);
        assert!(
            off.iter().all(|n| !n.starts_with("kvstore-transfer-")),
            "{off:?}"
        );
    }

    #[test]
    fn a_scope_on_the_pool_keeps_its_closure_on_the_caller_and_spawns_onto_the_pool() {
        let name = || std::thread::current().name().unwrap_or("").to_string();
        let caller = name();
        let mut spawned = String::new();
        let in_closure = in_place_scope_if(true, |s| {
            s.spawn(|_| spawned = name());
            name()
        });
        assert_eq!(in_closure, caller, "the closure left the calling thread");
        assert!(spawned.starts_with("kvstore-transfer-"), "{spawned:?}");
    }
}
