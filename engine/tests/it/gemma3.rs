//! Gemma 3: parity with mlx-lm (tiny random checkpoint with a 16-token window, and the 270M
//! model when `scripts/setup.sh --with-gemma` has converted it), chunked prefill across the
//! window, and prefix reuse through the paged cache and the store: a restored prefix gives
//! the output of a cold run for prompts longer than twice the window, whether the cached
//! prefix ends inside the first window or long after it.

use std::path::{Path, PathBuf};

use engine::{
    generate_with_reuse, greedy_ids, load, namespace_description, KvTiers, LayerKind, LoadOptions,
    Model, ReuseConfig, ReuseReport, Tokenizer,
};
use store::StoreConfig;

use crate::common::{
    assert_greedy_under_cold, check_against_mlx_lm, goldens, logit_tol, max_diff, near_tie, no_eos,
    tokens,
};
use crate::prerequisite;

/// f32 on both sides, same libmlx: differences come from evaluation order only (the goldens
/// were made on the CPU; on a CUDA GPU `logit_tol` adds the TF32 term, docs/cuda.md).
const TINY_TOL: f32 = 1e-4;
/// The 270M model (18 layers, a 262,144-entry tied head, an 897-token prompt): measured
/// max difference 1.5e-5 on the top-32 and probe logits.
const GEMMA_270M_TOL: f32 = 1e-4;

fn tiny() -> PathBuf {
    goldens().join("tiny-gemma3")
}

/// The converted 270M folder, when set up; else `None`, after [`prerequisite::missing`]
/// said so (CI fetches it: `scripts/test.sh` passes `--with-gemma` under `CI=1`).
fn gemma_270m() -> Option<PathBuf> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/gemma3-270m");
    if p.join("model.safetensors").is_file() {
        return Some(p);
    }
    prerequisite::missing(
        &format!("{} is missing", p.display()),
        "run bash scripts/setup.sh --with-gemma",
    );
    None
}

fn check_parity(name: &str, path: &Path, tol: f32) {
    check_against_mlx_lm("gemma3.json", name, path, &LoadOptions::default(), tol);
}

#[test]
fn tiny_gemma3_with_sliding_window_layers_matches_mlx_lm() {
    check_parity("tiny-gemma3", &tiny(), TINY_TOL);
}

#[test]
fn gemma3_270m_matches_mlx_lm_on_the_converted_checkpoint() {
    let Some(path) = gemma_270m() else { return };
    check_parity("gemma3-270m", &path, GEMMA_270M_TOL);
}

#[test]
fn gemma3_layer_kinds_follow_the_config_and_name_the_namespace_layout() {
    let (model, tok) = load(&tiny(), &LoadOptions::default()).unwrap();
    let w = LayerKind::Window(16);
    assert_eq!(
        model.layer_kinds(),
        vec![w, LayerKind::Global, w, LayerKind::Global]
    );
    let dir = tempfile::tempdir().unwrap();
    let d = namespace_description(&model, &tok, &config(dir.path(), 8)).unwrap();
    assert_eq!(d.layers, ["window(16)", "global", "window(16)", "global"]);
}

#[test]
fn gemma3_config_that_contradicts_itself_is_rejected() {
    let dir = tempfile::tempdir().unwrap();
    for f in [
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        std::fs::copy(tiny().join(f), dir.path().join(f)).unwrap();
    }
    let base: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tiny().join("config.json")).unwrap())
            .unwrap();
    let bad = [
        ("sliding_window_pattern", serde_json::json!(3)),
        ("rope_global_base_freq", serde_json::json!(10000.0)),
        ("sliding_window", serde_json::json!(0)),
        ("attn_logit_softcapping", serde_json::json!(50.0)),
        (
            "layer_types",
            serde_json::json!(["sliding_attention", "full_attention"]),
        ),
    ];
    for (key, value) in bad {
        let mut cfg = base.clone();
        cfg[key] = value;
        std::fs::write(dir.path().join("config.json"), cfg.to_string()).unwrap();
        let err = load(dir.path(), &LoadOptions::default()).unwrap_err();
        assert!(
            matches!(err, engine::EngineError::Config { .. }),
            "{key}: {err}"
        );
    }
}

/// Logits of the last prompt position on a fresh cache, all at once or in chunks.
fn last_logits(model: &Model, prompt: &[u32], chunk: usize) -> Vec<f32> {
    let mut cache = model.new_cache();
    model
        .prefill(prompt, &mut cache, chunk)
        .unwrap()
        .to_vec()
        .unwrap()
}

#[test]
fn gemma3_prefill_in_chunks_smaller_and_larger_than_the_window_matches_one_step() {
    let (model, _) = load(&tiny(), &LoadOptions::default()).unwrap();
    let prompt = tokens(7, 300, model.info().vocab_size);
    let whole = last_logits(&model, &prompt, 4096);
    // Other chunk sizes are other matmul shapes: on a GPU, other TF32 kernels (`logit_tol`).
    let tol = logit_tol(1e-4, &whole);
    for chunk in [1, 5, 16, 17, 64] {
        let d = max_diff(&whole, &last_logits(&model, &prompt, chunk));
        eprintln!("chunk {chunk}: max |logit difference| {d:e} (allowed {tol:e})");
        assert!(
            d < tol,
            "chunk {chunk}: logits differ by {d} (allowed {tol})"
        );
    }
}

fn config(dir: &Path, block_size: usize) -> ReuseConfig {
    ReuseConfig {
        store: StoreConfig::default()
            .root(dir)
            .ram_budget(256 << 20)
            .ssd_budget(1 << 30),
        block_size,
        // These tests check what each tier serves: no estimate may skip a tier.
        restore_always: true,
        ..ReuseConfig::default()
    }
}

fn cold(model: &Model, tok: &Tokenizer, prompt: &[u32], n: usize) -> Vec<u32> {
    generate_with_reuse(model, tok, None, prompt, &no_eos(n), &mut |_| true)
        .unwrap()
        .0
        .tokens
}

fn cached(
    model: &Model,
    tok: &Tokenizer,
    pc: &KvTiers,
    prompt: &[u32],
    n: usize,
) -> (Vec<u32>, ReuseReport) {
    let (g, r) =
        generate_with_reuse(model, tok, Some(pc), prompt, &no_eos(n), &mut |_| true).unwrap();
    (g.tokens, r)
}

/// For each cached prefix length: publish a sequence that shares exactly that prefix with
/// a long prompt (≥ 1,100 tokens, > 2 windows), then serve the prompt from RAM and, after
/// a restart, from SSD; both must give the cold output and restore the whole prefix.
fn restored_matches_cold(model: &Model, tok: &Tokenizer, block: usize, prefixes: &[usize]) {
    let vocab = model.info().vocab_size;
    let prompt = tokens(11, 1_104, vocab);
    let n = 12;
    let want = cold(model, tok, &prompt, n);
    for &p in prefixes {
        let dir = tempfile::tempdir().unwrap();
        {
            let pc = KvTiers::open(model, tok, config(dir.path(), block)).unwrap();
            // Shares the first p tokens, then diverges.
            let mut other = prompt[..p].to_vec();
            other.extend(tokens(p as u64 + 99, 2 * block, vocab));
            cached(model, tok, &pc, &other, 1);
            let (got, r) = cached(model, tok, &pc, &prompt, n);
            assert_eq!(
                r.cached_tokens,
                p / block * block,
                "prefix {p}: RAM restore"
            );
            assert_eq!(got, want, "prefix {p} (block {block}): RAM restore differs");
            pc.flush().unwrap();
        }
        // A restart: the RAM tier is empty, blocks come from disk.
        let pc = KvTiers::open(model, tok, config(dir.path(), block)).unwrap();
        let (got, r) = cached(model, tok, &pc, &prompt, n);
        assert!(
            r.cached_ssd_tokens >= p / block * block,
            "prefix {p}: {r:?}"
        );
        assert_eq!(got, want, "prefix {p} (block {block}): SSD restore differs");
    }
}

#[test]
fn gemma3_restored_prefixes_inside_and_beyond_the_window_match_cold_output() {
    let (model, tok) = load(&tiny(), &LoadOptions::default()).unwrap();
    // Window 16, block 8: prefixes ending inside the first window (8), at its edge (16),
    // just past it (24), mid-prompt and one block short of the whole prompt.
    restored_matches_cold(&model, &tok, 8, &[8, 16, 24, 520, 1_096]);
}

#[test]
fn gemma3_blocks_larger_than_the_window_restore_exactly() {
    let (model, tok) = load(&tiny(), &LoadOptions::default()).unwrap();
    // Block 32 > window 16: each block holds keys every later query masks out.
    restored_matches_cold(&model, &tok, 32, &[32, 608]);
}

#[test]
fn gemma3_window_layers_store_only_what_a_window_reads_bytes_exactly() {
    let (model, tok) = load(&tiny(), &LoadOptions::default()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let pc = KvTiers::open(&model, &tok, config(dir.path(), 8)).unwrap();
    let d = pc.description().clone();
    // 4 layers, 2 of them with a 16-token window: a trimmed block carries half the planes.
    assert_eq!(d.trimmed_planes.len() * 2, d.planes.len());
    let bytes =
        |specs: &[store::PlaneSpec]| -> u64 { specs.iter().filter_map(|p| p.byte_len()).sum() };
    let (whole, trimmed) = (bytes(&d.planes), bytes(&d.trimmed_planes));
    assert_eq!(d.trimmed_bytes_per_block(), whole - trimmed);
    let prompt = tokens(3, 1_104, model.info().vocab_size);
    let (_, r) = cached(&model, &tok, &pc, &prompt, 1);
    // 1,105 tokens hold 138 full blocks. Whole: those a continuation from the prompt's
    // last full block (1,104) or the one before (1,096) reads through a 16-token window,
    // positions 1,081..1,103, so the blocks ending at 1,088, 1,096 and 1,104; the other
    // 135 leave their window planes out.
    assert_eq!(r.published_blocks, 138);
    assert_eq!(r.window_trimmed_bytes, 135 * (whole - trimmed));
    // Publication finishes on the export thread: wait for it.
    pc.flush().unwrap();
    assert_eq!(pc.stats().ram_bytes, 3 * whole + 135 * trimmed);
}

/// A prompt that shares `p` tokens with one published before, served after a restart
/// (nothing resident): its output is the cold output. Returns the reuse report.
fn after_restart(model: &Model, tok: &Tokenizer, dir: &Path, prompt: &[u32]) -> ReuseReport {
    let want = cold(model, tok, prompt, 8);
    let pc = KvTiers::open(model, tok, config(dir, 8)).unwrap();
    let (got, r) = cached(model, tok, &pc, prompt, 8);
    assert_eq!(got, want, "{r:?}");
    pc.flush().unwrap();
    r
}

#[test]
fn gemma3_a_tail_needed_from_blocks_published_as_interior_is_recomputed_then_stored_whole() {
    let (model, tok) = load(&tiny(), &LoadOptions::default()).unwrap();
    let vocab = model.info().vocab_size;
    let dir = tempfile::tempdir().unwrap();
    let long = tokens(21, 600, vocab);
    {
        let pc = KvTiers::open(&model, &tok, config(dir.path(), 8)).unwrap();
        cached(&model, &tok, &pc, &long, 1);
        pc.flush().unwrap();
    }
    // A fork at 304, long after the window: its blocks were published interior (trimmed),
    // so a restore may not end there; it stops where every window key is real (nowhere
    // before 304 here) and recomputes, giving the cold output.
    let mut fork = long[..304].to_vec();
    fork.extend(tokens(22, 40, vocab));
    let r = after_restart(&model, &tok, dir.path(), &fork);
    assert_eq!(r.cached_tokens, 0, "{r:?}");
    assert_eq!(r.window_recomputed_tokens, 304, "{r:?}");
    // That request published the window before 304 whole (replacing the trimmed copies
    // on SSD): the next fork there restores 304 tokens from SSD.
    let mut again = long[..304].to_vec();
    again.extend(tokens(23, 40, vocab));
    let r = after_restart(&model, &tok, dir.path(), &again);
    assert_eq!((r.cached_tokens, r.cached_ssd_tokens), (304, 304), "{r:?}");
    // The long sequence's own end (blocks stored whole when it was published) restores;
    // a fork inside its first window is a fork from its inside like any other.
    let mut resumed = long.clone();
    resumed.extend(tokens(24, 20, vocab));
    let r = after_restart(&model, &tok, dir.path(), &resumed);
    assert_eq!(r.cached_ssd_tokens, 600, "{r:?}");
    let mut short = long[..12].to_vec();
    short.extend(tokens(25, 30, vocab));
    let r = after_restart(&model, &tok, dir.path(), &short);
    assert_eq!(
        (r.cached_tokens, r.window_recomputed_tokens),
        (0, 8),
        "{r:?}"
    );
    // Resent after another restart, it restores its whole chain (40 tokens) from SSD.
    let r = after_restart(&model, &tok, dir.path(), &short);
    assert_eq!(r.cached_ssd_tokens, 40, "{r:?}");
}

#[test]
fn gemma3_multi_turn_reuse_matches_cold_output_at_every_turn() {
    let (model, tok) = load(&tiny(), &LoadOptions::default()).unwrap();
    let vocab = model.info().vocab_size;
    let dir = tempfile::tempdir().unwrap();
    let pc = KvTiers::open(&model, &tok, config(dir.path(), 16)).unwrap();
    let mut convo = tokens(5, 700, vocab);
    for turn in 0..4 {
        let want = cold(&model, &tok, &convo, 6);
        let (got, r) = cached(&model, &tok, &pc, &convo, 6);
        let tf32 = mlx::f32_matmul_unit_roundoff().unwrap() > 1e-6;
        assert!(
            got == want || tf32,
            "turn {turn}: restored output {got:?} differs from cold {want:?} on an exact-f32 device"
        );
        if got != want {
            // Only where rounding may decide (a GPU): the tiny model's logits span about
            // ±1.2, so top-2 gaps of 1e-3 are common and TF32 flips them.
            assert_greedy_under_cold(&model, &convo, &got, 1e-4, &format!("turn {turn}"));
            assert_greedy_under_cold(&model, &convo, &want, 1e-4, &format!("turn {turn} cold"));
            eprintln!("turn {turn}: cached {got:?}, cold {want:?}: both greedy within TF32 ties");
        }
        if turn > 0 {
            assert!(r.cached_tokens > 600, "turn {turn}: {r:?}");
        }
        convo.extend(&got);
        convo.extend(tokens(turn + 50, 150, vocab));
    }
}

#[test]
fn gemma3_270m_restored_prefix_longer_than_two_windows_matches_cold_output() {
    let Some(path) = gemma_270m() else { return };
    let (model, tok) = load(&path, &LoadOptions::default()).unwrap();
    let text = "Prefix caches must not break sliding-window attention. ".repeat(120);
    let mut prompt = tok.encode(&text, true).unwrap();
    prompt.truncate(1_100);
    assert!(prompt.len() >= 1_100);
    let dir = tempfile::tempdir().unwrap();
    let pc = KvTiers::open(&model, &tok, config(dir.path(), 32)).unwrap();
    // Turn 1 publishes the prompt's blocks; turn 2 extends it by a question.
    cached(&model, &tok, &pc, &prompt, 1);
    let mut turn2 = prompt.clone();
    turn2.extend(
        tok.encode(" Question: what must not break?", false)
            .unwrap(),
    );
    let want = cold(&model, &tok, &turn2, 8);
    let (got, r) = cached(&model, &tok, &pc, &turn2, 8);
    // Turn 1 stayed resident on the device and is handed over whole (token-granular).
    assert_eq!(r.cached_device_tokens, 1_100, "{r:?}");
    assert_eq!(got, want);
    pc.flush().unwrap();
    drop(pc);
    // After a restart only the store has it: the 34 full blocks (1,088 tokens), from SSD.
    let pc = KvTiers::open(&model, &tok, config(dir.path(), 32)).unwrap();
    let (got, r) = cached(&model, &tok, &pc, &turn2, 8);
    assert_eq!(r.cached_ssd_tokens, 1_088, "{r:?}");
    assert_eq!(got, want);
}

#[test]
fn gemma3_batched_decode_with_window_masks_matches_each_row_alone() {
    use cache::{PagedConfig, PagedKvCache, PagedKvRows};
    use engine::{argmax, DEFAULT_PREFILL_CHUNK};

    let (model, _) = load(&tiny(), &LoadOptions::default()).unwrap();
    let vocab = model.info().vocab_size;
    let layers = model.info().kv.layers;
    // Rows shorter than the window, across it, and far past it, padded differently.
    let prompts: Vec<Vec<u32>> = [(5, 1), (19, 2), (70, 3)]
        .iter()
        .map(|&(n, seed)| tokens(seed, n, vocab))
        .collect();
    let (mut rows, mut alone, mut out) = (PagedKvRows::new(), Vec::new(), Vec::new());
    for p in &prompts {
        let mut c = PagedKvCache::new(layers, PagedConfig::default()).unwrap();
        let logits = model.prefill(p, &mut c, DEFAULT_PREFILL_CHUNK).unwrap();
        out.push(vec![argmax(&logits.to_vec::<f32>().unwrap())]);
        alone.push(c.clone());
        rows.push(c).unwrap();
    }
    let n = 24;
    let (mut worst, mut worst_ratio) = (0f32, 0f32);
    // Per row, the first step with a near tie (batch.rs): tokens are compared before it.
    let mut tie: Vec<Option<usize>> = vec![None; prompts.len()];
    for _ in 1..n {
        let last: Vec<u32> = out.iter().map(|o: &Vec<u32>| *o.last().unwrap()).collect();
        let logits: Vec<f32> = model
            .forward_rows(&last, &mut rows)
            .unwrap()
            .to_vec()
            .unwrap();
        for (b, row) in logits.chunks(vocab).enumerate() {
            let single: Vec<f32> = model
                .forward(&[last[b]], &mut alone[b])
                .unwrap()
                .to_vec()
                .unwrap();
            // Batched rows are other matmul shapes: on a GPU, other TF32 kernels.
            let tol = logit_tol(1e-4, &single);
            worst = worst.max(max_diff(row, &single));
            worst_ratio = worst_ratio.max(max_diff(row, &single) / tol);
            if tie[b].is_none() && near_tie(&single, tol) {
                tie[b] = Some(out[b].len());
            }
            out[b].push(argmax(row));
        }
    }
    for ((p, got), tie) in prompts.iter().zip(&out).zip(&tie) {
        let want = greedy_ids(&model, p, n).unwrap();
        let upto = tie.unwrap_or(n);
        assert_eq!(got[..upto], want[..upto]);
    }
    eprintln!("gemma3 batched: max |batched - alone| {worst:e} ({worst_ratio:.2} of allowed), near ties {tie:?}");
    assert!(
        worst_ratio < 1.0,
        "batched logits differ by {worst} ({worst_ratio} of allowed)"
    );
}

/// Gemma 3 270M with the template set-up installs (scripts/goldens/templates/
/// gemma3_tools.jinja): a forced call comes back as `tool_calls`, parsed from Gemma's
/// ```` ```tool_code ```` family and valid under the schema; sent back in the history with
/// its result, the next request reuses the previous prompt and the call the model wrote
/// (the template re-renders the call as the model's own tokens).
#[test]
fn gemma3_270m_forced_tool_calls_parse_and_come_back_as_a_cached_prefix() {
    use std::sync::Arc;

    use engine::server::ConnectionLimits;
    use engine::{Engine, EngineConfig};
    use serde_json::{json, Value};

    let Some(path) = gemma_270m() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let (model, tok) = load(&path, &LoadOptions::default()).unwrap();
    let prefix = KvTiers::open(&model, &tok, config(dir.path(), 16)).unwrap();
    let engine = Arc::new(Engine::open(model, tok, Some(prefix), EngineConfig::default()).unwrap());
    let srv = crate::server::Server::serve(
        engine,
        crate::server::server_config(None),
        ConnectionLimits::default(),
    );
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"], "additionalProperties": false}}}]);
    let user = json!({"role": "user", "content": "What is the weather in Paris?"});
    let body = json!({
        "messages": [user],
        "tools": tools,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": 40,
    });
    let v = srv.post("/v1/chat/completions", &body).json();
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls", "{v}");
    let call = v["choices"][0]["message"]["tool_calls"][0].clone();
    assert_eq!(call["function"]["name"], "get_weather", "{v}");
    let args: Value =
        serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert!(
        args["city"]
            .as_str()
            .is_some_and(|c| c.chars().count() <= 12),
        "{args}"
    );
    let first_prompt = v["usage"]["prompt_tokens"].as_u64().unwrap();
    srv.idle();
    let next = json!({
        "messages": [user,
            {"role": "assistant", "content": null, "tool_calls": [call.clone()]},
            {"role": "tool", "tool_call_id": call["id"], "content": "Sunny, 21 C"}],
        "tools": tools,
        "max_tokens": 2,
    });
    let v = srv.post("/v1/chat/completions", &next).json();
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        cached > first_prompt,
        "cached {cached}: not beyond the previous prompt's {first_prompt} tokens into the call: {v}"
    );
}
