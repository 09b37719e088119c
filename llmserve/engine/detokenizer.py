"""Incremental detokenization with stop strings.

Text is released only when it is final:
- a token that ends inside a multi-byte UTF-8 character decodes to U+FFFD; we wait for the rest;
- any tail of the text that could still grow into a stop string is held back;
- when a stop string appears, the text is cut before it (or after it, with
  include_stop_str_in_output) and the request finishes with reason "stop".
"""

from __future__ import annotations

from llmserve.sampling import SamplingParams
from llmserve.tokenizer import Tokenizer

CONTEXT_TOKENS = 5  # prompt tokens decoded with the output so leading spaces come out right


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.params = params
        self.tokens = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.text = ""  # all decoded output text so far (before any stop cut)
        self.emitted = 0  # characters of self.text already released
        self.stop_string: str | None = None

    def add_token(self, token_id: int) -> str:
        """Feed one output token; returns the newly released text (maybe empty)."""
        if self.stop_string is not None:  # finished: nothing after a stop string is released
            return ""
        self.tokens.append(token_id)
        skip = self.params.skip_special_tokens
        prefix = self.tokenizer.decode(self.tokens[self.prefix_offset : self.read_offset], skip)
        full = self.tokenizer.decode(self.tokens[self.prefix_offset :], skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        return self._release()

    def _release(self) -> str:
        stops = self.params.stop
        if not stops:
            return self._emit(len(self.text))
        hit = self._find_stop()
        if hit is not None:
            idx, s = hit
            self.stop_string = s
            self.text = self.text[: idx + len(s)] if self.params.include_stop_str_in_output else self.text[:idx]
            return self._emit(len(self.text))
        return self._emit(len(self.text) - _held_back(self.text, stops))

    def _find_stop(self) -> tuple[int, str] | None:
        longest = max(len(s) for s in self.stops)
        start = max(0, self.emitted - longest)
        best: tuple[int, str] | None = None
        for s in self.stops:
            i = self.text.find(s, start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        return best

    @property
    def stops(self) -> list[str]:
        return self.params.stop

    def _emit(self, upto: int) -> str:
        upto = max(upto, self.emitted)
        out = self.text[self.emitted : upto]
        self.emitted = upto
        return out

    def flush(self) -> str:
        """At finish: release what was held back (a stop string never matched)."""
        if self.stop_string is None:
            tail = self.tokenizer.decode(self.tokens[self.prefix_offset :], self.params.skip_special_tokens)
            prefix = self.tokenizer.decode(self.tokens[self.prefix_offset : self.read_offset], self.params.skip_special_tokens)
            if len(tail) > len(prefix):  # an unfinished UTF-8 sequence at the very end
                self.text += tail[len(prefix) :]
                self.prefix_offset = self.read_offset = len(self.tokens)
        return self._emit(len(self.text))


def _held_back(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
