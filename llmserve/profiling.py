"""Timing records: one StepRecord per engine step, RequestTimings derived from a request's
Timeline (the one place queue time, TTFT, ITL, TPOT and e2e are defined), and LatencyStats over
any series of durations."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmserve.engine.outputs import Timeline

STAGES = ("schedule", "prepare", "forward", "sample", "detokenize", "update")


@dataclass(slots=True)
class StepRecord:
    start: float  # time.time() when the step began; the stages follow each other in STAGES order
    num_prefill_tokens: int
    num_decode_seqs: int
    schedule_s: float
    prepare_s: float  # batch -> tensors
    forward_s: float  # model forward + logits
    sample_s: float
    update_s: float  # stop checks, freeing finished requests, building outputs (detokenize excluded)
    detokenize_s: float = 0.0  # incremental detokenization of the sampled tokens

    @property
    def duration_s(self) -> float:
        return self.schedule_s + self.prepare_s + self.forward_s + self.sample_s + self.detokenize_s + self.update_s

    def stage_durations(self) -> dict[str, float]:
        """{stage: seconds} in STAGES order."""
        return {s: getattr(self, f"{s}_s") for s in STAGES}


@dataclass(slots=True)
class RequestTimings:
    """Seconds. None where the timeline has not reached that point (e.g. aborted while queued).

    queue = arrival -> first scheduled; prefill = first scheduled -> first token;
    ttft = arrival -> first token; itl[i] = token i+1 - token i; tpot = mean of itl
    (= (last token - first token) / (n - 1)); decode = first token -> finished; e2e = arrival -> finished.
    """

    queue_s: float | None
    prefill_s: float | None
    ttft_s: float | None
    tpot_s: float | None
    decode_s: float | None
    e2e_s: float | None
    itl_s: list[float] = field(default_factory=list)

    def as_ms(self) -> dict:
        """The native API's `timings` object: {queue_ms, ttft_ms, tpot_ms, e2e_ms, itl_ms: [...]}."""
        return {
            "queue_ms": _ms(self.queue_s),
            "ttft_ms": _ms(self.ttft_s),
            "tpot_ms": _ms(self.tpot_s),
            "e2e_ms": _ms(self.e2e_s),
            "itl_ms": [_ms(x) for x in self.itl_s],
        }


def timings_of(tl: Timeline) -> RequestTimings:
    tt = tl.token_times
    first = tt[0] if tt else None
    return RequestTimings(
        queue_s=_gap(tl.arrival, tl.first_scheduled),
        prefill_s=_gap(tl.first_scheduled, first),
        ttft_s=_gap(tl.arrival, first),
        tpot_s=(tt[-1] - tt[0]) / (len(tt) - 1) if len(tt) > 1 else None,
        decode_s=_gap(first, tl.finished),
        e2e_s=_gap(tl.arrival, tl.finished),
        itl_s=[b - a for a, b in zip(tt, tt[1:], strict=False)],
    )


def _gap(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else end - start


def _ms(s: float | None) -> float | None:
    return None if s is None else round(s * 1000, 3)


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
        """Stats of `values` (any order); all NaN with count 0 when empty."""
        if not values:
            nan = float("nan")
            return cls(0, nan, nan, nan, nan, nan)
        xs = sorted(values)
        return cls(len(xs), sum(xs) / len(xs), percentile(xs, 50), percentile(xs, 95), percentile(xs, 99), xs[-1])

    def scaled(self, factor: float) -> LatencyStats:
        """The same stats in other units (e.g. factor 1000: seconds -> milliseconds)."""
        return LatencyStats(self.count, self.mean * factor, self.p50 * factor, self.p95 * factor, self.p99 * factor, self.max * factor)


def percentile(sorted_values: list[float], q: float) -> float:
    """q in [0, 100] of ascending values: linear interpolation between closest ranks (numpy's default)."""
    n = len(sorted_values)
    if n == 1:
        return sorted_values[0]
    rank = (n - 1) * q / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, n - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (rank - lo)
