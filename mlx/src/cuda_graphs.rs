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

/// Whether `MLX_USE_CUDA_GRAPHS` holds [`default_cuda_graphs`]'s choice rather than the
/// user's: a peer started as a child process (mlx_lm.server) should not inherit it.
pub fn cuda_graphs_var_is_ours() -> bool {
    SET_BY_US.load(Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;

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
