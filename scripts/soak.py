#!/usr/bin/env python3
"""Soak a running llmserve server with mixed traffic and watch its memory.

    python scripts/soak.py --base-url http://127.0.0.1:8000 --minutes 10 --concurrency 16

Traffic: `--concurrency` clients, each sending one request after another until time is up:
chat or completions, streaming or not, random prompt and output lengths, a stop string on some,
greedy or seeded sampling; every fifth request hangs up early (a disconnect, not a failure).

Every `--sample-every` seconds it reads GET /stats (RSS and glibc heap figures of the server
and of the engine-core process, running and waiting requests) and /metrics (generated tokens),
and writes a row to OUT.csv; at the end, OUT.png plots RSS, running requests and tok/s.

The verdict: after `--settle-minutes` (2), total RSS must stay within ±`--tolerance` (5%) of its
value at that moment, with 0 failed requests. Exit status 0 when both hold, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import random
import re
import sys
import time
from dataclasses import dataclass, field

import aiohttp
import msgspec

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex "
         "every jolly vexed sphinx of black quartz judging my vow").split()
STOPS = ("\n\n", ".", " the", "###")
COLUMNS = ("t_s", "rss_total_bytes", "server_rss_bytes", "core_rss_bytes", "core_heap_in_use_bytes",
           "core_heap_free_bytes", "server_heap_in_use_bytes", "server_heap_free_bytes",
           "running", "waiting", "tok_per_s", "requests_done", "hangups", "failures")


@dataclass
class Tally:
    done: int = 0
    hangups: int = 0
    failures: list[str] = field(default_factory=list)


def request_body(rng: random.Random, chat: bool, stream: bool) -> dict:
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 200)))
    body: dict = {"max_tokens": rng.randint(8, 160), "stream": stream, "temperature": rng.choice((0.0, 0.8))}
    if body["temperature"]:
        body["seed"] = rng.randrange(1 << 30)
    if rng.random() < 0.3:
        body["stop"] = [rng.choice(STOPS)]
    if chat:
        body["messages"] = [{"role": "user", "content": words}]
    else:
        body["prompt"] = words
    return body


async def one_request(session: aiohttp.ClientSession, base: str, rng: random.Random, hang_up: bool, tally: Tally) -> None:
    chat, stream = rng.random() < 0.5, rng.random() < 0.6
    url = base + ("/v1/chat/completions" if chat else "/v1/completions")
    body = request_body(rng, chat, stream)
    if hang_up:  # leave after a few chunks (streaming) or a short wait (not streaming)
        try:
            await asyncio.wait_for(_read(session, url, body, stream, stop_after=rng.randint(1, 4)), rng.uniform(0.05, 1.5))
        except TimeoutError:
            pass
        tally.hangups += 1
        return
    error = await _read(session, url, body, stream)
    if error:
        tally.failures.append(error)
    else:
        tally.done += 1


async def _read(session: aiohttp.ClientSession, url: str, body: dict, stream: bool, stop_after: int | None = None) -> str | None:
    """None when the request ended well (or was left after `stop_after` chunks), else why not."""
    async with session.post(url, data=msgspec.json.encode(body), headers={"Content-Type": "application/json"}) as resp:
        if resp.status != 200:
            return f"HTTP {resp.status}: {(await resp.read())[:200]!r}"
        if not stream:
            doc = await resp.json()
            return None if doc.get("choices") and doc["choices"][0].get("finish_reason") else f"no finish_reason: {doc}"
        chunks = 0
        async for line in resp.content:
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return None
            if b'"error"' in data:
                return f"error event: {data[:200]!r}"
            chunks += 1
            if stop_after is not None and chunks >= stop_after:
                return None
        return None if stop_after is not None else "the stream ended without [DONE]"


async def client_loop(session: aiohttp.ClientSession, base: str, seed: int, deadline: float, counter: list[int],
                      tally: Tally, timeout: float) -> None:
    rng = random.Random(seed)
    while time.monotonic() < deadline:
        counter[0] += 1
        try:
            await asyncio.wait_for(one_request(session, base, rng, counter[0] % 5 == 0, tally), timeout)
        except TimeoutError:
            tally.failures.append(f"no answer within {timeout:g} s")
        except aiohttp.ClientError as e:
            tally.failures.append(f"{type(e).__name__}: {e}")


async def sample(session: aiohttp.ClientSession, base: str, t0: float, last_tokens: list[float], tally: Tally) -> dict:
    async with session.get(base + "/stats") as resp:
        stats = await resp.json()
    async with session.get(base + "/metrics") as resp:
        text = await resp.text()
    m = re.search(r"^llmserve:generation_tokens_total (\S+)$", text, re.M)
    tokens, now = float(m.group(1)) if m else 0.0, time.monotonic()
    tok_s = (tokens - last_tokens[0]) / max(1e-9, now - last_tokens[1]) if last_tokens[1] else 0.0
    last_tokens[:] = [tokens, now]
    core, server = stats["engine"]["memory"], stats["server"]["memory"]
    return {
        "t_s": round(now - t0, 1), "rss_total_bytes": core.get("rss_bytes", 0) + server.get("rss_bytes", 0),
        "server_rss_bytes": server.get("rss_bytes", 0), "core_rss_bytes": core.get("rss_bytes", 0),
        "core_heap_in_use_bytes": core.get("heap_in_use_bytes", 0), "core_heap_free_bytes": core.get("heap_free_bytes", 0),
        "server_heap_in_use_bytes": server.get("heap_in_use_bytes", 0), "server_heap_free_bytes": server.get("heap_free_bytes", 0),
        "running": stats["engine"]["num_running"], "waiting": stats["engine"]["num_waiting"], "tok_per_s": round(tok_s, 1),
        "requests_done": tally.done, "hangups": tally.hangups, "failures": len(tally.failures),
    }


async def soak(args: argparse.Namespace) -> tuple[list[dict], Tally]:
    base = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    tally, rows, counter = Tally(), [], [0]
    t0 = time.monotonic()
    deadline = t0 + args.minutes * 60
    async with aiohttp.ClientSession(headers=headers, connector=aiohttp.TCPConnector(limit=args.concurrency + 4)) as session:
        clients = [asyncio.create_task(client_loop(session, base, args.seed + i, deadline, counter, tally, args.timeout))
                   for i in range(args.concurrency)]
        last_tokens = [0.0, 0.0]
        while time.monotonic() < deadline:
            try:
                row = await sample(session, base, t0, last_tokens, tally)
                rows.append(row)
                print(f"{row['t_s']:7.1f} s  RSS {row['rss_total_bytes'] / 2**30:.3f} GiB  running {row['running']:3d}  "
                      f"{row['tok_per_s']:7.1f} tok/s  done {tally.done}  failed {len(tally.failures)}", flush=True)
            except (aiohttp.ClientError, TimeoutError, KeyError, ValueError) as e:
                tally.failures.append(f"sampling failed: {type(e).__name__}: {e}")
            await asyncio.sleep(max(0.0, min(args.sample_every, deadline - time.monotonic())))
        await asyncio.wait(clients, timeout=args.timeout)
        for c in clients:
            c.cancel()
    return rows, tally


def verdict(rows: list[dict], settle_s: float, tolerance: float) -> tuple[bool, str]:
    after = [r for r in rows if r["t_s"] >= settle_s]
    if not after:
        return False, f"no samples after {settle_s:g} s"
    ref = after[0]["rss_total_bytes"]
    lo, hi = min(r["rss_total_bytes"] for r in after), max(r["rss_total_bytes"] for r in after)
    drift = max(hi - ref, ref - lo) / ref
    text = (f"RSS at {after[0]['t_s']:.0f} s: {ref / 2**30:.3f} GiB; after it: {lo / 2**30:.3f}-{hi / 2**30:.3f} GiB "
            f"({drift:+.1%} at most, tolerance ±{tolerance:.0%}); last {rows[-1]['rss_total_bytes'] / 2**30:.3f} GiB")
    return drift <= tolerance, text


def plot(rows: list[dict], path: str, settle_s: float, tolerance: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [r["t_s"] / 60 for r in rows]
    fig, (a, b, c) = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    for key, label in (("rss_total_bytes", "total"), ("core_rss_bytes", "engine core"), ("server_rss_bytes", "server")):
        a.plot(t, [r[key] / 2**30 for r in rows], label=label)
    ref = next((r["rss_total_bytes"] / 2**30 for r in rows if r["t_s"] >= settle_s), None)
    if ref is not None:
        a.axhspan(ref * (1 - tolerance), ref * (1 + tolerance), color="green", alpha=0.1, label=f"±{tolerance:.0%}")
    a.set(ylabel="RSS (GiB)", title="llmserve soak")
    a.legend(loc="center right")
    b.plot(t, [r["running"] for r in rows], label="running")
    b.plot(t, [r["waiting"] for r in rows], label="waiting")
    b.set(ylabel="requests")
    b.legend(loc="center right")
    c.plot(t, [r["tok_per_s"] for r in rows])
    c.set(ylabel="output tok/s", xlabel="minutes")
    for ax in (a, b, c):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--sample-every", type=float, default=5.0, help="seconds between samples")
    p.add_argument("--settle-minutes", type=float, default=2.0, help="RSS is compared with its value at this time")
    p.add_argument("--tolerance", type=float, default=0.05)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds one request may take")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="soak", help="writes OUT.csv and OUT.png")
    args = p.parse_args()
    rows, tally = asyncio.run(soak(args))
    with open(f"{args.out}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    if rows:
        plot(rows, f"{args.out}.png", args.settle_minutes * 60, args.tolerance)
    flat, text = verdict(rows, args.settle_minutes * 60, args.tolerance)
    print(f"{tally.done} requests finished, {tally.hangups} hung up on purpose, {len(tally.failures)} failed")
    for why in tally.failures[:10]:
        print(f"  failed: {why}")
    print(text)
    print(f"wrote {args.out}.csv and {args.out}.png")
    return 0 if flat and not tally.failures else 1


if __name__ == "__main__":
    sys.exit(main())
