//! The `kvstore` command line: serve, generate, inspect, gc, bench, demo.

use clap::{Parser, Subcommand};

mod agent_session;
mod bench;
mod cache_args;
mod chat;
mod demo;
mod engine_run;
mod gc;
mod generate;
mod inspect;
mod serve;
mod unix_socket;

/// kvstore: a content-addressed KV block store under an MLX generation engine.
#[derive(Parser)]
#[command(name = "kvstore", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the OpenAI-compatible API (continuous batching, prefix reuse) over HTTP.
    Serve(serve::Args),
    /// Measure kvstore's building blocks against baselines run in the same process.
    Bench(bench::Args),
    /// Show what a store directory holds; --verify re-checks every checksum.
    Inspect(inspect::Args),
    /// Remove least-recently-used, old, unreachable, corrupt and foreign files from a store.
    Gc(gc::Args),
    /// Generate a completion from a prompt or a messages file (plain text, or --json).
    Generate(generate::Args),
    /// An interactive multi-turn chat that streams the model's replies.
    Chat(chat::Args),
    /// Replay a multi-turn agent session with prefix reuse, restart, restore from SSD.
    Demo(demo::Args),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // Before any thread starts or MLX runs: libmlx reads these once (mlx::cuda_graphs).
    if serves_many(&cli.command) {
        mlx::default_cuda_graphs(false);
    } else {
        mlx::default_graph_mb();
    }
    if !matches!(cli.command, Command::Serve(_)) {
        quiet_on_closed_pipe();
    }
    match cli.command {
        Command::Serve(args) => serve::run(args),
        Command::Bench(args) => bench::run(args),
        Command::Inspect(args) => exit_with(inspect::run(args)?),
        Command::Gc(args) => exit_with(gc::run(args)?),
        Command::Generate(args) => generate::run(args),
        Command::Chat(args) => chat::run(args),
        Command::Demo(args) => demo::run(args),
    }
}

/// Lets a closed stdout end the process quietly, as it does other Unix tools (`kvstore
/// inspect | head`): Rust ignores SIGPIPE, which turns the write into a panic. Not for
/// `serve`, which must outlive its clients (its sockets never raise SIGPIPE either way).
fn quiet_on_closed_pipe() {
    // SAFETY: restoring a signal's default disposition at start-up, before any thread.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// Exits with `code` when it is not 0 (a command that ran but found a problem).
fn exit_with(code: i32) -> anyhow::Result<()> {
    if code != 0 {
        std::process::exit(code);
    }
    Ok(())
}

/// Whether the command runs the engine under a serving load (`serve`, `bench serve`,
/// `bench trace`): there, prompt chunks and batches keep changing shape, and a CUDA graph
/// instantiated for each new shape costs more than graphs save, so these run without them
/// unless `MLX_USE_CUDA_GRAPHS` says otherwise (docs/server.md, "CUDA graphs"). The others
/// (one request at a time: `generate`, `chat`, `demo`, the other benchmarks) keep MLX's
/// default, on: their decode steps repeat one shape; their graphs are committed every
/// `mlx::KVSTORE_GRAPH_MB` megabytes of inputs (docs/cuda.md, "CUDA graphs' size").
fn serves_many(command: &Command) -> bool {
    match command {
        Command::Serve(_) => true,
        Command::Bench(args) => args.serves_many(),
        _ => false,
    }
}

/// A duration given in milliseconds on the command line (`flag` names it in the error):
/// finite and not negative.
pub(crate) fn cli_duration_ms(ms: f64, flag: &str) -> anyhow::Result<std::time::Duration> {
    std::time::Duration::try_from_secs_f64(ms / 1e3).map_err(|_| {
        anyhow::anyhow!("{flag} must be a number of milliseconds, 0 or more (got {ms})")
    })
}

#[cfg(test)]
mod duration_tests {
    use super::cli_duration_ms;

    #[test]
    fn milliseconds_become_durations_and_nonsense_is_refused() {
        assert_eq!(
            cli_duration_ms(2.0, "--x").unwrap(),
            std::time::Duration::from_millis(2)
        );
        assert!(cli_duration_ms(0.0, "--x").unwrap().is_zero());
        for bad in [-1.0, f64::NAN, f64::INFINITY] {
            let e = cli_duration_ms(bad, "--load-grace")
                .unwrap_err()
                .to_string();
            assert!(e.contains("--load-grace"), "{e}");
        }
    }
}
