//! [`ResidentPool`]: the device tier (L0). The KV of finished sequences stays on the
//! device, indexed by chain key, under one byte budget shared with the live sequences.
//!
//! Layout (chosen by `kvstore bench cache`, docs/cache.md): a sequence owns per-layer
//! arenas in which its blocks are one strided run, so attention reads its KV through a
//! view, never a gather. A request whose prompt extends a resident sequence entirely (or
//! all but a short tail of it, as an agent's next turn does when the client re-renders the
//! previous reply) is *handed over* its arenas: no copy at all. A request that shares only
//! part of one (a fork, or a prompt that left the sequence mid-block) gets a cache of its
//! own holding the shared blocks, copied once into pools of their size
//! ([`PagedKvCache::fork`]), so the resident sequence is never altered and the fork never
//! holds a longer sequence's whole arenas.
//! Matches are token-granular: the partial last block is reused too.
//!
//! A hit of at least [`ResidentPool::set_share_min_tokens`] tokens that is not a handover
//! is a *share* instead of a fork: the request's cache starts with views of the resident
//! sequence's arenas as a read-only prefix ([`PagedKvCache::share_prefix`]) and writes only
//! its own tokens, so concurrent requests that branch from one resident prefix read the
//! same physical KV and nothing is copied at admission. An entry with live sharers is never
//! evicted, handed over, superseded or altered; its bytes count once (resident), each
//! sharer's own pools as live. A sharer that is parked keeps its source referenced while it
//! is resident (a refcount tree); when the last sharer ends the entry is evictable again.
//!
//! Eviction is least recently used, whole sequences at a time, when resident plus live
//! bytes exceed the budget. Every full block was exported to the host tiers when it was
//! published, so an evicted sequence is still restorable from RAM, SSD or the remote tier.
//! An exclusive device tier (`engine::DeviceTier::Exclusive`) exports a sequence's blocks
//! when it leaves instead: the pool keeps what eviction takes
//! ([`ResidentPool::set_keep_evicted`]) for the engine to export and drop
//! ([`ResidentPool::take_evicted`]).
//! A sequence holding a pinned block ([`store::Pins`]) is spared while unpinned ones are
//! left: a finished sequence that does not fit beside the pinned ones is not kept, but a
//! live request's reservation outranks pins (its blocks stay pinned in the host tiers), so
//! pins never keep a request from running.

use std::collections::HashMap;
use std::sync::Arc;

use serde::Serialize;
use store::{BlockKey, NamespaceId, Pins};

use crate::{CacheError, Chain, KvCache, PagedConfig, PagedKvCache, ShareHandle};

/// A resident sequence.
#[derive(Debug)]
struct Entry {
    chain: Chain,
    tokens: Vec<u32>,
    cache: PagedKvCache,
    bytes: u64,
    /// The allocator buffers behind its arenas when it was parked (`buffer_bytes`).
    buffers: u64,
    used: u64,
    /// Counts the caches that share a prefix of this one (its live sharers).
    handle: ShareHandle,
}

/// A sequence eviction took from a pool that keeps them ([`ResidentPool::set_keep_evicted`]).
#[derive(Debug)]
pub struct EvictedSequence {
    /// Its chain, with the keys of its full blocks.
    pub chain: Chain,
    /// The tokens it held.
    pub tokens: Vec<u32>,
    /// Its cache (the arenas: device memory until dropped).
    pub cache: PagedKvCache,
}

/// What [`ResidentPool::take`] found.
#[derive(Debug)]
pub struct ResidentHit {
    /// A cache holding the first `tokens` tokens of the prompt.
    pub cache: PagedKvCache,
    /// Prompt tokens it holds.
    pub tokens: usize,
    /// Whether the resident sequence's arenas were handed over (no copy) rather than
    /// shared copy-on-write with a sequence that stays resident.
    pub handed_over: bool,
    /// Whether the cache reads the resident sequence's arenas as a shared prefix (no copy,
    /// now or at its first write) rather than holding a copy-on-write clone.
    pub shared: bool,
}

/// Counters and gauges of the device tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ResidentStats {
    /// Sequences resident.
    pub sequences: usize,
    /// Device bytes they hold (their arenas), what the budget counts.
    pub resident_bytes: u64,
    /// The allocator buffers behind those arenas: at least `resident_bytes`, more where
    /// MLX's buffer cache handed an arena a larger freed buffer
    /// ([`PagedKvCache::buffer_bytes`]).
    pub resident_buffer_bytes: u64,
    /// Bytes reserved by live sequences.
    pub live_bytes: u64,
    /// The budget for both.
    pub budget_bytes: u64,
    /// Lookups that found a resident prefix.
    pub hits: u64,
    /// Lookups that found none.
    pub misses: u64,
    /// Hits served by handing a sequence's arenas over.
    pub handovers: u64,
    /// Hits served by a copy-on-write fork.
    pub forks: u64,
    /// Hits served by a shared prefix (no copy).
    pub shares: u64,
    /// Prompt tokens served from the device tier.
    pub hit_tokens: u64,
    /// Sequences evicted to make room.
    pub evictions: u64,
    /// Bytes those held.
    pub evicted_bytes: u64,
}

/// The device tier: resident sequences by chain key, one budget for resident and live KV.
#[derive(Debug)]
pub struct ResidentPool {
    budget: u64,
    live: u64,
    resident: u64,
    resident_buffers: u64,
    entries: HashMap<u64, Entry>,
    /// Chain key of every full block of every entry → the entries holding it.
    index: HashMap<BlockKey, Vec<u64>>,
    next_id: u64,
    clock: u64,
    stats: ResidentStats,
    /// Keys whose sequences eviction spares.
    pins: Arc<Pins>,
    /// The fewest matched tokens a hit shares rather than forks.
    share_min_tokens: usize,
    /// The engine's cache configuration, from which a fork gets the room of the prompt it
    /// is made for; `None`: a fork keeps its source's.
    fork_config: Option<PagedConfig>,
    /// Keep the sequences eviction takes (in `evicted`) instead of dropping them.
    keep_evicted: bool,
    evicted: Vec<EvictedSequence>,
}

/// What [`ResidentPool::share_counts`] reports of one resident sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShareCount {
    /// The entry's id (as [`PagedKvCache::shared_prefix`] names it).
    pub entry: u64,
    /// Caches alive that read a prefix of it (live requests and parked sequences).
    pub sharers: usize,
    /// The entry whose prefix this one's cache reads, if it is itself a sharer.
    pub source: Option<u64>,
}

/// The default of [`ResidentPool::set_share_min_tokens`] for a pool made without a device
/// in mind: never share (the engine picks per device: `engine::default_share_min_tokens`).
pub const DEFAULT_SHARE_MIN_TOKENS: usize = usize::MAX;

/// A hit on all but at most 1/`HANDOVER_TAIL` of a resident sequence takes it over
/// (trimmed, no copy) instead of forking it (a device copy of every layer's arena).
const HANDOVER_TAIL: usize = 4;

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl ResidentPool {
    /// An empty pool for `budget_bytes` of device KV (resident and live together).
    pub fn new(budget_bytes: u64) -> Self {
        Self {
            budget: budget_bytes,
            live: 0,
            resident: 0,
            resident_buffers: 0,
            entries: HashMap::new(),
            index: HashMap::new(),
            next_id: 0,
            clock: 0,
            stats: ResidentStats::default(),
            pins: Arc::new(Pins::new()),
            share_min_tokens: DEFAULT_SHARE_MIN_TOKENS,
            fork_config: None,
            keep_evicted: false,
            evicted: Vec::new(),
        }
    }

    /// Keeps the sequences eviction takes, for [`Self::take_evicted`], instead of dropping
    /// them (an exclusive device tier exports their blocks to the host tiers first). Until
    /// taken, their arenas hold device memory past the budget.
    pub fn set_keep_evicted(&mut self, keep: bool) {
        self.keep_evicted = keep;
    }

    /// The sequences evicted since the last call (none unless [`Self::set_keep_evicted`]).
    pub fn take_evicted(&mut self) -> Vec<EvictedSequence> {
        std::mem::take(&mut self.evicted)
    }

    /// Calls `f` with the chain, cache and tokens of every resident sequence, least
    /// recently used first (an exclusive device tier exports what they hold before a
    /// flush). Recency and the budget's accounting are unchanged.
    pub fn for_each_resident(&mut self, mut f: impl FnMut(&mut Chain, &mut PagedKvCache, &[u32])) {
        let mut ids: Vec<(u64, u64)> = self.entries.iter().map(|(id, e)| (e.used, *id)).collect();
        ids.sort_unstable();
        for (_, id) in ids {
            if let Some(e) = self.entries.get_mut(&id) {
                f(&mut e.chain, &mut e.cache, &e.tokens);
            }
        }
    }

    /// Sets the fewest matched tokens a hit that is not a handover shares (the request's
    /// cache reads the resident arenas as a prefix) rather than forks (copy on write);
    /// `usize::MAX` never shares.
    pub fn set_share_min_tokens(&mut self, tokens: usize) {
        self.share_min_tokens = tokens.max(1);
    }

    /// Sets the configuration new caches of the engine start from: a fork then gets pools
    /// with room for the prompt it is made for (`config.with_room_for(prompt)`), so its
    /// prefill does not grow them, nor do they keep the room of a longer source.
    pub fn set_fork_config(&mut self, config: PagedConfig) {
        self.fork_config = Some(config);
    }

    /// The fewest tokens a hit shares ([`Self::set_share_min_tokens`]).
    pub fn share_min_tokens(&self) -> usize {
        self.share_min_tokens
    }

    /// Live sharers of resident entry `entry` (`None` when it is not resident).
    pub fn sharers(&self, entry: u64) -> Option<usize> {
        self.entries.get(&entry).map(|e| e.handle.others())
    }

    /// Every resident sequence's sharers and source (in no particular order).
    pub fn share_counts(&self) -> Vec<ShareCount> {
        self.entries
            .iter()
            .map(|(id, e)| ShareCount {
                entry: *id,
                sharers: e.handle.others(),
                source: e.cache.shared_prefix().map(|(s, _)| s),
            })
            .collect()
    }

    /// Device bytes of resident entry `entry` (counted once, however many share it).
    pub fn entry_bytes(&self, entry: u64) -> Option<u64> {
        self.entries.get(&entry).map(|e| e.bytes)
    }

    /// Sets the pins eviction spares (the block store's, so one pin covers every tier).
    pub fn set_pins(&mut self, pins: Arc<Pins>) {
        self.pins = pins;
    }

    fn is_pinned(&self, e: &Entry) -> bool {
        if !self.pins.any() {
            return false;
        }
        let ns = e.chain.namespace();
        e.chain.keys().iter().any(|k| self.pins.is_pinned(ns, *k))
    }

    /// Device bytes of the resident sequences that hold a pinned block now.
    pub fn pinned_bytes(&self) -> u64 {
        self.entries
            .values()
            .filter(|e| self.is_pinned(e))
            .map(|e| e.bytes)
            .sum()
    }

    /// The budget in bytes.
    pub fn budget(&self) -> u64 {
        self.budget
    }

    /// Counters and gauges.
    pub fn stats(&self) -> ResidentStats {
        ResidentStats {
            sequences: self.entries.len(),
            resident_bytes: self.resident,
            resident_buffer_bytes: self.resident_buffers,
            live_bytes: self.live,
            budget_bytes: self.budget,
            ..self.stats
        }
    }

    /// Token ids of every resident sequence of `namespace` (most recently used first).
    pub fn sequences(&self, namespace: NamespaceId) -> Vec<&[u32]> {
        let mut e: Vec<&Entry> = self
            .entries
            .values()
            .filter(|e| e.chain.namespace() == namespace)
            .collect();
        e.sort_by_key(|e| std::cmp::Reverse(e.used));
        e.into_iter().map(|e| e.tokens.as_slice()).collect()
    }

    /// The longest resident prefix of `prompt`, at most `limit` tokens: `chain` holds the
    /// prompt's keys (at least those of its first `limit` tokens). The deepest key of
    /// `chain` that a resident sequence holds selects it; tokens after that key are
    /// compared one by one, so the partial last block counts. A sequence matched to its end,
    /// or all but a short tail of it (at most a quarter), leaves the pool and its cache is
    /// returned trimmed in place (no copy); otherwise the cache is a clone trimmed to the
    /// match (copy on write) and the sequence stays.
    pub fn take(
        &mut self,
        chain: &Chain,
        prompt: &[u32],
        limit: usize,
    ) -> Result<Option<ResidentHit>, CacheError> {
        let best = self.best(chain, prompt, limit);
        let Some((id, m)) = best else {
            self.stats.misses += 1;
            return Ok(None);
        };
        self.clock += 1;
        self.stats.hits += 1;
        self.stats.hit_tokens += m as u64;
        let (len, sharers) = self
            .entries
            .get(&id)
            .map_or((0, 0), |e| (e.tokens.len(), e.handle.others()));
        if sharers == 0 && (len - m) * HANDOVER_TAIL <= len {
            // The prompt takes (nearly) all of it: hand the arenas over, trimmed in place.
            // The tail dropped is mostly the previous reply the client did not send back
            // (a scripted or edited turn, stripped reasoning); its full blocks stay in the
            // host tiers.
            let Some(mut e) = self.remove(id) else {
                return Ok(None);
            };
            e.cache.trim(len - m)?;
            self.stats.handovers += 1;
            return Ok(Some(ResidentHit {
                cache: e.cache,
                tokens: m,
                handed_over: true,
                shared: false,
            }));
        }
        let e = self.entries.get_mut(&id).ok_or_else(|| {
            CacheError::Config("a resident sequence vanished during a lookup".into())
        })?;
        e.used = self.clock;
        if m >= self.share_min_tokens && e.cache.can_share() {
            let cache = PagedKvCache::share_prefix(&e.cache, m, e.handle.clone())?;
            self.stats.shares += 1;
            return Ok(Some(ResidentHit {
                cache,
                tokens: m,
                handed_over: false,
                shared: true,
            }));
        }
        // A pool with room for this prompt, a step of the ladder every cache of the engine
        // climbs (the source's own room may be far larger or smaller).
        let initial = self
            .fork_config
            .map_or(e.cache.config().initial_blocks, |c| {
                c.with_room_for(prompt.len()).initial_blocks
            });
        let cache = e.cache.fork(m, initial)?;
        self.stats.forks += 1;
        Ok(Some(ResidentHit {
            cache,
            tokens: m,
            handed_over: false,
            shared: false,
        }))
    }

    /// Tokens of `prompt` (at most `limit`) that [`Self::take`] would find resident now,
    /// without taking them or touching recency.
    pub fn peek(&self, chain: &Chain, prompt: &[u32], limit: usize) -> usize {
        self.best(chain, prompt, limit).map_or(0, |(_, m)| m)
    }

    /// The resident sequence sharing the longest prefix with `prompt[..limit]`, and that
    /// length (ties: the most recently used).
    fn best(&self, chain: &Chain, prompt: &[u32], limit: usize) -> Option<(u64, usize)> {
        let limit = limit.min(prompt.len());
        let bs = chain.block_size();
        let mut best: Option<(u64, usize)> = None;
        let deepest = chain
            .keys()
            .iter()
            .enumerate()
            .rev()
            .filter(|(j, _)| (j + 1) * bs <= limit)
            .find_map(|(j, k)| self.index.get(k).map(|ids| (j, ids)));
        if let Some((j, ids)) = deepest {
            let base = (j + 1) * bs;
            let mut best_used = 0;
            for (id, e) in ids
                .iter()
                .filter_map(|id| Some((*id, self.entries.get(id)?)))
            {
                let m = base + common_prefix(&e.tokens[base..], &prompt[base..limit]);
                // A hybrid's non-attention layers resume only where they kept a state.
                let m = e.cache.rewind_point(m);
                if m == 0 {
                    continue;
                }
                if best.is_none_or(|(_, bm)| m > bm || (m == bm && e.used > best_used)) {
                    best = Some((id, m));
                    best_used = e.used;
                }
            }
        }
        best
    }

    /// Keeps a finished sequence resident: its `tokens` (all it holds), its `chain` (with
    /// the keys of its full blocks) and its cache. Resident sequences of the namespace that
    /// it extends are dropped (it holds everything they did). Then the least recently used
    /// sequences are evicted until resident and live bytes fit the budget; returns how many
    /// were evicted (the new one among them if it alone does not fit). Sequences with live
    /// sharers are neither superseded nor evicted.
    pub fn park(&mut self, mut chain: Chain, tokens: Vec<u32>, cache: PagedKvCache) -> usize {
        chain.extend(&tokens);
        chain.truncate(tokens.len() / chain.block_size());
        if tokens.is_empty() || cache.offset() != tokens.len() {
            return 0;
        }
        let ns = chain.namespace();
        let superseded: Vec<u64> = self
            .entries
            .iter()
            .filter(|(_, e)| {
                e.chain.namespace() == ns && tokens.starts_with(&e.tokens) && e.handle.others() == 0
            })
            .map(|(id, _)| *id)
            .collect();
        for id in superseded {
            self.remove(id);
        }
        self.clock += 1;
        let id = self.next_id;
        self.next_id += 1;
        for k in chain.keys() {
            self.index.entry(*k).or_default().push(id);
        }
        let bytes = cache.device_bytes();
        let buffers = cache.buffer_bytes();
        self.resident += bytes;
        self.resident_buffers += buffers;
        self.entries.insert(
            id,
            Entry {
                chain,
                tokens,
                cache,
                bytes,
                buffers,
                used: self.clock,
                handle: ShareHandle::new(id),
            },
        );
        self.evict_to(self.budget, Some(id))
    }

    /// Reserves `bytes` for a live sequence, evicting resident sequences (least recently
    /// used first) to make room. Returns whether resident and live bytes fit the budget
    /// now (only sequences with live sharers can keep them from fitting once every other
    /// one is evicted; the caller's admission decides what to do when they do not; the
    /// bytes are reserved either way, and [`Self::release`] returns them).
    pub fn reserve(&mut self, bytes: u64) -> bool {
        self.live = self.live.saturating_add(bytes);
        self.evict_to(self.budget, None);
        self.resident + self.live <= self.budget
    }

    /// Returns a reservation made by [`Self::reserve`].
    pub fn release(&mut self, bytes: u64) {
        self.live = self.live.saturating_sub(bytes);
    }

    /// Evicts least recently used sequences until resident and live bytes fit `budget`,
    /// unpinned ones first. Then, after a park (`parked`: the new sequence) the new one
    /// goes rather than a pinned one; for a live reservation (`None`) pinned ones go too.
    /// A sequence with live sharers never goes (evicting a sharer may free its source).
    fn evict_to(&mut self, budget: u64, parked: Option<u64>) -> usize {
        let mut evicted = 0;
        while self.resident + self.live > budget {
            let lru = |pinned_too: bool| {
                self.entries
                    .iter()
                    .filter(|(_, e)| e.handle.others() == 0)
                    .filter(|(_, e)| pinned_too || !self.is_pinned(e))
                    .min_by_key(|(_, e)| e.used)
                    .map(|(id, _)| *id)
            };
            let victim = match (lru(false), parked) {
                (Some(id), _) => Some(id),
                (None, Some(new)) => Some(new).filter(|id| self.entries.contains_key(id)),
                (None, None) => lru(true),
            };
            let Some(id) = victim else {
                break;
            };
            if let Some(e) = self.remove(id) {
                self.stats.evictions += 1;
                self.stats.evicted_bytes += e.bytes;
                evicted += 1;
                if self.keep_evicted {
                    self.evicted.push(EvictedSequence {
                        chain: e.chain,
                        tokens: e.tokens,
                        cache: e.cache,
                    });
                }
            }
        }
        evicted
    }

    fn remove(&mut self, id: u64) -> Option<Entry> {
        let e = self.entries.remove(&id)?;
        for k in e.chain.keys() {
            if let Some(ids) = self.index.get_mut(k) {
                ids.retain(|i| *i != id);
                if ids.is_empty() {
                    self.index.remove(k);
                }
            }
        }
        self.resident -= e.bytes;
        self.resident_buffers -= e.buffers;
        Some(e)
    }
}
