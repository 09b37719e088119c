"""Redis tier for prefix KV blocks, keyed by the chained block hash.

Value: a KVBlockRecord (llmserve.cache.records: tagged msgpack, CRC-32-checked, never pickle;
CRC-32 guards a ~1 MB block against corruption and truncation, 4x faster than blake2b): its
dtype, shape [layers, 2, block_size, kv_heads, head_dim] and the block's K and V for every layer,
C order. A value that does not decode, or whose dtype, shape or length does not match, is
ignored and counted as rejected. Keys: llmserve:kv:<namespace>:<hash hex>; namespace = model
fingerprint, dtype and block size. Writes go behind, from a thread, pipelined in batches of
WRITE_BATCH.

Reads: a prefix is fetched as a stream of MGETs of about FETCH_BYTES each, kept WINDOW deep in
flight on one connection (the next request is sent before the current reply is read). Redis
runs every command already in its input buffer before it writes any reply, so sending all the
MGETs of a 64-block float32 prefix (47 MB) at once held its first byte back 30-50 ms, past the
50 ms timeout; a window of two keeps Redis streaming, each wait bounded by the time Redis takes
to build one ~2 MB reply, and the whole fetch still costs a single round trip of latency plus
transfer time. Fetches run off the step loop (KVConnector, below), within a budget sized by
their bytes (LOAD_LATENCY_S plus the bytes at LOAD_MIN_RATE). Any Redis error or a fetch past its
budget ends the load there (the blocks copied so far stay loaded; the rest is computed) and trips
the circuit breaker.
"""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import threading
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass

import torch

from llmserve.cache import records
from llmserve.cache.breaker import CircuitBreaker

logger = logging.getLogger("llmserve.cache")
WRITE_BATCH = 8  # blocks per pipelined write-behind (~6 MB of float32 SmolLM2 blocks)
FETCH_BYTES = 2 << 20  # payload per MGET in a fetch (at least one block)
WINDOW = 2  # MGETs in flight during a fetch
# A fetch's budget: a latency allowance plus its bytes at a floor rate. Loads run off the step
# loop (KVConnector), so the budget can wait out a slow Redis without stalling a decode.
LOAD_LATENCY_S = 0.5
LOAD_MIN_RATE = 100e6  # bytes/s


@dataclass(slots=True)
class KVStoreStats:
    blocks_read: int = 0
    blocks_written: int = 0
    blocks_rejected: int = 0
    errors: int = 0
    dropped: int = 0  # writes dropped: the write-behind queue was full, Redis was down, or shutdown came first

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class KVBlockRecord(records.Record, tag="kv/3"):
    dtype: str  # a torch dtype's name: "float32", "bfloat16", ...
    shape: list[int]  # [layers, 2, block_size, kv_heads, head_dim]
    payload: memoryview  # the tensor's bytes, C order


def encode_block(kv: torch.Tensor) -> bytes:
    """kv: [layers, 2, block_size, kv_heads, head_dim] -> bytes."""
    payload = memoryview(kv.cpu().contiguous().view(torch.uint8).numpy())
    return records.encode(KVBlockRecord(_dtype_name(kv.dtype), list(kv.shape), payload))


def decode_block(raw: bytes, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """The block tensor (a read-only view of raw: callers only copy from it), or None if anything
    about the value is off."""
    r = records.decode(raw, KVBlockRecord)
    if r is None or r.dtype != _dtype_name(dtype) or tuple(r.shape) != tuple(shape):
        return None
    if r.payload.nbytes != math.prod(shape) * dtype.itemsize:
        return None
    with warnings.catch_warnings():  # torch warns that the buffer is not writable
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(r.payload, dtype=torch.uint8).view(dtype).reshape(shape)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class RedisKVStore:
    def __init__(self, url: str, namespace: str, shape: tuple[int, ...], dtype: torch.dtype,
                 ttl_s: int = 3600, timeout_s: float = 0.05, max_pending: int = 1024):
        import redis

        # reads run in the connector's loader thread, each socket operation bounded by one MGET's
        # budget and the fetch by its own; writes run behind, in a thread that a busy engine may
        # starve for a while. Only the connect timeouts are short.
        self.latency_s = max(timeout_s, LOAD_LATENCY_S)
        self.client = redis.Redis.from_url(url, socket_timeout=self.budget_s(FETCH_BYTES), socket_connect_timeout=timeout_s)
        self.write_client = redis.Redis.from_url(url, socket_timeout=max(1.0, timeout_s), socket_connect_timeout=timeout_s)
        self.prefix = f"llmserve:kv:{namespace}:"
        self.shape, self.dtype, self.ttl_s = shape, dtype, ttl_s
        self.block_bytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        self.breaker = CircuitBreaker("kv-store")
        self.stats = KVStoreStats()
        self.pending: queue.Queue[tuple[bytes, torch.Tensor] | None] = queue.Queue(max_pending)
        self.writer = threading.Thread(target=self._write_loop, name="llmserve-kv-writer", daemon=True)
        self.writer.start()
        self.closed = False

    def budget_s(self, nbytes: int) -> float:
        """How long a fetch of nbytes may take before it counts as a miss."""
        return self.latency_s + nbytes / LOAD_MIN_RATE

    def key(self, block_hash: bytes) -> str:
        return self.prefix + block_hash.hex()

    def put(self, block_hash: bytes, kv: torch.Tensor) -> None:
        """Queue a block (already copied out of the cache) for a write-behind."""
        if self.closed or not self.breaker.allow():
            return
        try:
            self.pending.put_nowait((block_hash, kv))
        except queue.Full:
            self.stats.dropped += 1

    def fetch(self, hashes: list[bytes]) -> list[torch.Tensor]:
        """The longest run of consecutive valid blocks for `hashes`."""
        return [kv for run in self.fetch_runs(hashes) for kv in run]

    def fetch_runs(self, hashes: list[bytes]) -> Iterator[list[torch.Tensor]]:
        """The longest run of consecutive valid blocks for `hashes`, one MGET's worth at a time as
        its reply arrives (MGETs streamed WINDOW deep), so that the caller copies one while Redis
        sends the next. Each block is a read-only view of its reply. A Redis error, or the budget
        running out, ends the run there (counted, never raised)."""
        if not hashes or not self.breaker.allow():
            return
        try:
            with contextlib.closing(self._mget_stream([self.key(h) for h in hashes])) as replies:
                for raws in replies:
                    run = self._decode_run(raws)
                    if run:
                        yield run
                    if len(run) < len(raws):
                        break  # a missing or bad block: what follows it is of no use
            self.breaker.success()
        except Exception as e:  # redis-py raises many kinds (timeouts, connection, protocol)
            self._error(e)

    def _decode_run(self, raws: list[bytes | None]) -> list[torch.Tensor]:
        run = []
        for raw in raws:
            kv = None if raw is None else decode_block(raw, self.shape, self.dtype)
            if kv is None:
                self.stats.blocks_rejected += raw is not None
                break
            run.append(kv)
        self.stats.blocks_read += len(run)
        return run

    def _mget_stream(self, keys: list[str]) -> Iterator[list[bytes | None]]:
        """Each MGET's reply, in order; closed early with replies still in flight, it disconnects
        its connection (they must never reach another fetch). The budget counts the time spent
        waiting on Redis, not the caller's between replies."""
        per = max(1, FETCH_BYTES // self.block_bytes)
        groups = [keys[i : i + per] for i in range(0, len(keys), per)]
        deadline = time.monotonic() + self.budget_s(len(keys) * self.block_bytes)
        pool = self.client.connection_pool
        conn = pool.get_connection()
        sent = read = 0
        try:
            for i in range(len(groups)):
                while sent < min(len(groups), i + WINDOW):
                    conn.send_command("MGET", *groups[sent], check_health=False)  # no PING amid replies
                    sent += 1
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the fetch of {len(keys)} blocks ran past its budget")
                reply = conn.read_response()
                read += 1
                if not isinstance(reply, list) or len(reply) != len(groups[i]):
                    raise ValueError(f"MGET of {len(groups[i])} keys answered with {type(reply).__name__}")
                away = time.monotonic()
                yield reply
                deadline += time.monotonic() - away
        except GeneratorExit:  # the caller stopped early
            if read < sent:
                conn.disconnect()  # replies still in flight: never hand this socket back as is
            raise
        except BaseException:
            conn.disconnect()  # a reply may be half read
            raise
        finally:
            pool.release(conn)

    def _write_loop(self) -> None:
        """Until the None that close() queues: write what is queued, WRITE_BATCH at a time."""
        done = False
        while not done:
            batch: list[tuple[bytes, torch.Tensor]] = []
            item = self.pending.get()
            while item is not None:
                batch.append(item)
                if len(batch) == WRITE_BATCH or self.pending.empty():
                    break
                item = self.pending.get_nowait()
            done = item is None
            if batch:
                self._write(batch)

    def _write(self, batch: list[tuple[bytes, torch.Tensor]]) -> None:
        if not self.breaker.allow():
            self.stats.dropped += len(batch)
            return
        try:
            pipe = self.write_client.pipeline(transaction=False)
            for h, kv in batch:
                pipe.set(self.key(h), encode_block(kv), ex=self.ttl_s)
            pipe.execute()
            self.breaker.success()
            self.stats.blocks_written += len(batch)
        except Exception as e:
            self.stats.dropped += len(batch)
            self._error(e)

    def _error(self, e: Exception) -> None:
        self.stats.errors += 1
        self.breaker.failure(e)

    def close(self, timeout_s: float = 5.0) -> int:
        """Send the queued writes (waiting up to `timeout_s`), then close the connections. Writes
        that fail, or are still queued after that, are dropped, counted and logged. Returns the
        number dropped."""
        if self.closed:
            return 0
        self.closed = True
        queued, dropped_before = self.pending.qsize(), self.stats.dropped
        end = time.monotonic() + timeout_s
        try:
            self.pending.put(None, timeout=timeout_s)  # after the queued writes
        except queue.Full:
            pass
        self.writer.join(max(0.0, end - time.monotonic()))
        while True:
            try:
                self.stats.dropped += self.pending.get_nowait() is not None
            except queue.Empty:
                break
        dropped = self.stats.dropped - dropped_before
        if dropped:
            logger.warning("KV store: %d of %d queued block writes dropped at shutdown", dropped, queued)
        elif queued:
            logger.info("KV store: %d queued block writes sent at shutdown", queued)
        for client in (self.client, self.write_client):
            try:
                client.close()
            except Exception as e:  # a connection already broken: nothing left to release
                logger.debug("KV store: closing a Redis client: %s", e)
        return dropped


class KVConnector:
    """The Redis tier as the engine's KV connector (vLLM's name for it): the block manager asks it
    to load a request's prefix blocks into blocks reserved for them, and the load runs in a thread
    of its own, off the step loop, while the running requests keep stepping. A load that fails or
    runs out of its budget loads fewer blocks (none, at worst): the request computes the rest.
    Stores go behind, from RedisKVStore's writer thread. The copies into the cache touch only the
    reserved blocks, which no step reads until the load has finished."""

    def __init__(self, store: RedisKVStore, kv_caches: list[torch.Tensor]):
        self.store = store
        self.kv_caches = kv_caches  # per layer [2, num_blocks, block_size, kv_heads, head_dim]
        self.loader = ThreadPoolExecutor(1, thread_name_prefix="llmserve-kv-loader")
        self.loads: dict[str, Future[int]] = {}  # request_id -> blocks loaded, once done

    def start_load(self, request_id: str, hashes: list[bytes], block_ids: list[int]) -> None:
        self.loads[request_id] = self.loader.submit(self._load, hashes, block_ids)

    def _load(self, hashes: list[bytes], block_ids: list[int]) -> int:
        """Copy each run as it arrives: one index_copy_ per layer for the run's blocks."""
        loaded = 0
        for run in self.store.fetch_runs(hashes):
            ids = torch.tensor(block_ids[loaded : loaded + len(run)], device=self.kv_caches[0].device)
            kv = torch.stack(run).to(self.kv_caches[0].device)  # [n, layers, 2, block_size, kv_heads, head_dim]
            for layer, cache in enumerate(self.kv_caches):
                cache.index_copy_(1, ids, kv[:, layer].transpose(0, 1))
            loaded += len(run)
        return loaded

    def finished_loads(self) -> list[tuple[str, int]]:
        """(request_id, blocks loaded) of the loads done since the last call."""
        done = [rid for rid, f in self.loads.items() if f.done()]
        return [(rid, _loaded(self.loads.pop(rid))) for rid in done]

    def wait(self, timeout_s: float) -> None:
        """Until a load finishes, or timeout_s."""
        if self.loads:
            wait(list(self.loads.values()), timeout_s, FIRST_COMPLETED)

    def store_block(self, block_id: int, block_hash: bytes) -> None:
        self.store.put(block_hash, torch.stack([c[:, block_id] for c in self.kv_caches]))

    def close(self) -> None:
        self.loader.shutdown(wait=True, cancel_futures=True)


def _loaded(f: Future[int]) -> int:
    if f.cancelled():
        return 0
    if f.exception() is not None:  # fetch_runs() turns Redis errors into misses: this is a bug, not a miss
        logger.error("KV connector: a load failed: %r", f.exception())
        return 0
    return f.result()
