"""StatsBoard: where engine replicas post their EngineStats, for the ingress to read.

A Ray Serve handle reaches *some* replica, never a chosen one, so per-replica stats cannot be
asked for; each replica posts its own instead (every POST_INTERVAL_S), with its engine steps'
durations since the last post, and the ingress reads the board (every READ_INTERVAL_S, and for
GET /stats), taking the steps for its metrics (one ingress: one reader). One named actor per application; an entry
older than STALE_S belongs to a replica that has gone and is dropped.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass, field

import ray

from llmserve.engine.outputs import EngineStats
from llmserve.profiling import STAGES

POST_INTERVAL_S = 0.5
READ_INTERVAL_S = 0.5
STALE_S = 5.0
NAMESPACE = "llmserve"


@dataclass(slots=True)
class StepFigures:
    """Engine steps since a replica's last post: each one's duration, and their time per
    profiling.STAGES stage, summed."""

    durations: list[float] = field(default_factory=list)
    stage_seconds: list[float] = field(default_factory=lambda: [0.0] * len(STAGES))

    def add(self, durations: list[float], stage_seconds: list[float]) -> None:
        self.durations += durations
        for i, v in enumerate(stage_seconds[: len(STAGES)]):
            self.stage_seconds[i] += v


@ray.remote(num_cpus=0, max_restarts=-1)
class StatsBoard:
    def __init__(self) -> None:
        self.entries: dict[str, tuple[float, EngineStats]] = {}  # replica id -> (posted at, stats)
        self.steps = StepFigures()  # every replica's steps since the last read

    def post(self, replica_id: str, stats: EngineStats, steps: StepFigures) -> None:
        self.entries[replica_id] = (time.monotonic(), stats)
        self.steps.add(steps.durations, steps.stage_seconds)

    def read(self) -> tuple[dict[str, EngineStats], StepFigures]:
        """The fresh entries, and the steps posted since the last read (the ingress's metrics)."""
        now = time.monotonic()
        self.entries = {r: e for r, e in self.entries.items() if now - e[0] <= STALE_S}
        steps, self.steps = self.steps, StepFigures()
        return {r: s for r, (_, s) in self.entries.items()}, steps


def board_name(app_name: str) -> str:
    return f"llmserve-stats:{app_name}"


def get_board(app_name: str):
    """The application's board, created by whoever asks first (detached: it outlives a replica
    restart, and Ray restarts it; `llmserve serve --ray` kills it with the application)."""
    return StatsBoard.options(name=board_name(app_name), namespace=NAMESPACE, lifetime="detached",
                              get_if_exists=True).remote()


COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "num_steps")
COUNTER_DICTS = ("kv_store", "spec_decode")  # of counters (memory: gauges)


def sum_stats(current: list[EngineStats], retired: list[EngineStats], empty: EngineStats) -> EngineStats:
    """The replicas' stats as one engine's: counts and counters add up, usage is recomputed. The
    counters of `retired` replicas (gone from the board) still count, so that totals never go
    back; `empty` when no replica has posted."""
    total = _sum(current) if current else empty
    if not retired:
        return total
    gone = _sum(retired)
    return dataclasses.replace(
        total, **{f: getattr(total, f) + getattr(gone, f) for f in COUNTERS},
        **{f: _sum_dicts([getattr(total, f), getattr(gone, f)]) for f in COUNTER_DICTS})


def _sum(stats: list[EngineStats]) -> EngineStats:
    total = {}
    for f in dataclasses.fields(EngineStats):
        values = [getattr(s, f.name) for s in stats]
        total[f.name] = _sum_dicts(values) if isinstance(values[0], dict) else sum(values)
    used, blocks = total["num_blocks_used"], total["num_blocks_total"]
    total["kv_cache_usage"] = used / blocks if blocks else 0.0
    return EngineStats(**total)


def _sum_dicts(dicts: list[dict]) -> dict:
    """Numbers summed, lists of numbers summed element-wise (histogram counts); anything else
    kept from the first replica that has it."""
    out: dict = {}
    for d in dicts:
        for k, v in d.items():
            if k not in out:
                out[k] = list(v) if isinstance(v, list) else v
            elif _number(v) and _number(out[k]):
                out[k] += v
            elif isinstance(v, list) and isinstance(out[k], list) and all(map(_number, v + out[k])):
                out[k] = [a + b for a, b in itertools.zip_longest(out[k], v, fillvalue=0)]
    return out


def _number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)
