"""Compiled execution: `--compile none | inductor | tensorrt`.

inductor: decode-only steps run a torch.compile'd forward at fixed batch buckets (1, 2, 4, ...).
A batch of D decodes is padded to the next bucket b >= D; padded rows carry token 0 at
position 0, write their K/V into the null block 0 (slot 0) and attend to 1 token, so they never
touch a real sequence's cache. The block-table width is a dynamic dimension, so one graph per
bucket serves every context length. Prefill and mixed steps stay eager (their shapes vary every
step; measured in scripts/bench_compile.py). Every bucket is compiled at start-up.

tensorrt: needs CUDA and torch_tensorrt; both are checked at start-up with a clear message.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from llmserve.errors import LLMServeError
from llmserve.model.attention import AttentionMetadata
from llmserve.paths import cache_dir

logger = logging.getLogger("llmserve.compile")
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


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


class DecodeGraphs:
    """torch.compile'd decode forward, one graph per batch bucket."""

    def __init__(self, model: torch.nn.Module, buckets: tuple[int, ...] = DEFAULT_BUCKETS):
        import os

        import torch._inductor.config as inductor_config

        inductor_cache = cache_dir("inductor")
        inductor_cache.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(inductor_cache))
        inductor_config.fx_graph_cache = True  # a second start reuses compiled graphs
        # one graph per bucket (a static and a dynamic-width one each), for every dtype in the
        # process: more than dynamo's default of 8 per function
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * len(buckets) + 8)
        self.model = model
        self.buckets = tuple(sorted(buckets))
        self.fn: Callable = torch.compile(self._decode, fullgraph=True)

    def _decode(self, ids, positions, slots, tables, seq_lens, kv_caches):
        meta = AttentionMetadata(slots, ids.shape[0], tables, seq_lens, [])
        return self.model(ids, positions, kv_caches, meta)

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def __call__(self, ids, positions, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        """Same contract as model.forward, for a decode-only batch of at most max(buckets) rows."""
        d = ids.shape[0]
        b = self.bucket(d)
        assert b is not None and meta.num_decodes == d and not meta.prefills
        pad = b - d
        tables = meta.decode_block_tables
        if pad:
            z = torch.zeros(pad, dtype=torch.long)
            ids, positions, slots = torch.cat([ids, z]), torch.cat([positions, z]), torch.cat([meta.slot_mapping, z])
            tables = torch.cat([tables, torch.zeros(pad, tables.shape[1], dtype=torch.long)])
            seq_lens = torch.cat([meta.decode_seq_lens, torch.ones(pad, dtype=torch.long)])
        else:
            slots, seq_lens = meta.slot_mapping, meta.decode_seq_lens
        torch._dynamo.mark_dynamic(tables, 1)
        return self.fn(ids, positions, slots, tables, seq_lens, kv_caches)[:d]

    def warm_up(self, kv_caches: list[torch.Tensor]) -> None:
        from tqdm import tqdm

        # inputs made in inference mode, as ModelRunner.execute makes them: a graph compiled for
        # ordinary tensors fails dynamo's dispatch-key guard on inference tensors and is compiled
        # again at the first real step of each bucket
        with torch.inference_mode():
            for b in tqdm(self.buckets, desc="compiling decode buckets", unit="graph"):
                for width in (1, 2):  # the second width makes the block-table dimension dynamic
                    tables = torch.zeros(b, width, dtype=torch.long)
                    meta = AttentionMetadata(torch.zeros(b, dtype=torch.long), b, tables, torch.ones(b, dtype=torch.long), [])
                    self(torch.zeros(b, dtype=torch.long), torch.zeros(b, dtype=torch.long), kv_caches, meta)
