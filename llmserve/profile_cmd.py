"""`llmserve profile`: a synthetic workload run in process against LLMEngine, reported as
per-stage step latency and per-request latency tables, optionally as a Chrome trace (--trace).

Workload: --num-prompts prompts of --input-len random token ids, each generating exactly
--output-len tokens (EOS ignored), arriving all at once or at --request-rate (Poisson).
"""

from __future__ import annotations

import argparse
import random
import time

from llmserve.config import EngineConfig, add_arguments, from_sources
from llmserve.profiling import STAGES, LatencyStats, StepRecord, timings_of
from llmserve.table import format_table

STAT_HEADERS = ["", "count", "mean", "p50", "p95", "p99", "max"]


def add_profile_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=128, help="generated tokens per request (EOS ignored)")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s, Poisson arrivals (inf: all at once)")
    p.add_argument("--num-warmups", type=int, default=1, help="requests run (and not reported) before the workload")
    p.add_argument("--trace", metavar="OUT.json", default=None, help="write a Chrome trace-event file (open in Perfetto)")
    add_arguments(p, EngineConfig)


def run_profile(args: argparse.Namespace) -> int:
    from llmserve.engine.llm_engine import LLMEngine
    from llmserve.sampling import SamplingParams
    from llmserve.tracing import write_trace

    engine = LLMEngine(from_sources(EngineConfig, args))
    rng = random.Random(engine.config.seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)

    def prompt() -> list[int]:
        return [rng.randrange(vocab) for _ in range(args.input_len)]

    warmup(engine, [prompt() for _ in range(args.num_warmups)], params)
    gaps = [0.0 if args.request_rate == float("inf") else rng.expovariate(args.request_rate) for _ in range(args.num_prompts)]
    requests, elapsed = run_workload(engine, [prompt() for _ in range(args.num_prompts)], params, gaps)

    steps = list(engine.step_records)
    print(engine.plan.describe(), end="\n\n")
    print(_report(steps, requests, elapsed))
    if args.trace:
        write_trace(args.trace, steps, requests)
        print(f"trace: {args.trace} ({len(steps)} steps, {len(requests)} requests); open it in https://ui.perfetto.dev")
    return 0


def warmup(engine, prompts: list[list[int]], params) -> None:
    """Run `prompts` to the end, then forget their step records."""
    for i, ids in enumerate(prompts):
        engine.add_request(f"warmup-{i}", ids, params)
    while engine.has_unfinished_requests():
        engine.step()
    engine.step_records.clear()


def run_workload(engine, prompts: list[list[int]], params, gaps: list[float] | None = None,
                 lora_requests: list | None = None) -> tuple[list, float]:
    """Add prompts `gaps` seconds apart (default: all at once), interleaved with engine steps,
    and step until all finish: (the engine's Requests, seconds from the first add to the end).
    lora_requests: one LoRARequest (or None) per prompt."""
    requests = []
    t_start = time.time()
    due = t_start
    for i, (gap, ids) in enumerate(zip(gaps or [0.0] * len(prompts), prompts, strict=True)):
        due += gap
        while time.time() < due:
            if engine.has_unfinished_requests():
                engine.step()
            else:
                time.sleep(min(due - time.time(), 0.05))
        lora = lora_requests[i] if lora_requests else None
        requests.append(engine.add_request(f"req-{engine.num_steps}-{i}", ids, params, lora_request=lora))
    while engine.has_unfinished_requests():
        engine.step()
    return requests, time.time() - t_start


def _row(name: str, seconds: list[float]) -> list[object]:
    s = LatencyStats.of(seconds).scaled(1000)
    return [name, s.count, s.mean, s.p50, s.p95, s.p99, s.max]


def _report(steps: list[StepRecord], requests: list, elapsed: float) -> str:
    prefill_steps = [s for s in steps if s.num_prefill_tokens]
    decode_steps = [s for s in steps if not s.num_prefill_tokens]
    stage_rows = [_row(st, [r.stage_durations()[st] for r in steps]) for st in STAGES]
    stage_rows += [
        _row("step (all)", [s.duration_s for s in steps]),
        _row("step (with prefill)", [s.duration_s for s in prefill_steps]),
        _row("step (decode only)", [s.duration_s for s in decode_steps]),
    ]
    t = [timings_of(r.timeline) for r in requests]
    req_rows = [
        _row("queue", [x.queue_s for x in t if x.queue_s is not None]),
        _row("TTFT", [x.ttft_s for x in t if x.ttft_s is not None]),
        _row("ITL", [g for x in t for g in x.itl_s]),
        _row("TPOT", [x.tpot_s for x in t if x.tpot_s is not None]),
        _row("e2e", [x.e2e_s for x in t if x.e2e_s is not None]),
    ]
    n_in = sum(r.num_prompt_tokens for r in requests)
    n_out = sum(len(r.output_token_ids) for r in requests)
    batch = sum(s.num_decode_seqs for s in decode_steps) / max(len(decode_steps), 1)
    return "\n\n".join([
        format_table(STAT_HEADERS, stage_rows, "engine step stages (ms)"),
        format_table(STAT_HEADERS, req_rows, "requests (ms)"),
        f"{len(requests)} requests, {n_in} prompt + {n_out} output tokens in {elapsed:.3f} s: "
        f"{len(requests) / elapsed:.2f} req/s, {n_out / elapsed:.1f} output tok/s, {(n_in + n_out) / elapsed:.1f} total tok/s; "
        f"{len(steps)} steps ({len(prefill_steps)} with prefill), mean decode batch {batch:.1f}",
    ])
