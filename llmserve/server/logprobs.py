"""Logprob records (TokenLogprobs) in the shapes the OpenAI API returns them.

Completions: {"tokens": [str], "token_logprobs": [float | null], "top_logprobs": [{str: float} | null],
"text_offset": [int]} (the first prompt token of an echo has no logprob: null).
Chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}.
"""

from __future__ import annotations

from collections.abc import Sequence

from llmserve.engine.outputs import TokenLogprobs
from llmserve.tokenizer import Tokenizer

FLOOR = -9999.0  # OpenAI's stand-in for -inf (JSON has no infinities)


def clean(x: float) -> float:
    return x if x > FLOOR else FLOOR  # also maps NaN to FLOOR


class TokenNamer:
    """Token id -> the string shown in logprobs (vLLM's `token_id:N` form on request)."""

    def __init__(self, tokenizer: Tokenizer, as_ids: bool = False):
        self.tokenizer = tokenizer
        self.as_ids = as_ids

    def __call__(self, token_id: int) -> str:
        if self.as_ids:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(
    name: TokenNamer, token_ids: Sequence[int], lps: Sequence[TokenLogprobs | None], offset: int
) -> tuple[dict, int]:
    """The completions logprobs object for these tokens, and the text offset after them."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for tid, lp in zip(token_ids, lps, strict=False):
        s = name(tid)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        if lp is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(clean(lp.logprob))
        top = {name(t): clean(v) for t, v in lp.top}
        top.setdefault(s, clean(lp.logprob))  # as vLLM: the chosen token is always listed
        top_logprobs.append(top)
    body = {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}
    return body, offset


def merge_completion_logprobs(a: dict, b: dict) -> dict:
    return {k: a[k] + b[k] for k in a}


def chat_logprobs(name: TokenNamer, token_ids: Sequence[int], lps: Sequence[TokenLogprobs]) -> list[dict]:
    def entry(tid: int, logprob: float) -> dict:
        s = name(tid)
        return {"token": s, "logprob": clean(logprob), "bytes": list(s.encode("utf-8"))}

    return [
        {**entry(tid, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
        for tid, lp in zip(token_ids, lps, strict=False)
    ]
