"""The CUDA attention kernels (Triton) against a float64 reference: every row of a mixed step
(decode rows, a padded decode row, a fresh chunk, a continued chunk, a padding chunk), the
KV-cache write, and the engine's greedy tokens with every step's attention in them. Without a GPU
they run on CPU tensors under Triton's interpreter; its bf16 tl.dot is broken, so bf16 is
checked on a GPU only (scripts/gpu_check.sh runs this file there too)."""

import os

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are defined, so before their import

import pytest  # noqa: E402
from test_engine_reference import prompts, reference  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from llmserve import LLM, SamplingParams  # noqa: E402
from llmserve.kernels import triton_attention as ta  # noqa: E402

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=4e-3, rtol=1e-2),
       torch.bfloat16: dict(atol=3e-2, rtol=5e-2)}
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def _step(heads, kvh, hd, dtype, block_size, seed=0):
    """A cache with random contents and a mixed step over it: decodes of context 1, 19 and 40, a
    padded decode row (length 0), a fresh chunk of 13, a continued chunk of 9 (context 37) and a
    padding chunk."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = 40
    k_cache = torch.randn(num_blocks, block_size, kvh, hd, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kvh, hd, generator=g).to(dtype)
    free = iter(torch.randperm(num_blocks - 1, generator=g).add(1).tolist())  # block 0: the null block

    def table(n_tokens, width):
        blocks = [next(free) for _ in range(-(-n_tokens // block_size))]
        return blocks + [0] * (width - len(blocks))

    dec_lens = [1, 19, 40, 0]
    width = -(-40 // block_size)
    dec_tables = torch.tensor([table(n, width) for n in dec_lens])
    chunks = [(13, 13), (9, 37), (0, 0)]  # (query_len, context_len)
    pwidth = -(-37 // block_size) + 1
    p_tables = torch.tensor([table(c, pwidth) for _, c in chunks])
    starts, t = [], len(dec_lens)
    for n, _ in chunks:
        starts.append(t if n else 0)
        t += n
    q = torch.randn(t, heads, hd, generator=g).to(dtype)
    step = dict(block_tables=dec_tables, seq_lens=torch.tensor(dec_lens), query_start=torch.tensor(starts),
                query_len=torch.tensor([n for n, _ in chunks]), context_len=torch.tensor([c for _, c in chunks]),
                prefill_tables=p_tables)
    return q, k_cache, v_cache, step


def _reference(q, k_cache, v_cache, step, scale):
    """float64: each row attends to positions 0..its own of its sequence's blocks."""
    kvh, bs = k_cache.shape[2], k_cache.shape[1]
    g = q.shape[1] // kvh
    out = torch.zeros(q.shape, dtype=torch.float64)
    rows = [(i, table, n - 1) for i, (table, n) in enumerate(zip(step["block_tables"], step["seq_lens"].tolist(), strict=True))]
    for s, n, c, table in zip(step["query_start"].tolist(), step["query_len"].tolist(), step["context_len"].tolist(),
                              step["prefill_tables"], strict=True):
        rows += [(s + i, table, c - n + i) for i in range(n)]
    for row, table, pos in rows:
        if pos < 0:
            continue
        slots = [table[p // bs].item() * bs + p % bs for p in range(pos + 1)]
        keys = k_cache.reshape(-1, kvh, k_cache.shape[3])[slots].double().repeat_interleave(g, 1)  # [L, H, hd]
        vals = v_cache.reshape(-1, kvh, v_cache.shape[3])[slots].double().repeat_interleave(g, 1)
        probs = torch.softmax(torch.einsum("hd,lhd->hl", q[row].double(), keys) * scale, -1)
        out[row] = torch.einsum("hl,lhd->hd", probs, vals)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kvh"), [(2, 2), (6, 2)])  # GQA groups 1 and 3
@pytest.mark.parametrize("hd", [64, 128])
def test_mixed_step_matches_float64_reference(dtype, heads, kvh, hd):
    q, k_cache, v_cache, step = _step(heads, kvh, hd, dtype, block_size=8)
    scale = hd**-0.5
    on = {name: t.to(DEVICE) for name, t in step.items()}
    out = ta.paged_attention(q.to(DEVICE), None, None, k_cache.to(DEVICE), v_cache.to(DEVICE), scale=scale, **on).cpu()
    ref = _reference(q, k_cache, v_cache, step, scale)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, **TOL[dtype])
    assert out[3].eq(0).all()  # the padded decode row read nothing


def test_a_block_size_that_is_not_a_power_of_two():
    q, k_cache, v_cache, step = _step(6, 2, 64, torch.float32, block_size=24, seed=4)
    on = {name: t.to(DEVICE) for name, t in step.items()}
    out = ta.paged_attention(q.to(DEVICE), None, None, k_cache.to(DEVICE), v_cache.to(DEVICE), scale=0.125, **on).cpu()
    torch.testing.assert_close(out.double(), _reference(q, k_cache, v_cache, step, 0.125), **TOL[torch.float32])


def test_decode_op_matches_the_decode_rows_of_a_step():
    q, k_cache, v_cache, step = _step(6, 2, 64, torch.float32, block_size=16, seed=1)
    d = step["block_tables"].shape[0]
    out = ta.paged_decode_attention(q[:d].to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE),
                                    step["block_tables"].to(DEVICE), step["seq_lens"].to(DEVICE), 0.125).cpu()
    ref = _reference(q, k_cache, v_cache, {**step, "query_len": torch.zeros(3, dtype=torch.long)}, 0.125)
    torch.testing.assert_close(out.double(), ref[:d], **TOL[torch.float32])


def test_cache_write_converts_and_skips_negative_slots():
    g = torch.Generator().manual_seed(2)
    kv_cache = torch.zeros(2, 6, 4, 2, 64, dtype=torch.float16, device=DEVICE)
    qkv = torch.randn(3, 3 * 2 * 64, generator=g)  # k and v as views out of a fused projection
    k, v = qkv[:, 128:256].view(3, 2, 64), qkv[:, 256:].view(3, 2, 64)
    ta.reshape_and_cache(k.to(DEVICE), v.to(DEVICE), kv_cache, torch.tensor([5, -1, 22], device=DEVICE))
    flat = kv_cache.cpu().view(2, -1, 2, 64)
    torch.testing.assert_close(flat[0, [5, 22]], k[[0, 2]].half())
    torch.testing.assert_close(flat[1, [5, 22]], v[[0, 2]].half())
    written = torch.zeros(24, dtype=torch.bool)
    written[[5, 22]] = True
    assert flat[:, ~written].eq(0).all()  # the row with slot -1 wrote nothing


def test_engine_with_triton_attention_gives_transformers_tokens(tiny_model, monkeypatch):
    """Mixed steps of decodes, fresh and continued chunks (a 32-token budget chunks the longer
    prompts), every row through llmserve::paged_attention."""
    if DEVICE == "cuda":
        llm = LLM(tiny_model, device="cuda", dtype="float32", max_num_batched_tokens=32)
    else:  # the Triton kernels in place of the native CPU ones, interpreted
        for name in ("paged_attention", "reshape_and_cache"):
            monkeypatch.setattr(torch.ops.llmserve, name, getattr(ta, name))
        llm = LLM(tiny_model, dtype="float32", compile="none", max_num_batched_tokens=32)
        llm.engine.runner.unified_attention = True
    ref = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    ps = prompts(6, seed=3, lo=3, hi=70)
    outs = llm.generate(ps, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    for p, o in zip(ps, outs, strict=True):
        expect, scores = reference(ref, p, 10)
        if o.token_ids != expect:
            i = next(i for i, (a, b) in enumerate(zip(o.token_ids, expect, strict=True)) if a != b)
            top2 = scores[i].topk(2).values
            assert float(top2[0] - top2[1]) < 1e-3, f"first divergence at {i} is not a near-tie"
    assert llm.engine.get_stats().num_blocks_used == 0
