//! The graph census: how many nodes (MLX primitives) each engine step hands to the device.
//!
//! On a GPU a step is bound by the host launching its kernels (docs/benchmarks.md,
//! "Where an engine step's time goes under the trace"): its cost is the number of nodes
//! times MLX's per-node launch cost, so the node count is the figure to lower. The census
//! is off unless `KVSTORE_GRAPH_CENSUS=1`; then every step's graph (decode-only, a decode
//! pass carrying prefill chunks, a prefill pass of its own) is walked before it is queued
//! (host time: do not time a run that takes it) and tallied per process by the step's
//! kind and shape and by primitive. `kvstore bench generate|serve|trace` print the tally.

use std::collections::BTreeMap;
use std::sync::{Mutex, OnceLock};

/// The variable that turns the census on (`1`).
pub const GRAPH_CENSUS_VAR: &str = "KVSTORE_GRAPH_CENSUS";

/// What a counted step ran: its kind, the rows it decoded and the prompts whose chunks it
/// carried. Ordered decode-only first, then by rows and prompts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct StepShape {
    /// Rows decoded (0 in a prefill pass of its own).
    pub rows: usize,
    /// Prompts whose prefill chunks ran in the step (0 in a decode-only step).
    pub prompts: usize,
}

impl std::fmt::Display for StepShape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.rows, self.prompts) {
            (rows, 0) => write!(f, "{rows} row(s)"),
            (0, prompts) => write!(f, "prefill pass of {prompts} prompt(s)"),
            (rows, prompts) => write!(f, "{rows} row(s) + {prompts} prompt chunk(s)"),
        }
    }
}

/// The steps of one [`StepShape`]: how many, and their nodes by primitive.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepCensus {
    /// Steps counted.
    pub steps: u64,
    /// Nodes of those steps by MLX primitive name, summed.
    pub nodes: BTreeMap<String, u64>,
    /// Small computed inputs those steps read ([`mlx::pending_small_leaves`]), summed:
    /// mostly constants the host made for the step, which a CUDA device reads from managed
    /// memory.
    pub small_leaves: u64,
}

impl StepCensus {
    /// Nodes per step, on average.
    pub fn nodes_per_step(&self) -> f64 {
        let total: u64 = self.nodes.values().sum();
        total as f64 / self.steps.max(1) as f64
    }

    /// The `n` primitives with the most nodes per step, most first (ties by name).
    pub fn top(&self, n: usize) -> Vec<(String, f64)> {
        let mut v: Vec<(String, f64)> = self
            .nodes
            .iter()
            .map(|(k, &c)| (k.clone(), c as f64 / self.steps.max(1) as f64))
            .collect();
        v.sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        v.truncate(n);
        v
    }
}

static TALLY: Mutex<BTreeMap<StepShape, StepCensus>> = Mutex::new(BTreeMap::new());

/// Whether the census is on for this process (`KVSTORE_GRAPH_CENSUS=1`, read once).
pub fn graph_census_enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var(GRAPH_CENSUS_VAR).is_ok_and(|v| v.trim() == "1"))
}

/// Counts the pending nodes of a step of `shape` whose outputs are `arrays`, when the
/// census is on.
pub(crate) fn count_step(shape: StepShape, arrays: &[mlx::Array]) -> crate::Result<()> {
    if !graph_census_enabled() {
        return Ok(());
    }
    let arrays: Vec<&mlx::Array> = arrays.iter().collect();
    let names = mlx::pending_primitives(&arrays)?;
    record(shape, names, mlx::pending_small_leaves(&arrays)?);
    Ok(())
}

fn record(shape: StepShape, names: Vec<String>, small_leaves: usize) {
    let mut tally = TALLY.lock().unwrap_or_else(|e| e.into_inner());
    let c = tally.entry(shape).or_default();
    c.steps += 1;
    c.small_leaves += small_leaves as u64;
    for n in names {
        *c.nodes.entry(n).or_default() += 1;
    }
}

/// The census so far, by the shape of the steps (empty when it is off).
pub fn graph_census() -> BTreeMap<StepShape, StepCensus> {
    TALLY.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// The census as lines for a report: per step shape, steps, nodes per step and every
/// primitive's nodes, most first (the rare ones are where a step's extra kernels hide:
/// session 37's 8B decode step on the H100). Empty when the census is off or counted
/// nothing.
pub fn graph_census_lines() -> Vec<String> {
    graph_census()
        .iter()
        .map(|(shape, c)| {
            let top: Vec<String> = c
                .top(usize::MAX)
                .iter()
                .map(|(n, per)| format!("{n} {per:.1}"))
                .collect();
            format!(
                "graph census, {shape}: {} steps, {:.1} nodes per step ({}); {:.1} small \
                 leaves per step",
                c.steps,
                c.nodes_per_step(),
                top.join(", "),
                c.small_leaves as f64 / c.steps.max(1) as f64
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_census_averages_per_step_and_ranks_primitives() {
        let mut c = StepCensus::default();
        for names in [vec!["Add", "Matmul", "Matmul"], vec!["Matmul", "Slice"]] {
            c.steps += 1;
            for n in names {
                *c.nodes.entry(n.to_string()).or_default() += 1;
            }
        }
        assert_eq!(c.nodes_per_step(), 2.5);
        assert_eq!(
            c.top(2),
            vec![("Matmul".to_string(), 1.5), ("Add".to_string(), 0.5)]
        );
    }

    #[test]
    fn the_tally_counts_each_step_of_a_shape() {
        // The tally is process-wide: use shapes no other test steps.
        let rows = StepShape {
            rows: 4099,
            prompts: 0,
        };
        let before = graph_census().get(&rows).cloned().unwrap_or_default();
        record(rows, vec!["Add".into(), "Add".into()], 1);
        record(rows, vec!["Concatenate".into()], 0);
        let after = graph_census()[&rows].clone();
        assert_eq!(after.steps, before.steps + 2);
        assert_eq!(after.small_leaves, before.small_leaves + 1);
        assert_eq!(
            after.nodes["Add"],
            before.nodes.get("Add").unwrap_or(&0) + 2
        );
        assert!(graph_census_lines()
            .iter()
            .any(|l| l.starts_with("graph census, 4099 row(s): 2 steps, 1.5 nodes per step")));
        // A pass with chunks is tallied apart from decode-only steps of as many rows.
        let mixed = StepShape {
            rows: 4099,
            prompts: 3,
        };
        let solo = StepShape {
            rows: 0,
            prompts: 4099,
        };
        record(mixed, vec!["Matmul".into()], 0);
        record(solo, vec!["Matmul".into(), "Matmul".into()], 0);
        assert_eq!(graph_census()[&rows].steps, before.steps + 2);
        let lines = graph_census_lines();
        assert!(lines.iter().any(|l| l.starts_with(
            "graph census, 4099 row(s) + 3 prompt chunk(s): 1 steps, 1.0 nodes per step"
        )));
        assert!(lines.iter().any(|l| l.starts_with(
            "graph census, prefill pass of 4099 prompt(s): 1 steps, 2.0 nodes per step"
        )));
    }
}
