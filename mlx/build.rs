//! Finds the libmlx of an official MLX wheel, compiles the cxx shim against its headers and
//! links to it with an rpath, so nothing needs `LD_LIBRARY_PATH`.
//!
//! Discovery, in order: `$MLX_DIR`; the `mlx` package of `python3`; the project-local
//! `.mlx/mlx` folder that `scripts/setup.sh` fills. A folder qualifies when it holds
//! `include/mlx/mlx.h` and `lib/libmlx.{so,dylib}`.

use std::path::{Path, PathBuf};
use std::process::Command;

fn lib_name() -> &'static str {
    if cfg!(target_os = "macos") {
        "libmlx.dylib"
    } else {
        "libmlx.so"
    }
}

fn qualifies(dir: &Path) -> bool {
    dir.join("include/mlx/mlx.h").is_file() && dir.join("lib").join(lib_name()).is_file()
}

fn from_python() -> Option<PathBuf> {
    let out = Command::new("python3")
        .args([
            "-c",
            "import importlib.util, os; s = importlib.util.find_spec('mlx'); \
             print(os.path.dirname(s.origin) if s and s.origin else (list(s.submodule_search_locations)[0] if s else ''))",
        ])
        .output()
        .ok()?;
    let path = String::from_utf8(out.stdout).ok()?;
    let path = PathBuf::from(path.trim());
    (!path.as_os_str().is_empty()).then_some(path)
}

fn find_mlx() -> Result<(PathBuf, &'static str), String> {
    println!("cargo:rerun-if-env-changed=MLX_DIR");
    if let Ok(dir) = std::env::var("MLX_DIR") {
        let dir = PathBuf::from(dir);
        if qualifies(&dir) {
            return Ok((dir, "MLX_DIR"));
        }
        return Err(format!(
            "MLX_DIR={} does not hold include/mlx/mlx.h and lib/{}. Point it at the `mlx` \
             folder of an unpacked MLX wheel (mlx-cpu, mlx-cuda-13 or mlx-metal 0.32.4).",
            dir.display(),
            lib_name()
        ));
    }
    if let Some(dir) = from_python() {
        if qualifies(&dir) {
            return Ok((dir, "python3's mlx package"));
        }
    }
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").map_err(|e| e.to_string())?);
    let local = manifest.join("../.mlx/mlx");
    println!("cargo:rerun-if-changed={}", local.join("lib").display());
    if qualifies(&local) {
        return Ok((
            local.canonicalize().map_err(|e| e.to_string())?,
            "project-local .mlx",
        ));
    }
    Err(format!(
        "libmlx not found. Looked at $MLX_DIR (unset), python3's `mlx` package, and {}.\n\
         Fix: run `bash scripts/setup.sh` from the repository root (it downloads the MLX wheel \
         into .mlx/), or set MLX_DIR to the `mlx` folder of an unpacked MLX wheel.",
        local.display()
    ))
}

fn main() {
    let (dir, _source) = match find_mlx() {
        Ok(found) => found,
        Err(message) => {
            // A panic in a build script prints the message and fails the build.
            panic!("{message}");
        }
    };
    let include = dir.join("include");
    let lib = dir.join("lib");

    let mut build = cxx_build::bridge("src/ffi.rs");
    build
        .file("src/shim.cc")
        .file("src/direct_copy.cc")
        .file("src/rows_attention.cc")
        .file("src/copy_runs.cc")
        .file("src/nvrtc.cc")
        .file("src/host_upload.cc")
        .include(&include)
        .include("src")
        .std("c++20")
        .flag_if_supported("-Wno-unused-parameter")
        .flag_if_supported("-Wno-deprecated-declarations");
    // The batched decode attention (src/rows_attention.cc) needs the CUDA backend's headers,
    // which need the CUDA runtime's (cuda.h, cuda_runtime.h) and fmt's: scripts/cuda/build.sh
    // names them. Without them the kernel is left out and the cache attends row by row.
    println!("cargo:rerun-if-env-changed=KVSTORE_CUDA_INCLUDE");
    if let Ok(cuda) = std::env::var("KVSTORE_CUDA_INCLUDE") {
        for dir in std::env::split_paths(&cuda) {
            build.include(dir);
        }
        build
            .include(include.join("cccl"))
            .define("KVSTORE_CUDA", None);
    }
    build.compile("kvstore_mlx_shim");

    println!("cargo:rerun-if-changed=src/ffi.rs");
    println!("cargo:rerun-if-changed=src/shim.cc");
    println!("cargo:rerun-if-changed=src/shim.h");
    println!("cargo:rerun-if-changed=src/direct_copy.cc");
    println!("cargo:rerun-if-changed=src/direct_copy.h");
    println!("cargo:rerun-if-changed=src/rows_attention.cc");
    println!("cargo:rerun-if-changed=src/host_upload.cc");
    println!("cargo:rerun-if-changed=src/rows_attention.cu.h");
    println!("cargo:rerun-if-changed=src/copy_runs.cc");
    println!("cargo:rerun-if-changed=src/nvrtc.cc");
    println!("cargo:rerun-if-changed=src/nvrtc.h");
    println!("cargo:rustc-link-search=native={}", lib.display());
    println!("cargo:rustc-link-lib=dylib=mlx");
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
    // Exported to dependents as DEP_MLX_LIBDIR; their build script (mlx/rpath.rs) adds it
    // to their own rpath.
    println!("cargo:libdir={}", lib.display());
    println!("cargo:include={}", include.display());
}
