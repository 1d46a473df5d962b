//! Whether an mlx-lm peer's libmlx multiplies on the mlx-cpu wheel's reference BLAS.
//!
//! The wheel links libmlx against a reference BLAS whose f32 matmul is ~25x slower than
//! OpenBLAS's; set-up swaps Debian's OpenBLAS in behind it (scripts/setup.sh for the
//! engine, scripts/goldens/make_goldens.sh and scripts/bench/setup_peer.sh for the peers).
//! A peer venv made any other way keeps the reference BLAS, and every ratio against it
//! flatters kvstore: on cpu-vm in session 32 such a venv's mlx-lm prefilled SmolLM2 at 11
//! tok/s instead of 246. The benchmarks say so before they compare.

use std::path::{Path, PathBuf};

/// The reference BLAS libraries the mlx-cpu wheel of the venv holding `python`
/// (`VENV/bin/python`) still loads: regular files, not the symlinks to OpenBLAS set-up
/// makes (the kept originals end in `.orig`). Empty when the swap was made, when the venv
/// has no mlx-cpu wheel (a GPU wheel, another layout) or cannot be read.
pub fn reference_blas(python: &Path) -> Vec<PathBuf> {
    let Some(venv) = python.parent().and_then(Path::parent) else {
        return Vec::new();
    };
    let Ok(lib) = std::fs::read_dir(venv.join("lib")) else {
        return Vec::new();
    };
    let mut found = Vec::new();
    for py in lib.flatten() {
        let libs = py.path().join("site-packages/mlx_cpu.libs");
        let Ok(entries) = std::fs::read_dir(&libs) else {
            continue;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let blas =
                name.starts_with("libblas") && name.contains(".so") && !name.ends_with(".orig");
            if blas && e.file_type().is_ok_and(|t| t.is_file()) {
                found.push(e.path());
            }
        }
    }
    found.sort();
    found
}

/// Prints a warning on stderr when the peer run by `python` multiplies on the reference
/// BLAS ([`reference_blas`]); returns whether it did.
pub fn warn_if_reference_blas(python: &Path) -> bool {
    let found = reference_blas(python);
    let Some(first) = found.first() else {
        return false;
    };
    eprintln!(
        "warning: the mlx-lm peer ({}) runs its CPU matmuls on the mlx-cpu wheel's reference \
         BLAS ({}), several times slower than the OpenBLAS kvstore's libmlx uses: ratios \
         against it flatter kvstore. Swap OpenBLAS in with `bash scripts/goldens/make_goldens.sh` \
         (.venv-goldens) or `bash scripts/bench/setup_peer.sh` (.venv-peer).",
        python.display(),
        first.display()
    );
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(unix)]
    #[test]
    fn a_regular_blas_file_is_found_and_a_swapped_one_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let libs = dir.path().join("lib/python3.11/site-packages/mlx_cpu.libs");
        std::fs::create_dir_all(&libs).unwrap();
        std::fs::create_dir_all(dir.path().join("bin")).unwrap();
        let python = dir.path().join("bin/python");
        let blas = libs.join("libblas-bd8a282c.so.3.10.0");
        std::fs::write(&blas, b"reference").unwrap();
        std::fs::write(libs.join("liblapack-86b2c207.so.3.10.0"), b"lapack").unwrap();
        assert_eq!(reference_blas(&python), vec![blas.clone()]);
        assert!(warn_if_reference_blas(&python));
        // What set-up does: the original kept aside, a symlink in its place.
        let orig = libs.join("libblas-bd8a282c.so.3.10.0.orig");
        std::fs::rename(&blas, &orig).unwrap();
        std::os::unix::fs::symlink(&orig, &blas).unwrap();
        assert!(reference_blas(&python).is_empty());
        assert!(!warn_if_reference_blas(&python));
        // No venv around the Python at all.
        assert!(reference_blas(Path::new("python3")).is_empty());
    }
}
