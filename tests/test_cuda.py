"""The engine on an NVIDIA GPU (--device cuda): greedy tokens equal transformers' on the same GPU,
bf16 logits within the CPU tests' tolerance, no block left in use after aborts. Skipped without
a GPU; scripts/gpu_check.sh runs them on one (with tests/test_triton_attention.py)."""

import pytest
import torch
from test_compile_quant import run_prefill
from test_engine_reference import prompts, reference
from transformers import AutoModelForCausalLM

from llmserve import LLM, SamplingParams
from llmserve.model.loader import load_model

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (scripts/gpu_check.sh)")]
GREEDY = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("preset", ["tiny", "smollm2-135m-shape"])
def test_greedy_tokens_equal_transformers_on_the_gpu(model_factory, preset):
    path = model_factory(preset)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().cuda()
    ps = prompts(16, seed=7, lo=3, hi=200)
    llm = LLM(path, device="cuda", dtype="float32", max_num_batched_tokens=256, max_model_len=512, max_num_seqs=16)
    outs = llm.generate(ps, GREEDY)  # 16 at once: mixed steps of decodes and chunks
    for p, o in zip(ps, outs, strict=True):
        with torch.no_grad():
            got = ref.generate(torch.tensor([p], device="cuda"), max_new_tokens=48, min_new_tokens=48, do_sample=False,
                               eos_token_id=None, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
        expect, scores = got.sequences[0, len(p):].tolist(), torch.stack(got.scores)[:, 0]
        if o.token_ids != expect:
            i = next(i for i, (a, b) in enumerate(zip(o.token_ids, expect, strict=True)) if a != b)
            top2 = scores[i].topk(2).values
            assert float(top2[0] - top2[1]) < 1e-3, f"first divergence at {i} is not a near-tie"


def test_bfloat16_logits_within_tolerance_on_the_gpu(tiny_model):
    from llmserve.kernels.triton_attention import (
        register_cuda_ops,  # imported here: see test_triton_attention
    )

    register_cuda_ops()
    ids = torch.tensor(list(range(3, 40)))
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(tiny_model, dtype).cuda()
        model.use_native_attention(True)
        out[dtype] = run_prefill(model, ids, dtype, device="cuda")
    diff = out[torch.bfloat16] - out[torch.float32]
    assert diff.norm() / out[torch.float32].norm() <= 2e-2
    assert (out[torch.bfloat16].argmax(-1) == out[torch.float32].argmax(-1)).float().mean() >= 0.9


def test_no_block_in_use_after_aborts_on_the_gpu(tiny_model):
    eng = LLM(tiny_model, device="cuda", dtype="float32").engine
    for i, p in enumerate(prompts(6, seed=5, lo=20, hi=90)):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    for _ in range(5):
        eng.step()
    eng.abort_request("r0")
    eng.abort_request("r3")
    while eng.has_unfinished_requests():
        eng.step()
    stats = eng.get_stats()
    assert stats.num_blocks_used == 0 and stats.num_running == stats.num_waiting == 0


def test_cpu_and_gpu_greedy_agree(tiny_model):
    ps = prompts(4, seed=9, lo=10, hi=60)
    cpu = [o.token_ids for o in LLM(tiny_model, device="cpu", dtype="float32").generate(ps, GREEDY)]
    gpu = [o.token_ids for o in LLM(tiny_model, device="cuda", dtype="float32").generate(ps, GREEDY)]
    ref = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    for p, a, b in zip(ps, cpu, gpu, strict=True):
        if a != b:  # only a near-tie may differ
            i = next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
            top2 = reference(ref, p, i + 1)[1][i].topk(2).values
            assert float(top2[0] - top2[1]) < 1e-3
