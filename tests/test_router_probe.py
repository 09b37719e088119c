"""The endpoints sglang-router and vllm-router probe: /get_model_info, /get_server_info and
/get_load, over a real server with an API key."""

from __future__ import annotations

import dataclasses

import httpx
import pytest
from server_harness import live_server

from llmserve.server.router_probe import _without_password

KEY = "probe-secret"
REDIS_PASSWORD = "redis-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def keyed(tiny_model):
    # a Redis that is not there (every call a miss): /get_server_info must not show its password
    with live_server(tiny_model, api_key=KEY, max_num_seqs=8, redis_url=f"redis://:{REDIS_PASSWORD}@127.0.0.1:9/0") as s:
        yield s


def test_model_and_server_info(keyed):
    info = keyed.ctx.client.info
    for path in ("/get_model_info", "/model_info"):
        assert httpx.get(keyed.url + path).status_code == 401
        body = httpx.get(keyed.url + path, headers=AUTH).json()
        assert body["model_path"] == body["tokenizer_path"] == info.model_dir
        assert body["is_generation"] is True and body["served_model_name"] == keyed.model
    for path in ("/get_server_info", "/server_info"):
        r = httpx.get(keyed.url + path, headers=AUTH)
        assert r.status_code == 200 and KEY not in r.text and REDIS_PASSWORD not in r.text
        assert r.json()["redis_url"] == "redis://:***@127.0.0.1:9/0"
        body = r.json()
        assert body["dp_size"] == 1 and body["max_running_requests"] == 8
        assert body["max_total_num_tokens"] == info.num_kv_blocks * info.block_size
        assert body["internal_states"][0]["num_blocks_total"] == info.num_kv_blocks
        plan = body["execution_plan"]  # the engine's execution plan, each choice with its reason
        assert plan["dtype"] == {"value": "float32", "reason": "asked for"}
        assert plan["kv_cache_dtype"]["value"] == "float32" and plan["compile"]["value"] == "none"
        assert set(plan) >= {"attention_backend", "cpu_isa", "linear_backend"} and all(c["reason"] for c in plan.values())


def test_load_reports_the_engine_without_a_key(keyed):
    assert httpx.get(keyed.url + "/get_load").json() == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
    idle = keyed.ctx.stats
    try:  # the engine's figures as of a busy step (the tiny model finishes any request in milliseconds)
        keyed.ctx.stats = dataclasses.replace(idle, num_running=5, num_waiting=2, num_blocks_used=7)
        [engine] = httpx.get(keyed.url + "/get_load").json()
        as_object = httpx.get(keyed.url + "/get_load", params={"format": "object"}).json()
    finally:
        keyed.ctx.stats = idle
    block = keyed.ctx.client.info.block_size
    assert engine == {"dp_rank": 0, "num_reqs": 7, "num_waiting_reqs": 2, "num_tokens": 7 * block}
    assert as_object == {"load": 7, "num_waiting_reqs": 2, "num_tokens": 7 * block}
    r = httpx.get(keyed.url + "/get_load", params={"format": "csv"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "format"


def test_server_info_hides_a_redis_password():
    assert _without_password("redis://user:pw@10.0.0.1:6380/0") == "redis://user:***@10.0.0.1:6380/0"
    assert _without_password("redis://:pw@[::1]:6379/1") == "redis://:***@[::1]:6379/1"
    assert _without_password("redis://cache/0?password=pw&socket_timeout=1") == "redis://cache/0?password=***&socket_timeout=1"
    assert _without_password("redis://cache:6379/0") == "redis://cache:6379/0"
