"""Chrome trace-event JSON (loads in Perfetto / chrome://tracing) of engine steps and requests.

Layout: process 1 "engine" has one track of step spans, each with its stage sub-spans (schedule,
prepare, forward, sample, detokenize, update) laid end to end inside it. Process 2 "requests" has
one track per request: a "request" span (arrival -> finished) holding "queued" (arrival -> first
scheduled), "prefill" (first scheduled -> first token) and "decode" (first token -> finished).
All events are complete events ("ph": "X"); ts and dur are microseconds from the earliest time.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol

from llmserve.engine.outputs import Timeline
from llmserve.profiling import StepRecord

ENGINE_PID, REQUESTS_PID = 1, 2


class TracedRequest(Protocol):
    """What a trace reads of a request (the engine's Request has it): observability imports no
    engine internals."""

    request_id: str
    timeline: Timeline
    output_token_ids: list[int]
    num_cached_tokens: int
    num_preemptions: int

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def finish_reason(self) -> str | None: ...


def trace_events(steps: Iterable[StepRecord], requests: Iterable[TracedRequest]) -> dict:
    """{"traceEvents": [...], "displayTimeUnit": "ms"}; a child span never leaves its parent."""
    steps, requests = list(steps), list(requests)
    starts = [s.start for s in steps] + [r.timeline.arrival for r in requests]
    t0 = min(starts, default=0.0)

    def us(t: float) -> float:
        return (t - t0) * 1e6

    events = [
        _name("process_name", ENGINE_PID, 0, "engine"),
        _name("thread_name", ENGINE_PID, 0, "steps"),
        _name("process_name", REQUESTS_PID, 0, "requests"),
    ]
    for i, s in enumerate(steps):
        ts = us(s.start)
        args = {"step": i, "num_prefill_tokens": s.num_prefill_tokens, "num_decode_seqs": s.num_decode_seqs}
        events.append(_span("step", "step", ENGINE_PID, 0, ts, s.duration_s * 1e6, args))
        for stage, dur in s.stage_durations().items():
            events.append(_span(stage, "stage", ENGINE_PID, 0, ts, dur * 1e6))
            ts += dur * 1e6
    for tid, r in enumerate(requests, start=1):
        events += _request_events(r, tid, us)
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _request_events(r: TracedRequest, tid: int, us: Callable[[float], float]) -> list[dict]:
    tl = r.timeline
    first = tl.token_times[0] if tl.token_times else None
    end = tl.finished or (tl.token_times[-1] if tl.token_times else None) or tl.first_scheduled or tl.arrival
    args = {"request_id": r.request_id, "prompt_tokens": r.num_prompt_tokens, "output_tokens": len(r.output_token_ids),
            "cached_tokens": r.num_cached_tokens, "preemptions": r.num_preemptions, "finish_reason": r.finish_reason}
    events = [
        _name("thread_name", REQUESTS_PID, tid, r.request_id),
        _span("request", "request", REQUESTS_PID, tid, us(tl.arrival), us(end) - us(tl.arrival), args),
    ]
    phases = [("queued", tl.arrival, tl.first_scheduled), ("prefill", tl.first_scheduled, first), ("decode", first, tl.finished)]
    for name, a, b in phases:
        if a is not None and b is not None:
            events.append(_span(name, "request", REQUESTS_PID, tid, us(a), us(b) - us(a)))
    return events


def _span(name: str, cat: str, pid: int, tid: int, ts: float, dur: float, args: dict | None = None) -> dict:
    ev = {"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": tid, "ts": round(ts, 3), "dur": round(max(dur, 0.0), 3)}
    if args:
        ev["args"] = args
    return ev


def _name(kind: str, pid: int, tid: int, name: str) -> dict:
    """A metadata event naming a process or thread track."""
    return {"ph": "M", "name": kind, "pid": pid, "tid": tid, "args": {"name": name}}


def write_trace(path: str | Path, steps: Iterable[StepRecord], requests: Iterable[TracedRequest]) -> None:
    Path(path).write_text(json.dumps(trace_events(steps, requests)))
