"""LLM: the offline API. `LLM(model=None, **engine_options).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence

from llmserve.config import EngineConfig, from_sources
from llmserve.engine.engine_core import LLMEngine
from llmserve.engine.outputs import CompletionOutput, GenerationOutput, RequestOutput
from llmserve.sampling import SamplingParams

Prompt = str | list[int]


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The i-th of n samples: n=1, and a distinct seed when the request has one."""
    seed = None if params.seed is None else params.seed + index
    return dataclasses.replace(params, n=1, seed=seed)


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
    ) -> list[GenerationOutput]:
        """Run all prompts together (continuous batching); one output per prompt, in order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = sampling_params or SamplingParams()
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        results, children = [], {}
        for prompt, p in zip(prompts, plist, strict=True):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            out = GenerationOutput(f"gen-{next(self._ids)}", prompt if isinstance(prompt, str) else None, ids, [])
            for i in range(p.n):
                rid = f"{out.request_id}-{i}"
                req = self.engine.add_request(rid, ids, child_params(p, i))
                out.outputs.append(CompletionOutput(i, "", [], None))
                children[rid] = (out, i, req)
            results.append(out)
        while self.engine.has_unfinished_requests():
            for o in self.engine.step():
                if on_output is not None:
                    on_output(o)
                out, i, req = children[o.request_id]
                c = out.outputs[i]
                c.text += o.new_text
                if o.finished:
                    c.token_ids, c.finish_reason, c.stop_reason = list(req.output_token_ids), o.finish_reason, o.stop_reason
                    c.logprobs = list(req.logprobs) if req.sampling_params.logprobs is not None else None
                    out.num_cached_tokens = o.num_cached_tokens
                    if req.sampling_params.prompt_logprobs is not None:
                        out.prompt_logprobs = list(req.prompt_logprobs)
        return results

    def get_stats(self):
        return self.engine.get_stats()
