//! `kvstore bench`: benchmarks that report ratios against a baseline run in the same process.

use clap::Subcommand;

mod mlx;

/// Arguments of `kvstore bench`.
#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    which: Which,
}

#[derive(Subcommand)]
enum Which {
    /// MLX building blocks: f32 matmul GFLOP/s, SDPA at 2K keys, slice_update in place vs copy.
    Mlx(mlx::Args),
}

/// Runs the chosen benchmark.
pub fn run(args: Args) -> anyhow::Result<()> {
    match args.which {
        Which::Mlx(a) => mlx::run(a),
    }
}
