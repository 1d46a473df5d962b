"""Writes the engine's parity goldens (engine/tests/goldens/) with mlx-lm and transformers.

Run through make_goldens.sh, which makes the venv. Everything here is deterministic (fixed
seeds); re-running rewrites the same files unless a library changed its numbers.

1. Tiny random checkpoints (llama with llama3 rope scaling, qwen2 with biases, qwen3 with
   q/k norms and tied embeddings, and an MLX 4-bit quantized qwen3 with an 8-bit override)
   as Hugging Face folders with a small byte-level BPE tokenizer: committed, they are small.
2. SmolLM2-135M-Instruct: the GGUF's tensors read with MLX's GGUF loader, dequantized,
   Q/K rows un-permuted, written as an f32 Hugging Face folder under target/ for mlx-lm.
3. For each model: greedy ids for 32 tokens and last-position logits from mlx-lm (f32).
4. Tokenizer ids and chat-template renderings from transformers for a set of texts and
   conversations (tool calls, reasoning).
"""

import json
import shutil
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "engine" / "tests" / "goldens"
WORK = ROOT / "target" / "goldens"
GGUF = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
TEMPLATES = Path(__file__).resolve().parent / "templates"
N_TOKENS = 32

CORPUS = """The quick brown fox jumps over the lazy dog. A tiny model for tests: it has two
layers, sixty-four features and a vocabulary of a few hundred tokens. Numbers 0 1 2 3 4 5 6 7
8 9 10 42 2024. The weather in Paris is mild; in Berlin it rains. Call get_weather with
{"city": "Paris"} and read the tool response. Hello! How are you? I am fine, thank you.
""" * 4

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
            "<tool_call>", "</tool_call>", "<|begin_of_text|>", "<|eot_id|>",
            "<|start_header_id|>", "<|end_header_id|>"]


def tiny_tokenizer(folder: Path, template: str, bos, eos):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([CORPUS], trainer)
    tok.save(str(folder / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos,
           "chat_template": template, "model_max_length": 512}
    if bos:
        cfg["bos_token"] = bos
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    return tok.get_vocab_size()


def tiny_model(name: str, config: dict, template: str, seed: int, bos=None, eos="<|im_end|>"):
    folder = OUT / name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    vocab = tiny_tokenizer(folder, template, bos, eos)
    config = dict(config, vocab_size=vocab, max_position_embeddings=512,
                  architectures=["X"], torch_dtype="bfloat16")
    mx.random.seed(seed)
    h, inter = config["hidden_size"], config["intermediate_size"]
    nh, nkv = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim", h // nh)
    w = {}

    def lin(n, out, inp, bias=False):
        w[n + ".weight"] = mx.random.normal((out, inp)) * (1.5 / inp ** 0.5)
        if bias:
            w[n + ".bias"] = mx.random.normal((out,)) * 0.5

    def norm(n, d):
        w[n + ".weight"] = 1.0 + 0.2 * mx.random.normal((d,))

    w["model.embed_tokens.weight"] = mx.random.normal((vocab, h))
    qkv_bias = config["model_type"] == "qwen2"
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        lin(p + ".self_attn.q_proj", nh * hd, h, qkv_bias)
        lin(p + ".self_attn.k_proj", nkv * hd, h, qkv_bias)
        lin(p + ".self_attn.v_proj", nkv * hd, h, qkv_bias)
        lin(p + ".self_attn.o_proj", h, nh * hd)
        if config["model_type"] == "qwen3":
            norm(p + ".self_attn.q_norm", hd)
            norm(p + ".self_attn.k_norm", hd)
        lin(p + ".mlp.gate_proj", inter, h)
        lin(p + ".mlp.up_proj", inter, h)
        lin(p + ".mlp.down_proj", h, inter)
        norm(p + ".input_layernorm", h)
        norm(p + ".post_attention_layernorm", h)
    norm("model.norm", h)
    if not config.get("tie_word_embeddings", False):
        lin("lm_head", vocab, h)
    w = {k: v.astype(mx.bfloat16) for k, v in w.items()}
    mx.save_safetensors(str(folder / "model.safetensors"), w, metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def quantized_copy(src: Path, name: str):
    from mlx_lm.convert import convert

    dst = OUT / name
    shutil.rmtree(dst, ignore_errors=True)

    def predicate(path, module, config=None):
        if not hasattr(module, "to_quantized"):
            return False
        if path.endswith("down_proj"):
            return {"group_size": 32, "bits": 8}
        return True

    convert(str(src), str(dst), quantize=True, q_group_size=32, q_bits=4,
            quant_predicate=predicate)
    return dst


def gguf_to_hf(dst: Path):
    """SmolLM2's GGUF as an f32 Hugging Face folder, through MLX's own GGUF loader."""
    from transformers import AutoTokenizer

    if (dst / "model.safetensors").exists():
        return dst
    dst.mkdir(parents=True, exist_ok=True)
    arrays, meta = mx.load(str(GGUF), return_metadata=True)

    def m(key):
        v = meta[key]
        return v.item() if isinstance(v, mx.array) else v

    arch = m("general.architecture")
    heads, kv = int(m(f"{arch}.attention.head_count")), int(m(f"{arch}.attention.head_count_kv"))
    names = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
             "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    out = {}
    for key in arrays:
        if not key.endswith(".weight"):
            continue
        stem = key[: -len(".weight")]
        t = arrays[key]
        if stem + ".scales" in arrays:
            s, b = arrays[stem + ".scales"], arrays[stem + ".biases"]
            bits = t.shape[-1] * 32 // (s.shape[-1] * 32)
            # In f32, as the engine expands them (no rounding to the stored f16).
            t = mx.dequantize(t, s.astype(mx.float32), b.astype(mx.float32), group_size=32, bits=bits)
        if stem == "token_embd":
            hf = "model.embed_tokens"
        elif stem == "output_norm":
            hf = "model.norm"
        elif stem == "output":
            hf = "lm_head"
        else:
            _, n, part = stem.split(".", 2)
            hf = f"model.layers.{n}.{names[part]}"
        if part_is(hf, "q_proj") or part_is(hf, "k_proj"):
            nh = heads if hf.endswith("q_proj") else kv
            a = np.array(t)
            rows, cols = a.shape
            a = a.reshape(nh, rows // nh // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)
            t = mx.array(a)
        out[hf + ".weight"] = t.astype(mx.float32)
    mx.save_safetensors(str(dst / "model.safetensors"), out, metadata={"format": "pt"})
    config = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "hidden_size": int(m("llama.embedding_length")),
        "intermediate_size": int(m("llama.feed_forward_length")),
        "num_hidden_layers": int(m("llama.block_count")),
        "num_attention_heads": heads, "num_key_value_heads": kv,
        "rms_norm_eps": float(m("llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(m("llama.rope.freq_base")),
        "max_position_embeddings": int(m("llama.context_length")),
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "tie_word_embeddings": "lm_head.weight" not in out,
        "torch_dtype": "float32",
    }
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    # transformers' own GGUF import needs torch (gigabytes on Linux), so the reference
    # tokenizer is built with `tokenizers` from the GGUF vocabulary and merges, with
    # SmolLM2's pre-tokenizer (single digits, then GPT-2 byte level: llama.cpp's "smollm").
    tok = gguf_tokenizer(meta)
    tok.save_pretrained(str(dst))
    return dst


def gguf_tokenizer(meta):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = meta["tokenizer.ggml.tokens"]
    types = np.array(meta["tokenizer.ggml.token_type"]).tolist()
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    assert meta["tokenizer.ggml.pre"] == "smollm", meta["tokenizer.ggml.pre"]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges)
    tk = Tokenizer(bpe)
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, special=(k == 3)) for t, k in zip(tokens, types) if k in (3, 4)])
    bos = tokens[int(meta["tokenizer.ggml.bos_token_id"].item())]
    eos = tokens[int(meta["tokenizer.ggml.eos_token_id"].item())]
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=bos, eos_token=eos)
    fast.chat_template = meta["tokenizer.chat_template"]
    return fast


def part_is(name, part):
    return name.endswith("." + part)


def oracle(folder: Path, prompts, full_logits: bool, f32=True):
    """Greedy ids and last-position logits from mlx-lm, computing in f32 (or as stored)."""
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = load(str(folder))
    if f32:
        model.set_dtype(mx.float32)
    cases = []
    for ids in prompts:
        cache = make_prompt_cache(model)
        logits = model(mx.array([ids]), cache=cache)[0, -1].astype(mx.float32)
        last = np.array(logits)
        out = []
        for _ in range(N_TOKENS):
            t = int(mx.argmax(logits).item())
            out.append(t)
            if len(out) == N_TOKENS:
                break
            logits = model(mx.array([[t]]), cache=cache)[0, -1].astype(mx.float32)
        case = {"prompt_ids": ids, "greedy_ids": out}
        if full_logits:
            case["last_logits"] = [round(float(x), 6) for x in last]
        else:
            top = np.argsort(-last)[:32]
            rng = np.random.default_rng(0)
            probe = sorted(set(int(i) for i in rng.integers(0, last.shape[0], 32)))
            case["top_ids"] = [int(i) for i in top]
            case["top_logits"] = [round(float(last[i]), 6) for i in top]
            case["probe_ids"] = probe
            case["probe_logits"] = [round(float(last[i]), 6) for i in probe]
        cases.append(case)
    return cases


CONVERSATIONS = {
    "single": {"messages": [{"role": "user", "content": "What is the capital of France?"}]},
    "multi_turn": {"messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello. What do you need?"},
        {"role": "user", "content": "  A haiku about caches, please. \u00e9\u00e8 \u2603 \U0001f600"},
    ]},
    "tools": {
        "tools": [{"type": "function", "function": {
            "name": "get_weather", "description": "Current weather for a city.",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string", "description": "City name, e.g. \"Paris\""},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                "required": ["city"]}}}],
        "messages": [
            {"role": "system", "content": "Use tools when needed."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
                "name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]},
            {"role": "tool", "content": "{\"temp\": 21.5, \"sky\": \"clear\"}"},
            {"role": "assistant", "content": "It is 21.5 \u00b0C and clear in Paris."},
            {"role": "user", "content": "And in K\u00f8benhavn?"},
        ]},
    "reasoning": {"messages": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n4"},
        {"role": "user", "content": "Times 3?"},
        {"role": "assistant", "content": "12", "reasoning_content": "4*3=12"},
    ]},
}

TOKENIZER_TEXTS = [
    "Hello, world!",
    "The year 2024 had 366 days; 3.14159 is pi.",
    "  leading spaces\tand\ttabs\n\nnew lines  ",
    "caf\u00e9 na\u00efve \u2603 \U0001f600 \u4f60\u597d\u4e16\u754c",
    "<|im_start|>user\nhi<|im_end|>\n",
    "def f(x):\n    return x ** 2  # square\n",
    "don't won't I'm you'll they've",
]


def render(template, conv, gen, special, extra=None):
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(
        conversations=[conv["messages"]], tools=conv.get("tools"), chat_template=template,
        add_generation_prompt=gen, **special, **(extra or {}))
    return rendered[0]


def template_cases(template, special, tokenizer=None, extras=()):
    cases = []
    for name, conv in CONVERSATIONS.items():
        for gen in (False, True):
            for extra in [None, *extras]:
                text = render(template, conv, gen, special, extra)
                case = {"conversation": name, "add_generation_prompt": gen,
                        "messages_json": json.dumps(conv["messages"], ensure_ascii=False),
                        "tools_json": json.dumps(conv["tools"], ensure_ascii=False) if "tools" in conv else None,
                        "extra_json": json.dumps(extra) if extra else None,
                        "text": text}
                if tokenizer is not None:
                    case["ids"] = tokenizer.encode(text, add_special_tokens=False)
                cases.append(case)
    return cases


def main():
    from transformers import AutoTokenizer

    OUT.mkdir(parents=True, exist_ok=True)
    WORK.mkdir(parents=True, exist_ok=True)
    chatml = (TEMPLATES / "chatml_tools.jinja").read_text()
    header = (TEMPLATES / "header_tools.jinja").read_text()
    small = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5)
    models = {
        "tiny-llama": tiny_model("tiny-llama", dict(
            small, model_type="llama", rope_theta=10000.0, tie_word_embeddings=False,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
            header, seed=1, bos="<|begin_of_text|>", eos="<|eot_id|>"),
        "tiny-qwen2": tiny_model("tiny-qwen2", dict(
            small, model_type="qwen2", rope_theta=1e6, tie_word_embeddings=False),
            chatml, seed=2),
        "tiny-qwen3": tiny_model("tiny-qwen3", dict(
            small, model_type="qwen3", head_dim=32, rope_theta=1e6, rms_norm_eps=1e-6,
            tie_word_embeddings=True), chatml, seed=3),
    }
    models["tiny-qwen3-q4"] = quantized_copy(models["tiny-qwen3"], "tiny-qwen3-q4")

    goldens = {"n_tokens": N_TOKENS, "models": {}}
    for name, folder in models.items():
        tok = AutoTokenizer.from_pretrained(str(folder))
        prompts = [tok.encode("The quick brown fox", add_special_tokens=False),
                   tok.apply_chat_template(CONVERSATIONS["multi_turn"]["messages"],
                                           add_generation_prompt=True, tokenize=True)]
        goldens["models"][name] = {"path": name, "cases": oracle(folder, prompts, True)}
        if name.endswith("-q4"):
            goldens["models"][name + "-as-stored"] = {
                "path": name, "cases": oracle(folder, prompts, True, f32=False)}
        print(name, "ok", file=sys.stderr)

    smol = gguf_to_hf(WORK / "smollm2-hf")
    smol_tok = AutoTokenizer.from_pretrained(str(smol))
    prompts = [smol_tok.apply_chat_template(CONVERSATIONS[c]["messages"], add_generation_prompt=True,
                                            tokenize=True) for c in ("single", "multi_turn")]
    goldens["models"]["smollm2"] = {"path": "gguf", "cases": oracle(smol, prompts, False)}
    (OUT / "parity.json").write_text(json.dumps(goldens))
    print("smollm2 ok", file=sys.stderr)

    smol_special = {"bos_token": smol_tok.bos_token, "eos_token": smol_tok.eos_token}
    chat = {
        "smollm2": {"special": smol_special, "template": "gguf",
                    "cases": template_cases(smol_tok.chat_template, smol_special, smol_tok)},
        "chatml_tools": {"special": {"eos_token": "<|im_end|>"}, "template": "chatml_tools.jinja",
                         "cases": template_cases(chatml, {"eos_token": "<|im_end|>"},
                                                 extras=[{"enable_thinking": False}])},
        "header_tools": {"special": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
                         "template": "header_tools.jinja",
                         "cases": template_cases(header, {"bos_token": "<|begin_of_text|>",
                                                          "eos_token": "<|eot_id|>"},
                                                 extras=[{"date_string": "01 Jan 2025"}])},
    }
    (OUT / "chat_templates.json").write_text(json.dumps(chat, ensure_ascii=False, indent=1))
    shutil.copy(TEMPLATES / "chatml_tools.jinja", OUT / "chatml_tools.jinja")
    shutil.copy(TEMPLATES / "header_tools.jinja", OUT / "header_tools.jinja")

    toks = {"smollm2": [{"text": t, "ids": smol_tok.encode(t, add_special_tokens=False),
                         "ids_with_special": smol_tok.encode(t)} for t in TOKENIZER_TEXTS]}
    tiny = AutoTokenizer.from_pretrained(str(models["tiny-qwen3"]))
    toks["tiny-qwen3"] = [{"text": t, "ids": tiny.encode(t, add_special_tokens=False),
                           "ids_with_special": tiny.encode(t)} for t in TOKENIZER_TEXTS]
    (OUT / "tokenizer.json").write_text(json.dumps(toks, ensure_ascii=False, indent=1))
    print("goldens written to", OUT, file=sys.stderr)


if __name__ == "__main__":
    main()
