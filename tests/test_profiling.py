"""Profiling: LatencyStats vs numpy, timings derived from a timeline, `llmserve profile --trace`."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from llmserve.cli import main
from llmserve.engine.request import Timeline
from llmserve.profiling import LatencyStats, StepRecord, timings_of


@pytest.mark.parametrize("n", [1, 2, 3, 10, 101, 1000])
def test_latency_stats_match_numpy(n):
    rng = np.random.default_rng(n)
    for values in (rng.exponential(0.05, n), rng.normal(0, 1, n), rng.integers(0, 5, n).astype(float)):
        s = LatencyStats.of(list(values))
        assert s.count == n
        assert s.mean == pytest.approx(np.mean(values), rel=1e-12, abs=1e-12)
        for q, got in ((50, s.p50), (95, s.p95), (99, s.p99)):
            assert got == pytest.approx(np.percentile(values, q), rel=1e-12, abs=1e-12), (n, q)
        assert s.max == np.max(values)


def test_latency_stats_of_nothing_is_nan():
    s = LatencyStats.of([])
    assert s.count == 0 and math.isnan(s.p50) and math.isnan(s.mean)


def test_timings_from_a_hand_built_timeline():
    tl = Timeline(arrival=100.0, first_scheduled=100.5, token_times=[101.0, 101.25, 101.75, 102.0], finished=102.0)
    t = timings_of(tl)
    assert t.queue_s == pytest.approx(0.5)
    assert t.prefill_s == pytest.approx(0.5)
    assert t.ttft_s == pytest.approx(1.0)
    assert t.itl_s == pytest.approx([0.25, 0.5, 0.25])
    assert t.tpot_s == pytest.approx(1.0 / 3)
    assert t.decode_s == pytest.approx(1.0)
    assert t.e2e_s == pytest.approx(2.0)
    assert t.as_ms() == {"queue_ms": 500.0, "ttft_ms": 1000.0, "tpot_ms": 333.333, "e2e_ms": 2000.0, "itl_ms": [250.0, 500.0, 250.0]}


def test_timings_of_a_request_that_never_ran():
    t = timings_of(Timeline(arrival=5.0, finished=6.0))  # aborted while queued
    assert (t.queue_s, t.ttft_s, t.tpot_s, t.prefill_s, t.decode_s) == (None,) * 5
    assert t.e2e_s == pytest.approx(1.0) and t.itl_s == []
    one = timings_of(Timeline(arrival=0.0, first_scheduled=0.1, token_times=[0.3], finished=0.3))
    assert one.tpot_s is None and one.itl_s == [] and one.ttft_s == pytest.approx(0.3)


def test_step_record_duration_is_the_sum_of_its_stages():
    r = StepRecord(0.0, 10, 2, 0.001, 0.002, 0.010, 0.003, 0.0005, 0.0015)
    assert r.duration_s == pytest.approx(0.018)
    assert list(r.stage_durations()) == ["schedule", "prepare", "forward", "sample", "detokenize", "update"]


def _inside(child: dict, parent: dict, tol: float = 0.01) -> bool:
    return parent["ts"] - tol <= child["ts"] and child["ts"] + child["dur"] <= parent["ts"] + parent["dur"] + tol


def test_profile_writes_a_chrome_trace(tiny_model, tmp_path, capsys):
    out = tmp_path / "trace.json"
    n = 6
    rc = main(["profile", "--model", tiny_model, "--num-prompts", str(n), "--input-len", "40", "--output-len", "8",
               "--max-num-batched-tokens", "64", "--num-threads", "1", "--trace", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    for label in ("forward", "detokenize", "TTFT", "ITL", "e2e", "p99"):
        assert label in printed

    events = json.loads(out.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert all(isinstance(e["ts"], (int, float)) and isinstance(e["dur"], (int, float)) and e["dur"] >= 0 for e in spans)
    steps = [e for e in spans if e["name"] == "step"]
    stages = [e for e in spans if e["cat"] == "stage"]
    # 6 prompts x 40 tokens over a 64-token budget: several prefill steps, then decode steps
    assert len(steps) >= 8 and len(stages) == 6 * len(steps)
    assert sum(1 for s in steps if s["args"]["num_prefill_tokens"] > 0) >= 4
    for st in stages:
        assert any(_inside(st, s) for s in steps if s["pid"] == st["pid"] and s["tid"] == st["tid"])

    requests = [e for e in spans if e["name"] == "request"]
    assert len(requests) == n and len({r["tid"] for r in requests}) == n
    for r in requests:
        assert r["args"]["output_tokens"] == 8 and r["args"]["finish_reason"] == "length"
        phases = {e["name"]: e for e in spans if e["pid"] == r["pid"] and e["tid"] == r["tid"] and e is not r}
        assert set(phases) == {"queued", "prefill", "decode"}
        for p in phases.values():
            assert _inside(p, r)
        # queued -> prefill -> decode, end to end
        assert phases["queued"]["ts"] + phases["queued"]["dur"] == pytest.approx(phases["prefill"]["ts"], abs=0.01)
        assert phases["prefill"]["ts"] + phases["prefill"]["dur"] == pytest.approx(phases["decode"]["ts"], abs=0.01)
    # the engine process and the request tracks are named, so Perfetto labels them
    names = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert {"engine", "requests"} <= names
