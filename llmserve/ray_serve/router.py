"""PrefixAwareRouter: a Ray Serve request router for the Engine deployment that sends prompts
sharing a prefix to the replica whose prefix cache holds it.

Key: the chained hashes (engine/block_manager.chain_block_hashes, as the engine's prefix cache
keys its blocks) of the prompt's first `prefix_blocks` full KV blocks. The router remembers, for
each hash, the replica that was last sent a prompt through it (an LRU of `max_entries`), and
prefers the replica of the longest remembered prefix. It falls back to Ray's default choice (the
less loaded of two random replicas) when the prompt has no full block or no remembered prefix, or
when queues are unbalanced: the preferred replica has `imbalance` more ongoing requests than the
least loaded. The router runs inside the ingress's DeploymentHandle, one instance per ingress
replica.
"""

from __future__ import annotations

import random
from collections import OrderedDict

from ray.serve.request_router import (
    FIFOMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from llmserve.engine.block_manager import chain_block_hashes, namespace_hash

ROOT = namespace_hash("llmserve-router")


class PrefixAwareRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, block_size: int = 16, prefix_blocks: int = 4, imbalance: int = 8,
                         max_entries: int = 100_000) -> None:
        self.block_size, self.prefix_blocks, self.imbalance = block_size, prefix_blocks, imbalance
        self.max_entries = max_entries
        self.owners: OrderedDict[bytes, ReplicaID] = OrderedDict()  # prefix hash -> replica, LRU order

    def prefix_hashes(self, pending: PendingRequest | None) -> list[bytes]:
        """Hashes of the prompt's leading full blocks, shortest prefix first ([] when unknown)."""
        request = pending.args[0] if pending is not None and pending.args else None
        tokens = getattr(request, "prompt_token_ids", None)
        if not tokens:
            return []
        return [h for h, _ in chain_block_hashes(ROOT, tokens, self.block_size, self.prefix_blocks)]

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        """Ranks: [the prefix's replica], then two random ones (Ray probes each rank's queue
        lengths and takes the least loaded replica that accepts)."""
        if not candidate_replicas:
            return []
        fallback = random.sample(candidate_replicas, min(2, len(candidate_replicas)))
        preferred = self._preferred(candidate_replicas, self.prefix_hashes(pending_request))
        if preferred is None:
            return [fallback]
        return [[preferred], [r for r in fallback if r is not preferred] or fallback]

    def _preferred(self, candidates: list[RunningReplica], hashes: list[bytes]) -> RunningReplica | None:
        by_id = {r.replica_id: r for r in candidates}
        for h in reversed(hashes):  # the longest remembered prefix wins
            replica = by_id.get(self.owners.get(h))  # type: ignore[arg-type]
            if replica is not None:
                return replica if self._balanced(replica, candidates) else None
        return None

    def _balanced(self, replica: RunningReplica, candidates: list[RunningReplica]) -> bool:
        queue = self.replica_queue_len_cache
        loads = [queue.get(r.replica_id) or 0 for r in candidates]
        return (queue.get(replica.replica_id) or 0) - min(loads) < self.imbalance

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        for h in self.prefix_hashes(pending_request):
            self.owners[h] = replica_id
            self.owners.move_to_end(h)
        while len(self.owners) > self.max_entries:
            self.owners.popitem(last=False)
