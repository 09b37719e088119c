"""Decoder layers as one op (llmserve::decoder_layer, the plan's fused_layers) against their own
ops, in one engine: the same weights and KV cache run two compiled step graphs, one traced with
the layers fused and one without, alternating step by step, so that neither gains from where its
memory happens to lie (two engines side by side differ by up to 10% at batch 1 for that alone).

Columns: decode steps at --batches (every sequence at --context tokens) and one prefill of
--prefill tokens, as scripts/bench_compile.py builds them; tok/s, medians over --rounds, and the
median of the per-round ratios fused / unfused.
Usage: python scripts/bench_fused.py [--model DIR] [--quantize none|int8|int4] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_compile import decode_input, prefill_input, tokens_per_s  # noqa: E402

from llmserve.config import EngineConfig  # noqa: E402
from llmserve.engine.llm_engine import LLMEngine  # noqa: E402
from llmserve.model.compile import StepGraph  # noqa: E402


def graphs(engine: LLMEngine) -> dict[str, StepGraph]:
    """The engine's own (fused) graph, and one compiled over the same model with the layers' ops."""
    if engine.plan.fused_layers.value != "on":
        raise SystemExit(f"the plan runs no fused layers here: {engine.plan.fused_layers.reason}")
    model = engine.model
    for layer in model.layers:
        layer.fused = False
    unfused = StepGraph(model)
    unfused.warm_up(engine.runner.kv_caches)
    for layer in model.layers:  # the graphs keep what they traced; the flags only steer tracing
        layer.fused = True
    return {"fused": engine.runner.step_graph, "unfused": unfused}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--quantize", default=None, choices=["none", "int8", "int4"], help="default: as stored")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    engine = LLMEngine(EngineConfig(model=args.model, quantize=args.quantize, compile="inductor",
                                    kv_cache_memory=1 << 29))
    print(engine.plan.describe())
    runner, both = engine.runner, graphs(engine)
    columns = {f"batch {b}": (lambda b=b: decode_input(b, args.context), b, args.steps) for b in map(int, args.batches.split(","))}
    columns[f"prefill {args.prefill}"] = (lambda: prefill_input(args.prefill), args.prefill, 2)
    rounds = []
    for i in range(args.rounds):
        figures = {}
        for col, (make, tokens, steps) in columns.items():
            for name in (list(both) if i % 2 == 0 else list(both)[::-1]):
                runner.step_graph = both[name]
                figures[name, col] = tokens_per_s(runner, make, tokens, steps)
        rounds.append(figures)
        print(f"round {i + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    runner.step_graph = both["fused"]
    print(f"\n{args.rounds} rounds; tok/s, median over rounds (fused / unfused: median of per-round ratios)")
    print("| layers | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    for name in both:
        cells = [f"{statistics.median(r[name, c] for r in rounds):.1f}" for c in columns]
        if name == "fused":
            cells = [f"{cell} ({statistics.median(r['fused', c] / r['unfused', c] for r in rounds):.2f}x)"
                     for cell, c in zip(cells, columns, strict=True)]
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    with torch.inference_mode():
        main()
