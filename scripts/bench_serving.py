"""HTTP serving against the engine in process, side by side in one run.

The same workload on both sides: --num-prompts prompts of --input-len random token ids, each
generating exactly --output-len greedy tokens (EOS ignored), all sent at once; then concurrency 1:
--c1-prompts such prompts, one at a time.
- In process: LLMEngine stepped directly (the loop of `llmserve profile`).
- Over HTTP: `llmserve serve --no-response-cache` (the engine core in its own process), driven by
  the project's load tester (streaming /v1/completions with token-id prompts).
Both stay up for the whole run and take turns, --rounds times, on fresh prompts each round (the
machine is shared and noisy: alternating spreads its moods over both sides); each figure is the
median over the rounds.
Prints output tok/s, TTFT and ITL for both, and the ratios the serving targets are stated in.
Usage: python scripts/bench_serving.py [--model DIR] [--dtype bfloat16] [--num-threads N] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time

import httpx

from llmserve.bench.args import add_bench_arguments, add_workload_arguments
from llmserve.bench.datasets import SampleRequest
from llmserve.bench.report import summarize
from llmserve.bench.serve import run_load
from llmserve.config import EngineConfig, from_sources
from llmserve.profile_cmd import run_workload, warmup
from llmserve.profiling import LatencyStats, timings_of
from llmserve.sampling import SamplingParams
from llmserve.table import format_table


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(p)
    p.add_argument("--c1-prompts", type=int, default=8, help="prompts of the concurrency-1 run (0: skip it)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=3, help="turns each side takes at each workload")
    p.add_argument("--serve-args", default="", help="extra `llmserve serve` flags, e.g. '--compile inductor'")
    p.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE",
                   help="set in the server's environment only (repeatable), e.g. PYTHONPATH=../other-checkout")
    p.add_argument("--only", choices=("engine", "http"), default=None, help="run one side only (no ratios)")
    p.add_argument("--json", default=None, metavar="OUT.json")
    return p.parse_args()


class InProcess:
    """LLMEngine stepped directly in this process."""

    def __init__(self, args: argparse.Namespace, warm: list[int]):
        from llmserve.engine.llm_engine import LLMEngine

        self.engine = LLMEngine(from_sources(EngineConfig, env={}, model=args.model, dtype=args.dtype, num_threads=args.num_threads))
        self.params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
        warmup(self.engine, [warm], self.params)

    def run(self, prompts: list[list[int]], concurrency: int | None) -> dict:
        if concurrency is None:
            return _engine_figures(*run_workload(self.engine, prompts, self.params))
        assert concurrency == 1
        done, total = [], 0.0
        for ids in prompts:
            reqs, dt = run_workload(self.engine, [ids], self.params)
            done += reqs
            total += dt
        return _engine_figures(done, total)


def _engine_figures(requests: list, elapsed: float) -> dict:
    t = [timings_of(r.timeline) for r in requests]
    n_out = sum(len(r.output_token_ids) for r in requests)
    return {"output_tok_s": n_out / elapsed, "ttft_ms": _ms([x.ttft_s for x in t if x.ttft_s is not None]),
            "itl_ms": _ms([g for x in t for g in x.itl_s])}


def _ms(values: list[float]) -> dict:
    s = LatencyStats.of(values).scaled(1000)
    return {"p50": s.p50, "p99": s.p99}


class OverHTTP:
    """`llmserve serve` in a subprocess, driven by the load tester."""

    def __init__(self, args: argparse.Namespace, warm: list[int]):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url, self.output_len = f"http://127.0.0.1:{port}", args.output_len
        cmd = [sys.executable, "-m", "llmserve.cli", "serve", "--port", str(port), "--dtype", args.dtype,
               "--no-response-cache", "--log-level", "warning", *args.serve_args.split()]
        cmd += ["--model", args.model] if args.model else []
        cmd += ["--num-threads", str(args.num_threads)] if args.num_threads else []
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLMSERVE_")}
        env.update(item.split("=", 1) for item in args.server_env)
        self.server = subprocess.Popen(cmd, env=env)
        try:
            _wait_healthy(self.url, self.server)
            _load(self.url, [warm], self.output_len, 1)
        except BaseException:
            self.close()
            raise

    def run(self, prompts: list[list[int]], concurrency: int | None) -> dict:
        return _load(self.url, prompts, self.output_len, concurrency)

    def close(self) -> None:
        self.server.terminate()
        self.server.wait(60)


def _wait_healthy(url: str, server: subprocess.Popen, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited with {server.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit("the server did not come up")


def _load(url: str, prompts: list[list[int]] | list[str], output_len: int, concurrency: int | None, endpoint: str = "/v1/completions") -> dict:
    """One run of the load tester: every prompt streamed at once (or `concurrency` at a time),
    each exactly output_len tokens; its throughput, TTFT and ITL."""
    p = argparse.ArgumentParser()
    add_bench_arguments(p)
    argv = ["--base-url", url, "--endpoint", endpoint, "--ignore-eos", "--disable-tqdm", "--timeout", "600", "--max-duration", "1800"]
    load_args = p.parse_args(argv + (["--max-concurrency", str(concurrency)] if concurrency else []))
    samples = [SampleRequest(ids, output_len) for ids in prompts]
    records, duration, _ = asyncio.run(run_load(load_args, samples, []))
    s = summarize(records, duration, {})
    if s["failures"]:
        raise SystemExit(f"{s['failures']} request(s) failed: {s['errors']}")
    if s["total_output_tokens"] != len(prompts) * output_len:
        raise SystemExit(f"expected {len(prompts) * output_len} output tokens, got {s['total_output_tokens']}")
    return {"output_tok_s": s["output_throughput"], "ttft_ms": {k: s["ttft_ms"][k] for k in ("p50", "p99")},
            "itl_ms": {k: s["itl_ms"][k] for k in ("p50", "p99")}}


def report(engine: dict, http: dict) -> str:
    rows = []
    for run in ("c32", "c1"):
        for name, side in (("in process", engine), ("HTTP", http)):
            if run not in side:
                continue
            fig = side[run]
            rows.append([f"{run} {name}", fig["output_tok_s"], fig["ttft_ms"]["p50"], fig["ttft_ms"]["p99"],
                         fig["itl_ms"]["p50"], fig["itl_ms"]["p99"]])
    out = format_table(["", "output tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99"], rows, "serving vs in process (ms)")
    if not (engine and http):
        return out
    if "c32" in engine:
        out += f"\nc32: HTTP / in process = {http['c32']['output_tok_s'] / engine['c32']['output_tok_s']:.3f} (target >= 0.92)"
    if "c1" in engine:
        ratio = http["c1"]["output_tok_s"] / engine["c1"]["output_tok_s"]
        itl = engine["c1"]["itl_ms"]["p50"] / http["c1"]["itl_ms"]["p50"]
        gap = http["c1"]["ttft_ms"]["p50"] - engine["c1"]["ttft_ms"]["p50"]
        out += (f"\nc1:  HTTP / in process = {ratio:.3f} (target >= 0.9); ITL p50 in process / HTTP = {itl:.3f}; "
                f"TTFT p50 HTTP - in process = {gap:+.1f} ms (target <= 20)")
    return out


def main() -> int:
    args = parse_args()
    vocab = _vocab_size(args.model)
    rng = random.Random(args.seed)

    def prompt() -> list[int]:
        return [rng.randrange(vocab) for _ in range(args.input_len)]

    workloads = {}  # name: (prompts, concurrency)
    if args.num_prompts:
        workloads["c32"] = (args.num_prompts, None)
    if args.c1_prompts:
        workloads["c1"] = (args.c1_prompts, 1)
    warm = prompt()
    sides = {}
    if args.only != "http":
        sides["engine"] = InProcess(args, warm)
    if args.only != "engine":
        sides["http"] = OverHTTP(args, warm)
    try:
        rounds: dict[str, dict[str, list[dict]]] = {name: {w: [] for w in workloads} for name in sides}
        for w, (n, concurrency) in workloads.items():
            for _ in range(args.rounds):
                prompts = [prompt() for _ in range(n)]  # fresh each round: no prefix-cache hits
                for name, side in sides.items():
                    rounds[name][w].append(side.run(prompts, concurrency))
    finally:
        if "http" in sides:
            sides["http"].close()
    medians = {name: {w: _median(runs) for w, runs in by_w.items()} for name, by_w in rounds.items()}
    print(report(medians.get("engine", {}), medians.get("http", {})))
    if "engine" in rounds and "http" in rounds and "c32" in workloads:
        per_round = [h["output_tok_s"] / e["output_tok_s"] for e, h in zip(rounds["engine"]["c32"], rounds["http"]["c32"], strict=True)]
        print("c32 HTTP / in process, round by round: " + ", ".join(f"{r:.3f}" for r in per_round))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "medians": medians, "rounds": rounds}, f, indent=1)
    return 0


def _median(runs: list[dict]) -> dict:
    """Each figure's median over the rounds."""
    def med(xs: list[float]) -> float:
        return statistics.median(xs)

    return {"output_tok_s": med([r["output_tok_s"] for r in runs]),
            **{k: {q: med([r[k][q] for r in runs]) for q in ("p50", "p99")} for k in ("ttft_ms", "itl_ms")}}


def _vocab_size(model: str | None) -> int:
    from llmserve.model.resolve import resolve_model

    config = json.loads((resolve_model(model) / "config.json").read_text())
    return int(config["vocab_size"])


if __name__ == "__main__":
    sys.exit(main())
