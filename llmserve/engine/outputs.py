"""Records the engine hands to its callers."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmserve.engine.request import Request, TokenLogprobs


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
    request: Request  # read-only view for timelines and prompt logprobs


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None


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
    kv_store: dict = field(default_factory=dict)
