"""Converts Gemma 3's llama.cpp GGUF (K-quants that MLX's GGUF loader refuses) into a
Hugging Face folder the engine and mlx-lm both load: config.json, model.safetensors (every
tensor dequantized to f32, so no value is rounded on the way), generation_config.json, and
the tokenizer files given on the command line.

Usage: gemma3_from_gguf.py MODEL.gguf TOKENIZER_DIR OUT_DIR

llama.cpp's converter stores Gemma's RMS norm weights as (1 + w) because its norm multiplies
by the weight directly; Hugging Face and mlx-lm keep w and add 1 at run time, so 1 is taken
off every `*_norm` tensor here. Gemma uses non-interleaved RoPE in llama.cpp as well, so Q and
K rows are not permuted. Needs the `gguf` package (numpy comes with it).
"""

import json
import os
import shutil
import struct
import sys

import gguf
import numpy as np

NAMES = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_name(name):
    stem = name.removesuffix(".weight")
    if stem == "token_embd":
        return "model.embed_tokens.weight"
    if stem == "output_norm":
        return "model.norm.weight"
    if stem == "output":
        return "lm_head.weight"
    _, n, part = stem.split(".", 2)
    return f"model.layers.{n}.{NAMES[part]}.weight"


def field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def write_safetensors(path, tensors):
    header, offset = {}, 0
    for name in sorted(tensors):
        t = tensors[name]
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    header["__metadata__"] = {"format": "pt", "source": "gemma3_from_gguf.py"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path + ".part", "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name in sorted(tensors):
            f.write(np.ascontiguousarray(tensors[name], dtype="<f4").tobytes())
    os.replace(path + ".part", path)


def main():
    src, tok_dir, out = sys.argv[1:4]
    r = gguf.GGUFReader(src)
    arch = field(r, "general.architecture")
    if arch != "gemma3":
        sys.exit(f"{src}: architecture {arch!r}, expected gemma3")
    tensors = {}
    for t in r.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape([int(d) for d in reversed(t.shape)])
        name = hf_name(t.name)
        if name.endswith("norm.weight"):
            w = w - np.float32(1.0)
        tensors[name] = w
    g = lambda k, d=None: field(r, f"gemma3.{k}", d)
    layers = int(g("block_count"))
    window = int(g("attention.sliding_window"))
    # llama.cpp's gemma3 graph: every 6th layer is global, local layers use base 10000.
    pattern = 6
    config = {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": int(g("embedding_length")),
        "intermediate_size": int(g("feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": int(g("attention.head_count")),
        "num_key_value_heads": int(g("attention.head_count_kv")),
        "head_dim": int(g("attention.key_length")),
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(g("rope.freq_base")),
        "rope_global_base_freq": float(g("rope.freq_base")),
        "rope_local_base_freq": 10000.0,
        "rope_scaling": None,
        "query_pre_attn_scalar": int(g("attention.key_length")),
        "sliding_window": window,
        "sliding_window_pattern": pattern,
        "layer_types": [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)
        ],
        "max_position_embeddings": int(g("context_length")),
        "vocab_size": tensors["model.embed_tokens.weight"].shape[0],
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "hidden_activation": "gelu_pytorch_tanh",
        "bos_token_id": int(field(r, "tokenizer.ggml.bos_token_id", 2)),
        "eos_token_id": [1, 106],
        "pad_token_id": 0,
        "torch_dtype": "float32",
    }
    os.makedirs(out, exist_ok=True)
    write_safetensors(os.path.join(out, "model.safetensors"), tensors)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": config["bos_token_id"], "eos_token_id": [1, 106], "pad_token_id": 0}, f, indent=2)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(os.path.join(tok_dir, name), os.path.join(out, name))


if __name__ == "__main__":
    main()
