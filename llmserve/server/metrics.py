"""Prometheus metrics of one server (GET /metrics, text format), in a registry of their own.

Feeds: `on_step(event)` runs on the server's loop per StepEvent (a step listener on the door:
outputs, the stats after them, engine steps' durations) and observes only what the event alone
carries (tokens, finished requests, step times); `on_rejected()` per 429; `render()` reads the
latest engine stats once per scrape (gauges, and the cumulative counts behind the counters),
counts the response cache's hits/misses/errors since the last scrape (ResponseCacheStats, the
cache's own tally; the semantic cache's likewise), and serializes. The semantic cache times each
embedding into a histogram itself.

What is observed when:
- generation tokens: every step, as tokens are emitted; prompt tokens: when a request's first
  token is emitted (its prefill is done);
- per finished request (its Timeline, copied on the finished output -> RequestTimings): TTFT and
  every ITL (aborted requests too), and for stop/length only: e2e, queue, prefill, decode,
  request_success{finish_reason}; aborted requests count in request_aborted_total;
- step duration: once per engine step;
- preemptions, prefix-cache queries/hits (in tokens), KV-store blocks and errors, response-cache
  hits/misses/errors: deltas of cumulative stats at each scrape, so the counters stay monotonic.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from llmserve.cache.response_cache import ResponseCacheStats
from llmserve.engine.client import EngineClient, EngineStats, RequestOutput, StepEvent
from llmserve.profiling import timings_of

logger = logging.getLogger("llmserve.metrics")

# The `*_created` timestamp series only add noise to a scrape (the switch is process-wide).
disable_created_metrics()

# 1 ms .. 60 s
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
           1.0, 1.5, 2.0, 2.5, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)
FINISH_REASONS = ("stop", "length")
CACHES = ("response", "kv_store", "semantic")
# cumulative EngineStats fields, the keys the KV store reports in EngineStats.kv_store (its
# contract: cumulative counts under these names) and ResponseCacheStats fields -> our counter
ENGINE_COUNTERS = {"num_preemptions": "preemptions", "prefix_cache_queries": "prefix_queries", "prefix_cache_hits": "prefix_hits"}
KV_STORE_COUNTERS = {"blocks_read": "kv_store_read", "blocks_written": "kv_store_written", "errors": "kv_store_errors"}
# EngineStats.spec_decode (speculative decoding) -> our counter
SPEC_COUNTERS = {"num_drafts": "spec_drafts", "num_draft_tokens": "spec_draft_tokens", "num_accepted_tokens": "spec_accepted_tokens"}
RESPONSE_CACHE_COUNTERS = {"hits": "response_cache_hits", "misses": "response_cache_misses", "errors": "response_cache_errors"}
SEMANTIC_CACHE_COUNTERS = {"hits": "semantic_cache_hits", "misses": "semantic_cache_misses", "errors": "semantic_cache_errors"}
TallySource = Callable[[], Any]  # a cache's cumulative tally (ResponseCacheStats, SemanticCacheStats)


class ServerMetrics:
    def __init__(self, stats_source: Callable[[], EngineStats] | None = None,
                 response_cache_source: Callable[[], ResponseCacheStats] | None = None):
        """stats_source: the engine's latest stats (for gauges, and the counters' baseline);
        response_cache_source: the response cache's cumulative tally."""
        self.registry = r = CollectorRegistry()
        self.stats_source = stats_source
        self.tallies: dict[str, tuple[TallySource, dict[str, str]]] = {}  # name -> (source, field -> counter)
        if response_cache_source is not None:
            self.tallies["response_cache"] = (response_cache_source, RESPONSE_CACHE_COUNTERS)

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(f"llmserve:{name}", doc, buckets=BUCKETS, registry=r)

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(f"llmserve:{name}", doc, labels, registry=r)  # exposed as llmserve:{name}_total

        self.ttft = hist("time_to_first_token_seconds", "Arrival to first token.")
        self.itl = hist("inter_token_latency_seconds", "Gap between consecutive tokens of a request.")
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish, finished (stop/length) requests.")
        self.queue = hist("request_queue_time_seconds", "Arrival to first scheduled.")
        self.prefill = hist("request_prefill_time_seconds", "First scheduled to first token.")
        self.decode = hist("request_decode_time_seconds", "First token to finish.")
        self.step = hist("step_duration_seconds", "One engine step (schedule, run, update).")

        self.running = Gauge("llmserve:num_requests_running", "Requests in the running batch.", registry=r)
        self.waiting = Gauge("llmserve:num_requests_waiting", "Requests waiting for the engine.", registry=r)
        self.by_priority = {state: Gauge(f"llmserve:num_requests_{state}_by_priority",
                                         f"Requests {state}, per priority (--scheduling-policy priority).", ("priority",), registry=r)
                            for state in ("running", "waiting")}
        self.lora_info = Gauge("llmserve:lora_requests_info", "LoRA adapters of the running and waiting requests (--enable-lora; "
                               "the value is the time of the reading, as vLLM's)",
                               ("running_lora_adapters", "waiting_lora_adapters", "max_lora"), registry=r)
        self.kv_usage = Gauge("llmserve:kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).", registry=r)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests whose prefill finished.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.success = counter("request_success", "Requests finished by stop or length.", ("finish_reason",))
        self.rejected = counter("request_rejected", "Requests refused because the server was overloaded (429).")
        self.aborted = counter("request_aborted", "Requests aborted (client gone, shutdown).")
        self.preemptions = counter("num_preemptions", "Requests preempted to free KV cache.")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        # caches at the edges (response cache in front of the engine, KV store behind it)
        self.response_cache_hits = counter("response_cache_hits", "Response cache hits.")
        self.response_cache_misses = counter("response_cache_misses", "Response cache misses (eligible requests).")
        self.semantic_cache_hits = counter("semantic_cache_hits", "Requests answered with the answer to the same question in other words.")
        self.semantic_cache_misses = counter("semantic_cache_misses", "Semantic cache lookups not answered (after an exact miss).")
        self.embedding = hist("semantic_cache_embedding_seconds", "Embedding one question for the semantic cache.")
        self.kv_store_read = counter("kv_store_blocks_read", "KV blocks read from the KV store.")
        self.spec_drafts = counter("spec_decode_num_drafts", "Decode rows verified with draft tokens (speculative decoding).")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.spec_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        r.register(_AcceptanceLength(lambda: self.stats_source() if self.stats_source else None))
        self.kv_store_written = counter("kv_store_blocks_written", "KV blocks written to the KV store.")
        self.cache_errors = counter("cache_errors", "Cache backend errors (the request went on without it).", ("cache",))
        for reason in FINISH_REASONS:
            self.success.labels(reason)
        for cache in CACHES:
            self.cache_errors.labels(cache)
        self.kv_store_errors = self.cache_errors.labels("kv_store")
        self.response_cache_errors = self.cache_errors.labels("response")
        self.semantic_cache_errors = self.cache_errors.labels("semantic")

        self._last: dict[str, int] = {}  # cumulative counts at the last scrape
        self._latest: EngineStats | None = None  # the last step event's (when there is no stats_source)
        self._baseline(stats_source() if stats_source else None)

    def _baseline(self, stats: EngineStats | None) -> None:
        """Count only what happens from now on (an engine may have run before we watch it)."""
        self._last = {f: getattr(stats, f, 0) for f in ENGINE_COUNTERS}
        self._last |= {k: stats.kv_store.get(k, 0) if stats else 0 for k in KV_STORE_COUNTERS}
        self._last |= {f"spec.{k}": stats.spec_decode.get(k, 0) if stats else 0 for k in SPEC_COUNTERS}
        for name, (source, counters) in self.tallies.items():
            tally = source()
            self._last |= {f"{name}.{k}": getattr(tally, k) for k in counters}

    def attach(self, client: EngineClient, stats_source: Callable[[], EngineStats],
               response_cache_source: Callable[[], ResponseCacheStats] | None = None,
               semantic_cache_source: TallySource | None = None) -> None:
        """Observe the engine behind `client` (a step listener), its latest stats, and the caches' tallies."""
        self.stats_source = stats_source
        for name, source, counters in (("response_cache", response_cache_source, RESPONSE_CACHE_COUNTERS),
                                       ("semantic_cache", semantic_cache_source, SEMANTIC_CACHE_COUNTERS)):
            if source is not None:
                self.tallies[name] = (source, counters)
        self._baseline(stats_source())
        client.add_step_listener(self.on_step)

    # ---- feeds -------------------------------------------------------------------------------

    def on_step(self, event: StepEvent) -> None:
        """Per step event (outputs, the stats after them, engine steps' durations): O(outputs),
        one counter update per kind; the stats are read at the next scrape. A metrics fault is
        logged, never raised into the caller."""
        try:
            self._observe_step(event.outputs, event.step_durations)
            self._latest = event.stats
        except Exception:
            logger.exception("metrics: observing a step failed")

    def _observe_step(self, outputs: list[RequestOutput], step_durations: list[float]) -> None:
        """Tokens, finished requests, step time."""
        generated = prompt = 0
        for o in outputs:
            n_new = len(o.new_token_ids)
            if n_new:
                generated += n_new
                if o.num_output_tokens == n_new:
                    prompt += o.num_prompt_tokens
            if o.finished:
                self._on_finished(o)
        if generated:
            self.generation_tokens.inc(generated)
        if prompt:
            self.prompt_tokens.inc(prompt)
        for d in step_durations:
            self.step.observe(d)

    def _observe_stats(self, stats: EngineStats) -> None:
        """Stat deltas since the last scrape (cumulative engine, KV-store, speculative counts)."""
        for field_name, attr in ENGINE_COUNTERS.items():
            self._inc_delta(field_name, getattr(stats, field_name), attr)
        for key, attr in KV_STORE_COUNTERS.items():
            self._inc_delta(key, stats.kv_store.get(key, 0), attr)
        for key, attr in SPEC_COUNTERS.items():
            self._inc_delta(f"spec.{key}", stats.spec_decode.get(key, 0), attr)

    def _on_finished(self, o: RequestOutput) -> None:
        if o.timeline is None:
            return
        t = timings_of(o.timeline)
        if t.ttft_s is not None:
            self.ttft.observe(t.ttft_s)
        for gap in t.itl_s:
            self.itl.observe(gap)
        if o.finish_reason not in FINISH_REASONS:
            self.aborted.inc()
            return
        self.success.labels(o.finish_reason).inc()
        for hist, value in ((self.e2e, t.e2e_s), (self.queue, t.queue_s), (self.prefill, t.prefill_s), (self.decode, t.decode_s)):
            if value is not None:
                hist.observe(value)

    def _inc_delta(self, key: str, value: int, attr: str) -> None:
        delta = value - self._last[key]
        self._last[key] = value
        if delta > 0:  # a reset engine-side (never expected) must not make a counter go back
            getattr(self, attr).inc(delta)

    def on_rejected(self) -> None:
        self.rejected.inc()

    def _observe_tallies(self) -> None:
        for name, (source, counters) in self.tallies.items():
            tally = source()
            for key, attr in counters.items():
                self._inc_delta(f"{name}.{key}", getattr(tally, key), attr)

    # ---- exposition --------------------------------------------------------------------------

    def _set_gauges(self, stats: EngineStats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        for i, gauge in enumerate(self.by_priority.values()):
            gauge.clear()
            for priority, counts in stats.by_priority.items():
                gauge.labels(priority).set(counts[i])
        self.lora_info.clear()
        if stats.lora:
            lora = stats.lora
            self.lora_info.labels(",".join(lora["running"]), ",".join(lora["waiting"]), str(lora["max_lora"])).set(time.time())

    def render(self) -> tuple[bytes, str]:
        """(body, content type) of the Prometheus text format, gauges and counters refreshed
        from the latest stats first."""
        stats = self.stats_source() if self.stats_source is not None else self._latest
        if stats is not None:
            self._observe_stats(stats)
            self._set_gauges(stats)
        self._observe_tallies()
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def route(self, path: str = "/metrics") -> Route:
        async def metrics(request: Request) -> Response:
            body, content_type = self.render()
            return Response(body, media_type=content_type)

        return Route(path, metrics, methods=["GET"])


class _AcceptanceLength(Collector):
    """llmserve:spec_decode_acceptance_length: drafts accepted per verified decode row, a
    histogram built at each scrape from the engine's cumulative counts (one bucket per length)."""

    def __init__(self, stats_source: Callable[[], EngineStats | None]):
        self.stats_source = stats_source

    def collect(self) -> Any:
        stats = self.stats_source()
        counts = stats.spec_decode.get("accepted_length_counts", []) if stats is not None else []
        buckets, total = [], 0
        for length, n in enumerate(counts):
            total += n
            buckets.append((str(length), total))
        yield HistogramMetricFamily("llmserve:spec_decode_acceptance_length", "Draft tokens accepted per verified decode row.",
                                    buckets=[*buckets, ("+Inf", total)], sum_value=sum(i * n for i, n in enumerate(counts)))

    def describe(self) -> Any:
        return []
