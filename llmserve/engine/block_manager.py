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
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Protocol

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


class ExternalKVTier(Protocol):
    """A second tier of blocks by hash (cache/kv_store.py binds Redis to the cache tensors)."""

    def fetch(self, hashes: list[bytes]) -> list[Any]: ...  # payloads of the leading run of hits
    def load(self, block_id: int, payload: Any) -> None: ...  # payload -> the block's K/V
    def store_block(self, block_id: int, block_hash: bytes) -> None: ...  # write behind


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
    tier: ExternalKVTier | None = None  # e.g. Redis, behind the local prefix cache
    tier_asked: set[str] = field(default_factory=set)  # requests that already queried the tier
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

    def get_computed_blocks(self, request: Request) -> list[KVBlock]:
        """Longest cached prefix of full blocks (local, then the external tier); at least one
        token is always left to compute."""
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return []
        tokens, bs = request.all_token_ids, self.block_size
        chain = chain_block_hashes(self.root_of(request), tokens, bs, (len(tokens) - 1) // bs)  # every candidate block
        hits: list[KVBlock] = []
        for h, chunk in chain:
            block = self.pool.lookup(h, chunk)
            if block is None:
                break
            hits.append(block)
        if self.tier is not None and len(hits) < len(chain) and request.request_id not in self.tier_asked:
            self.tier_asked.add(request.request_id)  # one round trip per admission, not per step
            hits += self._load_from_tier(chain[len(hits) :])
        return hits

    def _load_from_tier(self, chain: list[tuple[bytes, tuple[int, ...]]]) -> list[KVBlock]:
        """Fetch consecutive blocks in one round trip into free blocks, registered as cached."""
        payloads = self.tier.fetch([h for h, _ in chain])  # type: ignore[union-attr]
        n = min(len(payloads), self.pool.num_free)
        blocks = self.pool.allocate(n)
        for block, (h, chunk), kv in zip(blocks, chain, payloads, strict=False):
            self.tier.load(block.block_id, kv)  # type: ignore[union-attr]
            self.pool.register(block, h, chunk)
        self.pool.release(list(reversed(blocks)))  # cached and free, until allocate_slots takes them
        return blocks

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
            if self.tier is not None:
                self.tier.store_block(blocks[i].block_id, h)
        return new

    def free(self, request: Request) -> None:
        blocks = self.req_blocks.pop(request.request_id, [])
        self.req_hashes.pop(request.request_id, None)
        self.tier_asked.discard(request.request_id)
        self.pool.release(list(reversed(blocks)))
