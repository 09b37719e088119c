"""Start-up cost of the default model: resolve (convert the GGUF on first use) and load it.

Usage: /usr/bin/time -v python scripts/load_time.py   (peak RSS: "Maximum resident set size")
First start: remove models/smollm2-135m-instruct first; later starts reuse the converted folder.
"""

import time

t0 = time.monotonic()
from llmserve.model.loader import load_model  # noqa: E402
from llmserve.model.resolve import resolve_model  # noqa: E402
from llmserve.tokenizer import Tokenizer  # noqa: E402

t1 = time.monotonic()
folder = resolve_model(None)
t2 = time.monotonic()
model = load_model(folder)
tok = Tokenizer(folder)
t3 = time.monotonic()
print(f"imports {t1 - t0:.1f} s, resolve/convert {t2 - t1:.1f} s, load {t3 - t2:.1f} s, "
      f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")
