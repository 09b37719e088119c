"""The execution plan: what runs how on this machine, decided once at start-up.

One frozen record holds every choice that depends on the machine: the CPU features, the dtype of
weights and activations, the KV-cache dtype, the compile mode, the attention backend (and its ISA
variant), and the linear backend, each with the reason it was chosen. LLMEngine builds it before
the model loads, logs it as one block, passes it down (ModelRunner.setup_execution), and reports
it in /get_server_info and `llmserve profile`. No module global decides any of this later.

Rules (`auto` everywhere):
- dtype: bfloat16 where the CPU computes it natively (AVX-512 BF16 or AMX), float32 elsewhere,
  where bf16 matmuls are hundreds of times slower. An explicit bfloat16 there runs, with a warning.
- kv_cache_dtype: the weights' dtype, except where float32 was picked for a CPU without native
  bf16: there a bf16 cache halves the bytes decode attention reads, and the faster of the two is
  measured once per machine and model shape (cached beside the kernels). An explicit float32
  asks for float32 numerics, so its cache stays float32.
- weights: as the checkpoint stores them (a GGUF file's Q8_0/Q4_0/Q4_1 tensors stay block-quantized,
  int8 or int4), unless --quantize says none (dequantize), int8 or int4 (every linear layer in it);
  float where LoRA adapters are enabled. Steps of at most quant_max_rows rows run the quantized
  GEMV, larger ones (quant_large_steps) a oneDNN-packed float copy of the weights where that
  measured faster and costs at most a quarter of the RAM, dequantized tiles and the GEMM
  otherwise: both are measured once per machine.
- compile: inductor where it measured faster (bf16 on native-bf16 CPUs, float32 on AVX2 and
  AVX-512), except for models too small for a compile to pay back.
- fused_layers: on where compiled steps run over the native kernels and the linears have native
  handles (oneDNN-packed or block-quantized): each decoder layer of a step without adapters is
  one op, llmserve::decoder_layer, in place of about ten kernels and op calls.
- linear: oneDNN-packed weights; where the native kernels run and a second copy costs at most
  an eighth of the RAM, plain weights too, for steps of few rows (batch-1 decode, small batches),
  which llmserve::gemv reads at close to the streaming bandwidth. Its software prefetch distance
  (none, or 1-8 KB ahead) and the most rows it takes (up to 16: as long as it beats oneDNN) are
  measured once per machine, ISA and dtype (cached beside the kernels).
- attention: the native kernels where they build, in the widest ISA variant the CPU runs
  (LLMSERVE_CPU_ISA=avx2|portable forces a narrower one); pure torch otherwise.
- device: cuda when asked for (auto stays on the CPU until the CUDA path has run on a GPU).
  There the dtype is bfloat16 (float32 where the GPU lacks bf16), attention runs the Triton
  kernels (llmserve.kernels.triton_attention), linears cuBLAS, and steps run eager: the compiled
  step graph and CUDA graphs on a GPU are not built yet.
- cudagraph_mode: none everywhere for now, with the reason: --enforce-eager, the CPU, or on a GPU
  the capture sizes decode steps would replay (llmserve.engine.cuda_graphs) until the capture
  has run on one (then full_decode_only: pure decode steps replay graphs, the rest run eager).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from llmserve.errors import InvalidRequestError

logger = logging.getLogger("llmserve.plan")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
ISAS = ("avx512", "avx2", "portable")  # widest first
ISA_FLAGS = {"avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq"), "avx2": ("avx2", "fma"), "portable": ()}
ONEDNN_BF16_ISAS = ("ALL", "DEFAULT", "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16",
                    "AVX10_1_512", "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16", "AVX10_2_512", "AVX10_2_512_AMX_2")
GEMV_MEMORY_SHARE = 8  # a plain copy of the weights for batch-1 steps, where it costs at most 1/8 of the RAM
QUANT_COPY_MEMORY_SHARE = 4  # a packed float copy of quantized weights for large steps: at most 1/4 of the RAM
QUANT_LARGE_ROWS = (32, 256)  # the large steps measured: a decode batch, a prefill chunk
MIN_COMPILE_PARAMS = 20_000_000  # below this a step takes ~1 ms, and a compile (tens of s) never pays back
GEMV_PREFETCH_BYTES = (0, 1024, 2048, 4096, 8192)  # the software prefetch distances measured
GEMV_PROBE_BYTES = 512 << 20  # the most weight bytes they are measured over (a larger model is past any cache)
GEMV_ROWS = (1, 2, 4, 8, 12, 16)  # the step sizes where gemv is measured against oneDNN (2: a compiled batch-1 step, padded)
QUANT_FORMATS = {"int8": "Q8_0", "int4": "Q4_1"}  # llmserve.model.quantize.FORMATS, by their GGUF layouts


@dataclass(frozen=True, slots=True)
class CpuInfo:
    model_name: str
    flags: frozenset[str]
    num_cores: int

    @classmethod
    def detect(cls, env: dict[str, str] | None = None) -> CpuInfo:
        """This CPU, as oneDNN may use it: ONEDNN_MAX_CPU_ISA below AVX512_CORE_BF16 (e.g. AVX2)
        leaves matmuls without native bf16, and the plan must not count on it."""
        env = os.environ if env is None else env
        try:
            lines = Path("/proc/cpuinfo").read_text().splitlines()
        except OSError:
            lines = []

        def field(*names: str) -> str:
            return next((ln.split(":", 1)[1].strip() for ln in lines if ln.split(":", 1)[0].strip() in names), "")

        flags = frozenset(field("flags", "Features").split())
        cap = env.get("ONEDNN_MAX_CPU_ISA", "").upper()
        if cap and cap not in ONEDNN_BF16_ISAS:
            flags -= {"avx512_bf16", "amx_bf16"}
        return cls(field("model name") or "unknown CPU", flags, os.cpu_count() or 1)

    @property
    def native_bf16(self) -> bool:
        return bool({"avx512_bf16", "amx_bf16"} & self.flags)

    @property
    def isas(self) -> tuple[str, ...]:
        """The kernel ISA variants this CPU runs, widest first."""
        return tuple(isa for isa in ISAS if all(f in self.flags for f in ISA_FLAGS[isa]))

    def describe(self) -> str:
        extras = ", ".join(f for f in ("avx512_bf16", "amx_bf16") if f in self.flags) or "no native bf16"
        return f"{self.model_name}, {self.num_cores} cores, {self.isas[0]} ({extras})"


@dataclass(frozen=True, slots=True)
class GpuInfo:
    name: str
    bf16: bool
    memory: int  # bytes

    @classmethod
    def detect(cls) -> GpuInfo | None:
        """The first CUDA GPU torch sees, or None."""
        if not torch.cuda.is_available():
            return None
        props = torch.cuda.get_device_properties(0)
        return cls(props.name, torch.cuda.is_bf16_supported(), props.total_memory)


class DeviceUnavailableError(InvalidRequestError):
    error_type = "device_unavailable"


@dataclass(frozen=True, slots=True)
class Choice:
    value: str
    reason: str


@dataclass(frozen=True, slots=True)
class ExecutionPlan:
    cpu: Choice  # the CPU's class (its widest ISA, +bf16 where native) and what was read of it
    device: Choice  # cpu | cuda
    dtype: Choice  # float32 | bfloat16
    kv_cache_dtype: Choice  # float32 | bfloat16
    compile: Choice  # none | inductor | tensorrt
    fused_layers: Choice  # on: a compiled step runs each decoder layer as one native op | off
    attention_backend: Choice  # native | torch (CPU) | triton (CUDA)
    cpu_isa: Choice  # the native decode kernel's variant: avx512 | avx2 | portable (or none)
    linear_backend: Choice  # onednn-packed+gemv | onednn-packed | int8 | dense
    gemv_prefetch: Choice  # bytes llmserve::gemv prefetches ahead: 0 (none) | 1024 ... 8192
    gemv_max_rows: Choice  # packed layers' steps of at most this many rows run llmserve::gemv: 0 ... 16
    weights: Choice  # what the linear layers hold: float | int8 | int4 | int4+int8 (mixed) ...
    quant_max_rows: Choice  # quantized layers' steps of at most this many rows run the quantized GEMV: 0 ... 16
    quant_large_steps: Choice  # their larger steps: packed (a oneDNN-packed float copy) | tiles | none
    cudagraph_mode: Choice  # none | full_decode_only (CUDA graphs for pure decode steps; not built yet)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype.value]

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        return DTYPES[self.kv_cache_dtype.value]

    @property
    def native(self) -> bool:
        return self.attention_backend.value == "native"

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device.value)

    def as_dict(self) -> dict[str, dict[str, str]]:
        return {name: asdict(choice) for name, choice in zip(self.__slots__, self._choices(), strict=True)}

    def describe(self) -> str:
        """One block for the log and the profile's header."""
        choices = self._choices()
        width, vwidth = max(map(len, self.__slots__)), max(len(c.value) for c in choices)
        return "execution plan:\n" + "\n".join(
            f"  {name:<{width}}  {c.value:<{vwidth}}  {c.reason}" for name, c in zip(self.__slots__, choices, strict=True))

    def _choices(self) -> list[Choice]:
        return [getattr(self, name) for name in self.__slots__]


def plan_for(config, model_config) -> ExecutionPlan:
    """The plan for `config` (an EngineConfig) and a ModelConfig on this machine; builds (or
    loads) the native kernels first unless pure-torch attention is asked for."""
    from llmserve import kernels

    gpu = GpuInfo.detect() if config.device == "cuda" else None
    if gpu is not None:
        return gpu_plan(config, CpuInfo.detect(), gpu, model_config.weight_formats)
    return build_plan(config, model_config, CpuInfo.detect(), config.attention_backend == "auto" and kernels.load())


def build_plan(config, model_config, cpu: CpuInfo, kernels_ok: bool, env: dict[str, str] | None = None) -> ExecutionPlan:
    """The plan for `config` (an EngineConfig) and the model's architecture (a ModelConfig) on
    `cpu` (no GPU seen); kernels_ok: the native kernels loaded. Typed errors for a request that
    cannot run."""
    env = os.environ if env is None else env
    if config.device == "cuda":
        raise DeviceUnavailableError(
            "--device cuda: torch sees no CUDA GPU on this machine (torch.cuda.is_available() is False); "
            "use --device cpu or auto")
    device = Choice("cpu", "asked for" if config.device == "cpu" else _auto_device_reason())
    dtype = _dtype(config.dtype, cpu)
    attention, isa = _attention(config.attention_backend, cpu, kernels_ok, env.get("LLMSERVE_CPU_ISA"))
    kv = _kv_cache_dtype(config.kv_cache_dtype, config.dtype, dtype, cpu, attention, isa, model_config)
    weights = _weights(config, model_config)
    compile_ = _compile(config.compile, dtype, cpu, model_config)
    linear = _linear(weights, dtype, attention, model_config)
    fused = _fused_layers(config.fused_layers, compile_, attention, linear)
    prefetch = rows = Choice("0", "no llmserve::gemv in this plan")
    quantized = weights.value != "float" and attention.value == "native"
    fmt = "int4" if "int4" in weights.value else "int8"  # the decoder linears' (int4 beside an int8 LM head)
    if "gemv" in linear.value:
        prefetch = measured_gemv_prefetch(isa.value, DTYPES[dtype.value], model_config)
    elif quantized:
        prefetch = measured_gemv_prefetch(isa.value, DTYPES[dtype.value], model_config, fmt)
    if linear.value.endswith("+gemv"):
        rows = measured_gemv_max_rows(isa.value, DTYPES[dtype.value], int(prefetch.value), model_config)
    quant_rows = Choice("0", "no quantized layers" if weights.value == "float" else "no native kernels: torch dequantizes")
    if quantized:
        large = _quant_large_steps(config.quant_large_steps, isa.value, DTYPES[dtype.value], fmt, model_config)
        quant_rows = measured_quant_max_rows(isa.value, DTYPES[dtype.value], fmt, int(prefetch.value), model_config,
                                             large.value)
    else:
        large = Choice("none", quant_rows.reason)
    graphs = Choice("none", "--enforce-eager" if config.enforce_eager else "CUDA graphs run on NVIDIA GPUs only")
    return ExecutionPlan(_cpu_class(cpu), device, dtype, kv, compile_, fused, attention, isa, linear, prefetch, rows, weights,
                         quant_rows, large, graphs)


def _weights(config, model_config) -> Choice:
    """What the linear layers will hold: the checkpoint's formats unless --quantize says otherwise."""
    stored = "+".join(model_config.weight_formats) or "float"
    if config.quantize == "none":
        return Choice("float", f"--quantize none: dequantized from {stored}" if stored != "float" else "asked for")
    if config.quantize in QUANT_FORMATS:
        if config.enable_lora:
            raise InvalidRequestError(f"--quantize {config.quantize} does not support --enable-lora in this release; "
                                      "adapters run over float weights (drop --quantize, or use --quantize none)", "quantize")
        return Choice(config.quantize, f"--quantize {config.quantize}: {QUANT_FORMATS[config.quantize]} blocks of 32")
    if stored == "float":
        return Choice("float", "the checkpoint's float weights")
    if config.enable_lora:
        return Choice("float", f"auto: dequantized from {stored}, since LoRA adapters run over float weights")
    return Choice(stored, f"as stored in the checkpoint ({', '.join(QUANT_FORMATS[f] for f in model_config.weight_formats)} "
                          "blocks, read as they are; --quantize none dequantizes)")


def _cpu_class(cpu: CpuInfo) -> Choice:
    return Choice(cpu.isas[0] + ("+bf16" if cpu.native_bf16 else ""), cpu.describe())


def _auto_device_reason() -> str:
    # auto stays on the CPU until the CUDA path has run on a GPU (scripts/gpu_check.sh)
    if torch.cuda.is_available():
        return "auto: the CUDA path has not yet been checked on a GPU; --device cuda opts in"
    return "auto: torch sees no CUDA GPU"


def gpu_plan(config, cpu: CpuInfo, gpu: GpuInfo, model_formats: tuple[str, ...] = ()) -> ExecutionPlan:
    """The plan on a CUDA GPU: the Triton attention kernels, cuBLAS linears, eager steps."""
    if config.compile in ("tensorrt", "inductor") or config.quantize in QUANT_FORMATS:
        asked = f"--compile {config.compile}" if config.quantize not in QUANT_FORMATS else f"--quantize {config.quantize}"
        raise InvalidRequestError(f"{asked} is not supported on a GPU in this release; drop it or use --device cpu")
    if config.attention_backend == "torch":
        raise InvalidRequestError("--attention-backend torch runs on the CPU only; on a GPU attention runs Triton kernels")
    device = Choice("cuda", f"asked for: {gpu.name}, {gpu.memory / 2**30:.0f} GiB")
    if config.dtype != "auto":
        dtype = Choice(config.dtype, "asked for")
    elif gpu.bf16:
        dtype = Choice("bfloat16", "auto: the GPU computes bf16 natively")
    else:
        dtype = Choice("float32", "auto: this GPU lacks bf16")
    kv = Choice(config.kv_cache_dtype, "asked for") if config.kv_cache_dtype != "auto" else \
        Choice(dtype.value, "auto: the weights' dtype")
    compile_ = Choice("none", "asked for" if config.compile == "none" else
                      "auto: eager; the compiled step graph and CUDA graphs have not run on a GPU yet")
    return ExecutionPlan(_cpu_class(cpu), device, dtype, kv, compile_, Choice("off", "the fused layer op runs on the CPU"),
                         Choice("triton", "the Triton kernels (CUDA)"),
                         Choice("none", "attention runs on the GPU"), Choice("dense", "cuBLAS through F.linear"),
                         Choice("0", "no llmserve::gemv on a GPU"), Choice("0", "no llmserve::gemv on a GPU"),
                         _gpu_weights(model_formats), Choice("0", "no quantized layers on a GPU"),
                         Choice("none", "no quantized layers on a GPU"), _cudagraph_mode(config))


def _gpu_weights(stored: tuple[str, ...]) -> Choice:
    if not stored:
        return Choice("float", "the checkpoint's float weights")
    return Choice("float", f"dequantized from {'+'.join(stored)}: quantized layers run on the CPU only in this release")


def _cudagraph_mode(config) -> Choice:
    """On a GPU: none, until the capture (llmserve.engine.cuda_graphs) has run on one."""
    from llmserve.engine.cuda_graphs import cudagraph_capture_sizes

    if config.enforce_eager:
        return Choice("none", "--enforce-eager: every step eager")
    sizes = " ".join(map(str, cudagraph_capture_sizes(config.max_num_seqs)))
    return Choice("none", f"eager: decode steps would replay graphs of {sizes} rows, whose capture has not run on a GPU yet")


def _dtype(requested: str, cpu: CpuInfo) -> Choice:
    if requested == "auto":
        if cpu.native_bf16:
            return Choice("bfloat16", "auto: this CPU computes bf16 natively (AVX-512 BF16 or AMX)")
        return Choice("float32", "auto: this CPU lacks native bf16 (AVX-512 BF16 or AMX), where bf16 matmuls crawl")
    if requested == "bfloat16" and not cpu.native_bf16:
        logger.warning(
            "--dtype bfloat16 on a CPU without native bf16 (no AVX-512 BF16 or AMX): every bf16 matmul is emulated "
            "and runs several times slower than float32 (measured ~25 against ~90 tok/s on an AVX2 machine); "
            "--dtype auto picks float32 here")
        return Choice("bfloat16", "asked for; this CPU lacks native bf16, so it runs several times slower than float32")
    return Choice(requested, "asked for")


def _attention(requested: str, cpu: CpuInfo, kernels_ok: bool, forced_isa: str | None) -> tuple[Choice, Choice]:
    if requested == "torch":
        return Choice("torch", "asked for"), Choice("none", "pure-torch attention")
    if not kernels_ok:
        return (Choice("torch", "the native kernels did not build here (see the log)"),
                Choice("none", "pure-torch attention"))
    if forced_isa:
        if forced_isa not in ISAS:
            raise InvalidRequestError(f"LLMSERVE_CPU_ISA={forced_isa}: expected one of {', '.join(ISAS)}")
        if forced_isa not in cpu.isas:
            raise InvalidRequestError(f"LLMSERVE_CPU_ISA={forced_isa}: this CPU lacks it (it runs {', '.join(cpu.isas)})")
        isa = Choice(forced_isa, "LLMSERVE_CPU_ISA")
    else:
        isa = Choice(cpu.isas[0], "the widest variant this CPU runs")
    return Choice("native", "the native kernels built here"), isa


def _kv_cache_dtype(requested: str, requested_dtype: str, dtype: Choice, cpu: CpuInfo, attention: Choice, isa: Choice,
                    model_config) -> Choice:
    if requested != "auto":
        return Choice(requested, "asked for")
    if dtype.value == "bfloat16":
        return Choice("bfloat16", "auto: the weights' dtype")
    if requested_dtype == "float32":
        return Choice("float32", "auto: float32 weights asked for, so float32 numerics")
    if attention.value != "native":
        return Choice("float32", "auto: the weights' dtype (pure-torch attention gains nothing from a bf16 cache)")
    return measured_kv_cache_dtype(isa.value, model_config)


def _compile(requested: str, dtype: Choice, cpu: CpuInfo, model_config) -> Choice:
    if requested != "auto":
        return Choice(requested, "asked for")
    params = approx_params(model_config)
    if params < MIN_COMPILE_PARAMS:
        return Choice("none", f"auto: {params / 1e6:.1f} M parameters step in about a millisecond; a compile would not pay back")
    if dtype.value == "bfloat16" and not cpu.native_bf16:
        return Choice("none", "auto: emulated bf16 is matmul-bound; compiling the rest gains little")
    if dtype.value == "bfloat16":
        return Choice("inductor", "auto: compiled bf16 steps measured 1.3-1.5x eager on AVX-512 BF16")
    return Choice("inductor", "auto: compiled float32 steps measured 1.1-1.3x eager on AVX2 and AVX-512")


def _fused_layers(requested: str, compile_: Choice, attention: Choice, linear: Choice) -> Choice:
    if requested == "off":
        return Choice("off", "asked for")
    if compile_.value != "inductor" or attention.value != "native":
        return Choice("off", "only compiled steps over the native kernels run the fused layer op")
    if linear.value == "dense":
        return Choice("off", "the linear layers run nn.Linear, which the fused layer op does not call")
    return Choice("on", "auto: llmserve::decoder_layer runs each decoder layer of a step without adapters as one op, "
                        "in place of about ten kernels and op calls")


def _linear(weights: Choice, dtype: Choice, attention: Choice, model_config) -> Choice:
    from llmserve.model.packed import packs_correctly

    if weights.value != "float":
        how = "llmserve::quant_linear" if attention.value == "native" else "dequantized by torch on each call (slow)"
        return Choice(weights.value, f"block-quantized layers through {how}; float layers, if any, as nn.Linear")
    if not packs_correctly(DTYPES[dtype.value]):
        return Choice("dense", "oneDNN weight packing is unavailable in this torch build or CPU")
    extra = approx_params(model_config) * DTYPES[dtype.value].itemsize
    if attention.value == "native" and extra <= physical_memory() // GEMV_MEMORY_SHARE:
        return Choice("onednn-packed+gemv", f"weights reordered once for oneDNN (2-4x nn.Linear in float32), and kept "
                                            f"plain too (+{extra / 2**20:.0f} MiB) for steps of few rows (gemv_max_rows): "
                                            "llmserve::gemv reads them nearer the streaming bandwidth")
    return Choice("onednn-packed", "weights reordered once for oneDNN (2-4x nn.Linear in float32)")


def physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def approx_params(c) -> int:
    """Parameters of a Llama-family ModelConfig (embeddings counted once when tied)."""
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    layer = c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    embed = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    return c.num_hidden_layers * layer + embed


def measured_kv_cache_dtype(isa: str, model_config, num_seqs: int = 32, context: int = 512) -> Choice:
    """float32 or bfloat16 cache under float32 queries, whichever decode attention runs faster at
    `num_seqs` sequences of `context` tokens; measured once per (ISA, head shape, threads)."""
    c = model_config
    key = f"kv_cache_dtype:{isa}:{c.num_attention_heads}x{c.num_key_value_heads}x{c.head_dim}:{torch.get_num_threads()}t"
    ms = _measured(key, isa, lambda: {name: _time_decode(DTYPES[name], c, num_seqs, context) for name in DTYPES})
    best = min(ms, key=ms.get)
    return Choice(best, f"auto: measured decode attention {ms['float32']:.2f} ms float32, {ms['bfloat16']:.2f} ms "
                        f"bfloat16 ({num_seqs} x {context} tokens, {isa})")


def measured_gemv_prefetch(isa: str, dtype: torch.dtype, model_config, fmt: str = "float") -> Choice:
    """The GEMV's software prefetch distance (bytes; 0: none), the fastest over weights of the
    model's shapes: llmserve::gemv over `dtype` weights, or with `fmt` int8|int4 the quantized
    GEMV over weights in that format; measured once per (ISA, dtype, format, threads, shapes)."""
    name = str(dtype).removeprefix("torch.")
    key = f"gemv_prefetch:{isa}:{name}:{torch.get_num_threads()}t:{_shapes_key(model_config)}:{GEMV_PREFETCH_BYTES}"
    key += "" if fmt == "float" else f":{fmt}:every-layer"
    measure = (lambda: _time_gemv(dtype, model_config)) if fmt == "float" else \
        (lambda: _time_quant_prefetch(dtype, fmt, model_config))
    ms = _measured(key, isa, measure)
    best = min(ms, key=ms.get)
    figures = ", ".join(f"{k} B {v:.2f} ms" for k, v in sorted(ms.items(), key=lambda kv: int(kv[0])))
    what = f"the model's {name} linears" if fmt == "float" else f"the model's linears in {fmt} ({name} activations)"
    return Choice(best, f"auto: measured a batch-1 gemv over {what} ({isa}): {figures}")


def measured_gemv_max_rows(isa: str, dtype: torch.dtype, prefetch: int, model_config) -> Choice:
    """The most rows a step may have and still run llmserve::gemv: the longest run of the row
    counts in GEMV_ROWS at which gemv beat oneDNN's packed linear over weights of the model's
    shapes; measured once per (ISA, dtype, threads, shapes, prefetch)."""
    name = str(dtype).removeprefix("torch.")
    key = f"gemv_max_rows:{isa}:{name}:{torch.get_num_threads()}t:{_shapes_key(model_config)}:{prefetch}B:{GEMV_ROWS}"
    rows, figures = _rows_won(_measured(key, isa, lambda: _time_gemv_rows(dtype, prefetch, model_config)), "onednn")
    return Choice(str(rows), f"auto: measured gemv against oneDNN, ms over the model's {name} linears ({isa}): {figures}")


def measured_quant_max_rows(isa: str, dtype: torch.dtype, fmt: str, prefetch: int, model_config,
                            large: str = "tiles") -> Choice:
    """The most rows a step may have and still run the quantized GEMV (rather than the `large`
    path: dequantized tiles and the GEMM, or the packed float copy): the longest run of GEMV_ROWS
    at which it was never slower, over `fmt` weights of the model's shapes; measured once per
    (ISA, dtype, format, threads, shapes, large path)."""
    name, other = str(dtype).removeprefix("torch."), "tile" if large == "tiles" else "packed"
    key = f"quant_max_rows:{isa}:{name}:{fmt}:{torch.get_num_threads()}t:{_shapes_key(model_config)}:{prefetch}B:{GEMV_ROWS}"
    key += "" if other == "tile" else ":packed"
    measured = _measured(key, isa, lambda: _time_quant_rows(dtype, fmt, prefetch, model_config, other))
    rows, figures = _rows_won(measured, other)
    against = "dequantized tiles and the GEMM" if other == "tile" else "the packed copy"
    return Choice(str(rows), f"auto: measured the quantized GEMV against {against}, ms over the "
                             f"model's linears in {fmt} ({name}, {isa}): {figures}")


def _quant_large_steps(asked: str, isa: str, dtype: torch.dtype, fmt: str, model_config) -> Choice:
    """packed (a oneDNN-packed float copy beside the quantized weights) or tiles, for steps of
    more rows than quant_max_rows: as asked, else packed where it measured faster over the model's
    shapes and the copy costs at most 1/QUANT_COPY_MEMORY_SHARE of the RAM."""
    name = str(dtype).removeprefix("torch.")
    copy_mb = approx_params(model_config) * dtype.itemsize / 1e6
    from llmserve.model.packed import packs_correctly

    if not packs_correctly(dtype):
        return Choice("tiles", "oneDNN weight packing is unavailable in this torch build or CPU")
    if asked != "auto":
        return Choice(asked, "asked for" + (f" (a {name} copy of about {copy_mb:.0f} MB)" if asked == "packed" else ""))
    if copy_mb * 1e6 > physical_memory() // QUANT_COPY_MEMORY_SHARE:
        return Choice("tiles", f"auto: a {name} copy ({copy_mb:.0f} MB) would take more than "
                               f"1/{QUANT_COPY_MEMORY_SHARE} of the RAM")
    key = f"quant_large_steps:{isa}:{name}:{fmt}:{torch.get_num_threads()}t:{_shapes_key(model_config)}:{QUANT_LARGE_ROWS}"
    ms = _measured(key, isa, lambda: _time_quant_large(dtype, fmt, model_config))
    tiles, packed = (sum(ms[f"{k}@{m}"] for m in QUANT_LARGE_ROWS) for k in ("tile", "packed"))
    figures = ", ".join(f"{m} rows {ms[f'tile@{m}']:.2f} vs {ms[f'packed@{m}']:.2f}" for m in QUANT_LARGE_ROWS)
    return Choice("packed" if packed < tiles else "tiles",
                  f"auto: measured dequantized tiles against a oneDNN-packed {name} copy (about {copy_mb:.0f} MB more), "
                  f"ms over the model's linears in {fmt} ({isa}): {figures}")


def _rows_won(measured: dict[str, float], other: str) -> tuple[int, str]:
    """measured: `gemv@M` and `<other>@M` ms for M in GEMV_ROWS -> (the last M of the first run
    of row counts where gemv was never slower, the figures as `M rows gemv vs other`)."""
    ms = {k: round(v, 2) for k, v in measured.items()}
    rows = 0
    for m in GEMV_ROWS:
        if ms[f"gemv@{m}"] > ms[f"{other}@{m}"]:
            break
        rows = m
    return rows, ", ".join(f"{m} rows {ms[f'gemv@{m}']:.2f} vs {ms[f'{other}@{m}']:.2f}" for m in GEMV_ROWS)


def _measured(key: str, isa: str, measure: Callable[[], dict[str, float]]) -> dict[str, float]:
    """measure() (choice -> ms) under the `isa` kernel variant, run once per key and kept in
    measurements.json beside the kernels, so that later starts read the same figures."""
    from llmserve import kernels

    path = kernels.build_directory() / "measurements.json"
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    if key not in cached:
        before = kernels.selected_isa()
        kernels.select_isa(isa)
        try:
            cached[key] = measure()
        finally:
            kernels.select_isa(before)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(cached, indent=1, sort_keys=True))
        tmp.replace(path)
    return cached[key]


def _shapes_key(c) -> str:
    return f"{c.hidden_size}x{c.intermediate_size}x{c.num_hidden_layers}"


def _probe_weights(dtype: torch.dtype, c) -> list[torch.Tensor]:
    """`dtype` weights of the model's decoder-layer linears ([out, in]: qkv, o, gate_up, down),
    layer after layer up to the model's size or GEMV_PROBE_BYTES, whichever is less: the cache
    regime (in the last-level cache, or not) is the model's own."""
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    layer = [(q + 2 * kv, c.hidden_size), (c.hidden_size, q), (2 * c.intermediate_size, c.hidden_size),
             (c.hidden_size, c.intermediate_size)]
    ws, nbytes = [], 0
    for _ in range(c.num_hidden_layers):
        for shape in layer:
            ws.append(torch.full(shape, 0.01, dtype=dtype))
            nbytes += ws[-1].numel() * dtype.itemsize
        if nbytes >= GEMV_PROBE_BYTES:
            break
    return ws


def _interleaved(fns: dict[str, Callable[[], None]], rounds: int) -> dict[str, float]:
    """Median ms of each fn, run round by round in turn, so that a shared machine's drift falls
    on all of them."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for f in fns.values():
        f()
    for _ in range(rounds):
        for k, f in fns.items():
            t = time.perf_counter()
            f()
            times[k].append((time.perf_counter() - t) * 1000)
    return {k: sorted(ts)[rounds // 2] for k, ts in times.items()}


def _time_gemv(dtype: torch.dtype, model_config, rounds: int = 5) -> dict[str, float]:
    """A batch-1 gemv over the probe weights, per prefetch distance."""
    from llmserve import kernels

    ws = _probe_weights(dtype, model_config)
    xs = {w.shape[1]: torch.randn(1, w.shape[1]) for w in ws}
    before = kernels.gemv_prefetch()

    def at(d: int) -> Callable[[], None]:
        def run() -> None:
            kernels.set_gemv_prefetch(d)
            for w in ws:
                torch.ops.llmserve.gemv(xs[w.shape[1]], w, None)
        return run

    try:
        return _interleaved({str(d): at(d) for d in GEMV_PREFETCH_BYTES}, rounds)
    finally:
        kernels.set_gemv_prefetch(before)


def _time_gemv_rows(dtype: torch.dtype, prefetch: int, model_config, rounds: int = 5) -> dict[str, float]:
    """gemv and oneDNN's packed linear over the probe weights, at each row count in GEMV_ROWS."""
    from llmserve import kernels

    ws = _probe_weights(dtype, model_config)
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in ws]
    xs = {(m, k): torch.randn(m, k).to(dtype) for m in GEMV_ROWS for k in {w.shape[1] for w in ws}}
    before = kernels.gemv_prefetch()
    kernels.set_gemv_prefetch(prefetch)

    def gemv(m: int) -> Callable[[], None]:
        def run() -> None:
            for w in ws:
                torch.ops.llmserve.gemv(xs[m, w.shape[1]], w, None)
        return run

    def onednn(m: int) -> Callable[[], None]:
        def run() -> None:
            for w, p in zip(ws, packed, strict=True):
                torch.ops.mkldnn._linear_pointwise(xs[m, w.shape[1]], p, None, "none", [], "")
        return run

    try:
        with torch.inference_mode():
            return _interleaved({f"{k}@{m}": f(m) for m in GEMV_ROWS for k, f in (("gemv", gemv), ("onednn", onednn))}, rounds)
    finally:
        kernels.set_gemv_prefetch(before)


def _quant_probe(fmt: str, model_config, every_layer: bool = False) -> list:
    """`fmt` probe weights: a quarter of the float probe's layers at most, or `every_layer` (the
    float probe's; so that, as in the model, they do not fit in the last-level cache)."""
    from llmserve.model.quantize import quantize

    ws = _probe_weights(torch.float32, model_config)
    return [quantize(w, fmt) for w in (ws if every_layer else ws[: 4 * max(1, model_config.num_hidden_layers // 4)])]


def _quant_runs(ws: list, dtype: torch.dtype, rows: tuple[int, ...]) -> dict[str, Callable[[int], Callable[[], None]]]:
    """Over the quantized probe weights `ws`, for a row count M: llmserve::quant_linear as the
    kernels stand (`quant`), and oneDNN's packed linear over the same weights dequantized
    (`packed`)."""
    from llmserve.model.quantize import dequantize

    packed = [torch.ops.mkldnn._reorder_linear_weight(dequantize(w).to(dtype), 64) for w in ws]
    xs = {(m, k): torch.randn(m, k).to(dtype) for m in rows for k in {w.in_features for w in ws}}

    def quant(m: int) -> Callable[[], None]:
        def run() -> None:
            for w in ws:
                torch.ops.llmserve.quant_linear(xs[m, w.in_features], w.q, w.d, w.m, None, w.in_features)
        return run

    def onednn(m: int) -> Callable[[], None]:
        def run() -> None:
            for w, p in zip(ws, packed, strict=True):
                torch.ops.mkldnn._linear_pointwise(xs[m, w.in_features], p, None, "none", [], "")
        return run

    return {"quant": quant, "packed": onednn}


def _time_quant_prefetch(dtype: torch.dtype, fmt: str, model_config, rounds: int = 5) -> dict[str, float]:
    """A batch-1 quantized GEMV over `fmt` probe weights, per prefetch distance."""
    from llmserve import kernels

    run = _quant_runs(_quant_probe(fmt, model_config, every_layer=True), dtype, (1,))["quant"](1)
    before = (kernels.gemv_prefetch(), kernels.quant_max_rows())
    kernels.set_quant_max_rows(1)

    def at(d: int) -> Callable[[], None]:
        def timed() -> None:
            kernels.set_gemv_prefetch(d)
            run()
        return timed

    try:
        with torch.inference_mode():
            return _interleaved({str(d): at(d) for d in GEMV_PREFETCH_BYTES}, rounds)
    finally:
        kernels.set_gemv_prefetch(before[0])
        kernels.set_quant_max_rows(before[1])


def _time_quant_rows(dtype: torch.dtype, fmt: str, prefetch: int, model_config, other: str = "tile",
                     rounds: int = 5) -> dict[str, float]:
    """llmserve::quant_linear's GEMV (`gemv@M`) against its tile path or the packed copy
    (`<other>@M`), over `fmt` probe weights, at each row count in GEMV_ROWS."""
    from llmserve import kernels

    runs = _quant_runs(_quant_probe(fmt, model_config), dtype, GEMV_ROWS)
    before = (kernels.gemv_prefetch(), kernels.quant_max_rows())
    kernels.set_gemv_prefetch(prefetch)

    def at(m: int, limit: int | None) -> Callable[[], None]:
        if limit is None:
            return runs["packed"](m)
        run = runs["quant"](m)

        def limited() -> None:
            kernels.set_quant_max_rows(limit)
            run()
        return limited

    paths = (("gemv", 16), (other, 0 if other == "tile" else None))
    try:
        with torch.inference_mode():
            return _interleaved({f"{k}@{m}": at(m, lim) for m in GEMV_ROWS for k, lim in paths}, rounds)
    finally:
        kernels.set_gemv_prefetch(before[0])
        kernels.set_quant_max_rows(before[1])


def _time_quant_large(dtype: torch.dtype, fmt: str, model_config, rounds: int = 3) -> dict[str, float]:
    """llmserve::quant_linear's tile path (`tile@M`), and oneDNN's packed linear over the same
    weights dequantized (`packed@M`), at each row count in QUANT_LARGE_ROWS."""
    from llmserve import kernels

    runs = _quant_runs(_quant_probe(fmt, model_config), dtype, QUANT_LARGE_ROWS)
    before = kernels.quant_max_rows()
    kernels.set_quant_max_rows(0)
    try:
        with torch.inference_mode():
            return _interleaved({f"{k}@{m}": runs[path](m) for m in QUANT_LARGE_ROWS
                                 for k, path in (("tile", "quant"), ("packed", "packed"))}, rounds)
    finally:
        kernels.set_quant_max_rows(before)


def _time_decode(kv_dtype: torch.dtype, c, num_seqs: int, context: int, reps: int = 5) -> float:
    """Median ms of one layer's paged decode attention, float32 queries, `kv_dtype` cache."""
    bs = 16
    blocks = num_seqs * context // bs
    g = torch.Generator().manual_seed(0)
    k = torch.randn(blocks + 1, bs, c.num_key_value_heads, c.head_dim, generator=g).to(kv_dtype)
    v = torch.randn_like(k)
    q = torch.randn(num_seqs, c.num_attention_heads, c.head_dim, generator=g)
    tables = torch.randperm(blocks, generator=g).add_(1).view(num_seqs, -1)
    lens = torch.full((num_seqs,), context, dtype=torch.long)
    op = torch.ops.llmserve.paged_decode_attention
    times = []
    for _ in range(reps + 1):
        t = time.perf_counter()
        op(q, k, v, tables, lens, c.head_dim**-0.5)
        times.append(time.perf_counter() - t)
    return sorted(times[1:])[reps // 2] * 1000
