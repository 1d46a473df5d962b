//! Build script shared by every crate that links libmlx through `kvstore-mlx`.
//!
//! Cargo only applies `rustc-link-arg` to the targets of the package whose build script
//! emits it, so each dependent that builds binaries, tests or examples must add libmlx's
//! directory to its own rpath. `kvstore-mlx` declares `links = "mlx"` and exports the
//! directory as `DEP_MLX_LIBDIR`.

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_MLX_LIBDIR");
    if let Ok(dir) = std::env::var("DEP_MLX_LIBDIR") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
}
