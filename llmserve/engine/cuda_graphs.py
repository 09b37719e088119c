"""CUDA graphs for decode steps: the bookkeeping, with no CUDA call in it.

vLLM's scheme (cudagraph_mode FULL_DECODE_ONLY): a pure decode step of n rows replays the graph
captured for the smallest capture size B >= n, over static input buffers. What is here runs on any
device and is tested on the CPU:

- cudagraph_capture_sizes(max_num_seqs): the sizes captured (1, 2, 4, 8, then every 8 up to 64
  and every 16 beyond, capped at and including max_num_seqs).
- graph_batch_size(inp, sizes): B for a step, or None where it runs eager: prefill chunks in it
  (mixed or prefill-only steps), prompt tokens to score (they need every row's hidden state),
  LoRA adapters, more rows than the largest size.
- StaticDecodeInputs: the buffers a graph is captured over, [max size] rows each, and fill(),
  which copies a step into their first B rows. Rows n..B-1 are padding: token 0 at position 0,
  slot -1 (writes nothing into the KV cache), seq_len 0 on a table of the null block 0 (reads
  nothing; its attention output is zeros). Every implementation of the cache write and of decode
  attention keeps that contract (llmserve.model.attention, kernels/, kernels/triton_attention.py).

Not built, as it has not run on a GPU: the runner that warms up and captures one
torch.cuda.CUDAGraph per size (largest first, one shared memory pool) over views of these
buffers, replays it and reads the logits of the step's rows out of its static output; the
capture time logged at start-up; pinned host staging with non_blocking copies, and sampled
tokens copied back on a side stream behind an event.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from llmserve.model.attention import AttentionMetadata, PrefillBatch

if TYPE_CHECKING:
    from llmserve.engine.model_runner import ModelInput

PAD_SLOT_ID = -1  # a padded row's slot: the cache write skips it (vLLM's PAD_SLOT_ID)
NULL_BLOCK = 0  # never handed to a sequence (block_manager); padded table entries name it


def cudagraph_capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """Ascending batch sizes to capture: 1, 2, 4, 8, 16, 24, ..., 64, 80, 96, ..., each at most
    max_num_seqs, and max_num_seqs itself (so every decode step of the scheduler has a size)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be at least 1, not {max_num_seqs}")
    sizes = [1, 2, 4, *range(8, 65, 8), *range(80, max_num_seqs + 1, 16)]
    return tuple(sorted({s for s in sizes if s < max_num_seqs} | {max_num_seqs}))


def padded_batch_size(num_rows: int, capture_sizes: Sequence[int]) -> int | None:
    """The smallest capture size >= num_rows (capture_sizes ascending); None past the largest."""
    if num_rows < 1:
        return None
    i = bisect_left(capture_sizes, num_rows)
    return capture_sizes[i] if i < len(capture_sizes) else None


def graph_batch_size(inp: ModelInput, capture_sizes: Sequence[int]) -> int | None:
    """The capture size a step replays, or None where it runs eager (see the module's docstring).
    A decode with drafts is a decode step too: its 1 + k rows are decode rows."""
    meta = inp.meta
    t = inp.input_ids.shape[0]
    pb = meta.prefill_batch
    if meta.prefills or (pb is not None and pb.query_len.numel()) or meta.num_decodes != t:
        return None
    if inp.prompt_rows or inp.lora is not None:
        return None
    return padded_batch_size(t, capture_sizes)


class StaticDecodeInputs:
    """The inputs a decode graph reads, in fixed storage, on `device` (vLLM's persistent buffers):
      input_ids, positions, slot_mapping, seq_lens  [max_batch_size] int64
      block_tables                                  [max_batch_size, max_blocks] int64
    A graph of size B is captured over their first B rows, and replays whatever the last fill()
    left there. max_blocks = cdiv(max_model_len, block_size): a step's tables fit any context."""

    def __init__(self, max_batch_size: int, max_blocks: int, device: torch.device | str = "cpu"):
        longs = dict(dtype=torch.long, device=device)
        self.input_ids = torch.zeros(max_batch_size, **longs)
        self.positions = torch.zeros(max_batch_size, **longs)
        self.slot_mapping = torch.full((max_batch_size,), PAD_SLOT_ID, **longs)
        self.seq_lens = torch.zeros(max_batch_size, **longs)
        self.block_tables = torch.full((max_batch_size, max_blocks), NULL_BLOCK, **longs)
        # no prefill chunks: the one Triton kernel's chunk arguments, [0] and [0, 1]
        none = torch.zeros(0, **longs)
        self.no_prefills = PrefillBatch(none, none, none, torch.zeros(0, 1, **longs))

    @property
    def max_batch_size(self) -> int:
        return self.input_ids.shape[0]

    def fill(self, inp: ModelInput, batch_size: int) -> ModelInput:
        """`inp` (a decode step of n <= batch_size rows) copied into the buffers' first batch_size
        rows, padded; returns it as a ModelInput over views of them. The rows to sample and verify
        stay inp's (all < n): padded rows' logits are never read."""
        from llmserve.engine.model_runner import ModelInput

        meta = inp.meta
        n, (_, width) = inp.input_ids.shape[0], meta.decode_block_tables.shape
        if not (meta.num_decodes == n <= batch_size <= self.max_batch_size):
            raise ValueError(f"a decode step of {n} rows ({meta.num_decodes} decode rows) does not fit "
                             f"{batch_size} of {self.max_batch_size} static rows")
        if width > self.block_tables.shape[1]:
            raise ValueError(f"block tables {width} wide, over the static {self.block_tables.shape[1]}")
        b = batch_size
        for buf, src, pad in ((self.input_ids, inp.input_ids, 0), (self.positions, inp.positions, 0),
                              (self.slot_mapping, meta.slot_mapping, PAD_SLOT_ID), (self.seq_lens, meta.decode_seq_lens, 0)):
            buf[:n].copy_(src, non_blocking=True)
            buf[n:b].fill_(pad)
        self.block_tables[:n, :width].copy_(meta.decode_block_tables, non_blocking=True)
        self.block_tables[:n, width:].fill_(NULL_BLOCK)
        self.block_tables[n:b].fill_(NULL_BLOCK)
        padded = AttentionMetadata(
            slot_mapping=self.slot_mapping[:b],
            num_decodes=b,
            decode_block_tables=self.block_tables[:b],
            decode_seq_lens=self.seq_lens[:b],
            prefills=[],
            prefill_batch=self.no_prefills if meta.prefill_batch is not None else None,
        )
        return ModelInput(self.input_ids[:b], self.positions[:b], padded, inp.sample_rows, inp.sample_requests,
                          inp.prompt_rows, inp.spec_rows, inp.lora)
