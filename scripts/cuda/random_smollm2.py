"""A SmolLM2-135M-shaped Hugging Face folder with random f32 weights, for speed runs only.

Usage: random_smollm2.py DEST TOKENIZER_DIR
Shape of SmolLM2-135M-Instruct (llama): hidden 576, 30 layers, 9 query / 3 KV heads of 64,
MLP 1536, vocabulary 49152, tied embeddings, RoPE theta 1e5; max_position_embeddings 65536
so a session can grow to 32K tokens. Made on the GPU machine instead of carrying the 93 MB
GGUF there: the speed of a step does not depend on the weights' values, and the tokenizer
files (SmolLM2's own, from TOKENIZER_DIR) give the same token ids as the real model, so
`bench agent` replays the same prompts. What the model says is noise.
"""

import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

dst, tok_dir = Path(sys.argv[1]), Path(sys.argv[2])
H, I, V, NH, KV, D, L = 576, 1536, 49152, 9, 3, 64, 30
cfg = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"],
    "hidden_size": H, "intermediate_size": I, "num_hidden_layers": L,
    "num_attention_heads": NH, "num_key_value_heads": KV, "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0, "max_position_embeddings": 65536, "vocab_size": V,
    "tie_word_embeddings": True, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
}
dst.mkdir(parents=True, exist_ok=True)
gen = torch.Generator().manual_seed(0)


def rnd(*shape):
    return torch.randn(*shape, dtype=torch.float32, generator=gen) * 0.02


t = {"model.embed_tokens.weight": rnd(V, H), "model.norm.weight": torch.ones(H)}
for l in range(L):
    p = f"model.layers.{l}."
    t[p + "input_layernorm.weight"] = torch.ones(H)
    t[p + "post_attention_layernorm.weight"] = torch.ones(H)
    t[p + "self_attn.q_proj.weight"] = rnd(NH * D, H)
    t[p + "self_attn.k_proj.weight"] = rnd(KV * D, H)
    t[p + "self_attn.v_proj.weight"] = rnd(KV * D, H)
    t[p + "self_attn.o_proj.weight"] = rnd(H, NH * D)
    t[p + "mlp.gate_proj.weight"] = rnd(I, H)
    t[p + "mlp.up_proj.weight"] = rnd(I, H)
    t[p + "mlp.down_proj.weight"] = rnd(H, I)
save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
(dst / "config.json").write_text(json.dumps(cfg, indent=2))
for f in ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"]:
    if (tok_dir / f).exists():
        shutil.copy(tok_dir / f, dst / f)
print(f"{dst}: {sum(v.numel() for v in t.values()) / 1e6:.1f} M f32 parameters")
