//! `kvstore bench remote`: time to first token of one long prompt whose prefix is served
//! three ways in the same run (recomputed, restored from the local SSD tier, fetched from a
//! Redis remote tier: single node and, optionally, a cluster), and the chain fetch rate
//! (blocks/s and MB/s through the store, verification included).
//!
//! Every request runs through an engine (the loop `serve` runs) opened over the arm's
//! tiers. Every repetition uses a fresh cache salt, so it publishes into a namespace nobody has
//! seen and reads it back from a fresh local store: nothing stale in Redis counts.

use std::time::Instant;

use anyhow::{Context, Result};
use engine::{GenerateParams, KvTiers, Request, ReuseConfig, Tokenizer};
use serde::Serialize;
use store::{chain_keys, RemoteConfig, Store, StoreConfig};

use crate::engine_run::{config as engine_config, ModelSlot};
use crate::generate::ModelArgs;

/// Arguments of `kvstore bench remote`.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// A single Redis node: redis://host:port.
    #[arg(long, value_name = "URL")]
    remote: String,
    /// A Redis Cluster as well: redis+cluster://h1:p1,h2:p2,….
    #[arg(long, value_name = "URL")]
    cluster: Option<String>,
    /// Prompt length in tokens.
    #[arg(long, default_value_t = 1024)]
    prompt_tokens: usize,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 32)]
    block_size: usize,
    /// Repetitions (the median is reported).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

/// One way of serving the prompt's prefix.
#[derive(Serialize, Clone, Debug)]
struct ArmResult {
    arm: String,
    /// Median TTFT over the repetitions.
    ttft_s: f64,
    /// Median time restoring (read or fetch, verify, copy into the live cache).
    restore_s: f64,
    /// Prompt tokens restored instead of computed (last repetition).
    cached_tokens: usize,
    /// Recompute's TTFT ÷ this arm's.
    speedup_vs_recompute: f64,
}

/// The chain fetch through the store (no model work).
#[derive(Serialize, Clone, Debug)]
struct FetchResult {
    target: String,
    blocks: usize,
    bytes: u64,
    /// Median seconds for the whole chain (one pipelined GET, then verification).
    seconds: f64,
    blocks_per_s: f64,
    mb_per_s: f64,
}

#[derive(Serialize)]
struct Report {
    model: String,
    prompt_tokens: usize,
    block_size: usize,
    block_bytes: u64,
    reps: usize,
    arms: Vec<ArmResult>,
    fetch: Vec<FetchResult>,
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// A deterministic prompt of exactly `n` tokens (varied text, so no degenerate repeats).
fn prompt(tokenizer: &Tokenizer, n: usize) -> Result<Vec<u32>> {
    let mut text = String::new();
    let mut i = 0u64;
    loop {
        let ids = tokenizer.encode(&text, false)?;
        if ids.len() >= n {
            return Ok(ids[..n].to_vec());
        }
        i += 1;
        text.push_str(&format!(
            "Step {i}: the engine reads block {} of namespace {:x}, checks its checksum, and restores it. ",
            i * 7 % 101,
            i.wrapping_mul(0x9e37_79b9) % 65_521
        ));
    }
}

struct Bench {
    /// The model, lent to one engine per request.
    slot: ModelSlot,
    prompt: Vec<u32>,
    block_size: usize,
    params: GenerateParams,
}

impl Bench {
    fn config(&self, dir: &std::path::Path, remote: Option<&str>, salt: &str) -> ReuseConfig {
        ReuseConfig {
            store: StoreConfig::default()
                .root(dir)
                .ram_budget(4 << 30)
                .ssd_budget(16 << 30)
                .remote(remote.map(|u| RemoteConfig::new(u).io_timeout_ms(30_000))),
            block_size: self.block_size,
            salt: Some(salt.to_string()),
            ..ReuseConfig::default()
        }
    }

    fn open(&self, dir: &std::path::Path, remote: Option<&str>, salt: &str) -> Result<KvTiers> {
        Ok(KvTiers::open(
            self.slot.model()?,
            self.slot.tokenizer()?,
            self.config(dir, remote, salt),
        )?)
    }

    /// TTFT and restore time of one request through an engine over `pc` (`None`: without
    /// a cache); the tiers come back for their counters.
    fn request(&mut self, pc: Option<KvTiers>) -> Result<((f64, f64, usize), Option<KvTiers>)> {
        let config = engine_config(Some(ReuseConfig::default().kv_budget_bytes));
        let request = Request::new(self.prompt.clone(), self.params.clone());
        let (done, pc) = self.slot.run(pc, config, request, &mut |_| true)?;
        let r = done.reuse;
        Ok(((r.ttft_s, r.restore_s, r.cached_tokens), pc))
    }

    /// Publishes the prompt's blocks into `remote` (and a local SSD tier) under `salt`;
    /// returns the publisher's store directory.
    fn publish(&mut self, remote: Option<&str>, salt: &str) -> Result<tempfile::TempDir> {
        let dir = tempfile::tempdir()?;
        let pc = self.open(dir.path(), remote, salt)?;
        let (_, pc) = self.request(Some(pc))?;
        let pc = pc.context("the engine kept the tiers")?;
        pc.flush()?;
        let st = pc.stats();
        if remote.is_some() && st.remote_blocks_written == 0 {
            anyhow::bail!(
                "nothing reached the remote tier ({} errors): is Redis running there?",
                st.remote_errors
            );
        }
        Ok(dir)
    }

    /// Fetches the published chain through a fresh store; seconds, blocks and bytes.
    fn fetch(&self, url: &str, salt: &str) -> Result<(f64, usize, u64)> {
        let probe = tempfile::tempdir()?;
        let desc = self.open(probe.path(), None, salt)?.description().clone();
        let dir = tempfile::tempdir()?;
        let s: Store = Store::open(
            StoreConfig::default()
                .root(dir.path())
                .ram_budget(4 << 30)
                .remote(Some(RemoteConfig::new(url).io_timeout_ms(30_000))),
        )?;
        let ns = s.register_namespace(&desc)?;
        let bs = self.block_size;
        let reusable = self.prompt.len() - 1;
        let keys = chain_keys(ns, &self.prompt[..reusable], bs);
        let tokens: Vec<&[u32]> = self.prompt.chunks(bs).take(keys.len()).collect();
        let t = Instant::now();
        let loaded = s.load_prefix(ns, &keys, &tokens);
        let secs = t.elapsed().as_secs_f64();
        if let Some(why) = loaded.stopped {
            anyhow::bail!("the chain fetch from {url} stopped: {why:?}");
        }
        Ok((secs, loaded.blocks.len(), s.stats().remote_bytes_read))
    }
}

/// Runs `kvstore bench remote`.
pub fn run(args: Args) -> Result<()> {
    if args.block_size == 0 || args.prompt_tokens <= args.block_size || args.reps == 0 {
        anyhow::bail!("need --block-size ≥ 1, --prompt-tokens > --block-size and --reps ≥ 1");
    }
    let (model, tokenizer) = args.model.load()?;
    let prompt = prompt(&tokenizer, args.prompt_tokens)?;
    let mut b = Bench {
        slot: ModelSlot::new(model, tokenizer),
        prompt,
        block_size: args.block_size,
        params: GenerateParams {
            max_tokens: 1,
            stop_at_eos: false,
            ..GenerateParams::default()
        },
    };
    let run_id = std::process::id();
    let mut targets = vec![("single node", args.remote.as_str())];
    if let Some(c) = &args.cluster {
        targets.push(("cluster", c.as_str()));
    }
    let names: Vec<String> = ["recompute", "local SSD"]
        .into_iter()
        .map(String::from)
        .chain(targets.iter().map(|(n, _)| format!("remote ({n})")))
        .collect();
    let mut ttft = vec![Vec::new(); names.len()];
    let mut restore = vec![Vec::new(); names.len()];
    let mut cached = vec![0; names.len()];
    let mut fetch: Vec<Vec<f64>> = vec![Vec::new(); targets.len()];
    let mut fetched = vec![(0, 0); targets.len()];
    // Warm-up: the first request pays for lazy kernels and weight paging.
    b.request(None)?;
    for rep in 0..args.reps {
        eprintln!("repetition {}/{}", rep + 1, args.reps);
        let mut record = |i: usize, (t, r, c): (f64, f64, usize)| {
            ttft[i].push(t);
            restore[i].push(r);
            cached[i] = c;
        };
        record(0, b.request(None)?.0);
        // Local SSD: a fresh handle on the publisher's store, so its RAM tier is empty.
        let salt = format!("bench-remote-{run_id}-{rep}-ssd");
        let dir = b.publish(None, &salt)?;
        let reader = b.open(dir.path(), None, &salt)?;
        record(1, b.request(Some(reader))?.0);
        for (i, (_, url)) in targets.iter().enumerate() {
            let salt = format!("bench-remote-{run_id}-{rep}-{i}");
            b.publish(Some(url), &salt)
                .with_context(|| format!("publishing to {url}"))?;
            let reader = tempfile::tempdir()?;
            let tiers = b.open(reader.path(), Some(url), &salt)?;
            record(2 + i, b.request(Some(tiers))?.0);
            let (secs, blocks, bytes) = b.fetch(url, &salt)?;
            fetch[i].push(secs);
            fetched[i] = (blocks, bytes);
        }
    }
    let base = median(&mut ttft[0].clone());
    let arms: Vec<ArmResult> = names
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let t = median(&mut ttft[i]);
            ArmResult {
                arm: name.clone(),
                ttft_s: t,
                restore_s: median(&mut restore[i]),
                cached_tokens: cached[i],
                speedup_vs_recompute: base / t.max(1e-9),
            }
        })
        .collect();
    let fetch: Vec<FetchResult> = targets
        .iter()
        .enumerate()
        .map(|(i, (name, _))| {
            let secs = median(&mut fetch[i]);
            let (blocks, bytes) = fetched[i];
            FetchResult {
                target: name.to_string(),
                blocks,
                bytes,
                seconds: secs,
                blocks_per_s: blocks as f64 / secs.max(1e-9),
                mb_per_s: bytes as f64 / 1e6 / secs.max(1e-9),
            }
        })
        .collect();
    let report = Report {
        model: args.model.path()?.display().to_string(),
        prompt_tokens: args.prompt_tokens,
        block_size: args.block_size,
        block_bytes: fetched
            .first()
            .map_or(0, |(n, bytes)| bytes / (*n).max(1) as u64),
        reps: args.reps,
        arms,
        fetch,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    println!(
        "{} prompt tokens, block size {}, {} bytes per block, median of {}",
        report.prompt_tokens, report.block_size, report.block_bytes, report.reps
    );
    println!(
        "{:<22} {:>10} {:>11} {:>7} {:>10}",
        "arm", "TTFT ms", "restore ms", "cached", "vs recomp"
    );
    for a in &report.arms {
        println!(
            "{:<22} {:>10.1} {:>11.1} {:>7} {:>9.2}x",
            a.arm,
            a.ttft_s * 1e3,
            a.restore_s * 1e3,
            a.cached_tokens,
            a.speedup_vs_recompute
        );
    }
    for f in &report.fetch {
        println!(
            "fetch from {:<12} {} blocks ({:.1} MB) in {:.1} ms: {:.0} blocks/s, {:.0} MB/s",
            f.target,
            f.blocks,
            f.bytes as f64 / 1e6,
            f.seconds * 1e3,
            f.blocks_per_s,
            f.mb_per_s
        );
    }
    Ok(())
}
