"""Cache benchmark: prefix reuse (TTFT) and response-cache hit latency; prints markdown tables.

1. Prefix reuse, in process: TTFT (add_request -> the step that returns the first output token,
   measured around LLMEngine.step()) of a prompt = a 1024-token shared prefix + a short tail:
   cold (engine A has never seen the prefix); local prefix hit (A again, another tail); Redis-tier
   hit (engine B, a second replica on the same Redis, started here on a free port, loads the
   prefix blocks A wrote behind, off its step loop; one B per --redis-timeouts value, though a KV
   fetch gets at least 0.5 s plus its bytes at 100 MB/s whatever the value). Median of --reps fresh prefixes. Targets: local <= 1/5 of cold, Redis tier
   <= 1/3 of cold.
2. Response cache over HTTP: `llmserve serve` subprocesses (in-process cache; and Redis-backed
   when redis-server exists). Latency of a deterministic request answered from the cache (a
   kept-alive httpx client, non-streaming, p50 / p99) against the same request generated
   ("cache": false). Target: hit p50 <= 5 ms.
Usage: python scripts/bench_cache.py [--model DIR] [--reps 3] [--redis-timeouts 0.05] [--hits 200] [--skip-http]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def redis_server() -> Iterator[str | None]:
    """A throwaway redis-server on a free loopback port; None when the binary is missing."""
    binary = shutil.which("redis-server")
    if binary is None:
        yield None
        return
    import redis

    port = free_port()
    with tempfile.TemporaryDirectory() as d:
        proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                                 "--dir", d], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 10
            while True:
                try:
                    redis.Redis(port=port, socket_timeout=1).ping()
                    break
                except redis.RedisError:
                    if time.monotonic() > deadline:
                        raise RuntimeError("redis-server did not start") from None
                    time.sleep(0.05)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.terminate()
            proc.wait(10)


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


# ---- 1. prefix reuse --------------------------------------------------------------------------


def ttft(engine, rid: str, ids: list[int]) -> float:
    """Seconds from add_request to the step that returns its first token (max_tokens 1)."""
    from llmserve.sampling import SamplingParams

    t = time.perf_counter()
    engine.add_request(rid, ids, SamplingParams(max_tokens=1, temperature=0))
    while True:
        for out in engine.step():
            if out.request_id == rid and out.new_token_ids:
                elapsed = time.perf_counter() - t
                while engine.has_unfinished_requests():
                    engine.step()
                return elapsed


def bench_prefix(args: argparse.Namespace, redis_url: str | None) -> list[tuple[str, float, float | None, str]]:
    """Rows (case, median TTFT ms, ratio to cold, blocks read from Redis per rep)."""
    from llmserve.config import EngineConfig, from_sources
    from llmserve.engine.llm_engine import LLMEngine

    def engine(timeout: float = 0.05) -> LLMEngine:
        return LLMEngine(from_sources(EngineConfig, env={}, model=args.model, dtype=args.dtype, num_blocks=args.num_blocks,
                                      num_threads=args.num_threads, redis_url=redis_url, redis_timeout=timeout))

    a = engine()
    # one replica B per Redis timeout: each loads A's prefix blocks from Redis
    replicas = {f"Redis-tier hit (replica B, --redis-timeout {t * 1000:.0f} ms)": engine(t) for t in args.redis_timeouts} if redis_url else {}
    vocab, bs = a.model_config.vocab_size, a.config.block_size
    rng = random.Random(0)
    rows: dict[str, list[float]] = {"cold": [], "local prefix hit": []} | {name: [] for name in replicas}
    reads: dict[str, list[int]] = {name: [] for name in rows}
    for e in (a, *replicas.values()):  # warm-up: kernels, allocator
        ttft(e, "warm", [rng.randrange(100, vocab) for _ in range(64)])
    for r in range(args.reps):
        prefix = [rng.randrange(100, vocab) for _ in range(args.prefix)]
        tails = [[rng.randrange(100, vocab) for _ in range(16)] for _ in range(2 + len(replicas))]
        written = a.kv_store.stats.blocks_written if a.kv_store else 0
        rows["cold"].append(ttft(a, f"cold-{r}", prefix + tails[0]))
        rows["local prefix hit"].append(ttft(a, f"local-{r}", prefix + tails[1]))
        if a.kv_store is not None:
            deadline = time.monotonic() + 30  # A's blocks are written behind
            while a.kv_store.stats.blocks_written < written + args.prefix // bs and time.monotonic() < deadline:
                time.sleep(0.01)
        for i, (name, b) in enumerate(replicas.items()):
            read = b.kv_store.stats.blocks_read
            rows[name].append(ttft(b, f"redis-{r}", prefix + tails[2 + i]))
            reads[name].append(b.kv_store.stats.blocks_read - read)
    cold = statistics.median(rows["cold"])
    out = []
    for name, xs in rows.items():
        med = statistics.median(xs)
        out.append((name, med * 1000, None if name == "cold" else med / cold,
                    "/".join(map(str, reads[name])) if reads[name] else ""))
    for e in (a, *replicas.values()):
        if e.kv_store is not None:
            e.kv_store.close()
    return out


# ---- 2. response cache over HTTP -------------------------------------------------------------


@contextlib.contextmanager
def server(args: argparse.Namespace, *extra: str) -> Iterator[str]:
    port = free_port()
    cmd = [sys.executable, "-m", "llmserve.cli", "serve", "--port", str(port), "--log-level", "warning", *extra]
    if args.model:
        cmd += ["--model", args.model]
    if args.num_threads:
        cmd += ["--num-threads", str(args.num_threads)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMSERVE_")}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited: {proc.stderr.read()[-2000:]}")  # type: ignore[union-attr]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not come up")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(60)


def timed(client: httpx.Client, body: dict, n: int, expect: str) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        r = client.post("/v1/completions", json=body)
        out.append((time.perf_counter() - t) * 1000)
        assert r.status_code == 200 and r.headers["x-llmserve-cache"] == expect, (r.status_code, r.text[:200])
    return out


def bench_http(args: argparse.Namespace, label: str, *extra: str) -> list[tuple[str, float, float, int]]:
    body = {"prompt": "Write a short story about a lighthouse keeper who finds a message in a bottle. " * 4,
            "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
    with server(args, *extra) as url, httpx.Client(base_url=url, timeout=120) as client:
        timed(client, {**body, "cache": False}, 2, "miss")  # warm-up
        gen = timed(client, {**body, "cache": False}, args.gens, "miss")
        timed(client, body, 1, "miss")  # stored
        time.sleep(0.2)  # a Redis write goes behind
        hits = timed(client, body, args.hits, "hit")
    return [(f"generated ({args.max_tokens} tokens), {label}", statistics.median(gen), percentile(gen, 99), len(gen)),
            (f"response-cache hit, {label}", statistics.median(hits), percentile(hits, 99), len(hits))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--prefix", type=int, default=1024, help="shared prefix length in tokens")
    p.add_argument("--reps", type=int, default=3, help="fresh prefixes measured (median)")
    p.add_argument("--num-blocks", type=int, default=512, help="KV cache blocks per in-process engine")
    p.add_argument("--num-threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--dtype", default="auto", help="the engines' dtype (auto: bfloat16 where the CPU computes it natively)")
    p.add_argument("--redis-timeouts", type=lambda v: [float(x) for x in v.split(",")], default=[0.05],
                   help="one Redis-tier replica per timeout, seconds (engine default 0.05)")
    p.add_argument("--hits", type=int, default=200, help="response-cache hits timed")
    p.add_argument("--gens", type=int, default=10, help="generated (uncached) requests timed")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--skip-http", action="store_true", help="only the in-process prefix benchmark")
    args = p.parse_args()

    with redis_server() as redis_url:
        if redis_url is None:
            print("note: redis-server not found; Redis rows skipped", file=sys.stderr)
        rows = bench_prefix(args, redis_url)
        print(f"\n### Prefix reuse: TTFT, {args.prefix}-token shared prefix + 16-token tail "
              f"(in process, around LLMEngine.step(); median of {args.reps} fresh prefixes)\n")
        print(f"| case | TTFT (ms) | vs cold | target | blocks read from Redis per rep (of {args.prefix // 16}) |")
        print("|---|---:|---:|---|---|")
        for name, ms, ratio, reads in rows:
            target = "<= 0.20" if name.startswith("local") else "<= 0.33" if name.startswith("Redis") else ""
            print(f"| {name} | {ms:.1f} | {'1.00' if ratio is None else f'{ratio:.3f}'} | {target} | {reads} |")
        if args.skip_http:
            return 0
        http = bench_http(args, "in-process cache")
        if redis_url:
            http += bench_http(args, "Redis cache", "--redis-url", redis_url)
    print("\n### Response cache over HTTP (non-streaming POST /v1/completions, kept-alive client)\n")
    print("| request | p50 (ms) | p99 (ms) | n |\n|---|---:|---:|---:|")
    for name, p50, p99, n in http:
        print(f"| {name} | {p50:.2f} | {p99:.2f} | {n} |")
    print("\nTarget: hit p50 <= 5 ms.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
