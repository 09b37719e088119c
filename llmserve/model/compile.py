"""Compiled execution: `--compile none | inductor | auto | tensorrt`.

inductor: decode-only steps run one torch.compile'd graph, from token ids to fp32 logits, for every
batch size up to max_batch. The batch and the block-table width are dynamic dimensions, so a
single graph serves every batch size and context length. Dynamo specialises sizes 0 and 1, so a
batch of 1 is padded to MIN_ROWS and a table to MIN_ROWS blocks: a padded row carries token 0 at
position 0, writes its K/V into the null block 0 (slot 0) and attends to 1 token, so it never
touches a real sequence's cache; padded table columns name the null block and lie past every
sequence's length. Prefill and mixed steps run the eager model.

The graph holds no weights: linear layers call the oneDNN-packed weights the eager model uses,
by handle (llmserve::packed_linear, model/packed.py). The KV-cache write and the decode attention
are opaque in-place ops (llmserve::write_kv_cache, llmserve::paged_decode_attention), so the
compiled graph updates the cache where it lies instead of copying it.

Compiled code is cached in cache_dir("inductor"); inductor keys it by the graph, its shapes and
the torch version, so a warm start loads it instead of compiling. Compiling shows a progress
bar whose ETA is the previous compile's duration on this machine.

tensorrt: needs CUDA and torch_tensorrt; both are checked at start-up with a clear message.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import torch

from llmserve.errors import LLMServeError
from llmserve.kernels import cpu_flags
from llmserve.model.attention import AttentionMetadata
from llmserve.model.packed import use_native_linear
from llmserve.paths import cache_dir

logger = logging.getLogger("llmserve.compile")
MIN_ROWS = 2


class CompileUnavailableError(LLMServeError):
    error_type = "compile_unavailable"


def check_tensorrt() -> None:
    """Fail fast, naming what is missing, when the TensorRT path cannot run here."""
    missing = []
    if not torch.cuda.is_available():
        missing.append("an NVIDIA GPU with CUDA (torch.cuda.is_available() is False)")
    try:
        import torch_tensorrt  # noqa: F401
    except ImportError:
        missing.append("the torch-tensorrt package (install it with: pip install '.[tensorrt]')")
    if missing:
        raise CompileUnavailableError("--compile tensorrt needs " + " and ".join(missing))
    raise CompileUnavailableError(
        "--compile tensorrt: CUDA and torch_tensorrt are present, but llmserve's engine runs on the CPU "
        "in this release; use --compile inductor"
    )


def choose_mode(requested: str, dtype: torch.dtype, quantize: str | None) -> str:
    """The execution mode to run; `auto` picks, and says in one log line which and why."""
    if requested == "inductor" and quantize:
        raise CompileUnavailableError(
            f"--compile inductor does not support --quantize {quantize} in this release "
            "(int8 layers run eager); use --compile none with --quantize, or drop --quantize")
    if requested != "auto":
        return requested
    bf16_cpu = "avx512_bf16" in cpu_flags().split()
    if quantize:
        mode, why = "none", f"--quantize {quantize} runs eager"
    elif dtype != torch.bfloat16:
        mode, why = "none", f"{str(dtype).removeprefix('torch.')}: compiled decode measured no faster than eager"
    elif not bf16_cpu:
        mode, why = "none", "this CPU lacks AVX-512 BF16, where compiled bfloat16 decode was measured to win"
    else:
        mode, why = "inductor", "bfloat16 on an AVX-512 BF16 CPU: compiled decode measured faster than eager"
    logger.info("--compile auto chose %s: %s", mode, why)
    return mode


def configure_inductor() -> None:
    """Process-wide inductor settings: the on-disk cache."""
    import torch._inductor.config as inductor_config

    inductor_cache = cache_dir("inductor")
    inductor_cache.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(inductor_cache))
    inductor_config.fx_graph_cache = True  # a second start loads compiled graphs from disk


class DecodeGraph:
    """The compiled decode step: [B] token ids -> [B, vocab] fp32 logits, B <= max_batch.

    It runs with inductor's C++ wrapper (the code that calls the graph's kernels and ops in
    order). In Python that code costs about 80 us a layer (tensor views, size asserts, ~10 calls);
    in C++ it measured 1.41x -> 1.52x eager at batch 1 and 1.38x -> 1.57x at batch 8
    (scripts/bench_compile.py), for a cold compile of 70-84 s instead of 55."""

    def __init__(self, model: torch.nn.Module, max_batch: int):
        configure_inductor()
        use_native_linear()
        self.model = model
        self.max_batch = max(max_batch, MIN_ROWS)
        self.fn = torch.compile(self._decode, fullgraph=True, dynamic=False, options={"cpp_wrapper": True})

    def _decode(self, ids, positions, slots, tables, seq_lens, kv_caches):
        meta = AttentionMetadata(slots, ids.shape[0], tables, seq_lens, [])
        return self.model.compute_logits(self.model(ids, positions, kv_caches, meta))

    def fits(self, n: int) -> bool:
        return n <= self.max_batch

    def __call__(self, ids, positions, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        """Logits [D, vocab] fp32 for a decode-only batch of D <= max_batch rows (meta as model.forward)."""
        d = ids.shape[0]
        assert self.fits(d) and meta.num_decodes == d and not meta.prefills
        slots, tables, seq_lens = meta.slot_mapping, meta.decode_block_tables, meta.decode_seq_lens
        if tables.shape[1] < MIN_ROWS:
            tables = torch.cat([tables, tables.new_zeros(d, MIN_ROWS - tables.shape[1])], dim=1)
        if d < MIN_ROWS:
            z = ids.new_zeros(MIN_ROWS - d)
            ids, positions, slots = torch.cat([ids, z]), torch.cat([positions, z]), torch.cat([slots, z])
            tables = torch.cat([tables, tables.new_zeros(len(z), tables.shape[1])])
            seq_lens = torch.cat([seq_lens, torch.ones_like(z)])
        for t in (ids, positions, slots, tables, seq_lens):
            torch._dynamo.mark_dynamic(t, 0)
        torch._dynamo.mark_dynamic(tables, 1)
        return self.fn(ids, positions, slots, tables, seq_lens, kv_caches)[:d]

    def warm_up(self, kv_caches: list[torch.Tensor]) -> float:
        """Compile (or load from the cache) the graph; returns the seconds it took."""
        last = cache_dir("inductor") / "last_compile_seconds"
        t = time.perf_counter()
        with _progress("compiling decode graph", _read_seconds(last)):
            # inputs made in inference mode, as ModelRunner.execute makes them: a graph compiled for
            # ordinary tensors fails dynamo's dispatch-key guard on inference tensors
            with torch.inference_mode():
                n = MIN_ROWS  # distinct tensors: dynamo guards on aliasing between inputs
                ids, positions, slots = (torch.zeros(n, dtype=torch.long) for _ in range(3))
                meta = AttentionMetadata(slots, n, torch.zeros(n, MIN_ROWS, dtype=torch.long), torch.ones(n, dtype=torch.long), [])
                self(ids, positions, kv_caches, meta)
        elapsed = time.perf_counter() - t
        last.write_text(f"{elapsed:.1f}")
        return elapsed


def _read_seconds(path) -> float:
    try:
        return max(float(path.read_text()), 1.0)
    except (OSError, ValueError):
        return 60.0  # a first cold compile of SmolLM2-135M on 2 cores takes about a minute


class _progress:
    """A seconds bar, ticked by a thread while the main thread compiles; total = the estimate."""

    def __init__(self, desc: str, estimate_s: float):
        from tqdm import tqdm

        self.bar = tqdm(total=round(estimate_s), desc=desc, unit="s")
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._tick, daemon=True)

    def _tick(self) -> None:
        while not self.done.wait(1.0):
            if self.bar.n < self.bar.total:
                self.bar.update(1)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()
        self.bar.update(self.bar.total - self.bar.n)
        self.bar.close()
