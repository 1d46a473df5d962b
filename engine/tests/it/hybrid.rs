//! Hybrid models (non-attention layers whose state the cache carries beside its KV): LFM2's
//! parity with mlx-lm (goldens by scripts/goldens/make_hybrid_goldens.py), chunked prefill,
//! the one-step-ahead trim of a convolution state, the device tier's state-exact hits, and
//! serving (batched decode, chunked prefill) through the engine.

use std::path::{Path, PathBuf};

use cache::{KvCache, PagedKvCache};
use engine::{
    generate_with_reuse, load, namespace_description, Engine, EngineConfig, Event, GenerateParams,
    KvTiers, LayerKind, LoadOptions, Model, Request, ReuseConfig, ReuseReport, Tokenizer,
};
use store::StoreConfig;

use crate::common::{
    assert_cold_greedy, check_against_mlx_lm, goldens, logit_tol, max_diff, no_eos, tokens,
};

/// f32 on both sides, same libmlx. The convolution is three multiply-adds here and one
/// `conv1d` in mlx-lm: only the summation order differs. Measured max 9.1e-6.
const LFM2_TOL: f32 = 1e-4;

fn lfm2() -> PathBuf {
    goldens().join("tiny-lfm2")
}

fn qwen3_next() -> PathBuf {
    goldens().join("tiny-qwen3-next")
}

/// f32 on both sides; the DeltaNet recurrence is the same ops in the same order as
/// mlx-lm's `gated_delta_ops`. Measured max 2.6e-5.
const QWEN3_NEXT_TOL: f32 = 1e-4;

#[test]
fn tiny_qwen3_next_with_gated_deltanet_matches_mlx_lm() {
    check_against_mlx_lm(
        "hybrid.json",
        "tiny-qwen3-next",
        &qwen3_next(),
        &LoadOptions::default(),
        QWEN3_NEXT_TOL,
    );
}

#[test]
fn qwen3_next_layers_alternate_deltanet_and_attention_and_carry_two_state_arrays() {
    let (model, tok) = load(&qwen3_next(), &LoadOptions::default()).unwrap();
    let r = LayerKind::Recurrent;
    assert_eq!(
        model.layer_kinds(),
        vec![r, LayerKind::Global, r, LayerKind::Global]
    );
    assert_eq!(
        model.state_shapes(),
        vec![vec![vec![1, 3, 96], vec![1, 4, 8, 16]]; 2]
    );
    let dir = tempfile::tempdir().unwrap();
    let d = namespace_description(&model, &tok, &config(dir.path())).unwrap();
    assert_eq!(d.state_planes.len(), 4);
    assert_eq!(d.state_planes[3].name, "states.1.1");
    assert_eq!(d.state_planes[3].shape, vec![4, 8, 16]);
}

fn nemotron_h() -> PathBuf {
    goldens().join("tiny-nemotron-h")
}

/// f32 on both sides; mlx-lm's CPU path computes the Mamba-2 recurrence in chunks (decays
/// as exponentials of cumulative sums), the engine token by token (products of
/// exponentials): the same sums in another order. Measured max 6.7e-6.
const NEMOTRON_H_TOL: f32 = 1e-4;

#[test]
fn tiny_nemotron_h_with_mamba2_layers_matches_mlx_lm() {
    check_against_mlx_lm(
        "hybrid.json",
        "tiny-nemotron-h",
        &nemotron_h(),
        &LoadOptions::default(),
        NEMOTRON_H_TOL,
    );
}

#[test]
fn nemotron_h_layers_follow_the_pattern_and_carry_conv_and_ssm_states() {
    let (model, _) = load(&nemotron_h(), &LoadOptions::default()).unwrap();
    assert_eq!(
        model.layer_kinds(),
        vec![
            LayerKind::Recurrent,
            LayerKind::Global,
            LayerKind::Recurrent,
            LayerKind::Mlp
        ]
    );
    assert_eq!(
        (model.kv_layout().layers, model.kv_layout().state_layers),
        (1, 2)
    );
    assert_eq!(
        model.state_shapes(),
        vec![vec![vec![1, 3, 128], vec![1, 4, 16, 16]]; 2]
    );
    let prompt = tokens(12, 70, model.info().vocab_size);
    chunked_prefill_matches_one_step(&model, &prompt, &[1, 3, 37]);
}

#[test]
fn nemotron_h_restored_prefixes_between_snapshots_match_cold_output_from_ram_and_ssd() {
    restored_between_snapshots(&nemotron_h(), &[(1, 40), (3, 90)]);
}

/// `--state-every auto`: the fewest blocks whose K/V outweighs one snapshot. tiny-lfm2's
/// snapshot is 1 KiB (2 layers of 2 × 64 inputs), a 4-token block's K/V 2 KiB: every block.
/// tiny-qwen3-next's is 6.25 KiB (2 × (3 × 96 + 4 × 8 × 16) floats): every 4th block.
#[test]
fn auto_state_snapshots_cost_at_most_the_kv_of_the_blocks_between_them() {
    for (path, every) in [(lfm2(), 1), (qwen3_next(), 4)] {
        let (model, tok) = load(&path, &LoadOptions::default()).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let config = ReuseConfig {
            block_size: 4,
            state_every: None,
            ..config(dir.path())
        };
        let d = namespace_description(&model, &tok, &config).unwrap();
        assert_eq!(engine::auto_state_every(&d), every, "{}", path.display());
        let pc = KvTiers::open(&model, &tok, config).unwrap();
        assert_eq!(pc.state_every(), every);
    }
}

#[test]
fn qwen3_next_prefill_in_chunks_carries_the_recurrent_state_across_them() {
    let (model, _) = load(&qwen3_next(), &LoadOptions::default()).unwrap();
    let prompt = tokens(9, 90, model.info().vocab_size);
    chunked_prefill_matches_one_step(&model, &prompt, &[1, 3, 37]);
}

#[test]
fn tiny_lfm2_with_short_convolutions_matches_mlx_lm() {
    check_against_mlx_lm(
        "hybrid.json",
        "tiny-lfm2",
        &lfm2(),
        &LoadOptions::default(),
        LFM2_TOL,
    );
}

fn logits(model: &Model, prompt: &[u32], cache: &mut PagedKvCache, chunk: usize) -> Vec<f32> {
    model
        .prefill(prompt, cache, chunk)
        .unwrap()
        .to_vec()
        .unwrap()
}

/// The last logits of `prompt` prefilled in chunks of each size equal one step's, within
/// `logit_tol` (other chunk sizes are other matmul shapes).
fn chunked_prefill_matches_one_step(model: &Model, prompt: &[u32], chunks: &[usize]) {
    let whole = logits(model, prompt, &mut model.new_cache(), 4096);
    let tol = logit_tol(1e-4, &whole);
    for &chunk in chunks {
        let d = max_diff(
            &whole,
            &logits(model, prompt, &mut model.new_cache(), chunk),
        );
        assert!(
            d < tol,
            "chunk {chunk}: logits differ by {d} (allowed {tol})"
        );
    }
}

#[test]
fn lfm2_layers_are_convolutions_and_attention_and_name_the_namespace() {
    let (model, tok) = load(&lfm2(), &LoadOptions::default()).unwrap();
    let c = LayerKind::Conv(3);
    assert_eq!(
        model.layer_kinds(),
        vec![c, LayerKind::Global, c, LayerKind::Global]
    );
    let kv = model.kv_layout();
    assert_eq!(
        (kv.layers, kv.state_layers, kv.kv_heads, kv.head_dim),
        (2, 2, 2, 16)
    );
    let cache = model.new_cache();
    assert_eq!((cache.layers(), cache.state_layers()), (2, 2));
    let dir = tempfile::tempdir().unwrap();
    let d = namespace_description(&model, &tok, &config(dir.path())).unwrap();
    assert_eq!(d.layers, ["conv(3)", "global", "conv(3)", "global"]);
}

#[test]
fn lfm2_prefill_in_chunks_carries_the_convolution_state_across_them() {
    let (model, _) = load(&lfm2(), &LoadOptions::default()).unwrap();
    let prompt = tokens(7, 150, model.info().vocab_size);
    // 1 and 2 are shorter than the 3-tap window; 37 ends mid-block.
    chunked_prefill_matches_one_step(&model, &prompt, &[1, 2, 3, 37, 64]);
}

#[test]
fn lfm2_steps_end_at_state_snapshots_without_changing_the_logits() {
    let (model, _) = load(&lfm2(), &LoadOptions::default()).unwrap();
    let prompt = tokens(8, 100, model.info().vocab_size);
    let whole = logits(&model, &prompt, &mut model.new_cache(), 4096);
    let tol = logit_tol(1e-4, &whole);
    let paged = cache::PagedConfig {
        block_size: 16,
        ..cache::PagedConfig::default()
    };
    let mut snap = model.empty_cache(paged).unwrap().with_state_snapshots(2);
    let d = max_diff(&whole, &logits(&model, &prompt, &mut snap, 45));
    assert!(d < tol, "logits differ by {d} (allowed {tol})");
    // Snapshots at 32, 64 and 96 tokens though the chunks end at 45 and 90.
    for at in [32, 64, 96] {
        assert!(
            snap.states().state_at(0, at).is_some(),
            "no snapshot at {at}"
        );
    }
    // The steps ended at 90 and 96 (kept for a one-step-ahead trim), then snapshots.
    assert_eq!(snap.rewind_point(95), 90);
    assert_eq!(snap.rewind_point(89), 64);
    snap.trim(100 - 64).unwrap();
    let resumed: Vec<f32> = logits(&model, &prompt[64..], &mut snap, 4096);
    let d = max_diff(&whole, &resumed);
    assert!(
        d < tol,
        "resumed at a snapshot: logits differ by {d} (allowed {tol})"
    );
}

#[test]
fn lfm2_trim_of_a_step_ahead_returns_the_state_before_it_and_further_trims_are_refused() {
    let (model, _) = load(&lfm2(), &LoadOptions::default()).unwrap();
    let prompt = tokens(3, 40, model.info().vocab_size);
    let mut cache = model.new_cache();
    logits(&model, &prompt, &mut cache, 16);
    // A step computed ahead (token 5), then dropped; token 9 instead.
    model.forward(&[5], &mut cache).unwrap();
    assert_eq!(cache.trim(1).unwrap(), 1);
    let got: Vec<f32> = model.forward(&[9], &mut cache).unwrap().to_vec().unwrap();
    let mut fresh = model.new_cache();
    logits(&model, &prompt, &mut fresh, 16);
    let want: Vec<f32> = model.forward(&[9], &mut fresh).unwrap().to_vec().unwrap();
    assert_eq!(
        got, want,
        "the rewound state computes what a fresh one does"
    );
    // Into the prompt's last 16-token chunk: no state was kept there.
    let before = cache.offset();
    let err = cache.trim(3).unwrap_err();
    assert!(matches!(err, cache::CacheError::Rewind { .. }), "{err}");
    assert_eq!(cache.offset(), before, "a refused trim changes nothing");
}

#[test]
fn lfm2_refuses_a_cache_without_its_convolution_states() {
    let (model, _) = load(&lfm2(), &LoadOptions::default()).unwrap();
    let mut plain = PagedKvCache::with_default_config(2);
    let err = model.forward(&[5, 6], &mut plain).unwrap_err();
    assert!(err.to_string().contains("layer states"), "{err}");
}

fn config(dir: &Path) -> ReuseConfig {
    config_every(dir, 1)
}

/// 16-token blocks, a state snapshot every `state_every` blocks.
fn config_every(dir: &Path, state_every: usize) -> ReuseConfig {
    ReuseConfig {
        state_every: Some(state_every),
        store: StoreConfig::default()
            .root(dir)
            .ram_budget(64 << 20)
            .ssd_budget(256 << 20),
        block_size: 16,
        restore_always: true,
        ..ReuseConfig::default()
    }
}

fn run(
    model: &Model,
    tok: &Tokenizer,
    pc: Option<&KvTiers>,
    prompt: &[u32],
    n: usize,
) -> (Vec<u32>, ReuseReport) {
    let (g, r) = generate_with_reuse(model, tok, pc, prompt, &no_eos(n), &mut |_| true).unwrap();
    (g.tokens, r)
}

/// The device tier hands a finished LFM2 sequence's KV and convolution states to the next
/// turn that extends it, whose output is then the cold output; a prompt that leaves the
/// sequence mid-way resumes at the latest state snapshot before that point (none kept:
/// no hit, never a hit with a wrong state). After a restart the snapshot blocks serve the
/// conversation from SSD.
#[test]
fn lfm2_device_tier_hits_are_state_exact_and_resume_at_snapshots() {
    let (model, tok) = load(&lfm2(), &LoadOptions::default()).unwrap();
    // Snapshots every 0 (none), 1 and 2 blocks of 16: a fork at token 50 resumes at 0, 48
    // and 32; after a restart the 96-token turn (80 tokens in whole blocks) at 0, 80, 64.
    for (every, fork_at, restart_at) in [(0, 0, 0), (1, 48, 80), (2, 32, 64)] {
        device_tier_round(&model, &tok, every, fork_at, restart_at);
    }
}

fn device_tier_round(
    model: &Model,
    tok: &Tokenizer,
    every: usize,
    fork_at: usize,
    restart_at: usize,
) {
    let vocab = model.info().vocab_size;
    let dir = tempfile::tempdir().unwrap();
    let pc = KvTiers::open(model, tok, config_every(dir.path(), every)).unwrap();
    let first = tokens(1, 70, vocab);
    let (reply, _) = run(model, tok, Some(&pc), &first, 6);
    let mut second: Vec<u32> = first.iter().chain(&reply).copied().collect();
    // The last token of a reply ended by its budget was never fed to the model.
    let held = second.len() - 1;
    second.extend(tokens(2, 20, vocab));
    let (got, r2) = run(model, tok, Some(&pc), &second, 8);
    assert_eq!(r2.cached_device_tokens, held, "{r2:?}");
    assert_eq!(r2.state_restored_tokens, held);
    assert_eq!(got, run(model, tok, None, &second, 8).0);
    // Leaves the resident sequence at token 50: resumes at the snapshot before it.
    let mut fork = second[..50].to_vec();
    fork.extend(tokens(3, 10, vocab));
    let (got, r3) = run(model, tok, Some(&pc), &fork, 8);
    assert_eq!(r3.cached_tokens, fork_at, "snapshots every {every}: {r3:?}");
    assert_eq!(got, run(model, tok, None, &fork, 8).0);
    pc.flush().unwrap();
    drop(pc);
    let pc = KvTiers::open(model, tok, config_every(dir.path(), every)).unwrap();
    let (got, r4) = run(model, tok, Some(&pc), &second, 8);
    assert_eq!(
        r4.cached_ssd_tokens, restart_at,
        "snapshots every {every}: {r4:?}"
    );
    assert_eq!(r4.state_recomputed_tokens, 80 - restart_at);
    assert_eq!(got, run(model, tok, None, &second, 8).0);
}

/// Host tiers without the device tier: a cached prefix that ends between state snapshots
/// restores up to the last snapshot block and recomputes the rest; the output is the cold
/// output, from RAM and, after a restart, from SSD.
#[test]
fn lfm2_restored_prefixes_between_snapshots_match_cold_output_from_ram_and_ssd() {
    // (snapshot every k blocks of 16, shared prefix): 40 and 150 end mid-block; with
    // snapshots every 48 tokens, 90 and 130 end two blocks after one (48, 96) and 16 before
    // the first.
    restored_between_snapshots(&lfm2(), &[(1, 40), (1, 150), (3, 90), (3, 130), (3, 16)]);
}

#[test]
fn qwen3_next_restored_prefixes_between_snapshots_match_cold_output_from_ram_and_ssd() {
    restored_between_snapshots(&qwen3_next(), &[(1, 40), (3, 90)]);
}

fn restored_between_snapshots(path: &Path, cases: &[(usize, usize)]) {
    let (model, tok) = load(path, &LoadOptions::default()).unwrap();
    let vocab = model.info().vocab_size;
    let prompt = tokens(11, 200, vocab);
    let want = run(&model, &tok, None, &prompt, 10).0;
    for &(every, p) in cases {
        let span = every * 16;
        let restored = p / span * span;
        let found = p / 16 * 16;
        let dir = tempfile::tempdir().unwrap();
        let host_only = |d: &Path| ReuseConfig {
            kv_budget_bytes: 0,
            ..config_every(d, every)
        };
        {
            let pc = KvTiers::open(&model, &tok, host_only(dir.path())).unwrap();
            let mut other = prompt[..p].to_vec();
            other.extend(tokens(p as u64 + 99, 40, vocab));
            run(&model, &tok, Some(&pc), &other, 1);
            let (got, r) = run(&model, &tok, Some(&pc), &prompt, 10);
            let what = format!("every {every}, prefix {p}: {r:?}");
            assert_eq!(r.cached_ram_tokens, restored, "{what}");
            assert_eq!(r.state_restored_tokens, restored, "{what}");
            assert_eq!(r.state_recomputed_tokens, found - restored, "{what}");
            assert_eq!(got, want, "{what}: RAM restore differs");
            pc.flush().unwrap();
        }
        let pc = KvTiers::open(&model, &tok, host_only(dir.path())).unwrap();
        let (got, r) = run(&model, &tok, Some(&pc), &prompt, 10);
        // The first request's own blocks (all of the prompt's) were published too.
        assert!(
            r.cached_ssd_tokens >= restored,
            "every {every}, prefix {p}: {r:?}"
        );
        assert_eq!(got, want, "every {every}, prefix {p}: SSD restore differs");
    }
}

/// Serving: a hybrid's requests decode together in one batch (the layer states stacked per
/// row) and a long prompt is prefilled in chunks between their steps; every request's
/// tokens are the cold greedy tokens. The next turn of one of them (its prompt, the reply,
/// new text) then resumes from the finished row, whose step computed ahead was trimmed off
/// its states too, and decodes as cold.
fn serves_batched_decode_and_chunked_prefill_with_cold_output(path: &Path) {
    let (model, tok) = load(path, &LoadOptions::default()).unwrap();
    let vocab = model.info().vocab_size;
    let prompts = [
        tokens(4, 9, vocab),
        tokens(5, 33, vocab),
        tokens(6, 120, vocab),
    ];
    let want: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| run(&model, &tok, None, p, 10).0)
        .collect();
    let mut next_turn = prompts[1].clone();
    next_turn.extend(&want[1]);
    next_turn.extend(tokens(7, 20, vocab));
    let want_next = run(&model, &tok, None, &next_turn, 10).0;
    let dir = tempfile::tempdir().unwrap();
    let pc = KvTiers::open(&model, &tok, config(dir.path())).unwrap();
    let engine = Engine::open(model, tok, Some(pc), EngineConfig::default()).unwrap();
    let submit = |p: &[u32]| {
        let params = GenerateParams {
            prefill_chunk: 16,
            ..no_eos(10)
        };
        engine.submit(Request::new(p.to_vec(), params)).unwrap()
    };
    let collect = |mut h: engine::RequestHandle| {
        let mut got = Vec::new();
        loop {
            match h.recv_blocking() {
                Some(Event::Token { sampled, .. }) => got.push(sampled.token),
                Some(Event::Finished(c)) => return (got, c),
                Some(Event::Failed(e)) => panic!("{e}"),
                Some(_) => {}
                None => panic!("no completion"),
            }
        }
    };
    let handles: Vec<_> = prompts.iter().map(|p| submit(p)).collect();
    for ((h, want), prompt) in handles.into_iter().zip(want).zip(&prompts) {
        let what = path.display().to_string();
        assert_cold_greedy(path, prompt, &collect(h).0, &want, &what);
    }
    let (got, c) = collect(submit(&next_turn));
    let what = format!("{}: the next turn", path.display());
    assert_cold_greedy(path, &next_turn, &got, &want_next, &what);
    // The finished row, handed over from the device: prompt and reply (its last token fed
    // by the step computed ahead, which was trimmed back to what the row emitted).
    assert_eq!(
        c.cached_tokens,
        prompts[1].len() + 10,
        "{}: {c:?}",
        path.display()
    );
    engine.shutdown(false).unwrap();
}

#[test]
fn lfm2_serves_batched_decode_and_chunked_prefill_with_cold_output() {
    serves_batched_decode_and_chunked_prefill_with_cold_output(&lfm2());
}

#[test]
fn qwen3_next_serves_batched_decode_and_chunked_prefill_with_cold_output() {
    serves_batched_decode_and_chunked_prefill_with_cold_output(&qwen3_next());
}

#[test]
fn nemotron_h_serves_batched_decode_and_chunked_prefill_with_cold_output() {
    serves_batched_decode_and_chunked_prefill_with_cold_output(&nemotron_h());
}
