"""What the engine admits: its fixed limits (EngineInfo, known once it has started) and one
validated EngineCoreRequest. The checks live here once, so the server refuses a request (a typed
4xx) before anything crosses to the engine process, and the engine applies the very same rules."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmserve.errors import InvalidRequestError, PromptTooLongError
from llmserve.lora.adapter import BaseShapes
from llmserve.lora.request import LoRARequest
from llmserve.sampling import SamplingParams


@dataclass(slots=True, frozen=True)
class EngineInfo:
    model_name: str  # as the API reports it
    model_dir: str  # the resolved HF folder (tokenizer, chat template)
    fingerprint: str  # model + dtype + quantization: response-cache keys
    vocab_size: int
    max_model_len: int
    block_size: int
    num_kv_blocks: int  # usable KV blocks (the null block excluded)
    eos_token_ids: tuple[int, ...]
    pid: int  # of the process that runs the engine
    execution_plan: dict[str, dict[str, str]] = field(default_factory=dict)  # ExecutionPlan.as_dict()
    scheduling_policy: str = "fcfs"  # fcfs | priority
    max_loras: int = 0  # distinct LoRA adapters in one batch; 0: LoRA is off (--enable-lora)
    max_lora_rank: int = 0
    lora_base: BaseShapes | None = None  # what an adapter must fit (the server checks adapters against it)


@dataclass(slots=True)
class EngineCoreRequest:
    """A request as the engine core receives it: validated, max_tokens resolved."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int
    arrival_time: float  # time.time(); the clock both processes share
    priority: int = 0  # lower runs first (--scheduling-policy priority)
    lora_request: LoRARequest | None = None  # the adapter it runs under; None: the base model


def make_core_request(
    info: EngineInfo, request_id: str, prompt_token_ids: list[int], params: SamplingParams, arrival_time: float,
    priority: int = 0, lora_request: LoRARequest | None = None,
) -> EngineCoreRequest:
    """Check a request against the engine's limits (typed errors); resolves max_tokens."""
    params.check_vocab(info.vocab_size)
    check_priority(info, priority)
    if lora_request is not None and not info.max_loras:
        raise InvalidRequestError("LoRA adapters need the server started with --enable-lora", "model")
    n_prompt = len(prompt_token_ids)
    if n_prompt == 0:
        raise InvalidRequestError("the prompt is empty", "prompt")
    if any(not (0 <= t < info.vocab_size) for t in prompt_token_ids):
        raise InvalidRequestError(f"prompt token ids must be in [0, {info.vocab_size})", "prompt")
    max_tokens = params.max_tokens if params.max_tokens is not None else info.max_model_len - n_prompt
    if n_prompt + max(max_tokens, 1) > info.max_model_len:
        raise PromptTooLongError(
            f"this model's maximum context length is {info.max_model_len} tokens; the request has "
            f"{n_prompt} prompt tokens and max_tokens {max_tokens} ({n_prompt + max_tokens} in total)",
            "prompt" if n_prompt >= info.max_model_len else "max_tokens",
        )
    if -(-(n_prompt + max_tokens) // info.block_size) > info.num_kv_blocks:
        raise PromptTooLongError(
            f"the request needs {n_prompt + max_tokens} tokens of KV cache; the cache holds "
            f"{info.num_kv_blocks * info.block_size}", "max_tokens",
        )
    return EngineCoreRequest(request_id, list(prompt_token_ids), params, max_tokens, arrival_time, priority, lora_request)


def check_priority(info: EngineInfo, priority: object) -> None:
    """An integer; other than 0 only under --scheduling-policy priority (as vLLM)."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise InvalidRequestError(f"priority must be an integer, got {type(priority).__name__}", "priority")
    if priority != 0 and info.scheduling_policy != "priority":
        raise InvalidRequestError("priority other than 0 needs the server started with --scheduling-policy priority",
                                  "priority")
