//! The remote tier: published blocks shared between engines through Redis.
//!
//! A block is stored under `kvstore:<namespace hex>:<key hex>` as exactly the bytes of its
//! SSD block file (same codec, same checksum), so a fetched value is verified like a file:
//! header, layout, checksum, then namespace, key, tokens and plane layout by the
//! [`Store`](crate::Store). Eviction is Redis's own (`maxmemory-policy allkeys-lru`).
//!
//! Redis is never on the path of a correct answer: every failure (refused connection,
//! timeout, a killed server, a corrupt or foreign value) turns into a miss. After a
//! connection failure the tier is skipped for a backoff that doubles up to
//! [`MAX_BACKOFF`]; the outage is logged once, and its end once.
//!
//! This module talks to Redis through the `redis` crate's synchronous connections: lookups
//! and fetches on the caller's thread (one pipelined round trip each, bounded by the I/O
//! timeout), publication on the store's own publisher thread.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::key::{BlockKey, NamespaceId};
use crate::stats::Counters;

/// Longest wait between two attempts to reach an unreachable Redis.
pub const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// First wait after a failure.
const FIRST_BACKOFF: Duration = Duration::from_millis(250);
/// Prefix of every key the remote tier writes.
pub const KEY_PREFIX: &str = "kvstore";

/// Configuration of the remote tier.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct RemoteConfig {
    /// `redis://[user:password@]host:port[/db]` (AUTH through the URL).
    pub url: String,
    /// Expiry of published blocks in seconds; `None` keeps them until Redis evicts them.
    pub ttl_secs: Option<u64>,
    /// Connection timeout in milliseconds.
    pub connect_timeout_ms: u64,
    /// Read and write timeout of every command, in milliseconds.
    pub io_timeout_ms: u64,
    /// Blocks the publication queue holds before further publications are skipped (and
    /// counted).
    pub queue_capacity: usize,
}

impl Default for RemoteConfig {
    fn default() -> Self {
        RemoteConfig {
            url: String::new(),
            ttl_secs: None,
            connect_timeout_ms: 500,
            io_timeout_ms: 1000,
            queue_capacity: 256,
        }
    }
}

impl RemoteConfig {
    /// The remote tier at `url`, other settings at their defaults.
    pub fn new(url: impl Into<String>) -> Self {
        RemoteConfig {
            url: url.into(),
            ..RemoteConfig::default()
        }
    }

    /// Expiry of published blocks. Default: none.
    pub fn ttl_secs(mut self, secs: Option<u64>) -> Self {
        self.ttl_secs = secs;
        self
    }

    /// Connection timeout. Default: 500 ms.
    pub fn connect_timeout_ms(mut self, ms: u64) -> Self {
        self.connect_timeout_ms = ms;
        self
    }

    /// Per-command read and write timeout. Default: 1000 ms.
    pub fn io_timeout_ms(mut self, ms: u64) -> Self {
        self.io_timeout_ms = ms;
        self
    }

    /// Capacity of the publication queue, in blocks (at least 1). Default: 256.
    pub fn queue_capacity(mut self, blocks: usize) -> Self {
        self.queue_capacity = blocks;
        self
    }
}

/// The Redis key of a block.
pub fn redis_key(ns: NamespaceId, key: BlockKey) -> String {
    format!("{KEY_PREFIX}:{ns}:{key}")
}

#[derive(Debug, Default)]
struct Health {
    /// Skip Redis until then.
    down_until: Option<Instant>,
    backoff: Duration,
    /// Whether the current outage has been logged.
    logged: bool,
}

/// A connection to Redis shared by the store's threads (one connection per role, so a
/// slow publication never holds up a lookup).
pub(crate) struct RemoteTier {
    client: redis::Client,
    config: RemoteConfig,
    health: Mutex<Health>,
    reader: Mutex<Option<redis::Connection>>,
    writer: Mutex<Option<redis::Connection>>,
    counters: Arc<Counters>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Which connection an operation uses.
#[derive(Clone, Copy)]
enum Role {
    Read,
    Write,
}

impl RemoteTier {
    /// Parses the URL; connects lazily, so a Redis that is down at start is no error.
    pub(crate) fn new(
        config: RemoteConfig,
        counters: Arc<Counters>,
    ) -> Result<Self, redis::RedisError> {
        let client = redis::Client::open(config.url.as_str())?;
        Ok(RemoteTier {
            client,
            config,
            health: Mutex::new(Health::default()),
            reader: Mutex::new(None),
            writer: Mutex::new(None),
            counters,
        })
    }

    pub(crate) fn config(&self) -> &RemoteConfig {
        &self.config
    }

    fn connect(&self) -> redis::RedisResult<redis::Connection> {
        let c = self
            .client
            .get_connection_with_timeout(Duration::from_millis(self.config.connect_timeout_ms))?;
        let io = Some(Duration::from_millis(self.config.io_timeout_ms.max(1)));
        c.set_read_timeout(io)?;
        c.set_write_timeout(io)?;
        Ok(c)
    }

    /// Runs `f` on the role's connection unless Redis is in backoff; `None` on any failure
    /// (counted, and logged once per outage).
    fn with_conn<T>(
        &self,
        role: Role,
        f: impl FnOnce(&mut redis::Connection) -> redis::RedisResult<T>,
    ) -> Option<T> {
        if lock(&self.health)
            .down_until
            .is_some_and(|t| Instant::now() < t)
        {
            return None;
        }
        let slot = match role {
            Role::Read => &self.reader,
            Role::Write => &self.writer,
        };
        let mut conn = lock(slot);
        if conn.is_none() {
            match self.connect() {
                Ok(c) => *conn = Some(c),
                Err(e) => {
                    drop(conn);
                    self.failed(&e);
                    return None;
                }
            }
        }
        let c = conn.as_mut()?;
        match f(c) {
            Ok(v) => {
                drop(conn);
                self.succeeded();
                Some(v)
            }
            Err(e) => {
                // The connection may hold a half-read reply: never reuse it.
                *conn = None;
                drop(conn);
                self.failed(&e);
                None
            }
        }
    }

    fn failed(&self, e: &redis::RedisError) {
        Counters::inc(&self.counters.remote_errors);
        let mut h = lock(&self.health);
        h.backoff = if h.backoff.is_zero() {
            FIRST_BACKOFF
        } else {
            (h.backoff * 2).min(MAX_BACKOFF)
        };
        h.down_until = Some(Instant::now() + h.backoff);
        if !h.logged {
            h.logged = true;
            tracing::warn!(
                error = %e,
                "remote tier unavailable; serving from the local tiers and retrying with backoff"
            );
        }
    }

    fn succeeded(&self) {
        let mut h = lock(&self.health);
        if h.logged {
            tracing::info!("remote tier reachable again");
        }
        *h = Health::default();
    }

    /// Which of `keys` Redis holds, in one pipelined round trip; `None` when unreachable.
    pub(crate) fn exists(&self, ns: NamespaceId, keys: &[BlockKey]) -> Option<Vec<bool>> {
        if keys.is_empty() {
            return Some(Vec::new());
        }
        self.with_conn(Role::Read, |c| {
            let mut p = redis::pipe();
            for &k in keys {
                p.cmd("EXISTS").arg(redis_key(ns, k));
            }
            p.query::<Vec<bool>>(c)
        })
    }

    /// The values of `keys`, in one pipelined round trip; `None` when unreachable.
    pub(crate) fn get(&self, ns: NamespaceId, keys: &[BlockKey]) -> Option<Vec<Option<Vec<u8>>>> {
        if keys.is_empty() {
            return Some(Vec::new());
        }
        self.with_conn(Role::Read, |c| {
            let mut p = redis::pipe();
            for &k in keys {
                p.cmd("GET").arg(redis_key(ns, k));
            }
            p.query::<Vec<Option<Vec<u8>>>>(c)
        })
    }

    /// Stores a block's file bytes (with the configured TTL); whether it was stored.
    pub(crate) fn put(&self, ns: NamespaceId, key: BlockKey, bytes: &[u8]) -> bool {
        self.with_conn(Role::Write, |c| {
            let mut cmd = redis::cmd("SET");
            cmd.arg(redis_key(ns, key)).arg(bytes);
            if let Some(ttl) = self.config.ttl_secs {
                cmd.arg("EX").arg(ttl.max(1));
            }
            cmd.query::<()>(c)
        })
        .is_some()
    }
}

/// What the remote tier holds for one namespace.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteNamespaceUsage {
    /// The namespace id (hex), as it appears in the keys.
    pub namespace: String,
    /// Blocks stored.
    pub blocks: u64,
    /// Bytes of their values.
    pub bytes: u64,
}

/// Scans every `kvstore:*` key of the Redis at `url` (SCAN, then a pipelined STRLEN
/// per batch) and sums blocks and bytes per namespace, largest first.
pub fn inspect_remote(url: &str) -> redis::RedisResult<Vec<RemoteNamespaceUsage>> {
    let client = redis::Client::open(url)?;
    let mut c = client.get_connection_with_timeout(Duration::from_secs(5))?;
    let mut by_ns: std::collections::BTreeMap<String, (u64, u64)> = Default::default();
    let mut cursor: u64 = 0;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("{KEY_PREFIX}:*"))
            .arg("COUNT")
            .arg(1000)
            .query(&mut c)?;
        if !keys.is_empty() {
            let mut p = redis::pipe();
            for k in &keys {
                p.cmd("STRLEN").arg(k);
            }
            let lens: Vec<u64> = p.query(&mut c)?;
            for (k, len) in keys.iter().zip(lens) {
                let ns = k.split(':').nth(1).unwrap_or_default().to_string();
                let e = by_ns.entry(ns).or_default();
                e.0 += 1;
                e.1 += len;
            }
        }
        cursor = next;
        if cursor == 0 {
            break;
        }
    }
    let mut out: Vec<RemoteNamespaceUsage> = by_ns
        .into_iter()
        .map(|(namespace, (blocks, bytes))| RemoteNamespaceUsage {
            namespace,
            blocks,
            bytes,
        })
        .collect();
    out.sort_by_key(|n| std::cmp::Reverse(n.bytes));
    Ok(out)
}
