"""mlx-lm's side of the graph census (`KVSTORE_GRAPH_CENSUS=1`, engine/src/census.rs): the
nodes (MLX primitives) of one decode step as mlx-lm's generate loop builds it.

Usage: census_mlx_lm.py MODEL_DIR PROMPT_LEN [f32|stored]
Prefills PROMPT_LEN tokens into mlx-lm's prompt cache, then builds one greedy decode step
(the model call, the last position's log-probabilities and the pick, what
`mlx_lm.generate.generate_step` queues each step) and counts its pending nodes in MLX's DOT
export. Prints one JSON object: nodes per step, by primitive. On a GPU the fast ops
(RMSNorm, RoPE, attention) are one node each; on the CPU MLX expands them into their
fallback graphs, so compare with kvstore's census on the same device.
"""

import collections
import io
import json
import re
import sys

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache


def main():
    folder, n = sys.argv[1], int(sys.argv[2])
    dtype = sys.argv[3] if len(sys.argv) > 3 else "f32"
    model, tok = load(folder)
    if dtype == "f32":
        model.set_dtype(mx.float32)
    base = tok.encode("The quick brown fox jumps over the lazy dog. " * 400, add_special_tokens=False)
    prompt = mx.array((base * (n // len(base) + 1))[:n])
    cache = make_prompt_cache(model)
    logits = model(prompt[None], cache=cache)
    y = mx.argmax(logits[:, -1, :], axis=-1)
    mx.eval(y, [c.state for c in cache])
    # One step as generate_step builds it: model call, log-probabilities, greedy pick.
    logits = model(y[:, None], cache=cache)[:, -1, :]
    logprobs = logits - mx.logsumexp(logits, keepdims=True)
    y = mx.argmax(logprobs, axis=-1)
    out = io.StringIO()
    mx.export_to_dot(out, y, logprobs)
    names = re.findall(r'label ="([^"]+)", shape=rectangle', out.getvalue())
    counts = collections.Counter(names)
    print(json.dumps({"prompt_tokens": n, "nodes_per_step": len(names),
                      "by_primitive": dict(counts.most_common()),
                      "device": str(mx.default_device()), "dtype": dtype}))


if __name__ == "__main__":
    main()
