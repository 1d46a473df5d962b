//! The `kvstore` command line: serve, generate, inspect, gc, bench, demo.

use clap::{Parser, Subcommand};

mod bench;
mod gc;
mod inspect;

/// kvstore: a content-addressed KV block store under an MLX generation engine.
#[derive(Parser)]
#[command(name = "kvstore", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Measure kvstore's building blocks against baselines run in the same process.
    Bench(bench::Args),
    /// Show what a store directory holds; --verify re-checks every checksum.
    Inspect(inspect::Args),
    /// Remove least-recently-used, old, unreachable, corrupt and foreign files from a store.
    Gc(gc::Args),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Bench(args) => bench::run(args),
        Command::Inspect(args) => exit_with(inspect::run(args)?),
        Command::Gc(args) => exit_with(gc::run(args)?),
    }
}

/// Exits with `code` when it is not 0 (a command that ran but found a problem).
fn exit_with(code: i32) -> anyhow::Result<()> {
    if code != 0 {
        std::process::exit(code);
    }
    Ok(())
}
