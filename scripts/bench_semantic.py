#!/usr/bin/env python3
"""How well all-MiniLM-L6-v2 tells a paraphrase from a different question: the threshold sweep a
semantic cache's default must come from.

tests/data/semantic_pairs.jsonl holds 100 paraphrase pairs and 300 unrelated pairs (100 hard ones,
the same question about a different thing: "capital of France" / "capital of Germany", and 200
pairs of different questions). For each threshold: the share of paraphrase pairs whose cosine
reaches it (hits) and the share of unrelated pairs that do (false hits, a wrong answer served).

    python scripts/bench_semantic.py [--backend onnxruntime]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from llmserve.embeddings import EmbeddingModel

DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "semantic_pairs.jsonl"


def similarities(model: EmbeddingModel, rows: list[dict]) -> np.ndarray:
    a, _ = model.encode([r["a"] for r in rows])
    b, _ = model.encode([r["b"] for r in rows])
    return (a * b).sum(1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="onnxruntime", choices=("onnxruntime", "torch"))
    args = p.parse_args()
    rows = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    sims = similarities(EmbeddingModel(args.backend), rows)
    para = np.array([s for s, r in zip(sims, rows, strict=True) if r["kind"] == "paraphrase"])
    unrel = np.array([s for s, r in zip(sims, rows, strict=True) if r["kind"] == "unrelated"])
    hard = np.array([s for s, r in zip(sims, rows, strict=True) if r.get("hard")])
    print(f"{len(para)} paraphrase pairs (cosine min {para.min():.3f}, median {np.median(para):.3f}); "
          f"{len(unrel)} unrelated pairs (max {unrel.max():.3f}; the {len(hard)} hard ones: median {np.median(hard):.3f})\n")
    print("threshold  paraphrase hits  false hits (unrelated)  false hits (hard)")
    for t in np.arange(0.80, 1.0, 0.01):
        print(f"{t:9.2f}  {np.mean(para >= t):15.0%}  {np.mean(unrel >= t):22.1%}  {np.mean(hard >= t):17.1%}")
    safe = float(unrel.max())
    print(f"\nno false hit above {safe:.3f}: there the paraphrase hit rate is {np.mean(para > safe):.0%}")


if __name__ == "__main__":
    main()
