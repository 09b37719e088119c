"""Structured output: a request's StructuredOutputsParams -> an llguidance grammar -> a matcher
that masks the tokens the structure does not allow, one step at a time.

llguidance (no dependencies, CPU wheels, a Rust parser that computes a 49k-token mask in tens of
microseconds) was chosen over xgrammar (pulls triton) and outlines-core (regex/JSON only, no Lark
grammars). Both processes use this module: the server compiles every grammar once, under
COMPILE_TIMEOUT_S, to answer 400 on a bad schema, regex or grammar; the engine compiles it again,
off its step loop, into matchers (an LRU of pristine matchers keyed by the grammar, copied per
request).

JSON output has fixed separators (", " and ": ") and no other whitespace, so a model cannot loop
on whitespace; unsupported JSON-schema keywords are errors, not silently ignored.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import torch

from llmserve.errors import InvalidRequestError
from llmserve.sampling import StructuredOutputsParams

COMPILE_TIMEOUT_S = 10.0
CACHE_ENTRIES = 256
JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
_SHIFTS = torch.arange(32, dtype=torch.int32)


def grammar_of(so: StructuredOutputsParams) -> str:
    """llguidance's grammar text for `so` (not yet checked: see GrammarCompiler.check)."""
    from llguidance import LLMatcher, gbnf_to_lark

    kind = so.kind()
    if kind in ("json", "json_object"):
        schema: Any = {"type": "object"} if kind == "json_object" else so.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise InvalidRequestError(f"the JSON schema is not valid JSON: {e}", "structured_outputs.json") from None
        if not isinstance(schema, dict):
            raise InvalidRequestError("the JSON schema must be an object", "structured_outputs.json")
        return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(so.regex or "")
    if kind == "choice":
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in so.choice or []))
    text = so.grammar or ""
    if "::=" in text:  # GBNF (llama.cpp's format)
        try:
            text = gbnf_to_lark(text)
        except Exception as e:  # its own parse errors
            raise InvalidRequestError(f"the GBNF grammar does not parse: {e}", "structured_outputs.grammar") from None
    return LLMatcher.grammar_from_lark(text)


class GrammarCompiler:
    """Grammars for one tokenizer (its JSON text) and vocabulary (the model's logits width)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.tokenizer_json, self.vocab_size, self.eos_token_ids = tokenizer_json, vocab_size, eos_token_ids
        self._tokenizer = None
        self._lock = threading.Lock()
        self._pristine: OrderedDict[str, Any] = OrderedDict()  # grammar -> unused LLMatcher

    @property
    def tokenizer(self):
        """llguidance's view of the vocabulary (built once, ~1 s)."""
        with self._lock:
            if self._tokenizer is None:
                from llguidance import LLTokenizer

                eos = list(self.eos_token_ids) or None
                self._tokenizer = LLTokenizer(self.tokenizer_json, n_vocab=self.vocab_size, eos_token=eos)
            return self._tokenizer

    def check(self, so: StructuredOutputsParams, param: str = "structured_outputs") -> str:
        """The grammar for `so`, compiled once against the vocabulary; 400 naming `param` if it
        does not compile (a malformed schema, an unsupported keyword, a bad regex or grammar)."""
        grammar = grammar_of(so)
        pristine = self._pristine_matcher(grammar)
        if pristine.is_error():
            raise InvalidRequestError(f"{param}: {_first_line(pristine.get_error())}", param)
        return grammar

    def matcher(self, grammar: str):
        """A fresh matcher for one request (in an error state if the grammar does not compile)."""
        return self._pristine_matcher(grammar).deep_copy()

    def _pristine_matcher(self, grammar: str):
        """The cached, never-advanced matcher of `grammar` (compiled on a miss)."""
        from llguidance import LLMatcher

        with self._lock:
            pristine = self._pristine.get(grammar)
            if pristine is not None:
                self._pristine.move_to_end(grammar)
                return pristine
        pristine = LLMatcher(self.tokenizer, grammar, log_level=0)  # releases the GIL while it compiles
        with self._lock:
            self._pristine[grammar] = pristine
            while len(self._pristine) > CACHE_ENTRIES:
                self._pristine.popitem(last=False)
        return pristine


def fill_bitmask(matchers: list, vocab_size: int) -> torch.Tensor:
    """[len(matchers), ceil(vocab / 32)] int32: bit j of word w allows token 32 * w + j."""
    words = (vocab_size + 31) // 32
    mask = torch.empty(len(matchers), words, dtype=torch.int32)
    for i, m in enumerate(matchers):
        m.unsafe_compute_mask_ptr(mask[i].data_ptr(), words * 4)
    return mask


def apply_bitmask(logits: torch.Tensor, mask: torch.Tensor) -> None:
    """In place: -inf where the mask's bit is 0. logits [R, vocab] fp32, mask [R, words] int32."""
    vocab = logits.shape[-1]
    allowed = ((mask.unsqueeze(-1) >> _SHIFTS) & 1).view(mask.shape[0], -1)[:, :vocab]
    logits.masked_fill_(allowed == 0, float("-inf"))


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0][:500] if text.strip() else "the grammar does not compile"
