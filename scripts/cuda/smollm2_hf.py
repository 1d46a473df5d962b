"""SmolLM2's GGUF as the f32 Hugging Face folder mlx-lm reads, made where it is needed.

Usage: smollm2_hf.py DEST
The same conversion as scripts/goldens/make_goldens.sh (make_goldens.gguf_to_hf: MLX's own
GGUF loader, dequantized, Q/K rows un-permuted), so the 538 MB f32 folder need not travel
to the GPU machine: only the 98 MB GGUF does.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "goldens"))
import make_goldens  # noqa: E402

print(make_goldens.gguf_to_hf(Path(sys.argv[1])))
