"""The embedded caches (no Redis): a deterministic request asked again is answered from the
in-process response cache, without the engine, in the same format (JSON and SSE, every
endpoint), marked x-llmserve-cache: hit; what is not deterministic or opts out is never cached;
the local prefix cache serves a shared 512-token prefix and the output stays exact."""

from __future__ import annotations

import json
import random

import httpx
import pytest
from server_harness import live_server, sse_data, torch_threads_restored

from llmserve.engine.llm import LLM
from llmserve.sampling import SamplingParams

pytestmark = pytest.mark.timeout(120)
VOLATILE = ("id", "created")  # differ between any two responses


def post(url: str, path: str, body: dict) -> httpx.Response:
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r


def stable(obj: dict) -> dict:
    """A response body without what legitimately differs between two answers."""
    out = {k: v for k, v in obj.items() if k not in VOLATILE}
    if "timings" in out:  # /generate: the hit's own timings
        out["timings"] = None
    if "t_ms" in out:
        out["t_ms"] = None
    return out


def events(r: httpx.Response) -> list:
    data = sse_data(r.text.splitlines())
    return [d if d == "[DONE]" else stable(json.loads(d)) for d in data]


CASES = [
    ("/v1/completions", {"prompt": "Hello there", "max_tokens": 12, "temperature": 0, "logprobs": 2, "echo": True}),
    ("/v1/completions", {"prompt": ["The river", "town"], "max_tokens": 6, "temperature": 0.9, "seed": 7, "stop": [" t"]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, "temperature": 0, "logprobs": True, "top_logprobs": 3}),
    ("/generate", {"prompt": "Hello", "max_tokens": 10, "temperature": 0, "logprobs": 1}),
]


@pytest.mark.parametrize(("path", "body"), CASES, ids=["completions-echo-logprobs", "completions-seed-2-prompts", "chat-logprobs", "generate"])
def test_a_repeated_deterministic_request_is_a_hit_with_the_same_body(server, path, body):
    first = post(server.url, path, body)
    steps = server.stats().num_steps
    again = post(server.url, path, body)
    assert (first.headers["x-llmserve-cache"], again.headers["x-llmserve-cache"]) == ("miss", "hit")
    assert stable(again.json()) == stable(first.json())
    # streamed, the same request replays the same engine record as SSE events (stream options
    # only change the formatting, so it is a hit too), and its text is the non-streamed text
    sbody = {**body, "stream": True} | ({"stream_options": {"include_usage": True}} if path != "/generate" else {})
    streamed = [post(server.url, path, sbody), post(server.url, path, sbody)]
    assert [r.headers["x-llmserve-cache"] for r in streamed] == ["hit", "hit"]
    assert events(streamed[1]) == events(streamed[0])
    assert _streamed_text(path, events(streamed[0])) == _text(path, first.json())
    assert server.stats().num_steps == steps  # no engine step for any hit


def _text(path: str, body: dict) -> list[str]:
    if path == "/generate":
        return [body["generated_text"]]
    return [c["message"]["content"] if "message" in c else c["text"] for c in body["choices"]]


def _streamed_text(path: str, evs: list) -> list[str]:
    if path == "/generate":
        return ["".join(e["token"]["text"] for e in evs if "token" in e)]
    texts: dict[int, str] = {}
    for e in evs[:-1]:
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + (c["delta"].get("content", "") if "delta" in c else c["text"])
    return [texts[i] for i in sorted(texts)]


def test_stream_from_a_miss_and_its_replay_are_the_same_events(server):
    plain = {"prompt": "naïve ñandú", "max_tokens": 16, "temperature": 0}
    text = post(server.url, "/v1/completions", {**plain, "cache": False}).json()["choices"][0]["text"]
    stop = text[len(text) // 2 :][:2]  # a stop string that the greedy output reaches mid-way
    body = {**plain, "stop": [stop], "stream": True, "stream_options": {"include_usage": True}, "logprobs": 1}
    miss, hit = post(server.url, "/v1/completions", body), post(server.url, "/v1/completions", body)
    assert (miss.headers["x-llmserve-cache"], hit.headers["x-llmserve-cache"]) == ("miss", "hit")
    assert events(hit) == events(miss) and events(hit)[-1] == "[DONE]"
    final = next(e for e in events(hit)[:-1] if e["choices"] and e["choices"][0]["finish_reason"])
    assert (final["choices"][0]["finish_reason"], final["choices"][0]["stop_reason"]) == ("stop", stop)
    assert events(hit)[-2]["usage"]["completion_tokens"] > 0  # usage reported as usual


@pytest.mark.parametrize(
    "extra",
    [{"temperature": 0.8}, {"temperature": 0, "cache": False}, {"temperature": 0, "n": 2}],
    ids=["sampled-without-seed", "opted-out", "n=2"],
)
def test_requests_that_are_not_cacheable_always_run(server, extra):
    body = {"prompt": "Not cached", "max_tokens": 6, **extra}
    before = server.ctx.response_cache_stats.hits
    steps = server.stats().num_steps
    for _ in range(2):
        assert post(server.url, "/v1/completions", body).headers["x-llmserve-cache"] == "miss"
    assert server.ctx.response_cache_stats.hits == before
    assert server.stats().num_steps > steps


def test_operator_can_turn_the_response_cache_off(tiny_model):
    with live_server(tiny_model, response_cache=False) as s:
        body = {"prompt": "Hello there", "max_tokens": 4, "temperature": 0}
        assert [post(s.url, "/v1/completions", body).headers["x-llmserve-cache"] for _ in range(2)] == ["miss", "miss"]
        stats = httpx.get(s.url + "/stats", timeout=10).json()["response_cache"]
        assert not stats["enabled"] and stats["hits"] == 0


def test_stats_route_reports_the_response_cache(server):
    body = {"prompt": "Stats please", "max_tokens": 3, "temperature": 0}
    before = httpx.get(server.url + "/stats", timeout=10).json()["response_cache"]
    post(server.url, "/v1/completions", body)
    post(server.url, "/v1/completions", body)
    after = httpx.get(server.url + "/stats", timeout=10).json()
    rc = after["response_cache"]
    assert rc["backend"] == "memory" and rc["hits"] == before["hits"] + 1 and rc["misses"] == before["misses"] + 1
    assert rc["stored"] == before["stored"] + 1 and after["engine"]["num_steps"] > 0


def test_local_prefix_cache_serves_a_shared_prefix_exactly(server, tiny_model):
    rng = random.Random(1)
    base = [rng.randrange(3, 1000) for _ in range(512)]
    first, second = base + [11] * 8, base + [12, 13, 14, 15]
    post(server.url, "/generate", {"input_ids": first, "max_tokens": 8, "temperature": 0, "cache": False})
    out = post(server.url, "/generate", {"input_ids": second, "max_tokens": 8, "temperature": 0, "cache": False}).json()
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= 496
    with torch_threads_restored():
        ref = LLM(tiny_model, dtype="float32", num_threads=1, enable_prefix_caching=False).generate([second], SamplingParams(max_tokens=8, temperature=0))[0]
    assert out["token_ids"] == ref.token_ids and out["generated_text"] == ref.text
