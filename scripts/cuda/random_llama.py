"""A Llama-3-8B-shaped Hugging Face folder with random bf16 weights, for speed runs only.

Usage: random_llama.py DEST TOKENIZER_DIR [LAYERS]
Shape of Llama 3.1 8B: hidden 4096, 32 layers, 32 query / 8 KV heads of 128, MLP 14336,
vocabulary 128256, llama3 RoPE scaling. Weights are N(0, 0.02) drawn on the GPU with torch
(the device image has torch and safetensors), written as 5 shards + index. The tokenizer
files are copied from TOKENIZER_DIR (SmolLM2's: its ids are all below 128256; what the
model says is noise, only its speed is measured).
"""

import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

dst, tok_dir = Path(sys.argv[1]), Path(sys.argv[2])
layers = int(sys.argv[3]) if len(sys.argv) > 3 else 32
H, I, V, NH, KV, D = 4096, 14336, 128256, 32, 8, 128
cfg = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"],
    "hidden_size": H, "intermediate_size": I, "num_hidden_layers": layers,
    "num_attention_heads": NH, "num_key_value_heads": KV, "head_dim": D,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "vocab_size": V, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "bos_token_id": 1, "eos_token_id": 2,
}
dst.mkdir(parents=True, exist_ok=True)
gen = torch.Generator(device="cuda").manual_seed(0)


def rnd(*shape):
    return (torch.randn(*shape, device="cuda", dtype=torch.float32, generator=gen) * 0.02).to(torch.bfloat16).cpu()


def ones(n):
    return torch.ones(n, dtype=torch.bfloat16)


shards, weight_map = [], {}
per_shard = 8
groups = [list(range(i, min(i + per_shard, layers))) for i in range(0, layers, per_shard)]
n_files = len(groups) + 1
for gi, group in enumerate(groups):
    t = {}
    for l in group:
        p = f"model.layers.{l}."
        t[p + "input_layernorm.weight"] = ones(H)
        t[p + "post_attention_layernorm.weight"] = ones(H)
        t[p + "self_attn.q_proj.weight"] = rnd(NH * D, H)
        t[p + "self_attn.k_proj.weight"] = rnd(KV * D, H)
        t[p + "self_attn.v_proj.weight"] = rnd(KV * D, H)
        t[p + "self_attn.o_proj.weight"] = rnd(H, NH * D)
        t[p + "mlp.gate_proj.weight"] = rnd(I, H)
        t[p + "mlp.up_proj.weight"] = rnd(I, H)
        t[p + "mlp.down_proj.weight"] = rnd(H, I)
    shards.append(t)
shards.append({"model.embed_tokens.weight": rnd(V, H), "model.norm.weight": ones(H),
               "lm_head.weight": rnd(V, H)})
total = 0
for i, t in enumerate(shards):
    name = f"model-{i + 1:05d}-of-{n_files:05d}.safetensors"
    save_file(t, str(dst / name), metadata={"format": "pt"})
    for k, v in t.items():
        weight_map[k] = name
        total += v.numel() * 2
(dst / "model.safetensors.index.json").write_text(
    json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
(dst / "config.json").write_text(json.dumps(cfg, indent=2))
for f in ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"]:
    if (tok_dir / f).exists():
        shutil.copy(tok_dir / f, dst / f)
print(f"{dst}: {total / 1e9:.2f} GB of bf16 weights, {layers} layers")
