//! Whether MLX's CUDA backend records kernels into CUDA graphs (`MLX_USE_CUDA_GRAPHS`).
//!
//! libmlx reads the variable once, the first time it launches a kernel, so the choice is
//! per process. Graphs make a pass whose shapes repeat cheaper to launch (a decode step of
//! one sequence: the 8B model decodes ~20 % faster with them on the H200), but a pass of
//! new shapes instantiates new graphs: under a serving load, where prompt chunks and
//! batches keep changing shape, a step with a chunk took 69 ms with graphs and 26 ms
//! without (docs/benchmarks.md, "CUDA graphs"). MLX on the CPU or Metal ignores it.

use std::sync::atomic::{AtomicBool, Ordering};

/// The variable libmlx reads.
pub const CUDA_GRAPHS_VAR: &str = "MLX_USE_CUDA_GRAPHS";

/// Set when [`default_cuda_graphs`] wrote the variable (the user had not set it).
static SET_BY_US: AtomicBool = AtomicBool::new(false);

/// Whether MLX will record CUDA graphs: on when `MLX_USE_CUDA_GRAPHS` is unset, else
/// when its value reads as a non-zero integer, as libmlx reads it (C's `atoi`: `1` is on;
/// `0`, and any word such as `false` or even `true`, is off).
pub fn cuda_graphs_enabled() -> bool {
    graphs_on(std::env::var(CUDA_GRAPHS_VAR).ok().as_deref())
}

/// What a value of the variable (`None`: unset) means.
fn graphs_on(value: Option<&str>) -> bool {
    let Some(v) = value else {
        return true;
    };
    // atoi: leading blanks, a sign, then the digits up to the first other character.
    let v = v.trim_start();
    let digits = v.strip_prefix(['+', '-']).unwrap_or(v);
    digits
        .chars()
        .take_while(char::is_ascii_digit)
        .any(|c| c != '0')
}

/// Makes `on` this process's choice unless the user set `MLX_USE_CUDA_GRAPHS`. Call it
/// at the start of `main`, before any thread starts and before MLX runs anything (libmlx
/// reads the variable once). Returns whether it wrote the variable.
pub fn default_cuda_graphs(on: bool) -> bool {
    if std::env::var_os(CUDA_GRAPHS_VAR).is_some() {
        return false;
    }
    std::env::set_var(CUDA_GRAPHS_VAR, if on { "1" } else { "0" });
    SET_BY_US.store(true, Ordering::Relaxed);
    true
}

/// The variable libmlx reads for the input megabytes after which its CUDA backend commits
/// the graph it is recording and starts a new one (and, on Metal, a command buffer).
pub const GRAPH_MB_VAR: &str = "MLX_MAX_MB_PER_BUFFER";

/// kvstore's graph size on CUDA, in input megabytes: a graph is committed once its kernels'
/// inputs pass 100 MB, so each of the 8B's layers (436 MB of weights) is recorded and
/// launched in several graphs rather than one graph per one to three layers. Measured on
/// the H100 (docs/benchmarks.md, session 39): the 8B-shaped bf16 decode 7.35 → 6.72 ms a
/// token at 512 tokens and 7.52 → 7.02 at 2,048, prefill 2-9 % faster; mlx-lm's own loop
/// is faster with libmlx's default, so a peer keeps it.
pub const KVSTORE_GRAPH_MB: u32 = 100;

/// Set when [`default_graph_mb`] wrote [`GRAPH_MB_VAR`] (the user had not set it).
static GRAPH_MB_SET_BY_US: AtomicBool = AtomicBool::new(false);

/// Makes [`KVSTORE_GRAPH_MB`] this process's graph size unless the user set
/// `MLX_MAX_MB_PER_BUFFER`, on Linux only (CUDA; the CPU ignores it, and Metal, where the
/// same variable sizes command buffers, is not measured). Call it at the start of `main`,
/// before any thread starts and before MLX runs anything. Returns whether it wrote it.
pub fn default_graph_mb() -> bool {
    if !cfg!(target_os = "linux") || std::env::var_os(GRAPH_MB_VAR).is_some() {
        return false;
    }
    std::env::set_var(GRAPH_MB_VAR, KVSTORE_GRAPH_MB.to_string());
    GRAPH_MB_SET_BY_US.store(true, Ordering::Relaxed);
    true
}

/// The MLX variables this process set for itself ([`default_cuda_graphs`],
/// [`default_graph_mb`]), which a peer started as a child process (mlx-lm) must not
/// inherit: it runs as its users run it.
pub fn vars_set_for_kvstore() -> Vec<&'static str> {
    let mut vars = Vec::new();
    if SET_BY_US.load(Ordering::Relaxed) {
        vars.push(CUDA_GRAPHS_VAR);
    }
    if GRAPH_MB_SET_BY_US.load(Ordering::Relaxed) {
        vars.push(GRAPH_MB_VAR);
    }
    vars
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_graph_size_is_kvstores_unless_the_user_set_one_and_peers_do_not_inherit_it() {
        // The only test that touches MLX_MAX_MB_PER_BUFFER (libmlx ignores it on the CPU).
        let user = std::env::var(GRAPH_MB_VAR).ok();
        let wrote = default_graph_mb();
        let now = std::env::var(GRAPH_MB_VAR).ok();
        match user {
            Some(u) => {
                assert!(!wrote, "a user's value is kept");
                assert_eq!(now, Some(u));
                assert!(!vars_set_for_kvstore().contains(&GRAPH_MB_VAR));
            }
            None if cfg!(target_os = "linux") => {
                assert!(wrote);
                assert_eq!(now.as_deref(), Some("100"));
                assert!(vars_set_for_kvstore().contains(&GRAPH_MB_VAR));
                assert!(!default_graph_mb(), "set once");
            }
            None => assert!(!wrote && now.is_none(), "only Linux (CUDA) is measured"),
        }
    }

    #[test]
    fn the_variable_is_read_as_libmlx_reads_it() {
        assert!(graphs_on(None), "unset: libmlx's default, on");
        for on in ["1", " 1 ", "-2", "10x"] {
            assert!(graphs_on(Some(on)), "{on}");
        }
        for off in ["0", "", "00", "false", "true", "x1"] {
            assert!(!graphs_on(Some(off)), "{off}");
        }
    }
}
