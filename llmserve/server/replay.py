"""Response-cache records <-> engine outputs: a finished choice's RequestOutputs become a
CachedChoice, and a hit becomes the same RequestOutputs again, so a replayed response goes
through the very code (deltas, SSE chunks, usage) that formatted the original.
"""

from __future__ import annotations

from llmserve.cache.response_cache import LP, CachedChoice, CachedStep
from llmserve.engine.client import EngineCoreRequest
from llmserve.engine.outputs import RequestOutput, Timeline, TokenLogprobs


def _to_lp(lp: TokenLogprobs) -> LP:
    return (lp.token_id, lp.logprob, list(lp.top))


def _from_lp(lp: LP) -> TokenLogprobs:
    return TokenLogprobs(lp[0], lp[1], list(lp[2]))


def record_choice(outputs: list[RequestOutput], prompt_logprobs: list[TokenLogprobs | None] | None) -> CachedChoice:
    """outputs: every engine output of one finished (stop or length) request, in order;
    prompt_logprobs: what the engine sent, when the request asked for them."""
    last = outputs[-1]
    assert last.finish_reason in ("stop", "length"), "only finished, unaborted choices are cached"
    steps = [CachedStep(list(o.new_token_ids), o.new_text, [_to_lp(x) for x in o.new_logprobs]) for o in outputs]
    prompt_lps = None if prompt_logprobs is None else [None if x is None else _to_lp(x) for x in prompt_logprobs]
    return CachedChoice(steps, last.finish_reason, last.stop_reason, last.num_cached_tokens, prompt_lps)  # type: ignore[arg-type]


def replay_choice(choice: CachedChoice, req: EngineCoreRequest, now: float, same_prompt: bool = True) -> list[RequestOutput]:
    """The outputs the engine gave for `choice`, re-addressed to `req`, as if it had run at `now`;
    same_prompt False (a semantic hit): none of req's prompt tokens came from the prefix cache."""
    num_cached = choice.num_cached_tokens if same_prompt else 0
    prompt_lps = None if choice.prompt_logprobs is None else [None if x is None else _from_lp(x) for x in choice.prompt_logprobs]
    num_tokens = sum(len(s.token_ids) for s in choice.steps)
    timeline = Timeline(req.arrival_time, now, [now] * num_tokens, now)
    outputs, n_out = [], 0
    for i, s in enumerate(choice.steps):
        last = i == len(choice.steps) - 1
        n_out += len(s.token_ids)
        outputs.append(RequestOutput(
            req.request_id, list(s.token_ids), s.text, [_from_lp(x) for x in s.logprobs], last,
            choice.finish_reason if last else None, choice.stop_reason if last else None,
            len(req.prompt_token_ids), n_out, num_cached, now,
            prompt_lps if i == 0 else None, timeline if last else None,
        ))
    return outputs
