//! `kvstore bench store`: RAM and SSD tier throughput at 1, 8 and 32 MiB blocks and prefix
//! restore time, each beside `dd` with direct I/O on the same disk in the same run, plus
//! blake3 and memcpy GB/s.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use store::{
    Block, BlockMeta, Dtype, NamespaceDescription, Plane, PlaneSpec, PutJob, RamTier, ReadOutcome,
    SsdOptions, SsdTier, Store, StoreConfig,
};

/// Arguments of `kvstore bench store`.
#[derive(clap::Args)]
pub struct Args {
    /// Directory on the disk to measure (made if missing; a scratch subdirectory is created
    /// and removed). Default: the system temp directory.
    #[arg(long, value_name = "DIR")]
    dir: Option<PathBuf>,
    /// Bytes written per block size.
    #[arg(long, default_value = "256MiB")]
    total: String,
    /// Blocks in the restored prefix (8 MiB blocks).
    #[arg(long, default_value_t = 16)]
    restore_blocks: usize,
}

const MIB: u64 = 1 << 20;

fn gbps(bytes: u64, secs: f64) -> f64 {
    bytes as f64 / secs / 1e9
}

fn data(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    let mut v = vec![0u8; len];
    for chunk in v.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let b = x.to_le_bytes();
        chunk.copy_from_slice(&b[..chunk.len()]);
    }
    v
}

fn namespace(block_bytes: u64) -> NamespaceDescription {
    let mut d = NamespaceDescription::new(format!("bench-{block_bytes}"), Dtype::U8, 16);
    d.planes = vec![
        PlaneSpec::new("k", Dtype::U8, vec![block_bytes / 2]),
        PlaneSpec::new("v", Dtype::U8, vec![block_bytes / 2]),
    ];
    d
}

fn blocks(d: &NamespaceDescription, n: usize, payload: &[u8]) -> Vec<Block> {
    let ns = d.id();
    let half = payload.len() / 2;
    let mut parent = ns.0;
    (0..n)
        .map(|i| {
            let tokens: Vec<u32> = (0..16).map(|t| (i * 16 + t) as u32).collect();
            let meta = BlockMeta::new(ns, parent, i as u32, tokens);
            parent = meta.key.0;
            // Each block owns a copy, as a published block would.
            let planes = vec![
                Plane::new("k", Dtype::U8, vec![half as u64], payload[..half].to_vec()),
                Plane::new("v", Dtype::U8, vec![half as u64], payload[half..].to_vec()),
            ];
            Block { meta, planes }
        })
        .collect()
}

/// Drops the page cache so reads come from the disk; false if not permitted.
pub(crate) fn drop_caches() -> bool {
    Command::new("sync").status().is_ok_and(|s| s.success())
        && std::fs::write("/proc/sys/vm/drop_caches", "3").is_ok()
}

/// Runs dd and returns GB/s computed from the bytes and the wall time.
fn dd(args: &[String], bytes: u64) -> Result<f64> {
    let t = Instant::now();
    let out = Command::new("dd")
        .args(args)
        .output()
        .context("running dd")?;
    let secs = t.elapsed().as_secs_f64();
    if !out.status.success() {
        anyhow::bail!(
            "dd {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(gbps(bytes, secs))
}

pub(crate) fn dd_write(path: &Path, bs: u64, count: u64) -> Result<f64> {
    dd(
        &[
            "if=/dev/zero".into(),
            format!("of={}", path.display()),
            format!("bs={bs}"),
            format!("count={count}"),
            "oflag=direct".into(),
            "conv=fsync".into(),
        ],
        bs * count,
    )
}

pub(crate) fn dd_read(path: &Path, bs: u64, count: u64) -> Result<f64> {
    dd(
        &[
            format!("if={}", path.display()),
            "of=/dev/null".into(),
            format!("bs={bs}"),
            format!("count={count}"),
            "iflag=direct".into(),
        ],
        bs * count,
    )
}

fn row(what: &str, ours: f64, base_name: &str, base: f64) {
    println!(
        "  {what:<34} {ours:>7.2} GB/s   {base_name:<20} {base:>7.2} GB/s   ratio {:>5.2}",
        ours / base
    );
}

/// A writable SSD tier at `root` without a budget to speak of.
/// A fresh SSD tier at `root` holding at most `budget` bytes of blocks.
fn scratch_ssd(root: &Path, budget: u64) -> Result<SsdTier> {
    Ok(SsdTier::open(
        root,
        SsdOptions {
            read_only: false,
            budget,
        },
    )?)
}

/// A budget no benchmark here fills: nothing is evicted.
const UNBOUNDED: u64 = u64::MAX / 2;

/// Writes `bl` into `ssd` in group commits of 64 (the write-behind worker's batches).
fn put_in_groups(ssd: &SsdTier, bl: &[Block]) -> Result<()> {
    for group in bl.chunks(64) {
        let jobs: Vec<PutJob<'_>> = group
            .iter()
            .map(|block| PutJob {
                block,
                replace: false,
                used: None,
            })
            .collect();
        for r in ssd.put_many(&jobs) {
            r?;
        }
    }
    Ok(())
}

/// GB/s of the SSD tier's group commits (the write-behind worker's batches of 64) into a
/// fresh tier under `dir`.
fn ssd_put_groups(dir: &Path, bs_mib: u64, bl: &[Block], bytes: u64) -> Result<f64> {
    let root = dir.join(format!("store-{bs_mib}-groups"));
    let ssd = scratch_ssd(&root, UNBOUNDED)?;
    let t = Instant::now();
    put_in_groups(&ssd, bl)?;
    let secs = t.elapsed().as_secs_f64();
    drop(ssd);
    let _ = std::fs::remove_dir_all(&root);
    Ok(gbps(bytes, secs))
}

/// GB/s at which blocks leaving a full RAM tier reach the SSD through the store's
/// write-behind worker (every insert spills one block; timed until the flush returns, over
/// the blocks written), and how many spills the queue dropped. The queue may hold every
/// block: this measures the writer, not the bound (`--ssd-queue`). With `republish`, after
/// every `republish`-th insert the block inserted `republish` inserts before is published
/// again (as a prompt that recomputed a block the SSD holds does), which queues a recency
/// refresh among the spills.
fn write_behind_spills(
    dir: &Path,
    d: &NamespaceDescription,
    bl: &[Block],
    bs: u64,
    republish: Option<usize>,
) -> Result<(f64, u64)> {
    let root = dir.join(format!(
        "store-{}-spills-{}",
        bs / MIB,
        republish.unwrap_or(0)
    ));
    let s: Store = Store::open(
        StoreConfig::default()
            .root(&root)
            .ram_budget(bs)
            .ssd_budget(u64::MAX / 2)
            .queue_bytes(u64::MAX),
    )?;
    s.register_namespace(d)?;
    let t = Instant::now();
    for (i, b) in bl.iter().enumerate() {
        s.insert(Arc::new(b.clone()))?;
        if let Some(k) = republish.filter(|&k| k > 0 && i >= k && i % k == 0) {
            s.insert(Arc::new(bl[i - k].clone()))?;
        }
    }
    s.flush()?;
    let secs = t.elapsed().as_secs_f64();
    let st = s.stats();
    drop(s);
    let _ = std::fs::remove_dir_all(&root);
    Ok((gbps(st.blocks_written * bs, secs), st.skipped_queue_full))
}

/// Microseconds an index lookup (`SsdTier::contains`, what every request's lookup asks
/// for a block past RAM) takes while another thread writes `bl` in group commits of 64 into
/// a tier of `budget` bytes: with a small budget each group evicts as many blocks as it
/// writes. Returns the lookups' P50, P99 and max.
fn lookups_during_writes(dir: &Path, bl: &[Block], budget: u64) -> Result<(f64, f64, f64)> {
    let root = dir.join(format!("store-lookups-{budget}"));
    let ssd = scratch_ssd(&root, budget)?;
    let probe = (bl[0].meta.namespace, bl[0].meta.key);
    let done = std::sync::atomic::AtomicBool::new(false);
    let mut micros = Vec::new();
    let written = std::thread::scope(|scope| {
        let writer = scope.spawn(|| {
            let r = put_in_groups(&ssd, bl);
            done.store(true, std::sync::atomic::Ordering::Release);
            r
        });
        while !done.load(std::sync::atomic::Ordering::Acquire) {
            let t = Instant::now();
            std::hint::black_box(ssd.contains(probe.0, probe.1));
            micros.push(t.elapsed().as_secs_f64() * 1e6);
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
        writer
            .join()
            .map_err(|_| anyhow::anyhow!("the writer panicked"))?
    });
    written?;
    drop(ssd);
    let _ = std::fs::remove_dir_all(&root);
    anyhow::ensure!(!micros.is_empty(), "no lookup ran while the writer wrote");
    micros.sort_by(f64::total_cmp);
    let at = |q: f64| micros[((micros.len() - 1) as f64 * q) as usize];
    Ok((at(0.5), at(0.99), micros[micros.len() - 1]))
}

/// Runs the benchmark.
pub fn run(args: Args) -> Result<()> {
    if cfg!(debug_assertions) {
        eprintln!("warning: debug build; run `cargo run --release -p kvstore -- bench store`");
    }
    let total = args
        .total
        .parse::<bytesize::ByteSize>()
        .map_err(|e| anyhow::anyhow!("--total {:?}: {e}", args.total))?
        .as_u64();
    let base = args.dir.unwrap_or_else(std::env::temp_dir);
    let scratch = super::scratch_dir(&base, "kvstore-bench-")?;
    let dir = scratch.path();
    let cold = drop_caches();
    println!(
        "kvstore bench store: {} per block size, scratch {} ({} page cache before reads)",
        bytesize::ByteSize::b(total).display().iec(),
        dir.display(),
        if cold {
            "dropping"
        } else {
            "CANNOT drop (not root): warm"
        }
    );

    // Baselines that do not depend on block size.
    let buf = data(64 * MIB as usize, 1);
    let mut dst = vec![0u8; buf.len()];
    dst.copy_from_slice(&buf); // fault the pages in before timing
    let t = Instant::now();
    for _ in 0..4 {
        dst.copy_from_slice(&buf);
        std::hint::black_box(&dst);
    }
    let memcpy = gbps(4 * buf.len() as u64, t.elapsed().as_secs_f64());
    let t = Instant::now();
    for _ in 0..4 {
        std::hint::black_box(blake3::hash(&buf));
    }
    let b3 = gbps(4 * buf.len() as u64, t.elapsed().as_secs_f64());
    println!("  memcpy {memcpy:.2} GB/s, blake3 (1 thread) {b3:.2} GB/s");

    for bs_mib in [1u64, 8, 32] {
        let bs = bs_mib * MIB;
        let n = (total / bs).max(4) as usize;
        let bytes = n as u64 * bs;
        println!("block {bs_mib} MiB x {n}:");
        let d = namespace(bs);
        let payload = data(bs as usize, bs_mib);

        // RAM tier: publish (copy into an owned block) + insert; restore (lookup + copy out).
        let t = Instant::now();
        let bl = blocks(&d, n, &payload);
        let mut ram: RamTier = RamTier::new(bytes);
        for b in &bl {
            ram.insert(Arc::new(b.clone()));
        }
        let ram_w = gbps(bytes, t.elapsed().as_secs_f64());
        let mut out = vec![0u8; bs as usize];
        let t = Instant::now();
        for b in &bl {
            let p = ram.get(b.meta.namespace, b.meta.key).context("RAM miss")?;
            let mut off = 0;
            for plane in &p.planes {
                out[off..off + plane.data.len()].copy_from_slice(&plane.data);
                off += plane.data.len();
            }
            std::hint::black_box(&out);
        }
        let ram_r = gbps(bytes, t.elapsed().as_secs_f64());
        // The same copies straight from the planes, without the tier: the memcpy baseline
        // for this access pattern (one destination block reused, so it stays in cache).
        let t = Instant::now();
        for b in &bl {
            let mut off = 0;
            for plane in &b.planes {
                out[off..off + plane.data.len()].copy_from_slice(&plane.data);
                off += plane.data.len();
            }
            std::hint::black_box(&out);
        }
        let copy_r = gbps(bytes, t.elapsed().as_secs_f64());
        drop(ram);
        row(
            "RAM write (copy + insert)",
            ram_w,
            "memcpy (64 MiB)",
            memcpy,
        );
        row(
            "RAM read (hit + copy out)",
            ram_r,
            "same copies, no tier",
            copy_r,
        );

        // SSD tier: put = checksum + write + fsync + rename + fsync dir.
        let root = dir.join(format!("store-{bs_mib}"));
        let ssd = scratch_ssd(&root, UNBOUNDED)?;
        let t = Instant::now();
        for b in &bl {
            ssd.put(b)?;
        }
        let ssd_w = gbps(bytes, t.elapsed().as_secs_f64());
        let ddfile = dir.join("dd.bin");
        let dd_w = dd_write(&ddfile, bs, n as u64)?;
        row(
            "SSD write (put, fsync each)",
            ssd_w,
            "dd oflag=direct",
            dd_w,
        );
        let group_w = ssd_put_groups(dir, bs_mib, &bl, bytes)?;
        row(
            "SSD write (put_many, groups of 64)",
            group_w,
            "dd oflag=direct",
            dd_w,
        );
        for (what, republish) in [
            ("SSD write-behind (RAM spills)", None),
            ("  + a re-publication per 4 spills", Some(4)),
        ] {
            let (w, dropped) = write_behind_spills(dir, &d, &bl, bs, republish)?;
            row(what, w, "dd oflag=direct", dd_w);
            if dropped > 0 {
                println!("    ({dropped} of {n} spills dropped: write-behind queue full)");
            }
        }

        // Index lookups while the writer's group commits evict as much as they write,
        // against the same lookups while it writes without evicting.
        let quiet = lookups_during_writes(dir, &bl, UNBOUNDED)?;
        // A quarter of the blocks, each with room to spare for its file's header.
        let evicting = lookups_during_writes(dir, &bl, (n as u64 / 4).max(1) * (bs + MIB))?;
        println!(
            "  SSD index lookup during group commits, P50 / P99 / max µs: evicting {:.1} / {:.1} / {:.1}, \
             not evicting {:.1} / {:.1} / {:.1}",
            evicting.0, evicting.1, evicting.2, quiet.0, quiet.1, quiet.2
        );

        drop_caches();
        let t = Instant::now();
        for b in &bl {
            match ssd.get(b.meta.namespace, b.meta.key) {
                ReadOutcome::Hit(blk) => {
                    std::hint::black_box(&blk);
                }
                other => anyhow::bail!("SSD read failed: {other:?}"),
            }
        }
        let ssd_r = gbps(bytes, t.elapsed().as_secs_f64());
        drop_caches();
        let dd_r = dd_read(&ddfile, bs, n as u64)?;
        row("SSD read (pread + verify)", ssd_r, "dd iflag=direct", dd_r);
        drop(ssd);
        let _ = std::fs::remove_dir_all(&root);
        let _ = std::fs::remove_file(&ddfile);
    }

    // Restore a prefix of N 8 MiB blocks through the Store facade, from SSD then RAM.
    let n = args.restore_blocks.max(1);
    let bs = 8 * MIB;
    let bytes = n as u64 * bs;
    let d = namespace(bs);
    let payload = data(bs as usize, 99);
    let bl = blocks(&d, n, &payload);
    let root = dir.join("store-restore");
    {
        let s: Store = Store::open(
            StoreConfig::default()
                .root(&root)
                .ram_budget(2 * bytes)
                .ssd_budget(4 * bytes),
        )?;
        s.register_namespace(&d)?;
        for b in &bl {
            s.insert(Arc::new(b.clone()))?;
        }
        s.flush()?;
    }
    let s: Store = Store::open(
        StoreConfig::default()
            .root(&root)
            .ram_budget(2 * bytes)
            .ssd_budget(4 * bytes),
    )?;
    let keys: Vec<_> = bl.iter().map(|b| b.meta.key).collect();
    let toks: Vec<_> = bl.iter().map(|b| b.meta.tokens.clone()).collect();
    drop_caches();
    let t = Instant::now();
    let loaded = s.load_prefix(d.id(), &keys, &toks);
    let ssd_secs = t.elapsed().as_secs_f64();
    anyhow::ensure!(
        loaded.blocks.len() == n,
        "restore stopped: {:?}",
        loaded.stopped
    );
    let t = Instant::now();
    let loaded = s.load_prefix(d.id(), &keys, &toks);
    let ram_secs = t.elapsed().as_secs_f64();
    anyhow::ensure!(
        loaded.blocks.len() == n,
        "restore stopped: {:?}",
        loaded.stopped
    );
    drop(loaded);
    drop(s);
    let ddfile = dir.join("dd.bin");
    dd_write(&ddfile, bs, n as u64)?;
    drop_caches();
    let dd_r = dd_read(&ddfile, bs, n as u64)?;
    println!(
        "restore prefix of {n} x 8 MiB blocks ({} MiB):",
        bytes / MIB
    );
    println!(
        "  from SSD {:>8.1} ms ({:.2} GB/s)   dd iflag=direct {:.1} ms ({dd_r:.2} GB/s)   ratio {:.2}",
        ssd_secs * 1e3,
        gbps(bytes, ssd_secs),
        bytes as f64 / dd_r / 1e6,
        gbps(bytes, ssd_secs) / dd_r
    );
    println!(
        "  from RAM {:>8.3} ms (lookup + validate, no copy)",
        ram_secs * 1e3
    );
    Ok(())
}
