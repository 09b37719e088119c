"""Live serving figures for the dashboard (GET /stats/live): one Second per wall-clock second over
the last WINDOW_S seconds.

Feeds, each O(1) per step and per token: `on_step(step)` (a step listener on the engine door) adds the
step's tokens, its stage times, the TTFT and every ITL of each request that finished, and the
gauges and cumulative counters after it; `points(since)` (a poll) also stamps the current second
with the gauges now, so an idle server still draws a line.
TTFT and ITL go into fixed log-spaced histograms (EDGES), so a percentile costs one pass over
BINS counts, whatever the load.
"""

from __future__ import annotations

import bisect
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from llmserve.engine.client import EngineStats, StepEvent
from llmserve.profiling import STAGES, timings_of

WINDOW_S = 300
BINS = 64
EDGES = [1e-4 * 10 ** (6 * i / BINS) for i in range(BINS + 1)]  # 0.1 ms .. 100 s, log-spaced


def _observe(hist: list[int], seconds: float) -> None:
    hist[min(max(bisect.bisect_right(EDGES, seconds) - 1, 0), BINS - 1)] += 1


def percentile_ms(hist: list[int], q: float) -> float | None:
    """The q-quantile (0..1) of a histogram, as its bin's geometric middle in ms; None if empty."""
    total = sum(hist)
    if not total:
        return None
    rank, seen = q * total, 0
    for i, n in enumerate(hist):
        seen += n
        if seen >= rank and n:
            return round(math.sqrt(EDGES[i] * EDGES[i + 1]) * 1000, 3)
    return None


@dataclass(slots=True)
class Second:
    t: int  # unix second
    tokens: int = 0
    finished: int = 0
    steps: int = 0
    stage_s: list[float] = field(default_factory=lambda: [0.0] * len(STAGES))
    ttft: list[int] = field(default_factory=lambda: [0] * BINS)
    itl: list[int] = field(default_factory=lambda: [0] * BINS)
    # after the last step (or poll) in this second
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    prefix_queries: int = 0  # cumulative, in tokens
    prefix_hits: int = 0
    cache_hits: int = 0  # cumulative, response cache
    cache_misses: int = 0


class LiveStats:
    def __init__(self, stats_source: Callable[[], EngineStats], cache_source: Callable[[], Any],
                 clock: Callable[[], float] = time.time):
        """stats_source: the engine's latest stats; cache_source: the response cache's tally."""
        self.stats_source, self.cache_source, self.clock = stats_source, cache_source, clock
        self.seconds: deque[Second] = deque(maxlen=WINDOW_S + 1)

    def _now(self) -> Second:
        t = int(self.clock())
        if not self.seconds or self.seconds[-1].t != t:
            self.seconds.append(_idle(self.seconds[-1], t) if self.seconds else Second(t))
        return self.seconds[-1]

    def _stamp(self, s: Second, stats: EngineStats) -> None:
        s.running, s.waiting, s.kv_usage = stats.num_running, stats.num_waiting, stats.kv_cache_usage
        s.prefix_queries, s.prefix_hits = stats.prefix_cache_queries, stats.prefix_cache_hits
        cache = self.cache_source()
        s.cache_hits, s.cache_misses = cache.hits, cache.misses

    def on_step(self, step: StepEvent) -> None:
        s = self._now()
        s.steps += len(step.step_durations)
        for i, v in enumerate(step.stage_seconds[: len(STAGES)]):
            s.stage_s[i] += v
        for o in step.outputs:
            s.tokens += len(o.new_token_ids)
            if o.finished and o.timeline is not None:
                s.finished += 1
                t = timings_of(o.timeline)
                if t.ttft_s is not None:
                    _observe(s.ttft, t.ttft_s)
                for gap in t.itl_s:
                    _observe(s.itl, gap)
        self._stamp(s, step.stats)

    def points(self, since: float, stats: EngineStats) -> list[dict]:
        """One point per whole second after `since`, from the first one recorded (at most
        WINDOW_S ago) up to the last full one."""
        self._stamp(self._now(), stats)
        now = int(self.clock())
        by_t = {s.t: s for s in self.seconds}
        out, prev = [], None
        for t in range(max(int(since) + 1, now - WINDOW_S, self.seconds[0].t), now):
            s = by_t.get(t)
            before = by_t.get(t - 1) or prev
            if s is None:  # nothing happened: the gauges and counters stand still
                s = Second(t) if before is None else _idle(before, t)
            out.append(_point(s, before))
            prev = s
        return out


def _idle(before: Second, t: int) -> Second:
    """Second t with nothing happened in it: gauges and cumulative counters carry over."""
    return Second(t, running=before.running, waiting=before.waiting, kv_usage=before.kv_usage,
                  prefix_queries=before.prefix_queries, prefix_hits=before.prefix_hits,
                  cache_hits=before.cache_hits, cache_misses=before.cache_misses)


def _rate(hits: int, total: int) -> float | None:
    return round(hits / total, 4) if total > 0 else None


def _point(s: Second, before: Second | None) -> dict:
    b = before or s
    steps = max(s.steps, 1)
    return {
        "t": s.t, "running": s.running, "waiting": s.waiting, "kv_usage": round(s.kv_usage, 4),
        "tok_s": s.tokens, "finished": s.finished,
        "ttft_p50_ms": percentile_ms(s.ttft, 0.5), "ttft_p99_ms": percentile_ms(s.ttft, 0.99),
        "itl_p50_ms": percentile_ms(s.itl, 0.5), "itl_p99_ms": percentile_ms(s.itl, 0.99),
        "prefix_hit_rate": _rate(s.prefix_hits - b.prefix_hits, s.prefix_queries - b.prefix_queries),
        "response_cache_hit_rate": _rate(s.cache_hits - b.cache_hits,
                                         (s.cache_hits + s.cache_misses) - (b.cache_hits + b.cache_misses)),
        "steps": s.steps,
        "step_ms": {stage: round(v / steps * 1000, 3) for stage, v in zip(STAGES, s.stage_s, strict=True)},
    }
