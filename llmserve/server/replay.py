"""Response-cache records <-> engine outputs: a finished choice's RequestOutputs become a
CachedChoice, and a hit becomes the same RequestOutputs again, so a replayed response goes
through the very code (deltas, SSE chunks, usage) that formatted the original.
"""

from __future__ import annotations

from llmserve.cache.response_cache import LP, CachedChoice, CachedStep
from llmserve.engine.outputs import RequestOutput
from llmserve.engine.request import Request, TokenLogprobs


def _to_lp(lp: TokenLogprobs) -> LP:
    return (lp.token_id, lp.logprob, list(lp.top))


def _from_lp(lp: LP) -> TokenLogprobs:
    return TokenLogprobs(lp[0], lp[1], list(lp[2]))


def record_choice(outputs: list[RequestOutput], request: Request) -> CachedChoice:
    """outputs: every engine output of one finished (stop or length) request, in order."""
    last = outputs[-1]
    assert last.finish_reason in ("stop", "length"), "only finished, unaborted choices are cached"
    steps = [CachedStep(list(o.new_token_ids), o.new_text, [_to_lp(x) for x in o.new_logprobs]) for o in outputs]
    prompt_lps = None
    if request.sampling_params.prompt_logprobs is not None:
        prompt_lps = [None if x is None else _to_lp(x) for x in request.prompt_logprobs]
    return CachedChoice(steps, last.finish_reason, last.stop_reason, last.num_cached_tokens, prompt_lps)  # type: ignore[arg-type]


def replay_choice(choice: CachedChoice, req: Request, now: float) -> list[RequestOutput]:
    """The outputs the engine gave for `choice`, re-addressed to `req` (whose timeline and
    prompt logprobs are filled in as if it had run, at time `now`)."""
    if choice.prompt_logprobs is not None:
        req.prompt_logprobs = [None if x is None else _from_lp(x) for x in choice.prompt_logprobs]
    tl = req.timeline
    tl.first_scheduled = tl.finished = now
    outputs = []
    for i, s in enumerate(choice.steps):
        last = i == len(choice.steps) - 1
        for t in s.token_ids:
            req.append_output_token(t)
            tl.token_times.append(now)
        outputs.append(RequestOutput(
            req.request_id, list(s.token_ids), s.text, [_from_lp(x) for x in s.logprobs], last,
            choice.finish_reason if last else None, choice.stop_reason if last else None,
            req.num_prompt_tokens, len(req.output_token_ids), choice.num_cached_tokens, req,
        ))
    return outputs
