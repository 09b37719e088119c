"""Scale-out on Ray Serve against one server, side by side in one run.

Workload (fresh each round): --num-prompts prompts of token ids, each one of --num-prefixes shared
prefixes of --prefix-len tokens followed by --suffix-len tokens of its own, in a shuffled order,
each generating exactly --output-len greedy tokens, --concurrency streams at a time.
Three sides, all up for the whole run and taking turns each round:
  (a) single   `llmserve serve` (one engine, torch threads: all cores)
  (b) default  Ray Serve, --replicas engine replicas x 1 thread, Ray's default router
  (c) prefix   the same, with llmserve's prefix-aware router
Prints output tok/s, TTFT p50/p99 and the prefix-cache hit rate (prompt tokens found cached / looked
up, from /stats) of each side, medians over --rounds.
Usage: python scripts/bench_ray.py [--model DIR] [--dtype bfloat16] [--rounds 2] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys

import httpx
from bench_serving import _load, _vocab_size, _wait_healthy

from llmserve.config import EngineConfig, RayConfig, ServerConfig, from_sources
from llmserve.table import format_table


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--compile", default="none", help="the engines' --compile (none: the quickest start)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--router-imbalance", type=int, default=None, help="(c)'s --router-imbalance (default: the server's)")
    p.add_argument("--num-prompts", type=int, default=96)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-prefixes", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=8400, help="(a) listens here, Ray Serve's proxy on the next port")
    p.add_argument("--json", default=None, metavar="OUT.json")
    return p.parse_args()


def workload(rng: random.Random, vocab: int, args: argparse.Namespace) -> list[list[int]]:
    def ids(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    prefixes = [ids(args.prefix_len) for _ in range(args.num_prefixes)]
    prompts = [prefixes[i % len(prefixes)] + ids(args.suffix_len) for i in range(args.num_prompts)]
    rng.shuffle(prompts)
    return prompts


class Side:
    def __init__(self, name: str, url: str):
        self.name, self.url = name, url

    def run(self, prompts: list[list[int]], args: argparse.Namespace) -> dict:
        before = self._prefix_counts()
        figures = _load(self.url, prompts, args.output_len, args.concurrency)
        queries, hits = (now - then for now, then in zip(self._prefix_counts(), before, strict=True))
        return {**figures, "prefix_hit_rate": hits / max(queries, 1)}

    def _prefix_counts(self) -> tuple[int, int]:
        engine = httpx.get(self.url + "/stats", timeout=30).json()["engine"]
        return engine["prefix_cache_queries"], engine["prefix_cache_hits"]


def start_single(args: argparse.Namespace) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "llmserve.cli", "serve", "--port", str(args.port), "--dtype", args.dtype,
           "--compile", args.compile, "--no-response-cache", "--log-level", "warning"]
    cmd += ["--model", args.model] if args.model else []
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMSERVE_")}
    return subprocess.Popen(cmd, env=env)


def start_ray(args: argparse.Namespace) -> dict[str, str]:
    """Both Ray applications on one local cluster: router name -> URL."""
    import ray
    from ray import serve

    from llmserve.ray_serve.app import build_application

    # CPUs as Ray counts them: each application's replicas reserve 1 each; only one side runs at a time
    ray.init(num_cpus=2 * args.replicas, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port + 1})
    engine = from_sources(EngineConfig, env={}, model=args.model, dtype=args.dtype, compile=args.compile, num_threads=1)
    server = from_sources(ServerConfig, env={}, response_cache=False, log_level="warning")
    urls = {}
    for router in ("default", "prefix"):
        tuning = {"router_imbalance": args.router_imbalance} if args.router_imbalance is not None else {}
        ray_config = from_sources(RayConfig, env={}, num_replicas=args.replicas, request_router=router, **tuning)
        app = build_application(engine, server, ray_config, app_name=f"bench-{router}")
        serve.run(app, name=f"bench-{router}", route_prefix=f"/{router}")
        urls[router] = f"http://127.0.0.1:{args.port + 1}/{router}"
    return urls


def main() -> int:
    args = parse_args()
    vocab = _vocab_size(args.model)
    rng = random.Random(args.seed)
    single = start_single(args)
    try:
        ray_urls = start_ray(args)
        _wait_healthy(f"http://127.0.0.1:{args.port}", single)
        sides = [Side("(a) single", f"http://127.0.0.1:{args.port}")]
        sides += [Side(f"({k}) Ray, {r} router", ray_urls[r]) for k, r in (("b", "default"), ("c", "prefix"))]
        warm = workload(rng, vocab, args)[: args.concurrency]
        for side in sides:
            _load(side.url, warm, args.output_len, args.concurrency)
        rounds: dict[str, list[dict]] = {s.name: [] for s in sides}
        for r in range(args.rounds):
            prompts = workload(rng, vocab, args)
            for side in sides if r % 2 == 0 else sides[::-1]:  # alternate who goes first
                rounds[side.name].append(side.run(prompts, args))
                print(side.name, rounds[side.name][-1], flush=True)
    finally:
        single.terminate()
        single.wait(60)
    medians = {name: _median(runs) for name, runs in rounds.items()}
    print(report(medians, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "medians": medians, "rounds": rounds}, f, indent=1)
    return 0


def _median(runs: list[dict]) -> dict:
    med = statistics.median
    return {"output_tok_s": med(r["output_tok_s"] for r in runs), "prefix_hit_rate": med(r["prefix_hit_rate"] for r in runs),
            "ttft_ms": {q: med(r["ttft_ms"][q] for r in runs) for q in ("p50", "p99")}}


def report(medians: dict[str, dict], args: argparse.Namespace) -> str:
    rows = [[name, m["output_tok_s"], m["ttft_ms"]["p50"], m["ttft_ms"]["p99"], f"{100 * m['prefix_hit_rate']:.1f}%"]
            for name, m in medians.items()]
    title = (f"{args.num_prompts} prompts, {args.concurrency} streams, {args.num_prefixes} prefixes x {args.prefix_len} "
             f"+ {args.suffix_len} tokens, {args.output_len} out, {args.dtype}; medians of {args.rounds} rounds")
    out = format_table(["", "output tok/s", "TTFT p50 ms", "TTFT p99 ms", "prefix hits"], rows, title)
    b, c = (m for name, m in medians.items() if name.startswith(("(b)", "(c)")))
    out += (f"\n(c) vs (b): prefix hits {100 * c['prefix_hit_rate']:.1f}% vs {100 * b['prefix_hit_rate']:.1f}%, "
            f"TTFT p50 {c['ttft_ms']['p50'] / b['ttft_ms']['p50']:.2f}x, output tok/s {c['output_tok_s'] / b['output_tok_s']:.2f}x")
    return out


if __name__ == "__main__":
    sys.exit(main())
