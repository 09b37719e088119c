"""Decode tokens/s per execution mode, side by side in one process, plus compiled start-up time.

Modes: eager fp32, inductor fp32, eager bf16, inductor bf16, int8 (weight-only, bf16 activations).
Each mode runs decode-only steps of the model at batch 1, 8 and 32 (context --context tokens)
through the same path the engine uses (ModelRunner.forward: compiled bucket or eager), then the
LM head and argmax. Start-up: a fresh process compiles the decode buckets with an empty inductor
cache (cold), then again with that cache (warm).
Usage: python scripts/bench_compile.py [--model DIR] [--batches 1,8,32] [--steps 30]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import torch

from llmserve.engine.model_runner import ModelInput, ModelRunner
from llmserve.model.attention import AttentionMetadata
from llmserve.model.loader import load_model
from llmserve.model.resolve import resolve_model

MODES = {  # name: (dtype, compile, quantize)
    "eager fp32": (torch.float32, False, None),
    "inductor fp32": (torch.float32, True, None),
    "eager bf16": (torch.bfloat16, False, None),
    "inductor bf16": (torch.bfloat16, True, None),
    "int8": (torch.float32, False, "int8"),
}


def decode_input(batch: int, context: int, block_size: int) -> ModelInput:
    per_seq = -(-(context + 1) // block_size)
    tables = torch.arange(1, batch * per_seq + 1).reshape(batch, per_seq)
    slots = tables[:, context // block_size] * block_size + context % block_size
    meta = AttentionMetadata(slots, batch, tables, torch.full((batch,), context + 1), [])
    return ModelInput(torch.randint(100, 1000, (batch,)), torch.full((batch,), context), meta, [], [], [])


def tokens_per_s(runner: ModelRunner, batch: int, context: int, steps: int) -> float:
    with torch.inference_mode():
        for i in range(steps + 3):
            if i == 3:
                t = time.perf_counter()
            inp = decode_input(batch, context, runner.block_size)
            runner.model.compute_logits(runner.forward(inp)).argmax(-1)
    return batch * steps / (time.perf_counter() - t)


def startup(model_dir: str, dtype: str, buckets: str) -> float:
    """Seconds to compile every bucket (this process's own, cache as the environment says)."""
    model = load_model(model_dir, getattr(torch, dtype))
    runner = ModelRunner(model, 64, 16, getattr(torch, dtype))
    t = time.perf_counter()
    runner.setup_execution("inductor", tuple(int(b) for b in buckets.split(",")))
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--startup-only", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    model_dir = str(resolve_model(args.model))
    if args.startup_only:
        print(f"{startup(model_dir, args.startup_only, args.batches):.1f}")
        return
    batches = [int(b) for b in args.batches.split(",")]
    blocks = max(batches) * (-(-(args.context + 1) // 16)) + 1
    print("| mode | " + " | ".join(f"batch {b} tok/s" for b in batches) + " | vs eager fp32 (batch 1 / last) |")
    print("|---|" + "---|" * (len(batches) + 1))
    base = None
    for name in args.modes.split(","):
        dtype, compiled, quant = MODES[name]
        model = load_model(model_dir, dtype, quant)
        runner = ModelRunner(model, blocks, 16, dtype)
        runner.setup_execution("inductor" if compiled else "none", tuple(batches))  # as the engine does
        rates = [tokens_per_s(runner, b, args.context, args.steps) for b in batches]
        base = base or rates
        print(f"| {name} | " + " | ".join(f"{r:.1f}" for r in rates)
              + f" | {rates[0] / base[0]:.2f}x / {rates[-1] / base[-1]:.2f}x |", flush=True)
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
        cmd = [sys.executable, __file__, "--model", model_dir, "--batches", args.batches, "--startup-only", "float32"]
        cold = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout.split()[-1]
        warm = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout.split()[-1]
    print(f"\ncompile start-up (buckets {args.batches}, fp32): cold cache {cold} s, warm cache {warm} s")


if __name__ == "__main__":
    main()
