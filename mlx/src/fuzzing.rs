//! Entry point for the `model_file` fuzz target (`fuzz/`) and its corpus replay test: the
//! model-file checks of [`crate::validate`] and, for every file they accept, MLX's own loader
//! on it. Not a stable API.
//!
//! What must hold: the checks never panic; a file they accept describes only tensors inside
//! it; and MLX, handed an accepted file, returns arrays or an error, never a crash (the
//! fuzzer runs under AddressSanitizer, so a read outside gguflib's mapping is caught).

use std::path::Path;

use crate::validate;

/// Runs `data` through the GGUF and safetensors checks and, when one accepts it, through
/// MLX's loader of that format via the file `scratch` (overwritten). Panics when an
/// invariant breaks.
pub fn check_model_file(data: &[u8], scratch: &Path) {
    let len = data.len() as u64;
    if let Ok(layout) = validate::gguf(data, len) {
        for t in &layout.tensors {
            assert!((1..=validate::MAX_GGUF_DIMS as usize).contains(&t.dims.len()));
            assert!(t.offset >= layout.data_offset);
            assert!(t.offset + t.bytes <= len, "{t:?} ends past {len}");
        }
        std::fs::write(scratch, data).expect("scratch file");
        if let Ok(g) = crate::io::load_gguf(scratch) {
            let arrays: Vec<_> = g.tensors.values().collect();
            let _ = crate::eval(&arrays);
        }
    }
    if let Ok(tensors) = validate::safetensors(data, len) {
        let total: u64 = tensors.iter().map(|t| t.bytes).sum();
        assert!(total <= len);
        std::fs::write(scratch, data).expect("scratch file");
        if let Ok(st) = crate::io::load_safetensors(scratch) {
            let arrays: Vec<_> = st.tensors.values().collect();
            let _ = crate::eval(&arrays);
        }
    }
}

/// The committed inputs of fuzz target `target`: every file under `fuzz/corpus/<target>`
/// and `fuzz/seeds/<target>`, sorted (the corpus replay test).
pub fn committed_inputs(target: &str) -> Vec<std::path::PathBuf> {
    let fuzz = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz");
    let mut files = Vec::new();
    for dir in ["corpus", "seeds"] {
        if let Ok(entries) = std::fs::read_dir(fuzz.join(dir).join(target)) {
            files.extend(entries.filter_map(|e| e.ok()).map(|e| e.path()));
        }
    }
    files.sort();
    files
}
