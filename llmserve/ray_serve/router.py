"""PrefixAwareRouter: a Ray Serve request router for the Engine deployment that sends prompts
sharing a prefix to the replica whose prefix cache holds it.

Key: the chained hashes (engine/block_hash.chain_block_hashes, as the engine's prefix cache
keys its blocks) of the prompt's first `prefix_blocks` full KV blocks. The router remembers, for
each hash, the replicas that were sent a prompt through it (an LRU of `max_entries` hashes), and
prefers the least loaded of those holding the longest remembered prefix; a new prefix goes to the
least loaded replica. It falls back to Ray's default choice (the less loaded of two random
replicas) when the prompt has no full block, or when queues are unbalanced: the preferred replica
has `imbalance` more ongoing requests than the least loaded. The replica it then picks becomes a
second holder: a popular prefix spreads over replicas, one miss each, and is balanced from then
on. The default of 32 (sglang-router's too) is deliberately loose: a spread costs one full
prefill, which stalls that replica's other requests, while a few more ongoing requests (mostly
cheap decodes) barely slow it (scripts/bench_ray.py, README: at 8, TTFT p50 2.4-3.5 s; at 32,
0.6-0.8 s). The router runs inside the ingress's DeploymentHandle, one instance per ingress replica.
"""

from __future__ import annotations

import random
from collections import Counter, OrderedDict

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from llmserve.engine.block_hash import chain_block_hashes, namespace_hash

ROOT = namespace_hash("llmserve-router")
PRUNE_CHOICES_AT = 256


class PrefixAwareRouter(RequestRouter):  # no FIFOMixin: it would hand a replica chosen for one prompt to another
    def initialize_state(self, block_size: int = 16, prefix_blocks: int = 4, imbalance: int = 32,
                         max_entries: int = 100_000) -> None:
        self.block_size, self.prefix_blocks, self.imbalance = block_size, prefix_blocks, imbalance
        self.max_entries = max_entries
        # prefix hash -> the replicas sent a prompt through it, latest last; LRU order
        self.holders: OrderedDict[bytes, dict[ReplicaID, None]] = OrderedDict()
        # requests chosen for a replica and not yet sent: Ray's queue lengths do not count them yet,
        # and a burst is chosen all at once
        self.choices: dict[str, tuple[ReplicaID, PendingRequest]] = {}  # internal request id -> (replica, request)
        self.chosen: Counter[ReplicaID] = Counter()

    def prefix_hashes(self, pending: PendingRequest | None) -> list[bytes]:
        """Hashes of the prompt's leading full blocks, shortest prefix first ([] when unknown); under
        a LoRA adapter they chain from a root of its own, as the engine's do."""
        request = pending.args[0] if pending is not None and pending.args else None
        tokens = getattr(request, "prompt_token_ids", None)
        if not tokens:
            return []
        lora = getattr(request, "lora_request", None)
        root = ROOT if lora is None else namespace_hash(f"llmserve-router:lora:{lora.content_hash}")
        return [h for h, _ in chain_block_hashes(root, tokens, self.block_size, self.prefix_blocks)]

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        """Ranks: [the prefix's replica], then two random ones (Ray probes each rank's queue
        lengths and takes the least loaded replica that accepts). A prefix seen for the first
        time is given to the least loaded replica at once, so that its next requests, routed
        while this one is still on its way, follow it."""
        if pending_request is not None:  # every replica full: Ray sleeps between tries, not spin
            pending_request.routing_context.should_backoff = True
        if not candidate_replicas:
            return []
        fallback = random.sample(candidate_replicas, min(2, len(candidate_replicas)))
        hashes = self.prefix_hashes(pending_request)
        if not hashes:
            return [fallback]
        preferred = self._holder(candidate_replicas, hashes)
        if preferred is None:
            preferred = min(random.sample(candidate_replicas, len(candidate_replicas)), key=self._load)
            self._remember(hashes, preferred.replica_id)
        elif self._load(preferred) - min(map(self._load, candidate_replicas)) >= self.imbalance:
            return [fallback]  # unbalanced: load first (the prefix gains a second holder)
        self._choose(pending_request, preferred.replica_id)  # type: ignore[arg-type]
        return [[preferred], [r for r in fallback if r is not preferred] or fallback]

    def _holder(self, candidates: list[RunningReplica], hashes: list[bytes]) -> RunningReplica | None:
        """The least loaded replica holding the longest remembered prefix (the latest on a tie)."""
        by_id = {r.replica_id: r for r in candidates}
        for h in reversed(hashes):
            held = [by_id[r] for r in reversed(self.holders.get(h, {})) if r in by_id]
            if held:
                return min(held, key=self._load)
        return None

    def _load(self, replica: RunningReplica) -> int:
        """Ongoing requests (as Ray last heard), plus those chosen for it and not yet sent."""
        return (self.replica_queue_len_cache.get(replica.replica_id) or 0) + self.chosen[replica.replica_id]

    def _choose(self, pending: PendingRequest, replica_id: ReplicaID) -> None:
        self._unchoose(pending)
        if len(self.choices) >= PRUNE_CHOICES_AT:  # forget requests cancelled before they were sent
            for p in [p for _, p in self.choices.values() if p.future.done()]:
                self._unchoose(p)
        self.choices[pending.metadata.internal_request_id] = (replica_id, pending)
        self.chosen[replica_id] += 1

    def _unchoose(self, pending: PendingRequest) -> None:
        choice = self.choices.pop(pending.metadata.internal_request_id, None)
        if choice is not None:
            self.chosen[choice[0]] -= 1

    def _remember(self, hashes: list[bytes], replica_id: ReplicaID) -> None:
        for h in hashes:
            held = self.holders.setdefault(h, {})
            held.pop(replica_id, None)
            held[replica_id] = None
            self.holders.move_to_end(h)
        while len(self.holders) > self.max_entries:
            self.holders.popitem(last=False)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        self._unchoose(pending_request)
        self._remember(self.prefix_hashes(pending_request), replica_id)
