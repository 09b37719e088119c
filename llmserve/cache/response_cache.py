"""Whole-response cache in front of the engine: a deterministic request (temperature 0 or a fixed
seed, n == 1) asked again is answered without the engine.

Key: llmserve:resp:<blake2b-128 hex> of the model fingerprint, the prompts' token ids (after
templating), the canonical sampling parameters and whatever else shapes the engine's output.
Value: a ResponseRecord (llmserve.cache.records: tagged msgpack, CRC-checked; never pickle),
the engine's raw outputs step by step (token ids, text delta, logprobs) per choice, with its own
key, so a hit is formatted (and streamed) by the same code as a miss; options that only change
formatting (echo text, logprob token names) need not be in the key. A value that does not decode
as this version's record for this key is ignored and counted as rejected, never loaded.
Backends: InMemoryLRU (the default: bounded in bytes, with a TTL) or RedisResponseStore
(redis.asyncio and its connection pool, shared by replicas). A Redis call times out fast (50 ms
by default) and a circuit breaker skips a dead Redis; a failed or skipped call is a miss.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal

import msgspec

from llmserve.cache import records
from llmserve.cache.breaker import CircuitBreaker
from llmserve.engine.outputs import TokenLogprobs
from llmserve.errors import StoreUnavailableError

logger = logging.getLogger("llmserve.cache")
VERSION = 2  # of the key material and of ResponseRecord's tag
KEY_PREFIX = "llmserve:resp:"


@dataclass(slots=True)
class ResponseCacheStats:
    hits: int = 0
    misses: int = 0  # eligible lookups not answered (absent, rejected, Redis down)
    errors: int = 0  # backend calls that failed or timed out
    rejected: int = 0  # values found but corrupt, truncated, of another version or key
    stored: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class CachedStep(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """One engine output (a RequestOutput's delta)."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs]


class CachedChoice(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    steps: list[CachedStep]  # the last one finished the choice
    finish_reason: Literal["stop", "length"]
    stop_reason: int | str | None
    num_cached_tokens: int
    prompt_logprobs: list[TokenLogprobs | None] | None  # when the request asked for them (echo)


class ResponseRecord(records.Record, tag=f"response/{VERSION}"):
    key: str  # the cache key it was stored under
    choices: list[CachedChoice]  # one per prompt, in order


def cache_key(fingerprint: str, prompts: list[list[int]], params: dict[str, Any], **options: Any) -> str:
    """params: SamplingParams.canonical(); options: anything else that changes the output."""
    material = {"v": VERSION, "model": fingerprint, "prompts": prompts, "params": params, "options": options}
    blob = json.dumps(material, sort_keys=True, separators=(",", ":"))
    return KEY_PREFIX + hashlib.blake2b(blob.encode(), digest_size=16).hexdigest()


def decode_record(raw: bytes, key: str) -> ResponseRecord | None:
    """The record stored under `key`, or None if anything about the value is off."""
    record = records.decode(raw, ResponseRecord)
    if record is None or record.key != key or not record.choices or any(not c.steps for c in record.choices):
        return None
    return record


class InMemoryLRU:
    """key -> bytes, least recently used evicted first, sum(len(key) + len(value)) <= max_bytes
    and at most max_entries entries; an entry expires ttl_s after it was set. Not thread-safe (the
    server's event loop owns it)."""

    def __init__(self, max_bytes: int, clock: Callable[[], float] = time.monotonic, max_entries: int | None = None):
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.clock = clock
        self.entries: OrderedDict[str, tuple[float, bytes]] = OrderedDict()  # key -> (expires, value)
        self.nbytes = 0
        self.evictions = 0

    def get(self, key: str) -> bytes | None:
        item = self.entries.get(key)
        if item is None:
            return None
        if self.clock() >= item[0]:
            self._drop(key)
            return None
        self.entries.move_to_end(key)
        return item[1]

    def set(self, key: str, value: bytes, ttl_s: float) -> bool:
        """False (nothing stored) when the entry alone exceeds the bound."""
        size = len(key) + len(value)
        if size > self.max_bytes or self.max_entries == 0:
            return False
        if key in self.entries:
            self._drop(key)
        while self.nbytes + size > self.max_bytes or (self.max_entries is not None and len(self.entries) >= self.max_entries):
            self._drop(next(iter(self.entries)))
            self.evictions += 1
        self.entries[key] = (self.clock() + ttl_s, value)
        self.nbytes += size
        return True

    def delete(self, key: str) -> bool:
        """False when there is no such entry (or it expired)."""
        if self.get(key) is None:
            return False
        self._drop(key)
        return True

    def _drop(self, key: str) -> None:
        _, value = self.entries.pop(key)
        self.nbytes -= len(key) + len(value)

    def __len__(self) -> int:
        return len(self.entries)


def _unavailable(strict: bool, why: str) -> None:
    if strict:
        raise StoreUnavailableError(f"Redis did not answer ({why}); try again later")
    return None


class RedisResponseStore:
    """GET/SET on a shared Redis; every call bounded by timeout_s, skipped while the breaker is
    open; failures are counted in stats.errors and return None."""

    def __init__(self, url: str, stats: ResponseCacheStats, timeout_s: float = 0.05):
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        self.client = aioredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0)
        )
        self.stats = stats
        self.timeout_s = timeout_s
        self.breaker = CircuitBreaker("response-cache")

    async def get(self, key: str, strict: bool = False) -> bytes | None:
        return await self._call(lambda: self.client.get(key), strict)

    async def set(self, key: str, value: bytes, ttl_s: int) -> bool:
        return bool(await self._call(lambda: self.client.set(key, value, ex=ttl_s)))

    async def delete(self, key: str, strict: bool = False) -> bool:
        return bool(await self._call(lambda: self.client.delete(key), strict))

    async def _call(self, op: Callable[[], Awaitable[Any]], strict: bool = False) -> Any:
        """op's result; on a failure (or an open breaker) None, or with `strict`
        StoreUnavailableError: where an absent value would be a wrong answer, not a miss."""
        if not self.breaker.allow():
            return _unavailable(strict, "the circuit breaker is open")
        try:
            async with asyncio.timeout(self.timeout_s):
                result = await op()
        except Exception as e:  # redis-py raises many kinds (connection, protocol); and timeouts
            self.stats.errors += 1
            self.breaker.failure(e)
            return _unavailable(strict, type(e).__name__)
        self.breaker.success()
        return result

    async def close(self) -> None:
        try:
            async with asyncio.timeout(1.0):
                await self.client.aclose()
        except Exception as e:  # closing a dead connection must not fail shutdown
            logger.debug("closing the response cache's Redis client: %s", e)


class ResponseCache:
    """lookup / store of ResponseRecords over one backend (local LRU, or Redis when given)."""

    def __init__(self, ttl_s: int, max_bytes: int, redis: RedisResponseStore | None = None):
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes  # also the largest record stored in Redis
        self.redis = redis
        self.stats = redis.stats if redis is not None else ResponseCacheStats()
        self.local = InMemoryLRU(max_bytes) if redis is None else None
        self._writes: set[asyncio.Task] = set()  # Redis writes in flight (strong references)

    async def lookup(self, key: str, num_choices: int) -> ResponseRecord | None:
        record = await self.get(key, num_choices)
        if record is None:
            self.stats.misses += 1
        else:
            self.stats.hits += 1
        return record

    async def get(self, key: str, num_choices: int) -> ResponseRecord | None:
        """The record under `key` (None if absent or unusable), without counting a hit or miss."""
        raw = self.local.get(key) if self.local is not None else await self.redis.get(key)  # type: ignore[union-attr]
        record = decode_record(raw, key) if raw is not None else None
        if raw is not None and (record is None or len(record.choices) != num_choices):
            self.stats.rejected += 1
            return None
        return record

    def store(self, record: ResponseRecord) -> None:
        """Local: at once. Redis: written behind by a task; the response does not wait for it."""
        key = record.key
        try:
            value = records.encode(record)
        except (msgspec.EncodeError, ValueError, TypeError) as e:  # a bug, not a fault of the request: serve it anyway
            self.stats.errors += 1
            logger.warning("response cache: could not encode a record: %s", e)
            return
        if self.local is not None:
            self.stats.stored += self.local.set(key, value, self.ttl_s)
        elif len(value) + len(key) <= self.max_bytes:
            task = asyncio.get_running_loop().create_task(self._write(key, value))
            self._writes.add(task)
            task.add_done_callback(self._writes.discard)

    async def _write(self, key: str, value: bytes) -> None:
        if await self.redis.set(key, value, self.ttl_s):  # type: ignore[union-attr]
            self.stats.stored += 1

    async def close(self) -> None:
        if self._writes:
            await asyncio.wait(self._writes, timeout=1.0)
        if self.redis is not None:
            await self.redis.close()


def make_response_cache(enabled: bool, ttl_s: int, max_bytes: int, redis_url: str | None,
                        timeout_s: float = 0.05) -> ResponseCache | None:
    """None when disabled (--no-response-cache); Redis when a URL is given, else in process."""
    if not enabled:
        return None
    redis = RedisResponseStore(redis_url, ResponseCacheStats(), timeout_s) if redis_url else None
    return ResponseCache(ttl_s, max_bytes, redis)
