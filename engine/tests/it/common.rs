use std::path::PathBuf;

use serde_json::Value;

pub fn goldens() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/goldens")
}

pub fn golden(name: &str) -> Value {
    let p = goldens().join(name);
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
}

/// The default model, when `scripts/setup.sh` has fetched it.
pub fn smollm2() -> Option<PathBuf> {
    let p =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if p.is_file() {
        Some(p)
    } else {
        eprintln!(
            "skipped: {} is missing (run bash scripts/setup.sh)",
            p.display()
        );
        None
    }
}

pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

pub fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}
