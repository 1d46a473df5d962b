//! `kvstore bench mlx`: MLX's building blocks from Rust, each beside a baseline measured in
//! the same process: f32 matmul against a plain Rust loop, fused SDPA against attention
//! composed of MLX ops, and `slice_update` in place against the copy a live clone forces;
//! then what one graph node costs the host to launch, by kind.

use anyhow::Result;
use mlx::fast::{scaled_dot_product_attention, AttentionMask};
use mlx::Dtype;
use serde::Serialize;

use super::timing::{median, random};

/// Arguments of `kvstore bench mlx`.
#[derive(clap::Args)]
pub struct Args {
    /// Small sizes and few repetitions (a smoke run, numbers not meaningful).
    #[arg(long)]
    quick: bool,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

/// One measured operation beside its baseline.
#[derive(Serialize)]
struct Row {
    name: String,
    /// Median seconds per call of the measured operation.
    seconds: f64,
    /// Median seconds per call of the baseline.
    baseline_seconds: f64,
    /// What the baseline is.
    baseline: String,
    /// baseline_seconds / seconds: how many times faster the measured operation is.
    speedup: f64,
    /// Throughput of the measured operation, when it has one (GFLOP/s).
    gflops: Option<f64>,
    /// Throughput of the baseline (GFLOP/s).
    baseline_gflops: Option<f64>,
}

#[derive(Serialize)]
struct Report {
    mlx_version: String,
    device: String,
    rows: Vec<Row>,
    /// Host cost per graph node, by kind.
    launch: Vec<LaunchRow>,
}

/// A cache-friendly (i, k, j) triple loop: what a matmul costs without a BLAS.
fn rust_matmul(a: &[f32], b: &[f32], n: usize) -> Vec<f32> {
    let mut c = vec![0.0f32; n * n];
    for i in 0..n {
        for k in 0..n {
            let aik = a[i * n + k];
            let (brow, crow) = (&b[k * n..][..n], &mut c[i * n..][..n]);
            for (cj, bj) in crow.iter_mut().zip(brow) {
                *cj += aik * bj;
            }
        }
    }
    c
}

fn matmul_rows(quick: bool) -> Result<Vec<Row>> {
    let sizes: &[usize] = if quick { &[128] } else { &[512, 1024, 2048] };
    let mut rows = Vec::new();
    for &n in sizes {
        let a = random(&[n as i32, n as i32], 1)?;
        let b = random(&[n as i32, n as i32], 2)?;
        let reps = if quick { 2 } else { 5 };
        let t = median(reps, || Ok(a.matmul(&b)?.eval()?))?;
        let (ha, hb) = (a.to_vec::<f32>()?, b.to_vec::<f32>()?);
        let base_n = n.min(512);
        let tb = median(if quick { 1 } else { 3 }, || {
            std::hint::black_box(rust_matmul(
                &ha[..base_n * base_n],
                &hb[..base_n * base_n],
                base_n,
            ));
            Ok(())
        })?;
        let flops = 2.0 * (n as f64).powi(3);
        let base_flops = 2.0 * (base_n as f64).powi(3);
        let gflops = flops / t.as_secs_f64() / 1e9;
        let baseline_gflops = base_flops / tb.as_secs_f64() / 1e9;
        rows.push(Row {
            name: format!("matmul f32 {n}x{n}"),
            seconds: t.as_secs_f64(),
            baseline_seconds: tb.as_secs_f64() * flops / base_flops,
            baseline: format!("Rust i-k-j loop ({base_n}³, scaled to {n}³)"),
            speedup: gflops / baseline_gflops,
            gflops: Some(gflops),
            baseline_gflops: Some(baseline_gflops),
        });
    }
    Ok(rows)
}

fn sdpa_rows(quick: bool) -> Result<Vec<Row>> {
    // SmolLM2-135M's attention shape: 9 query heads over 3 KV heads, head_dim 64.
    let (hq, hkv, d) = (9, 3, 64);
    let keys = if quick { 256 } else { 2048 };
    let mut rows = Vec::new();
    for queries in [1, if quick { 16 } else { 128 }] {
        let q = random(&[1, hq, queries, d], 3)?;
        let k = random(&[1, hkv, keys, d], 4)?;
        let v = random(&[1, hkv, keys, d], 5)?;
        let scale = 1.0 / (d as f32).sqrt();
        let mask = if queries == 1 {
            AttentionMask::None
        } else {
            AttentionMask::Causal
        };
        let reps = if quick { 3 } else { 20 };
        let t = median(reps, || {
            Ok(scaled_dot_product_attention(&q, &k, &v, scale, mask)?.eval()?)
        })?;
        // The same attention from unfused MLX ops (GQA by repeating KV heads).
        let group = hq / hkv;
        let causal = if queries == 1 {
            None
        } else {
            let qi =
                mlx::ops::arange(0.0, queries as f64, 1.0, Dtype::I32)?.reshape(&[queries, 1])?;
            let kj = mlx::ops::arange(0.0, keys as f64, 1.0, Dtype::I32)?.reshape(&[1, keys])?;
            let allowed = kj.le(&qi.add_scalar((keys - queries) as f64)?)?;
            let neg = mlx::ops::full(&[queries, keys], -1e30, Dtype::F32)?;
            let zero = mlx::ops::zeros(&[queries, keys], Dtype::F32)?;
            Some(mlx::ops::where_(&allowed, &zero, &neg)?)
        };
        let tb = median(reps, || {
            let kr = k
                .reshape(&[1, hkv, 1, keys, d])?
                .broadcast_to(&[1, hkv, group, keys, d])?
                .reshape(&[1, hq, keys, d])?;
            let vr = v
                .reshape(&[1, hkv, 1, keys, d])?
                .broadcast_to(&[1, hkv, group, keys, d])?
                .reshape(&[1, hq, keys, d])?;
            let mut s = q
                .mul_scalar(scale as f64)?
                .matmul(&kr.transpose(&[0, 1, 3, 2])?)?;
            if let Some(m) = &causal {
                s = s.add(m)?;
            }
            Ok(s.softmax(-1, true)?.matmul(&vr)?.eval()?)
        })?;
        rows.push(Row {
            name: format!("sdpa {queries}q x {keys}k (9/3 heads, d64)"),
            seconds: t.as_secs_f64(),
            baseline_seconds: tb.as_secs_f64(),
            baseline: "matmul + softmax + matmul from MLX ops".into(),
            speedup: tb.as_secs_f64() / t.as_secs_f64(),
            gflops: None,
            baseline_gflops: None,
        });
    }
    Ok(rows)
}

fn slice_update_row(quick: bool) -> Result<Row> {
    // A KV arena of 16 MiB (4 MiB quick) taking one 16-token block write per step.
    let blocks = if quick { 64 } else { 256 };
    let shape = [blocks, 4, 16, 64 * 4];
    let update = random(&[1, 4, 16, 256], 6)?;
    let reps = if quick { 5 } else { 30 };
    let mut arena = Some(random(&shape, 7)?.add_scalar(0.0)?);
    let mut step = 0;
    let t_in_place = median(reps, || {
        let b = step % blocks;
        step += 1;
        let a = arena
            .take()
            .ok_or_else(|| anyhow::anyhow!("arena missing"))?;
        let a = a.slice_update(&update, &[b, 0, 0, 0], &[b + 1, 4, 16, 256])?;
        a.eval()?;
        arena = Some(a);
        Ok(())
    })?;
    let mut arena = Some(random(&shape, 8)?.add_scalar(0.0)?);
    let t_copy = median(reps, || {
        let b = step % blocks;
        step += 1;
        let a = arena
            .take()
            .ok_or_else(|| anyhow::anyhow!("arena missing"))?;
        let keep = a.clone(); // a second handle forces MLX to copy
        let a = a.slice_update(&update, &[b, 0, 0, 0], &[b + 1, 4, 16, 256])?;
        a.eval()?;
        drop(keep);
        arena = Some(a);
        Ok(())
    })?;
    Ok(Row {
        name: format!(
            "slice_update 1 block into a {} MiB arena",
            (blocks * 4 * 16 * 256 * 4) >> 20
        ),
        seconds: t_in_place.as_secs_f64(),
        baseline_seconds: t_copy.as_secs_f64(),
        baseline: "the same update with a live clone (copy)".into(),
        speedup: t_copy.as_secs_f64() / t_in_place.as_secs_f64(),
        gflops: None,
        baseline_gflops: None,
    })
}

/// What one node of a lazy graph costs the host to launch, by kind.
#[derive(Serialize)]
struct LaunchRow {
    /// The node kind.
    kind: String,
    /// Microseconds per node: a graph of `nodes` such nodes against a graph of one, built
    /// and evaluated (medians), the difference over `nodes - 1`.
    us_per_node: f64,
    /// Nodes in the measured graph.
    nodes: usize,
}

/// The kinds of node [`launch_rows`] chains.
#[derive(Clone, Copy)]
enum NodeKind {
    /// An add of two 64-float arrays.
    Kernel,
    /// An add of a host scalar, which MLX turns into a constant array.
    Scalar,
    /// A reshape.
    View,
    /// A one-token `slice_update` into a 2 MiB arena, in place.
    Write,
}

impl NodeKind {
    fn describe(self) -> &'static str {
        match self {
            NodeKind::Kernel => "a small kernel (add of two 64-float arrays)",
            NodeKind::Scalar => {
                "a small kernel with a host scalar (add_scalar: MLX makes a constant array)"
            }
            NodeKind::View => "a view (reshape)",
            NodeKind::Write => "a one-token slice_update into a 2 MiB arena, in place",
        }
    }
}

/// Host cost per node of MLX's graph evaluation: a chain of nodes of each [`NodeKind`],
/// against a graph of one node of the same kind. On a GPU a decode step is bound by this
/// cost times its nodes (engine::graph_census).
fn launch_rows(quick: bool) -> Result<Vec<LaunchRow>> {
    let n = if quick { 50 } else { 1000 };
    let reps = if quick { 3 } else { 15 };
    let x = random(&[64], 9)?;
    let chain = |len: usize, kind: NodeKind| -> Result<std::time::Duration> {
        let mut arena = Some(random(&[8, 1024, 64], 10)?.add_scalar(0.0)?);
        let token = random(&[8, 1, 64], 11)?;
        median(reps, || {
            let mut y = match kind {
                // The arena itself, taken so that its only handle is the chain's: each
                // write can be in place.
                NodeKind::Write => arena
                    .take()
                    .ok_or_else(|| anyhow::anyhow!("arena missing"))?,
                _ => x.clone(),
            };
            for i in 0..len {
                y = match kind {
                    NodeKind::Kernel => y.add(&x)?,
                    NodeKind::Scalar => y.add_scalar(1.0)?,
                    NodeKind::View => y.reshape(if i % 2 == 0 { &[8, 8] } else { &[64] })?,
                    NodeKind::Write => {
                        let c = (i % 1024) as i32;
                        y.slice_update(&token, &[0, c, 0], &[8, c + 1, 64])?
                    }
                };
            }
            y.eval()?;
            if let NodeKind::Write = kind {
                arena = Some(y);
            }
            Ok(())
        })
    };
    let mut rows = Vec::new();
    for kind in [
        NodeKind::Kernel,
        NodeKind::Scalar,
        NodeKind::View,
        NodeKind::Write,
    ] {
        let (one, many) = (chain(1, kind)?, chain(n, kind)?);
        rows.push(LaunchRow {
            kind: kind.describe().into(),
            us_per_node: (many.as_secs_f64() - one.as_secs_f64()).max(0.0) * 1e6 / (n - 1) as f64,
            nodes: n,
        });
    }
    Ok(rows)
}

/// Runs the MLX benchmark and prints a table or JSON.
pub fn run(args: Args) -> Result<()> {
    let mut rows = matmul_rows(args.quick)?;
    rows.extend(sdpa_rows(args.quick)?);
    rows.push(slice_update_row(args.quick)?);
    let report = Report {
        mlx_version: mlx::version()?,
        device: format!("{:?}", mlx::default_device()?).to_lowercase(),
        rows,
        launch: launch_rows(args.quick)?,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    println!("MLX {} on {}", report.mlx_version, report.device);
    println!(
        "{:<44} {:>11} {:>11} {:>9}  baseline",
        "operation", "time", "baseline", "speedup"
    );
    for r in &report.rows {
        let extra = match (r.gflops, r.baseline_gflops) {
            (Some(g), Some(b)) => format!("  ({g:.1} vs {b:.1} GFLOP/s)"),
            _ => String::new(),
        };
        println!(
            "{:<44} {:>9.3}ms {:>9.3}ms {:>8.1}x  {}{}",
            r.name,
            r.seconds * 1e3,
            r.baseline_seconds * 1e3,
            r.speedup,
            r.baseline,
            extra
        );
    }
    for l in &report.launch {
        println!(
            "graph launch, per node: {:>7.2} us  {} ({} nodes against 1)",
            l.us_per_node, l.kind, l.nodes
        );
    }
    Ok(())
}
