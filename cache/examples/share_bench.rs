//! Shared prefix vs copy-on-write fork: the cost of a decode step and of a 512-token
//! prefill chunk after a device-tier hit of `n` tokens (1K, 4K, 16K; SmolLM2's attention
//! shape, f32, one layer), each through `KvCache::update_and_attend`, plus the fork's
//! first write (the copy of the arena a share avoids). Figures in docs/benchmarks.md
//! ("Shared prefixes"). Run: `cargo run --release -p kvstore-cache --example share_bench`
//! (`-- --quick` for one small size).

use std::time::{Duration, Instant};

use cache::{Chain, KvCache, PagedConfig, PagedKvCache, ResidentPool};
use mlx::fast::AttentionMask;
use mlx::{Array, Dtype};
use store::NamespaceId;

const HQ: i32 = 9;
const HKV: i32 = 3;
const D: i32 = 64;
const CHUNK: i32 = 512;

fn random(shape: &[i32], seed: u64) -> Result<Array, Box<dyn std::error::Error>> {
    let a = mlx::random::normal(shape, Dtype::F32, &mlx::random::key(seed)?)?;
    a.eval()?;
    Ok(a)
}

fn median(mut v: Vec<Duration>) -> f64 {
    v.sort();
    v[v.len() / 2].as_secs_f64() * 1e3
}

/// A hit of `n` tokens on a resident sequence of `2n` (not a handover): shared when
/// `share`, else forked.
fn hit(n: usize, share: bool) -> Result<PagedKvCache, Box<dyn std::error::Error>> {
    let ns = NamespaceId([9; 32]);
    let config = PagedConfig {
        block_size: 32,
        initial_blocks: 8,
        max_blocks: 8192,
        ..PagedConfig::default()
    };
    let held = 2 * n;
    let tokens: Vec<u32> = (0..held as u32).collect();
    let mut cache = PagedKvCache::new(1, config)?;
    let (k, v) = (
        random(&[1, HKV, held as i32, D], 1)?,
        random(&[1, HKV, held as i32, D], 2)?,
    );
    cache.update_and_fetch(0, &k, &v)?;
    let mut pool = ResidentPool::new(u64::MAX);
    pool.set_share_min_tokens(if share { 1 } else { usize::MAX });
    pool.park(Chain::of(ns, 32, &[]), tokens.clone(), cache);
    let mut prompt = tokens[..n].to_vec();
    prompt.push(u32::MAX);
    let chain = Chain::of(ns, 32, &prompt[..n]);
    let h = pool
        .take(&chain, &prompt, n)?
        .ok_or("the resident prefix was not found")?;
    assert_eq!((h.tokens, h.shared), (n, share));
    Ok(h.cache)
}

/// Median ms of `reps` steps of `q_len` queries on `cache` (each trimmed off again), and
/// the first step (the fork's copy on write).
fn steps(
    cache: &mut PagedKvCache,
    q_len: i32,
    reps: usize,
) -> Result<(f64, f64), Box<dyn std::error::Error>> {
    let q = random(&[1, HQ, q_len, D], 3)?;
    let (k, v) = (
        random(&[1, HKV, q_len, D], 4)?,
        random(&[1, HKV, q_len, D], 5)?,
    );
    let mask = if q_len > 1 {
        AttentionMask::Causal
    } else {
        AttentionMask::None
    };
    let scale = 1.0 / (D as f32).sqrt();
    let mut times = Vec::new();
    for _ in 0..reps + 1 {
        let t = Instant::now();
        cache
            .update_and_attend(0, &q, &k, &v, scale, mask)?
            .eval()?;
        times.push(t.elapsed());
        cache.trim(q_len as usize)?;
    }
    let first = times.remove(0).as_secs_f64() * 1e3;
    Ok((first, median(times)))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let quick = std::env::args().any(|a| a == "--quick");
    let sizes: &[usize] = if quick { &[1024] } else { &[1024, 4096, 16384] };
    let reps = if quick { 3 } else { 15 };
    println!(
        "| tokens | step | fork first ms | fork ms | shared first ms | shared ms | shared / fork |"
    );
    println!("|---:|---|---:|---:|---:|---:|---:|");
    for &n in sizes {
        for (what, q_len) in [("decode", 1), ("prefill 512", CHUNK)] {
            let (mut fork, mut shared) = (hit(n, false)?, hit(n, true)?);
            let (ff, fm) = steps(&mut fork, q_len, reps)?;
            let (sf, sm) = steps(&mut shared, q_len, reps)?;
            println!(
                "| {n} | {what} | {ff:.2} | {fm:.2} | {sf:.2} | {sm:.2} | {:.2} |",
                sm / fm
            );
        }
    }
    Ok(())
}
