//! `GET /metrics`: one `prometheus-client` registry per server, encoded in the Prometheus
//! text format (version 0.0.4).
//!
//! Two kinds of metrics live in the registry, each declared once with its help text:
//!
//! - the HTTP responses by status code, a counter family the server's middleware increments
//!   as responses leave ([`ServerMetrics::record_response`]);
//! - everything the engine and the store count themselves (requests, tokens, the tiers), read
//!   as one snapshot per scrape by [`EngineCollector`], the crate's `Collector` for values
//!   that live elsewhere, so the engine thread never takes a metrics lock.
//!
//! Counter names are declared without `_total`: the encoder appends it, so
//! `kvstore_requests` is scraped as `kvstore_requests_total`.

use std::fmt;
use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{
    DescriptorEncoder, EncodeCounterValue, EncodeGaugeValue, EncodeMetric,
};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use crate::scheduler::{Engine, TTFT_BUCKETS};

/// The `Content-Type` of `/metrics`.
pub(crate) const CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// A status code label: `code="200"`.
type CodeLabel = [(&'static str, u16); 1];

/// A metric with one sample per store tier: kind, name, help, (tier, value) pairs.
type TierMetric<'a> = (MetricType, &'a str, &'a str, [(&'a str, u64); 2]);

/// The server's metrics registry.
#[derive(Debug)]
pub(crate) struct ServerMetrics {
    registry: Registry,
    responses: Family<CodeLabel, Counter>,
}

impl ServerMetrics {
    /// The registry of a server over `engine`.
    pub(crate) fn new(engine: Arc<Engine>) -> Self {
        let mut registry = Registry::default();
        let responses = Family::<CodeLabel, Counter>::default();
        // The registry appends the period to a registered metric's help.
        registry.register(
            "kvstore_http_responses",
            "HTTP responses by status code",
            responses.clone(),
        );
        registry.register_collector(Box::new(EngineCollector { engine }));
        ServerMetrics {
            registry,
            responses,
        }
    }

    /// Counts one response with status `code`.
    pub(crate) fn record_response(&self, code: u16) {
        self.responses.get_or_create(&[("code", code)]).inc();
    }

    /// Every metric, in the Prometheus text format.
    pub(crate) fn encode(&self) -> Result<String, fmt::Error> {
        let mut out = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut out, &self.registry)?;
        Ok(out)
    }
}

/// Reads the engine's and the store's counters at each scrape.
struct EngineCollector {
    engine: Arc<Engine>,
}

impl fmt::Debug for EngineCollector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("EngineCollector")
    }
}

/// Writes one metric (no labels).
fn one<M: EncodeMetric>(
    e: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    metric: M,
) -> fmt::Result {
    metric.encode(e.encode_descriptor(name, help, None, metric.metric_type())?)
}

fn counter(
    e: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    v: impl EncodeCounterValue,
) -> fmt::Result {
    one(e, name, help, ConstCounter::new(v))
}

fn gauge(
    e: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    v: impl EncodeGaugeValue,
) -> fmt::Result {
    one(e, name, help, ConstGauge::new(v))
}

/// Writes counters given as (name, help, value).
fn counter_list(e: &mut DescriptorEncoder<'_>, list: &[(&str, &str, u64)]) -> fmt::Result {
    for &(name, help, v) in list {
        counter(e, name, help, v)?;
    }
    Ok(())
}

/// Writes one metric with one sample per value of the label `label`.
fn by_label(
    e: &mut DescriptorEncoder<'_>,
    kind: MetricType,
    name: &str,
    help: &str,
    label: &str,
    samples: &[(&str, u64)],
) -> fmt::Result {
    let mut m = e.encode_descriptor(name, help, None, kind)?;
    for &(value, v) in samples {
        let labels = [(label, value)];
        let sample = m.encode_family(&labels)?;
        match kind {
            MetricType::Counter => ConstCounter::new(v).encode(sample)?,
            _ => ConstGauge::new(v).encode(sample)?,
        }
    }
    Ok(())
}

impl Collector for EngineCollector {
    fn encode(&self, mut e: DescriptorEncoder<'_>) -> fmt::Result {
        use MetricType::{Counter, Gauge};
        let e = &mut e;
        let m = self.engine.metrics();
        by_label(
            e,
            Counter,
            "kvstore_requests",
            "Generation requests by outcome.",
            "outcome",
            &[
                ("submitted", m.requests_submitted),
                ("stop", m.requests_finished_stop),
                ("length", m.requests_finished_length),
                ("cancelled", m.requests_cancelled),
                ("failed", m.requests_failed),
            ],
        )?;
        counter(
            e,
            "kvstore_prompt_tokens",
            "Prompt tokens of admitted requests.",
            m.prompt_tokens,
        )?;
        by_label(
            e,
            Counter,
            "kvstore_cached_prompt_tokens",
            "Prompt tokens reused from the prefix cache, by tier.",
            "tier",
            &[
                ("device", m.cached_device_tokens),
                ("ram", m.cached_ram_tokens),
                ("ssd", m.cached_ssd_tokens),
                ("remote", m.cached_remote_tokens),
            ],
        )?;
        counter(
            e,
            "kvstore_generated_tokens",
            "Tokens generated.",
            m.generated_tokens,
        )?;
        counter(
            e,
            "kvstore_decode_steps",
            "Batched decode steps.",
            m.decode_steps,
        )?;
        counter(
            e,
            "kvstore_decode_rows",
            "Rows over all batched decode steps (÷ steps = mean batch).",
            m.decode_rows,
        )?;
        gauge(
            e,
            "kvstore_queue_depth",
            "Requests waiting for admission.",
            m.queue_depth,
        )?;
        gauge(
            e,
            "kvstore_active_requests",
            "Requests decoding now.",
            m.active_rows,
        )?;
        gauge(
            e,
            "kvstore_kv_reserved_bytes",
            "Live KV bytes reserved by admitted requests.",
            m.kv_reserved_bytes,
        )?;
        gauge(
            e,
            "kvstore_mlx_active_bytes",
            "Bytes held by live MLX arrays: weights, live KV, published blocks in the RAM tier.",
            mlx::active_memory().unwrap_or(0) as u64,
        )?;
        gauge(
            e,
            "kvstore_mlx_cache_bytes",
            "Bytes of freed buffers MLX keeps for reuse (capped by --mlx-cache-limit).",
            mlx::cache_memory().unwrap_or(0) as u64,
        )?;
        // The engine counts cumulatively per bucket; the encoder wants each bucket's own
        // count, +Inf included, and accumulates them again.
        let mut buckets = Vec::with_capacity(TTFT_BUCKETS.len() + 1);
        let mut below = 0;
        for (le, &cumulative) in TTFT_BUCKETS.iter().zip(&m.ttft_buckets) {
            buckets.push((*le, cumulative.saturating_sub(below)));
            below = cumulative;
        }
        buckets.push((f64::INFINITY, m.ttft_count.saturating_sub(below)));
        e.encode_descriptor(
            "kvstore_ttft_seconds",
            "Time to first token (queue + restore + prefill), seconds.",
            None,
            MetricType::Histogram,
        )?
        .encode_histogram::<prometheus_client::encoding::NoLabelSet>(
            m.ttft_sum_s,
            m.ttft_count,
            &buckets,
            None,
        )?;
        if let Some(d) = self.engine.kv_tiers().map(|p| p.resident_stats()) {
            gauge(
                e,
                "kvstore_device_resident_bytes",
                "Device bytes of finished sequences kept resident for reuse (the device tier).",
                d.resident_bytes,
            )?;
            gauge(
                e,
                "kvstore_device_resident_buffer_bytes",
                "MLX buffers behind the resident sequences' KV: at least kvstore_device_resident_bytes, more where MLX's buffer cache handed an arena a larger freed buffer.",
                d.resident_buffer_bytes,
            )?;
            gauge(
                e,
                "kvstore_device_resident_sequences",
                "Finished sequences kept resident on the device.",
                d.sequences as u64,
            )?;
            gauge(
                e,
                "kvstore_device_budget_bytes",
                "Device budget for live and resident KV (--kv-budget).",
                d.budget_bytes,
            )?;
            by_label(
                e,
                Counter,
                "kvstore_device_hits",
                "Requests whose prefix was resident on the device, by how it was served.",
                "kind",
                &[("handover", d.handovers), ("fork", d.forks)],
            )?;
            counter(
                e,
                "kvstore_device_evictions",
                "Resident sequences evicted from the device to make room.",
                d.evictions,
            )?;
        }
        if let Some(x) = self.engine.kv_tiers().map(|p| p.export_stats()) {
            export(e, &x)?;
        }
        if let Some(st) = self.engine.cache_stats() {
            let tiers = |ram: u64, ssd: u64| [("ram", ram), ("ssd", ssd)];
            let per_tier: [TierMetric<'_>; 6] = [
                (
                    Counter,
                    "kvstore_cache_hits",
                    "Blocks served by the store, by tier.",
                    tiers(st.ram_hits, st.ssd_hits),
                ),
                (
                    Counter,
                    "kvstore_cache_misses",
                    "Blocks looked up and not found, by tier.",
                    tiers(st.ram_misses, st.ssd_misses),
                ),
                (
                    Counter,
                    "kvstore_cache_evictions",
                    "Blocks a tier gave up to make room, by tier (RAM's go to the SSD writer).",
                    tiers(st.ram_evictions, st.ssd_evictions),
                ),
                (
                    Gauge,
                    "kvstore_cache_bytes",
                    "Bytes held by the store, by tier.",
                    tiers(st.ram_bytes, st.ssd_bytes),
                ),
                (
                    Gauge,
                    "kvstore_cache_budget_bytes",
                    "Byte budget of the store, by tier.",
                    tiers(st.ram_budget, st.ssd_budget),
                ),
                (
                    Gauge,
                    "kvstore_cache_blocks",
                    "Blocks held by the store, by tier.",
                    tiers(st.ram_blocks, st.ssd_blocks),
                ),
            ];
            for (kind, name, help, samples) in per_tier {
                by_label(e, kind, name, help, "tier", &samples)?;
            }
            counter(
                e,
                "kvstore_cache_bytes_written",
                "Bytes written to SSD block files.",
                st.bytes_written,
            )?;
            let writes: [(&str, &str, u64); 3] = [
                (
                    "kvstore_cache_spills",
                    "Blocks that left RAM queued for the SSD writer.",
                    st.spills,
                ),
                (
                    "kvstore_cache_spills_dropped",
                    "Blocks that left RAM and were dropped: the write-behind queue was full (--ssd-queue).",
                    st.skipped_queue_full,
                ),
                (
                    "kvstore_cache_ram_not_admitted",
                    "New blocks the RAM tier refused under --eviction freq-admit (sent to the SSD writer).",
                    st.ram_not_admitted,
                ),
            ];
            counter_list(e, &writes)?;
            if st.remote_enabled {
                remote(e, &st)?;
            }
        }
        Ok(())
    }
}

/// The export thread's counters: what publication copied from the device into the host
/// tiers, and what it skipped while it was behind (docs/cache.md, "Publication").
fn export(e: &mut DescriptorEncoder<'_>, x: &crate::ExportStats) -> fmt::Result {
    let counters: [(&str, &str, u64); 5] = [
        (
            "kvstore_export_blocks",
            "Blocks copied from the device into the host tiers by the export thread.",
            x.blocks,
        ),
        (
            "kvstore_export_bytes",
            "Device bytes the export thread read back.",
            x.bytes,
        ),
        (
            "kvstore_export_failed_blocks",
            "Blocks lost to a failed device read or a refused insert (logged).",
            x.failed_blocks,
        ),
        (
            "kvstore_export_skipped_exports",
            "Publications not exported because the export thread was behind (never waited for).",
            x.skipped_exports,
        ),
        (
            "kvstore_export_skipped_blocks",
            "Blocks of those skipped publications (not in the host tiers).",
            x.skipped_blocks,
        ),
    ];
    counter_list(e, &counters)?;
    let seconds: [(&str, &str, u64); 3] = [
        (
            "kvstore_export_read_seconds",
            "Seconds the export thread spent reading blocks back from the device.",
            x.read_us,
        ),
        (
            "kvstore_export_insert_seconds",
            "Seconds the export thread spent inserting blocks into the store (hashing included).",
            x.insert_us,
        ),
        (
            "kvstore_export_lookup_wait_seconds",
            "Seconds lookups waited for an export holding one of their blocks.",
            x.lookup_wait_us,
        ),
    ];
    for (name, help, us) in seconds {
        counter(e, name, help, us as f64 / 1e6)?;
    }
    Ok(())
}

/// The remote tier's counters (only with `--remote`).
fn remote(e: &mut DescriptorEncoder<'_>, st: &store::StoreStats) -> fmt::Result {
    let counters: [(&str, &str, u64); 10] = [
        (
            "kvstore_remote_hits",
            "Blocks fetched from the remote tier and verified.",
            st.remote_hits,
        ),
        (
            "kvstore_remote_misses",
            "Blocks asked of the remote tier and not served (absent, unreachable or invalid).",
            st.remote_misses,
        ),
        (
            "kvstore_remote_fetched_bytes",
            "Bytes of verified blocks fetched from the remote tier.",
            st.remote_bytes_read,
        ),
        (
            "kvstore_remote_fetches",
            "Chain fetches from the remote tier (one pipelined round trip each).",
            st.remote_fetches,
        ),
        (
            "kvstore_remote_errors",
            "Failed Redis operations (refused, timed out, killed, AUTH or TLS refused).",
            st.remote_errors,
        ),
        (
            "kvstore_remote_verify_failures",
            "Fetched values that failed verification (corrupt or foreign), never served.",
            st.remote_verify_failures,
        ),
        (
            "kvstore_remote_published_blocks",
            "Blocks published to the remote tier.",
            st.remote_blocks_written,
        ),
        (
            "kvstore_remote_published_bytes",
            "Bytes published to the remote tier.",
            st.remote_bytes_written,
        ),
        (
            "kvstore_remote_publish_queue_drops",
            "Publications skipped because the publication queue was full.",
            st.remote_queue_full,
        ),
        (
            "kvstore_remote_publish_errors",
            "Publications that failed (Redis unreachable, in backoff, or an error).",
            st.remote_publish_errors,
        ),
    ];
    counter_list(e, &counters)?;
    counter(
        e,
        "kvstore_remote_fetch_seconds",
        "Seconds spent in those fetches.",
        st.remote_fetch_us as f64 / 1e6,
    )
}
