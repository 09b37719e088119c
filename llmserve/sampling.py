"""SamplingParams: what a request asks of the sampler, validated once at the edge."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from llmserve.errors import InvalidRequestError

MAX_LOGPROBS = 20
MAX_CHOICES = 1024


@dataclass(slots=True)
class StructuredOutputsParams:
    """Output held to a structure by a token mask (vLLM's names); exactly one field is set.

    json: a JSON schema (dict, or its JSON text); json_object: any JSON object; regex: the whole
    output matches it; choice: the output is one of these strings; grammar: a Lark grammar
    (llguidance's dialect, e.g. `start: "yes" | "no"`) or a GBNF one (with `::=`)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def kind(self) -> str:
        """The one field that is set; InvalidRequestError otherwise."""
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        _check(len(given) == 1, f"structured_outputs needs exactly one of json, regex, choice, grammar, json_object; got {given or 'none'}",
               "structured_outputs")
        kind = given[0]
        if kind == "choice":
            _check(isinstance(self.choice, list) and 0 < len(self.choice) <= MAX_CHOICES and all(isinstance(c, str) and c for c in self.choice),
                   f"structured_outputs.choice must be a list of 1 to {MAX_CHOICES} non-empty strings", "structured_outputs.choice")
        elif kind == "json":
            _check(isinstance(self.json, (dict, str)), "structured_outputs.json must be a JSON schema (an object)", "structured_outputs.json")
        elif kind in ("regex", "grammar"):
            _check(isinstance(getattr(self, kind), str) and getattr(self, kind), f"structured_outputs.{kind} must be a non-empty string",
                   f"structured_outputs.{kind}")
        return kind


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16  # None: up to the context length
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0): disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # top-N logprobs per generated token
    prompt_logprobs: int | None = None  # top-N logprobs per prompt token (echo)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    speculative: bool = True  # False: never verify drafts for this request (speculative decoding)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        if self.top_k == 0:
            self.top_k = -1
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def deterministic(self) -> bool:
        return self.greedy or self.seed is not None

    def validate(self) -> None:
        _check(isinstance(self.n, int) and 1 <= self.n <= 128, "n must be an integer in [1, 128]", "n")
        _check(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
            f"max_tokens must be at least 1, got {self.max_tokens}",
            "max_tokens",
        )
        _check(_num(self.temperature) and 0 <= self.temperature <= 100, f"temperature must be in [0, 100], got {self.temperature}", "temperature")
        _check(_num(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        _check(isinstance(self.top_k, int) and -1 <= self.top_k < 2**31, f"top_k must be -1 (off) or a positive integer, got {self.top_k}", "top_k")
        _check(_num(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        _check(_num(self.repetition_penalty) and 0 < self.repetition_penalty <= 10, f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}", "repetition_penalty")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _check(_num(v) and -2 <= v <= 2, f"{name} must be in [-2, 2], got {v}", name)
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens must be >= 0", "min_tokens")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens must not exceed max_tokens", "min_tokens")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            _check(v is None or (isinstance(v, int) and 0 <= v <= MAX_LOGPROBS), f"{name} must be in [0, {MAX_LOGPROBS}]", name)
        _check(
            self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool) and -(2**63) <= self.seed < 2**64),
            "seed must be an integer in [-2^63, 2^64)", "seed",
        )
        _check(all(isinstance(s, str) for s in self.stop) and len(self.stop) <= 16, "stop must be a string or a list of at most 16 strings", "stop")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids must be non-negative integers", "stop_token_ids")
        if self.logit_bias:
            _check(all(_num(b) and -100 <= b <= 100 for b in self.logit_bias.values()), "logit_bias values must be in [-100, 100]", "logit_bias")
        if self.structured_outputs is not None:
            self.structured_outputs.kind()

    def check_vocab(self, vocab_size: int) -> None:
        for param, ids in (("logit_bias", list(self.logit_bias or {})), ("stop_token_ids", self.stop_token_ids)):
            for tid in ids:
                _check(0 <= tid < vocab_size, f"{param}: token id {tid} is outside the vocabulary (size {vocab_size})", param)

    def canonical(self) -> dict:
        """A stable dict of everything that changes the output (for cache keys): 0 and 0.0 agree."""
        d = asdict(self)
        del d["speculative"]  # speculation never changes the output
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            d[name] = float(d[name])
        d["logit_bias"] = sorted((t, float(b)) for t, b in (self.logit_bias or {}).items())
        return d


def _num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v  # rejects NaN


def _check(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise InvalidRequestError(message, param)


@dataclass(slots=True, frozen=True)
class Sample:
    """One engine request behind an API request: sample `index` of the n for its prompt."""

    index: int  # prompt_index * n + sample index, as OpenAI numbers choices
    prompt_index: int
    request_id: str  # "<parent id>-<index>"
    params: SamplingParams  # n=1; seed + sample index when the request has a seed


def fan_out(request_id: str, num_prompts: int, params: SamplingParams) -> list[Sample]:
    """The n samples of each prompt as separate engine requests (the one place n is expanded)."""
    samples = []
    for p in range(num_prompts):
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            idx = p * params.n + i
            samples.append(Sample(idx, p, f"{request_id}-{idx}", replace(params, n=1, seed=seed)))
    return samples
