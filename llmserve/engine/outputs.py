"""Records the engine hands to its callers: plain copies, never a live Request, so they cross a
process boundary (engine/messages.py) as they are."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import msgspec


class TokenLogprobs(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """One sampled token's logprob and the best alternatives (also stored by the response cache)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # [(token_id, logprob)] best first


@dataclass(slots=True)
class Timeline:
    """Wall-clock timestamps (time.time()) of one request's life."""

    arrival: float
    first_scheduled: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished: float | None = None


@dataclass(slots=True)
class RequestOutput:
    """What one engine step produced for one request (a delta), plus totals when finished."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprobs]
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    token_time: float  # time.time() when new_token_ids were sampled (one step: one time)
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # on the request's first output, when asked
    timeline: Timeline | None = None  # a copy, on the finished output


@dataclass(slots=True)
class CompletionOutput:
    """One output sequence, accumulated from its RequestOutput deltas (add)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None  # None: not asked for

    def add(self, out: RequestOutput) -> None:
        """Append one delta (the one accumulator: LLM.generate and the server's choices); a
        finished output also sets the reasons."""
        self.text += out.new_text
        self.token_ids += out.new_token_ids
        if self.logprobs is not None:
            self.logprobs += out.new_logprobs
        if out.finished:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class GenerationOutput:
    """LLM.generate's result for one prompt. text/token_ids/... mirror outputs[0]."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int = 0

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[TokenLogprobs] | None:
        return self.outputs[0].logprobs


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_blocks_total: int  # usable blocks (the null block excluded)
    num_blocks_free: int
    num_blocks_used: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_steps: int
    kv_store: dict[str, int] = field(default_factory=dict)
    memory: dict[str, int] = field(default_factory=dict)  # the engine's process: llmserve.memory.memory_stats(), in stats asked for only ({} per step)
    spec_decode: dict[str, Any] = field(default_factory=dict)  # spec_decode.SpecStats.as_dict(), {} when off
    by_priority: dict[str, list[int]] = field(default_factory=dict)  # priority -> [running, waiting]; {} under fcfs
    lora: dict[str, Any] = field(default_factory=dict)  # --enable-lora: {"running": [names], "waiting": [names], "max_lora": n}

    @classmethod
    def idle(cls, num_blocks: int = 0) -> EngineStats:
        """An engine that has not stepped yet."""
        return cls(0, 0, num_blocks, num_blocks, 0, 0.0, 0, 0, 0, 0)

    def with_waiting(self, num_waiting: int) -> EngineStats:
        """A copy with num_waiting replaced (the door does this per step: 5x dataclasses.replace's
        speed; the dicts are shared, as replace shares them)."""
        return EngineStats(self.num_running, num_waiting, self.num_blocks_total, self.num_blocks_free, self.num_blocks_used,
                           self.kv_cache_usage, self.prefix_cache_queries, self.prefix_cache_hits, self.num_preemptions,
                           self.num_steps, self.kv_store, self.memory, self.spec_decode, self.by_priority, self.lora)


# with_waiting names every field: one added to EngineStats must be added there too
assert len(fields(EngineStats)) == 15, "EngineStats.with_waiting copies 15 fields"


@dataclass(slots=True)
class StepEvent:
    """What the front end's step listeners (metrics, the dashboard) see of the engine: per batch of
    outputs, or of engine steps reported. Built by the door, never sent over a wire."""

    outputs: list[RequestOutput]  # delivered with this event ([]: none)
    stats: EngineStats  # the engine's, as of this event; num_waiting is the front end's count
    step_durations: list[float] = field(default_factory=list)  # seconds, of engine steps since the last event
    stage_seconds: list[float] = field(default_factory=list)  # those steps' time per profiling.STAGES stage ([]: none)
