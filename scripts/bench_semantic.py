#!/usr/bin/env python3
"""How well the semantic cache tells a paraphrase from a different question, and how fast it
answers one.

Quality (the default): tests/data/semantic_pairs.jsonl holds 100 paraphrase pairs and 300
unrelated pairs (100 hard ones, the same question about a different thing: "capital of France" /
"capital of Germany"); semantic_pairs_holdout.jsonl holds 40 and 40 hard ones, written before the
key-term check was designed; semantic_pairs_holdout2.jsonl holds 60 and 60 hard ones, written
apart from the check's question idioms and answer kinds, and not read while they were designed. For each cosine threshold (all-MiniLM-L6-v2): the share of
paraphrase pairs that would hit and the number of unrelated pairs that would (a wrong answer
served), by cosine alone and with the key-term check the cache also applies.

    python scripts/bench_semantic.py [--backend onnxruntime|torch]

Speed (--url): against a running `llmserve serve --semantic-cache`, asks each pair's first
question, then its paraphrase, and reports the latency of the semantic hits (non-streaming, one
kept-alive connection, embedding included) beside exact hits of the same questions.

    python scripts/bench_semantic.py --url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from llmserve.cache.key_terms import key_terms, same_question
from llmserve.config import ServerConfig

DATA = Path(__file__).resolve().parents[1] / "tests" / "data"
SETS = ("semantic_pairs.jsonl", "semantic_pairs_holdout.jsonl", "semantic_pairs_holdout2.jsonl")


def load(name: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / name).read_text().splitlines() if line.strip()]


def sweep(backend: str) -> None:
    from llmserve.embeddings import EmbeddingModel

    model = EmbeddingModel(backend)
    default = ServerConfig().semantic_threshold
    for name in SETS:
        rows = load(name)
        a, _ = model.encode([r["a"] for r in rows])
        b, _ = model.encode([r["b"] for r in rows])
        sims = (a * b).sum(1)
        para = np.array([r["kind"] == "paraphrase" for r in rows])
        same = np.array([same_question(key_terms(r["a"]), key_terms(r["b"])) for r in rows])
        print(f"\n{name}: {para.sum()} paraphrase pairs, {(~para).sum()} unrelated "
              f"(cosine of unrelated pairs up to {sims[~para].max():.3f})")
        print("threshold | cosine only: hits  false hits | with key terms: hits  false hits")
        for t in np.arange(0.70, 0.99, 0.05):
            cos = sims >= t - 1e-9
            mark = "  <- default" if abs(t - default) < 1e-6 else ""
            print(f"{t:9.2f} | {np.mean(cos[para]):17.0%} {np.sum(cos[~para]):11d} | "
                  f"{np.mean((cos & same)[para]):19.0%} {np.sum((cos & same)[~para]):11d}{mark}")


def latency(url: str) -> None:
    import httpx

    def ask(client: httpx.Client, question: str) -> tuple[str, float]:
        t0 = time.perf_counter()
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": question}],
                                                      "max_tokens": 8, "temperature": 0})
        r.raise_for_status()
        return r.headers.get("x-llmserve-cache", "?"), (time.perf_counter() - t0) * 1000

    pairs = [r for name in SETS for r in load(name) if r["kind"] == "paraphrase"]
    semantic, exact = [], []
    with httpx.Client(base_url=url, timeout=120) as client:
        for r in pairs:
            ask(client, r["a"])
            status, ms = ask(client, r["b"])
            if status == "semantic-hit":
                semantic.append(ms)
            status, ms = ask(client, r["a"])
            if status == "hit":
                exact.append(ms)
    print(f"{len(pairs)} paraphrase pairs: {len(semantic)} semantic hits, {len(exact)} exact hits")
    for label, ms in (("semantic hit", semantic), ("exact hit", exact)):
        if ms:
            p99 = np.percentile(ms, 99)
            print(f"{label:13s} p50 {statistics.median(ms):6.2f} ms   p99 {p99:6.2f} ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="onnxruntime", choices=("onnxruntime", "torch"))
    p.add_argument("--url", help="measure hit latency against this running server instead")
    args = p.parse_args()
    latency(args.url) if args.url else sweep(args.backend)


if __name__ == "__main__":
    main()
