"""LoRA deltas of a batch that mixes adapters, beside the base model's linear layers.

Each fused linear (qkv_proj, o_proj, gate_up_proj, down_proj) has a LoRASlots: --max-loras slots
of stacked, zero-padded adapter weights, the rank padded to --max-lora-rank R and the scale
folded into B:
  lora_a  [slots, n * R, in]          the n slices' A matrices (q, k, v: n = 3) stacked on the rank
  lora_b  [slots, n * R, sum(out_i)]  their B matrices, transposed, block-diagonal: slice i's R rows
                                      are zero outside slice i's output columns
A step's LoRABatch says which rows use which slot (row_slots [T], -1: none). The base matmul runs
once; each row gets only its own adapter's delta, in one of two ways:
- native (the native kernels are loaded): llmserve::lora_add adds every row's delta in one pass
  (llmserve/kernels/lora.cpp), grouping the rows by slot. A decode step's deltas are a few million
  multiply-adds per layer, and three torch ops per linear cost a fixed 25-60 us each, far more
  than the arithmetic: at 32 rows the op took a decode step with adapters from 43 to about
  31 ms (the base alone: 28 ms).
- torch: a one-hot mask [T, K] over the first K slots (the engine keeps the step's adapters
  there, K >= 2), with no per-row gather of weights and three ops per fused linear:
    xa  = x @ lora_a[:K]^T             [T, K * n * R]
    xa *= mask, widened to n * R       each row keeps its own slot only
    y  += xa @ lora_b[:K]              [T, sum(out_i)]
  The block-diagonal B trades n times the (small) B FLOPs for one matmul instead of n and a
  concatenation. The work grows with K, not with the rows per adapter.
Either way the compiled step graph takes the slots (and K) as dynamic inputs, so its shapes stay
fixed however adapters mix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

MIN_SLOTS = 2  # dynamo specialises a size of 1: one adapter computes over two slots
WARM_UP_SLOTS = 3  # the compiled LoRA graph warms up on K = 3, a size like no other of its warm-up step


def num_slots(max_loras: int) -> int:
    """Slots to allocate: max_loras, and at least WARM_UP_SLOTS."""
    return max(max_loras, WARM_UP_SLOTS)


@dataclass(slots=True)
class LoRABatch:
    row_slots: torch.Tensor  # [T] int64: each row's slot, -1: none
    masks: dict[int, torch.Tensor]  # torch path: n * R -> [T, K * n * R] in the activation dtype, 1 where a row uses the slot

    @staticmethod
    def of(row_slots: torch.Tensor, slot_ids: torch.Tensor, dtype: torch.dtype, widths: tuple[int, ...]) -> LoRABatch:
        """row_slots [T] (-1: none), slot_ids = arange(K) [K]; a mask per slice width n * R of
        the slots that take the torch path (`widths`; none when all are native)."""
        onehot = (row_slots[:, None] == slot_ids[None, :]).to(dtype) if widths else None
        return LoRABatch(row_slots, {w: onehot.repeat_interleave(w, dim=1) for w in widths})


class LoRASlots(nn.Module):
    def __init__(self, in_features: int, out_slices: list[int], max_loras: int, max_rank: int):
        super().__init__()
        self.rank, self.out_slices = max_rank, list(out_slices)
        self.width = len(out_slices) * max_rank  # n * R
        self.native = False  # llmserve::lora_add (set with the model's other native kernels)
        self.register_buffer("lora_a", torch.zeros(max_loras, self.width, in_features), persistent=False)
        self.register_buffer("lora_b", torch.zeros(max_loras, self.width, sum(out_slices)), persistent=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
        """y (the base linear's output [T, out]) plus each row's delta (natively: y itself, updated)."""
        if self.native:
            torch.ops.llmserve.lora_add(y, x, self.lora_a, self.lora_b, batch.row_slots, self.out_slices)
            return y
        mask = batch.masks[self.width]
        k = mask.shape[1] // self.width
        xa = (x @ self.lora_a[:k].reshape(k * self.width, -1).t()) * mask
        return torch.addmm(y, xa, self.lora_b[:k].reshape(k * self.width, -1))

    def set_slot(self, slot: int, slices: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Slot `slot` holds these slices' (A [r, in], B [out, r]); absent slices are zero."""
        r = self.rank
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        starts = [sum(self.out_slices[:i]) for i in range(len(self.out_slices))]
        for i, (a_i, b_i) in slices.items():
            self.lora_a[slot, i * r: i * r + a_i.shape[0]].copy_(a_i)
            self.lora_b[slot, i * r: i * r + b_i.shape[1], starts[i]: starts[i] + b_i.shape[0]].copy_(b_i.t())

    def copy_slot(self, src: int, dst: int) -> None:
        self.lora_a[dst].copy_(self.lora_a[src])
        self.lora_b[dst].copy_(self.lora_b[src])
