"""Gemma 3 parity goldens (engine/tests/goldens/gemma3.json and tiny-gemma3/) with mlx-lm.

Run through `make_goldens.sh --gemma`. Deterministic (fixed seeds).

1. tiny-gemma3: a random gemma3_text checkpoint small enough to commit (4 layers, hidden 64,
   window 16, layers 1 and 3 global, query_pre_attn_scalar unlike head_dim, tied
   embeddings as Gemma ships them; small embeddings, or greedy decoding just repeats the
   last token), with the tiny byte-level BPE tokenizer.
   Prompts shorter and longer than the window; 32 greedy tokens cross it either way.
2. gemma3-270m: the folder `bash scripts/setup.sh --with-gemma` converts from the GGUF
   (models/gemma3-270m), when present: a chat prompt and a prompt longer than the 512-token
   window. Top-32 and 32 probe logits (the vocabulary has 262,144 entries).
"""

import json
import shutil
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_goldens import CONVERSATIONS, CORPUS, OUT, ROOT, TEMPLATES, oracle, tiny_tokenizer  # noqa: E402

GEMMA = ROOT / "models" / "gemma3-270m"


def tiny_gemma3(name="tiny-gemma3", seed=8):
    folder = OUT / name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    template = (TEMPLATES / "chatml_tools.jinja").read_text()
    vocab = tiny_tokenizer(folder, template, None, "<|im_end|>")
    h, inter, layers, nh, nkv, hd = 64, 128, 4, 4, 2, 32
    config = {
        "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"],
        "hidden_size": h, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": nh, "num_key_value_heads": nkv, "head_dim": hd,
        "rms_norm_eps": 1e-6, "vocab_size": vocab, "max_position_embeddings": 2048,
        "rope_theta": 1e6, "rope_global_base_freq": 1e6, "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": 24, "sliding_window": 16, "sliding_window_pattern": 2,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "tie_word_embeddings": True, "final_logit_softcapping": None,
        "attn_logit_softcapping": None, "hidden_activation": "gelu_pytorch_tanh",
        "torch_dtype": "bfloat16",
    }
    mx.random.seed(seed)
    w = {}

    def lin(n, out, inp):
        w[n + ".weight"] = mx.random.normal((out, inp)) * (1.5 / inp ** 0.5)

    def norm(n, d):
        # Gemma norms scale by 1 + weight: weights near 0.
        w[n + ".weight"] = 0.5 * mx.random.normal((d,))

    w["model.embed_tokens.weight"] = mx.random.normal((vocab, h)) * 0.05
    for i in range(layers):
        p = f"model.layers.{i}"
        lin(p + ".self_attn.q_proj", nh * hd, h)
        lin(p + ".self_attn.k_proj", nkv * hd, h)
        lin(p + ".self_attn.v_proj", nkv * hd, h)
        lin(p + ".self_attn.o_proj", h, nh * hd)
        norm(p + ".self_attn.q_norm", hd)
        norm(p + ".self_attn.k_norm", hd)
        lin(p + ".mlp.gate_proj", inter, h)
        lin(p + ".mlp.up_proj", inter, h)
        lin(p + ".mlp.down_proj", h, inter)
        for n in ("input_layernorm", "post_attention_layernorm",
                  "pre_feedforward_layernorm", "post_feedforward_layernorm"):
            norm(f"{p}.{n}", h)
    norm("model.norm", h)
    w = {k: v.astype(mx.bfloat16) for k, v in w.items()}
    mx.save_safetensors(str(folder / "model.safetensors"), w, metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def main():
    from transformers import AutoTokenizer

    goldens = {"n_tokens": 32, "models": {}}
    tiny = tiny_gemma3()
    tok = AutoTokenizer.from_pretrained(str(tiny))
    prompts = [tok.encode("The quick brown fox", add_special_tokens=False),
               tok.encode(CORPUS[:400], add_special_tokens=False)]
    goldens["models"]["tiny-gemma3"] = {"path": "tiny-gemma3", "cases": oracle(tiny, prompts, True)}
    print("tiny-gemma3 ok", [len(p) for p in prompts], file=sys.stderr)

    if (GEMMA / "model.safetensors").exists():
        tok = AutoTokenizer.from_pretrained(str(GEMMA))
        chat = tok.apply_chat_template(CONVERSATIONS["single"]["messages"],
                                       add_generation_prompt=True, tokenize=True)
        long = tok.encode(CORPUS * 2)
        prompts = [chat, long]
        goldens["models"]["gemma3-270m"] = {"path": "models/gemma3-270m",
                                            "cases": oracle(GEMMA, prompts, False)}
        print("gemma3-270m ok", [len(p) for p in prompts], file=sys.stderr)
    else:
        print(f"skipping gemma3-270m: run 'bash scripts/setup.sh --with-gemma' first", file=sys.stderr)
    (OUT / "gemma3.json").write_text(json.dumps(goldens))


if __name__ == "__main__":
    main()
