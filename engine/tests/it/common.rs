use std::path::{Path, PathBuf};

use engine::{greedy_ids, load, GenerateParams, LoadOptions, Model};
use serde_json::Value;

use crate::prerequisite;

pub fn goldens() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/goldens")
}

pub fn golden(name: &str) -> Value {
    let p = goldens().join(name);
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
}

/// The default model, when `scripts/setup.sh` has fetched it; else `None`, after
/// [`prerequisite::missing`] said so (under CI: the test fails).
pub fn smollm2() -> Option<PathBuf> {
    let p =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if p.is_file() {
        return Some(p);
    }
    prerequisite::missing(
        &format!("{} is missing", p.display()),
        "run bash scripts/setup.sh",
    );
    None
}

/// A copy of the golden tiny model `name` in `dir` with a 2048-token context: a chat
/// template's tool preamble alone fills most of the 512 it has, and random weights do not
/// care about positions. Returns the copy's folder.
pub fn roomy_tiny_model(name: &str, dir: &std::path::Path) -> PathBuf {
    let src = goldens().join(name);
    let out = dir.join(name);
    std::fs::create_dir_all(&out).unwrap();
    for f in [
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        std::fs::copy(src.join(f), out.join(f)).unwrap();
    }
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    config["max_position_embeddings"] = serde_json::json!(2048);
    std::fs::write(out.join("config.json"), config.to_string()).unwrap();
    out
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

/// Allowed |logit difference| between two f32 evaluations of a model that agree to `base`
/// when matmuls are exact f32 (the CPU): `base + 4u·max|reference|`, u being the matmul
/// operand roundoff of the default device (`mlx::f32_matmul_unit_roundoff`).
///
/// On CUDA, f32 matmuls run on TF32 tensor cores (u = 2^-10): every product in every layer
/// reads its operands with ~1e-3 relative error, and those errors reach the logits in
/// proportion to their size. Measured on an H200 against CPU-made mlx-lm goldens: 0.5-0.7 u
/// of the largest |logit| for 2-layer tiny models and SmolLM2's 30 layers alike, 1.4 u for
/// the tiny Gemma 3; 4u leaves a margin of 3x or more. A wrong op (rope, norm, bias, mask) moves logits by O(max |logit|). On the
/// CPU, u = 2^-24 and the bound is `base` in effect.
pub fn logit_tol(base: f32, reference: &[f32]) -> f32 {
    let u = mlx::f32_matmul_unit_roundoff().unwrap();
    let scale = reference.iter().fold(0f32, |m, x| m.max(x.abs()));
    base + 4.0 * u * scale
}

/// Whether the two largest logits are closer than `tol` twice over: two evaluations that
/// each stay within `tol` of the exact logits may then pick different argmaxes.
pub fn near_tie(logits: &[f32], tol: f32) -> bool {
    let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &x in logits {
        if x > a {
            (a, b) = (x, a);
        } else if x > b {
            b = x;
        }
    }
    a - b < 2.0 * tol
}

/// Checks that each token of `generated` is what a cold model picks after `prompt` and the
/// tokens before it: the argmax of the logits `forward_all` gives for that position, or
/// within the near-tie band of it (`2 * logit_tol(base, ..)`, as in `near_tie`). On the CPU
/// this is the exact greedy sequence; on a GPU, where a run that restored its prefix and a
/// cold run round differently, it still catches a restore that changes the model's output.
pub fn assert_greedy_under_cold(
    model: &Model,
    prompt: &[u32],
    generated: &[u32],
    base: f32,
    what: &str,
) {
    let Some((_, fed)) = generated.split_last() else {
        return;
    };
    let seq: Vec<u32> = prompt.iter().chain(fed).copied().collect();
    let all: Vec<f32> = model
        .forward_all(&seq, &mut model.new_cache())
        .unwrap()
        .to_vec()
        .unwrap();
    let vocab = all.len() / seq.len();
    for (i, &t) in generated.iter().enumerate() {
        let row = &all[(prompt.len() - 1 + i) * vocab..][..vocab];
        let best = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        let tol = logit_tol(base, row);
        assert!(
            row[t as usize] >= best - 2.0 * tol,
            "{what}: token {i} ({t}) has logit {} where the cold maximum is {best} (allowed gap {})",
            row[t as usize],
            2.0 * tol
        );
    }
}

/// Asserts that `got`, the greedy tokens a batched, chunked, shared or restored run gave
/// after `prompt`, are the cold run's `want`. On the CPU they must be equal. On a GPU the two
/// runs round differently (TF32 products, other kernel shapes), and a near tie can send them
/// down different branches: there, where they differ, each must be greedy within the
/// near-tie band under a cold teacher-forced pass of the model at `path`
/// ([`assert_greedy_under_cold`]), which a wrong restore or a mixed-up row still fails.
pub fn assert_cold_greedy(path: &Path, prompt: &[u32], got: &[u32], want: &[u32], what: &str) {
    if got == want {
        return;
    }
    assert_ne!(
        mlx::default_device().unwrap(),
        mlx::Device::Cpu,
        "{what}: {got:?} where the cold run gave {want:?}"
    );
    let (model, _) = load(path, &LoadOptions::default()).unwrap();
    assert_greedy_under_cold(&model, prompt, got, 1e-4, what);
    assert_greedy_under_cold(&model, prompt, want, 1e-4, &format!("{what} (cold)"));
}

/// Logits and greedy ids of the model at `path` against mlx-lm's goldens for `name` in
/// `goldens_file`: every logit within `logit_tol(tol, …)`, greedy ids identical.
pub fn check_against_mlx_lm(
    goldens_file: &str,
    name: &str,
    path: &std::path::Path,
    options: &LoadOptions,
    tol: f32,
) {
    let g = golden(goldens_file);
    let n = g["n_tokens"].as_u64().unwrap() as usize;
    let (model, _) = load(path, options).unwrap();
    let mut worst = 0f32;
    let mut allowed = f32::INFINITY;
    for case in g["models"][name]["cases"].as_array().unwrap() {
        let prompt = ids(&case["prompt_ids"]);
        let mut cache = model.new_cache();
        let logits: Vec<f32> = model
            .forward(&prompt, &mut cache)
            .unwrap()
            .to_vec()
            .unwrap();
        if let Some(full) = case.get("last_logits") {
            let want = floats(full);
            allowed = allowed.min(logit_tol(tol, &want));
            for (a, b) in logits.iter().zip(want) {
                worst = worst.max((a - b).abs());
            }
        } else {
            allowed = allowed.min(logit_tol(tol, &floats(&case["top_logits"])));
            for key in ["top", "probe"] {
                let want = floats(&case[format!("{key}_logits")]);
                for (i, id) in ids(&case[format!("{key}_ids")]).into_iter().enumerate() {
                    worst = worst.max((logits[id as usize] - want[i]).abs());
                }
            }
        }
        let got = greedy_ids(&model, &prompt, n).unwrap();
        assert_eq!(
            got,
            ids(&case["greedy_ids"]),
            "{name}: greedy ids differ from mlx-lm ({} prompt tokens)",
            prompt.len()
        );
    }
    eprintln!("{name}: max |logit - mlx-lm| = {worst:.2e} (allowed {allowed:.2e})");
    assert!(
        worst < allowed,
        "{name}: logits differ from mlx-lm by {worst} (allowed {allowed})"
    );
}

/// Deterministic pseudo-random token ids in `3..vocab`.
pub fn tokens(seed: u64, n: usize, vocab: usize) -> Vec<u32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            3 + (x % (vocab as u64 - 3)) as u32
        })
        .collect()
}

/// The largest absolute difference between two logit vectors.
pub fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Greedy decoding of exactly `max_tokens` tokens (EOS ignored).
pub fn no_eos(max_tokens: usize) -> GenerateParams {
    GenerateParams {
        max_tokens,
        stop_at_eos: false,
        ..GenerateParams::default()
    }
}

/// The prefix tiers of the engine tests: a store at `root`, blocks of `block_size` tokens,
/// every cached block restored. What these tests check is what a restore reports, not the
/// restore-or-recompute choice (tested in engine/src/cost_model.rs), which on a tiny model
/// is near break-even and so follows the machine's load.
pub(crate) fn reuse_config(
    root: impl AsRef<std::path::Path>,
    block_size: usize,
) -> engine::ReuseConfig {
    engine::ReuseConfig {
        store: store::StoreConfig::default().root(root.as_ref()),
        block_size,
        restore_always: true,
        ..engine::ReuseConfig::default()
    }
}
