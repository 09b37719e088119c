"""CUDA graph bookkeeping, on the CPU (llmserve.engine.cuda_graphs): the capture sizes, which
steps replay a graph and of what size, and the padded static inputs. A padded decode step
through the engine's own model and KV cache gives the real rows' logits of the unpadded step and
writes no byte outside the real rows' slots."""

from __future__ import annotations

import os
from dataclasses import replace

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # the Triton kernels on CPU tensors (read when they are defined)

import pytest  # noqa: E402

from llmserve import LLM, SamplingParams, kernels  # noqa: E402
from llmserve.config import EngineConfig  # noqa: E402
from llmserve.engine.cuda_graphs import (  # noqa: E402
    PAD_SLOT_ID,
    StaticDecodeInputs,
    cudagraph_capture_sizes,
    graph_batch_size,
    padded_batch_size,
)
from llmserve.engine.model_runner import LoRAInput  # noqa: E402
from llmserve.model.attention import attend, write_kv_cache  # noqa: E402
from llmserve.model.config import ModelConfig  # noqa: E402
from llmserve.plan import CpuInfo, GpuInfo, build_plan, gpu_plan  # noqa: E402

SIZES_256 = cudagraph_capture_sizes(256)


@pytest.mark.parametrize("max_num_seqs,want", [
    (1, (1,)), (3, (1, 2, 3)), (8, (1, 2, 4, 8)), (12, (1, 2, 4, 8, 12)),
    (64, (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)),
    (50, (1, 2, 4, 8, 16, 24, 32, 40, 48, 50)),
    (72, (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 72)),
    (100, (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 100)),
])
def test_capture_sizes_step_by_8_to_64_then_16_and_end_at_max_num_seqs(max_num_seqs, want):
    assert cudagraph_capture_sizes(max_num_seqs) == want


def test_capture_sizes_for_256_and_a_bad_max():
    assert SIZES_256[:4] == (1, 2, 4, 8) and SIZES_256[-1] == 256 and len(SIZES_256) == 4 + 7 + 12
    steps = [b - a for a, b in zip(SIZES_256[3:], SIZES_256[4:], strict=False)]
    assert steps == [8] * 7 + [16] * 12
    with pytest.raises(ValueError):
        cudagraph_capture_sizes(0)


@pytest.mark.parametrize("rows,want", [(1, 1), (2, 2), (3, 4), (5, 8), (8, 8), (9, 16), (63, 64), (64, 64),
                                       (65, 80), (241, 256), (256, 256), (257, None), (0, None)])
def test_a_batch_takes_the_smallest_size_that_holds_it(rows, want):
    assert padded_batch_size(rows, SIZES_256) == want


def test_the_plan_reports_enforce_eager_and_the_sizes_graphs_would_take():
    cpu = CpuInfo("a CPU", frozenset({"avx2", "fma"}), 2)
    gpu = GpuInfo("NVIDIA H100", bf16=True, memory=80 << 30)
    on_gpu = gpu_plan(EngineConfig(max_num_seqs=12), cpu, gpu).cudagraph_mode
    assert on_gpu.value == "none" and "1 2 4 8 12 rows" in on_gpu.reason
    assert gpu_plan(EngineConfig(enforce_eager=True), cpu, gpu).cudagraph_mode.reason.startswith("--enforce-eager")
    model = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 64,
                                   "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                                   "num_key_value_heads": 2})
    on_cpu = build_plan(EngineConfig(compile="none", attention_backend="torch"), model, cpu, False, {}).cudagraph_mode
    assert (on_cpu.value, on_cpu.reason) == ("none", "CUDA graphs run on NVIDIA GPUs only")
    eager = build_plan(EngineConfig(compile="none", attention_backend="torch", enforce_eager=True), model, cpu, False, {})
    assert eager.cudagraph_mode.reason == "--enforce-eager"


# --- steps of a real engine ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def steps(tiny_model):
    """Every step of a short run over the tiny model: (ModelInput as the CPU runs it, the same step
    laid out for the one Triton kernel, the KV caches before it). Two requests prefill, decode,
    then a third arrives (a mixed step) and all three decode."""
    llm = LLM(tiny_model, dtype="float32", compile="none", num_blocks=64, max_num_seqs=8, num_threads=1)
    eng, runner = llm.engine, llm.engine.runner
    prepare, record = runner.prepare, []

    def recording(out):
        inp = prepare(out)
        runner.unified_attention = True
        unified = prepare(out)
        runner.unified_attention = False
        record.append((inp, unified, [c.clone() for c in runner.kv_caches]))
        return inp

    runner.prepare = recording
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    eng.add_request("a", list(range(3, 23)), params)
    eng.add_request("b", list(range(40, 57)), params)
    for _ in range(2):
        eng.step()
    eng.add_request("c", list(range(100, 140)), params)
    while eng.has_unfinished_requests():
        eng.step()
    return runner, record


def _kinds(record):
    """(prefill-only, mixed, pure decode) steps, as ModelInputs."""
    inps = [r[0] for r in record]
    prefill = [i for i in inps if i.meta.prefills and not i.meta.num_decodes]
    mixed = [i for i in inps if i.meta.prefills and i.meta.num_decodes]
    decode = [i for i in inps if not i.meta.prefills]
    return prefill, mixed, decode


def test_pure_decode_steps_get_a_size_and_the_others_none(steps):
    _, record = steps
    prefill, mixed, decode = _kinds(record)
    assert prefill and mixed and decode
    sizes = cudagraph_capture_sizes(8)
    for inp, unified, _ in record:
        got = graph_batch_size(inp, sizes)
        assert graph_batch_size(unified, sizes) == got  # either layout of the step
        if inp.meta.prefills:
            assert got is None
        else:
            assert got == {1: 1, 2: 2, 3: 4}[inp.meta.num_decodes]
    three = next(i for i in decode if i.meta.num_decodes == 3)
    assert graph_batch_size(three, (1, 2)) is None  # more rows than the largest size
    req = three.sample_requests[0]
    assert graph_batch_size(replace(three, prompt_rows=[(req, 0, 7)]), sizes) is None  # needs every hidden state
    lora = LoRAInput(torch.full((3,), -1), 1)
    assert graph_batch_size(replace(three, lora=lora), sizes) is None


def test_fill_pads_rows_a_previous_larger_step_left_behind():
    from llmserve.engine.model_runner import ModelInput
    from llmserve.model.attention import AttentionMetadata

    buf = StaticDecodeInputs(8, 4)
    for t in (buf.input_ids, buf.positions, buf.slot_mapping, buf.seq_lens, buf.block_tables):
        t.fill_(9)  # what a step of 8 rows left
    meta = AttentionMetadata(torch.tensor([33, 50]), 2, torch.tensor([[2], [3]]), torch.tensor([2, 3]), [])
    inp = ModelInput(torch.tensor([5, 6]), torch.tensor([1, 2]), meta, [0, 1], [], [])
    got = buf.fill(inp, 4)
    assert got.input_ids.tolist() == [5, 6, 0, 0] and got.positions.tolist() == [1, 2, 0, 0]
    assert got.meta.slot_mapping.tolist() == [33, 50, PAD_SLOT_ID, PAD_SLOT_ID]
    assert got.meta.decode_seq_lens.tolist() == [2, 3, 0, 0] and got.meta.num_decodes == 4
    assert got.meta.decode_block_tables.tolist() == [[2, 0, 0, 0], [3, 0, 0, 0], [0] * 4, [0] * 4]
    assert got.input_ids.data_ptr() == buf.input_ids.data_ptr()  # views of the static storage
    assert got.meta.prefill_batch is None and got.logit_rows == [0, 1]
    with pytest.raises(ValueError):
        buf.fill(inp, 1)
    with pytest.raises(ValueError):
        buf.fill(inp, 9)


def _backends():
    return ["torch"] + (["native"] if kernels.load() else []) + ([] if torch.cuda.is_available() else ["triton"])


@pytest.mark.parametrize("layout", ["split", "unified"])
@pytest.mark.parametrize("backend", _backends())
def test_a_padded_decode_step_gives_the_real_rows_logits_and_writes_only_their_slots(steps, backend, layout, monkeypatch):
    """triton: the CUDA kernels a captured graph would replay, interpreted, in place of the native ones."""
    runner, record = steps
    if backend == "triton":
        from llmserve.kernels import triton_attention as ta

        for name in ("paged_attention", "paged_decode_attention", "reshape_and_cache"):
            monkeypatch.setattr(torch.ops.llmserve, name, getattr(ta, name))
    model = runner.model
    step = next(r for r in record if not r[0].meta.prefills and r[0].meta.num_decodes == 3)
    inp = step[1] if layout == "unified" else step[0]
    before = step[2]
    bs = runner.block_size
    real_slots = set(inp.meta.slot_mapping.tolist())
    num_blocks = before[0].shape[1]
    assert not {s // bs for s in real_slots} & {0, num_blocks - 1}  # slot -1 taken as an index would hit one
    static = StaticDecodeInputs(8, -(-128 // bs))
    native = model.layers[0].self_attn.attn.native  # as the engine's plan set it
    model.use_native_attention(backend != "torch")
    try:
        runner.kv_caches = [c.clone() for c in before]
        with torch.inference_mode():
            _, want = runner.forward(inp)
        unpadded = runner.kv_caches
        runner.kv_caches = [c.clone() for c in before]
        with torch.inference_mode():
            hidden, got = runner.forward(static.fill(inp, 8))  # 3 real rows, 5 padded
        padded = runner.kv_caches
    finally:
        model.use_native_attention(native)
        runner.kv_caches = [c.clone() for c in before]
    assert got.shape == want.shape == (3, model.config.vocab_size)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)
    assert torch.isfinite(hidden).all()  # padded rows attend to nothing and give zeros, not NaN
    real = torch.tensor(sorted(real_slots))
    for b4, a, p in zip(before, unpadded, padded, strict=True):
        flat_b, flat_a, flat_p = (x.view(2, -1, *x.shape[3:]) for x in (b4, a, p))
        others = torch.ones(flat_b.shape[1], dtype=torch.bool)
        others[real] = False
        assert torch.equal(flat_p[:, others], flat_b[:, others])  # every other slot, the null block's too
        assert torch.allclose(flat_p[:, real], flat_a[:, real], atol=1e-5, rtol=1e-4)
        assert not torch.equal(flat_p[:, real], flat_b[:, real])  # the real rows were written


def test_the_torch_cache_write_and_decode_attention_ignore_padded_rows():
    """The pure-torch implementations keep the contract of the native and Triton ones."""
    from llmserve.model.attention import AttentionMetadata

    g = torch.Generator().manual_seed(0)
    kv = torch.randn(2, 5, 4, 2, 8, generator=g)
    k, v = torch.randn(3, 2, 8, generator=g), torch.randn(3, 2, 8, generator=g)
    before = kv.clone()
    write_kv_cache(kv, torch.tensor([-1, 6, -1]), k, v)
    flat, flat_before = kv.view(2, 20, 2, 8), before.view(2, 20, 2, 8)
    assert torch.equal(flat[0, 6], k[1]) and torch.equal(flat[1, 6], v[1])
    flat[:, 6] = flat_before[:, 6]
    assert torch.equal(kv, before)
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(2, 4, 8, generator=g).to(dtype)
        meta = AttentionMetadata(torch.tensor([5, -1]), 2, torch.tensor([[1, 2], [0, 0]]), torch.tensor([6, 0]), [])
        out = attend(q, None, None, kv[0].to(dtype), kv[1].to(dtype), meta, 0.35, native=False)
        assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isfinite(out[0]).all()
