//! Batched decode ([`engine::Model::forward_rows`]) against each row decoded alone.

use cache::{PagedConfig, PagedKvCache, PagedKvRows};
use engine::{argmax, greedy_ids, load, LoadOptions, Model, DEFAULT_PREFILL_CHUNK};

use crate::common::goldens;

fn prompts() -> Vec<Vec<u32>> {
    // Three lengths that pad differently inside the batch and straddle a 32-token block.
    let mk = |n: usize, seed: u32| -> Vec<u32> {
        (0..n as u32)
            .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed) >> 7) % 250 + 3)
            .collect()
    };
    vec![mk(5, 1), mk(19, 2), mk(41, 3)]
}

/// Greedy tokens of every prompt decoded together, and the largest |logit| gap to each row's
/// logits computed alone at the same step.
fn batched(model: &Model, prompts: &[Vec<u32>], n: usize) -> (Vec<Vec<u32>>, f32) {
    let layers = model.info().kv.layers;
    let mut rows = PagedKvRows::new();
    let mut alone: Vec<PagedKvCache> = Vec::new();
    let mut out: Vec<Vec<u32>> = Vec::new();
    for p in prompts {
        let mut c = PagedKvCache::new(layers, PagedConfig::default()).unwrap();
        let logits = model.prefill(p, &mut c, DEFAULT_PREFILL_CHUNK).unwrap();
        out.push(vec![argmax(&logits.to_vec::<f32>().unwrap())]);
        alone.push(c.clone());
        rows.push(c).unwrap();
    }
    let mut worst = 0f32;
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
            for (x, y) in row.iter().zip(&single) {
                worst = worst.max((x - y).abs());
            }
            out[b].push(argmax(row));
        }
    }
    (out, worst)
}

fn check(name: &str) {
    let (model, _) = load(&goldens().join(name), &LoadOptions::default()).unwrap();
    let prompts = prompts();
    let (tokens, worst) = batched(&model, &prompts, 16);
    for (p, got) in prompts.iter().zip(&tokens) {
        assert_eq!(got, &greedy_ids(&model, p, 16).unwrap(), "{name}");
    }
    assert!(worst < 1e-4, "{name}: batched logits differ by {worst}");
    eprintln!("{name}: max |batched - alone| logit = {worst:e}");
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
fn a_batch_of_one_is_the_single_sequence_path() {
    let (model, _) = load(&goldens().join("tiny-qwen3"), &LoadOptions::default()).unwrap();
    let p = &prompts()[1];
    let (tokens, worst) = batched(&model, std::slice::from_ref(p), 12);
    assert_eq!(tokens[0], greedy_ids(&model, p, 12).unwrap());
    assert!(worst < 1e-5, "{worst}");
}

#[test]
fn a_batched_step_needs_one_token_per_row() {
    let (model, _) = load(&goldens().join("tiny-llama"), &LoadOptions::default()).unwrap();
    let mut rows = PagedKvRows::new();
    assert!(model.forward_rows(&[1, 2], &mut rows).is_err());
    assert!(model.forward_rows(&[], &mut rows).is_err());
}
