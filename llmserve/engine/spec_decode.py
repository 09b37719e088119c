"""Speculative decoding by n-gram prompt lookup (--speculative-method ngram).

Proposal. For a running sequence whose tokens are t[0..L), find the most recent earlier
occurrence of its last n tokens (n from prompt_lookup_max down to prompt_lookup_min) and propose
the up-to-K tokens that followed it. NgramIndex keeps, per n, the latest end position of every
n-gram seen, and indexes only the tokens added since the last lookup: O(new tokens) per step.

Verification (ModelRunner + Sampler.verify). The row becomes K+1 decode rows [last, d1..dK] at
consecutive positions on the sequence's blocks, row i seeing start + i + 1 tokens (causal inside
the row; the same kernel, compiled graph and numerics as a plain decode). Position i yields target token y_i, sampled exactly as a plain
decode step would sample it (greedy argmax, or the request's own noise draw); d_{i+1} is
accepted while it equals y_i, and the first y_i that differs is emitted as the correction (or
y_K as a bonus when every draft matched). For a deterministic draft this is the standard
rejection rule: d is accepted with probability p(d), and a rejection emits a draw from p without
d, renormalised; drawing y_i with the request's generator also keeps seeded output identical,
token for token, to a run without speculation.

Bookkeeping. Only accepted tokens are appended, hashed into prefix-cache blocks or written to
the Redis tier: the rejected positions' K/V lies beyond num_computed_tokens and is overwritten by
the next step.

Auto off. No speculation when more than max_batch sequences run, nor for requests whose
sampling depends on the tokens before each position (structured output, repetition/presence/
frequency penalties, min_tokens not reached yet) or that opted out. Below max_batch, a sequence
speculates only while it pays: StepCost fits decode step time = fixed + per_row x rows to the
engine's recent decode steps, and K more rows for one of b sequences raise throughput only if
that sequence's drafts are accepted at more than b * per_row * K / (fixed + per_row * b) tokens
per check (its running mean, `SeqSpec.accepted`). A sequence below that pauses PAUSE_STEPS
steps, then checks once more. The fitted costs and the thresholds they give are logged.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import asdict, dataclass, field

from llmserve.engine.request import Request
from llmserve.errors import InvalidRequestError

logger = logging.getLogger("llmserve.engine")
PAUSE_STEPS = 16  # a sequence whose drafts do not pay waits this long before it checks again
EMA = 0.3  # weight of the newest check in a sequence's mean accepted drafts
ROW_COST_GUESS = 0.05  # per_row / fixed before any fit: one more row costs 5% of a step


@dataclass(slots=True)
class SpecConfig:
    num_speculative_tokens: int = 4  # K
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    max_batch: int = 8  # no speculation with more running sequences

    def validate(self) -> None:
        if not 1 <= self.num_speculative_tokens <= 16:
            raise InvalidRequestError("--num-speculative-tokens must be in [1, 16]", "num_speculative_tokens")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 16:
            raise InvalidRequestError("need 1 <= --prompt-lookup-min <= --prompt-lookup-max <= 16", "prompt_lookup_min")


class NgramIndex:
    """ngram (tuple) -> the position right after its latest occurrence, for n in [lo, hi]."""

    def __init__(self, lo: int, hi: int):
        self.lo, self.hi = lo, hi
        self.last_end: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending at positions <= indexed - 1 are in the map

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix."""
        end = len(tokens)
        for e in range(max(self.indexed, 1), end):  # index what arrived since the last call
            for n in range(self.lo, min(self.hi, e) + 1):
                self.last_end[tuple(tokens[e - n : e])] = e
        self.indexed = max(self.indexed, end)
        for n in range(min(self.hi, end - 1), self.lo - 1, -1):
            e = self.last_end.get(tuple(tokens[end - n :]))
            if e is not None:
                return tokens[e : e + k]
        return []


class StepCost:
    """Decode step seconds ~ fixed + per_row * rows, least squares over the last `window`
    decode-only steps (None until the steps vary in size)."""

    def __init__(self, window: int = 256):
        self.samples: deque[tuple[int, float]] = deque(maxlen=window)

    def observe(self, rows: int, seconds: float) -> None:
        self.samples.append((rows, seconds))

    def fit(self) -> tuple[float, float] | None:
        n = len(self.samples)
        if n < 16:
            return None
        mx = sum(r for r, _ in self.samples) / n
        my = sum(s for _, s in self.samples) / n
        var = sum((r - mx) ** 2 for r, _ in self.samples)
        if var < 1e-9:
            return None
        per_row = max(sum((r - mx) * (s - my) for r, s in self.samples) / var, 0.0)
        return max(my - per_row * mx, 1e-4), per_row

    def threshold(self, batch: int, k: int, fit: tuple[float, float] | None) -> float:
        """Accepted drafts per check above which k drafts for one of `batch` sequences pay."""
        fixed, per_row = fit or (1.0, ROW_COST_GUESS)
        return batch * per_row * k / (fixed + per_row * batch)


@dataclass(slots=True)
class SeqSpec:
    index: NgramIndex
    accepted: float  # running mean of accepted drafts per check (optimistic at first)
    paused_until: int = 0  # a step number


@dataclass(slots=True)
class SpecStats:
    num_drafts: int = 0  # verification rows
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_length_counts: list[int] = field(default_factory=list)  # [i]: rows that accepted i drafts

    def as_dict(self) -> dict:
        return asdict(self)


class NgramProposer:
    def __init__(self, config: SpecConfig):
        config.validate()
        self.config = config
        self.seqs: dict[str, SeqSpec] = {}
        self.stats = SpecStats(accepted_length_counts=[0] * (config.num_speculative_tokens + 1))
        self.step = 0
        self.batch = 1  # sequences running this step
        self.cost = StepCost()
        self.fit: tuple[float, float] | None = None
        self._logged: tuple[float, float] | None = None
        logger.info("speculative decoding: ngram, K=%d, n in [%d, %d], off above %d running sequences",
                    config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max, config.max_batch)

    def begin_step(self, num_running: int) -> bool:
        """Whether this step speculates at all."""
        self.step += 1
        self.batch = num_running
        if self.step % 64 == 0:
            self._refit()
        return num_running <= self.config.max_batch

    def observe_step(self, rows: int, seconds: float) -> None:
        """A decode-only step of `rows` rows took `seconds`."""
        self.cost.observe(rows, seconds)

    def _refit(self) -> None:
        self.fit = self.cost.fit()
        if self.fit is None or (self._logged and all(abs(a - b) <= 0.2 * b for a, b in zip(self.fit, self._logged, strict=True))):
            return
        self._logged = self.fit
        k = self.config.num_speculative_tokens
        thresholds = ", ".join(f"{b}: {self.cost.threshold(b, k, self.fit):.2f}" for b in (1, 2, 4, 8) if b <= self.config.max_batch)
        logger.info("speculative decoding: a decode step takes %.1f ms + %.2f ms per row; a sequence speculates while "
                    "it accepts more drafts per check than (by running sequences) %s", self.fit[0] * 1e3, self.fit[1] * 1e3, thresholds)

    def propose(self, req: Request, max_new: int) -> list[int]:
        """Drafts for one decode row, at most max_new (the tokens it may still produce, minus the
        one it makes anyway); [] when the request cannot or should not speculate."""
        k = min(self.config.num_speculative_tokens, max_new)
        if k <= 0 or not eligible(req):
            return []
        seq = self.seqs.get(req.request_id)
        if seq is None:
            index = NgramIndex(self.config.prompt_lookup_min, self.config.prompt_lookup_max)
            seq = self.seqs[req.request_id] = SeqSpec(index, accepted=self.config.num_speculative_tokens / 2)
        if self.step < seq.paused_until:
            return []
        if seq.accepted <= self.cost.threshold(self.batch, k, self.fit):
            seq.paused_until = self.step + PAUSE_STEPS
            seq.accepted = self.cost.threshold(self.batch, k, self.fit) + 1e-6  # the next check decides alone
            return []
        return seq.index.propose(req.all_token_ids, k)

    def record(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += num_drafts
        s.num_accepted_tokens += num_accepted
        s.accepted_length_counts[num_accepted] += 1
        seq = self.seqs.get(request_id)
        if seq is not None:
            seq.accepted = (1 - EMA) * seq.accepted + EMA * num_accepted

    def forget(self, request_id: str) -> None:
        self.seqs.pop(request_id, None)


def eligible(req: Request) -> bool:
    """Whether the tokens at every draft position can be sampled from that position's logits alone."""
    p = req.sampling_params
    return (p.speculative and req.matcher is None and p.repetition_penalty == 1.0 and not p.presence_penalty
            and not p.frequency_penalty and len(req.output_token_ids) >= p.min_tokens)
