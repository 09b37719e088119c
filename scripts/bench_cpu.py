"""This machine's roofline, and the engine's workload against it, in one run.

1. The machine: matmul rate per dtype (a 2048-cube matmul, 256 for emulated bf16, and a packed linear of the model's
   widest shape at M = 1 and M = 32 rows against a plain matmul of that shape), and the streaming
   read bandwidth (a sum over 512 MB, best of several).
2. The workload of `llmserve profile` (--num-prompts x --input-len in / --output-len out, greedy,
   all at once) run in process under the execution plan the engine options give: output tok/s,
   its GEMM FLOPs (2 x weights x tokens, the LM head for generated tokens only) over the best
   matmul rate found = the compute bound, and the achieved fraction of it.
3. One stream: the mean decode-only step at batch 1 against the bytes of the weights it reads
   (every linear weight once) over the streaming read bandwidth, measured again just before each
   of --b1-rounds streams (a shared machine's bandwidth drifts within a minute); the median
   round's ratio is the figure.

4. --weights none,int8,int4,stored: the same model under each weights format (--quantize; stored:
   as the checkpoint holds them, e.g. the default model's Q4_1 blocks; a `:unfused` suffix, e.g.
   int8:unfused, runs that format with --fused-layers off, its decoder layers as their modules' ops), one engine
   each, measured round by round in turn (--rounds): the batch-1 decode step against its own
   weight bytes over the read bandwidth measured just before, one stream's output tok/s
   (--input-len in / --output-len out), --num-prompts streams at once, and the prefill of one
   --prefill-len prompt; the medians, and each format's ratio to the first (the float plan).

Emulating an AVX2-only CPU on an AVX-512 one: ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2
LLMSERVE_CPU_ISA=avx2 (the plan then sees no native bf16 and picks float32).
Usage: python scripts/bench_cpu.py [--model DIR] [engine options, e.g. --dtype float32 --compile none]
       python scripts/bench_cpu.py --weights none,int8,int4 [--rounds 3] [engine options]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from llmserve.config import EngineConfig, add_arguments, from_sources
from llmserve.plan import CpuInfo, approx_params
from llmserve.profile_cmd import run_workload, warmup
from llmserve.sampling import SamplingParams

DTYPES = (torch.float32, torch.bfloat16)


def best_seconds(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def matmul_gflops(m: int, k: int, n: int, dtype: torch.dtype, reps: int = 5) -> float:
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    return 2 * m * k * n / best_seconds(lambda: torch.mm(a, b), reps) / 1e9


def packed_gflops(m: int, k: int, n: int, dtype: torch.dtype, reps: int = 20) -> float | None:
    from llmserve.model.packed import PackedLinear, packs_correctly

    if not packs_correctly(dtype):
        return None
    layer = PackedLinear(torch.nn.Linear(k, n, bias=False).to(dtype))
    x = torch.randn(m, k).to(dtype)
    with torch.inference_mode():
        return 2 * m * k * n / best_seconds(lambda: layer(x), reps) / 1e9


def read_gbps(mbytes: int = 512, reps: int = 7) -> float:
    x = torch.ones(mbytes * 2**20 // 4)
    return x.numel() * 4 / best_seconds(lambda: x.sum(), reps) / 1e9


def machine(shape: tuple[int, int], native_bf16: bool) -> dict:
    k, n = shape
    out: dict = {"read_gbps": read_gbps()}
    for dt in DTYPES:
        name = str(dt).removeprefix("torch.")
        cube = 2048 if dt == torch.float32 or native_bf16 else 256  # emulated bf16: minutes at 2048
        out[f"mm2048 {name}"] = matmul_gflops(cube, cube, cube, dt, reps=3)
        for m in (1, 32):
            out[f"mm{m} {name}"] = matmul_gflops(m, k, n, dt, reps=20)
            out[f"packed{m} {name}"] = packed_gflops(m, k, n, dt)
    return out


def workload(config: EngineConfig, num_prompts: int, input_len: int, output_len: int, b1_rounds: int) -> dict:
    from llmserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(config)
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)

    def prompts(n: int) -> list[list[int]]:
        return [[rng.randrange(vocab) for _ in range(input_len)] for _ in range(n)]

    warmup(engine, prompts(2), params)
    _, elapsed = run_workload(engine, prompts(num_prompts), params)
    rounds = []  # (read GB/s just before, mean batch-1 decode step in s)
    for _ in range(b1_rounds):
        warmup(engine, prompts(1), params)  # forgets the step records
        gbps = read_gbps(reps=3)
        run_workload(engine, prompts(1), params)
        b1 = [s.duration_s for s in engine.step_records if not s.num_prefill_tokens and s.num_decode_seqs == 1]
        rounds.append((gbps, statistics.mean(b1)))
    c = engine.model_config
    head = c.vocab_size * c.hidden_size
    body = approx_params(c) - head * (1 if c.tie_word_embeddings else 2)
    flops = 2 * body * num_prompts * input_len + 2 * (body + head) * num_prompts * output_len
    return {"plan": engine.plan, "tok_s": num_prompts * output_len / elapsed, "elapsed": elapsed, "flops": flops,
            "b1_rounds": rounds, "weight_bytes": linear_bytes(engine)}


def linear_bytes(engine) -> int:
    """Bytes every decode step reads from the linear layers' weights (the LM head included):
    block-quantized layers as stored, float ones (maybe packed for oneDNN) at the plan's dtype."""
    from llmserve.model.quantize import QuantLinear

    quantized = [m for m in engine.model.modules() if isinstance(m, QuantLinear)]
    float_weights = sum(m.in_features * m.out_features for m in engine.model.modules()
                        if hasattr(m, "out_features") and not isinstance(m, QuantLinear))
    return sum(m.quantized.nbytes() for m in quantized) + float_weights * engine.dtype.itemsize


class WeightsRun:
    """One engine under one --quantize value, and its figures per round."""

    def __init__(self, config: EngineConfig, weights: str, args):
        from dataclasses import replace

        from llmserve.engine.llm_engine import LLMEngine

        self.weights, self.args = weights, args
        fmt, _, variant = weights.partition(":")
        if variant not in ("", "unfused"):
            raise SystemExit(f"--weights {weights}: the only suffix is :unfused")
        quantize = None if fmt == "stored" else fmt
        fused = "off" if variant else config.fused_layers
        self.engine = LLMEngine(replace(config, quantize=quantize, fused_layers=fused,
                                        kv_cache_memory=config.kv_cache_memory or 1 << 29))
        self.rng = random.Random(0)
        self.figures: dict[str, list[float]] = {}
        self.bytes = linear_bytes(self.engine)
        warmup(self.engine, self.prompts(2, args.input_len), self.params(8))

    def prompts(self, n: int, length: int) -> list[list[int]]:
        vocab = self.engine.model_config.vocab_size
        return [[self.rng.randrange(vocab) for _ in range(length)] for _ in range(n)]

    def params(self, n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)

    def add(self, name: str, value: float) -> None:
        self.figures.setdefault(name, []).append(value)

    def round(self) -> None:
        a, e = self.args, self.engine
        gbps = read_gbps(reps=3)
        warmup(e, [], self.params(1))
        _, elapsed = run_workload(e, self.prompts(1, a.input_len), self.params(a.output_len))
        b1 = [s.duration_s for s in e.step_records if not s.num_prefill_tokens and s.num_decode_seqs == 1]
        self.add("b1 step ms", statistics.mean(b1) * 1000)
        self.add("b1 / bound", statistics.mean(b1) / (self.bytes / (gbps * 1e9)))
        self.add("1 stream tok/s", a.output_len / elapsed)
        _, elapsed = run_workload(e, self.prompts(a.num_prompts, a.input_len), self.params(a.output_len))
        self.add(f"{a.num_prompts} streams tok/s", a.num_prompts * a.output_len / elapsed)
        _, elapsed = run_workload(e, self.prompts(1, a.prefill_len), self.params(1))
        self.add(f"prefill {a.prefill_len} ms", elapsed * 1000)


def compare_weights(config: EngineConfig, args) -> None:
    runs = [WeightsRun(config, w, args) for w in args.weights.split(",")]
    for r in runs:
        print(f"--quantize {r.weights}: linear weights {r.bytes / 1e6:.1f} MB\n{r.engine.plan.describe()}\n")
    for i in range(args.rounds):
        for r in runs:
            r.round()
        print(f"round {i + 1}: " + "; ".join(f"{r.weights} b1 {r.figures['b1 step ms'][-1]:.2f} ms" for r in runs))
    base = runs[0]
    print(f"\nmedians of {args.rounds} rounds (ratio: to --quantize {base.weights}; for times, theirs / its)")
    for name in base.figures:
        cells = []
        for r in runs:
            v, b = statistics.median(r.figures[name]), statistics.median(base.figures[name])
            ratio = v / b if "tok/s" in name else b / v if "ms" in name else None
            cells.append(f"{r.weights} {v:.2f}" + (f" ({ratio:.2f}x)" if ratio and r is not base else ""))
        print(f"{name:>20}: " + ", ".join(cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--b1-rounds", type=int, default=3, help="batch-1 streams, each after its own bandwidth probe")
    ap.add_argument("--no-workload", action="store_true", help="only the machine's figures")
    ap.add_argument("--weights", default=None, help="compare --quantize values side by side, e.g. none,int8,int4")
    ap.add_argument("--rounds", type=int, default=3, help="--weights: rounds, each format in turn")
    ap.add_argument("--prefill-len", type=int, default=512, help="--weights: the prefill measured")
    add_arguments(ap, EngineConfig)
    args = ap.parse_args()
    config = from_sources(EngineConfig, args)
    cpu = CpuInfo.detect()
    print(f"CPU: {cpu.describe()}; torch threads {torch.get_num_threads()}, ATen {torch.backends.cpu.get_cpu_capability()}")

    from llmserve.model.config import ModelConfig
    from llmserve.model.resolve import resolve_model

    if args.weights:
        return compare_weights(config, args)
    c = ModelConfig.from_file(resolve_model(config.model) / "config.json")
    m = machine((c.hidden_size, 2 * c.intermediate_size), cpu.native_bf16)  # the gate_up projection
    print(f"streaming read: {m['read_gbps']:.1f} GB/s")
    for dt in DTYPES:
        name = str(dt).removeprefix("torch.")
        packed = {r: m[f"packed{r} {name}"] for r in (1, 32)}
        line = f"{name:>8}: 2048^3 matmul {m[f'mm2048 {name}']:.1f} GFLOP/s; [{c.hidden_size} x {2 * c.intermediate_size}] "
        line += ", ".join(f"M={r} matmul {m[f'mm{r} {name}']:.1f}" + (f" packed {packed[r]:.1f}" if packed[r] else "")
                          for r in (1, 32))
        print(line)
    if args.no_workload:
        return
    w = workload(config, args.num_prompts, args.input_len, args.output_len, args.b1_rounds)
    dtype = w["plan"].dtype.value
    peak = max(m[f"mm2048 {dtype}"], m[f"packed32 {dtype}"] or 0.0)
    bound_s = w["flops"] / (peak * 1e9)
    print(f"\n{w['plan'].describe()}\n")
    print(f"workload {args.num_prompts} x {args.input_len} in / {args.output_len} out: {w['tok_s']:.1f} output tok/s "
          f"({w['elapsed']:.2f} s); GEMM work {w['flops'] / 1e12:.2f} TFLOP, at the best {dtype} matmul rate "
          f"({peak:.0f} GFLOP/s) {bound_s:.2f} s = {args.num_prompts * args.output_len / bound_s:.0f} tok/s: "
          f"{bound_s / w['elapsed'] * 100:.0f}% of the compute bound")
    ratios = []
    for gbps, step_s in w["b1_rounds"]:
        floor_s = w["weight_bytes"] / (gbps * 1e9)
        ratios.append(step_s / floor_s)
        print(f"batch-1 decode step: {step_s * 1000:.1f} ms; weights {w['weight_bytes'] / 1e6:.0f} MB at "
              f"{gbps:.1f} GB/s (read just before) = {floor_s * 1000:.1f} ms: {ratios[-1]:.2f}x the bandwidth bound")
    print(f"batch-1 median: {statistics.median(ratios):.2f}x the bandwidth bound")

if __name__ == "__main__":
    main()
