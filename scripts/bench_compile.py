"""Tokens/s per execution mode, side by side in one process, plus compiled start-up time.

Modes: eager and inductor in float32 and bfloat16, and int8 (weight-only, eager). Every mode runs
through the engine's own path (ModelRunner.setup_execution, then ModelRunner.forward: the compiled
step graph or eager) and ends with the LM head and argmax:
- decode steps at batch 1, 8 and 32, every sequence at --context tokens;
- one prefill step of 512 tokens (--prefill): one fresh prompt, or --prefill-seqs of them.
All modes are loaded first, then measured in --rounds interleaved rounds, so a noisy neighbour
slows every mode alike; a cell is the median over rounds, and `vs eager` is the median of the
per-round ratios against the eager mode of the same dtype.
Start-up: fresh processes compile the bfloat16 step graph with an empty inductor cache (cold),
then again with that cache (warm); each prints the seconds setup_execution took.
Usage: python scripts/bench_compile.py [--model DIR] [--batches 1,8,32] [--rounds 5] [--modes ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from llmserve.config import EngineConfig
from llmserve.engine.model_runner import ModelInput, ModelRunner
from llmserve.model.attention import AttentionMetadata, PrefillSeq
from llmserve.model.loader import load_model
from llmserve.model.resolve import resolve_model
from llmserve.plan import plan_for

MODES = {  # name: (dtype, compile, quantize)
    "eager fp32": (torch.float32, "none", None),
    "inductor fp32": (torch.float32, "inductor", None),
    "eager bf16": (torch.bfloat16, "none", None),
    "inductor bf16": (torch.bfloat16, "inductor", None),
    "int8": (torch.float32, "none", "int8"),
}
BLOCK = 16


def decode_input(batch: int, context: int) -> ModelInput:
    per_seq = -(-(context + 1) // BLOCK)
    tables = torch.arange(1, batch * per_seq + 1).reshape(batch, per_seq)
    slots = tables[:, context // BLOCK] * BLOCK + context % BLOCK
    meta = AttentionMetadata(slots, batch, tables, torch.full((batch,), context + 1), [])
    return ModelInput(torch.randint(100, 1000, (batch,)), torch.full((batch,), context), meta, list(range(batch)), [], [])


def prefill_input(n: int, seqs: int = 1) -> ModelInput:
    """One prefill step of n tokens: `seqs` fresh prompts of n // seqs tokens each."""
    per, blocks = n // seqs, -(-(n // seqs) // BLOCK)
    chunks, slots = [], []
    for s in range(seqs):
        table = torch.arange(1 + s * blocks, 1 + (s + 1) * blocks)
        chunks.append(PrefillSeq(s * per, per, per, table))
        slots.append(table.repeat_interleave(BLOCK)[:per] * BLOCK + torch.arange(per) % BLOCK)
    meta = AttentionMetadata(torch.cat(slots), 0, torch.zeros(0, 1, dtype=torch.long), torch.zeros(0, dtype=torch.long), chunks)
    rows = [c.query_start + per - 1 for c in chunks]
    return ModelInput(torch.randint(100, 1000, (per * seqs,)), torch.arange(per).repeat(seqs), meta, rows, [], [])


def tokens_per_s(runner: ModelRunner, make, tokens: int, steps: int) -> float:
    with torch.inference_mode():
        runner.forward(make())[1].argmax(-1)  # warm
        t = time.perf_counter()
        for _ in range(steps):
            runner.forward(make())[1].argmax(-1)
    return tokens * steps / (time.perf_counter() - t)


def startup(model_dir: str, dtype: str) -> float:
    """Seconds setup_execution("inductor") takes in this process (cache as the environment says)."""
    model = load_model(model_dir, getattr(torch, dtype))
    runner = ModelRunner(model, 64, BLOCK, getattr(torch, dtype))
    plan = plan_for(EngineConfig(dtype=dtype, kv_cache_dtype=dtype, compile="inductor"), model.config)
    t = time.perf_counter()
    runner.setup_execution(plan)
    return time.perf_counter() - t


def measure_round(runners: dict, batches: list[int], args) -> dict[tuple[str, str], float]:
    out = {}
    n = args.prefill // args.prefill_seqs * args.prefill_seqs
    for name, runner in runners.items():
        for b in batches:
            out[name, f"batch {b}"] = tokens_per_s(runner, lambda b=b: decode_input(b, args.context), b, args.steps)
        out[name, prefill_column(args)] = tokens_per_s(runner, lambda: prefill_input(n, args.prefill_seqs), n, 2)
    return out


def prefill_column(args) -> str:
    return f"prefill {args.prefill}" if args.prefill_seqs == 1 else f"prefill {args.prefill_seqs} x {args.prefill // args.prefill_seqs}"


def report(rounds: list[dict], names: list[str], columns: list[str]) -> None:
    print(f"\n{len(rounds)} rounds; tok/s, median over rounds (vs eager of the same dtype: median of per-round ratios)")
    print("| mode | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    for name in names:
        base = "eager " + name.split()[-1] if name.startswith("inductor") else None
        cells = []
        for col in columns:
            cell = f"{statistics.median(r[name, col] for r in rounds):.1f}"
            if base in names:
                cell += f" ({statistics.median(r[name, col] / r[base, col] for r in rounds):.2f}x)"
            cells.append(cell)
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prefill-seqs", type=int, default=1, help="split the prefill step into this many prompts")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--no-startup", action="store_true")
    ap.add_argument("--startup-only", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    model_dir = str(resolve_model(args.model))
    batches = [int(b) for b in args.batches.split(",")]
    if args.startup_only:
        print(f"{startup(model_dir, args.startup_only):.1f}")
        return
    prefill_blocks = args.prefill_seqs * -(-(args.prefill // args.prefill_seqs) // BLOCK)
    blocks = max(max(batches) * -(-(args.context + 1) // BLOCK), prefill_blocks) + 1
    runners = {}
    for name in args.modes.split(","):
        dtype, compile, quant = MODES[name]
        model = load_model(model_dir, dtype, quant)
        name_of = str(dtype).removeprefix("torch.")
        plan = plan_for(EngineConfig(dtype=name_of, kv_cache_dtype=name_of, compile=compile, quantize=quant), model.config)
        runners[name] = ModelRunner(model, blocks, BLOCK, dtype)
        runners[name].setup_execution(plan)  # as the engine does
    rounds = []
    for i in range(args.rounds):
        rounds.append(measure_round(runners, batches, args))
        print(f"round {i + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    report(rounds, list(runners), [f"batch {b}" for b in batches] + [prefill_column(args)])
    if args.no_startup:
        return
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
        cmd = [sys.executable, __file__, "--model", model_dir, "--batches", args.batches, "--startup-only", "bfloat16"]
        cold, warm = (subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout.split()[-1]
                      for _ in range(2))
    print(f"\ncompile start-up (bfloat16 step graph): cold cache {cold} s, warm cache {warm} s")


if __name__ == "__main__":
    main()
