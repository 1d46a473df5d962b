"""mlx-lm's arm of `kvstore bench agent`: the same transcript through mlx-lm with its prompt
cache, the way mlx-lm's server reuses it (keep the cache, trim it to the longest common
prefix with the new prompt, prefill the rest).

Usage: mlx_lm_agent.py MODEL_DIR TRANSCRIPT.json [stored]
TRANSCRIPT.json: {"max_tokens": N, "prompts": [[token ids of turn 1], [turn 2], ...]}
`stored` keeps the checkpoint's dtype (what `kvstore --keep-quantized` does); without it
the model computes in f32, as kvstore does on CPU.
Prints one JSON object per turn: prompt_tokens, cached_tokens, ttft_s.
"""

import json
import sys
import time

import mlx.core as mx
from mlx_lm import load, stream_generate
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache
from mlx_lm.sample_utils import make_sampler


def main():
    folder, transcript = sys.argv[1], json.load(open(sys.argv[2]))
    model, tok = load(folder)
    if sys.argv[3:4] != ["stored"]:
        model.set_dtype(mx.float32)  # what kvstore computes in on CPU
    cache = make_prompt_cache(model)
    held = []  # tokens the cache holds
    sampler = make_sampler(temp=0.0)
    for prompt in transcript["prompts"]:
        start = time.perf_counter()
        common = 0
        while common < min(len(held), len(prompt) - 1) and held[common] == prompt[common]:
            common += 1
        if common < len(held):
            if can_trim_prompt_cache(cache):
                trim_prompt_cache(cache, len(held) - common)
            else:
                cache, common = make_prompt_cache(model), 0
        ttft = None
        generated = []
        for r in stream_generate(model, tok, prompt[common:], max_tokens=transcript["max_tokens"],
                                 sampler=sampler, prompt_cache=cache):
            if ttft is None:
                ttft = time.perf_counter() - start
            generated.append(r.token)
        # What the cache holds now, read from the cache itself.
        held = (list(prompt) + generated)[: cache[0].offset]
        print(json.dumps({"prompt_tokens": len(prompt), "cached_tokens": common, "ttft_s": ttft}), flush=True)


if __name__ == "__main__":
    main()
