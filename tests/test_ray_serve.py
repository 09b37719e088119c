"""`llmserve serve --ray` on a local Ray cluster: 2 engine replicas of the tiny model behind the
ingress, through Ray Serve's HTTP proxy.

The cluster is started by this test process (ray.init); each application is a real
`llmserve serve --ray --ray-address ...` subprocess, so the command's own start-up and teardown
run too. The first test deploys Ray's default router for comparison; the rest share one
application with the prefix-aware router.
"""

from __future__ import annotations

import contextlib
import json
import random
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import openai
import pytest
import ray
from ray import serve
from redis_fixture import free_port
from server_harness import ServerProcess, offline_llm, server_process, sse_data, wait_for

from llmserve.sampling import SamplingParams

pytestmark = pytest.mark.timeout(600)

GROUPS, PER_GROUP = 4, 5
PREFIX_TOKENS, SUFFIX_TOKENS = 80, 8  # 5 full blocks of 16 shared, then each request's own tokens


@dataclass
class Cluster:
    address: str
    port: int  # Serve's HTTP proxy: one per cluster, so every application here uses it


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, object_store_memory=100 << 20)
    try:
        yield Cluster(ray.get_runtime_context().gcs_address, free_port())
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()


@contextlib.contextmanager
def ray_app(cluster: Cluster, model: str, log_dir, *args: str) -> Iterator[ServerProcess]:
    """`llmserve serve --ray` with 2 engine replicas, up once both post their stats."""
    with server_process(model, log_dir / "ray.log", "--ray", "--ray-address", cluster.address, "--num-replicas", "2",
                        "--replica-cpus", "1", "--kv-cache-memory", str(32 << 20), *args,
                        port=cluster.port, timeout_s=240) as app:
        wait_for(lambda: len(stats(app)["replicas"]) == 2, 60, "both replicas posted their stats", interval=0.2)
        yield app


@pytest.fixture(scope="module")
def app(cluster, tiny_model, tmp_path_factory) -> Iterator[ServerProcess]:
    with ray_app(cluster, tiny_model, tmp_path_factory.mktemp("ray-prefix"), "--request-router", "prefix",
                 "--shutdown-timeout", "0.5") as a:
        yield a


def stats(app: ServerProcess) -> dict:
    return httpx.get(app.url + "/stats", timeout=10).json()


def complete(url: str, prompt, **kw) -> dict:
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, **kw}
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def prefix_groups(app: ServerProcess) -> dict[str, dict]:
    """Send 4 groups of 5 prompts (token ids) sharing a group prefix, one request per group at
    a time; each replica's prefix-cache (queries, hits) gained, once every lookup has posted."""
    rng = random.Random(7)
    prefixes = [[rng.randrange(10, 1000) for _ in range(PREFIX_TOKENS)] for _ in range(GROUPS)]
    before = stats(app)["replicas"]
    with ThreadPoolExecutor(GROUPS) as pool:
        for _ in range(PER_GROUP):
            rounds = [p + [rng.randrange(10, 1000) for _ in range(SUFFIX_TOKENS)] for p in prefixes]
            list(pool.map(lambda prompt: complete(app.url, prompt), rounds))
    queried = GROUPS * PER_GROUP * (PREFIX_TOKENS + SUFFIX_TOKENS)

    def gained() -> dict[str, dict]:
        now = stats(app)["replicas"]
        return {r: {k: s[k] - before.get(r, {}).get(k, 0) for k in ("prefix_cache_queries", "prefix_cache_hits")}
                for r, s in now.items()}

    wait_for(lambda: sum(g["prefix_cache_queries"] for g in gained().values()) == queried, 10,
             "every prompt's lookup posted", interval=0.2)
    return gained()


# every request after a group's first finds the group's 5 blocks: the most hits there can be
MOST_HITS = GROUPS * (PER_GROUP - 1) * PREFIX_TOKENS


def test_default_router_splits_prefix_groups(cluster, tiny_model, tmp_path):
    with ray_app(cluster, tiny_model, tmp_path, "--request-router", "default") as app:
        gained = prefix_groups(app)
    hits = sum(g["prefix_cache_hits"] for g in gained.values())
    assert hits < MOST_HITS, gained  # groups land on both replicas: each replica's first request misses
    assert all(g["prefix_cache_queries"] > 0 for g in gained.values()), gained  # both replicas served


def test_prefix_router_keeps_each_group_on_one_replica(app):
    gained = prefix_groups(app)
    assert sum(g["prefix_cache_hits"] for g in gained.values()) == MOST_HITS, gained
    assert all(g["prefix_cache_queries"] > 0 for g in gained.values()), gained  # the groups spread over both


def test_openai_client_through_the_proxy_matches_offline(app, tiny_model):
    prompts = ["Hello there", "The river town", "café au lait", "one two three four"]
    with offline_llm(tiny_model) as llm:
        refs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0))
    client = openai.OpenAI(base_url=app.url + "/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    for prompt, ref in zip(prompts, refs, strict=True):
        r = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, logprobs=0,
                                      extra_body={"return_tokens_as_token_ids": True})
        assert [int(t.removeprefix("token_id:")) for t in r.choices[0].logprobs.tokens] == ref.token_ids
        assert r.choices[0].text == ref.text and r.choices[0].finish_reason == ref.finish_reason
        chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                                extra_body={"cache": False}))
        assert "".join(c.choices[0].text for c in chunks) == ref.text
        assert chunks[-1].choices[0].finish_reason == ref.finish_reason
    # n samples: n engine requests, each routed on its own
    r = client.completions.create(model=model, prompt=prompts[0], max_tokens=12, temperature=0, n=3, extra_body={"cache": False})
    assert [c.text for c in r.choices] == [refs[0].text] * 3
    # the replicas' engine steps reach the ingress's metrics
    wait_for(lambda: steps_observed(app) >= 12, 10, "the step-time histogram counts the replicas' steps", interval=0.2)


def steps_observed(app: ServerProcess) -> float:
    metrics = httpx.get(app.url + "/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("llmserve:step_duration_seconds_count"))


def test_disconnect_frees_blocks_in_the_replica(app):
    def running() -> dict[str, tuple[int, int]]:
        return {r: (s["num_running"], s["num_blocks_used"]) for r, s in stats(app)["replicas"].items()}

    body = {"prompt": "a long story", "max_tokens": 900, "ignore_eos": True, "stream": True, "temperature": 0}
    with httpx.stream("POST", app.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert sse_data(next(lines) for _ in range(4))
        wait_for(lambda: any(n == 1 and used > 0 for n, used in running().values()), 10,
                 "the stream runs in a replica", interval=0.1)
        wait_for(lambda: sorted(e["num_reqs"] for e in httpx.get(app.url + "/get_load").json()) == [0, 1], 5,
                 "/get_load lists both replicas, one running the stream", interval=0.1)
    wait_for(lambda: all(v == (0, 0) for v in running().values()), 10, "the replica freed the request's blocks",
             interval=0.1)


def test_a_dead_replica_fails_only_its_streams_and_comes_back(app):
    """8 live streams; one replica's actor is killed: every stream ends (finish_reason or an error
    event) within 10 s, the next 10 requests succeed, and Ray starts a new replica."""
    ends: list[str | None] = [None] * 8
    first = [threading.Event() for _ in ends]

    def stream(i: int) -> None:
        body = {"prompt": f"story number {i}", "max_tokens": 700, "ignore_eos": True, "stream": True, "temperature": 0}
        with httpx.stream("POST", app.url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                first[i].set()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    ends[i] = "error"
                elif event["choices"][0]["finish_reason"]:
                    ends[i] = event["choices"][0]["finish_reason"]

    engines = [a for a in ray.util.list_named_actors(all_namespaces=True) if "#Engine#" in a["name"]]
    assert len(engines) == 2, engines
    victim = engines[0]["name"].rsplit("#", 1)[1]
    actor = ray.get_actor(engines[0]["name"], namespace=engines[0]["namespace"])
    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(ends))]
    for t in threads:
        t.start()
    assert all(e.wait(30) for e in first)
    ray.kill(actor, no_restart=True)
    killed = time.monotonic()
    for t in threads:
        t.join(max(0.0, killed + 10 - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a stream did not end within 10 s of the kill"
    print("streams ended", time.monotonic() - killed, "s after the kill:", ends)
    assert "error" in ends and all(e in ("error", "length") for e in ends), ends  # pow2 put streams on both

    for i in range(10):
        complete(app.url, f"after the failure {i}", max_tokens=3)
    wait_for(lambda: len(stats(app)["replicas"]) == 2 and victim not in stats(app)["replicas"], 90,
             "Ray started a new replica", interval=0.5)


def test_sigterm_drains_every_stream_then_exits(app):
    """The last test of the application: SIGTERM lets streams run --shutdown-timeout (0.5 s),
    then each choice ends with finish_reason "abort" and the stream with [DONE]."""
    body = {"prompt": "to the end", "max_tokens": 1000, "ignore_eos": True, "stream": True, "n": 16, "temperature": 0}
    finish: dict[int, str] = {}
    with httpx.stream("POST", app.url + "/v1/completions", json=body, timeout=30) as r:
        data = (line[5:].strip() for line in r.iter_lines() if line.startswith("data:"))
        assert json.loads(next(data))["choices"]
        app.proc.terminate()
        events = list(data)
    assert events[-1] == "[DONE]"
    for event in map(json.loads, events[:-1]):
        for choice in event["choices"]:
            if choice["finish_reason"]:
                finish[choice["index"]] = choice["finish_reason"]
    assert finish == {i: "abort" for i in range(16)}
    assert app.proc.wait(30) == 0


def test_replica_stats_add_up():
    from llmserve.engine.outputs import EngineStats
    from llmserve.ray_serve.board import sum_stats

    a = EngineStats(2, 1, 100, 60, 40, 0.4, 500, 300, 0, 10, kv_store={"hits": 3}, spec_decode={"accepted_length_counts": [1, 2]})
    b = EngineStats(1, 0, 100, 90, 10, 0.1, 200, 50, 1, 20, kv_store={"hits": 4, "misses": 1},
                    spec_decode={"accepted_length_counts": [5, 0, 7]})
    empty = EngineStats.idle()
    total = sum_stats([a, b], [], empty)
    assert (total.num_running, total.num_waiting, total.num_blocks_total, total.num_blocks_used) == (3, 1, 200, 50)
    assert total.kv_cache_usage == 0.25 and (total.prefix_cache_queries, total.prefix_cache_hits) == (700, 350)
    assert total.kv_store == {"hits": 7, "misses": 1}
    assert total.spec_decode == {"accepted_length_counts": [6, 2, 7]}
    # b's replica has gone: its counters still count, its load does not
    after = sum_stats([a], [b], empty)
    assert (after.num_running, after.num_blocks_total, after.num_blocks_used) == (2, 100, 40)
    assert (after.prefix_cache_queries, after.prefix_cache_hits, after.num_steps) == (700, 350, 30)
    assert after.kv_store == {"hits": 7, "misses": 1}
    assert sum_stats([], [], empty) is empty


def test_application_settings():
    from llmserve.config import EngineConfig, RayConfig, ServerConfig
    from llmserve.errors import InvalidRequestError
    from llmserve.ray_serve.app import PREFIX_ROUTER, build_application

    def engine_deployment(**ray_options):
        app = build_application(EngineConfig(max_num_seqs=8), ServerConfig(), RayConfig(**ray_options))
        return app._bound_deployment.init_args[0]._bound_deployment

    scaled = engine_deployment(min_replicas=1, max_replicas=3, replica_cpus=2)
    auto = scaled._deployment_config.autoscaling_config
    assert (auto.min_replicas, auto.max_replicas, auto.target_ongoing_requests) == (1, 3, 16)
    assert scaled.ray_actor_options["num_cpus"] == 2 and scaled.init_args[0].num_threads == 2
    assert scaled.max_ongoing_requests == 16
    fixed = engine_deployment(num_replicas=3, request_router="default")
    assert fixed.num_replicas == 3 and fixed._deployment_config.request_router_config.request_router_class != PREFIX_ROUTER
    prefix = engine_deployment()._deployment_config.request_router_config
    assert prefix.request_router_class == PREFIX_ROUTER and prefix.request_router_kwargs["imbalance"] == 32
    for bad in ({"min_replicas": 1}, {"min_replicas": 3, "max_replicas": 2}, {"num_replicas": 0}, {"replica_cpus": 0}):
        with pytest.raises(InvalidRequestError):
            build_application(EngineConfig(), ServerConfig(), RayConfig(**bad))
