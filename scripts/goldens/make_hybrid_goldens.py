"""Hybrid-model parity goldens (engine/tests/goldens/hybrid.json and tiny-<family>/) with
mlx-lm.

Run through `make_goldens.sh --hybrid`. Deterministic (fixed seeds).

Each tiny checkpoint is made from mlx-lm's own model class for the family: the class is
built from the config, and every parameter it declares gets seeded random values of its
own shape and name (norm weights near 1, projections scaled by fan-in), so the names and
layouts are mlx-lm's. Written as a Hugging Face folder (bf16 safetensors, config.json) with
the tiny byte-level BPE tokenizer. The oracle loads the folder with `mlx_lm.load` and
computes in f32: greedy ids for 32 tokens and last-position logits, for a short prompt and
one longer than several blocks of 32 tokens.

1. tiny-lfm2 (`lfm2`): 4 layers (conv, attention, conv, attention), hidden 64, 4 heads /
   2 KV heads, 3-tap convolutions, auto-adjusted feed-forward width.
2. tiny-qwen3-next (`qwen3_next`, dense): 4 layers (DeltaNet, attention, DeltaNet,
   attention), hidden 64; attention 4 heads / 2 KV heads of 16 with half of each head
   rotated; DeltaNet 2 key heads of 16, 4 value heads of 8, 4-tap convolution.
3. tiny-nemotron-h (`nemotron_h`): 4 layers `M*M-` (Mamba-2, attention, Mamba-2, MLP),
   hidden 64; Mamba-2 4 heads of 16, 2 groups, state 16, 4-tap convolution with a bias;
   attention 4 heads / 2 KV heads of 16.
"""

import json
import shutil
import sys
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_goldens import CONVERSATIONS, CORPUS, OUT, TEMPLATES, oracle, tiny_tokenizer  # noqa: E402


def random_like(name: str, shape):
    """Seeded values for parameter `name`: norms near 1, biases small, the rest by fan-in."""
    if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
        return 1.0 + 0.2 * mx.random.normal(shape)
    if name.endswith(".bias"):
        return 0.1 * mx.random.normal(shape)
    if name.endswith("embed_tokens.weight"):
        return mx.random.normal(shape)
    fan_in = 1
    for d in shape[1:]:
        fan_in *= d
    return mx.random.normal(shape) * (1.5 / max(fan_in, 1) ** 0.5)


def tiny_from_mlx_lm(name: str, module, config: dict, seed: int):
    """A checkpoint of mlx-lm's `module.Model` for `config`, random weights."""
    folder = OUT / name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    template = (TEMPLATES / "chatml_tools.jinja").read_text()
    vocab = tiny_tokenizer(folder, template, None, "<|im_end|>")
    config = dict(config, vocab_size=vocab, torch_dtype="bfloat16")
    model = module.Model(module.ModelArgs.from_dict(config))
    mx.random.seed(seed)
    weights = {k: random_like(k, v.shape).astype(mx.bfloat16)
               for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def tiny_lfm2():
    from mlx_lm.models import lfm2

    return tiny_from_mlx_lm("tiny-lfm2", lfm2, {
        "model_type": "lfm2", "architectures": ["Lfm2ForCausalLM"],
        "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 16384, "norm_eps": 1e-5,
        "conv_bias": False, "conv_L_cache": 3, "block_dim": 64, "block_ff_dim": 128,
        "block_multiple_of": 32, "block_ffn_dim_multiplier": None,
        "block_auto_adjust_ff_dim": True, "rope_theta": 1e6,
        "layer_types": ["conv", "full_attention", "conv", "full_attention"],
        "tie_embedding": True,
    }, seed=20)


def tiny_qwen3_next():
    from mlx_lm.models import qwen3_next

    return tiny_from_mlx_lm("tiny-qwen3-next", qwen3_next, {
        "model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"],
        "hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
        "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4, "num_experts": 0,
        "num_experts_per_tok": 0, "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": 0, "mlp_only_layers": [],
        "moe_intermediate_size": 0, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
        "partial_rotary_factor": 0.5, "max_position_embeddings": 16384,
        "tie_word_embeddings": True, "full_attention_interval": 2,
    }, seed=21)


def tiny_nemotron_h():
    from mlx_lm.models import nemotron_h

    return tiny_from_mlx_lm("tiny-nemotron-h", nemotron_h, {
        "model_type": "nemotron_h", "architectures": ["NemotronHForCausalLM"],
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "max_position_embeddings": 16384, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "attention_bias": False,
        "mamba_num_heads": 4, "mamba_head_dim": 16, "mamba_proj_bias": False,
        "ssm_state_size": 16, "conv_kernel": 4, "n_groups": 2,
        "time_step_limit": [0.001, 100.0], "mlp_bias": False, "layer_norm_epsilon": 1e-5,
        "rms_norm_eps": 1e-5, "use_bias": False, "use_conv_bias": True,
        "residual_in_fp32": True, "hybrid_override_pattern": "M*M-",
    }, seed=22)


def main():
    from transformers import AutoTokenizer

    goldens = {"n_tokens": 32, "models": {}}
    for name, make in [("tiny-lfm2", tiny_lfm2), ("tiny-qwen3-next", tiny_qwen3_next),
                       ("tiny-nemotron-h", tiny_nemotron_h)]:
        folder = make()
        tok = AutoTokenizer.from_pretrained(str(folder))
        prompts = [tok.encode("The quick brown fox", add_special_tokens=False),
                   tok.apply_chat_template(CONVERSATIONS["multi_turn"]["messages"],
                                           add_generation_prompt=True, tokenize=True),
                   tok.encode(CORPUS[:400], add_special_tokens=False)]
        goldens["models"][name] = {"path": name, "cases": oracle(folder, prompts, True)}
        print(name, "ok", [len(p) for p in prompts], file=sys.stderr)
    (OUT / "hybrid.json").write_text(json.dumps(goldens))


if __name__ == "__main__":
    main()
