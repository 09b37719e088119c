"""Request: one sequence's state inside the engine (pure Python, no torch)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from llmserve.engine.outputs import Timeline, TokenLogprobs
from llmserve.lora.request import LoRARequest
from llmserve.sampling import SamplingParams

__all__ = ["Request", "RequestStatus", "Timeline", "TokenLogprobs"]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # its prefix blocks load from the KV connector
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort")


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved: never None
    eos_token_ids: tuple[int, ...] = ()
    timeline: Timeline = field(default_factory=lambda: Timeline(time.time()))
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)  # prompt + output
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at admission
    num_preemptions: int = 0
    priority: int = 0  # --scheduling-policy priority: lower runs first, ties by arrival
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    matcher: Any = None  # llguidance.LLMatcher of a structured request: it has consumed every output token
    lora_request: LoRARequest | None = None  # the adapter it runs under; None: the base model
    lora_adapter: Any = None  # llmserve.lora.adapter.LoRAAdapter: its weights, read when it was added

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
