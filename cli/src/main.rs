//! The `kvstore` command line: serve, generate, inspect, gc, bench, demo.

use clap::{Parser, Subcommand};

mod bench;

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
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Bench(args) => bench::run(args),
    }
}
