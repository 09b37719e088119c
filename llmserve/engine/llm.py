"""LLM: the offline API. `LLM(model=None, **engine_options).generate(prompts, SamplingParams(...))`.
With `LLM(..., enable_lora=True)`, generate takes `lora_request=LoRARequest(name, id, path)`, one
for all prompts or one (or None: the base model) per prompt, as vLLM.
It drives the engine in process (no engine-core process, no IPC). `with LLM(...) as llm:` closes
it at the end (the Redis KV tier's queued writes are sent first)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

from llmserve.config import EngineConfig, from_sources
from llmserve.engine.llm_engine import LLMEngine
from llmserve.engine.outputs import CompletionOutput, GenerationOutput, RequestOutput
from llmserve.lora.request import LoRARequest
from llmserve.sampling import SamplingParams, fan_out

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str | None = None, **engine_options):
        self.engine = LLMEngine(from_sources(EngineConfig, env={}, model=model, **engine_options))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        on_output: Callable[[RequestOutput], None] | None = None,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[GenerationOutput]:
        """Run all prompts together (continuous batching); one output per prompt, in order.
        priority: one per prompt, lower first (needs scheduling_policy="priority"), as vLLM."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = sampling_params or SamplingParams()
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        loras = list(lora_request) if isinstance(lora_request, Sequence) else [lora_request] * len(prompts)
        results, children = [], {}
        for prompt, p, prio, lora in zip(prompts, plist, priority or [0] * len(prompts), loras, strict=True):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            out = GenerationOutput(f"gen-{next(self._ids)}", prompt if isinstance(prompt, str) else None, ids, [])
            for s in fan_out(out.request_id, 1, p):
                self.engine.add_request(s.request_id, ids, s.params, priority=prio, lora_request=lora)
                out.outputs.append(CompletionOutput(s.index, logprobs=[] if p.logprobs is not None else None))
                children[s.request_id] = (out, s.index)
            results.append(out)
        while self.engine.has_unfinished_requests():
            for o in self.engine.step():
                if on_output is not None:
                    on_output(o)
                out, i = children[o.request_id]
                out.outputs[i].add(o)
                if o.prompt_logprobs is not None:
                    out.prompt_logprobs = o.prompt_logprobs
                if o.finished:
                    out.num_cached_tokens = o.num_cached_tokens
        return results

    def get_stats(self):
        return self.engine.get_stats(memory=True)

    def close(self) -> None:
        """Flush the Redis KV tier's queued writes and close its connections (see LLMEngine.close)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
