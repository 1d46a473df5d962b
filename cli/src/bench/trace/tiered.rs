//! `--simulate --tiers DEVICE,RAM,SSD`: the trace through a model of kvstore's three tiers
//! as the engine and the store drive them, one request after another, to see where the
//! tiers' hits go and what each structural choice costs against one cache of their sum.
//!
//! What is modelled, and where it is in the code:
//! - **Host blocks** are the engine's (`--block-size`, 32 tokens): a trace block of `b`
//!   tokens is `b / block` of them, named by the trace block's chain and their index in
//!   it. Only full blocks are stored, so a prompt ending inside a block stores none of its
//!   tail. A sequence holds its prompt and all but the last of its completion tokens
//!   (the last one sampled is never fed back); its full blocks past the prompt hold reply
//!   tokens no later prompt has (the replay's model writes its own), so they take room and
//!   are never hit.
//! - **Device tier** (cache/src/resident.rs, `ResidentPool`): finished sequences kept
//!   whole, each costing its arena's capacity (the growth ladder from 16 blocks,
//!   `cache::ladder_capacity`), evicted least recently used, whole sequences at a time,
//!   when resident plus live bytes pass the budget; the request running reserves its own
//!   (one at a time here). A hit is the longest common token prefix with a resident
//!   sequence, at least one full block; a hit on all but a quarter of a sequence takes it
//!   out (a hand-over), any other refreshes it; a parked sequence drops those it extends.
//!   The store is asked only for the blocks after the device hit's last full block, so a
//!   device hit is no use of the RAM copies of its blocks.
//! - **Publication** (engine/src/reuse.rs `publish`, engine/src/export.rs): every full
//!   block after the restored ones is inserted into the store at once (inclusive: RAM holds
//!   copies of device blocks); `exclusive` instead inserts a sequence's blocks (those no
//!   host tier holds) when it leaves the device, evicted, as `--device-tier exclusive` does
//!   (the tail a hand-over cuts off is not exported).
//! - **RAM tier** (store/src/ram.rs `RamTier::insert`, store/src/store.rs `insert`): the
//!   store's [`ChainOrder`] under `--eviction`, as [`super::sim`]'s freq-admit column runs
//!   it; a block it refuses and every block it evicts is spilled.
//! - **Spills** (store/src/store.rs `spill`): stamped with the store's use clock as they
//!   leave; a block the SSD holds already is not written (its SSD copy keeps its place);
//!   the rest are written unless dropped: `drop_spills` drops a fixed share, or a
//!   [`WriterModel`] (`--writer`) queues them for a writer of a fixed rate and drops what
//!   arrives while its queue is full (store/src/queued_bytes.rs), from the request's
//!   arrival time on the trace's clock.
//! - **SSD tier** (store/src/ssd.rs): recency order by stamp, no gate, no chain rule (the
//!   order it keeps under `lru` and `freq-admit`; `lfu`'s counts are not modelled); a
//!   write older than every block it would displace is not admitted (never, for a spill
//!   stamped as it leaves). A re-published block it holds is made recent.
//! - **Loads** (store/src/store.rs `load_in_order`, `touch_chain`): the run of blocks RAM
//!   or the SSD holds after the device hit, in order: a RAM block is a use there; an SSD
//!   block is read and promoted into RAM (which may refuse it or evict for it, spilling);
//!   the load stops at a block neither holds by then. Then the loaded chain is refreshed in
//!   both tiers, root last, one stamp per block.
//!
//! A request's hit is the device hit, or, when the host tiers hold blocks after its last
//! full block, that block boundary plus the loaded blocks, each counted in the tier that
//! served it. Every cached block is restored (`--restore always`: no cost model), and a
//! prompt held whole counts every token, as the single-cache columns do (the engine
//! computes at least one).

use std::collections::{BTreeSet, HashMap};

use anyhow::{bail, Result};
use store::eviction::{ChainOrder, EvictionPolicy};
use store::UseClock;

use super::sim::{SimRequest, SimTrace};

/// Blocks a fresh arena holds (engine/src/reuse.rs, `initial_blocks`).
const INITIAL_ARENA_BLOCKS: usize = 16;

/// A hit on all but at most 1/`HANDOVER_TAIL` of a resident sequence takes it over
/// (cache/src/resident.rs).
const HANDOVER_TAIL: usize = 4;

/// Token budgets of the three tiers (`--tiers DEVICE,RAM,SSD`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TierBudgets {
    /// Device tier: resident sequences and the running request's reservation.
    pub device: u64,
    /// RAM tier.
    pub ram: u64,
    /// SSD tier.
    pub ssd: u64,
}

impl TierBudgets {
    /// Parses `DEVICE,RAM,SSD`, three token counts (0 for a tier left out).
    pub fn parse(s: &str) -> Result<TierBudgets, String> {
        let parts: Vec<&str> = s.split(',').map(str::trim).collect();
        let [d, r, ssd] = parts[..] else {
            return Err(format!(
                "`{s}`: give three token budgets, DEVICE,RAM,SSD (e.g. 364089,1118481,838861)"
            ));
        };
        let n = |x: &str| {
            x.replace('_', "")
                .parse::<u64>()
                .map_err(|e| format!("`{x}` in `{s}`: {e}"))
        };
        Ok(TierBudgets {
            device: n(d)?,
            ram: n(r)?,
            ssd: n(ssd)?,
        })
    }

    /// The three together.
    pub fn total(&self) -> u64 {
        self.device + self.ram + self.ssd
    }
}

/// How the tiers are run.
#[derive(Clone, Copy, Debug)]
pub struct TierModel {
    /// Tokens per host block (`--block-size`); must divide the trace's block.
    pub block: usize,
    /// The RAM tier's policy (`--eviction`).
    pub eviction: EvictionPolicy,
    /// Share of the spills to write that are dropped, evenly spread in runs of
    /// `drop_run`: run g (from 1) of consecutive spills is dropped when ⌊g·F⌋ grows.
    pub drop_spills: f64,
    /// Consecutive spills dropped together (a full queue drops what leaves RAM until the
    /// writer catches up, not one spill in four).
    pub drop_run: u64,
    /// The write-behind writer's rate and queue, in place of `drop_spills` when set.
    pub writer: Option<WriterModel>,
    /// Blocks reach RAM only when they leave the device tier.
    pub exclusive: bool,
    /// Most blocks an arena grows to (`ReuseConfig::max_blocks`).
    pub max_blocks: usize,
}

/// The write-behind worker as a queue drained at a fixed rate (`--writer
/// RATE,QUEUE[,PUBLISH]`): a spill enters if the queue has room for it (a block always fits
/// an empty queue) and is dropped otherwise; once a spill was dropped, spills are dropped
/// until the queue has drained to `resume` of its bound (`--writer-resume`, the store's
/// [`store::QUEUE_RESUME_SHARE`] by default; 1 resumes as soon as a block fits). Spills happen as blocks are published: all at a request's
/// arrival, or, with PUBLISH, one after another at that many blocks a second from it on
/// (the engine prefills one prompt after another), so a request's spills meet the
/// writer's progress as they do in a run.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct WriterModel {
    /// Host blocks the writer writes a second.
    pub blocks_per_s: f64,
    /// Host blocks the queue holds.
    pub queue_blocks: f64,
    /// Share of the bound the queue drains to before a full queue takes spills again.
    pub resume: f64,
    /// Host blocks the engine publishes a second, one after another (`None`: a request's
    /// blocks at its arrival).
    pub publish_per_s: Option<f64>,
}

impl WriterModel {
    /// Parses `RATE,QUEUE[,PUBLISH]` (host blocks a second, host blocks queued at most,
    /// host blocks published a second).
    pub fn parse(s: &str) -> Result<WriterModel, String> {
        let bad = || {
            format!(
                "`{s}`: give the writer's rate and queue in host blocks, and optionally the \
                 engine's publication rate, RATE,QUEUE[,PUBLISH] (e.g. 202,728,397)"
            )
        };
        let nums: Vec<f64> = s
            .split(',')
            .map(|x| x.trim().parse::<f64>().map_err(|_| bad()))
            .collect::<Result<_, _>>()?;
        let (rate, queue, publish) = match nums[..] {
            [r, q] => (r, q, None),
            [r, q, p] => (r, q, Some(p)),
            _ => return Err(bad()),
        };
        let positive = |x: f64| x > 0.0 && x.is_finite();
        if !(positive(rate) && queue >= 1.0 && queue.is_finite() && publish.is_none_or(positive)) {
            return Err(format!(
                "`{s}`: the writer needs a rate above 0, a queue of at least one block and a \
                 publication rate above 0"
            ));
        }
        Ok(WriterModel {
            blocks_per_s: rate,
            queue_blocks: queue,
            resume: store::QUEUE_RESUME_SHARE,
            publish_per_s: publish,
        })
    }
}

/// The [`WriterModel`]'s queue as a run goes.
#[derive(Clone, Copy, Debug)]
struct WriterQueue {
    model: WriterModel,
    /// Blocks queued at `at_s`.
    queued: f64,
    at_s: f64,
    /// Dropping until the queue has drained to `resume` of its bound.
    shedding: bool,
}

impl WriterQueue {
    fn new(model: WriterModel) -> Self {
        WriterQueue {
            model,
            queued: 0.0,
            at_s: 0.0,
            shedding: false,
        }
    }

    /// Whether a spill at `now_s` enters the queue (else it is dropped).
    fn takes(&mut self, now_s: f64) -> bool {
        let m = self.model;
        let drained = m.blocks_per_s * (now_s - self.at_s).max(0.0);
        self.queued = (self.queued - drained).max(0.0);
        self.at_s = self.at_s.max(now_s);
        if self.shedding && self.queued <= m.resume * m.queue_blocks {
            self.shedding = false;
        }
        if self.shedding || (self.queued > 0.0 && self.queued + 1.0 > m.queue_blocks) {
            self.shedding = true;
            return false;
        }
        self.queued += 1.0;
        true
    }
}

/// Counters of a tiered run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct TierCounters {
    /// Blocks inserted into the store by publication.
    pub published: u64,
    /// New blocks RAM's policy refused.
    pub ram_refused: u64,
    /// Blocks that left RAM, refused ones included (the store's `ram_evictions`).
    pub ram_evictions: u64,
    /// Blocks that left RAM while the SSD held them (not written again).
    pub spills_on_ssd: u64,
    /// Spills to write that were dropped.
    pub spills_dropped: u64,
    /// Spills written to the SSD.
    pub ssd_written: u64,
    /// Blocks the SSD evicted.
    pub ssd_evictions: u64,
    /// Blocks read from the SSD and promoted into RAM.
    pub promotions: u64,
    /// Sequences the device tier evicted.
    pub device_evictions: u64,
    /// Device hits that took the sequence over.
    pub handovers: u64,
}

/// A tiered run: each request's hit tokens by tier (device, RAM, SSD), and counters.
#[derive(Clone, Debug, Default)]
pub struct TieredRun {
    /// Hit tokens of each request: device, RAM, SSD.
    pub hits: Vec<[usize; 3]>,
    /// What happened on the way.
    pub counters: TierCounters,
}

impl TieredRun {
    /// Hit tokens of every request together, by tier.
    pub fn totals(&self) -> [usize; 3] {
        self.hits.iter().fold([0; 3], |mut a, h| {
            for (x, y) in a.iter_mut().zip(h) {
                *x += y;
            }
            a
        })
    }
}

type Id = u64;

/// Host block `k` of the trace block named `chain`.
fn block_id(chain: u32, k: usize) -> Id {
    (u64::from(chain) << 20) | k as u64
}

/// Reply blocks are numbered apart from trace blocks.
const REPLY: Id = 1 << 63;

/// A sequence's full host blocks: its prompt's, then those holding reply tokens.
struct Sequence {
    blocks: Vec<Id>,
    /// How many of `blocks` are the prompt's.
    prompt_blocks: usize,
    /// Tokens held (prompt and completion but its last token).
    held: usize,
}

/// A resident sequence of the device tier.
struct Resident {
    /// The request whose prompt it starts with.
    req: usize,
    seq: Sequence,
    /// Tokens of device budget its arenas take.
    cost: u64,
    used: u64,
}

/// The tokens `a`'s prompt shares with the sequence `e` holds (request `e`'s prompt, then
/// reply tokens no prompt has).
fn common_tokens(t: &SimTrace, a: &SimRequest, e: &SimRequest) -> usize {
    let mut m = 0;
    for (i, (x, y)) in a.chain.iter().zip(&e.chain).enumerate() {
        if x != y {
            break;
        }
        let (fa, fe) = (t.tokens_in(a, i), t.tokens_in(e, i));
        m += fa.min(fe);
        if fa < t.block || fe < t.block {
            break;
        }
    }
    m
}

/// The SSD tier's order: least recent stamp first (ties: the earlier write or touch).
#[derive(Default)]
struct Ssd {
    capacity: usize,
    order: BTreeSet<(u64, u64, Id)>,
    at: HashMap<Id, (u64, u64)>,
    tie: u64,
}

impl Ssd {
    fn contains(&self, id: Id) -> bool {
        self.at.contains_key(&id)
    }

    /// `SsdTier::touch_at`: at least as recent as `stamp`.
    fn touch_at(&mut self, id: Id, stamp: u64) {
        let Some(&(s, tie)) = self.at.get(&id) else {
            return;
        };
        if s > stamp {
            return;
        }
        self.order.remove(&(s, tie, id));
        self.tie += 1;
        self.order.insert((stamp, self.tie, id));
        self.at.insert(id, (stamp, self.tie));
    }

    /// `SsdTier::put_at` of a block not held: evicts older blocks for it; returns whether
    /// it was written and how many left.
    fn put_at(&mut self, id: Id, stamp: u64) -> (bool, u64) {
        let mut evicted = 0;
        while self.at.len() >= self.capacity {
            let Some(&(s, tie, v)) = self.order.first() else {
                break;
            };
            if s > stamp {
                break;
            }
            self.order.remove(&(s, tie, v));
            self.at.remove(&v);
            evicted += 1;
        }
        if self.at.len() >= self.capacity {
            return (false, evicted);
        }
        self.tie += 1;
        self.order.insert((stamp, self.tie, id));
        self.at.insert(id, (stamp, self.tie));
        (true, evicted)
    }
}

/// The three tiers and the store's use clock.
struct Tiers<'a> {
    t: &'a SimTrace,
    model: TierModel,
    clock: UseClock,
    ram: ChainOrder<Id>,
    ram_capacity: usize,
    ssd: Ssd,
    device_budget: u64,
    resident: HashMap<u64, Resident>,
    resident_cost: u64,
    live: u64,
    device_clock: u64,
    next_resident: u64,
    next_reply: Id,
    /// Spills that were to be written so far (for the drops).
    spills_to_write: u64,
    /// The writer's queue, when modelled.
    writer: Option<WriterQueue>,
    /// The arrival of the request being replayed, or the time of the block it publishes
    /// (trace seconds).
    now_s: f64,
    /// When the engine published its last block (`WriterModel::publish_per_s`).
    published_at_s: f64,
    c: TierCounters,
}

impl Tiers<'_> {
    /// Tokens of device budget a sequence of `tokens` takes: its arena's capacity.
    fn cost(&self, tokens: usize) -> u64 {
        let bs = self.model.block;
        let cap = cache::ladder_capacity(
            INITIAL_ARENA_BLOCKS,
            self.model.max_blocks,
            bs,
            tokens.div_ceil(bs),
        );
        (cap * bs) as u64
    }

    /// Request `j`'s sequence: its prompt's full blocks, then reply blocks of its own.
    fn sequence(&mut self, j: usize) -> Sequence {
        let (t, bs) = (self.t, self.model.block);
        let r = &t.requests[j];
        let mut blocks = Vec::new();
        for (i, &c) in r.chain.iter().enumerate() {
            let fill = t.tokens_in(r, i);
            blocks.extend((0..fill / bs).map(|k| block_id(c, k)));
            if fill < t.block {
                break;
            }
        }
        let prompt_blocks = blocks.len();
        let held = r.len + r.out.max(1) - 1;
        for _ in prompt_blocks..held / bs {
            blocks.push(self.next_reply);
            self.next_reply += 1;
        }
        Sequence {
            blocks,
            prompt_blocks,
            held,
        }
    }

    /// `RamTier::insert` of block `id` (child of `parent`): what leaves, in order.
    fn ram_insert(&mut self, id: Id, parent: Option<Id>) -> Vec<Id> {
        let cap = self.ram_capacity as u64;
        if cap == 0 {
            self.clock.tick();
            return vec![id];
        }
        if self.ram.contains(id) {
            self.ram.used(id, cap);
            return Vec::new();
        }
        let u = self.ram.used(id, cap);
        if self.ram.len() >= self.ram_capacity && !self.ram.admits(u, cap, |_| false) {
            self.c.ram_refused += 1;
            self.clock.tick();
            return vec![id];
        }
        self.ram.insert(id, parent, u);
        let mut out = Vec::new();
        while self.ram.len() > self.ram_capacity {
            let victim = self.ram.victim(Some(id), |_| false);
            let v = victim.unwrap_or(id);
            self.ram.remove(v);
            out.push(v);
            if victim.is_none() {
                break;
            }
        }
        out
    }

    /// `Store::spill`.
    fn spill(&mut self, left: Vec<Id>) {
        for id in left {
            let stamp = self.clock.tick();
            self.c.ram_evictions += 1;
            if self.ssd.contains(id) {
                self.c.spills_on_ssd += 1;
                continue;
            }
            if self.ssd.capacity == 0 {
                continue;
            }
            let dropped = if let Some(w) = &mut self.writer {
                !w.takes(self.now_s)
            } else {
                let n = self.spills_to_write / self.model.drop_run;
                self.spills_to_write += 1;
                let f = self.model.drop_spills;
                ((n + 1) as f64 * f).floor() > (n as f64 * f).floor()
            };
            if dropped {
                self.c.spills_dropped += 1;
                continue;
            }
            let (written, evicted) = self.ssd.put_at(id, stamp);
            self.c.ssd_evictions += evicted;
            self.c.ssd_written += u64::from(written);
        }
    }

    /// `Store::insert` of a published block.
    fn publish(&mut self, id: Id, parent: Option<Id>) {
        self.c.published += 1;
        if let Some(rate) = self.model.writer.and_then(|w| w.publish_per_s) {
            self.now_s = self.now_s.max(self.published_at_s) + 1.0 / rate;
            self.published_at_s = self.now_s;
        }
        let left = self.ram_insert(id, parent);
        if self.ssd.contains(id) {
            // Re-published while stored: the SSD copy is recent again.
            let stamp = self.clock.tick();
            self.ssd.touch_at(id, stamp);
        }
        let displaced = !left.is_empty();
        self.spill(left);
        if displaced {
            let stamp = self.clock.tick();
            self.ram.touch_at(id, stamp);
        }
    }

    /// Publishes `seq.blocks[from..]` that no host tier holds (exclusive device tier).
    fn publish_missing(&mut self, seq: &Sequence, from: usize) {
        for i in from..seq.blocks.len() {
            let id = seq.blocks[i];
            if !self.ram.contains(id) && !self.ssd.contains(id) {
                self.publish(id, i.checked_sub(1).map(|p| seq.blocks[p]));
            }
        }
    }

    /// `Store::load_prefix` of `blocks[first..]`: hit blocks in RAM and on SSD.
    fn load(&mut self, blocks: &[Id], first: usize) -> (usize, usize) {
        let cap = self.ram_capacity as u64;
        let (mut ram, mut ssd) = (0, 0);
        let mut end = first;
        for i in first..blocks.len() {
            let id = blocks[i];
            if self.ram.contains(id) {
                self.ram.used(id, cap);
                ram += 1;
            } else if self.ssd.contains(id) {
                let left = self.ram_insert(id, i.checked_sub(1).map(|p| blocks[p]));
                self.c.promotions += 1;
                self.spill(left);
                ssd += 1;
            } else {
                break;
            }
            end = i + 1;
        }
        for &id in blocks[first..end].iter().rev() {
            let stamp = self.clock.tick();
            self.ram.touch_at(id, stamp);
            self.ssd.touch_at(id, stamp);
        }
        (ram, ssd)
    }

    /// `ResidentPool::take`: the device hit of request `j` in tokens.
    fn device_take(&mut self, j: usize) -> usize {
        let t = self.t;
        let r = &t.requests[j];
        let best = self
            .resident
            .iter()
            .map(|(&id, e)| (id, common_tokens(t, r, &t.requests[e.req]), e.used))
            .filter(|&(_, m, _)| m >= self.model.block)
            .max_by_key(|&(_, m, used)| (m, used));
        let Some((id, m, _)) = best else {
            return 0;
        };
        self.device_clock += 1;
        let held = self.resident[&id].seq.held;
        if (held - m) * HANDOVER_TAIL <= held {
            self.c.handovers += 1;
            // The tail cut off stays unexported, as the engine leaves it
            // (`DeviceTier::Exclusive`): it is the reply the next turn re-rendered.
            self.device_remove(id);
        } else if let Some(e) = self.resident.get_mut(&id) {
            e.used = self.device_clock;
        }
        m
    }

    fn device_remove(&mut self, id: u64) -> Option<Resident> {
        let e = self.resident.remove(&id)?;
        self.resident_cost -= e.cost;
        Some(e)
    }

    /// `ResidentPool::evict_to`: least recently used sequences leave until resident and
    /// live fit; `parked` goes last.
    fn device_evict(&mut self) {
        while self.resident_cost + self.live > self.device_budget {
            let Some(id) = self
                .resident
                .iter()
                .min_by_key(|(_, e)| e.used)
                .map(|(id, _)| *id)
            else {
                break;
            };
            if let Some(e) = self.device_remove(id) {
                self.c.device_evictions += 1;
                if self.model.exclusive {
                    self.publish_missing(&e.seq, 0);
                }
            }
        }
    }

    /// `ResidentPool::park` of request `j`'s finished sequence.
    fn device_park(&mut self, j: usize, seq: Sequence, cost: u64) {
        let t = self.t;
        let r = &t.requests[j];
        let superseded: Vec<u64> = self
            .resident
            .iter()
            .filter(|(_, e)| {
                let p = &t.requests[e.req];
                e.seq.held == p.len && common_tokens(t, r, p) >= p.len
            })
            .map(|(id, _)| *id)
            .collect();
        for id in superseded {
            self.device_remove(id);
        }
        self.device_clock += 1;
        let id = self.next_resident;
        self.next_resident += 1;
        self.resident_cost += cost;
        self.resident.insert(
            id,
            Resident {
                req: j,
                seq,
                cost,
                used: self.device_clock,
            },
        );
        self.device_evict();
    }

    /// One request: device hit, loads after it, publication, the sequence parked.
    fn request(&mut self, j: usize) -> [usize; 3] {
        let bs = self.model.block;
        self.now_s = self.t.requests[j].at_s;
        let seq = self.sequence(j);
        let m = if self.device_budget > 0 {
            self.device_take(j)
        } else {
            0
        };
        let first = (m / bs).min(seq.prompt_blocks);
        let (ram, ssd) = self.load(&seq.blocks[..seq.prompt_blocks], first);
        let hit = if ram + ssd > 0 {
            [first * bs, ram * bs, ssd * bs]
        } else {
            [m, 0, 0]
        };
        let cost = self.cost(seq.held);
        let device = self.device_budget > 0;
        if device {
            self.live = cost;
            self.device_evict();
        }
        if !self.model.exclusive || !device {
            let from = first + ram + ssd;
            for i in from..seq.blocks.len() {
                let parent = i.checked_sub(1).map(|p| seq.blocks[p]);
                self.publish(seq.blocks[i], parent);
            }
        }
        if device {
            self.live = 0;
            self.device_park(j, seq, cost);
        }
        hit
    }
}

/// The settings [`simulate_tiers`] can run.
fn validate(t: &SimTrace, model: &TierModel) -> Result<()> {
    let bs = model.block;
    if bs == 0 || !t.block.is_multiple_of(bs) {
        bail!(
            "--tiers needs host blocks (--block-size {bs}) that divide the trace's blocks \
             ({} tokens at this --token-scale)",
            t.block
        );
    }
    if model.drop_run == 0 {
        bail!("--drop-run must be at least 1");
    }
    if let Some(w) = model.writer {
        if !(0.0..=1.0).contains(&w.resume) {
            bail!(
                "--writer-resume must be a share of the queue from 0 to 1, not {}",
                w.resume
            );
        }
    }
    if !(0.0..=1.0).contains(&model.drop_spills) {
        bail!(
            "--drop-spills must be a share from 0 to 1, not {}",
            model.drop_spills
        );
    }
    Ok(())
}

/// Replays `t` through the tiers at `budgets` (tokens) under `model`.
pub fn simulate_tiers(t: &SimTrace, budgets: TierBudgets, model: TierModel) -> Result<TieredRun> {
    validate(t, &model)?;
    let bs = model.block;
    let clock = UseClock::default();
    let blocks = |tokens: u64| usize::try_from(tokens / bs as u64).unwrap_or(usize::MAX);
    let mut tiers = Tiers {
        t,
        model,
        ram: ChainOrder::with_clock(model.eviction, clock.clone()),
        clock,
        ram_capacity: blocks(budgets.ram),
        ssd: Ssd {
            capacity: blocks(budgets.ssd),
            ..Ssd::default()
        },
        device_budget: budgets.device,
        resident: HashMap::new(),
        resident_cost: 0,
        live: 0,
        device_clock: 0,
        next_resident: 0,
        next_reply: REPLY,
        spills_to_write: 0,
        writer: model.writer.map(WriterQueue::new),
        now_s: 0.0,
        published_at_s: 0.0,
        c: TierCounters::default(),
    };
    let hits = (0..t.requests.len()).map(|j| tiers.request(j)).collect();
    Ok(TieredRun {
        hits,
        counters: tiers.c,
    })
}

/// Prints each `--tiers` row (hit share in total and by tier, beside an LRU and a
/// freq-admit cache of the three budgets' sum, and what the tiers did) and returns the
/// rows as JSON.
pub fn report(t: &SimTrace, rows: &[TierBudgets], model: TierModel) -> Result<serde_json::Value> {
    validate(t, &model)?;
    let total = t.prompt_tokens() as f64;
    let pct = |tokens: usize| 100.0 * tokens as f64 / total;
    let one_cache = |policy, tokens: u64| {
        let blocks = usize::try_from(tokens / t.block as u64).unwrap_or(usize::MAX);
        pct(super::sim::simulate(t, policy, blocks).iter().sum())
    };
    let drops = match model.writer {
        Some(w) => format!(
            "spills queued for a writer of {} blocks/s, {} blocks queued at most, resuming at \
             {:.0} % after a drop, {}",
            w.blocks_per_s,
            w.queue_blocks,
            100.0 * w.resume,
            match w.publish_per_s {
                Some(p) => format!("blocks published at {p}/s"),
                None => "a request's blocks published at its arrival".into(),
            }
        ),
        None => format!(
            "{:.1} % of spills dropped in runs of {}",
            100.0 * model.drop_spills,
            model.drop_run
        ),
    };
    println!(
        "tiers: blocks of {} tokens, RAM under {}, device tier {}, {drops} (% of prompt \
         tokens hit)",
        model.block,
        model.eviction,
        if model.exclusive {
            "exclusive (blocks reach RAM when they leave it)"
        } else {
            "inclusive (every published block goes to RAM at once)"
        },
    );
    println!(
        "{:>26} {:>7} {:>7} {:>7} {:>7} | {:>8} {:>10} | {:>8} {:>8} {:>8} {:>8} {:>8} {:>8}",
        "device,RAM,SSD tokens",
        "total",
        "device",
        "RAM",
        "SSD",
        "sum lru",
        "freq-admit",
        "refused",
        "spilled",
        "dropped",
        "written",
        "SSD evic",
        "dev evic"
    );
    let mut out = Vec::new();
    for &b in rows {
        let run = simulate_tiers(t, b, model)?;
        let [d, r, s] = run.totals();
        let (lru, fa) = (
            one_cache(super::sim::Policy::Lru, b.total()),
            one_cache(super::sim::Policy::FreqAdmit, b.total()),
        );
        let c = run.counters;
        println!(
            "{:>26} {:>7.2} {:>7.2} {:>7.2} {:>7.2} | {:>8.2} {:>10.2} | {:>8} {:>8} {:>8} {:>8} {:>8} {:>8}",
            format!("{},{},{}", b.device, b.ram, b.ssd),
            pct(d + r + s),
            pct(d),
            pct(r),
            pct(s),
            lru,
            fa,
            c.ram_refused,
            c.ram_evictions,
            c.spills_dropped,
            c.ssd_written,
            c.ssd_evictions,
            c.device_evictions
        );
        out.push(serde_json::json!({
            "device_tokens": b.device,
            "ram_tokens": b.ram,
            "ssd_tokens": b.ssd,
            "hit": (d + r + s) as f64 / total,
            "device": d as f64 / total,
            "ram": r as f64 / total,
            "ssd": s as f64 / total,
            "sum_lru": lru / 100.0,
            "sum_freq_admit": fa / 100.0,
            "counters": c,
        }));
    }
    Ok(serde_json::json!({
        "block_tokens": model.block,
        "eviction": model.eviction.name(),
        "drop_spills": model.drop_spills,
        "drop_run": model.drop_run,
        "writer": model.writer,
        "device_exclusive": model.exclusive,
        "rows": out,
    }))
}

#[cfg(test)]
mod tests {
    use super::super::scale::TokenScale;
    use super::super::sim::{self, Policy};
    use super::super::tier_tests::{conversations, requests};
    use super::*;

    /// Requests of whole 1-token blocks with 1 completion token (`--token-scale 1/512`):
    /// a sequence holds its prompt and nothing more.
    fn trace(reqs: &[&[u64]]) -> SimTrace {
        let scale = TokenScale::new(1.0 / 512.0).unwrap();
        let ids: Vec<Vec<u64>> = reqs.iter().map(|r| r.to_vec()).collect();
        let t = SimTrace::new(&requests(&ids), &scale);
        assert_eq!(t.block, 1);
        t
    }

    fn model(eviction: EvictionPolicy) -> TierModel {
        TierModel {
            block: 1,
            eviction,
            drop_spills: 0.0,
            drop_run: 1,
            writer: None,
            exclusive: false,
            max_blocks: 8192,
        }
    }

    /// A=1, B=2, C=3, X=9; blocks of 1 token; a device tier of 16 tokens (one arena of 16
    /// blocks: one sequence), RAM and SSD of 2 blocks each, RAM under LRU.
    ///   r0 [A B]: nothing. A, B published to RAM; r0 parked on the device.
    ///   r1 [X]: nothing. Its reservation evicts r0. X enters RAM, which evicts B (A has a
    ///     child): B is written to the SSD.
    ///   r2 [A B]: A from RAM (1); B from the SSD (1), promoted: RAM evicts X, the SSD
    ///     writes it. r1 is evicted from the device, r2 parked.
    ///   r3 [A B C]: r2 on the device holds A B: handed over (2). C enters RAM, but A B C is
    ///     one chain and RAM holds 2: C leaves at once; the SSD evicts X (older than B,
    ///     which r2's load refreshed) to write it.
    ///   r4 [X]: in no tier (0). X enters RAM, evicting B, which the SSD holds (not
    ///     written again).
    ///   r5 [A B C]: A from RAM (1), B and C from the SSD (2). B's promotion evicts X from
    ///     RAM; the SSD writes it in place of B (older than C); C's promotion evicts C.
    #[test]
    fn three_tiers_by_hand() {
        let t = trace(&[&[1, 2], &[9], &[1, 2], &[1, 2, 3], &[9], &[1, 2, 3]]);
        let b = TierBudgets {
            device: 16,
            ram: 2,
            ssd: 2,
        };
        let run = simulate_tiers(&t, b, model(EvictionPolicy::Lru)).unwrap();
        assert_eq!(
            run.hits,
            vec![
                [0, 0, 0],
                [0, 0, 0],
                [0, 1, 1],
                [2, 0, 0],
                [0, 0, 0],
                [0, 1, 2]
            ]
        );
        assert_eq!(
            run.counters,
            TierCounters {
                published: 5,
                ram_refused: 0,
                ram_evictions: 6,
                spills_on_ssd: 2,
                spills_dropped: 0,
                ssd_written: 4,
                ssd_evictions: 2,
                promotions: 3,
                device_evictions: 4,
                handovers: 1,
            }
        );
        // Every spill dropped: the SSD never serves.
        let all = TierModel {
            drop_spills: 1.0,
            ..model(EvictionPolicy::Lru)
        };
        let run = simulate_tiers(&t, b, all).unwrap();
        assert_eq!(run.totals()[2], 0);
        assert_eq!(run.counters.ssd_written, 0);
        assert_eq!(run.hits[2], [0, 1, 0]);
        // Exclusive: r0's A B reach RAM only when r1 evicts r0, and r1's X never does
        // before r2, so r2 finds both in RAM.
        let exclusive = TierModel {
            exclusive: true,
            ..model(EvictionPolicy::Lru)
        };
        let run = simulate_tiers(&t, b, exclusive).unwrap();
        assert_eq!(run.hits[..3], [[0, 0, 0], [0, 0, 0], [0, 2, 0]]);
    }

    /// Half the spills dropped in runs of 2: runs 2, 4, … (from 1) are dropped (⌊g / 2⌋
    /// grows at g = 2, 4, …), so of spills 1-8 the 3rd, 4th, 7th and 8th.
    #[test]
    fn drops_are_evenly_spread_runs() {
        // Eight one-block prompts through a RAM of 1 block and a large SSD: each new one
        // spills the previous one; then all eight again.
        let ids: Vec<[u64; 1]> = (1..=9).map(|i| [i]).collect();
        let mut reqs: Vec<&[u64]> = ids.iter().map(|b| &b[..]).collect();
        reqs.extend(ids[..8].iter().map(|b| &b[..]));
        let t = trace(&reqs);
        let b = TierBudgets {
            device: 0,
            ram: 1,
            ssd: 100,
        };
        let m = TierModel {
            drop_spills: 0.5,
            drop_run: 2,
            ..model(EvictionPolicy::Lru)
        };
        let run = simulate_tiers(&t, b, m).unwrap();
        // Blocks 1-8 were spilled in order by 2-9; 3, 4, 7, 8 were dropped.
        let ssd: Vec<usize> = run.hits[9..].iter().map(|h| h[2]).collect();
        assert_eq!(ssd, vec![1, 1, 0, 0, 1, 1, 0, 0]);
    }

    /// Freq-admit's refusals go to the SSD, which serves them. RAM of 2 blocks, SSD of 1,
    /// requests A, B, C, A, B, C of one block each: C (used once, like A and B, which sat
    /// idle for 2 uses, not more than the 2 blocks RAM holds) is refused and written to
    /// the SSD; A and B hit in RAM; C hits on the SSD, and its promotion is refused again
    /// (A, its victim, used twice as C now, was used 2 uses ago). One cache of 2 blocks
    /// misses C (`sim`'s loop test).
    #[test]
    fn a_block_freq_admit_refuses_is_served_by_the_ssd() {
        let t = trace(&[&[1], &[2], &[3], &[1], &[2], &[3]]);
        let b = TierBudgets {
            device: 0,
            ram: 2,
            ssd: 1,
        };
        let run = simulate_tiers(&t, b, model(EvictionPolicy::FreqAdmit)).unwrap();
        assert_eq!(
            run.hits,
            vec![
                [0, 0, 0],
                [0, 0, 0],
                [0, 0, 0],
                [0, 1, 0],
                [0, 1, 0],
                [0, 0, 1]
            ]
        );
        assert_eq!(run.counters.ram_refused, 2);
        assert_eq!(run.counters.ssd_written, 1);
        assert_eq!(run.counters.spills_on_ssd, 1);
        assert_eq!(
            sim::simulate(&t, Policy::FreqAdmit, 2),
            vec![0, 0, 0, 1, 1, 0]
        );
    }

    /// With no device tier and no SSD, the tiers are the RAM tier alone: the single-cache
    /// simulation of its policy, request by request.
    #[test]
    fn ram_alone_is_the_single_cache_simulation() {
        let reqs = conversations(1500, 10, 0x5eed);
        let refs: Vec<&[u64]> = reqs.iter().map(Vec::as_slice).collect();
        let t = trace(&refs);
        let ideal: usize = sim::ideal(&t).iter().sum();
        for capacity in [12, 24, 48, 96] {
            for (p, policy) in [
                (EvictionPolicy::FreqAdmit, Policy::FreqAdmit),
                (EvictionPolicy::Lfu, Policy::Lfu),
                (EvictionPolicy::Lru, Policy::LruLeaf),
            ] {
                let b = TierBudgets {
                    device: 0,
                    ram: capacity as u64,
                    ssd: 0,
                };
                let run = simulate_tiers(&t, b, model(p)).unwrap();
                let ram: Vec<usize> = run.hits.iter().map(|h| h[1]).collect();
                let want = sim::simulate(&t, policy, capacity);
                assert_eq!(ram, want, "{p} at {capacity}");
                assert_eq!(run.totals()[0] + run.totals()[2], 0);
                let hits: usize = ram.iter().sum();
                assert!(hits > 0 && hits < ideal, "{p} at {capacity}: {hits}");
            }
        }
    }

    #[test]
    fn settings_it_cannot_run_are_refused() {
        let t = trace(&[&[1, 2]]);
        let b = TierBudgets {
            device: 0,
            ram: 2,
            ssd: 0,
        };
        let ok = model(EvictionPolicy::Lru);
        assert!(simulate_tiers(&t, b, ok).is_ok());
        for bad in [
            TierModel { block: 2, ..ok },
            TierModel { block: 0, ..ok },
            TierModel { drop_run: 0, ..ok },
            TierModel {
                drop_spills: 1.5,
                ..ok
            },
            TierModel {
                writer: Some(WriterModel {
                    resume: 1.5,
                    ..WriterModel::parse("1,4").unwrap()
                }),
                ..ok
            },
        ] {
            assert!(simulate_tiers(&t, b, bad).is_err(), "{bad:?}");
        }
    }

    /// A writer of 1 block/s with a queue of 4: five spills at t=0 fill it and drop the
    /// fifth. At t=1 (3 queued) a writer that resumes as soon as a block fits takes the
    /// next one; one that resumes at half the queue drops it, and takes one at t=2 (2
    /// queued). At t=10 both queues are empty and take four more.
    #[test]
    fn the_writer_queue_drops_while_full_and_resumes_at_its_mark() {
        let half = WriterModel::parse("1,4").unwrap();
        let eager = WriterModel {
            resume: 1.0,
            ..half
        };
        let takes = |m: WriterModel, times: &[f64]| -> Vec<bool> {
            let mut q = WriterQueue::new(m);
            times.iter().map(|&t| q.takes(t)).collect()
        };
        let times = [
            0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 2.0, 10.0, 10.0, 10.0, 10.0, 10.0,
        ];
        let (y, n) = (true, false);
        assert_eq!(
            takes(eager, &times),
            vec![y, y, y, y, n, y, y, y, y, y, y, n]
        );
        assert_eq!(
            takes(half, &times),
            vec![y, y, y, y, n, n, y, y, y, y, y, n]
        );
        // A block always fits an empty queue, even one of less than a block.
        let tiny = WriterModel {
            queue_blocks: 0.5,
            ..eager
        };
        assert_eq!(takes(tiny, &[0.0, 0.0, 1.0]), vec![y, n, y]);
        assert!(WriterModel::parse("0,4").is_err());
        assert!(WriterModel::parse("5").is_err());
        assert!(WriterModel::parse("5,0").is_err());
        assert!(WriterModel::parse("5,4,0").is_err());
        assert!(WriterModel::parse("5,4,6,7").is_err());
        assert_eq!(
            WriterModel::parse("5, 4, 6").unwrap().publish_per_s,
            Some(6.0)
        );
    }

    /// Spills through a modelled writer in a replay: one-block prompts one second apart
    /// through a RAM of 1 block, each spilling the one before, against a writer of 0.5
    /// blocks/s with a queue of 1: every other spill is dropped, so every other block
    /// hits on the SSD when the prompts come again.
    #[test]
    fn a_writer_slower_than_the_spills_drops_them() {
        let ids: Vec<Vec<u64>> = (1..=9).map(|i| vec![i]).collect();
        let mut reqs = requests(&ids);
        reqs.extend(requests(&ids[..8]));
        for (i, r) in reqs.iter_mut().enumerate() {
            r.timestamp = 1000 * i as u64;
        }
        let scale = TokenScale::new(1.0 / 512.0).unwrap();
        let t = SimTrace::new(&reqs, &scale);
        let b = TierBudgets {
            device: 0,
            ram: 1,
            ssd: 100,
        };
        let m = TierModel {
            writer: Some(WriterModel::parse("0.5,1").unwrap()),
            ..model(EvictionPolicy::Lru)
        };
        let run = simulate_tiers(&t, b, m).unwrap();
        // Block 1 spilled at t=1 (queued), 2 at t=2 (half a block still queued: dropped),
        // 3 at t=3 (drained: queued), and so on.
        let ssd: Vec<usize> = run.hits[9..].iter().map(|h| h[2]).collect();
        assert_eq!(ssd, vec![1, 0, 1, 0, 1, 0, 1, 0]);
        // When the prompts come again the writer has room: only blocks 2, 4, 6, 8 were lost.
        assert_eq!(run.counters.spills_dropped, 4);
    }

    /// One prompt of four chained blocks through a RAM of one block: blocks 2-4 leave as
    /// they are published (RAM keeps the root: it has a child). A writer of 1 block/s with
    /// a queue of 1 takes the first spill and drops the other two when all are published
    /// at the arrival; published one a second, each spill finds the queue drained.
    #[test]
    fn spills_meet_the_writer_as_the_engine_publishes() {
        let t = trace(&[&[1, 2, 3, 4]]);
        let b = TierBudgets {
            device: 0,
            ram: 1,
            ssd: 100,
        };
        let dropped = |w: &str| {
            let m = TierModel {
                writer: Some(WriterModel::parse(w).unwrap()),
                ..model(EvictionPolicy::Lru)
            };
            let c = simulate_tiers(&t, b, m).unwrap().counters;
            (c.ssd_written, c.spills_dropped)
        };
        assert_eq!(dropped("1,1"), (1, 2));
        assert_eq!(dropped("1,1,1"), (3, 0));
    }

    #[test]
    fn budgets_parse() {
        assert_eq!(
            TierBudgets::parse("364089,1118481,838861"),
            Ok(TierBudgets {
                device: 364_089,
                ram: 1_118_481,
                ssd: 838_861
            })
        );
        assert_eq!(TierBudgets::parse(" 0, 2_000 ,0").unwrap().total(), 2000);
        assert!(TierBudgets::parse("1,2").is_err());
        assert!(TierBudgets::parse("1,x,2").is_err());
    }
}
