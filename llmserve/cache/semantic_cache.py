"""Semantic response cache: a request that asks what an earlier one asked, in other words, gets
the earlier answer (opt-in: --semantic-cache).

Only the question is compared: the last user message (chat) or the prompt (completions). The rest
of the request must be identical, so it is hashed into the entry's `scope`: the model fingerprint,
the canonical sampling parameters, the earlier turns, system prompt and tools, the endpoint.
A hit needs, within one scope, both
  - cosine(embedding(question), embedding(cached question)) >= threshold, and
  - the same key terms (llmserve.cache.key_terms: "capital of France" is not "capital of Germany",
    however close their embeddings are).
An entry points at the exact response cache's key of the answer it stands for; the answer itself
lives there (in process or in Redis), so a semantic hit is replayed like an exact one.

Storage: VectorIndex, in process, a ring of `capacity` unit vectors [capacity, 384] float32 with
brute-force top-k per lookup; entries expire after the response cache's TTL. With --redis-url,
entries are not added locally but published to one Redis stream (STREAM, trimmed to about
`capacity`); every replica, this one included, follows the stream from its start, so a replica
that starts late loads what the others stored. Debian's Redis has no vector search: the search
stays local. Stream records are SemanticRecords (llmserve.cache.records: tagged msgpack,
CRC-checked; never pickle).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from llmserve.cache import records
from llmserve.cache.breaker import CircuitBreaker
from llmserve.cache.key_terms import KeyTerms, key_terms, same_question

logger = logging.getLogger("llmserve.cache")
STREAM = "llmserve:sem:entries"
TOP_K = 8  # candidates above the threshold checked for the same key terms, best first
FOLLOW_BLOCK_MS = 1000


@dataclass(slots=True)
class SemanticCacheStats:
    hits: int = 0
    misses: int = 0  # eligible lookups not answered
    errors: int = 0  # embedding or Redis calls that failed
    rejected: int = 0  # stream records that were corrupt or of another version
    stored: int = 0  # entries added to the index (on this replica, from any replica)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(slots=True)
class SemanticQuery:
    """What a route hands the cache: the question, and the rest of the request that must match."""

    text: str
    context: dict[str, Any]  # JSON-able: earlier turns, system prompt, tools, endpoint


@dataclass(slots=True)
class SemanticEntry:
    scope: str
    text: str
    response_key: str  # the exact response cache's key of the answer
    expires: float  # time.time() after which the entry is ignored
    vector: np.ndarray  # [dim] float32, unit length


@dataclass(slots=True)
class SemanticMatch:
    entry: SemanticEntry
    similarity: float


class SemanticRecord(records.Record, tag="semantic/2"):
    scope: str
    text: str
    response_key: str
    expires: float
    vector: memoryview  # little-endian float32


def encode_entry(e: SemanticEntry) -> bytes:
    vec = np.ascontiguousarray(e.vector, dtype="<f4")
    return records.encode(SemanticRecord(e.scope, e.text, e.response_key, e.expires, memoryview(vec).cast("B")))


def decode_entry(raw: bytes) -> SemanticEntry | None:
    """The entry, or None if anything about the record is off."""
    r = records.decode(raw, SemanticRecord)
    if r is None or not r.vector.nbytes or r.vector.nbytes % 4:
        return None
    vector = np.frombuffer(r.vector, dtype="<f4").astype(np.float32)
    return SemanticEntry(r.scope, r.text, r.response_key, r.expires, vector)


def _scope_id(scope: str) -> int:
    return int.from_bytes(hashlib.blake2b(scope.encode(), digest_size=8).digest(), "little")


class VectorIndex:
    """A ring of at most `capacity` entries (the oldest overwritten first); one entry per
    (scope, text). Lives on the server's event loop (no locking)."""

    def __init__(self, capacity: int, dim: int):
        self.capacity = capacity
        self.vectors = np.zeros((capacity, dim), np.float32)
        self.scope_ids = np.zeros(capacity, np.uint64)
        self.expires = np.zeros(capacity, np.float64)  # 0: an empty slot
        self.entries: list[SemanticEntry | None] = [None] * capacity
        self.terms: list[KeyTerms | None] = [None] * capacity
        self.slots: dict[tuple[str, str], int] = {}  # (scope, text) -> slot
        self.next = 0

    def __len__(self) -> int:
        return len(self.slots)

    def add(self, e: SemanticEntry, terms: KeyTerms | None = None) -> None:
        """terms: key_terms(e.text), when the caller has them already."""
        slot = self.slots.get((e.scope, e.text))
        if slot is None:
            slot, self.next = self.next, (self.next + 1) % self.capacity
            old = self.entries[slot]
            if old is not None:
                del self.slots[(old.scope, old.text)]
        self.vectors[slot] = e.vector
        self.scope_ids[slot] = _scope_id(e.scope)
        self.expires[slot] = e.expires
        self.entries[slot], self.terms[slot] = e, terms or key_terms(e.text)
        self.slots[(e.scope, e.text)] = slot

    def discard(self, e: SemanticEntry) -> None:
        """Forget an entry whose answer is gone from the response cache."""
        slot = self.slots.get((e.scope, e.text))
        if slot is not None and self.entries[slot] is e:
            del self.slots[(e.scope, e.text)]
            self.entries[slot], self.terms[slot], self.expires[slot] = None, None, 0.0

    def search(self, scope: str, vector: np.ndarray, terms: KeyTerms, threshold: float,
               now: float | None = None) -> SemanticMatch | None:
        """The most similar live entry of `scope` at or above `threshold` with the same key terms."""
        now = time.time() if now is None else now
        sims = self.vectors @ vector
        sims[(self.scope_ids != _scope_id(scope)) | (self.expires <= now)] = -np.inf
        k = min(TOP_K, self.capacity)
        for slot in sorted(np.argpartition(-sims, k - 1)[:k], key=lambda s: -sims[s]):
            if sims[slot] < threshold:
                break
            entry = self.entries[slot]
            if entry is not None and entry.scope == scope and same_question(self.terms[slot], terms):  # type: ignore[arg-type]
                return SemanticMatch(entry, float(sims[slot]))
        return None


class RedisSemanticFeed:
    """Entries shared through one Redis stream: publish() appends (bounded by timeout_s, skipped
    while the breaker is open), follow() reads it from the start into an index, forever."""

    def __init__(self, url: str, stats: SemanticCacheStats, maxlen: int, timeout_s: float = 0.05):
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        def connect(timeout: float) -> Any:
            return aioredis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0))

        self.writer = connect(timeout_s)
        self.reader = connect(FOLLOW_BLOCK_MS / 1000 + 1.0)
        self.stats, self.maxlen, self.timeout_s = stats, maxlen, timeout_s
        self.breaker = CircuitBreaker("semantic-cache")
        self.last_id = "0-0"

    async def publish(self, raw: bytes) -> None:
        if not self.breaker.allow():
            return
        try:
            async with asyncio.timeout(self.timeout_s):
                await self.writer.xadd(STREAM, {"e": raw}, maxlen=self.maxlen, approximate=True)
        except Exception as e:  # connection, protocol, timeout: the entry is lost, the answer was served
            self.stats.errors += 1
            self.breaker.failure(e)
            return
        self.breaker.success()

    async def follow(self, index: VectorIndex) -> None:
        backoff = 0.25
        while True:
            try:
                batches = await self.reader.xread({STREAM: self.last_id}, count=512, block=FOLLOW_BLOCK_MS)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # Redis down: keep what we have, try again later
                self.stats.errors += 1
                logger.debug("semantic cache: reading the stream failed: %s", e)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            backoff = 0.25
            for _, stream_records in batches or []:
                for record_id, fields in stream_records:
                    self.last_id = record_id
                    self._load(index, fields.get(b"e", b""))

    def _load(self, index: VectorIndex, raw: bytes) -> None:
        entry = decode_entry(raw)
        if entry is None or entry.vector.shape[0] != index.vectors.shape[1]:
            self.stats.rejected += 1
        elif entry.expires > time.time():
            index.add(entry)
            self.stats.stored += 1

    async def close(self) -> None:
        for client in (self.writer, self.reader):
            try:
                async with asyncio.timeout(1.0):
                    await client.aclose()
            except Exception as e:  # closing a dead connection must not fail shutdown
                logger.debug("closing the semantic cache's Redis client: %s", e)


@dataclass(slots=True)
class SemanticLookup:
    """One eligible request's lookup: what it will store on a miss."""

    scope: str
    text: str
    vector: np.ndarray | None  # None when embedding failed (nothing is stored)
    terms: KeyTerms
    match: SemanticMatch | None


@dataclass
class SemanticCache:
    """lookup()/store() over a VectorIndex, filled locally or through a RedisSemanticFeed.
    embed: texts -> unit vectors [n, dim] (blocking; run in a worker thread)."""

    embed: Callable[[list[str]], np.ndarray]
    threshold: float
    ttl_s: float
    index: VectorIndex
    feed: RedisSemanticFeed | None = None
    on_embedding: Callable[[float], None] | None = None  # seconds per embedding (a metric)
    stats: SemanticCacheStats = field(default_factory=SemanticCacheStats)
    _tasks: set[asyncio.Task] = field(default_factory=set, init=False)  # Redis writes in flight
    _follower: asyncio.Task | None = field(default=None, init=False)

    def start(self) -> None:
        """On the server's loop: follow the shared stream (with Redis)."""
        if self.feed is not None:
            self._follower = asyncio.get_running_loop().create_task(self.feed.follow(self.index))

    async def lookup(self, scope: str, text: str) -> SemanticLookup:
        vector = await self._embed(text)
        terms = key_terms(text)
        match = None if vector is None else self.index.search(scope, vector, terms, self.threshold)
        if match is None:
            self.stats.misses += 1
        return SemanticLookup(scope, text, vector, terms, match)

    def count_hit(self, hit: bool) -> None:
        """A match only counts as a hit when its answer is still in the response cache."""
        if hit:
            self.stats.hits += 1
        else:
            self.stats.misses += 1

    def discard(self, entry: SemanticEntry) -> None:
        self.index.discard(entry)

    def store(self, lookup: SemanticLookup, response_key: str) -> None:
        if lookup.vector is None:
            return
        entry = SemanticEntry(lookup.scope, lookup.text, response_key, time.time() + self.ttl_s, lookup.vector)
        if self.feed is None:
            self.index.add(entry, lookup.terms)
            self.stats.stored += 1
        else:
            task = asyncio.get_running_loop().create_task(self.feed.publish(encode_entry(entry)))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _embed(self, text: str) -> np.ndarray | None:
        t0 = time.perf_counter()
        try:
            vectors = await asyncio.to_thread(self.embed, [text])
        except Exception:  # the request goes on without the cache
            self.stats.errors += 1
            logger.exception("semantic cache: embedding failed")
            return None
        if self.on_embedding is not None:
            self.on_embedding(time.perf_counter() - t0)
        return vectors[0]

    async def close(self) -> None:
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=1.0)
        if self._follower is not None:
            self._follower.cancel()
            await asyncio.wait([self._follower], timeout=1.0)
        if self.feed is not None:
            await self.feed.close()
