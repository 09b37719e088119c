"""/metrics moves with traffic; native timings agree with what the client measured."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server_harness import sse_data, wait_for

pytestmark = pytest.mark.timeout(120)


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one /metrics scrape."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_move_by_exactly_what_was_sent(server):
    before = scrape(server.url)
    usages = []
    for i in range(5):
        body = {"prompt": f"The river town {i}", "max_tokens": 3 + i, "temperature": 0, "ignore_eos": True}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200
        usages.append(r.json()["usage"])
    wait_for(lambda: server.stats().num_running == 0, 5, "requests did not finish")
    after = scrape(server.url)

    def delta(name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("llmserve:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert delta("llmserve:generation_tokens_total") == sum(u["completion_tokens"] for u in usages)
    assert delta("llmserve:request_success_total", finish_reason="length") == 5
    for h in ("time_to_first_token", "e2e_request_latency", "request_queue_time", "request_prefill_time", "request_decode_time"):
        assert delta(f"llmserve:{h}_seconds_count") == 5, h
    assert delta("llmserve:inter_token_latency_seconds_count") == sum(u["completion_tokens"] - 1 for u in usages)
    assert delta("llmserve:step_duration_seconds_count") > 0
    assert after[("llmserve:num_requests_running", ())] == 0 and after[("llmserve:num_requests_waiting", ())] == 0


def test_response_cache_hits_and_misses_reach_metrics(server):
    before = scrape(server.url)
    body = {"prompt": "Cache me twice", "max_tokens": 4, "temperature": 0}
    replies = [httpx.post(server.url + "/v1/completions", json=body, timeout=60) for _ in range(2)]
    assert [r.headers["x-llmserve-cache"] for r in replies] == ["miss", "hit"]
    after = scrape(server.url)
    for name, moved in (("response_cache_hits_total", 1), ("response_cache_misses_total", 1)):
        assert after[(f"llmserve:{name}", ())] - before[(f"llmserve:{name}", ())] == moved, name
    errors = ("llmserve:cache_errors_total", (("cache", "response"),))
    assert after[errors] == before[errors]


def test_native_timings_within_client_measurements(server):
    body = {"prompt": "Hello world", "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    first = None
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=60) as r:
        events = []
        for data in sse_data(r.iter_lines()):
            if first is None:
                first = time.perf_counter()
            events.append(json.loads(data))
    end = time.perf_counter()
    timings = events[-1]["timings"]
    assert 0 < timings["ttft_ms"] <= (first - start) * 1000
    assert timings["ttft_ms"] <= timings["e2e_ms"] <= (end - start) * 1000
    assert len(timings["itl_ms"]) == 11 and all(x >= 0 for x in timings["itl_ms"])


def test_memory_figures_come_when_asked_not_with_every_step(server):
    """The per-step stats carry no memory figures (mallinfo2 and /proc reads are for stats asked
    for); GET /stats has the engine process's."""
    seen: list[dict] = []
    remove = server.ctx.client.add_step_listener(lambda step: seen.append(step.stats.memory))
    try:
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "a", "max_tokens": 3, "temperature": 0}, timeout=60)
        assert r.status_code == 200
        wait_for(lambda: len(seen) >= 3, 30, "no steps seen")
    finally:
        remove()
    assert seen and all(m == {} for m in seen)
    engine = httpx.get(server.url + "/stats", timeout=30).json()["engine"]
    assert engine["memory"]["rss_bytes"] > 0
