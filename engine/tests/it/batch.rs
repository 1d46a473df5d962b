//! Batched decode ([`engine::Model::forward_rows`]) against each row decoded alone.

use cache::{PagedConfig, PagedKvCache, PagedKvRows};
use engine::{argmax, greedy_ids, load, LoadOptions, Model, DEFAULT_PREFILL_CHUNK};

use crate::common::{goldens, logit_tol, near_tie};

fn prompts() -> Vec<Vec<u32>> {
    // Three lengths that pad differently inside the batch and straddle a 32-token block.
    let mk = |n: usize, seed: u32| -> Vec<u32> {
        (0..n as u32)
            .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed) >> 7) % 250 + 3)
            .collect()
    };
    vec![mk(5, 1), mk(19, 2), mk(41, 3)]
}

/// What a batched decode gave: greedy tokens per row, the largest |logit| gap to each row's
/// logits computed alone at the same step, and that gap over its allowed bound.
struct Batched {
    tokens: Vec<Vec<u32>>,
    worst: f32,
    worst_ratio: f32,
    /// Per row, the first step whose alone logits have a near tie at the top (`near_tie`):
    /// from there the row's tokens may differ from a separate greedy run's on a GPU.
    tie: Vec<Option<usize>>,
}

/// Greedy tokens of every prompt decoded together, compared at every step with each row's
/// logits computed alone. `base`: the bound where matmuls are exact f32 (`logit_tol`).
fn batched(model: &Model, prompts: &[Vec<u32>], n: usize, base: f32) -> Batched {
    let mut rows = PagedKvRows::new();
    let mut alone: Vec<PagedKvCache> = Vec::new();
    let mut out: Vec<Vec<u32>> = Vec::new();
    let mut tie = Vec::new();
    for p in prompts {
        let mut c = model.empty_cache(PagedConfig::default()).unwrap();
        let logits = model.prefill(p, &mut c, DEFAULT_PREFILL_CHUNK).unwrap();
        let logits = logits.to_vec::<f32>().unwrap();
        tie.push(near_tie(&logits, logit_tol(base, &logits)).then_some(0));
        out.push(vec![argmax(&logits)]);
        alone.push(c.clone());
        rows.push(c).unwrap();
    }
    let (mut worst, mut worst_ratio) = (0f32, 0f32);
    for _ in 1..n {
        let last: Vec<u32> = out.iter().map(|o| *o.last().unwrap()).collect();
        let logits: Vec<f32> = model
            .forward_rows(&last, &mut rows)
            .unwrap()
            .to_vec()
            .unwrap();
        let vocab = logits.len() / prompts.len();
        for (b, row) in logits.chunks(vocab).enumerate() {
            let single: Vec<f32> = model
                .forward(&[last[b]], &mut alone[b])
                .unwrap()
                .to_vec()
                .unwrap();
            let tol = logit_tol(base, &single);
            for (x, y) in row.iter().zip(&single) {
                worst = worst.max((x - y).abs());
                worst_ratio = worst_ratio.max((x - y).abs() / tol);
            }
            if tie[b].is_none() && near_tie(&single, tol) {
                tie[b] = Some(out[b].len());
            }
            out[b].push(argmax(row));
        }
    }
    Batched {
        tokens: out,
        worst,
        worst_ratio,
        tie,
    }
}

/// The tokens up to (without) a row's first near tie: where both runs must agree.
fn until_tie(tokens: &[u32], tie: Option<usize>) -> &[u32] {
    &tokens[..tie.unwrap_or(tokens.len()).min(tokens.len())]
}

fn check(name: &str) {
    let (model, _) = load(&goldens().join(name), &LoadOptions::default()).unwrap();
    let prompts = prompts();
    let r = batched(&model, &prompts, 16, 1e-4);
    for ((p, got), tie) in prompts.iter().zip(&r.tokens).zip(&r.tie) {
        let want = greedy_ids(&model, p, 16).unwrap();
        assert_eq!(until_tie(got, *tie), until_tie(&want, *tie), "{name}");
    }
    eprintln!(
        "{name}: max |batched - alone| logit = {:e} ({:.2} of allowed), near ties {:?}",
        r.worst, r.worst_ratio, r.tie
    );
    assert!(
        r.worst_ratio < 1.0,
        "{name}: batched logits differ by {} ({} of allowed)",
        r.worst,
        r.worst_ratio
    );
}

#[test]
fn batched_decode_matches_each_row_alone_llama() {
    check("tiny-llama");
}

#[test]
fn batched_decode_matches_each_row_alone_qwen2() {
    check("tiny-qwen2");
}

#[test]
fn batched_decode_matches_each_row_alone_qwen3() {
    check("tiny-qwen3");
}

#[test]
fn batched_decode_matches_each_row_alone_lfm2_with_convolution_states() {
    check("tiny-lfm2");
}

#[test]
fn batched_decode_matches_each_row_alone_qwen3_next_with_recurrent_states() {
    check("tiny-qwen3-next");
}

#[test]
fn batched_decode_matches_each_row_alone_nemotron_h_with_mamba2_states() {
    check("tiny-nemotron-h");
}

#[test]
fn a_batch_of_one_is_the_single_sequence_path() {
    let (model, _) = load(&goldens().join("tiny-qwen3"), &LoadOptions::default()).unwrap();
    let p = &prompts()[1];
    // One row takes the single-sequence path: the same kernels, so no TF32 slack and no
    // near-tie allowance.
    let r = batched(&model, std::slice::from_ref(p), 12, 1e-5);
    assert_eq!(r.tokens[0], greedy_ids(&model, p, 12).unwrap());
    assert!(r.worst < 1e-5, "{}", r.worst);
}

#[test]
fn a_batched_step_needs_one_token_per_row() {
    let (model, _) = load(&goldens().join("tiny-llama"), &LoadOptions::default()).unwrap();
    let mut rows = PagedKvRows::new();
    assert!(model.forward_rows(&[1, 2], &mut rows).is_err());
    assert!(model.forward_rows(&[], &mut rows).is_err());
}
