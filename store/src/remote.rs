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
//! Two deployments, one key layout: a single node (`redis://`, `rediss://` for TLS) or a
//! Redis Cluster (`redis+cluster://h1:p1,h2:p2`, `rediss+cluster://…`). The keys carry no
//! hash tag, so the blocks of one chain spread over every master (memory and load stay
//! balanced); a chain's `EXISTS`/`GET` pipeline is split per master by the `redis` crate's
//! cluster pipeline, which writes every node's part before reading any reply: still one
//! round trip, to all masters in parallel.
//!
//! This module talks to Redis through the `redis` crate's synchronous connections: lookups
//! and fetches on the caller's thread (one pipelined round trip each, bounded by the I/O
//! timeout), publication on the store's own publisher thread.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use redis::cluster::{ClusterClient, ClusterConnection};
use redis::{Cmd, ErrorKind, RedisError, RedisResult};
use serde::{Deserialize, Serialize};

use crate::key::{BlockKey, NamespaceId};
use crate::stats::Counters;

/// Longest wait between two attempts to reach an unreachable Redis.
pub const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// First wait after a failure.
const FIRST_BACKOFF: Duration = Duration::from_millis(250);
/// Prefix of every key the remote tier writes.
pub const KEY_PREFIX: &str = "kvstore";
/// Scheme of a Redis Cluster URL (`rediss+cluster` with TLS).
const CLUSTER_SCHEME: &str = "redis+cluster";
/// Scheme of a Redis Cluster URL with TLS.
const CLUSTER_TLS_SCHEME: &str = "rediss+cluster";

/// Configuration of the remote tier.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct RemoteConfig {
    /// `redis://[user:password@]host:port[/db]`, `rediss://…` (TLS), or a Redis Cluster:
    /// `redis+cluster://[user:password@]h1:p1,h2:p2,…` (`rediss+cluster://…` with TLS).
    /// AUTH goes in the URL.
    pub url: String,
    /// PEM file of the CA that signed the servers' TLS certificates; `None` trusts the
    /// system's roots. Only for `rediss` URLs.
    pub ca_cert: Option<PathBuf>,
    /// Expiry of published blocks in seconds; `None` keeps them until Redis evicts them.
    pub ttl_secs: Option<u64>,
    /// Connection timeout in milliseconds.
    pub connect_timeout_ms: u64,
    /// Read and write timeout of every command, in milliseconds.
    pub io_timeout_ms: u64,
    /// Bytes of blocks the publication queue holds (from queueing until published) before
    /// further publications are skipped and counted (`remote_queue_full`); a lone block
    /// always fits.
    pub queue_bytes: u64,
}

/// Jobs the publication queue holds at most, whatever their bytes (as the write-behind
/// queue's `StoreConfig::queue_capacity`): the bound that matters is
/// [`RemoteConfig::queue_bytes`].
pub(crate) const REMOTE_QUEUE_JOBS: usize = 4096;

impl Default for RemoteConfig {
    fn default() -> Self {
        RemoteConfig {
            url: String::new(),
            ca_cert: None,
            ttl_secs: None,
            connect_timeout_ms: 500,
            io_timeout_ms: 1000,
            queue_bytes: crate::store::DEFAULT_QUEUE_BYTES,
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

    /// CA certificate (PEM) for `rediss` URLs. Default: none (the system's roots).
    pub fn ca_cert(mut self, path: Option<PathBuf>) -> Self {
        self.ca_cert = path;
        self
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

    /// Bound of the publication queue, in bytes of its blocks. Default:
    /// [`crate::store::DEFAULT_QUEUE_BYTES`] (1 GiB; until session 26 the bound was 256 blocks).
    pub fn queue_bytes(mut self, bytes: u64) -> Self {
        self.queue_bytes = bytes;
        self
    }

    fn connect_timeout(&self) -> Duration {
        Duration::from_millis(self.connect_timeout_ms.max(1))
    }

    fn io_timeout(&self) -> Duration {
        Duration::from_millis(self.io_timeout_ms.max(1))
    }
}

/// The Redis key of a block.
pub fn redis_key(ns: NamespaceId, key: BlockKey) -> String {
    format!("{KEY_PREFIX}:{ns}:{key}")
}

fn invalid(message: &'static str, detail: String) -> RedisError {
    RedisError::from((ErrorKind::InvalidClientConfig, message, detail))
}

/// A cluster URL split into the scheme of its nodes, the `user:password@` part and the seed
/// nodes (`host:port`); `None` for a single-node URL.
fn cluster_parts(url: &str) -> RedisResult<Option<(&'static str, &str, Vec<&str>)>> {
    let Some((scheme, rest)) = url.split_once("://") else {
        return Ok(None);
    };
    let node_scheme = match scheme {
        CLUSTER_SCHEME => "redis",
        CLUSTER_TLS_SCHEME => "rediss",
        _ => return Ok(None),
    };
    let (auth, hosts) = match rest.rfind('@') {
        Some(at) => (&rest[..=at], &rest[at + 1..]),
        None => ("", rest),
    };
    let hosts = hosts.trim_end_matches('/');
    let seeds: Vec<&str> = hosts.split(',').filter(|h| !h.is_empty()).collect();
    if seeds.is_empty() || hosts.contains('/') {
        return Err(invalid(
            "a cluster URL lists seed nodes",
            "expected redis+cluster://[user:password@]host:port,host:port,…".into(),
        ));
    }
    Ok(Some((node_scheme, auth, seeds)))
}

/// The TLS roots `config` names (its CA file), read now.
fn read_certs(config: &RemoteConfig) -> RedisResult<Option<redis::TlsCertificates>> {
    if config.url.starts_with("rediss") || config.ca_cert.is_some() {
        // The one provider compiled in (ring); a second install is refused, harmlessly.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
    let Some(path) = &config.ca_cert else {
        return Ok(None);
    };
    let pem = std::fs::read(path).map_err(|e| {
        invalid(
            "cannot read the remote tier's CA certificate",
            format!("{}: {e}", path.display()),
        )
    })?;
    Ok(Some(redis::TlsCertificates {
        client_tls: None,
        root_cert: Some(pem),
    }))
}

fn single_client(url: &str, certs: Option<redis::TlsCertificates>) -> RedisResult<redis::Client> {
    match certs {
        Some(c) => redis::Client::build_with_tls(url, c),
        None => redis::Client::open(url),
    }
}

fn cluster_client(
    config: &RemoteConfig,
    scheme: &str,
    auth: &str,
    seeds: &[&str],
    certs: Option<redis::TlsCertificates>,
) -> RedisResult<ClusterClient> {
    let nodes: Vec<String> = seeds
        .iter()
        .map(|h| format!("{scheme}://{auth}{h}"))
        .collect();
    let mut b = ClusterClient::builder(nodes)
        .connection_timeout(config.connect_timeout())
        .response_timeout(config.io_timeout())
        // A MOVED/ASK redirection after resharding is followed once; an unreachable master
        // fails the command instead of stalling it.
        .retries(1)
        .min_retry_wait(10)
        .max_retry_wait(100);
    if let Some(c) = certs {
        b = b.certs(c);
    }
    b.build()
}

/// Where the remote tier lives.
#[derive(Clone)]
enum Target {
    Single(redis::Client),
    Cluster(ClusterClient),
}

/// An open connection to a single node or a cluster.
enum Conn {
    Single(redis::Connection),
    Cluster(Box<ClusterConnection>),
}

impl Conn {
    /// Sends `cmds` as one pipeline (per master on a cluster: written to every node before
    /// any reply is read) and returns the replies in order.
    fn pipeline<T: redis::FromRedisValue>(&mut self, cmds: Vec<Cmd>) -> RedisResult<Vec<T>> {
        match self {
            Conn::Single(c) => {
                let mut p = redis::pipe();
                for cmd in cmds {
                    p.add_command(cmd);
                }
                p.query(c)
            }
            Conn::Cluster(c) => {
                let mut p = redis::cluster::cluster_pipe();
                for cmd in cmds {
                    p.add_command(cmd);
                }
                p.query(c.as_mut())
            }
        }
    }

    fn query<T: redis::FromRedisValue>(&mut self, cmd: &Cmd) -> RedisResult<T> {
        match self {
            Conn::Single(c) => cmd.query(c),
            Conn::Cluster(c) => cmd.query(c.as_mut()),
        }
    }
}

impl Target {
    /// Parses `config`'s URL and reads its CA file; connects nothing.
    fn new(config: &RemoteConfig) -> RedisResult<Target> {
        let certs = read_certs(config)?;
        let Some((scheme, auth, seeds)) = cluster_parts(&config.url)? else {
            return Ok(Target::Single(single_client(&config.url, certs)?));
        };
        Ok(Target::Cluster(cluster_client(
            config, scheme, auth, &seeds, certs,
        )?))
    }

    fn connect(&self, config: &RemoteConfig) -> RedisResult<Conn> {
        let io = Some(config.io_timeout());
        Ok(match self {
            Target::Single(client) => {
                let c = client.get_connection_with_timeout(config.connect_timeout())?;
                c.set_read_timeout(io)?;
                c.set_write_timeout(io)?;
                Conn::Single(c)
            }
            Target::Cluster(client) => {
                let c = client.get_connection()?;
                c.set_read_timeout(io)?;
                c.set_write_timeout(io)?;
                Conn::Cluster(Box::new(c))
            }
        })
    }
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
    target: Target,
    config: RemoteConfig,
    health: Mutex<Health>,
    reader: Mutex<Option<Conn>>,
    writer: Mutex<Option<Conn>>,
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
    /// Parses the URL (and reads the CA file); connects lazily, so a Redis that is down at
    /// start is no error.
    pub(crate) fn new(config: RemoteConfig, counters: Arc<Counters>) -> RedisResult<Self> {
        Ok(RemoteTier {
            target: Target::new(&config)?,
            config,
            health: Mutex::new(Health::default()),
            reader: Mutex::new(None),
            writer: Mutex::new(None),
            counters,
        })
    }

    /// Runs `f` on the role's connection unless Redis is in backoff; `None` on any failure
    /// (counted, and logged once per outage).
    fn with_conn<T>(&self, role: Role, f: impl FnOnce(&mut Conn) -> RedisResult<T>) -> Option<T> {
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
            match self.target.connect(&self.config) {
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

    fn failed(&self, e: &RedisError) {
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
            let hint = match e.kind() {
                ErrorKind::AuthenticationFailed => {
                    "Redis refused the credentials: check user and password in --remote"
                }
                _ if e.to_string().contains("NOAUTH") => {
                    "Redis requires a password: put it in --remote (redis://:password@host:port)"
                }
                _ => "serving from the local tiers and retrying with backoff",
            };
            tracing::warn!(error = %e, "remote tier unavailable: {hint}");
        }
    }

    fn succeeded(&self) {
        let mut h = lock(&self.health);
        if h.logged {
            tracing::info!("remote tier reachable again");
        }
        *h = Health::default();
    }

    /// One `name key` command per key, sent as one pipelined round trip.
    fn per_key<T: redis::FromRedisValue>(
        &self,
        name: &str,
        ns: NamespaceId,
        keys: &[BlockKey],
    ) -> Option<Vec<T>> {
        if keys.is_empty() {
            return Some(Vec::new());
        }
        let cmds = keys
            .iter()
            .map(|&k| {
                let mut c = redis::cmd(name);
                c.arg(redis_key(ns, k));
                c
            })
            .collect();
        self.with_conn(Role::Read, |c| c.pipeline(cmds))
    }

    /// Which of `keys` Redis holds, in one pipelined round trip; `None` when unreachable.
    pub(crate) fn exists(&self, ns: NamespaceId, keys: &[BlockKey]) -> Option<Vec<bool>> {
        self.per_key("EXISTS", ns, keys)
    }

    /// The values of `keys`, in one pipelined round trip; `None` when unreachable.
    pub(crate) fn get(&self, ns: NamespaceId, keys: &[BlockKey]) -> Option<Vec<Option<Vec<u8>>>> {
        self.per_key("GET", ns, keys)
    }

    /// Deletes a block's value; whether Redis held it (`None` when unreachable).
    pub(crate) fn delete(&self, ns: NamespaceId, key: BlockKey) -> Option<bool> {
        let mut cmd = redis::cmd("DEL");
        cmd.arg(redis_key(ns, key));
        self.with_conn(Role::Write, |c| c.query::<u64>(&cmd))
            .map(|n| n > 0)
    }

    /// Every block Redis holds (namespace, key, value bytes); keys of another format under
    /// the prefix are skipped.
    pub(crate) fn scan(&self) -> RedisResult<Vec<(NamespaceId, BlockKey, u64)>> {
        let mut out = Vec::new();
        scan_all(&self.config, &mut |k, len| {
            let mut parts = k.split(':').skip(1);
            if let (Some(Ok(ns)), Some(Ok(key)), None) = (
                parts.next().map(str::parse::<NamespaceId>),
                parts.next().map(str::parse::<BlockKey>),
                parts.next(),
            ) {
                out.push((ns, key, len));
            }
        })?;
        Ok(out)
    }

    /// Stores a block's file bytes (with the configured TTL, raised to `pinned` when the
    /// block is pinned for longer); whether it was stored.
    pub(crate) fn put(
        &self,
        ns: NamespaceId,
        key: BlockKey,
        bytes: &[u8],
        pinned: Option<std::time::Duration>,
    ) -> bool {
        let mut cmd = redis::cmd("SET");
        cmd.arg(redis_key(ns, key)).arg(bytes);
        if let Some(ttl) = self.config.ttl_secs {
            let pin = pinned.map_or(0, |d| d.as_secs() + 1);
            cmd.arg("EX").arg(ttl.max(pin).max(1));
        }
        self.with_conn(Role::Write, |c| c.query::<()>(&cmd))
            .is_some()
    }

    /// Makes `keys` of `ns` live at least `secs` more where Redis holds them (`EXPIRE … GT`:
    /// never shortened). Without a configured TTL keys never expire: nothing to do. Whether
    /// Redis answered.
    pub(crate) fn extend(&self, ns: NamespaceId, keys: &[BlockKey], secs: u64) -> bool {
        if self.config.ttl_secs.is_none() || keys.is_empty() {
            return true;
        }
        self.with_conn(Role::Write, |c| {
            for k in keys {
                let mut cmd = redis::cmd("EXPIRE");
                cmd.arg(redis_key(ns, *k)).arg(secs.max(1)).arg("GT");
                c.query::<i64>(&cmd)?;
            }
            Ok(())
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

/// Scans every `kvstore:*` key the remote tier of `config` holds (on a cluster, every
/// master's) with SCAN and a pipelined STRLEN per batch, and sums blocks and bytes per
/// namespace, largest first.
pub fn inspect_remote(config: &RemoteConfig) -> RedisResult<Vec<RemoteNamespaceUsage>> {
    let mut by_ns: std::collections::BTreeMap<String, (u64, u64)> = Default::default();
    scan_all(config, &mut |key, len| {
        let ns = key.split(':').nth(1).unwrap_or_default().to_string();
        let e = by_ns.entry(ns).or_default();
        e.0 += 1;
        e.1 += len;
    })?;
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

/// Calls `visit(key, value length)` for every `kvstore:*` key the remote tier of `config`
/// holds (on a cluster, every master's), with SCAN and a pipelined STRLEN per batch.
fn scan_all(config: &RemoteConfig, visit: &mut dyn FnMut(&str, u64)) -> RedisResult<()> {
    let certs = read_certs(config)?;
    match cluster_parts(&config.url)? {
        None => scan_node(&single_client(&config.url, certs)?, config, visit),
        Some((scheme, auth, seeds)) => {
            let cluster = cluster_client(config, scheme, auth, &seeds, certs.clone())?;
            let mut c = cluster.get_connection()?;
            let nodes: String = redis::cmd("CLUSTER").arg("NODES").query(&mut c)?;
            for master in cluster_masters(&nodes) {
                let client = single_client(&format!("{scheme}://{auth}{master}"), certs.clone())?;
                scan_node(&client, config, visit)?;
            }
            Ok(())
        }
    }
}

/// `host:port` of every master `CLUSTER NODES` lists.
fn cluster_masters(nodes: &str) -> Vec<String> {
    nodes
        .lines()
        .filter_map(|line| {
            let mut f = line.split_whitespace();
            let addr = f.nth(1)?;
            let flags = f.next()?;
            let is_master = flags.split(',').any(|x| x == "master");
            // `ip:port@cport[,hostname]`
            is_master.then(|| addr.split('@').next().unwrap_or(addr).to_string())
        })
        .collect()
}

/// Calls `visit(key, value length)` for each of one node's `kvstore:*` keys.
fn scan_node(
    client: &redis::Client,
    config: &RemoteConfig,
    visit: &mut dyn FnMut(&str, u64),
) -> RedisResult<()> {
    let mut c = client.get_connection_with_timeout(config.connect_timeout())?;
    c.set_read_timeout(Some(Duration::from_secs(5).max(config.io_timeout())))?;
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
                visit(k, len);
            }
        }
        cursor = next;
        if cursor == 0 {
            return Ok(());
        }
    }
}
