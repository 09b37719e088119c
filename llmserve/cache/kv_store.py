"""Redis tier for prefix KV blocks, keyed by the chained block hash.

Value layout (never pickle; Redis contents are untrusted):
  b"LLMSKV" | u32 little-endian header length | JSON header | raw payload
  header: {"version", "dtype", "shape": [layers, 2, block_size, kv_heads, head_dim], "checksum"}
  payload: the block's K and V for every layer, C order, `checksum` = CRC-32 of it (integrity
  against corruption and truncation; a block is ~1 MB, and CRC-32 runs 4x faster than blake2b).
A value whose magic, version, dtype, shape, length or checksum does not match is ignored and
counted as rejected. Keys: llmserve:kv:<namespace>:<hash hex>; namespace = model fingerprint,
dtype and block size. Writes go behind, from a thread, pipelined in batches; reads are one
pipelined round trip of MGETs of BATCH blocks each, so Redis starts answering at once and no
socket read waits long. Any Redis error or a timeout (default 50 ms per socket operation) counts
as a miss and trips the circuit breaker.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import warnings
import zlib
from dataclasses import asdict, dataclass

import torch

from llmserve.cache.breaker import CircuitBreaker

logger = logging.getLogger("llmserve.cache")
MAGIC = b"LLMSKV"
VERSION = 2
BATCH = 8  # blocks per MGET in a fetch, and per pipelined write (~6 MB of float32 SmolLM2 blocks)


@dataclass(slots=True)
class KVStoreStats:
    blocks_read: int = 0
    blocks_written: int = 0
    blocks_rejected: int = 0
    errors: int = 0
    dropped: int = 0  # writes dropped because the write-behind queue was full

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def encode_block(kv: torch.Tensor) -> bytes:
    """kv: [layers, 2, block_size, kv_heads, head_dim] -> bytes."""
    payload = kv.contiguous().view(torch.uint8).numpy().tobytes()
    header = {"version": VERSION, "dtype": str(kv.dtype).removeprefix("torch."), "shape": list(kv.shape),
              "checksum": zlib.crc32(payload)}
    h = json.dumps(header, separators=(",", ":")).encode()
    return MAGIC + len(h).to_bytes(4, "little") + h + payload


def decode_block(raw: bytes, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """The block tensor, or None if anything about the value is off."""
    try:
        if not raw.startswith(MAGIC):
            return None
        n = int.from_bytes(raw[6:10], "little")
        header = json.loads(raw[10 : 10 + n])
        payload = memoryview(raw)[10 + n :]  # no copy
        ok = (
            header.get("version") == VERSION
            and header.get("dtype") == str(dtype).removeprefix("torch.")
            and tuple(header.get("shape", ())) == tuple(shape)
            and zlib.crc32(payload) == header.get("checksum")
        )
        if not ok:
            return None
        with warnings.catch_warnings():  # a read-only view of `raw`: callers only copy from it
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(payload, dtype=torch.uint8).view(dtype).reshape(shape)
    except (ValueError, RuntimeError, UnicodeDecodeError, AttributeError, TypeError):
        return None


class RedisKVStore:
    def __init__(self, url: str, namespace: str, shape: tuple[int, ...], dtype: torch.dtype,
                 ttl_s: int = 3600, timeout_s: float = 0.05, max_pending: int = 1024):
        import redis

        # reads sit on the engine's critical path and must fail fast; writes run behind, in a thread
        # that a busy engine may starve for a while, so only their connect timeout is short
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.write_client = redis.Redis.from_url(url, socket_timeout=max(1.0, timeout_s), socket_connect_timeout=timeout_s)
        self.prefix = f"llmserve:kv:{namespace}:"
        self.shape, self.dtype, self.ttl_s = shape, dtype, ttl_s
        self.breaker = CircuitBreaker("kv-store")
        self.stats = KVStoreStats()
        self.pending: queue.Queue[tuple[bytes, torch.Tensor] | None] = queue.Queue(max_pending)
        self.writer = threading.Thread(target=self._write_loop, name="llmserve-kv-writer", daemon=True)
        self.writer.start()

    def key(self, block_hash: bytes) -> str:
        return self.prefix + block_hash.hex()

    def put(self, block_hash: bytes, kv: torch.Tensor) -> None:
        """Queue a block (already copied out of the cache) for a write-behind."""
        if not self.breaker.allow():
            return
        try:
            self.pending.put_nowait((block_hash, kv))
        except queue.Full:
            self.stats.dropped += 1

    def fetch(self, hashes: list[bytes]) -> list[torch.Tensor]:
        """The longest run of consecutive valid blocks for `hashes`, in one round trip."""
        if not hashes or not self.breaker.allow():
            return []
        try:
            pipe = self.client.pipeline(transaction=False)
            for i in range(0, len(hashes), BATCH):
                pipe.mget([self.key(h) for h in hashes[i : i + BATCH]])
            raws = [raw for batch in pipe.execute() for raw in batch]
            self.breaker.success()
        except Exception as e:  # redis-py raises many kinds (timeouts, connection, protocol)
            self._error(e)
            return []
        out = []
        for raw in raws:
            if raw is None:
                break
            kv = decode_block(raw, self.shape, self.dtype)
            if kv is None:
                self.stats.blocks_rejected += 1
                break
            out.append(kv)
        self.stats.blocks_read += len(out)
        return out

    def _write_loop(self) -> None:
        while True:
            item = self.pending.get()
            if item is None:
                return
            batch = [item]
            while len(batch) < BATCH and not self.pending.empty():
                nxt = self.pending.get_nowait()
                if nxt is None:
                    return
                batch.append(nxt)
            self._write(batch)

    def _write(self, batch: list[tuple[bytes, torch.Tensor]]) -> None:
        if not self.breaker.allow():
            return
        try:
            pipe = self.write_client.pipeline(transaction=False)
            for h, kv in batch:
                pipe.set(self.key(h), encode_block(kv), ex=self.ttl_s)
            pipe.execute()
            self.breaker.success()
            self.stats.blocks_written += len(batch)
        except Exception as e:
            self._error(e)

    def _error(self, e: Exception) -> None:
        self.stats.errors += 1
        self.breaker.failure(e)

    def flush(self, timeout_s: float = 2.0) -> None:
        """Wait (bounded) until queued writes have been sent; for tests and shutdown."""
        import time

        end = time.monotonic() + timeout_s
        while not self.pending.empty() and time.monotonic() < end:
            time.sleep(0.005)
        time.sleep(0.02)

    def close(self) -> None:
        self.pending.put(None)


class KVTier:
    """Binds a RedisKVStore to the model runner's cache tensors for the block manager."""

    def __init__(self, store: RedisKVStore, kv_caches: list[torch.Tensor]):
        self.store = store
        self.kv_caches = kv_caches  # per layer [2, num_blocks, block_size, kv_heads, head_dim]

    def fetch(self, hashes: list[bytes]) -> list[torch.Tensor]:
        return self.store.fetch(hashes)

    def load(self, block_id: int, kv: torch.Tensor) -> None:
        for layer, cache in enumerate(self.kv_caches):
            cache[:, block_id].copy_(kv[layer])

    def store_block(self, block_id: int, block_hash: bytes) -> None:
        self.store.put(block_hash, torch.stack([c[:, block_id] for c in self.kv_caches]))
