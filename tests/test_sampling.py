"""Each sampling parameter has its effect; invalid values raise a typed error with a clear message."""

from __future__ import annotations

import math

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.engine.request import Request
from llmserve.engine.sampler import Sampler
from llmserve.errors import InvalidRequestError

V = 50


def make(params: SamplingParams, prompt=(1, 2, 3), outputs=(), rid="r") -> Request:
    r = Request(rid, list(prompt), params, 10, eos_token_ids=(0,))
    for t in outputs:
        r.append_output_token(t)
    return r


def logits_row(seed: int = 0) -> torch.Tensor:
    return torch.randn(1, V, generator=torch.Generator().manual_seed(seed)) * 3


def draw(params: SamplingParams, logits: torch.Tensor, n: int = 200, **kw) -> list[int]:
    s = Sampler(seed=0)
    return [s(logits, [make(params, **kw)]).token_ids[0] for _ in range(n)]


def test_greedy_and_top_k_1_pick_the_argmax():
    lg = logits_row()
    best = int(lg.argmax())
    assert set(draw(SamplingParams(temperature=0), lg, 5)) == {best}
    assert set(draw(SamplingParams(temperature=1.5, top_k=1), lg)) == {best}


def test_top_k_top_p_min_p_restrict_the_support():
    lg = logits_row(1)
    order = lg[0].argsort(descending=True).tolist()
    assert set(draw(SamplingParams(temperature=2.0, top_k=3), lg, 300)) <= set(order[:3])
    probs = torch.softmax(lg[0], -1)
    cum = probs[order].cumsum(0)
    k = int((cum < 0.5).sum()) + 1
    assert set(draw(SamplingParams(temperature=1.0, top_p=0.5), lg, 300)) <= set(order[:k])
    kept = {i for i in range(V) if probs[i] >= 0.2 * probs.max()}
    assert set(draw(SamplingParams(temperature=1.0, min_p=0.2), lg, 300)) <= kept


def test_temperature_spreads_the_distribution():
    lg = logits_row(2)
    cold = draw(SamplingParams(temperature=0.1), lg, 300)
    hot = draw(SamplingParams(temperature=5.0), lg, 300)
    assert len(set(hot)) > len(set(cold))


def test_sampling_matches_the_distribution():
    lg = torch.tensor([[0.0, math.log(3.0)] + [-1e9] * (V - 2)])  # p = [0.25, 0.75]
    got = draw(SamplingParams(temperature=1.0), lg, 2000)
    assert abs(got.count(1) / 2000 - 0.75) < 0.04


def test_logit_bias_forces_and_bans():
    lg = logits_row(3)
    assert set(draw(SamplingParams(temperature=0, logit_bias={7: 100.0}), lg, 3)) == {7}
    best = int(lg.argmax())
    assert best not in draw(SamplingParams(temperature=0, logit_bias={best: -100.0}), lg, 3)


def test_penalties_push_away_from_seen_tokens():
    lg = torch.zeros(1, V)
    lg[0, 5], lg[0, 6] = 2.0, 1.5
    # token 5 already generated: presence/frequency/repetition penalties make 6 the argmax
    for p in (SamplingParams(temperature=0, presence_penalty=1.0), SamplingParams(temperature=0, frequency_penalty=0.3),
              SamplingParams(temperature=0, repetition_penalty=2.0)):
        assert draw(p, lg, 1, outputs=(5, 5)) == [6]
    assert draw(SamplingParams(temperature=0), lg, 1, outputs=(5, 5)) == [5]


def test_min_tokens_bans_eos_until_reached():
    lg = torch.zeros(1, V)
    lg[0, 0] = 10.0  # EOS is the argmax
    assert draw(SamplingParams(temperature=0, min_tokens=3), lg, 1, outputs=(4,)) != [0]
    assert draw(SamplingParams(temperature=0, min_tokens=3), lg, 1, outputs=(4, 4, 4)) == [0]


def test_logprobs_are_raw_and_top_n_sorted():
    lg = logits_row(4)
    out = Sampler()(lg, [make(SamplingParams(temperature=0, logprobs=5, logit_bias={3: 50.0}))])
    lp = out.logprobs[0]
    ref = torch.log_softmax(lg[0], -1)
    assert lp.token_id == 3 and abs(lp.logprob - float(ref[3])) < 1e-5  # the raw model logprob
    assert [t for t, _ in lp.top] == ref.topk(5).indices.tolist()
    assert all(a[1] >= b[1] for a, b in zip(lp.top, lp.top[1:], strict=False))


def test_seed_reproducible_and_independent_of_neighbours():
    lg = logits_row(5).repeat(3, 1)
    p = SamplingParams(temperature=1.0, seed=7)
    solo, mixed = Sampler(seed=1), Sampler(seed=2)
    alone = [solo(lg[:1], [make(p, rid="x")]).token_ids[0] for _ in range(8)]  # the seed's stream advances
    others = [make(SamplingParams(temperature=1.0), rid="o1"), make(p, rid="x"), make(SamplingParams(temperature=1.0), rid="o2")]
    assert [mixed(lg, others).token_ids[1] for _ in range(8)] == alone
    assert len(set(alone)) > 1


@pytest.mark.parametrize(
    "kwargs, param",
    [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"max_tokens": 0}, "max_tokens"),
     ({"n": 0}, "n"), ({"top_k": -5}, "top_k"), ({"min_p": 2}, "min_p"), ({"presence_penalty": 3}, "presence_penalty"),
     ({"repetition_penalty": 0}, "repetition_penalty"), ({"logprobs": 21}, "logprobs"), ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
     ({"temperature": float("nan")}, "temperature"), ({"stop": [1]}, "stop"), ({"seed": "x"}, "seed")],
)
def test_invalid_values_raise_typed_errors(kwargs, param):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param and param.split("_")[0] in e.value.message


def test_engine_logprobs_and_eos(tiny_model):
    llm = LLM(tiny_model, dtype="float32")
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=8, temperature=0, logprobs=20, ignore_eos=True))[0]
    assert len(out.logprobs) == 8 and all(len(x.top) == 20 for x in out.logprobs)
    assert all(x.token_id == x.top[0][0] for x in out.logprobs)  # greedy picks the best
    eos = llm.engine.eos_token_ids[0]
    forced = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=8, temperature=0, logit_bias={eos: 100.0}))[0]
    assert forced.finish_reason == "stop" and forced.token_ids == [eos]
    ignored = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=8, temperature=0, logit_bias={eos: 100.0}, ignore_eos=True))[0]
    assert ignored.finish_reason == "length" and len(ignored.token_ids) == 8
