"""Writes engine/tests/goldens/tiny-llama as an f32 GGUF with a byte-level BPE ("gpt2")
tokenizer, the GGUF form kvstore reads, for checking the GGUF path on a GPU against the CPU
(`device.sh gg`). mlx-lm's converter writes the weights and the model's metadata; its
tokenizer metadata ("llama", SentencePiece) is replaced by the tiny model's BPE vocabulary
and merges. The GGUF has no rope scaling, so its tokens differ from the safetensors'.

Usage: python tiny_gguf.py OUT.gguf   (with mlx and mlx-lm, e.g. .venv-peer)
"""

import json
import os
import sys

import mlx.core as mx
from mlx_lm.gguf import convert_to_gguf

SRC = "engine/tests/goldens/tiny-llama"


def main(out):
    weights = {k: v.astype(mx.float32) for k, v in mx.load(f"{SRC}/model.safetensors").items()}
    config = json.load(open(f"{SRC}/config.json"))
    plain = out + ".plain.gguf"
    convert_to_gguf(SRC, weights, config, plain)
    arrays, meta = mx.load(plain, return_metadata=True)
    os.remove(plain)
    tok = json.load(open(f"{SRC}/tokenizer.json"))["model"]
    vocab = sorted(tok["vocab"].items(), key=lambda kv: kv[1])
    meta["tokenizer.ggml.model"] = "gpt2"
    meta["tokenizer.ggml.tokens"] = [t for t, _ in vocab]
    meta["tokenizer.ggml.merges"] = [m if isinstance(m, str) else " ".join(m) for m in tok["merges"]]
    meta["tokenizer.ggml.token_type"] = mx.array([1] * len(vocab), dtype=mx.int32)
    meta.pop("tokenizer.ggml.scores", None)
    mx.save_gguf(out, arrays, meta)


if __name__ == "__main__":
    main(sys.argv[1])
