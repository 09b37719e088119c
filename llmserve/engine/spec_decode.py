"""Speculative decoding by n-gram prompt lookup (--speculative-method ngram).

Proposal. For a running sequence whose tokens are t[0..L), find the most recent earlier
occurrence of its last n tokens (n from prompt_lookup_max down to prompt_lookup_min) and propose
the up-to-K tokens that followed it. NgramIndex keeps, per n, the latest end position of every
n-gram seen, and indexes only the tokens added since the last lookup: O(new tokens) per step.

Verification (ModelRunner + Sampler.verify). The row becomes a K+1-token query [last, d1..dK] at
consecutive positions, causal inside the row, over the sequence's cached past (the attention
path of a continued prefill). Position i yields target token y_i, sampled exactly as a plain
decode step would sample it (greedy argmax, or the request's own noise draw); d_{i+1} is
accepted while it equals y_i, and the first y_i that differs is emitted as the correction (or
y_K as a bonus when every draft matched). For a deterministic draft this is the standard
rejection rule: d is accepted with probability p(d), and a rejection emits a draw from p without
d, renormalised; drawing y_i with the request's generator also keeps seeded output identical,
token for token, to a run without speculation.

Bookkeeping. Only accepted tokens are appended, hashed into prefix-cache blocks or written to
the Redis tier: the rejected positions' K/V lies beyond num_computed_tokens and is overwritten by
the next step.

Auto off. No speculation when more than max_batch sequences run (the step is compute-bound and
the extra query tokens cost more than they save), for requests whose sampling depends on the
tokens before each position (structured output, repetition/presence/frequency penalties,
min_tokens not reached yet) or that opted out, and, per sequence, after a run of proposals that
were mostly rejected (it retries after a pause).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from llmserve.engine.request import Request

logger = logging.getLogger("llmserve.engine")
# a sequence whose last LOW_WINDOW proposals averaged under LOW_ACCEPTANCE accepted tokens each
# stops proposing for PAUSE_STEPS steps
LOW_WINDOW, LOW_ACCEPTANCE, PAUSE_STEPS = 4, 0.5, 16


@dataclass(slots=True)
class SpecConfig:
    num_speculative_tokens: int = 4  # K
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    max_batch: int = 8  # no speculation with more running sequences

    def validate(self) -> None:
        from llmserve.errors import InvalidRequestError

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


@dataclass(slots=True)
class SeqSpec:
    index: NgramIndex
    recent: list[int] = field(default_factory=list)  # accepted drafts of the last proposals
    paused_until: int = 0  # a step number


@dataclass(slots=True)
class SpecStats:
    num_drafts: int = 0  # verification rows
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_length_counts: list[int] = field(default_factory=list)  # [i]: rows that accepted i drafts

    def as_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens, "accepted_length_counts": list(self.accepted_length_counts)}


class NgramProposer:
    def __init__(self, config: SpecConfig):
        config.validate()
        self.config = config
        self.seqs: dict[str, SeqSpec] = {}
        self.stats = SpecStats(accepted_length_counts=[0] * (config.num_speculative_tokens + 1))
        self.step = 0
        logger.info("speculative decoding: ngram, K=%d, n in [%d, %d], off above %d running sequences",
                    config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max, config.max_batch)

    def begin_step(self, num_running: int) -> bool:
        """Whether this step speculates at all."""
        self.step += 1
        return num_running <= self.config.max_batch

    def propose(self, req: Request, max_new: int) -> list[int]:
        """Drafts for one decode row, at most max_new (the tokens it may still produce, minus the
        one it makes anyway); [] when the request cannot or should not speculate."""
        k = min(self.config.num_speculative_tokens, max_new)
        if k <= 0 or not eligible(req):
            return []
        seq = self.seqs.get(req.request_id)
        if seq is None:
            seq = self.seqs[req.request_id] = SeqSpec(NgramIndex(self.config.prompt_lookup_min, self.config.prompt_lookup_max))
        if self.step < seq.paused_until:
            return []
        return seq.index.propose(req.all_token_ids, k)

    def record(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += num_drafts
        s.num_accepted_tokens += num_accepted
        s.accepted_length_counts[num_accepted] += 1
        seq = self.seqs.get(request_id)
        if seq is None:
            return
        seq.recent = (seq.recent + [num_accepted])[-LOW_WINDOW:]
        if len(seq.recent) == LOW_WINDOW and sum(seq.recent) / LOW_WINDOW < LOW_ACCEPTANCE:
            seq.paused_until, seq.recent = self.step + PAUSE_STEPS, []

    def forget(self, request_id: str) -> None:
        self.seqs.pop(request_id, None)


def eligible(req: Request) -> bool:
    """Whether the tokens at every draft position can be sampled from that position's logits alone."""
    p = req.sampling_params
    return (p.speculative and req.matcher is None and p.repetition_penalty == 1.0 and not p.presence_penalty
            and not p.frequency_penalty and len(req.output_token_ids) >= p.min_tokens)
