"""`llmserve bench serve` / scripts/loadtest.py: send a dataset to an OpenAI-compatible server with
gamma-distributed arrivals and bounded concurrency, then report TTFT / TPOT / ITL / E2EL, throughput
and goodput (see report.py).

Bounded: every request has --timeout seconds, the whole run --max-duration seconds; a request
cut by either, refused, or broken counts as a failure (never an exception). Every dataset entry
ends as exactly one record: successes + failures == --num-prompts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from collections.abc import AsyncIterator

import aiohttp
import numpy as np
from tqdm import tqdm

from llmserve.bench.client import RequestRecord, request_body, stream_request
from llmserve.bench.datasets import SampleRequest, build_dataset
from llmserve.bench.report import format_summary, parse_goodput, summarize


def run_bench(args: argparse.Namespace) -> int:
    """Run, print the summary, write --json / --plot. 0 when every request succeeded, else 1."""
    slos = parse_goodput(args.goodput)
    samples = build_dataset(
        args.dataset, args.num_prompts + args.num_warmups, args.input_len, args.output_len, args.range_ratio,
        args.seed, args.prefix_len, args.num_prefixes, args.dataset_path,
    )
    records, duration, model = asyncio.run(run_load(args, samples[args.num_warmups:], samples[: args.num_warmups]))
    summary = summarize(records, duration, slos)
    print(format_summary(summary))
    if args.json:
        config = {k: v for k, v in vars(args).items() if k != "func" and not k.endswith("command")}
        doc = {"config": {**config, "model": model}, "summary": summary, "requests": [r.to_json() for r in records]}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1, default=_jsonable)
    if args.plot:
        from llmserve.bench.plot import plot

        plot(records, args.plot)
    return 0 if summary["failures"] == 0 else 1


def _jsonable(x: object) -> object:
    return None if isinstance(x, float) and not math.isfinite(x) else str(x)


async def run_load(
    args: argparse.Namespace, samples: list[SampleRequest], warmups: list[SampleRequest]
) -> tuple[list[RequestRecord], float, str | None]:
    """(one record per sample, seconds from the first send to the last answer, model name sent)."""
    base = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    conns = args.max_concurrency or max(len(samples), len(warmups), 1)
    connector = aiohttp.TCPConnector(limit=conns)
    timeout = aiohttp.ClientTimeout(total=None)  # each request is bounded by --timeout below
    deadline = time.monotonic() + args.max_duration
    async with aiohttp.ClientSession(headers=headers, connector=connector, timeout=timeout) as client:
        model = args.model or await _first_model(client, base)
        url = base + args.endpoint
        sem = asyncio.Semaphore(args.max_concurrency or len(samples) + len(warmups) or 1)

        async def send(rec: RequestRecord, sample: SampleRequest, t0: float, bar: tqdm | None) -> None:
            async with sem:
                try:
                    body = request_body(args.endpoint, model, sample, args.temperature, args.ignore_eos)
                    await asyncio.wait_for(stream_request(client, url, body, rec, t0), args.timeout)
                except TimeoutError:
                    rec.error = f"timed out after {args.timeout:g} s"
                except Exception as e:  # transport errors, malformed replies: a failed request, not a crash
                    rec.error = f"{type(e).__name__}: {e}"
                except asyncio.CancelledError:
                    rec.error = f"cancelled: --max-duration {args.max_duration:g} s reached"
                    raise
            if bar is not None:
                bar.update(1)

        if warmups:
            t0 = time.perf_counter()
            await _gather_until([send(RequestRecord(-1, s.max_tokens), s, t0, None) for s in warmups], deadline)
        records = [RequestRecord(i, s.max_tokens) for i, s in enumerate(samples)]
        bar = tqdm(total=len(samples), disable=args.disable_tqdm, desc="requests")
        t0 = time.perf_counter()
        tasks = []
        async for i in _arrivals(len(samples), args.request_rate, args.burstiness, args.seed, deadline):
            tasks.append(asyncio.create_task(send(records[i], samples[i], t0, bar)))
        await _gather_until(tasks, deadline)
        duration = time.perf_counter() - t0
        bar.close()
    for r in records:
        if r.start_s is None and r.error is None:
            r.error = f"not sent: --max-duration {args.max_duration:g} s reached"
    return records, duration, model


async def _arrivals(n: int, rate: float, burstiness: float, seed: int, deadline: float) -> AsyncIterator[int]:
    """Indices 0..n-1 spaced by gamma(shape=burstiness, mean=1/rate) gaps; stops at the deadline."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        if time.monotonic() >= deadline:
            return
        yield i
        if math.isfinite(rate) and i + 1 < n:
            gap = float(rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness)))
            await asyncio.sleep(min(gap, max(0.0, deadline - time.monotonic())))


async def _gather_until(coros_or_tasks: list, deadline: float) -> None:
    """Wait for all; cancel what is still running at the deadline."""
    tasks = [asyncio.ensure_future(c) for c in coros_or_tasks]
    if not tasks:
        return
    _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.monotonic()))
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


async def _first_model(client: aiohttp.ClientSession, base: str) -> str | None:
    """The first model id of GET /v1/models; None (send no model) when the server does not say."""
    try:
        async with client.get(base + "/v1/models", timeout=aiohttp.ClientTimeout(total=10.0)) as resp:
            data = (await resp.json(content_type=None)).get("data") or []
            return data[0]["id"] if resp.status == 200 and data else None
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError, AttributeError):
        return None
