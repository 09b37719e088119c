"""The endpoints sglang-router and vllm-router probe: /get_model_info, /get_server_info and
/get_load, over a real server with an API key."""

from __future__ import annotations

import httpx
import pytest
from server_harness import live_server, wait_for

from llmserve.server.router_probe import _without_password

KEY = "probe-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def keyed(tiny_model):
    with live_server(tiny_model, api_key=KEY, max_num_seqs=8) as s:
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
        assert r.status_code == 200 and KEY not in r.text
        body = r.json()
        assert body["dp_size"] == 1 and body["max_running_requests"] == 8
        assert body["max_total_num_tokens"] == info.num_kv_blocks * info.block_size
        assert body["internal_states"][0]["num_blocks_total"] == info.num_kv_blocks


def test_load_follows_the_running_requests_without_a_key(keyed):
    def load() -> dict:
        [engine] = httpx.get(keyed.url + "/get_load").json()
        return engine

    assert load() == {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}
    body = {"prompt": "a long story", "max_tokens": 600, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", keyed.url + "/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        next(r.iter_lines())
        wait_for(lambda: load()["num_reqs"] == 1 and load()["num_tokens"] > 0, 10, "the stream counts as load")
        as_object = httpx.get(keyed.url + "/get_load", params={"format": "object"}).json()
        assert as_object["load"] == 1 and as_object["num_tokens"] % keyed.ctx.client.info.block_size == 0
    wait_for(lambda: load()["num_reqs"] == 0, 10, "the load drops when the client leaves")
    r = httpx.get(keyed.url + "/get_load", params={"format": "csv"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "format"


def test_server_info_hides_a_redis_password():
    assert _without_password("redis://user:pw@10.0.0.1:6380/0") == "redis://user:***@10.0.0.1:6380/0"
    assert _without_password("redis://:pw@cache/1") == "redis://:***@cache/1"
    assert _without_password("redis://cache:6379/0") == "redis://cache:6379/0"
