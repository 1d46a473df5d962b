//! `kvstore bench`: benchmarks that report ratios against a baseline run in the same process.

use clap::Subcommand;

mod agent;
mod cache;
mod child_server;
mod generate;
mod grammar;
mod mlx;
mod peer_blas;
mod prefill;
mod remote;
mod serve;
mod step_rows;
mod store;
mod timing;
mod trace;

/// Arguments of `kvstore bench`.
#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    which: Which,
}

#[derive(Subcommand)]
enum Which {
    /// The multi-turn agent session: no cache vs RAM reuse vs SSD reuse vs mlx-lm.
    Agent(agent::Args),
    /// Paged vs contiguous decode attention at 1K-16K tokens; publish and restore per block.
    Cache(cache::Args),
    /// Prefill tok/s at 512 and 2048 tokens, decode tok/s, peak memory, beside mlx-lm.
    Generate(generate::Args),
    /// Grammar-constrained decoding: tok/s constrained vs not, mask ms per token.
    Grammar(grammar::Args),
    /// MLX building blocks: f32 matmul GFLOP/s, SDPA at 2K keys, slice_update in place vs copy.
    Mlx(mlx::Args),
    /// TTFT of a prefix from the Redis remote tier vs local SSD vs recompute; chain fetch blocks/s.
    Remote(remote::Args),
    /// The serving engine under load: streams' ITL while a long prompt prefills (chunked vs
    /// whole), and concurrent multi-turn sessions (throughput, TTFT/ITL P50/P99, hit share),
    /// in process and, with `--peer-python`, over HTTP beside mlx_lm.server.
    Serve(Box<serve::Args>),
    /// An agent turn's prefill (new tokens after a long cached context) as a share of the
    /// f32 matmul rate measured in the same run.
    Prefill(prefill::Args),
    /// Store tiers: RAM and SSD GB/s at 1, 8, 32 MiB blocks and prefix restore, beside dd.
    Store(store::Args),
    /// Replay a Mooncake-format request trace: hit share against ideal, LRU and Belady, TTFT.
    Trace(Box<trace::Args>),
}

impl Args {
    /// Whether the benchmark runs the engine under a serving load (`serve`, `trace`): see
    /// `serves_many` in main.rs.
    pub fn serves_many(&self) -> bool {
        matches!(self.which, Which::Serve(_) | Which::Trace(_))
    }
}

/// A scratch directory (removed when dropped) inside `base`, which is created first if it
/// does not exist: a benchmark's `--dir` may name a fresh path on the disk to measure.
fn scratch_dir(base: &std::path::Path, prefix: &str) -> anyhow::Result<tempfile::TempDir> {
    use anyhow::Context;
    std::fs::create_dir_all(base)
        .with_context(|| format!("creating the directory {} (--dir)", base.display()))?;
    tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in(base)
        .with_context(|| format!("creating a scratch directory in {}", base.display()))
}

/// Makes `cmd`, a peer (mlx-lm) started as a child process, run as its users run it:
/// without the MLX variables kvstore set for itself (`mlx::vars_set_for_kvstore`).
fn peer_env(cmd: &mut std::process::Command) {
    for var in ::mlx::vars_set_for_kvstore() {
        cmd.env_remove(var);
    }
}

/// Runs the chosen benchmark; with `KVSTORE_GRAPH_CENSUS=1`, then prints the census of
/// its decode steps' graphs (engine::graph_census).
pub fn run(args: Args) -> anyhow::Result<()> {
    run_one(args)?;
    for line in engine::graph_census_lines() {
        eprintln!("{line}");
    }
    let (one, each) = ::cache::decode_path_totals();
    if one + each > 0 {
        eprintln!(
            "decode attention: {one} row-layer steps in one node, {each} otherwise ({:.1} % in \
             one node; KVSTORE_ROWS_KERNEL=0 turns it off)",
            100.0 * one as f64 / (one + each) as f64
        );
    }
    let (padded, plain) = ::cache::prefill_attention_totals();
    if padded + plain > 0 {
        eprintln!(
            "prefill attention (16-bit, causal): {padded} layer-chunks padded to a few shapes, \
             {plain} at their own shape (padding is on by default on CUDA; \
             KVSTORE_PADDED_ATTENTION=0|1 chooses)"
        );
    }
    let waits = engine::pass_memory_waits();
    if waits > 0 {
        eprintln!(
            "prefill passes waited {waits} times for the device to free their activations and \
             attention scores (--pass-workspace)"
        );
    }
    Ok(())
}

fn run_one(args: Args) -> anyhow::Result<()> {
    match args.which {
        Which::Agent(a) => agent::run(a),
        Which::Cache(a) => cache::run(a),
        Which::Generate(a) => generate::run(a),
        Which::Grammar(a) => grammar::run(a),
        Which::Mlx(a) => mlx::run(a),
        Which::Prefill(a) => prefill::run(a),
        Which::Remote(a) => remote::run(a),
        Which::Serve(a) => serve::run(*a),
        Which::Store(a) => store::run(a),
        Which::Trace(a) => trace::run(*a),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scratch_directory_is_made_in_a_base_that_did_not_exist_and_removed_alone() {
        let root = tempfile::tempdir().unwrap();
        let base = root.path().join("fresh").join("disk");
        let scratch = scratch_dir(&base, "kvstore-bench-").unwrap();
        assert!(scratch.path().starts_with(&base) && scratch.path().is_dir());
        let path = scratch.path().to_path_buf();
        drop(scratch);
        assert!(!path.exists() && base.is_dir());
        // A base that is a file: a clear error naming it.
        let file = root.path().join("a-file");
        std::fs::write(&file, b"x").unwrap();
        let err = format!("{:#}", scratch_dir(&file, "kvstore-bench-").unwrap_err());
        assert!(err.contains("a-file"), "{err}");
    }
}
