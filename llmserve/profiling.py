"""Timing records: one StepRecord per engine step, LatencyStats over any series of durations."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(slots=True)
class StepRecord:
    start: float  # time.time() when the step began
    num_prefill_tokens: int
    num_decode_seqs: int
    schedule_s: float
    prepare_s: float
    forward_s: float
    sample_s: float
    update_s: float  # detokenize + stop checks + building outputs

    @property
    def duration_s(self) -> float:
        return self.schedule_s + self.prepare_s + self.forward_s + self.sample_s + self.update_s


@dataclass(slots=True)
class LatencyStats:
    count: int
    mean: float
    p50: float
    p95: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: list[float]) -> LatencyStats:
        if not values:
            nan = float("nan")
            return cls(0, nan, nan, nan, nan, nan)
        xs = sorted(values)
        return cls(len(xs), sum(xs) / len(xs), percentile(xs, 50), percentile(xs, 95), percentile(xs, 99), xs[-1])


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default method)."""
    n = len(sorted_values)
    if n == 1:
        return sorted_values[0]
    rank = (n - 1) * q / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, n - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (rank - lo)
