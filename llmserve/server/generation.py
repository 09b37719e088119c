"""Generation: the engine requests behind one API request (n samples of each prompt), merged
into one stream of deltas, with per-choice totals and usage.

Lifecycle: Generation(...) validates every child (typed errors, nothing submitted yet);
`await start()` submits them all through the engine client and returns once each has produced
its first delta, so a refusal (429) or a dead engine (503) becomes an HTTP status rather than a
broken stream; `async for choice, delta in events()` yields until every child has finished;
`close()` (idempotent, synchronous) aborts any child still running. Whoever holds a started
Generation must close it: the SSE response does so when the stream ends or the client goes.

Response cache (the one place in front of the engine): a deterministic request (temperature 0
or a seed, n == 1, not opted out) is looked up in `start()`; a hit replays the recorded engine
outputs instead of submitting anything (cache_status "hit"); a miss records its outputs and,
once every choice finished without an abort, stores them. With the semantic cache on, a route
may also pass the request's question (SemanticQuery): after an exact miss, an earlier answer to
the same question in other words is replayed (cache_status "semantic-hit"), and a miss's answer
is filed under its question too.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import partial

from llmserve.cache.response_cache import ResponseRecord, cache_key
from llmserve.cache.semantic_cache import SemanticLookup, SemanticQuery
from llmserve.engine.client import EngineCoreRequest
from llmserve.engine.outputs import CompletionOutput, RequestOutput, Timeline, TokenLogprobs
from llmserve.lora.request import LoRARequest
from llmserve.sampling import SamplingParams, fan_out
from llmserve.server.context import ServerContext
from llmserve.server.errors import ShuttingDownError
from llmserve.server.replay import record_choice, replay_choice

CACHE_HEADER = "x-llmserve-cache"  # on every generation response: "hit", "semantic-hit" or "miss"
SIMILARITY_HEADER = "x-llmserve-similarity"  # on a semantic hit: the cosine of the two questions


class _Inbox:
    """What the engine client delivers (on the loop thread) to the one task that reads it, in
    order: an asyncio.Queue's job at half its cost per item, which is paid per token. A future
    exists only while the reader waits."""

    __slots__ = ("items", "waiter")

    def __init__(self) -> None:
        self.items: deque = deque()
        self.waiter: asyncio.Future[None] | None = None

    def put(self, item: object) -> None:
        self.items.append(item)
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self):
        while not self.items:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        return self.items.popleft()


@dataclass(slots=True, kw_only=True)
class Choice(CompletionOutput):
    """One output sequence as its deltas arrive (index: prompt_index * n + sample index, as OpenAI
    numbers choices)."""

    prompt_index: int
    request: EngineCoreRequest  # as sent to the engine
    logprobs: list[TokenLogprobs] | None = field(default_factory=list)  # always kept (formatting picks)
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # when asked (echo)
    num_cached_tokens: int = 0
    timeline: Timeline | None = None  # the engine's, once finished


@dataclass(slots=True)
class Delta:
    """What one engine step added to one choice (generated tokens dropped when scoring only)."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs]
    finish_reason: str | None
    first_token_index: int  # output position of token_ids[0]
    token_time: float  # time.time() when the engine sampled token_ids


class Generation:
    def __init__(
        self,
        ctx: ServerContext,
        request_id: str,
        prompts: list[list[int]],
        params: SamplingParams,
        arrival: float | None = None,
        score_only: bool = False,  # max_tokens 0: run one step for the prompt logprobs, drop the token
        use_cache: bool = True,  # the request's "cache" field
        semantic: SemanticQuery | None = None,  # the question, where the route allows a semantic hit
        priority: int = 0,  # the request's "priority" field
        lora: LoRARequest | None = None,  # the adapter `model` named; None: the base model
    ):
        self.ctx = ctx
        self.request_id = request_id
        self.prompts = prompts
        self.score_only = score_only
        self.lora = lora
        arrival = time.time() if arrival is None else arrival
        make = ctx.client.make_request
        self.choices = [
            Choice(s.index, prompt_index=s.prompt_index,
                   request=make(s.request_id, prompts[s.prompt_index], s.params, arrival, priority, lora))
            for s in fan_out(request_id, len(prompts), params)
        ]
        self._inbox = _Inbox()  # (choice index, engine output or its failure), as the engine client delivers them
        self._submitted: list[str] = []  # engine request ids sent
        self._buffer: deque[tuple[int, RequestOutput]] = deque()  # first deltas, read by start()
        self.cache_key = self._cache_key(params, use_cache)
        self.cache_status = "miss"  # "hit": answered from the response cache
        self.semantic_scope = self._semantic_scope(params, semantic)
        self.semantic = semantic
        self._semantic_lookup: SemanticLookup | None = None
        # engine outputs per choice, kept while a cacheable request runs
        self._recorded: list[list[RequestOutput]] | None = [[] for _ in self.choices] if self.cache_key else None

    def _cache_key(self, params: SamplingParams, use_cache: bool) -> str | None:
        if self.ctx.response_cache is None or not use_cache or params.n != 1 or not params.deterministic:
            return None
        return cache_key(
            self.ctx.client.info.fingerprint, self.prompts, params.canonical(), score_only=self.score_only,
            max_model_len=self.ctx.max_model_len, eos=list(self.ctx.client.info.eos_token_ids), lora=self._lora_key,
        )

    @property
    def model_name(self) -> str:
        """What the response reports in `model`: the adapter's name, or the served model's."""
        return self.lora.lora_name if self.lora is not None else self.ctx.model_name

    @property
    def _lora_key(self) -> str | None:
        """The adapter's weights (by hash), where a cache entry must match them."""
        return self.lora.content_hash if self.lora is not None else None

    def _semantic_scope(self, params: SamplingParams, query: SemanticQuery | None) -> str | None:
        """Everything but the question that a semantic hit must share (None: not eligible)."""
        if query is None or self.cache_key is None or self.ctx.semantic_cache is None or len(self.prompts) != 1 or self.score_only:
            return None
        return cache_key(
            self.ctx.client.info.fingerprint, [], params.canonical(), semantic=query.context,
            max_model_len=self.ctx.max_model_len, eos=list(self.ctx.client.info.eos_token_ids), lora=self._lora_key,
        )

    @property
    def headers(self) -> dict[str, str]:
        headers = {CACHE_HEADER: self.cache_status}
        if self._semantic_lookup is not None and self._semantic_lookup.match is not None and self.cache_status == "semantic-hit":
            headers[SIMILARITY_HEADER] = f"{self._semantic_lookup.match.similarity:.4f}"
        return headers

    async def start(self) -> None:
        if self.ctx.draining:
            raise ShuttingDownError("the server is shutting down")
        if self.cache_key is not None and (await self._replay() or await self._replay_similar()):
            return
        try:
            for c in self.choices:
                self.ctx.client.add_request(c.request, partial(self._on_output, c.index))
                self._submitted.append(c.request.request_id)
            started: set[int] = set()
            while len(started) < len(self.choices):
                i, item = await self._inbox.get()
                if isinstance(item, BaseException):
                    raise item
                started.add(i)
                self._buffer.append((i, item))
        except BaseException:
            self.close()
            raise

    async def _replay(self) -> bool:
        """A hit: queue the recorded outputs as if the engine had produced them."""
        record = await self.ctx.response_cache.lookup(self.cache_key, len(self.choices))  # type: ignore[union-attr, arg-type]
        if record is None:
            return False
        self._queue_record(record, "hit")
        return True

    async def _replay_similar(self) -> bool:
        """After an exact miss: the answer to the same question asked in other words."""
        if self.semantic_scope is None:
            return False
        cache = self.ctx.semantic_cache
        self._semantic_lookup = lookup = await cache.lookup(self.semantic_scope, self.semantic.text)  # type: ignore[union-attr]
        if lookup.match is None:
            return False
        answers = self.ctx.response_cache
        record = await answers.get(lookup.match.entry.response_key, len(self.choices))  # type: ignore[union-attr]
        cache.count_hit(record is not None)  # type: ignore[union-attr]
        if record is None:  # a miss: the answer expired or was evicted, or Redis is away
            if answers.redis is None:  # in process, the answer is gone for good: forget the entry
                cache.discard(lookup.match.entry)  # type: ignore[union-attr]
            lookup.match = None
            return False
        self._queue_record(record, "semantic-hit")
        return True

    def _queue_record(self, record: ResponseRecord, status: str) -> None:
        self.cache_status, self._recorded = status, None
        now = time.time()
        for c, cached in zip(self.choices, record.choices, strict=True):
            self._buffer.extend((c.index, out) for out in replay_choice(cached, c.request, now, status == "hit"))

    def _store(self) -> None:
        if self._recorded is None or any(c.finish_reason == "abort" for c in self.choices):
            return
        choices = [record_choice(outs, c.prompt_logprobs) for outs, c in zip(self._recorded, self.choices, strict=True)]
        self.ctx.response_cache.store(ResponseRecord(self.cache_key, choices))  # type: ignore[union-attr, arg-type]
        self._recorded = None
        if self._semantic_lookup is not None:
            self.ctx.semantic_cache.store(self._semantic_lookup, self.cache_key)  # type: ignore[union-attr, arg-type]

    def _on_output(self, index: int, item: RequestOutput | BaseException) -> None:
        """The engine client's sink for one child (loop thread): an output, or its death."""
        self._inbox.put((index, item))

    def close(self) -> None:
        """Abort every child still running (the client ignores finished ones)."""
        for rid in self._submitted:
            self.ctx.client.abort_request(rid)
        self._submitted = []

    async def events(self) -> AsyncIterator[tuple[Choice, Delta]]:
        """(choice, delta) in arrival order, until every choice has finished."""
        pending = sum(not c.finished for c in self.choices)
        while pending:
            if self._buffer:
                i, item = self._buffer.popleft()
            else:
                i, item = await self._inbox.get()
            if isinstance(item, BaseException):
                raise item
            choice = self.choices[i]
            delta = self._apply(choice, item)
            if choice.finished:
                pending -= 1
                if not pending:
                    self._store()
            yield choice, delta

    def _apply(self, c: Choice, out: RequestOutput) -> Delta:
        if self._recorded is not None:
            self._recorded[c.index].append(out)
        first = out.num_output_tokens - len(out.new_token_ids)
        if out.prompt_logprobs is not None:
            c.prompt_logprobs = out.prompt_logprobs
        if self.score_only:  # the one sampled token is not part of the answer
            reason = out.finish_reason and ("abort" if out.finish_reason == "abort" else "length")
            delta = Delta([], "", [], reason, first, out.token_time)
            c.finish_reason = reason
        else:
            delta = Delta(out.new_token_ids, out.new_text, out.new_logprobs, out.finish_reason, first, out.token_time)
            c.add(out)
        c.num_cached_tokens = out.num_cached_tokens
        if out.finished:
            c.timeline = out.timeline
        return delta

    async def run(self) -> list[Choice]:
        """Non-streaming: every choice to the end."""
        async for _ in self.events():
            pass
        return self.choices

    def usage(self) -> dict:
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(len(c.token_ids) for c in self.choices)
        n = len(self.choices) // len(self.prompts)
        cached = sum(self.choices[p * n].num_cached_tokens for p in range(len(self.prompts)))
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
