"""Compiled execution: `--compile none | inductor | auto | tensorrt` (llmserve.plan resolves auto).

inductor: every step runs one torch.compile'd graph (StepGraph), from token ids to the fp32 logits
of the rows that sample, whatever its mix of decode rows and prefill chunks. The token count, the
decode rows, the prefill chunks, the block-table widths and the logit rows are dynamic dimensions,
so a single graph serves every batch, prompt and context length; sizes 0 and 1 are padded (see
StepGraph). Only steps that score prompt tokens (prompt_logprobs) run the eager model: they need
the hidden state of every row.

The graph holds no weights: linear layers call the oneDNN-packed weights the eager model uses,
by handle (llmserve::packed_linear, model/packed.py). The KV-cache write and the attention are
opaque in-place ops (llmserve::reshape_and_cache, llmserve::paged_attention), so the compiled
graph updates the cache where it lies instead of copying it, and one attention call per layer
covers every row of the step.

Compiled code is cached in cache_dir("inductor"); inductor keys it by the graph, its shapes and
the torch version, so a warm start loads it instead of compiling. The KV cache's block count is
a dynamic dimension too, so another cache size (--num-blocks, --max-num-seqs) loads the same code.
Compiling shows a progress bar whose ETA is the previous compile's duration on this machine (a
warm load does not count: it would make the next cold compile's ETA ten times too short).

tensorrt: needs CUDA and torch_tensorrt; both are checked at start-up with a clear message.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import types

import torch

from llmserve import kernels
from llmserve.errors import LLMServeError
from llmserve.lora.layers import WARM_UP_SLOTS, LoRABatch
from llmserve.model.attention import AttentionMetadata, PrefillBatch, PrefillSeq
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


def configure_inductor() -> None:
    """Process-wide inductor settings: the on-disk cache."""
    import torch._inductor.config as inductor_config
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    inductor_cache = cache_dir("inductor")
    inductor_cache.mkdir(parents=True, exist_ok=True)
    # torch writes its temp-dir default into the environment the first time anything asks for the
    # cache dir (loading a model does); only a path the user chose is kept
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen is None or os.path.abspath(chosen) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_cache)
    inductor_config.fx_graph_cache = True  # a second start loads compiled graphs from disk


class StepGraph:
    """One compiled step: token ids -> fp32 logits of the chosen rows, for any flat batch.

    Decode-only, prefill-only and mixed steps all run it: the token count, the decode rows, the
    prefill chunks, the block-table widths and the logit rows are dynamic dimensions. Dynamo
    specialises sizes 0 and 1, so each of those is padded to MIN_ROWS: a padded decode row
    carries token 0 at position 0, writes its K/V into the null block 0 (slot 0) and attends to 1
    token; a padded chunk has 0 tokens; padded table columns name the null block; padded logit
    rows repeat row 0 and are cut off. Padding never touches a real sequence's cache. A batch-1
    decode step's padding row is the last of every layer's rows, so the native GEMVs skip it
    (kernels.live_rows) and write zeros there: at batch 1 the linears read their weights for one
    row, not two.

    It runs with inductor's C++ wrapper (the code that calls the graph's kernels and ops in
    order). In Python that code costs about 80 us a layer (tensor views, size asserts, ~10 calls);
    in C++ it measured 1.41x -> 1.52x eager at batch 1 and 1.38x -> 1.57x at batch 8
    (scripts/bench_compile.py). The wrapper and the kernels are built as separate C++ files
    (cpp_wrapper_build_separate), which the compiler works on in parallel: a cold start of 49-63 s
    instead of 82-85 s, side by side, at the same speed (1.01x at batch 32)."""

    def __init__(self, model: torch.nn.Module):
        configure_inductor()
        self.model = model
        # No guards on the model's modules: its layers, weights and flags are fixed before the
        # first compile (adapters are copied into fixed slots), and this graph's step function
        # has a code object of its own (_own_code), so another model's graph is never taken for
        # this one. With a guard per weight tensor a step spent ~1 ms in dynamo's lookup over a
        # quantized model's ~400 buffers.
        options = {"cpp_wrapper": True, "cpp_wrapper_build_separate": True,
                   "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
        self.fn = torch.compile(_own_code(self._step), fullgraph=True, dynamic=False, options=options)
        # the model's GEMVs are llmserve's (kernels.live_rows applies to them)
        self.native_gemvs = model.native_decode and hasattr(torch.ops.llmserve, "set_live_rows")

    def _step(self, ids, positions, slots, tables, seq_lens, starts, lens, contexts, prefill_tables, rows, kv_caches,
              row_slots=None, slot_ids=None):
        meta = AttentionMetadata(slots, tables.shape[0], tables, seq_lens, [],
                                 prefill_batch=PrefillBatch(starts, lens, contexts, prefill_tables))
        lora = None if row_slots is None else LoRABatch.of(row_slots, slot_ids, self.model.embed_tokens.weight.dtype,
                                                           self.model.lora_widths)
        return self.model.compute_logits(self.model(ids, positions, kv_caches, meta, lora)[rows])

    def __call__(self, ids, positions, kv_caches, meta: AttentionMetadata, rows: list[int],
                 lora: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
        """Logits [len(rows), vocab] fp32 of flat rows `rows` (ids, positions, meta as model.forward);
        lora: (each row's slot [T], -1 for none; K, the slots in use), when the step has adapters.
        A step without adapters runs a graph without LoRA: it costs nothing then."""
        d, pad = meta.num_decodes, max(MIN_ROWS - meta.num_decodes, 0)
        # decode rows only: every padding row follows the real ones, so the native GEMVs skip them
        skip_pad = pad and ids.shape[0] == d and self.native_gemvs
        z = ids.new_zeros(pad)
        ids, positions, slots = (torch.cat([x[:d], z, x[d:]]) for x in (ids, positions, meta.slot_mapping))
        tables = _pad(_pad(meta.decode_block_tables, 1, MIN_ROWS), 0, d + pad)
        seq_lens = torch.cat([meta.decode_seq_lens, torch.ones_like(z)])
        chunks = meta.prefills
        starts, lens, contexts = (torch.tensor([getattr(p, f) for p in chunks], dtype=torch.long)
                                  for f in ("query_start", "query_len", "context_len"))
        starts += pad
        width = max([len(p.block_table) for p in chunks] + [MIN_ROWS])
        prefill_tables = torch.stack([_pad(p.block_table, 0, width) for p in chunks]) if chunks else z.new_zeros(0, width)
        starts, lens, contexts, prefill_tables = (_pad(x, 0, MIN_ROWS) for x in (starts, lens, contexts, prefill_tables))
        flat_rows = torch.tensor([r + pad if r >= d else r for r in rows] or [0], dtype=torch.long)
        flat_rows = _pad(flat_rows, 0, MIN_ROWS)
        args = (ids, positions, slots, tables, seq_lens, starts, lens, contexts, prefill_tables, flat_rows)
        for t in args:
            torch._dynamo.mark_dynamic(t, 0)
        torch._dynamo.mark_dynamic(tables, 1)
        torch._dynamo.mark_dynamic(prefill_tables, 1)
        with kernels.live_rows(d) if skip_pad else contextlib.nullcontext():
            if lora is None:
                return self.fn(*args, kv_caches)[: len(rows)]
            row_slots = torch.cat([lora[0][:d], torch.full_like(z, -1), lora[0][d:]])
            slot_ids = torch.arange(lora[1], device=row_slots.device)
            for t in (row_slots, slot_ids):
                torch._dynamo.mark_dynamic(t, 0)
            return self.fn(*args, kv_caches, row_slots, slot_ids)[: len(rows)]

    def warm_up(self, kv_caches: list[torch.Tensor], lora: bool = False) -> float:
        """Compile (or load from the cache) the graph, and with `lora` the graph for steps with
        adapters too; returns the seconds it took."""
        last = cache_dir("inductor") / "last_compile_seconds"
        misses = torch._dynamo.utils.counters["inductor"]["fxgraph_cache_miss"]
        t = time.perf_counter()
        with _progress("compiling the step graph", _read_seconds(last)):
            # inputs made in inference mode, as ModelRunner.execute makes them: a graph compiled for
            # ordinary tensors fails dynamo's dispatch-key guard on inference tensors
            with torch.inference_mode():
                for cache in kv_caches:  # [2, num_blocks, ...]: one compile serves every cache size
                    torch._dynamo.mark_dynamic(cache, 1)
                ids, positions, meta, rows = _warm_up_step()
                self(ids, positions, kv_caches, meta, rows)
                if lora:  # another shape, so that K is like no other size
                    ids, positions, meta, rows = _warm_up_step(decodes=4)
                    self(ids, positions, kv_caches, meta, rows, (torch.full_like(ids, -1), WARM_UP_SLOTS))
        elapsed = time.perf_counter() - t
        if torch._dynamo.utils.counters["inductor"]["fxgraph_cache_miss"] > misses:  # a compile, not a cache load
            last.write_text(f"{elapsed:.1f}")
        return elapsed


def _own_code(method):
    """`method` over a copy of its code object: dynamo keeps compiled graphs per code object, so
    each StepGraph has a cache of its own, valid for its model only."""
    f = method.__func__
    copy = types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__, f.__closure__)
    return types.MethodType(copy, method.__self__)


def _warm_up_step(decodes: int = 3) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
    """A mixed step wholly in the null block: `decodes` decode rows (tables decodes + 1 wide), a
    fresh chunk of 3 tokens and a continued one of 4 (tables decodes + 2 wide), decodes + 3 logit
    rows. Every dynamic size differs from the others, or dynamo would give equal sizes one symbol
    and recompile when they part."""
    t = decodes + 7
    null = torch.zeros(decodes + 2, dtype=torch.long)
    chunks = [PrefillSeq(decodes, 3, 3, null), PrefillSeq(decodes + 3, 4, 6, null)]
    meta = AttentionMetadata(torch.zeros(t, dtype=torch.long), decodes, torch.zeros(decodes, decodes + 1, dtype=torch.long),
                             torch.ones(decodes, dtype=torch.long), chunks)
    positions = torch.cat([torch.zeros(decodes, dtype=torch.long), torch.arange(3), torch.arange(2, 6)])
    return torch.zeros(t, dtype=torch.long), positions, meta, [*range(decodes), decodes + 2, decodes + 5, decodes + 6]


def _pad(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """x with zeros appended along dim up to `size` (unchanged if it is as long already)."""
    short = size - x.shape[dim]
    if short <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = short
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


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
