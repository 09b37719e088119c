"""Scheduler: continuous batching with chunked prefill and preemption by recompute.

Each step hands out a token budget (max_num_batched_tokens) first to running requests, in
arrival order (a decode costs 1 token, an unfinished prefill takes a chunk), then admits waiting
requests first come, first served, within max_num_seqs. When the KV cache runs out of blocks,
the most recently admitted running request is preempted: its blocks are freed and it goes back
to the front of the waiting queue, to be recomputed (prompt + the tokens it already produced).

Under the priority policy both queues are kept in (priority, arrival) order, lower first: the
budget goes to the best running requests, the best waiting one is admitted first, the worst
running one is preempted, and a waiting request better than the worst running one preempts it
when it waits for a batch slot or for blocks (vLLM preempts only for memory).

With LoRA (max_loras > 0), the running requests use at most max_loras distinct adapters. A
waiting request whose adapter would exceed that stays waiting; behind it only base-model
requests are admitted, so the running adapters drain and it is never starved.

With a proposer (speculative decoding), a decode may carry draft tokens: it then computes
1 + len(drafts) tokens, and only those the sampler accepts are committed (commit()).
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass, field

from llmserve.engine.block_manager import KVCacheManager
from llmserve.engine.request import Request, RequestStatus
from llmserve.engine.spec_decode import NgramProposer


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_tokens: int  # tokens computed this step, starting at request.num_computed_tokens
    block_ids: list[int]
    num_computed_tokens: int  # before this step
    samples: bool  # this chunk reaches the last known token, so a new token is sampled
    spec_token_ids: list[int] = field(default_factory=list)  # drafts computed after the last known token


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_seqs: int = 0
    num_spec_tokens: int = 0  # draft tokens verified this step

    @property
    def empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 proposer: NgramProposer | None = None, max_model_len: int = 1 << 30, policy: str = "fcfs", max_loras: int = 0):
        self.kv = kv
        self.max_loras = max_loras
        self.priority = policy == "priority"
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.loading: dict[str, Request] = {}  # WAITING_FOR_REMOTE_KVS: their prefixes load off the loop
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self._enqueue(self.waiting, request)

    def counts_by_priority(self) -> dict[str, list[int]]:
        """Under the priority policy: priority -> [running, waiting] (a metric's labels); {} under fcfs."""
        counts: dict[str, list[int]] = {}
        if self.priority:
            for i, queue in enumerate((self.running, self.waiting)):
                for req in queue:
                    counts.setdefault(str(req.priority), [0, 0])[i] += 1
        return counts

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        preempted = False
        for rid in self.kv.finish_remote_loads():  # back in line, their loaded blocks now local hits
            req = self.loading.pop(rid)
            req.status = RequestStatus.WAITING
            self._enqueue(self.waiting, req, front=True)
        if self.priority:
            self._preempt_for_better_waiting()
        speculate = self.proposer is not None and self.proposer.begin_step(len(self.running))
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            # drafts only where blocks to spare remain for every other running sequence's next token
            room = speculate and n == 1 and self.kv.num_free_blocks > len(self.running)
            drafts = self._drafts(req, budget) if room else []
            if drafts and not self.kv.allocate_slots(req, n + len(drafts)):
                drafts = []  # no room for the drafts: a plain decode
            while not self.kv.allocate_slots(req, n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                self._add(out, req, n, drafts)
                budget -= n + len(drafts)
                i += 1
        if not preempted:
            budget = self._admit_waiting(out, budget)
        return out

    def _running_adapters(self) -> set[int]:
        return {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}

    def _needs_adapter_slot(self, req: Request, adapters: set[int]) -> bool:
        """Whether req's adapter is not running and the running ones are at --max-loras."""
        lora = req.lora_request
        return lora is not None and lora.lora_int_id not in adapters and len(adapters) >= self.max_loras

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> int:
        adapters = self._running_adapters()
        held_back = False  # a request waits for an adapter slot: only base-model requests pass it
        for req in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            lora = req.lora_request
            if lora is not None and (held_back or self._needs_adapter_slot(req, adapters)):
                held_back = True
                continue
            computed = self.kv.get_computed_blocks(req)
            if req.status is RequestStatus.WAITING and self.kv.start_remote_load(req, computed):
                self.waiting.remove(req)
                req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                self.loading[req.request_id] = req
                continue
            num_cached = len(computed) * self.kv.block_size
            n = min(req.num_tokens - num_cached, budget)
            if not self.kv.allocate_slots(req, n, computed):
                break
            self.waiting.remove(req)
            if lora is not None:
                adapters.add(lora.lora_int_id)
            req.num_computed_tokens = num_cached
            if req.status is RequestStatus.WAITING:  # first admission, not a resumed preemption
                self.kv.record_prefix_query(req, computed)
                req.num_cached_tokens = num_cached
                req.timeline.first_scheduled = time.time()
            req.status = RequestStatus.RUNNING
            self._enqueue(self.running, req)
            self._add(out, req, n)
            budget -= n
        return budget

    def lora_counts(self) -> tuple[list[str], list[str]]:
        """The adapters of the running and of the waiting requests (names, each once)."""
        def names(queue) -> list[str]:
            return sorted({r.lora_request.lora_name for r in queue if r.lora_request is not None})

        return names(self.running), names(self.waiting)

    def _drafts(self, req: Request, budget: int) -> list[int]:
        """Drafts for a decode, within the step's budget, max_tokens and the context length."""
        if req.num_computed_tokens < req.num_prompt_tokens:
            return []
        room = min(budget, req.max_tokens - len(req.output_token_ids), self.max_model_len - req.num_tokens) - 1
        return self.proposer.propose(req, room)  # type: ignore[union-attr]

    def _add(self, out: SchedulerOutput, req: Request, n: int, drafts: list[int] | None = None) -> None:
        """n: the known tokens computed this step; drafts follow them."""
        start = req.num_computed_tokens
        samples = start + n == req.num_tokens
        drafts = drafts or []
        out.scheduled.append(ScheduledRequest(req, n + len(drafts), self.kv.block_ids(req.request_id), start, samples, drafts))
        out.num_spec_tokens += len(drafts)
        if n == 1 and req.num_computed_tokens >= req.num_prompt_tokens:
            out.num_decode_seqs += 1
        else:
            out.num_prefill_tokens += n

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        self._enqueue(self.waiting, req, front=True)

    def _enqueue(self, queue: list[Request] | deque[Request], req: Request, front: bool = False) -> None:
        """In rank order under the priority policy; else at the back (the front: a preempted request)."""
        if self.priority:
            _insert(queue, req)
        elif front:
            queue.appendleft(req)  # type: ignore[union-attr]
        else:
            queue.append(req)

    def _preempt_for_better_waiting(self) -> None:
        """Going down the waiting queue, best first: while a waiting request ranks above the
        worst running one and lacks a batch slot or the blocks for its first chunk (beside those
        of the better ones before it), preempt that running request."""
        slots_taken = blocks_taken = 0  # by the waiting requests already provided for
        adapters = self._running_adapters()
        for req in list(self.waiting):
            if self._needs_adapter_slot(req, adapters):
                continue  # admission would hold it back: preempting for it would free nothing it can use
            need = -(-min(req.num_tokens, self.max_num_batched_tokens) // self.kv.block_size)
            while self._lacks_room(slots_taken + 1, blocks_taken + need) and self.running \
                    and _rank(req) < _rank(self.running[-1]):
                self._preempt(self.running.pop())
            if self._lacks_room(slots_taken + 1, blocks_taken + need):
                return
            slots_taken, blocks_taken = slots_taken + 1, blocks_taken + need

    def _lacks_room(self, slots: int, blocks: int) -> bool:
        """Whether `slots` more running requests, holding `blocks` more blocks, do not fit."""
        return len(self.running) + slots > self.max_num_seqs or self.kv.num_free_blocks < blocks

    def advance(self, out: SchedulerOutput) -> None:
        """After the model ran: mark the scheduled tokens computed and hash newly full blocks.
        Rows with drafts are committed by the engine once it knows which were accepted."""
        for s in out.scheduled:
            if not s.spec_token_ids:
                self.commit(s.request, s.num_tokens)

    def commit(self, req: Request, num_tokens: int) -> None:
        """num_tokens more of req's tokens (all in req.all_token_ids) have their K/V in the cache."""
        req.num_computed_tokens += num_tokens
        if req.status is RequestStatus.RUNNING:
            self.kv.cache_full_blocks(req, req.num_computed_tokens)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """End a request (stop, length or abort) and free its blocks at once."""
        if req.status.finished:
            return
        req.status = status
        req.timeline.finished = time.time()
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.loading.pop(req.request_id, None)
        self.kv.free(req)
        self.requests.pop(req.request_id, None)


def _rank(req: Request) -> tuple[int, float]:
    return req.priority, req.timeline.arrival


def _insert(queue: list[Request] | deque[Request], req: Request) -> None:
    """Into `queue`, kept in _rank order, after every request of equal rank."""
    keys = [_rank(r) for r in queue]
    queue.insert(bisect.bisect_right(keys, _rank(req)), req)
