"""LoRA deltas of a batch that mixes adapters, beside the base model's linear layers.

Each fused linear (qkv_proj, o_proj, gate_up_proj, down_proj) has a LoRASlots: --max-loras slots
of stacked, zero-padded adapter weights, the rank padded to --max-lora-rank R and the scale
folded into B:
  lora_a   [max_loras, n * R, in]   the n slices' A matrices (q, k, v: n = 3) stacked on the rank
  lora_b_i [max_loras, R, out_i]    slice i's B, transposed
A step's LoRABatch says which rows use which slot: row_slots [T] (-1: the base model, no delta)
and num_slots K, the first K slots (the engine keeps the step's adapters there, K >= 2). Per
fused linear, all rows at once, and without a per-row gather of weights:
  xa    = x @ lora_a[:K]^T                      [T, K * n * R]
  xa    = xa * onehot(row_slots, K)             the row's own slot only
  out_i = xa[slice i] @ lora_b_i[:K]            [T, out_i], concatenated over the slices
The base matmul runs once; each row gets only its own adapter's delta. The cost grows with K,
not with the number of rows per adapter; the compiled step graph takes row_slots and K as dynamic
inputs, so its shapes stay fixed however adapters mix.
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
    mask: torch.Tensor  # [T, K] in the activation dtype: 1 where a row uses the slot

    @staticmethod
    def of(row_slots: torch.Tensor, slot_ids: torch.Tensor, dtype: torch.dtype) -> LoRABatch:
        """row_slots [T] (-1: none), slot_ids = arange(K) [K]."""
        return LoRABatch((row_slots[:, None] == slot_ids[None, :]).to(dtype))


class LoRASlots(nn.Module):
    def __init__(self, in_features: int, out_slices: list[int], max_loras: int, max_rank: int):
        super().__init__()
        self.rank, self.out_slices = max_rank, list(out_slices)
        n = len(out_slices)
        self.register_buffer("lora_a", torch.zeros(max_loras, n * max_rank, in_features), persistent=False)
        for i, out in enumerate(out_slices):
            self.register_buffer(f"lora_b_{i}", torch.zeros(max_loras, max_rank, out), persistent=False)

    def forward(self, x: torch.Tensor, batch: LoRABatch) -> torch.Tensor:  # x [T, in] -> [T, sum(out_slices)]
        t, k = x.shape[0], batch.mask.shape[1]
        n, r = len(self.out_slices), self.rank
        xa = (x @ self.lora_a[:k].reshape(k * n * r, -1).t()).view(t, k, n, r) * batch.mask[:, :, None, None]
        outs = [xa[:, :, i].reshape(t, k * r) @ getattr(self, f"lora_b_{i}")[:k].reshape(k * r, -1) for i in range(n)]
        return outs[0] if n == 1 else torch.cat(outs, dim=-1)

    def set_slot(self, slot: int, slices: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Slot `slot` holds these slices' (A [r, in], B [out, r]); absent slices are zero."""
        r = self.rank
        self.lora_a[slot].zero_()
        for i in range(len(self.out_slices)):
            b = getattr(self, f"lora_b_{i}")[slot]
            b.zero_()
            if i in slices:
                a_i, b_i = slices[i]
                self.lora_a[slot, i * r: i * r + a_i.shape[0]].copy_(a_i)
                b[: b_i.shape[1]].copy_(b_i.t())

    def copy_slot(self, src: int, dst: int) -> None:
        self.lora_a[dst].copy_(self.lora_a[src])
        for i in range(len(self.out_slices)):
            b = getattr(self, f"lora_b_{i}")
            b[dst].copy_(b[src])
