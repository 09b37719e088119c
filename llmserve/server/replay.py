"""Response-cache records <-> engine outputs: a finished choice's RequestOutputs become a
CachedChoice, and a hit becomes the same RequestOutputs again, so a replayed response goes
through the very code (deltas, SSE chunks, usage) that formatted the original.
"""

from __future__ import annotations

from llmserve.cache.response_cache import CachedChoice, CachedStep
from llmserve.engine.client import EngineCoreRequest
from llmserve.engine.outputs import RequestOutput, Timeline, TokenLogprobs


def record_choice(outputs: list[RequestOutput], prompt_logprobs: list[TokenLogprobs | None] | None) -> CachedChoice:
    """outputs: every engine output of one finished (stop or length) request, in order;
    prompt_logprobs: what the engine sent, when the request asked for them."""
    last = outputs[-1]
    assert last.finish_reason in ("stop", "length"), "only finished, unaborted choices are cached"
    steps = [CachedStep(o.new_token_ids, o.new_text, o.new_logprobs) for o in outputs]
    return CachedChoice(steps, last.finish_reason, last.stop_reason, last.num_cached_tokens, prompt_logprobs)  # type: ignore[arg-type]


def replay_choice(choice: CachedChoice, req: EngineCoreRequest, now: float, same_prompt: bool = True) -> list[RequestOutput]:
    """The outputs the engine gave for `choice`, re-addressed to `req`, as if it had run at `now`;
    same_prompt False (a semantic hit): none of req's prompt tokens came from the prefix cache.
    The lists are the record's own (a decoded record is used once; the LRU keeps bytes)."""
    num_cached = choice.num_cached_tokens if same_prompt else 0
    num_tokens = sum(len(s.token_ids) for s in choice.steps)
    timeline = Timeline(req.arrival_time, now, [now] * num_tokens, now)
    outputs, n_out = [], 0
    for i, s in enumerate(choice.steps):
        last = i == len(choice.steps) - 1
        n_out += len(s.token_ids)
        outputs.append(RequestOutput(
            req.request_id, s.token_ids, s.text, s.logprobs, last,
            choice.finish_reason if last else None, choice.stop_reason if last else None,
            len(req.prompt_token_ids), n_out, num_cached, now,
            choice.prompt_logprobs if i == 0 else None, timeline if last else None,
        ))
    return outputs
