//! Bytes as a model file: the GGUF and safetensors checks never panic, accept only files
//! whose tensors lie inside them, and MLX never crashes on a file they accept.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    thread_local! {
        static SCRATCH: tempfile::TempDir = tempfile::tempdir().expect("scratch dir");
    }
    SCRATCH.with(|d| mlx::fuzzing::check_model_file(data, &d.path().join("model")))
});
