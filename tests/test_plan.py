"""The execution plan: each choice for a CPU with and without native bf16, with its reason, and
the plan where a user sees it (the start-up log, /get_server_info)."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys

import pytest
import torch

from llmserve import kernels
from llmserve.config import EngineConfig
from llmserve.errors import InvalidRequestError
from llmserve.model.config import ModelConfig
from llmserve.plan import (
    GEMV_PREFETCH_BYTES,
    GEMV_ROWS,
    CpuInfo,
    DeviceUnavailableError,
    GpuInfo,
    build_plan,
    gpu_plan,
)

AVX2_ONLY = CpuInfo("AMD EPYC (Zen 3)", frozenset("sse4_2 avx avx2 fma f16c".split()), 2)
AVX512_BF16 = CpuInfo("AMD EPYC (Zen 5)", frozenset("avx avx2 fma avx512f avx512bw avx512vl avx512dq avx512_bf16".split()), 2)
SMOLLM2_RAW = {"architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
               "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "tie_word_embeddings": True}
SMOLLM2 = ModelConfig.from_dict(SMOLLM2_RAW)
TINY = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 64,
                              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                              "num_key_value_heads": 2})


def plan(cpu: CpuInfo, model=SMOLLM2, kernels_ok: bool = False, env: dict | None = None, **options):
    return build_plan(EngineConfig(**options), model, cpu, kernels_ok, env or {})


def test_without_native_bf16_auto_picks_float32_and_compiles():
    p = plan(AVX2_ONLY)
    assert (p.dtype.value, p.torch_dtype) == ("float32", torch.float32)
    assert "lacks native bf16" in p.dtype.reason
    assert p.compile.value == "inductor" and "float32" in p.compile.reason
    assert (p.attention_backend.value, p.cpu_isa.value) == ("torch", "none")  # kernels_ok=False
    assert p.kv_cache_dtype.value == "float32"
    assert AVX2_ONLY.isas == ("avx2", "portable") and not AVX2_ONLY.native_bf16


def test_with_native_bf16_auto_picks_bfloat16():
    p = plan(AVX512_BF16)
    assert p.dtype.value == "bfloat16" and p.kv_cache_dtype.value == "bfloat16"
    assert p.compile.value == "inductor"
    assert AVX512_BF16.isas[0] == "avx512"


@pytest.mark.skipif(not kernels.load(), reason="no native kernels (no C++ compiler)")
def test_kv_cache_dtype_auto_is_measured_where_float32_was_chosen_for_speed():
    """AVX2 (this CPU runs that variant whatever it is): the faster cache, measured once and kept
    beside the kernels, so a second plan reads the same figures."""
    first = plan(AVX2_ONLY, kernels_ok=True)
    assert (first.attention_backend.value, first.cpu_isa.value) == ("native", "avx2")
    assert first.kv_cache_dtype.value in ("float32", "bfloat16") and "measured" in first.kv_cache_dtype.reason
    assert plan(AVX2_ONLY, kernels_ok=True).kv_cache_dtype == first.kv_cache_dtype
    assert kernels.build_directory().joinpath("measurements.json").is_file()
    # float32 asked for: float32 numerics, no measurement
    asked = plan(AVX2_ONLY, kernels_ok=True, dtype="float32")
    assert asked.kv_cache_dtype.value == "float32" and "asked for" in asked.kv_cache_dtype.reason


@pytest.mark.skipif(not kernels.load(), reason="no native kernels (no C++ compiler)")
def test_gemv_prefetch_is_the_distance_measured_fastest_and_kept():
    """Where llmserve::gemv runs, its prefetch distance is the fastest of those measured (the
    figures are in the reason), kept beside the kernels so that a second plan reads the same;
    without gemv (pure-torch attention) there is none."""
    first = plan(AVX2_ONLY, kernels_ok=True)
    assert first.linear_backend.value == "onednn-packed+gemv"
    figures = dict(re.findall(r"(\d+) B ([\d.]+) ms", first.gemv_prefetch.reason))
    assert set(figures) == {str(d) for d in GEMV_PREFETCH_BYTES}
    assert float(figures[first.gemv_prefetch.value]) == min(map(float, figures.values()))
    again = plan(AVX2_ONLY, kernels_ok=True)
    assert (again.gemv_prefetch, again.gemv_max_rows) == (first.gemv_prefetch, first.gemv_max_rows)
    without = plan(AVX2_ONLY, kernels_ok=False)
    assert without.gemv_prefetch.value == without.gemv_max_rows.value == "0"


@pytest.mark.skipif(not kernels.load(), reason="no native kernels (no C++ compiler)")
def test_gemv_max_rows_is_the_last_row_count_where_gemv_beat_onednn():
    """Row counts are measured in order; the limit is the last one up to which gemv was never
    slower than oneDNN (the figures are in the reason)."""
    p = plan(AVX2_ONLY, kernels_ok=True)
    figures = {int(m): (float(g), float(o)) for m, g, o in re.findall(r"(\d+) rows ([\d.]+) vs ([\d.]+)", p.gemv_max_rows.reason)}
    assert sorted(figures) == list(GEMV_ROWS)
    wins = [m for m in GEMV_ROWS if figures[m][0] <= figures[m][1]]
    limit = next((GEMV_ROWS[i - 1] if i else 0 for i, m in enumerate(GEMV_ROWS) if m not in wins), GEMV_ROWS[-1])
    assert p.gemv_max_rows.value == str(limit)


def test_explicit_bfloat16_without_native_support_runs_with_one_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="llmserve.plan"):
        p = plan(AVX2_ONLY, dtype="bfloat16")
    assert p.dtype.value == "bfloat16" and p.compile.value == "none"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "several times slower" in warnings[0] and "auto picks float32" in warnings[0]


def test_compile_auto_skips_tiny_models_and_quantized_weights_compile():
    small = plan(AVX512_BF16, model=TINY).compile
    assert small.value == "none" and "M parameters" in small.reason
    assert plan(AVX512_BF16, compile="none").compile == plan(AVX2_ONLY, compile="none").compile
    p = plan(AVX512_BF16, compile="inductor", quantize="int8")
    assert (p.compile.value, p.weights.value) == ("inductor", "int8") and "Q8_0" in p.weights.reason


def test_fused_layers_run_in_compiled_steps_over_the_native_kernels():
    off = plan(AVX512_BF16, compile="inductor").fused_layers  # kernels_ok=False: pure-torch attention
    assert off.value == "off" and "native kernels" in off.reason
    if not kernels.load():
        return
    here = CpuInfo.detect()
    on = plan(here, kernels_ok=True, compile="inductor").fused_layers
    assert on.value == "on" and "llmserve::decoder_layer" in on.reason
    assert plan(here, kernels_ok=True, compile="none").fused_layers.value == "off"
    asked = plan(here, kernels_ok=True, compile="inductor", fused_layers="off").fused_layers
    assert (asked.value, asked.reason) == ("off", "asked for")


GGUF_Q4_1 = ModelConfig.from_dict({**SMOLLM2_RAW, "quantization_config": {
    "quant_method": "llmserve-blockwise", "formats": {"mlp.up_proj": "int4", "embed_tokens": "int8"}}})


def test_weights_are_served_as_stored_unless_quantize_says_otherwise():
    assert plan(AVX2_ONLY).weights.value == "float"
    stored = plan(AVX2_ONLY, model=GGUF_Q4_1).weights
    assert stored.value == "int4+int8" and "as stored" in stored.reason and "Q4_1" in stored.reason
    assert plan(AVX2_ONLY, model=GGUF_Q4_1, quantize="none").weights.value == "float"
    assert plan(AVX2_ONLY, model=GGUF_Q4_1, quantize="int8").weights.value == "int8"
    assert plan(AVX2_ONLY, quantize="int4").linear_backend.value == "int4"
    lora = plan(AVX2_ONLY, model=GGUF_Q4_1, enable_lora=True).weights
    assert lora.value == "float" and "LoRA" in lora.reason  # adapters run over float weights
    with pytest.raises(InvalidRequestError, match="--quantize int4 does not support --enable-lora"):
        plan(AVX2_ONLY, quantize="int4", enable_lora=True)


def test_cpu_isa_can_be_forced_narrower_but_not_wider():
    assert plan(AVX512_BF16, kernels_ok=True, env={"LLMSERVE_CPU_ISA": "avx2"}, dtype="bfloat16").cpu_isa.value == "avx2"
    with pytest.raises(InvalidRequestError, match="this CPU lacks it"):
        plan(AVX2_ONLY, kernels_ok=True, env={"LLMSERVE_CPU_ISA": "avx512"})
    with pytest.raises(InvalidRequestError, match="expected one of"):
        plan(AVX2_ONLY, kernels_ok=True, env={"LLMSERVE_CPU_ISA": "sse"})


def test_plan_is_described_with_every_reason():
    p = plan(AVX2_ONLY)
    text = p.describe()
    for name, choice in p.as_dict().items():
        assert name in text and choice["value"] in text and choice["reason"] in text


def test_the_engine_logs_its_plan_once_at_start_up(tiny_model, caplog):
    from llmserve import LLM

    with caplog.at_level(logging.INFO, logger="llmserve.engine"):
        llm = LLM(tiny_model, dtype="float32", num_threads=1)
    blocks = [r.getMessage() for r in caplog.records if r.getMessage().startswith("execution plan:")]
    assert len(blocks) == 1 and blocks[0] == llm.engine.plan.describe()
    assert llm.engine.runner.kv_caches[0].dtype == llm.engine.plan.kv_torch_dtype
    assert llm.engine.plan.dtype.value == "float32"
    plan_ = llm.engine.plan
    if plan_.native:  # the kernels run as the plan says
        assert kernels.selected_isa() == plan_.cpu_isa.value
        assert (kernels.gemv_prefetch(), kernels.gemv_max_rows()) == (int(plan_.gemv_prefetch.value), int(plan_.gemv_max_rows.value))


def test_a_onednn_isa_cap_below_bf16_means_no_native_bf16():
    here = CpuInfo.detect({})
    capped = CpuInfo.detect({"ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert not capped.native_bf16 and capped.isas == here.isas
    assert CpuInfo.detect({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}).native_bf16 == here.native_bf16


H200 = GpuInfo("NVIDIA H200", bf16=True, memory=141 << 30)


def test_device_cuda_without_a_gpu_is_refused_and_auto_falls_back_to_the_cpu():
    with pytest.raises(DeviceUnavailableError, match="no CUDA GPU"):
        plan(AVX2_ONLY, device="cuda")
    p = plan(AVX2_ONLY, device="auto")
    assert p.device.value == "cpu" and "no CUDA GPU" in p.device.reason
    assert plan(AVX2_ONLY, device="cpu").device.reason == "asked for"


def test_on_a_gpu_the_plan_runs_triton_attention_in_bf16_eager():
    p = gpu_plan(EngineConfig(), AVX2_ONLY, H200)
    assert (p.device.value, p.torch_device) == ("cuda", torch.device("cuda")) and "H200" in p.device.reason
    assert (p.dtype.value, p.kv_cache_dtype.value) == ("bfloat16", "bfloat16")
    assert (p.attention_backend.value, p.cpu_isa.value, p.linear_backend.value) == ("triton", "none", "dense")
    assert p.compile.value == "none" and not p.native
    assert gpu_plan(EngineConfig(), AVX2_ONLY, GpuInfo("old GPU", bf16=False, memory=16 << 30)).dtype.value == "float32"
    p = gpu_plan(EngineConfig(dtype="float32", kv_cache_dtype="bfloat16"), AVX2_ONLY, H200)
    assert (p.dtype.value, p.kv_cache_dtype.value) == ("float32", "bfloat16")


@pytest.mark.parametrize("options", [dict(compile="inductor"), dict(compile="tensorrt"), dict(quantize="int8"),
                                     dict(attention_backend="torch")])
def test_what_a_gpu_does_not_run_is_refused_by_name(options):
    (name, value), = options.items()
    with pytest.raises(InvalidRequestError, match=value if name != "attention_backend" else "attention-backend"):
        gpu_plan(EngineConfig(**options), AVX2_ONLY, H200)


def test_device_cuda_on_a_machine_without_one_exits_2_with_one_sentence(tiny_model):
    r = subprocess.run([sys.executable, "-m", "llmserve.cli", "generate", "hi", "--model", tiny_model, "--device", "cuda"],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        "llmserve: error: --device cuda: torch sees no CUDA GPU on this machine (torch.cuda.is_available() is False); "
        "use --device cpu or auto")
