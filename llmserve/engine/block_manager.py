"""Paged KV cache bookkeeping with automatic prefix caching (pure Python, no torch).

Invariants:
- Block 0 is the null block: never allocated, padded rows of a batch write into it.
- A block with ref_cnt == 0 sits in the free queue (least recently used first). If it still
  carries a block_hash it is also in `cached`, and a later prompt with the same prefix can
  revive it; it is evicted (hash dropped) only when it is handed out as a new block.
- A full block's hash chains over its parent's hash and its token ids; under a LoRA adapter the
  root is the namespace's hashed with the adapter's content hash (the same tokens have other K/V);
  otherwise the chain's root is the
  namespace (model fingerprint, block size, dtype), so different models never share blocks.
  A hit is confirmed by comparing the block's token ids, not only the hash.
- With a KV connector (the Redis tier), the blocks after a request's local hits are asked for
  once per request: free blocks are reserved for them (held, in `loading`) while the connector
  fills them off the step loop; when the load ends, the leading run that arrived is registered
  as cached and every reserved block is released. A request freed meanwhile gets nothing
  registered, and its blocks come back only when the load ends (the connector may still write).
  No I/O happens here.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

from llmserve.engine.block_hash import chain_block_hashes, hash_block, namespace_hash
from llmserve.engine.request import Request


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] | None = None  # the tokens hashed into block_hash


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError("the KV cache needs at least 2 blocks (block 0 is reserved)")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks[1:])
        self.cached: dict[bytes, KVBlock] = {}
        self.num_evictions = 0

    @property
    def num_usable(self) -> int:
        return len(self.blocks) - 1

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self, n: int) -> list[KVBlock]:
        assert n <= len(self.free), "caller checks capacity first"
        out = []
        for _ in range(n):
            _, block = self.free.popitem(last=False)  # least recently used
            if block.block_hash is not None:
                del self.cached[block.block_hash]
                block.block_hash, block.token_ids = None, None
                self.num_evictions += 1
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on prefix-cache hits (reviving them from the free queue)."""
        for b in blocks:
            if b.ref_cnt == 0:
                del self.free[b.block_id]
            b.ref_cnt += 1

    def release(self, blocks: list[KVBlock]) -> None:
        """Drop a reference; pass blocks tail first so a sequence's tail is evicted first."""
        for b in blocks:
            b.ref_cnt -= 1
            assert b.ref_cnt >= 0
            if b.ref_cnt == 0:
                self.free[b.block_id] = b

    def lookup(self, block_hash: bytes, token_ids: tuple[int, ...]) -> KVBlock | None:
        b = self.cached.get(block_hash)
        return b if b is not None and b.token_ids == token_ids else None

    def register(self, block: KVBlock, block_hash: bytes, token_ids: tuple[int, ...]) -> None:
        if block_hash in self.cached:  # another sequence computed the same block first
            return
        block.block_hash, block.token_ids = block_hash, token_ids
        self.cached[block_hash] = block


class KVConnector(Protocol):
    """A second tier of blocks by hash (cache/kv_store.py: Redis). It does the I/O, off the step
    loop; the block manager only says which blocks to fill and registers what arrived."""

    def start_load(self, request_id: str, hashes: list[bytes], block_ids: list[int]) -> None: ...  # fill these blocks
    def finished_loads(self) -> list[tuple[str, int]]: ...  # (request_id, leading blocks filled) since the last call
    def store_block(self, block_id: int, block_hash: bytes) -> None: ...  # write behind
    def wait(self, timeout_s: float) -> None: ...  # until a load ends, or timeout_s
    def close(self) -> None: ...


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens found


@dataclass(slots=True)
class KVCacheManager:
    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = True
    namespace: str = ""
    pool: BlockPool = field(init=False)
    req_blocks: dict[str, list[KVBlock]] = field(default_factory=dict)
    req_hashes: dict[str, list[bytes]] = field(default_factory=dict)  # hashes of full blocks
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    root: bytes = field(init=False)
    connector: KVConnector | None = None  # e.g. Redis, behind the local prefix cache
    # request_id -> (the hash chain being loaded, the blocks reserved for it), until the load ends
    loading: dict[str, tuple[list[tuple[bytes, tuple[int, ...]]], list[KVBlock]]] = field(default_factory=dict)
    abandoned: set[str] = field(default_factory=set)  # loading requests freed before their load ended
    asked: set[str] = field(default_factory=set)  # requests the connector was asked about: once per request
    lora_roots: dict[str, bytes] = field(default_factory=dict)  # adapter content hash -> its chains' root

    def __post_init__(self) -> None:
        self.pool = BlockPool(self.num_blocks)
        self.root = namespace_hash(self.namespace)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_usable

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def root_of(self, request: Request) -> bytes:
        """The root of the request's hash chains: its adapter's own, or the base model's."""
        lora = request.lora_request
        if lora is None:
            return self.root
        root = self.lora_roots.get(lora.content_hash)
        if root is None:
            root = self.lora_roots[lora.content_hash] = namespace_hash(f"{self.namespace}:lora:{lora.content_hash}")
        return root

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def _chain(self, request: Request) -> list[tuple[bytes, tuple[int, ...]]]:
        """Every full block that could be cached (at least one token is always left to compute)."""
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return []
        tokens, bs = request.all_token_ids, self.block_size
        return chain_block_hashes(self.root_of(request), tokens, bs, (len(tokens) - 1) // bs)

    def get_computed_blocks(self, request: Request) -> list[KVBlock]:
        """Longest cached prefix of full blocks, in this cache (no I/O)."""
        hits: list[KVBlock] = []
        for h, chunk in self._chain(request):
            block = self.pool.lookup(h, chunk)
            if block is None:
                break
            hits.append(block)
        return hits

    def start_remote_load(self, request: Request, hits: list[KVBlock]) -> bool:
        """Ask the connector for the blocks after the local hits, into free blocks reserved for
        them, once per request; False when there is nothing to ask (no connector, asked before,
        no such blocks, no free block)."""
        if self.connector is None or request.request_id in self.asked:
            return False
        self.asked.add(request.request_id)
        rest = self._chain(request)[len(hits):]
        self.pool.touch(hits)  # held, so that reserving blocks cannot evict them
        n = min(len(rest), self.pool.num_free - len(self.req_blocks))  # a block to spare per holder
        blocks = self.pool.allocate(n) if n > 0 else []
        self.pool.release(list(reversed(hits)))
        if not blocks:
            return False
        self.loading[request.request_id] = (rest[:n], blocks)
        self.connector.start_load(request.request_id, [h for h, _ in rest[:n]], [b.block_id for b in blocks])
        return True

    def finish_remote_loads(self) -> list[str]:
        """Register the blocks of the loads that ended as cached (and free, until allocate_slots
        takes them); the ids of their requests, but for those freed meanwhile."""
        ended = []
        for rid, n in self.connector.finished_loads() if self.connector is not None else []:
            chain, blocks = self.loading.pop(rid)
            abandoned = rid in self.abandoned
            self.abandoned.discard(rid)
            for block, (h, chunk) in zip(blocks[: 0 if abandoned else n], chain, strict=False):
                self.pool.register(block, h, chunk)
            self.pool.release(list(reversed(blocks)))
            if not abandoned:
                ended.append(rid)
        return ended

    def record_prefix_query(self, request: Request, hits: list[KVBlock]) -> None:
        """Counted once, when the request is admitted."""
        self.stats.queries += len(request.prompt_token_ids)
        self.stats.hits += min(len(hits) * self.block_size, len(request.prompt_token_ids))

    def allocate_slots(self, request: Request, num_new_tokens: int, computed: list[KVBlock] | None = None) -> bool:
        """Make room for num_new_tokens more tokens after the computed ones; False if out of blocks."""
        computed = computed or []
        held = self.req_blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(computed) * self.block_size
        need = self.blocks_needed(num_computed + num_new_tokens) - len(held) - len(computed)
        reviving = sum(1 for b in computed if b.ref_cnt == 0)  # hits that sit in the free queue
        if need + reviving > self.pool.num_free:
            return False
        self.pool.touch(computed)
        blocks = self.req_blocks.setdefault(request.request_id, [])
        blocks.extend(computed)
        if computed:
            self.req_hashes[request.request_id] = [b.block_hash for b in computed]  # type: ignore[misc]
        if need > 0:
            blocks.extend(self.pool.allocate(need))
        return True

    def cache_full_blocks(self, request: Request, num_computed_tokens: int) -> list[KVBlock]:
        """Hash and register blocks that became full; returns them (for a write-behind KV tier)."""
        if not self.enable_prefix_caching:
            return []
        hashes = self.req_hashes.setdefault(request.request_id, [])
        blocks = self.req_blocks[request.request_id]
        bs, tokens = self.block_size, request.all_token_ids
        new = []
        for i in range(len(hashes), num_computed_tokens // bs):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            h = hash_block(hashes[-1] if hashes else self.root_of(request), chunk)
            hashes.append(h)
            self.pool.register(blocks[i], h, chunk)
            new.append(blocks[i])
            if self.connector is not None:
                self.connector.store_block(blocks[i].block_id, h)
        return new

    def free(self, request: Request) -> None:
        blocks = self.req_blocks.pop(request.request_id, [])
        self.req_hashes.pop(request.request_id, None)
        self.asked.discard(request.request_id)
        if request.request_id in self.loading:  # the connector still fills its blocks: released when it ends
            self.abandoned.add(request.request_id)
        self.pool.release(list(reversed(blocks)))
