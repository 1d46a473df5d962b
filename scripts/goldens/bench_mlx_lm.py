"""mlx-lm's side of `kvstore bench generate`: prefill and decode speed on given token ids.

Usage: bench_mlx_lm.py MODEL_DIR PROMPT_LEN[,PROMPT_LEN...] DECODE_TOKENS [f32|stored]
`f32` (the default) casts the weights to f32, what kvstore computes in on CPU; `stored` keeps
the checkpoint's dtype, to compare against `kvstore --keep-quantized` on a bf16 checkpoint on
a GPU (docs/cuda.md). Prints one JSON object per prompt length, as mlx-lm reports it.
"""

import json
import sys

import mlx.core as mx
from mlx_lm import load, stream_generate
from mlx_lm.sample_utils import make_sampler


def main():
    folder, lens, decode = sys.argv[1], [int(x) for x in sys.argv[2].split(",")], int(sys.argv[3])
    dtype = sys.argv[4] if len(sys.argv) > 4 else "f32"
    model, tok = load(folder)
    if dtype == "f32":
        model.set_dtype(mx.float32)
    tok._eos_token_ids = set()  # measure exactly `decode` tokens
    base = tok.encode("The quick brown fox jumps over the lazy dog. " * 400, add_special_tokens=False)
    for _ in stream_generate(model, tok, base[:16], max_tokens=4):  # warm-up, as kvstore does
        pass
    for n in lens:
        prompt = (base * (n // len(base) + 1))[:n]
        mx.reset_peak_memory()
        last = None
        for last in stream_generate(model, tok, prompt, max_tokens=decode,
                                    sampler=make_sampler(temp=0.0)):
            pass
        print(json.dumps({"prompt_tokens": n, "prefill_tok_per_s": last.prompt_tps,
                          "decode_tok_per_s": last.generation_tps,
                          "generated_tokens": last.generation_tokens,
                          "peak_memory_bytes": int(mx.get_peak_memory()),
                          "dtype": dtype, "device": str(mx.default_device())}), flush=True)


if __name__ == "__main__":
    main()
