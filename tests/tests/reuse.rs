//! Prefix reuse end to end: engine ⇄ cache ⇄ store, across turns and restarts. Every
//! output with a restored prefix is compared with the same request served cold.

use std::path::Path;

use engine::{Engine, EngineConfig, KvTiers, LoadOptions, Model, Request, ReuseConfig, Tokenizer};
use kvstore_tests::tiny_model;
use kvstore_tests::turns::{cached, cold, params, random_tokens, rng};
use rand::rngs::StdRng;
use store::StoreConfig;

fn load(path: &Path) -> (Model, Tokenizer) {
    engine::load(path, &LoadOptions::default()).unwrap()
}

fn config(dir: &Path, block_size: usize) -> ReuseConfig {
    ReuseConfig {
        store: StoreConfig::default()
            .root(dir)
            .ram_budget(64 << 20)
            .ssd_budget(256 << 20),
        block_size,
        // These tests check what each tier serves: no estimate may skip a tier.
        restore_always: true,
        ..ReuseConfig::default()
    }
}

/// [`config`] without the device tier (a zero budget keeps nothing resident), so that
/// every hit goes through the host tiers.
fn host_only(dir: &Path, block_size: usize) -> ReuseConfig {
    ReuseConfig {
        kv_budget_bytes: 0,
        ..config(dir, block_size)
    }
}

/// Turn 1 (77 random tokens), its greedy reply served cold (20 tokens), and turn 2: turn 1,
/// the reply and 29 new random tokens.
fn two_turns(r: &mut StdRng, model: &Model, tok: &Tokenizer) -> (Vec<u32>, Vec<u32>, Vec<u32>) {
    let turn1 = random_tokens(r, 77, 320);
    let out1 = cold(model, tok, &turn1, 20);
    let turn2 = turn1
        .iter()
        .chain(&out1)
        .copied()
        .chain(random_tokens(r, 29, 320))
        .collect();
    (turn1, out1, turn2)
}

#[test]
fn restored_prefixes_from_ram_and_from_ssd_after_a_restart_match_cold_output() {
    let mut r = rng("restored_prefixes_from_ram_and_from_ssd_after_a_restart_match_cold_output");
    let (model, tok) = load(&tiny_model("tiny-llama"));
    let dir = tempfile::tempdir().unwrap();
    let (turn1, out1_cold, turn2) = two_turns(&mut r, &model, &tok);
    let out2_cold = cold(&model, &tok, &turn2, 20);

    let (saved_estimate, saved_restore);
    {
        let pc = KvTiers::open(&model, &tok, host_only(dir.path(), 8)).unwrap();
        let (out1, rep1) = cached(&model, &tok, &pc, &turn1, 20);
        assert_eq!(out1, out1_cold);
        assert_eq!(rep1.cached_tokens, 0);
        assert_eq!(rep1.diverged_at, None);
        // 77 prompt + 19 forwarded generated tokens = 96 held → 12 blocks.
        assert_eq!(rep1.published_blocks, 12);

        let (out2, rep2) = cached(&model, &tok, &pc, &turn2, 20);
        assert_eq!(out2, out2_cold, "RAM-restored prefix changed the output");
        assert_eq!(rep2.cached_tokens, 96);
        assert_eq!(rep2.cached_ram_tokens, 96);
        assert_eq!(
            rep2.diverged_at,
            Some(96),
            "turn 2 extends what turn 1 published"
        );
        pc.flush().unwrap();
        saved_estimate = pc.prefill_estimate();
        assert!(
            saved_estimate.is_some_and(|f| f.seconds(512, 0) > 0.0),
            "{saved_estimate:?}"
        );
        // Turn 2's restore from RAM was measured: the import fit is no longer the prior.
        saved_restore = pc.restore_estimates();
        assert!(saved_restore.import.is_some(), "{saved_restore:?}");
        // Both publications were finished by the export thread, every block inserted.
        let st = pc.export_stats();
        assert_eq!(
            (st.exports, st.blocks, st.failed_blocks),
            (2, 12 + rep2.published_blocks as u64, 0)
        );
    }

    // A restart: a new store handle, nothing on the device or in RAM; the blocks come
    // from SSD, and the cost model measured before (saved by the export thread at the
    // flush) is read back.
    let pc = KvTiers::open(&model, &tok, config(dir.path(), 8)).unwrap();
    assert_eq!(pc.prefill_estimate(), saved_estimate);
    assert_eq!(pc.restore_estimates(), saved_restore);
    let (out2, rep) = cached(&model, &tok, &pc, &turn2, 20);
    assert_eq!(out2, out2_cold, "SSD-restored prefix changed the output");
    assert!(rep.cached_ssd_tokens >= 96, "{rep:?}");
    assert_eq!(rep.cached_ram_tokens + rep.cached_device_tokens, 0);
    assert!(rep.stopped.is_none(), "{rep:?}");
}

#[test]
fn a_cost_file_of_per_unit_estimates_loads_as_priors_and_a_corrupt_one_is_ignored() {
    let (model, tok) = load(&tiny_model("tiny-llama"));
    let dir = tempfile::tempdir().unwrap();
    let pc = KvTiers::open(&model, &tok, host_only(dir.path(), 8)).unwrap();
    let device = pc.cost_device().to_string();
    // What the cost model wrote before its fits: one per-unit number per measure.
    let old = format!(
        r#"{{"{device}": {{"prefill_s_per_token": 0.00025, "ssd_s_per_block": 0.001,
            "remote_s_per_block": null, "import_s_per_block": 0.0005}}}}"#
    );
    pc.store()
        .save_costs(pc.namespace(), old.as_bytes())
        .unwrap();
    drop(pc);
    let pc = KvTiers::open(&model, &tok, host_only(dir.path(), 8)).unwrap();
    let per_unit = |s: f64| engine::Fit {
        per_unit_s: s,
        ..engine::Fit::default()
    };
    assert_eq!(pc.prefill_estimate(), Some(per_unit(0.00025)));
    let restore = pc.restore_estimates();
    assert_eq!(restore.ssd, Some(per_unit(0.001)));
    assert_eq!(restore.import, Some(per_unit(0.0005)));
    assert_eq!(restore.remote, None);
    pc.store()
        .save_costs(pc.namespace(), b"{\"truncated\": {\"prefill\": [")
        .unwrap();
    drop(pc);
    // A corrupt file: the cache opens, with no prefill estimate (the import is calibrated).
    let pc = KvTiers::open(&model, &tok, host_only(dir.path(), 8)).unwrap();
    assert_eq!(pc.prefill_estimate(), None);
    assert_eq!(pc.restore_estimates().ssd, None);
    // It still serves, and its next save replaces the file with a readable one.
    let prompt: Vec<u32> = (0..40).map(|i| i % 300 + 3).collect();
    let (out, _) = cached(&model, &tok, &pc, &prompt, 4);
    assert_eq!(out, cold(&model, &tok, &prompt, 4));
    pc.flush().unwrap();
    let estimate = pc.prefill_estimate();
    assert!(estimate.is_some());
    drop(pc);
    let pc = KvTiers::open(&model, &tok, host_only(dir.path(), 8)).unwrap();
    assert_eq!(pc.prefill_estimate(), estimate);
}

/// A store holding turn 1's 12 blocks on SSD only (RAM 0 after a restart), with saved
/// estimates of `prefill_s_per_token`, a free import and none for the SSD; the engine's
/// cache over it (deciding by the estimates) and turn 2's prompt.
fn ssd_only_turn1(
    r: &mut StdRng,
    model: &Model,
    tok: &Tokenizer,
    dir: &Path,
    prefill_s_per_token: f64,
) -> (KvTiers, Vec<u32>) {
    let (turn1, _, turn2) = two_turns(r, model, tok);
    let estimates = || ReuseConfig {
        restore_always: false,
        ..host_only(dir, 8)
    };
    {
        let pc = KvTiers::open(model, tok, estimates()).unwrap();
        assert_eq!(cached(model, tok, &pc, &turn1, 20).1.published_blocks, 12);
        pc.flush().unwrap();
        let device = pc.cost_device().to_string();
        let costs = format!(
            r#"{{"{device}": {{"prefill_s_per_token": {prefill_s_per_token:e}, "import_s_per_block": 0.0}}}}"#
        );
        pc.store()
            .save_costs(pc.namespace(), costs.as_bytes())
            .unwrap();
    }
    let pc = KvTiers::open(model, tok, estimates()).unwrap();
    assert_eq!(pc.cost_samples().ssd, 0);
    (pc, turn2)
}

#[test]
fn an_unmeasured_ssd_is_probed_in_two_loads_of_different_sizes_then_restored_by_the_fit() {
    let mut r = rng("an_unmeasured_ssd_is_probed_in_two_loads_of_different_sizes");
    let (model, tok) = load(&tiny_model("tiny-llama"));
    let dir = tempfile::tempdir().unwrap();
    // Recomputing made absurdly dear (1 s per token), so that the plan restores all it may
    // whatever this machine's timings.
    let (pc, turn2) = ssd_only_turn1(&mut r, &model, &tok, dir.path(), 1.0);
    let (out2, rep) = cached(&model, &tok, &pc, &turn2, 20);
    assert_eq!(out2, cold(&model, &tok, &turn2, 20));
    // The 12 SSD blocks came in three loads: the probe's first block, the probe's other 3
    // (two sizes: the fit separates the SSD's fixed cost from its per-block cost), then the
    // 8 the fit found worth reading.
    assert_eq!(rep.cached_ssd_tokens, 96, "{rep:?}");
    assert_eq!(rep.ssd_blocks_skipped, 0, "{rep:?}");
    assert_eq!(pc.cost_samples().ssd, 3);
    assert!(pc.restore_estimates().ssd.is_some());
}

#[test]
fn an_unmeasured_ssd_that_a_slow_disk_would_not_pay_for_is_measured_off_the_request() {
    let mut r = rng("an_unmeasured_ssd_that_a_slow_disk_would_not_pay_for");
    let (model, tok) = load(&tiny_model("tiny-llama"));
    let dir = tempfile::tempdir().unwrap();
    // Recomputing nearly free (a fast GPU's 0.1 µs a token: 12 blocks save ~10 µs): priced
    // as a slow disk (2 ms to start), the unmeasured SSD loses, so the request recomputes
    // and does not read it.
    let (pc, turn2) = ssd_only_turn1(&mut r, &model, &tok, dir.path(), 1e-7);
    let (out2, rep) = cached(&model, &tok, &pc, &turn2, 20);
    assert_eq!(out2, cold(&model, &tok, &turn2, 20));
    assert_eq!(
        (rep.cached_tokens, rep.ssd_blocks_skipped),
        (0, 12),
        "{rep:?}"
    );
    // The SSD is measured in the background instead (on the export thread: loads of 1, 2
    // and 4 blocks, then the 5 left of the 12), for the requests after this one.
    pc.flush().unwrap();
    assert_eq!(pc.cost_samples().ssd, 4);
    let measured = pc.restore_estimates().ssd;
    assert!(measured.is_some());
    // Saved with the cost model: a restart knows the SSD.
    drop(pc);
    let pc = KvTiers::open(&model, &tok, host_only(dir.path(), 8)).unwrap();
    assert_eq!(pc.restore_estimates().ssd, measured);
}

#[test]
fn device_hits_hand_over_whole_sequences_fork_partial_ones_and_match_cold_output() {
    let mut r =
        rng("device_hits_hand_over_whole_sequences_fork_partial_ones_and_match_cold_output");
    let (model, tok) = load(&tiny_model("tiny-llama"));
    let dir = tempfile::tempdir().unwrap();
    let pc = KvTiers::open(&model, &tok, config(dir.path(), 8)).unwrap();
    let (turn1, out1, turn2) = two_turns(&mut r, &model, &tok);
    assert_eq!(cached(&model, &tok, &pc, &turn1, 20).0, out1);
    // Turn 2 extends everything turn 1 held (77 prompt + 19 generated tokens it forwarded):
    // the sequence's arenas are handed over, the partial block included.
    let (out2, rep) = cached(&model, &tok, &pc, &turn2, 20);
    assert_eq!(
        out2,
        cold(&model, &tok, &turn2, 20),
        "handed-over KV changed the output"
    );
    assert_eq!(
        (rep.cached_tokens, rep.cached_device_tokens),
        (96, 96),
        "{rep:?}"
    );
    assert!(rep.device_handover, "{rep:?}");
    assert_eq!(rep.cached_ram_tokens + rep.cached_ssd_tokens, 0, "{rep:?}");

    // A branch that leaves turn 2 at token 101 (mid-block) forks it: 101 tokens shared,
    // token-granular, and the resident turn 2 is untouched (asked again below).
    let mut branch = turn2[..101].to_vec();
    branch.extend(random_tokens(&mut r, 12, 320));
    // A random token may equal turn 2's own (1 in 320; turn 2 holds the model's reply,
    // which a GPU's rounding can change): the branch must leave turn 2 at token 101.
    if branch[101] == turn2[101] {
        branch[101] = (branch[101] + 1) % 320;
    }
    let (got, rep) = cached(&model, &tok, &pc, &branch, 8);
    assert_eq!(
        got,
        cold(&model, &tok, &branch, 8),
        "forked KV changed the output"
    );
    assert_eq!(rep.cached_device_tokens, 101, "{rep:?}");
    assert!(!rep.device_handover, "{rep:?}");
    // Turn 2's prompt again: all but its 20-token reply matches, so it is handed over,
    // trimmed in place.
    let again = turn2.clone();
    let (got, rep) = cached(&model, &tok, &pc, &again, 8);
    assert_eq!(
        got,
        cold(&model, &tok, &again, 8),
        "the fork altered the resident sequence"
    );
    assert_eq!(rep.cached_device_tokens, again.len() - 1, "{rep:?}");
    let st = pc.resident_stats();
    assert!(st.handovers >= 2 && st.forks >= 1, "{st:?}");
}

#[test]
fn a_corrupt_block_in_the_middle_ends_the_prefix_and_output_stays_correct() {
    let mut r = rng("a_corrupt_block_in_the_middle_ends_the_prefix_and_output_stays_correct");
    let (model, tok) = load(&tiny_model("tiny-llama"));
    let dir = tempfile::tempdir().unwrap();
    let prompt = random_tokens(&mut r, 70, 320);
    let follow: Vec<u32> = prompt
        .iter()
        .copied()
        .chain(random_tokens(&mut r, 10, 320))
        .collect();
    let want = cold(&model, &tok, &follow, 12);
    let ns;
    {
        let pc = KvTiers::open(&model, &tok, config(dir.path(), 8)).unwrap();
        ns = pc.namespace();
        cached(&model, &tok, &pc, &prompt, 1);
        pc.flush().unwrap();
    }
    // Flip one byte in the middle of block 3's file.
    let key = store::chain_keys(ns, &prompt, 8)[3];
    let hex = key.to_hex();
    let path = dir
        .path()
        .join(ns.to_hex())
        .join(&hex[..2])
        .join(format!("{hex}.safetensors"));
    let mut bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let at = bytes.len() - 100;
    bytes[at] ^= 0x40;
    std::fs::write(&path, bytes).unwrap();

    let pc = KvTiers::open(&model, &tok, config(dir.path(), 8)).unwrap();
    let (got, rep) = cached(&model, &tok, &pc, &follow, 12);
    assert_eq!(
        rep.cached_tokens, 24,
        "the prefix must end before the corrupt block 3: {rep:?}"
    );
    assert!(rep.stopped.is_some());
    assert_eq!(got, want);
    assert!(
        pc.stats().quarantined >= 1 || pc.stats().verify_failures >= 1,
        "{:?}",
        pc.stats()
    );
}

#[test]
fn tiny_budgets_still_give_correct_output() {
    let mut r = rng("tiny_budgets_still_give_correct_output");
    let (model, tok) = load(&tiny_model("tiny-llama"));
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path(), 8);
    // One block is 2 layers × K,V × 2 heads × 8 tokens × 16 dims × 4 bytes = 4 KiB.
    cfg.store = StoreConfig::default()
        .root(dir.path())
        .ram_budget(5 << 10)
        .ssd_budget(24 << 10);
    let pc = KvTiers::open(&model, &tok, cfg).unwrap();
    let mut prompt = random_tokens(&mut r, 40, 320);
    for _ in 0..3 {
        let want = cold(&model, &tok, &prompt, 8);
        let (got, _) = cached(&model, &tok, &pc, &prompt, 8);
        assert_eq!(got, want);
        prompt.extend(got);
        prompt.extend(random_tokens(&mut r, 9, 320));
    }
    pc.flush().unwrap();
    let s = pc.stats();
    assert!(s.ram_bytes <= 5 << 10, "{s:?}");
    assert!(s.ssd_bytes <= 24 << 10, "{s:?}");
}

#[test]
fn other_models_and_other_salts_never_share_blocks() {
    let mut r = rng("other_models_and_other_salts_never_share_blocks");
    let (llama, llama_tok) = load(&tiny_model("tiny-llama"));
    let (qwen, qwen_tok) = load(&tiny_model("tiny-qwen2"));
    let dir = tempfile::tempdir().unwrap();
    let prompt = random_tokens(&mut r, 50, 300);
    let pc = KvTiers::open(&llama, &llama_tok, config(dir.path(), 8)).unwrap();
    cached(&llama, &llama_tok, &pc, &prompt, 2);
    pc.flush().unwrap();
    drop(pc);

    let other = KvTiers::open(&qwen, &qwen_tok, config(dir.path(), 8)).unwrap();
    let (got, rep) = cached(&qwen, &qwen_tok, &other, &prompt, 6);
    assert_eq!(rep.cached_tokens, 0, "another model hit llama's blocks");
    assert_eq!(got, cold(&qwen, &qwen_tok, &prompt, 6));
    drop(other);

    let mut salted = config(dir.path(), 8);
    salted.salt = Some("tenant-b".into());
    let pc = KvTiers::open(&llama, &llama_tok, salted).unwrap();
    let (_, rep) = cached(&llama, &llama_tok, &pc, &prompt, 2);
    assert_eq!(rep.cached_tokens, 0, "a different salt hit unsalted blocks");
    drop(pc);
    let pc = KvTiers::open(&llama, &llama_tok, config(dir.path(), 8)).unwrap();
    let (_, rep) = cached(&llama, &llama_tok, &pc, &prompt, 2);
    assert_eq!(
        rep.cached_tokens, 48,
        "the unsalted namespace lost its blocks"
    );
}

/// A host-tier run restored after a device-tier hit is appended to the hit's pools by ops
/// that run with the request's first prefill step: admission does not evaluate them (on a
/// GPU that evaluation waited for the decode step queued ahead and any prefill pass before
/// it, and stalled every decoding row at bursts of RAM hits: docs/benchmarks.md, session
/// 41). The request's output is still the cold output.
#[test]
fn a_host_run_after_a_device_hit_is_appended_with_the_first_prefill_step_and_matches_cold() {
    use cache::KvCache;
    let mut r = rng(
        "a_host_run_after_a_device_hit_is_appended_with_the_first_prefill_step_and_matches_cold",
    );
    let (model, tok) = load(&tiny_model("tiny-llama"));
    let dir = tempfile::tempdir().unwrap();
    let pc = KvTiers::open(&model, &tok, config(dir.path(), 8)).unwrap();
    // Turn A: its 8 blocks reach RAM; then the device tier is emptied (RAM keeps them).
    let a = random_tokens(&mut r, 64, 320);
    cached(&model, &tok, &pc, &a, 1);
    pc.set_kv_budget(ReuseConfig::default().kv_budget_bytes)
        .unwrap();
    // A request sharing A's first 20 tokens restores 2 blocks from RAM and stays resident.
    let mut b = a[..20].to_vec();
    b.extend(random_tokens(&mut r, 10, 320));
    if b[20] == a[20] {
        b[20] = (b[20] + 1) % 320;
    }
    cached(&model, &tok, &pc, &b, 1);
    // A's continuation: the device hit (its first 2 whole blocks, from that sequence), then
    // RAM's blocks 2-7 appended to the hit's pools.
    let mut c = a.clone();
    c.extend(random_tokens(&mut r, 8, 320));
    let want = cold(&model, &tok, &c, 8);
    let mut p = pc.prepare(&c).unwrap();
    let rep = &p.report;
    assert_eq!(
        (rep.cached_device_tokens, rep.cached_ram_tokens),
        (16, 48),
        "{rep:?}"
    );
    for l in 0..p.cache.layers() {
        let pool = p.cache.pool(l).expect("a pool for every layer");
        assert!(
            pool.arrays().iter().any(|a| !a.is_available()),
            "layer {l}: the appended run was evaluated at admission"
        );
    }
    let out = engine::generate(&model, &tok, &mut p.cache, &c, &params(8), &mut |_| true).unwrap();
    assert_eq!(out.tokens, want, "the appended run changed the output");
}

#[test]
fn a_prompt_diverging_inside_a_block_reuses_the_blocks_before_it() {
    let mut r = rng("a_prompt_diverging_inside_a_block_reuses_the_blocks_before_it");
    let (model, tok) = load(&tiny_model("tiny-llama"));
    let dir = tempfile::tempdir().unwrap();
    let pc = KvTiers::open(&model, &tok, config(dir.path(), 8)).unwrap();
    let prompt = random_tokens(&mut r, 64, 320);
    cached(&model, &tok, &pc, &prompt, 1);
    let mut edited = prompt.clone();
    edited[45] = if edited[45] == 7 { 8 } else { 7 };
    let want = cold(&model, &tok, &edited, 10);
    let (got, rep) = cached(&model, &tok, &pc, &edited, 10);
    assert_eq!(got, want);
    assert_eq!(
        rep.cached_tokens, 45,
        "the device tier reuses every token before the edit"
    );
    assert_eq!(rep.diverged_at, Some(45));

    // Through the host tiers only whole blocks are stored: blocks 0-4 end before token 45.
    let dir = tempfile::tempdir().unwrap();
    let pc = KvTiers::open(&model, &tok, host_only(dir.path(), 8)).unwrap();
    cached(&model, &tok, &pc, &prompt, 1);
    let (got, rep) = cached(&model, &tok, &pc, &edited, 10);
    assert_eq!(got, want);
    assert_eq!(rep.cached_tokens, 40, "blocks 0-4 end before token 45");
}

#[test]
fn the_io_thread_loads_a_queued_requests_ssd_prefix_and_the_output_matches_cold() {
    let mut r = rng("the_io_thread_loads_a_queued_requests_ssd_prefix_and_the_output_matches_cold");
    let path = tiny_model("tiny-llama");
    let (model, tok) = load(&path);
    let dir = tempfile::tempdir().unwrap();
    let (turn1, _, turn2) = two_turns(&mut r, &model, &tok);
    {
        let pc = KvTiers::open(&model, &tok, config(dir.path(), 8)).unwrap();
        cached(&model, &tok, &pc, &turn1, 20);
        pc.flush().unwrap();
    }
    let serve = |prefix: Option<KvTiers>| {
        let (model, tok) = load(&path);
        let engine = Engine::open(model, tok, prefix, EngineConfig::default()).unwrap();
        engine
            .submit(Request::new(turn2.clone(), params(12)))
            .unwrap()
            .wait()
            .unwrap()
    };
    let want = serve(None);
    // A new engine on the same store: nothing on the device or in RAM, so the prefix is on
    // SSD; the I/O thread loads it while the request is queued.
    let got = serve(Some(
        KvTiers::open(&model, &tok, config(dir.path(), 8)).unwrap(),
    ));
    assert_eq!(
        got.text, want.text,
        "the prefetched prefix changed the output"
    );
    assert!(got.reuse.prefetched, "{:?}", got.reuse);
    assert!(got.reuse.cached_ssd_tokens >= 96, "{:?}", got.reuse);
}

#[test]
fn warming_the_restore_path_measures_an_import_prior_and_keeps_a_saved_one() {
    let (model, tok) = load(&tiny_model("tiny-llama"));
    let dir = tempfile::tempdir().unwrap();
    let pc = KvTiers::open(&model, &tok, host_only(dir.path(), 8)).unwrap();
    // Opening measures nothing: the restore path is warmed where restores run.
    assert_eq!(pc.restore_estimates().import, None);
    let prior = pc
        .warm_restore()
        .unwrap()
        .expect("an attention model's synthetic blocks restore");
    assert!(prior.fixed_s.is_finite() && prior.fixed_s >= 0.0);
    assert!(prior.per_unit_s.is_finite() && prior.per_unit_s >= 0.0);
    assert_eq!(pc.restore_estimates().import, Some(prior));
    // A device with a saved estimate keeps it: warming measures, but does not replace it.
    let device = pc.cost_device().to_string();
    let saved = format!(r#"{{"{device}": {{"import_s_per_block": 0.0005}}}}"#);
    pc.store()
        .save_costs(pc.namespace(), saved.as_bytes())
        .unwrap();
    drop(pc);
    let pc = KvTiers::open(&model, &tok, host_only(dir.path(), 8)).unwrap();
    assert!(pc.warm_restore().unwrap().is_some());
    let per_unit = engine::Fit {
        per_unit_s: 0.0005,
        ..engine::Fit::default()
    };
    assert_eq!(pc.restore_estimates().import, Some(per_unit));
    drop(pc);

    // The engine warms the path on its own thread before its first request: a fresh
    // store's engine has an import estimate once a request was served.
    let fresh = tempfile::tempdir().unwrap();
    let pc = KvTiers::open(&model, &tok, host_only(fresh.path(), 8)).unwrap();
    let engine = Engine::open(model, tok, Some(pc), EngineConfig::default()).unwrap();
    let prompt: Vec<u32> = (0..20).map(|i| i % 300 + 3).collect();
    engine
        .submit(Request::new(prompt, params(4)))
        .unwrap()
        .wait()
        .expect("a request is served");
    assert!(engine
        .kv_tiers()
        .unwrap()
        .restore_estimates()
        .import
        .is_some());
}

#[test]
fn warming_a_hybrids_restore_path_restores_its_snapshot_blocks() {
    let (model, tok) = load(&tiny_model("tiny-lfm2"));
    let dir = tempfile::tempdir().unwrap();
    let pc = KvTiers::open(&model, &tok, host_only(dir.path(), 8)).unwrap();
    assert!(pc.warm_restore().unwrap().is_some());
    assert!(pc.restore_estimates().import.is_some());
}
