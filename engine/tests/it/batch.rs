//! Batched decode ([`engine::Model::forward_rows`]) against each row decoded alone.

use cache::{KvCache, PagedConfig, PagedKvCache, PagedKvRows};
use engine::{
    argmax, greedy_ids, load, Engine, EngineConfig, GenerateParams, KvTiers, LoadOptions, Model,
    PromptChunk, Request, DEFAULT_PREFILL_CHUNK,
};

use crate::common::{goldens, logit_tol, max_diff, near_tie};

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
/// A model with recurrent state layers (Mamba2, gated delta, convolutions) carries each
/// step's rounding into the next through its state: on CUDA (TF32) the tiny Nemotron-H's
/// batched logits came 1.45 times `logit_tol`'s 4u from the row's alone (H100, session 41),
/// so such models get twice its TF32 part. On the CPU u is 2^-24 and `base` decides.
fn batched(model: &Model, prompts: &[Vec<u32>], n: usize, base: f32, arena: bool) -> Batched {
    let carried = if model.info().kv.state_layers > 0 {
        2.0
    } else {
        1.0
    };
    let mut rows = PagedKvRows::new();
    rows.set_batch_arena(arena).unwrap();
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
            let tol = base + carried * (logit_tol(base, &single) - base);
            for (x, y) in row.iter().zip(&single) {
                worst = worst.max((x - y).abs());
                worst_ratio = worst_ratio.max((x - y).abs() / tol);
            }
            if tie[b].is_none() && near_tie(&single, tol) {
                tie[b] = Some(out[b].len());
            }
            out[b].push(argmax(row));
        }
        assert_eq!(rows.has_arena(), arena && n > 1);
    }
    // While an arena holds the batch it is the only home of the rows' KV.
    for (i, a) in alone.iter().enumerate() {
        let r = rows.row(i).unwrap();
        assert_eq!(r.is_lent(), arena && n > 1);
        assert_eq!(
            r.offset(),
            a.offset(),
            "row {i}'s length counts the arena's"
        );
    }
    // Every row's cache holds what it holds alone once the batch lets go of it: the arena
    // gave it its whole KV back.
    let keep: Vec<usize> = Vec::new();
    for (got, want) in rows.filter(&keep).unwrap().iter().zip(&alone) {
        assert_kv_close(got, want);
    }
    Batched {
        tokens: out,
        worst,
        worst_ratio,
        tie,
    }
}

/// Asserts that `got` holds the KV `want` holds (computed in a batch and alone: equal up to
/// float rounding) and holds it itself (no arena lends it). The rounding is that of the
/// projections' f32 products: TF32 on CUDA, whose error grows with the values' size, as
/// `logit_tol` says of logits (docs/cuda.md, "Tolerances on the GPU").
fn assert_kv_close(got: &PagedKvCache, want: &PagedKvCache) {
    assert!(!got.is_lent());
    assert_eq!(got.offset(), want.offset());
    for l in 0..want.layers() {
        let (Some((gk, gv)), Some((wk, wv))) = (got.fetch(l).unwrap(), want.fetch(l).unwrap())
        else {
            assert!(got.fetch(l).unwrap().is_none() && want.fetch(l).unwrap().is_none());
            continue;
        };
        for (g, w) in [(gk, wk), (gv, wv)] {
            assert_eq!(g.shape(), w.shape(), "layer {l}");
            let (g, w) = (
                g.astype(mlx::Dtype::F32).unwrap().to_vec::<f32>().unwrap(),
                w.astype(mlx::Dtype::F32).unwrap().to_vec::<f32>().unwrap(),
            );
            let gap = g
                .iter()
                .zip(&w)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            let tol = logit_tol(1e-3, &w);
            assert!(
                gap < tol,
                "layer {l}: cached KV differs by {gap} (allowed {tol})"
            );
        }
    }
}

/// The tokens up to (without) a row's first near tie: where both runs must agree.
fn until_tie(tokens: &[u32], tie: Option<usize>) -> &[u32] {
    &tokens[..tie.unwrap_or(tokens.len()).min(tokens.len())]
}

fn check(name: &str) {
    check_with(name, false);
}

fn check_with(name: &str, arena: bool) {
    let (model, _) = load(&goldens().join(name), &LoadOptions::default()).unwrap();
    let prompts = prompts();
    let r = batched(&model, &prompts, 16, 1e-4, arena);
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
fn batched_decode_in_a_batch_arena_matches_each_row_alone_llama() {
    check_with("tiny-llama", true);
}

#[test]
fn batched_decode_in_a_batch_arena_matches_each_row_alone_qwen3() {
    check_with("tiny-qwen3", true);
}

#[test]
fn batched_decode_in_a_batch_arena_matches_each_row_alone_qwen2() {
    check_with("tiny-qwen2", true);
}

#[test]
fn a_batch_arena_holds_the_rows_kv_and_gives_it_back_when_the_batch_changes() {
    let (model, _) = load(&goldens().join("tiny-llama"), &LoadOptions::default()).unwrap();
    let ps = prompts();
    let mut rows = PagedKvRows::new();
    rows.set_batch_arena(true).unwrap();
    let mut lens = Vec::new();
    for p in &ps[1..] {
        let mut c = model.empty_cache(PagedConfig::default()).unwrap();
        model.prefill(p, &mut c, DEFAULT_PREFILL_CHUNK).unwrap();
        lens.push(p.len());
        rows.push(c).unwrap();
    }
    for step in 1..=3 {
        model.forward_rows(&[7, 8], &mut rows).unwrap();
        assert!(rows.has_arena());
        // The arena holds the rows' KV; their caches keep exact lengths.
        let offs: Vec<i32> = rows.offsets().unwrap().to_vec().unwrap();
        let want: Vec<i32> = lens.iter().map(|l| (l + step) as i32).collect();
        assert_eq!(offs, want);
        let row = rows.row(0).unwrap();
        assert_eq!(row.offset(), lens[0] + step);
        assert!(row.is_lent() && row.pool(0).is_none() && row.device_bytes() == 0);
    }
    // A shorter row joins the arena (written into a free slot); the others keep their
    // tokens in it, where they are.
    let mut c = model.empty_cache(PagedConfig::default()).unwrap();
    model
        .prefill(&ps[0], &mut c, DEFAULT_PREFILL_CHUNK)
        .unwrap();
    rows.push(c).unwrap();
    assert!(rows.has_arena());
    assert!(
        rows.row(2).unwrap().is_lent(),
        "a joining row gives its pools up"
    );
    let offs: Vec<i32> = rows.offsets().unwrap().to_vec().unwrap();
    assert_eq!(
        offs,
        vec![
            (lens[0] + 3) as i32,
            (lens[1] + 3) as i32,
            ps[0].len() as i32
        ]
    );
    model.forward_rows(&[7, 8, 9], &mut rows).unwrap();
    // The joined row leaves with every token it decoded; the others stay in the arena.
    let gone = rows.filter(&[0, 1]).unwrap();
    assert!(rows.has_arena());
    assert_eq!(gone[0].offset(), ps[0].len() + 1);
    assert!(!gone[0].is_lent() && gone[0].fetch(0).unwrap().is_some());
    model.forward_rows(&[7, 9], &mut rows).unwrap();
    // A row longer than the arena's rows, and than its columns, joins it too.
    let long: Vec<u32> = (0..300u32).map(|i| i % 200 + 3).collect();
    let mut c = model.empty_cache(PagedConfig::default()).unwrap();
    model.prefill(&long, &mut c, DEFAULT_PREFILL_CHUNK).unwrap();
    rows.push(c).unwrap();
    assert!(rows.has_arena());
    for i in 0..3 {
        assert!(rows.row(i).unwrap().is_lent(), "row {i}");
    }
    assert_eq!(rows.row(0).unwrap().offset(), lens[0] + 5);
    assert_eq!(rows.row(1).unwrap().offset(), lens[1] + 5);
    model.forward_rows(&[7, 9, 11], &mut rows).unwrap();
    assert!(rows.has_arena());
    let caches = rows.into_rows().unwrap();
    let offs: Vec<usize> = caches.iter().map(|c| c.offset()).collect();
    assert_eq!(offs, vec![lens[0] + 6, lens[1] + 6, long.len() + 1]);
}

/// One batched decode step of `rows` (row b's last token `last[b]`), each row's logits
/// checked against those of the same step decoded alone on `alone[ids[b]]`; `last` gets
/// each row's greedy next token.
fn step_as_alone(
    model: &Model,
    rows: &mut PagedKvRows,
    alone: &mut [PagedKvCache],
    last: &mut [u32],
    ids: &[usize],
) {
    let logits: Vec<f32> = model.forward_rows(last, rows).unwrap().to_vec().unwrap();
    let vocab = logits.len() / last.len();
    for (b, row) in logits.chunks(vocab).enumerate() {
        let single: Vec<f32> = model
            .forward(&[last[b]], &mut alone[ids[b]])
            .unwrap()
            .to_vec()
            .unwrap();
        let tol = logit_tol(1e-4, &single);
        assert!(
            max_diff(row, &single) < tol,
            "row {b}: {} > {tol}",
            max_diff(row, &single)
        );
        last[b] = argmax(&single);
    }
}

/// Rows joining and leaving a batch arena mid-decode get the logits each gets alone.
#[test]
fn rows_joining_and_leaving_a_batch_arena_decode_as_alone() {
    let (model, _) = load(&goldens().join("tiny-llama"), &LoadOptions::default()).unwrap();
    let ps = prompts();
    let mut rows = PagedKvRows::new();
    rows.set_batch_arena(true).unwrap();
    let mut alone: Vec<PagedKvCache> = Vec::new();
    let mut last: Vec<u32> = Vec::new();
    let mut ids: Vec<usize> = Vec::new();
    let step = |rows: &mut PagedKvRows,
                alone: &mut [PagedKvCache],
                last: &mut [u32],
                ids: &[usize]| { step_as_alone(&model, rows, alone, last, ids) };
    // The longest first, so the shorter ones join the arena it holds.
    for (i, p) in ps.iter().enumerate().rev() {
        let mut c = model.empty_cache(PagedConfig::default()).unwrap();
        let logits = model.prefill(p, &mut c, DEFAULT_PREFILL_CHUNK).unwrap();
        alone.push(c.clone());
        rows.push(c).unwrap();
        last.push(argmax(&logits.to_vec::<f32>().unwrap()));
        ids.push(ps.len() - 1 - i);
        for _ in 0..3 {
            step(&mut rows, &mut alone, &mut last, &ids);
            assert!(rows.has_arena());
        }
    }
    // Joins and leaves in every position, each leaving row with its KV; the others decode
    // on in the arena, where they are.
    let leave = |rows: &mut PagedKvRows,
                 alone: &[PagedKvCache],
                 keep: &[usize],
                 last: &mut Vec<u32>,
                 ids: &mut Vec<usize>| {
        let gone = rows.filter(keep).unwrap();
        let leaving: Vec<usize> = (0..ids.len()).filter(|i| !keep.contains(i)).collect();
        assert_eq!(gone.len(), leaving.len());
        for (c, &i) in gone.iter().zip(&leaving) {
            assert_kv_close(c, &alone[ids[i]]);
        }
        *last = keep.iter().map(|&i| last[i]).collect();
        *ids = keep.iter().map(|&i| ids[i]).collect();
    };
    let join = |rows: &mut PagedKvRows,
                alone: &mut Vec<PagedKvCache>,
                p: &[u32],
                last: &mut Vec<u32>,
                ids: &mut Vec<usize>| {
        let mut c = model.empty_cache(PagedConfig::default()).unwrap();
        let logits = model.prefill(p, &mut c, DEFAULT_PREFILL_CHUNK).unwrap();
        alone.push(c.clone());
        rows.push(c).unwrap();
        last.push(argmax(&logits.to_vec::<f32>().unwrap()));
        ids.push(alone.len() - 1);
        assert!(rows.has_arena(), "a row of {} tokens joins", p.len());
    };
    // The first row leaves.
    leave(&mut rows, &alone, &[1, 2], &mut last, &mut ids);
    step(&mut rows, &mut alone, &mut last, &ids);
    // A row longer than every other, and than the arena's 256 columns, joins.
    let long: Vec<u32> = (0..300u32).map(|i| (i * 13) % 200 + 3).collect();
    join(&mut rows, &mut alone, &long, &mut last, &mut ids);
    for _ in 0..2 {
        step(&mut rows, &mut alone, &mut last, &ids);
        assert!(rows.has_arena());
    }
    // The middle row leaves; a short row joins its slot.
    leave(&mut rows, &alone, &[0, 2], &mut last, &mut ids);
    step(&mut rows, &mut alone, &mut last, &ids);
    join(&mut rows, &mut alone, &ps[0], &mut last, &mut ids);
    step(&mut rows, &mut alone, &mut last, &ids);
    // The last row leaves, then every row at once: the arena goes.
    leave(&mut rows, &alone, &[0, 1], &mut last, &mut ids);
    step(&mut rows, &mut alone, &mut last, &ids);
    assert!(rows.has_arena());
    leave(&mut rows, &alone, &[], &mut last, &mut ids);
    assert!(!rows.has_arena());
    assert!(rows.is_empty());
}

/// Rows of very different lengths share one arena (each in its own slot, left-aligned)
/// and get the logits each gets alone.
#[test]
fn rows_of_very_different_lengths_share_a_batch_arena_and_decode_as_alone() {
    let (model, _) = load(&goldens().join("tiny-llama"), &LoadOptions::default()).unwrap();
    let mut rows = PagedKvRows::new();
    rows.set_batch_arena(true).unwrap();
    let mut alone = Vec::new();
    let mut last = Vec::new();
    for n in [200usize, 2, 37] {
        let p: Vec<u32> = (0..n as u32).map(|i| i % 200 + 3).collect();
        let mut c = model.empty_cache(PagedConfig::default()).unwrap();
        let logits = model.prefill(&p, &mut c, DEFAULT_PREFILL_CHUNK).unwrap();
        alone.push(c.clone());
        rows.push(c).unwrap();
        last.push(argmax(&logits.to_vec::<f32>().unwrap()));
    }
    for _ in 0..4 {
        step_as_alone(&model, &mut rows, &mut alone, &mut last, &[0, 1, 2]);
        assert!(rows.has_arena());
    }
    for (got, want) in rows.into_rows().unwrap().iter().zip(&alone) {
        assert_kv_close(got, want);
    }
}

#[test]
fn a_batch_of_one_is_the_single_sequence_path() {
    let (model, _) = load(&goldens().join("tiny-qwen3"), &LoadOptions::default()).unwrap();
    let p = &prompts()[1];
    // One row takes the single-sequence path: the same kernels, so no TF32 slack and no
    // near-tie allowance.
    let r = batched(&model, std::slice::from_ref(p), 12, 1e-5, false);
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

/// One KV budget: with the batch arena forced on, the device KV the engine holds (the
/// decoding batch with its arena, the caches being prefilled, the resident sequences) stays
/// within `--kv-budget`. Each request reserves exactly one pool's initial capacity (128
/// tokens of blocks of 8), so no capacity slack enters; the arena's padding beyond the
/// rows' reservations is charged to the device tier, which evicts for it.
#[test]
fn an_engine_with_a_batch_arena_keeps_its_device_kv_within_the_kv_budget() {
    let dir = tempfile::tempdir().unwrap();
    let (model, tok) = load(&goldens().join("tiny-llama"), &LoadOptions::default()).unwrap();
    let kv = model.info().kv;
    let per_token = (kv.layers * 2 * kv.kv_heads * kv.head_dim * kv.dtype.size()) as u64;
    let reuse = crate::common::reuse_config(dir.path(), 8);
    let tiers = KvTiers::open(&model, &tok, reuse).unwrap();
    // Three live reservations (384 tokens), and 640 tokens for the arena's padding (4 slots
    // × 256 columns) or resident sequences.
    let budget = 8 * 128 * per_token;
    let config = EngineConfig {
        kv_budget_bytes: budget,
        max_batch: 3,
        batch_arena: Some(true),
        ..EngineConfig::default()
    };
    let engine = Engine::open(model, tok, Some(tiers), config).unwrap();
    // Distinct prompts (no shared blocks, whose buffers would be counted twice).
    let handles: Vec<_> = (0..6u32)
        .map(|r| {
            let prompt: Vec<u32> = (0..24u32).map(|i| (i * 7 + r * 31) % 200 + 3).collect();
            let params = GenerateParams {
                max_tokens: 104,
                stop_at_eos: false,
                ..GenerateParams::default()
            };
            engine.submit(Request::new(prompt, params)).unwrap()
        })
        .collect();
    for h in handles {
        assert_eq!(h.wait().unwrap().completion_tokens, 104);
    }
    let m = engine.metrics();
    assert!(
        m.batch_arena_steps > 0,
        "no step ran in a batch arena: {m:?}"
    );
    assert!(
        m.decode_rows > m.decode_steps,
        "requests decoded together: {m:?}"
    );
    assert!(m.kv_device_peak_bytes > 3 * 24 * per_token);
    assert!(
        m.kv_device_peak_bytes <= budget,
        "device KV peaked at {} bytes under a budget of {budget}",
        m.kv_device_peak_bytes
    );
}

/// The test prompts prefilled as two identical batches of rows (one for the pass under
/// test, one for the reference) and each row's next token.
fn twin_rows(model: &Model) -> (PagedKvRows, PagedKvRows, Vec<u32>) {
    let mut mixed_rows = PagedKvRows::new();
    let mut apart_rows = PagedKvRows::new();
    let mut last = Vec::new();
    for p in prompts() {
        let mut c = model.empty_cache(PagedConfig::default()).unwrap();
        let logits = model.prefill(&p, &mut c, DEFAULT_PREFILL_CHUNK).unwrap();
        last.push(argmax(&logits.to_vec::<f32>().unwrap()));
        apart_rows.push(c.clone()).unwrap();
        mixed_rows.push(c).unwrap();
    }
    (mixed_rows, apart_rows, last)
}

/// Checks a mixed step's row logits against a decode step of `last` over `apart_rows`
/// (within the batched bound) and returns the reference logits, `[B · vocab]`.
fn rows_match_apart(
    name: &str,
    model: &Model,
    step: &engine::MixedStep,
    last: &[u32],
    apart_rows: &mut PagedKvRows,
) -> Vec<f32> {
    let rows: Vec<f32> = step.rows_logits.to_vec().unwrap();
    let want_rows: Vec<f32> = model
        .forward_rows(last, apart_rows)
        .unwrap()
        .to_vec()
        .unwrap();
    let vocab = rows.len() / last.len();
    for (b, (g, w)) in rows.chunks(vocab).zip(want_rows.chunks(vocab)).enumerate() {
        let gap = max_diff(g, w);
        assert!(gap < logit_tol(1e-4, w), "{name}: row {b} differs by {gap}");
    }
    want_rows
}

/// A mixed step ([`Model::forward_mixed`]: a decode step of the rows and a prefill chunk
/// of another prompt in one forward pass) gives what the two give apart: each row's logits
/// within the batched bound, and the chunk's last logits and every cache's keys and values
/// within float rounding. Two mixed steps: a chunk that does not end its prompt, then one
/// that does.
fn mixed_step_matches_the_two_apart(name: &str) {
    let (model, _) = load(&goldens().join(name), &LoadOptions::default()).unwrap();
    let (mut mixed_rows, mut apart_rows, mut last) = twin_rows(&model);
    // A prompt of 70 tokens, 20 of them cached: chunks of 33 and 17 tokens after them.
    let prompt: Vec<u32> = (0..70u32).map(|i| (i * 7919 + 11) % 250 + 3).collect();
    let mut mixed_cache = model.empty_cache(PagedConfig::default()).unwrap();
    model
        .prefill(&prompt[..20], &mut mixed_cache, DEFAULT_PREFILL_CHUNK)
        .unwrap();
    let mut apart_cache = mixed_cache.clone();
    for (from, to) in [(20, 53), (53, 70)] {
        let chunk = &prompt[from..to];
        let ids = mlx::Array::from_slice(&last, &[last.len() as i32]).unwrap();
        let mut prompts = [PromptChunk {
            tokens: chunk,
            cache: &mut mixed_cache,
        }];
        let step = model
            .forward_mixed(&ids, &mut mixed_rows, &mut prompts)
            .unwrap()
            .expect("this family has a mixed pass");
        let want_rows = rows_match_apart(name, &model, &step, &last, &mut apart_rows);
        let got: Vec<f32> = step.prompts[0].logits.to_vec().unwrap();
        let want: Vec<f32> = model
            .forward(chunk, &mut apart_cache)
            .unwrap()
            .to_vec()
            .unwrap();
        let vocab = want.len();
        let gap = max_diff(&got, &want);
        assert!(
            gap < logit_tol(1e-4, &want),
            "{name}: chunk logits differ by {gap}"
        );
        last = want_rows.chunks(vocab).map(argmax).collect();
    }
    assert_kv_close(&mixed_cache, &apart_cache);
    let keep: Vec<usize> = (0..prompts().len()).collect();
    let got = mixed_rows.filter(&keep).unwrap();
    let want = apart_rows.filter(&keep).unwrap();
    for (g, w) in got.iter().zip(&want) {
        assert_kv_close(g, w);
    }
}

#[test]
fn a_mixed_step_matches_the_two_apart_llama() {
    mixed_step_matches_the_two_apart("tiny-llama");
}

#[test]
fn a_mixed_step_matches_the_two_apart_qwen3() {
    mixed_step_matches_the_two_apart("tiny-qwen3");
}

/// Several prompts in one pass (the oldest's chunk and riders: a fresh prompt and one
/// after a cached prefix) give what each gives alone: each prompt's last logits and cache
/// within float rounding, and, in a mixed pass (`with_rows`), the rows' logits within the
/// batched bound; without rows it is the packed prefill pass ([`Model::forward_prompts`]).
fn several_prompts_in_one_pass_match_each_alone(name: &str, with_rows: bool) {
    let (model, _) = load(&goldens().join(name), &LoadOptions::default()).unwrap();
    let (mut mixed_rows, mut apart_rows, last) = twin_rows(&model);
    let prompt =
        |seed: u32, n: u32| -> Vec<u32> { (0..n).map(|i| (i * 7919 + seed) % 250 + 3).collect() };
    // A 40-token chunk after 24 cached tokens, a fresh 9-token prompt, 13 tokens after 5.
    let (a, b, c) = (prompt(11, 64), prompt(17, 9), prompt(29, 18));
    let cached = [24, 0, 5];
    let mut mixed: Vec<_> = [&a, &b, &c]
        .iter()
        .zip(cached)
        .map(|(p, n)| {
            let mut cache = model.empty_cache(PagedConfig::default()).unwrap();
            if n > 0 {
                model
                    .prefill(&p[..n], &mut cache, DEFAULT_PREFILL_CHUNK)
                    .unwrap();
            }
            cache
        })
        .collect();
    let mut apart: Vec<_> = mixed.to_vec();
    let ids = mlx::Array::from_slice(&last, &[last.len() as i32]).unwrap();
    let chunks: Vec<&[u32]> = vec![&a[24..], &b[..], &c[5..]];
    let mut parts: Vec<PromptChunk> = chunks
        .iter()
        .zip(mixed.iter_mut())
        .map(|(t, cache)| PromptChunk { tokens: t, cache })
        .collect();
    let prompts = if with_rows {
        let step = model
            .forward_mixed(&ids, &mut mixed_rows, &mut parts)
            .unwrap()
            .expect("this family has a mixed pass");
        rows_match_apart(name, &model, &step, &last, &mut apart_rows);
        step.prompts
    } else {
        let before = mixed_rows.row(0).unwrap().offset();
        let passes = model
            .forward_prompts(&mut parts)
            .unwrap()
            .expect("this family has a packed prefill pass");
        assert_eq!(
            mixed_rows.row(0).unwrap().offset(),
            before,
            "{name}: rows moved"
        );
        passes
    };
    drop(parts);
    assert_eq!(prompts.len(), 3);
    for (i, ((part, chunk), cache)) in prompts.iter().zip(&chunks).zip(&mut apart).enumerate() {
        let want: Vec<f32> = model.forward(chunk, cache).unwrap().to_vec().unwrap();
        let got: Vec<f32> = part.logits.to_vec().unwrap();
        let gap = max_diff(&got, &want);
        assert!(
            gap < logit_tol(1e-4, &want),
            "{name}: prompt {i}'s logits differ by {gap}"
        );
        assert_eq!(mixed[i].offset(), cached[i] + chunk.len());
        assert_kv_close(&mixed[i], cache);
    }
}

#[test]
fn a_mixed_step_with_several_prompts_matches_each_alone_llama() {
    several_prompts_in_one_pass_match_each_alone("tiny-llama", true);
}

#[test]
fn a_mixed_step_with_several_prompts_matches_each_alone_qwen3() {
    several_prompts_in_one_pass_match_each_alone("tiny-qwen3", true);
}

#[test]
fn a_packed_prefill_pass_matches_each_prompt_alone_llama() {
    several_prompts_in_one_pass_match_each_alone("tiny-llama", false);
}

#[test]
fn a_packed_prefill_pass_matches_each_prompt_alone_qwen3() {
    several_prompts_in_one_pass_match_each_alone("tiny-qwen3", false);
}

/// A family without a mixed pass (a hybrid) says so and changes nothing.
#[test]
fn a_hybrid_has_no_mixed_pass_and_is_left_unchanged() {
    let (model, _) = load(&goldens().join("tiny-lfm2"), &LoadOptions::default()).unwrap();
    let mut rows = PagedKvRows::new();
    let mut c = model.empty_cache(PagedConfig::default()).unwrap();
    model
        .prefill(&[5, 6, 7], &mut c, DEFAULT_PREFILL_CHUNK)
        .unwrap();
    rows.push(c).unwrap();
    let mut cache = model.empty_cache(PagedConfig::default()).unwrap();
    let ids = mlx::Array::from_slice(&[9u32], &[1]).unwrap();
    let mut prompts = [PromptChunk {
        tokens: &[3, 4, 5],
        cache: &mut cache,
    }];
    let step = model.forward_mixed(&ids, &mut rows, &mut prompts).unwrap();
    assert!(step.is_none());
    assert_eq!(cache.offset(), 0);
    assert_eq!(rows.row(0).unwrap().offset(), 3);
}

/// `Engine::shutdown` writes what the RAM tier holds to the SSD; `close_without_flush`
/// (`bench trace --no-flush`) lets it go: a fresh store on the same directory finds the
/// request's blocks after the one and none after the other (the default RAM tier holds
/// them all, so nothing was spilled before).
#[test]
fn closing_without_a_flush_leaves_the_ram_tiers_blocks_unwritten() {
    let ssd_blocks_after = |flush: bool| {
        let dir = tempfile::tempdir().unwrap();
        let (model, tok) = load(&goldens().join("tiny-llama"), &LoadOptions::default()).unwrap();
        let tiers = KvTiers::open(&model, &tok, crate::common::reuse_config(dir.path(), 8));
        let engine = Engine::open(model, tok, Some(tiers.unwrap()), EngineConfig::default());
        let engine = engine.unwrap();
        let prompt: Vec<u32> = (0..40u32).map(|i| (i * 11) % 200 + 3).collect();
        let params = GenerateParams {
            max_tokens: 4,
            stop_at_eos: false,
            ..GenerateParams::default()
        };
        let done = engine.submit(Request::new(prompt, params)).unwrap().wait();
        assert_eq!(done.unwrap().completion_tokens, 4);
        if flush {
            engine.shutdown(false).unwrap();
            drop(engine);
        } else {
            engine.close_without_flush();
        }
        let store = store::Store::open(store::StoreConfig::default().root(dir.path())).unwrap();
        store.stats().ssd_blocks
    };
    assert!(
        ssd_blocks_after(true) >= 5,
        "a flush writes the prompt's 5 blocks"
    );
    assert_eq!(ssd_blocks_after(false), 0);
}
