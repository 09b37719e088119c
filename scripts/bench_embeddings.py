#!/usr/bin/env python3
"""Embedding latency: one 32-token text through all-MiniLM-L6-v2, ONNX Runtime against torch, in
interleaved rounds in one process (p50 and p99 of single calls), and how far apart they are
(cosine of the two backends' vectors on the texts used).

    python scripts/bench_embeddings.py [--threads 1] [--rounds 5] [--calls 40]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from llmserve.embeddings import EmbeddingModel

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex every jolly vexed "
         "sphinx of black quartz judging my vow near the old river town at dawn").split()


def text_of(tokens: int, model: EmbeddingModel, seed: int) -> str:
    """A text that tokenizes to exactly `tokens` tokens ([CLS] and [SEP] included)."""
    rng = np.random.default_rng(seed)
    words: list[str] = []
    while len(model.tokenizer.encode(" ".join(words)).ids) < tokens:
        words.append(str(rng.choice(WORDS)))
    while len(model.tokenizer.encode(" ".join(words)).ids) > tokens:
        words.pop()
    return " ".join(words)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads of both backends")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=40, help="single-text calls per backend per round")
    p.add_argument("--tokens", type=int, default=32)
    args = p.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    models = {b: EmbeddingModel(b, num_threads=args.threads) for b in ("onnxruntime", "torch")}
    texts = [text_of(args.tokens, models["torch"], i) for i in range(args.calls)]
    times: dict[str, list[float]] = {b: [] for b in models}
    for _ in range(args.rounds):
        for name, model in models.items():
            model.encode(texts[:2])  # warm
            for t in texts:
                s = time.perf_counter()
                model.encode([t])
                times[name].append((time.perf_counter() - s) * 1000)
    a, _ = models["onnxruntime"].encode(texts)
    b, _ = models["torch"].encode(texts)
    for name, ts in times.items():
        ts.sort()
        print(f"{name:12s} p50 {statistics.median(ts):6.2f} ms   p99 {ts[int(0.99 * (len(ts) - 1))]:6.2f} ms   ({len(ts)} calls)")
    ratio = statistics.median(times["torch"]) / statistics.median(times["onnxruntime"])
    print(f"onnxruntime is {ratio:.2f}x faster at p50; min cosine between backends {float((a * b).sum(1).min()):.6f}")


if __name__ == "__main__":
    main()
