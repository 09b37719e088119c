"""Multi-LoRA serving speed, in process, side by side in one run: --num-prompts streams of
--input-len random tokens and exactly --output-len greedy tokens (EOS ignored), all at once, on
SmolLM2-135M (or --model) in the machine's fast dtype (`auto`), compiled as `auto` picks.

Two engines stay up for the whole run: the base model alone (LoRA off), and the same model with
--enable-lora and --num-adapters random rank---rank adapters on all 7 projections (PEFT's format,
written to a temporary folder). Workloads, --rounds times in turn, on fresh prompts each round:
  base       the engine without LoRA
  lora-none  the LoRA engine, no adapter requested        (target >= 0.97x base)
  lora-one   the LoRA engine, one adapter on every request (target >= 0.85x base)
  lora-many  the LoRA engine, the adapters spread evenly   (target >= 0.80x base)
Each figure is the median over the rounds; the LoRA engine's step time per stage is printed too.
Usage: python scripts/bench_lora.py [--model DIR] [--rounds 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from llmserve.bench.args import add_workload_arguments
from llmserve.config import EngineConfig, from_sources
from llmserve.engine.llm_engine import LLMEngine
from llmserve.lora.adapter import PROJECTIONS
from llmserve.lora.manager import base_shapes
from llmserve.lora.request import LoRARequest
from llmserve.profile_cmd import run_workload, warmup
from llmserve.sampling import SamplingParams
from llmserve.table import format_table

WORKLOADS = ("base", "lora-none", "lora-one", "lora-many")
TARGETS = {"lora-none": 0.97, "lora-one": 0.85, "lora-many": 0.80}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(p)
    p.add_argument("--num-adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="OUT.json")
    return p.parse_args()


def write_adapter(folder: Path, engine: LLMEngine, rank: int, seed: int) -> None:
    """A random PEFT adapter on every projection of every layer (small weights: any output will do)."""
    shapes = base_shapes(engine.model_config)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(shapes.num_layers):
        for proj in PROJECTIONS:
            d_in, d_out = shapes.shapes[proj]
            part = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, d_in, generator=gen) * 0.01
            tensors[f"{key}.lora_B.weight"] = torch.randn(d_out, rank, generator=gen) * 0.01
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(PROJECTIONS), "bias": "none"}
    (folder / "adapter_config.json").write_text(json.dumps(config))


def figures(requests: list, elapsed: float) -> dict:
    return {"output_tok_s": sum(len(r.output_token_ids) for r in requests) / elapsed}


def main() -> int:
    args = parse_args()
    common = dict(model=args.model, dtype=args.dtype, num_threads=args.num_threads)
    base = LLMEngine(from_sources(EngineConfig, env={}, **common))
    lora = LLMEngine(from_sources(EngineConfig, env={}, **common, enable_lora=True, max_loras=args.num_adapters,
                                  max_lora_rank=args.rank))
    tmp = Path(tempfile.mkdtemp(prefix="llmserve-bench-lora-"))
    adapters = []
    for i in range(args.num_adapters):
        write_adapter(tmp / f"adapter-{i}", lora, args.rank, args.seed + i)
        adapters.append(LoRARequest(f"adapter-{i}", i + 1, str(tmp / f"adapter-{i}")))
    rng = random.Random(args.seed)
    vocab = base.model_config.vocab_size

    def prompts() -> list[list[int]]:
        return [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(args.num_prompts)]

    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    warm = prompts()[:4]
    warmup(base, warm, params)
    for a in adapters:  # read every adapter, and place each once
        run_workload(lora, warm[:1], params, lora_requests=[a])
    loras_of = {"base": None, "lora-none": [None] * args.num_prompts, "lora-one": [adapters[0]] * args.num_prompts,
                "lora-many": [adapters[i % len(adapters)] for i in range(args.num_prompts)]}
    runs: dict[str, list[dict]] = {w: [] for w in WORKLOADS}
    for r in range(args.rounds):
        batch = prompts()
        for w in WORKLOADS[r % 4:] + WORKLOADS[: r % 4]:
            engine = base if w == "base" else lora
            engine.step_records.clear()
            runs[w].append(figures(*run_workload(engine, batch, params, lora_requests=loras_of[w])))
            decodes = [s.duration_s for s in engine.step_records if s.num_decode_seqs and not s.num_prefill_tokens]
            runs[w][-1]["step_ms"] = 1000 * statistics.median(decodes)
    med = {w: {k: statistics.median(x[k] for x in runs[w]) for k in runs[w][0]} for w in WORKLOADS}
    rows = [[w, m["output_tok_s"], m["output_tok_s"] / med["base"]["output_tok_s"], m["step_ms"], TARGETS.get(w, "")]
            for w, m in med.items()]
    print(format_table(["workload", "output tok/s", "vs base", "decode step p50 ms", "target"], rows,
                       f"{args.num_prompts} x {args.input_len}/{args.output_len}, {args.num_adapters} adapters of rank {args.rank} "
                       f"(medians over {args.rounds} rounds)"))
    print(f"execution plan: dtype {lora.plan.dtype.value}, compile {lora.plan.compile.value}")
    if args.json:
        Path(args.json).write_text(json.dumps({"config": vars(args), "medians": med, "rounds": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
