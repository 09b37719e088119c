"""Response cache pieces without a server: the in-process LRU's byte bound, LRU order and TTL;
the record codec refusing anything corrupt, truncated, of another version or key, or off-schema;
the key's sensitivity; the counters; and a dead Redis costing a fast miss, then no call at all."""

from __future__ import annotations

import asyncio
import time
import zlib

import msgspec
import pytest
from redis_fixture import free_port

from llmserve.cache import records
from llmserve.cache.response_cache import (
    CachedChoice,
    CachedStep,
    InMemoryLRU,
    RedisResponseStore,
    ResponseCache,
    ResponseCacheStats,
    ResponseRecord,
    cache_key,
    decode_record,
)
from llmserve.engine.outputs import TokenLogprobs
from llmserve.sampling import SamplingParams

KEY = cache_key("fp", [[1, 2, 3]], SamplingParams(temperature=0).canonical())


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def record(key: str = KEY) -> ResponseRecord:
    steps = [CachedStep([5], "hi", [TokenLogprobs(5, -0.25, [(5, -0.25), (7, -1.5)])]),
             CachedStep([9], " there", [TokenLogprobs(9, float("-inf"), [])])]
    return ResponseRecord(key, [CachedChoice(steps, "stop", 9, 16, [None, TokenLogprobs(2, -3.0, [])])])


def test_lru_never_exceeds_its_byte_bound():
    lru = InMemoryLRU(max_bytes=1000)
    for i in range(200):
        assert lru.set(f"k{i}", bytes(37 + i % 50), ttl_s=60)
        assert lru.nbytes <= 1000
        assert lru.nbytes == sum(len(k) + len(v) for k, (_, v) in lru.entries.items())
    assert 0 < len(lru) < 200 and lru.evictions == 200 - len(lru)
    assert lru.get("k199") is not None and lru.get("k0") is None  # newest kept, oldest evicted


def test_lru_evicts_least_recently_used_and_refuses_oversized_entries():
    lru = InMemoryLRU(max_bytes=3 * 12)
    for k in ("a", "b", "c"):
        lru.set(k, bytes(11), 60)
    assert lru.get("a") is not None  # a is now the most recently used
    lru.set("d", bytes(11), 60)
    assert lru.get("b") is None and lru.get("a") is not None and lru.get("c") is not None
    assert not lru.set("huge", bytes(100), 60) and lru.get("huge") is None
    lru.set("a", bytes(5), 60)  # replacing a key re-counts its bytes
    assert lru.nbytes == 12 + 12 + 6


def test_lru_entries_expire_after_their_ttl():
    clock = FakeClock()
    lru = InMemoryLRU(max_bytes=1000, clock=clock)
    lru.set("a", b"x", ttl_s=10)
    clock.t += 9.9
    assert lru.get("a") == b"x"
    clock.t += 0.2
    assert lru.get("a") is None and lru.nbytes == 0


def test_record_round_trips_exactly():
    assert decode_record(records.encode(record()), KEY) == record()


def _sealed(body: object) -> bytes:
    """A value with a valid CRC around `body` (msgpack of any object): what only the schema can refuse."""
    return _sealed_bytes(msgspec.msgpack.encode(body))


def _sealed_bytes(raw: bytes) -> bytes:
    """A valid CRC around a body given as raw bytes (not necessarily msgpack)."""
    return msgspec.msgpack.encode([zlib.crc32(raw), raw])


def _choice(token_ids: list, finish_reason: str = "stop", *extra: object) -> list:
    return [[[token_ids, "", []]], finish_reason, None, 0, None, *extra]


class OlderRecord(records.Record, tag="response/1"):  # the same fields, another version
    key: str
    choices: list[CachedChoice]


@pytest.mark.parametrize(
    "mangle",
    [
        lambda raw: raw[: len(raw) // 2],  # truncated
        lambda raw: raw[:-3] + bytes([raw[-3] ^ 0x20]) + raw[-2:],  # one payload byte flipped
        lambda raw: b"",
        lambda raw: b"\x80\x04\x95pickle",  # not ours
        lambda raw: records.encode(OlderRecord(KEY, record().choices)),
        lambda raw: records.encode(record("llmserve:resp:other")),
        lambda raw: _sealed_bytes(b"\xc1"),  # the body is not msgpack
        lambda raw: records.encode(ResponseRecord(KEY, [])),  # no choice
        lambda raw: _sealed(["response/2", KEY, [_choice(["5"])]]),
        lambda raw: _sealed(["response/2", KEY, [_choice([5], "abort")]]),
        lambda raw: _sealed(["response/2", KEY, [_choice([5], "stop", 1)]]),  # an extra field
        lambda raw: _sealed(["response/2", KEY, [_choice([True])]]),
        lambda raw: _sealed(["response/2", KEY]),  # a missing field
        lambda raw: _sealed(["response/2", KEY, [[[], "stop", None, 0, None]]]),  # a choice without steps
        lambda raw: _sealed_bytes(b"\x91" * 100_000 + b"\xc0"),  # arrays nested past any sane depth
    ],
)
def test_bad_values_are_refused(mangle):
    raw = records.encode(record())
    assert decode_record(mangle(raw), KEY) is None


def test_a_valid_record_written_by_hand_is_accepted():
    rec = decode_record(_sealed(["response/2", KEY, [[[[[5], "x", [[5, -0.5, [[5, -0.5]]]]]], "length", None, 0, None]]]), KEY)
    assert rec is not None and rec.choices[0].steps[0].text == "x"
    assert rec.choices[0].steps[0].logprobs == [TokenLogprobs(5, -0.5, [(5, -0.5)])]


def test_key_depends_on_everything_that_changes_the_output():
    greedy = SamplingParams(temperature=0, max_tokens=8).canonical()
    base = cache_key("fp", [[1, 2, 3]], greedy, score_only=False)
    assert base == cache_key("fp", [[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=8).canonical(), score_only=False)
    others = [
        cache_key("fp2", [[1, 2, 3]], greedy, score_only=False),
        cache_key("fp", [[1, 2, 4]], greedy, score_only=False),
        cache_key("fp", [[1, 2], [3]], greedy, score_only=False),
        cache_key("fp", [[1, 2, 3]], SamplingParams(temperature=0, max_tokens=9).canonical(), score_only=False),
        cache_key("fp", [[1, 2, 3]], SamplingParams(temperature=0, max_tokens=8, logprobs=1).canonical(), score_only=False),
        cache_key("fp", [[1, 2, 3]], SamplingParams(temperature=0, max_tokens=8, stop=["x"]).canonical(), score_only=False),
        cache_key("fp", [[1, 2, 3]], SamplingParams(temperature=0, max_tokens=8, logit_bias={3: 1.0}).canonical(), score_only=False),
        cache_key("fp", [[1, 2, 3]], greedy, score_only=True),
    ]
    assert len({base, *others}) == len(others) + 1


def test_lookup_counts_hits_misses_and_rejected_values():
    cache = ResponseCache(ttl_s=60, max_bytes=1 << 20)

    async def main() -> None:
        assert await cache.lookup(KEY, 1) is None
        cache.store(record())
        assert await cache.lookup(KEY, 1) == record()
        assert await cache.lookup(KEY, 2) is None  # a record for another number of prompts
        cache.local.set(KEY, b"garbage", 60)  # type: ignore[union-attr]
        assert await cache.lookup(KEY, 1) is None

    asyncio.run(main())
    assert cache.stats == ResponseCacheStats(hits=1, misses=3, errors=0, rejected=2, stored=1)


def test_a_dead_redis_is_a_fast_miss_then_skipped_by_the_breaker():
    stats = ResponseCacheStats()

    async def main() -> list[float]:
        store = RedisResponseStore(f"redis://127.0.0.1:{free_port()}/0", stats, timeout_s=0.05)
        cache = ResponseCache(ttl_s=60, max_bytes=1 << 20, redis=store)
        times = []
        for _ in range(3):
            t = time.perf_counter()
            assert await cache.lookup(KEY, 1) is None
            times.append(time.perf_counter() - t)
        cache.store(record())  # skipped: the breaker is open
        await cache.close()
        assert store.breaker.is_open
        return times

    times = asyncio.run(main())
    assert stats.errors == 1 and stats.misses == 3 and stats.stored == 0  # one failed call, then none
    assert max(times) < 1.0  # generous: a refused connection must not hang a request
