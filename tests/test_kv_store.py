"""RedisKVStore against a real redis-server: a prefix is streamed back as several MGETs in
flight, only its leading run of present blocks is returned, and a fetch cut off by a timeout
never leaves stale replies on a pooled connection."""

from __future__ import annotations

import time

import pytest
import torch

from llmserve.cache import kv_store
from llmserve.cache.kv_store import RedisKVStore

pytestmark = pytest.mark.redis
SHAPE = (2, 2, 4, 2, 8)  # [layers, K/V, block_size, kv_heads, head_dim]: 1 KiB in float32


def blocks(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=g) for _ in range(n)]


def hashes(n: int, tag: str) -> list[bytes]:
    return [f"{tag}-{i}".encode().ljust(16, b".") for i in range(n)]


@pytest.fixture
def store(redis_server, monkeypatch):
    monkeypatch.setattr(kv_store, "FETCH_BYTES", 1)  # one block per MGET: many requests in flight
    s = RedisKVStore(redis_server.url, "test", SHAPE, torch.float32, timeout_s=0.05)
    yield s
    s.close()


def put_all(store: RedisKVStore, hs: list[bytes], kvs: list[torch.Tensor]) -> None:
    for h, kv in zip(hs, kvs, strict=True):
        store.put(h, kv)
    deadline = time.monotonic() + 10
    while store.stats.blocks_written < len(hs) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.stats.blocks_written == len(hs)


def test_a_prefix_streams_back_in_order_up_to_the_first_missing_block(store):
    hs, kvs = hashes(12, "stream"), blocks(12, seed=1)
    put_all(store, hs[:7] + hs[8:], kvs[:7] + kvs[8:])  # block 7 is missing
    got = store.fetch(hs)
    assert len(got) == 7 and store.stats.blocks_read == 7
    assert all(torch.equal(a, b) for a, b in zip(got, kvs[:7], strict=True))


def test_a_timed_out_fetch_leaves_no_stale_reply_behind(store, redis_server):
    hs, kvs = hashes(6, "stale"), blocks(6, seed=2)
    put_all(store, hs, kvs)
    admin = redis_server.client()
    admin.execute_command("CLIENT", "PAUSE", 1000, "ALL")  # Redis answers nothing for 1 s, past the budget
    t = time.monotonic()
    assert store.fetch(hs) == []  # past its budget: a miss, counted, never an exception
    assert store.budget_s(store.block_bytes) <= time.monotonic() - t < 0.9 and store.stats.errors == 1
    time.sleep(1.0 - (time.monotonic() - t) + 0.1)  # the pause is over: the cut-off MGETs' replies are sent now
    store.breaker.open_until = 0.0  # skip the cooldown instead of sleeping through it
    got = store.fetch(hs[3:])  # the same pooled connection would read the paused fetch's replies
    assert len(got) == 3 and all(torch.equal(a, b) for a, b in zip(got, kvs[3:], strict=True))


def test_a_fetch_cut_short_leaves_no_reply_behind_and_a_load_lands_in_its_blocks(store):
    """A fetch that stops at a missing block while later MGETs are in flight (one block each)
    hands back no connection with replies pending: the next fetch reads its own blocks. The
    connector copies each run as it arrives into the blocks reserved for it, in order."""
    hs, kvs = hashes(10, "cut"), blocks(10, seed=3)
    put_all(store, hs[:2] + hs[3:], kvs[:2] + kvs[3:])  # block 2 is missing; 3.. follow it
    assert len(store.fetch(hs)) == 2
    got = store.fetch(hs[3:])
    assert len(got) == 7 and all(torch.equal(a, b) for a, b in zip(got, kvs[3:], strict=True))
    layers, num_blocks = SHAPE[0], 16
    caches = [torch.zeros(2, num_blocks, *SHAPE[2:]) for _ in range(layers)]
    connector = kv_store.KVConnector(store, caches)
    try:
        ids = [9, 4, 12, 1, 7, 3, 15]  # reserved blocks come in any order
        assert connector._load(hs[3:], ids) == 7
        for kv, block_id in zip(kvs[3:], ids, strict=True):
            assert all(torch.equal(caches[layer][:, block_id], kv[layer]) for layer in range(layers))
        untouched = sorted(set(range(num_blocks)) - set(ids))
        assert all(not caches[layer][:, untouched].any() for layer in range(layers))
    finally:
        connector.close()
