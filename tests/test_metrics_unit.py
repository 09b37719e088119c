"""ServerMetrics driven by a real LLMEngine on the tiny model (the outputs, stats and step times a
StepEvent carries), read back through the text format."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmserve.cache.response_cache import ResponseCacheStats
from llmserve.config import EngineConfig, from_sources
from llmserve.engine.llm_engine import LLMEngine
from llmserve.engine.outputs import StepEvent
from llmserve.sampling import SamplingParams
from llmserve.server.metrics import ServerMetrics

HISTOGRAMS = [
    "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
    "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
    "step_duration_seconds",
]
COUNTERS = [
    "prompt_tokens", "generation_tokens", "request_success", "request_rejected", "request_aborted",
    "num_preemptions", "prefix_cache_queries", "prefix_cache_hits", "response_cache_hits",
    "response_cache_misses", "kv_store_blocks_read", "kv_store_blocks_written", "cache_errors",
]


def scrape(metrics: ServerMetrics) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels without `le`): value}, plus bucket samples keyed with `le`."""
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


@pytest.fixture(scope="module")
def engine(tiny_model):
    return LLMEngine(from_sources(EngineConfig, env={}, dtype="float32", model=tiny_model, num_threads=1, max_num_batched_tokens=64))


def run(engine: LLMEngine, metrics: ServerMetrics, prompts: list[list[int]], params: list[SamplingParams], abort: frozenset[int] = frozenset()):
    reqs = [engine.add_request(f"r{engine.num_steps}-{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
    for i in abort:
        engine.abort_request(reqs[i].request_id)
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            break
        steps = engine.num_steps
        outputs = engine.step()
        durations = [engine.step_records[-1].duration_s] if engine.num_steps > steps else []
        metrics.on_step(StepEvent(outputs, engine.get_stats(), durations))
    assert not engine.has_unfinished_requests()
    return reqs


def test_counters_and_histograms_follow_the_requests(engine):
    metrics = ServerMetrics(engine.get_stats)
    before = scrape(metrics)
    for name in HISTOGRAMS:
        assert before[(f"llmserve:{name}_count", ())] == 0
    for name in COUNTERS:
        assert any(k[0] == f"llmserve:{name}_total" for k in before), name
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert (f"llmserve:{name}", ()) in before

    n, out_len = 6, 5
    # 4 run to their length, 2 stop early on a stop token (min_tokens keeps them going a little)
    prompts = [[(7 * i + j) % 900 + 10 for j in range(20 + 3 * i)] for i in range(n)]
    params = [SamplingParams(max_tokens=out_len, ignore_eos=True, temperature=0.0) for _ in range(4)]
    reqs = run(engine, metrics, prompts[:4], params)
    stop_tok = reqs[0].output_token_ids[2]  # greedy: the same prompt produces it again at position 3
    stop = SamplingParams(max_tokens=out_len, ignore_eos=True, temperature=0.0, stop_token_ids=[stop_tok])
    reqs += run(engine, metrics, [prompts[0], prompts[0]], [stop, stop])
    m = scrape(metrics)

    reasons = [r.finish_reason for r in reqs]
    assert reasons.count("length") == 4 and reasons.count("stop") == 2
    assert m[("llmserve:request_success_total", (("finish_reason", "length"),))] == 4
    assert m[("llmserve:request_success_total", (("finish_reason", "stop"),))] == 2
    assert m[("llmserve:prompt_tokens_total", ())] == sum(r.num_prompt_tokens for r in reqs)
    n_out = sum(len(r.output_token_ids) for r in reqs)
    assert n_out == 4 * out_len + 2 * 3
    assert m[("llmserve:generation_tokens_total", ())] == n_out
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds"):
        assert m[(f"llmserve:{name}_count", ())] == n, name
        assert m[(f"llmserve:{name}_bucket", (("le", "+Inf"),))] == n
    assert m[("llmserve:inter_token_latency_seconds_count", ())] == n_out - n
    assert m[("llmserve:step_duration_seconds_count", ())] == engine.num_steps
    # the repeated prompt hits the prefix cache: counters equal the engine's own totals (tokens)
    stats = engine.get_stats()
    assert m[("llmserve:prefix_cache_hits_total", ())] == stats.prefix_cache_hits > 0
    assert m[("llmserve:prefix_cache_queries_total", ())] == stats.prefix_cache_queries
    assert m[("llmserve:num_requests_running", ())] == 0
    assert m[("llmserve:num_requests_waiting", ())] == 0
    assert m[("llmserve:kv_cache_usage_perc", ())] == 0
    assert m[("llmserve:request_aborted_total", ())] == 0


def test_aborts_rejections_and_cache_events(engine):
    cache = ResponseCacheStats(hits=5, misses=3, errors=1)  # before: not counted
    metrics = ServerMetrics(engine.get_stats, lambda: cache)  # created mid-life: counts only what happens from now
    prompts = [[11 + i] * 24 for i in range(3)]
    params = [SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)] * 3
    run(engine, metrics, prompts, params, abort={1})
    metrics.on_rejected()
    metrics.on_rejected()
    cache.hits, cache.misses, cache.errors = cache.hits + 1, cache.misses + 1, cache.errors + 2
    m = scrape(metrics)
    assert m[("llmserve:request_aborted_total", ())] == 1
    assert m[("llmserve:request_success_total", (("finish_reason", "length"),))] == 2
    assert m[("llmserve:e2e_request_latency_seconds_count", ())] == 2
    assert m[("llmserve:generation_tokens_total", ())] == 8
    assert m[("llmserve:prompt_tokens_total", ())] == 48
    assert m[("llmserve:request_rejected_total", ())] == 2
    assert m[("llmserve:response_cache_hits_total", ())] == 1
    assert m[("llmserve:response_cache_misses_total", ())] == 1
    assert m[("llmserve:cache_errors_total", (("cache", "response"),))] == 2
    assert m[("llmserve:cache_errors_total", (("cache", "kv_store"),))] == 0
    assert scrape(metrics)[("llmserve:response_cache_hits_total", ())] == 1  # a second scrape adds nothing


def test_preemptions_are_counted_as_deltas(tiny_model):
    # a cache of 6 usable blocks x 16 tokens cannot hold three 40-token sequences at once
    engine = LLMEngine(from_sources(EngineConfig, env={}, dtype="float32", model=tiny_model, num_threads=1, num_blocks=7, max_num_batched_tokens=128))
    metrics = ServerMetrics(engine.get_stats)
    params = [SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)] * 3
    reqs = run(engine, metrics, [[50 + i] * 16 for i in range(3)], params)
    assert engine.get_stats().num_preemptions > 0
    m = scrape(metrics)
    assert m[("llmserve:num_preemptions_total", ())] == engine.get_stats().num_preemptions
    assert m[("llmserve:request_success_total", (("finish_reason", "length"),))] == 3
    assert m[("llmserve:generation_tokens_total", ())] == sum(len(r.output_token_ids) for r in reqs) == 72
    assert m[("llmserve:prompt_tokens_total", ())] == 48  # once per request, however often it was recomputed


def test_requests_per_priority_are_gauges(tiny_model):
    engine = LLMEngine(from_sources(EngineConfig, env={}, dtype="float32", model=tiny_model, num_threads=1, max_num_seqs=2,
                                    scheduling_policy="priority"))
    metrics = ServerMetrics(engine.get_stats)
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
    for i, priority in enumerate((3, 3, -1, 3)):
        engine.add_request(f"p{i}", [7 + i] * 5, params, priority=priority)
    engine.step()  # two run: the -1 and the first 3
    m = scrape(metrics)
    gauge = "llmserve:num_requests_{}_by_priority"
    assert m[(gauge.format("running"), (("priority", "-1"),))] == 1
    assert m[(gauge.format("running"), (("priority", "3"),))] == 1
    assert m[(gauge.format("waiting"), (("priority", "3"),))] == 2
    assert m[(gauge.format("waiting"), (("priority", "-1"),))] == 0
    while engine.has_unfinished_requests():
        engine.step()
    assert not any(name.endswith("_by_priority") for name, _ in scrape(metrics))  # nothing left: no series
