"""Sampler: logits [N, vocab] (fp32) of the rows that sample this step -> one token id each.

Order per row: the structured-output mask (one batched op over the constrained rows; the other
rows are untouched), logit_bias, min_tokens (ban EOS/stop ids), repetition/presence/frequency
penalties, then greedy argmax, or temperature -> top_k -> top_p -> min_p -> a draw. Logprobs are
those of the raw model distribution (before any processing), as vLLM reports them.

A draw is argmax(probs / Exp(1) noise), which samples exactly from `probs`. A request with a seed
draws its noise from its own generator, advanced once per token, so its output is the same
whatever else shares the batch.

verify() checks a decode's drafts (speculative decoding, engine/spec_decode.py): row i of its
logits gives target token y_i, drawn exactly as a plain step would draw it; drafts are accepted
while they equal y_i, and the generator is rewound to one draw per emitted token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve.engine.request import Request, TokenLogprobs
from llmserve.sampling import SamplingParams
from llmserve.structured import apply_bitmask, fill_bitmask


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class Sampler:
    def __init__(self, seed: int = 0):
        self.default_generator = torch.Generator().manual_seed(seed)
        self.generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        params = [r.sampling_params for r in requests]
        want_logprobs = [p.logprobs is not None for p in params]
        raw_logp = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None
        logits = self._process(logits, requests)
        tokens = logits.argmax(dim=-1)
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if sampled:
            tokens[sampled] = self._draw(logits[sampled], [requests[i] for i in sampled])
        token_list = tokens.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(requests)
        if raw_logp is not None:
            for i, p in enumerate(params):
                if want_logprobs[i]:
                    logprobs[i] = top_logprobs(raw_logp[i], token_list[i], p.logprobs or 0)
        return SamplerOutput(token_list, logprobs)

    def verify(self, logits: torch.Tensor, req: Request, drafts: list[int]) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits [len(drafts) + 1, vocab] of one decode row with drafts -> (the accepted drafts
        and the token after them, their logprobs). Only for spec_decode.eligible requests: the
        processing of each row does not depend on the tokens before it."""
        p = req.sampling_params
        raw_logp = torch.log_softmax(logits, dim=-1) if p.logprobs is not None else None
        if _needs_processing(req):
            logits = logits.clone()
            for row in logits:
                _process_row(row, req)
        if p.greedy:
            targets = logits.argmax(dim=-1).tolist()
        else:
            generator = self._generator(req)
            state = generator.get_state()
            targets = self._draw(logits, [req] * len(logits)).tolist()
        m = 0
        while m < len(drafts) and drafts[m] == targets[m]:
            m += 1
        tokens = targets[: m + 1]
        if not p.greedy:  # the draws after the last emitted token were never used: take them back
            generator.set_state(state)
            scratch = torch.empty(logits.shape[-1], dtype=logits.dtype)
            for _ in tokens:
                scratch.exponential_(generator=generator)
        lps = [None if raw_logp is None else top_logprobs(raw_logp[i], t, p.logprobs or 0) for i, t in enumerate(tokens)]
        return tokens, lps

    def _process(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        constrained = [i for i, r in enumerate(requests) if r.matcher is not None]
        rows = [i for i, r in enumerate(requests) if _needs_processing(r)]
        if not rows and not constrained:
            return logits
        logits = logits.clone()
        if constrained:
            mask = fill_bitmask([requests[i].matcher for i in constrained], logits.shape[-1])
            picked = logits[constrained]
            apply_bitmask(picked, mask)
            logits[constrained] = picked
        for i in rows:
            _process_row(logits[i], requests[i])
        return logits

    def _draw(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        # logits: [S, vocab] for the rows that sample
        temps = torch.tensor([r.sampling_params.temperature for r in requests], dtype=logits.dtype)
        logits = logits / temps[:, None]
        logits = _apply_top_k_top_p(logits, [r.sampling_params for r in requests])
        probs = torch.softmax(logits, dim=-1)
        min_p = torch.tensor([r.sampling_params.min_p for r in requests], dtype=probs.dtype)
        if (min_p > 0).any():
            probs = probs.masked_fill(probs < min_p[:, None] * probs.amax(-1, keepdim=True), 0.0)
        noise = torch.empty_like(probs)
        for j, r in enumerate(requests):
            noise[j].exponential_(generator=self._generator(r))
        return (probs / noise).argmax(dim=-1)

    def _generator(self, r: Request) -> torch.Generator:
        seed = r.sampling_params.seed
        if seed is None:
            return self.default_generator
        g = self.generators.get(r.request_id)
        if g is None:
            g = self.generators[r.request_id] = torch.Generator().manual_seed(seed)
        return g


def _needs_processing(r: Request) -> bool:
    p = r.sampling_params
    return bool(
        p.logit_bias
        or len(r.output_token_ids) < p.min_tokens
        or p.repetition_penalty != 1.0
        or p.presence_penalty
        or p.frequency_penalty
    )


def _process_row(row: torch.Tensor, r: Request) -> None:
    """In place on one row [vocab]."""
    p = r.sampling_params
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
        row[ids] += torch.tensor(list(p.logit_bias.values()), dtype=row.dtype)
    if len(r.output_token_ids) < p.min_tokens:
        banned = [t for t in (*r.eos_token_ids, *p.stop_token_ids) if t < row.shape[0]]
        row[banned] = float("-inf")
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(r.all_token_ids)), dtype=torch.long)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and r.output_token_ids:
        ids, counts = torch.unique(torch.tensor(r.output_token_ids), return_counts=True)
        row[ids] -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty


def _apply_top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    vocab = logits.shape[-1]
    top_k = torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params])
    top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype)
    if bool((top_k >= logits.shape[-1]).all()) and bool((top_p >= 1.0).all()):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1])[None, :]
    drop = rank >= top_k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    drop |= (probs.cumsum(-1) - probs) >= top_p[:, None]  # keep the smallest set reaching top_p
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def top_logprobs(logp: torch.Tensor, token_id: int, n: int) -> TokenLogprobs:
    """logp: [vocab] log-probabilities; the chosen token's logprob and the n best."""
    top: list[tuple[int, float]] = []
    if n > 0:
        vals, ids = logp.topk(n)
        top = list(zip(ids.tolist(), vals.tolist(), strict=True))
    return TokenLogprobs(token_id, float(logp[token_id]), top)
