//! The prefix-cache flags shared by `generate`, `chat`, `demo`, `bench agent` and `serve`.

use std::path::PathBuf;

use anyhow::{Context, Result};
use cache::KvFormat;
use engine::{KvTiers, Model, ReuseConfig, Tokenizer};
use store::{EvictionPolicy, StoreConfig};

/// How KV is kept in the live cache and in stored blocks.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvChoice {
    /// As the model computes it (f32 on CPU).
    Float,
    /// Affine 8-bit, groups of 64 (or 32 when head_dim is 32).
    Kv8,
    /// Affine 4-bit, groups of 64 (or 32 when head_dim is 32).
    Kv4,
}

/// When to restore cached blocks rather than recompute them.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum RestoreChoice {
    /// When the measured restore cost beats the measured prefill cost.
    Auto,
    /// Every block found.
    Always,
}

/// Prefix-cache flags.
#[derive(clap::Args, Clone, Debug)]
pub struct CacheArgs {
    /// Store directory. Default: $KVSTORE_DIR, else the platform cache dir (~/.cache/kvstore).
    #[arg(long, value_name = "DIR")]
    pub store: Option<PathBuf>,
    /// RAM tier budget, e.g. 512MiB.
    #[arg(long, value_name = "SIZE", default_value = "1GiB")]
    pub ram_budget: String,
    /// SSD tier budget, e.g. 16GiB.
    #[arg(long, value_name = "SIZE", default_value = "16GiB")]
    pub ssd_budget: String,
    /// Blocks that left RAM and wait to be written to the SSD, at most, on top of the RAM
    /// budget; spills beyond it are dropped and counted (`skipped_queue_full`). It must hold
    /// the blocks of the prompts published at once.
    #[arg(long, value_name = "SIZE", default_value = "1GiB")]
    pub ssd_queue: String,
    /// Host memory that restores staged ahead of admission may hold at once: an I/O worker
    /// checks a queued request's loaded prefix and assembles it in the device layout, so
    /// the engine thread only moves the bytes; past this, the engine thread assembles at
    /// admission (0: never staged).
    #[arg(long, value_name = "SIZE", default_value = "4GiB")]
    pub staging_bytes: String,
    /// Which block the RAM and SSD tiers give up when full: `freq-admit` (a new block
    /// displaces only a block used less often, or one left unused for a whole turnover of
    /// the tier), `lru` (least recently used) or `lfu` (least frequently used).
    #[arg(long, value_name = "POLICY", default_value = "freq-admit")]
    pub eviction: EvictionPolicy,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 32)]
    pub block_size: usize,
    /// Device memory for all KV, in the KV format chosen: live requests and the finished
    /// sequences kept resident for reuse (the device tier) together, e.g. 8GiB.
    #[arg(long, value_name = "SIZE", default_value = "4GiB")]
    pub kv_budget: String,
    /// Bound on MLX's buffer cache (freed device buffers kept for reuse), or `auto`: the
    /// KV budget (at least 1 GiB) on the CPU, 1 GiB on a GPU. MLX's own default is the whole
    /// device memory; a long session then holds every buffer it ever freed.
    #[arg(long, value_name = "SIZE|auto", default_value = "auto")]
    pub mlx_cache_limit: String,
    /// KV format of the live cache and the stored blocks.
    #[arg(long, value_enum, default_value = "float")]
    pub kv: KvChoice,
    /// Mixed into the store namespace: requests with different salts never share blocks.
    #[arg(long, value_name = "SALT")]
    pub cache_salt: Option<String>,
    /// The remote tier shared with other engines.
    #[command(flatten)]
    pub remote: RemoteArgs,
    /// Which cached blocks to restore: `auto` restores a block from SSD or the remote tier
    /// only when the measured cost model says it beats recomputing it; `always` restores
    /// everything found (for checking the tiers).
    #[arg(long, value_enum, default_value = "auto")]
    pub restore: RestoreChoice,
    /// Hybrid models (LFM2, Qwen3-Next): store the non-attention layers' state with every
    /// N-th block, where a restore can resume (0: only where a sequence ended); `auto`: the
    /// fewest blocks whose K/V outweighs one snapshot.
    #[arg(long, value_name = "N|auto", default_value = "auto", value_parser = parse_state_every)]
    pub state_every: StateEvery,
    /// A device-tier hit of at least N tokens that another request may still extend reads
    /// the resident KV in place (shared by every request on it, no copy) instead of
    /// copying it; `never` always copies. Default: 256 on the CPU, never on a GPU.
    #[arg(long, value_name = "N|never", value_parser = parse_share_min_tokens)]
    pub share_min_tokens: Option<usize>,
    /// `inclusive`: every block is copied to the host tiers as it is published, so RAM
    /// holds copies of the device tier's blocks; `exclusive`: a finished sequence's blocks
    /// reach the host tiers when it leaves the device (evicted, or at shutdown), so the
    /// tiers hold more distinct blocks, but other requests find a running prompt's blocks
    /// only once its sequence has left the device (docs/prefix-reuse.md, "The device
    /// tier").
    #[arg(long, value_name = "inclusive|exclusive", default_value = "inclusive")]
    pub device_tier: engine::DeviceTier,
    /// Do not read or write the prefix cache (every request is prefilled in full).
    #[arg(long)]
    pub no_cache: bool,
}

/// Parses `--share-min-tokens`: a token count (at least 1) or `never`.
pub fn parse_share_min_tokens(s: &str) -> std::result::Result<usize, String> {
    if s == "never" {
        return Ok(usize::MAX);
    }
    match s.parse::<usize>() {
        Ok(0) => Err("0: a hit shares from at least 1 token (or `never`)".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("{s:?}: a number of tokens or never ({e})")),
    }
}

/// `--state-every`: a block count, or `auto` (`None`: [`engine::auto_state_every`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StateEvery(pub Option<usize>);

/// Parses `--state-every`: a number of blocks or `auto`.
pub fn parse_state_every(s: &str) -> std::result::Result<StateEvery, String> {
    if s == "auto" {
        return Ok(StateEvery(None));
    }
    s.parse::<usize>()
        .map(|n| StateEvery(Some(n)))
        .map_err(|e| format!("{s:?}: a number of blocks or auto ({e})"))
}

/// Remote-tier flags (shared with `kvstore inspect --remote`).
#[derive(clap::Args, Clone, Debug, Default)]
pub struct RemoteArgs {
    /// A remote tier shared with other engines: redis://[user:password@]host:port[/db],
    /// rediss://… (TLS), or a Redis Cluster: redis+cluster://h1:p1,h2:p2,… (rediss+cluster
    /// with TLS). Blocks are fetched from it (and verified) when neither local tier has
    /// them, and published to it in the background.
    #[arg(long, value_name = "URL")]
    pub remote: Option<String>,
    /// CA certificate (PEM) that signed the Redis servers' TLS certificates. Default: the
    /// system's roots.
    #[arg(long, value_name = "FILE", requires = "remote")]
    pub remote_ca: Option<PathBuf>,
    /// Expiry of published blocks, in seconds. Default: none (Redis's eviction decides).
    #[arg(long, value_name = "SECS", requires = "remote")]
    pub remote_ttl: Option<u64>,
    /// Timeout of every Redis command (read and write), in milliseconds.
    #[arg(long, value_name = "MS", default_value_t = 1000, requires = "remote")]
    pub remote_timeout: u64,
    /// Timeout of a connection attempt to Redis, in milliseconds.
    #[arg(long, value_name = "MS", default_value_t = 500, requires = "remote")]
    pub remote_connect_timeout: u64,
    /// Bytes of blocks the background publication queue holds, e.g. 1GiB; more are
    /// skipped (and counted). A number needs its unit: until session 26 this counted
    /// blocks.
    #[arg(long, value_name = "SIZE", default_value = "1GiB", requires = "remote")]
    pub remote_queue: String,
}

impl RemoteArgs {
    /// The remote-tier settings, or `None` without `--remote`.
    pub fn config(&self) -> Result<Option<store::RemoteConfig>> {
        let Some(url) = &self.remote else {
            return Ok(None);
        };
        let queue = self.remote_queue.trim();
        if queue.bytes().all(|b| b.is_ascii_digit()) {
            anyhow::bail!(
                "--remote-queue {queue:?}: give a size with its unit (e.g. 1GiB): the queue is bounded by the bytes of its blocks, no longer by a count of blocks"
            );
        }
        let queue_bytes = parse_size(queue).context("--remote-queue")?;
        for (flag, v) in [
            ("--remote-timeout", self.remote_timeout),
            ("--remote-connect-timeout", self.remote_connect_timeout),
            ("--remote-queue", queue_bytes),
            ("--remote-ttl", self.remote_ttl.unwrap_or(1)),
        ] {
            if v == 0 {
                anyhow::bail!("{flag} must be at least 1");
            }
        }
        Ok(Some(
            store::RemoteConfig::new(url)
                .ca_cert(self.remote_ca.clone())
                .ttl_secs(self.remote_ttl)
                .io_timeout_ms(self.remote_timeout)
                .connect_timeout_ms(self.remote_connect_timeout)
                .queue_bytes(queue_bytes),
        ))
    }
}

/// Parses a size such as `512MiB`, `2GB` or a plain byte count.
pub fn parse_size(s: &str) -> Result<u64> {
    s.trim()
        .parse::<bytesize::ByteSize>()
        .map(|b| b.as_u64())
        .map_err(|e| anyhow::anyhow!("{s:?} is not a size (try 512MiB or 2GiB): {e}"))
}

impl CacheArgs {
    /// The store directory these flags name.
    pub fn store_dir(&self) -> Result<PathBuf> {
        crate::inspect::store_dir(self.store.clone())
    }

    /// The reuse settings these flags describe, for a model with `head_dim`.
    pub fn reuse_config(&self, head_dim: usize) -> Result<ReuseConfig> {
        if self.block_size == 0 {
            anyhow::bail!("--block-size must be at least 1");
        }
        let group = if head_dim.is_multiple_of(64) { 64 } else { 32 };
        let kv_format = match self.kv {
            KvChoice::Float => KvFormat::Float,
            KvChoice::Kv8 => KvFormat::Quantized {
                bits: 8,
                group_size: group,
            },
            KvChoice::Kv4 => KvFormat::Quantized {
                bits: 4,
                group_size: group,
            },
        };
        Ok(ReuseConfig {
            kv_budget_bytes: self.kv_budget_bytes()?,
            store: StoreConfig::default()
                .root(self.store_dir()?)
                .ram_budget(parse_size(&self.ram_budget).context("--ram-budget")?)
                .ssd_budget(parse_size(&self.ssd_budget).context("--ssd-budget")?)
                .queue_bytes(parse_size(&self.ssd_queue).context("--ssd-queue")?)
                .eviction(self.eviction)
                .remote(self.remote.config()?),
            block_size: self.block_size,
            kv_format,
            salt: self.cache_salt.clone(),
            restore_always: self.restore == RestoreChoice::Always,
            state_every: self.state_every.0,
            share_min_tokens: self
                .share_min_tokens
                .unwrap_or_else(engine::default_share_min_tokens),
            device_tier: self.device_tier,
            staging_bytes: parse_size(&self.staging_bytes).context("--staging-bytes")?,
            ..ReuseConfig::default()
        })
    }

    /// `--kv-budget` in bytes.
    pub fn kv_budget_bytes(&self) -> Result<u64> {
        let bytes = parse_size(&self.kv_budget).context("--kv-budget")?;
        if bytes == 0 {
            anyhow::bail!("--kv-budget must be more than 0 bytes");
        }
        Ok(bytes)
    }

    /// Applies `--mlx-cache-limit` to MLX's buffer cache.
    pub fn apply_mlx_cache_limit(&self) -> Result<()> {
        apply_mlx_cache_limit(&self.mlx_cache_limit, self.kv_budget_bytes()?)
    }

    /// Opens the prefix cache for `model`, or `None` with `--no-cache`. Applies
    /// `--mlx-cache-limit` either way.
    pub fn open(&self, model: &Model, tokenizer: &Tokenizer) -> Result<Option<KvTiers>> {
        self.apply_mlx_cache_limit()?;
        if self.no_cache {
            return Ok(None);
        }
        let config = self.reuse_config(model.info().kv.head_dim)?;
        let dir = config.store.root.clone();
        KvTiers::open(model, tokenizer, config)
            .map(Some)
            .with_context(|| match dir {
                Some(d) => format!("opening the block store at {}", d.display()),
                None => "opening the block store".to_string(),
            })
    }
}

/// Sets MLX's buffer cache limit from `--mlx-cache-limit` (`spec`, see
/// [`mlx_cache_limit_bytes`]) on the default device.
pub fn apply_mlx_cache_limit(spec: &str, kv_budget: u64) -> Result<()> {
    let cpu = mlx::default_device().context("reading MLX's default device")? == mlx::Device::Cpu;
    let bytes = mlx_cache_limit_bytes(spec, kv_budget, cpu)?;
    mlx::set_cache_limit(bytes as usize).context("setting the MLX cache limit")?;
    Ok(())
}

/// The buffer cache limit `spec` asks for: a size, or `auto`. `auto` is 1 GiB on a GPU,
/// where MLX's own default (the whole device) let one 32K-token session hold 143 GB; on
/// the CPU it is the KV budget (at least 1 GiB): there the cache is host memory like the
/// KV itself, and a smaller one makes every restore and prefill allocate fresh pages, which
/// the kernel must fault in and zero (on cpu-vm 0.85 s per GiB; with a 1 GiB cache the SSD
/// arm of the 13-turn session took 1.28x the RAM arm, with 4 GiB 1.01x: docs/benchmarks.md,
/// "The MLX buffer cache on the CPU").
pub fn mlx_cache_limit_bytes(spec: &str, kv_budget: u64, cpu: bool) -> Result<u64> {
    const GIB: u64 = 1 << 30;
    if spec.trim().eq_ignore_ascii_case("auto") {
        return Ok(if cpu { kv_budget.max(GIB) } else { GIB });
    }
    parse_size(spec).context("--mlx-cache-limit")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mlx_cache_limit_is_a_size_or_auto_by_device() {
        const GIB: u64 = 1 << 30;
        assert_eq!(
            mlx_cache_limit_bytes("auto", 4 * GIB, true).unwrap(),
            4 * GIB
        );
        assert_eq!(mlx_cache_limit_bytes("AUTO", 256 << 20, true).unwrap(), GIB);
        assert_eq!(mlx_cache_limit_bytes("auto", 16 * GIB, false).unwrap(), GIB);
        assert_eq!(
            mlx_cache_limit_bytes("2GiB", 16 * GIB, true).unwrap(),
            2 * GIB
        );
        assert_eq!(mlx_cache_limit_bytes("0", GIB, false).unwrap(), 0);
        assert!(mlx_cache_limit_bytes("lots", GIB, true).is_err());
    }

    #[test]
    fn the_remote_queue_is_a_size_with_its_unit() {
        let args = |q: &str| RemoteArgs {
            remote: Some("redis://127.0.0.1:6379".into()),
            remote_queue: q.into(),
            remote_timeout: 1000,
            remote_connect_timeout: 500,
            ..RemoteArgs::default()
        };
        let c = args("64MiB").config().unwrap().unwrap();
        assert_eq!(c.queue_bytes, 64 << 20);
        let e = args("256").config().unwrap_err().to_string();
        assert!(e.contains("give a size with its unit"), "{e}");
        assert!(args("0B").config().is_err());
        assert!(args("lots").config().is_err());
        assert!(RemoteArgs::default().config().unwrap().is_none());
    }

    #[test]
    fn share_min_tokens_takes_a_count_or_never_and_refuses_zero() {
        assert_eq!(parse_share_min_tokens("300"), Ok(300));
        assert_eq!(parse_share_min_tokens("never"), Ok(usize::MAX));
        assert!(parse_share_min_tokens("0")
            .unwrap_err()
            .contains("at least 1"));
        assert!(parse_share_min_tokens("lots").is_err());
    }
}
