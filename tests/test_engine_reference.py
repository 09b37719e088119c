"""Engine output equals transformers' generate, and stays the same under batching, caching and preemption."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from llmserve import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 300) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    lens[0], lens[-1] = lo, hi
    return [torch.randint(3, 1000, (k,), generator=g).tolist() for k in lens]


@pytest.fixture(scope="module")
def ref(tiny_model):
    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


def reference(ref, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    with torch.no_grad():
        out = ref.generate(
            torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
            eos_token_id=None, pad_token_id=0, output_scores=True, return_dict_in_generate=True,
        )
    return out.sequences[0, len(prompt):].tolist(), torch.stack(out.scores)[:, 0]


def test_same_tokens_as_transformers(tiny_model, ref):
    ps = prompts(16)
    outs = LLM(tiny_model, dtype="float32", max_num_batched_tokens=256).generate(ps, GREEDY)
    for p, o in zip(ps, outs, strict=True):
        expect, scores = reference(ref, p, 64)
        assert len(o.token_ids) == 64 and o.finish_reason == "length"
        if o.token_ids != expect:
            i = next(i for i, (a, b) in enumerate(zip(o.token_ids, expect, strict=True)) if a != b)
            top2 = scores[i].topk(2).values
            assert float(top2[0] - top2[1]) < 1e-3, f"first divergence at {i} is not a near-tie"


def test_alone_equals_batched_and_cache_off(tiny_model):
    ps = prompts(16, seed=1)
    batched = [o.token_ids for o in LLM(tiny_model, dtype="float32").generate(ps, GREEDY)]
    alone_llm = LLM(tiny_model, dtype="float32", enable_prefix_caching=False)
    for p, b in zip(ps[:4], batched[:4], strict=True):
        assert alone_llm.generate([p], GREEDY)[0].token_ids == b


def test_prefix_caching_hits_and_same_output(tiny_model):
    shared = prompts(1, seed=2, lo=200, hi=200)[0]
    ps = [shared + [5 + i, 7, 9] for i in range(6)]
    off = [o.token_ids for o in LLM(tiny_model, dtype="float32", enable_prefix_caching=False).generate(ps, GREEDY)]
    llm = LLM(tiny_model, dtype="float32", enable_prefix_caching=True)
    llm.generate(ps[:1], GREEDY)
    on = [o.token_ids for o in llm.generate(ps, GREEDY)]
    assert on == off
    stats = llm.get_stats()
    assert stats.prefix_cache_hits >= 6 * 192  # every request reused the 12 full shared blocks


def test_preemption_keeps_output(tiny_model):
    ps = prompts(8, seed=3, lo=40, hi=120)
    big = [o.token_ids for o in LLM(tiny_model, dtype="float32").generate(ps, GREEDY)]
    small = LLM(tiny_model, dtype="float32", num_blocks=30, block_size=8)  # 29 usable blocks = 232 tokens for 8 requests
    got = [o.token_ids for o in small.generate(ps, GREEDY)]
    assert small.get_stats().num_preemptions > 0
    assert got == big
    assert small.get_stats().num_blocks_used == 0


def test_seeded_sampling_is_batch_invariant(tiny_model):
    ps = prompts(10, seed=4, lo=5, hi=60)
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    llm = LLM(tiny_model, dtype="float32")
    alone = llm.generate([ps[3]], params)[0].token_ids
    in_batch = llm.generate(ps, [SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True)] * 3 + [params] + [SamplingParams(max_tokens=30, temperature=0.7, ignore_eos=True)] * 6)[3].token_ids
    assert alone == in_batch
    other_seed = llm.generate([ps[3]], SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=99, ignore_eos=True))[0].token_ids
    assert other_seed != alone


def test_no_block_leak_after_finish_and_abort(tiny_model):
    llm = LLM(tiny_model, dtype="float32")
    eng = llm.engine
    for i, p in enumerate(prompts(6, seed=5, lo=20, hi=90)):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    for _ in range(5):
        eng.step()
    assert eng.get_stats().num_blocks_used > 0
    eng.abort_request("r0")
    eng.abort_request("r3")
    finished = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                finished[o.request_id] = o.finish_reason
    assert finished["r0"] == finished["r3"] == "abort"
    assert sum(r == "length" for r in finished.values()) == 4
    stats = eng.get_stats()
    assert stats.num_blocks_used == 0 and stats.num_running == stats.num_waiting == 0
