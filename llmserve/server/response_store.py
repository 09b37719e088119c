"""Stored /v1/responses (`store: true`, OpenAI's default): GET and DELETE /v1/responses/{id} read
them, and `previous_response_id` continues the conversation one holds.

A StoredResponse holds the response object as GET returns it, and the conversation up to and
including it: every earlier turn's input items and output items, then this turn's, as Responses
API items. The next turn's prompt is rendered from that list plus its own input, exactly as if
the client had sent the whole list itself (previous instructions are not carried over, as
OpenAI). Values are llmserve.cache.records (tagged msgpack, CRC-checked); one that does not decode
is absent.

Backends: in process, an LRU bounded by count (--response-store-size) and bytes
(--response-store-bytes), or Redis under --redis-url, so that replicas share conversations;
entries expire after --response-cache-ttl either way. Writes finish before the response that
made them is answered, so a follow-up turn always finds its predecessor. A Redis that does not
answer a read or a delete is a 503 (StoreUnavailableError), not a 404: the response may exist.
"""

from __future__ import annotations

import logging
from typing import Any

from llmserve.cache import records
from llmserve.cache.response_cache import InMemoryLRU, RedisResponseStore, ResponseCacheStats

logger = logging.getLogger("llmserve.server")
KEY_PREFIX = "llmserve:responses:"


class StoredResponse(records.Record, tag="stored-response/2"):
    response: dict[str, Any]  # the response object, as GET /v1/responses/{id} answers
    conversation: list[dict[str, Any]]  # Responses API items, oldest first, this turn's output last


def _json_only(value: Any) -> bool:
    """Only what JSON holds (msgpack also carries bytes, extension types and non-string keys)."""
    if isinstance(value, dict):
        return all(isinstance(k, str) and _json_only(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_json_only(v) for v in value)
    return value is None or isinstance(value, str | int | float | bool)


class ResponseStore:
    def __init__(self, ttl_s: int, max_entries: int, max_bytes: int, redis: RedisResponseStore | None = None):
        self.ttl_s = ttl_s
        self.redis = redis
        self.local = InMemoryLRU(max_bytes, max_entries=max_entries) if redis is None else None

    async def get(self, response_id: str) -> StoredResponse | None:
        key = KEY_PREFIX + response_id
        raw = self.local.get(key) if self.local is not None else await self.redis.get(key, strict=True)  # type: ignore[union-attr]
        if raw is None:
            return None
        record = records.decode(raw, StoredResponse)
        try:
            ok = record is not None and _json_only(record.response) and _json_only(record.conversation)
        except RecursionError:
            ok = False
        if not ok:
            logger.warning("stored response %s does not decode; treated as absent", response_id)
            return None
        return record

    async def put(self, response_id: str, record: StoredResponse) -> bool:
        """False when it could not be kept (larger than the bound, or Redis failed)."""
        key, value = KEY_PREFIX + response_id, records.encode(record)
        if self.local is not None:
            return self.local.set(key, value, self.ttl_s)
        return await self.redis.set(key, value, self.ttl_s)  # type: ignore[union-attr]

    async def delete(self, response_id: str) -> bool:
        key = KEY_PREFIX + response_id
        return self.local.delete(key) if self.local is not None else await self.redis.delete(key, strict=True)  # type: ignore[union-attr]

    async def close(self) -> None:
        if self.redis is not None:
            await self.redis.close()


def make_response_store(ttl_s: int, max_entries: int, max_bytes: int, redis_url: str | None, timeout_s: float) -> ResponseStore:
    redis = RedisResponseStore(redis_url, ResponseCacheStats(), timeout_s) if redis_url else None
    return ResponseStore(ttl_s, max_entries, max_bytes, redis)
