"""The engine's adapters: read from disk when a request for one is added, kept in memory (an LRU
of --max-cpu-loras; each request also holds the weights it was added with, so a step never reads
a file), and placed into the model's --max-loras slots for the steps that use them.

Slots: a step with adapters X, Y uses the first K = max(MIN_SLOTS, |{X, Y}|) slots (LoRASlots
computes over exactly those), so `prepare` moves the step's adapters into slots below K: one
already there stays; another takes a slot below K whose adapter this step does not use (an empty
one first), copied from the slot it sat in or from memory. Adapters change between steps rarely,
so a step mostly writes nothing. The scheduler never puts more than --max-loras adapters in one
step.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch

from llmserve.lora.adapter import BaseShapes, LoRAAdapter, LoRARequest, load_adapter
from llmserve.lora.layers import MIN_SLOTS, LoRASlots
from llmserve.model.config import ModelConfig

logger = logging.getLogger("llmserve.lora")


class LoRAManager:
    def __init__(self, slots: dict[tuple[int, str], LoRASlots], base: BaseShapes, max_loras: int, max_cpu_loras: int,
                 max_rank: int):
        self.slots = slots  # (layer, fused layer name) -> its LoRASlots
        self.base, self.max_rank = base, max_rank
        self.num_slots = next(iter(slots.values())).lora_a.shape[0]
        self.max_cpu_loras = max(max_cpu_loras, max_loras)
        self.loaded: OrderedDict[int, LoRAAdapter] = OrderedDict()  # lora_int_id -> adapter, least recently used first
        self.occupant: list[int | None] = [None] * self.num_slots  # slot -> lora_int_id

    def adapter(self, req: LoRARequest) -> LoRAAdapter:
        """The adapter, read from its path the first time (typed errors when it cannot be)."""
        a = self.loaded.get(req.lora_int_id)
        if a is None:
            a = load_adapter(req.lora_name, req.lora_path, self.base, self.max_rank)
            self.loaded[req.lora_int_id] = a
            while len(self.loaded) > self.max_cpu_loras:
                evicted, _ = self.loaded.popitem(last=False)
                logger.info("LoRA adapter id %d evicted from memory (--max-cpu-loras)", evicted)
        self.loaded.move_to_end(req.lora_int_id)
        return a

    def prepare(self, active: dict[int, LoRAAdapter]) -> dict[int, int]:
        """Place the step's adapters (lora_int_id -> weights; at most max_loras) in the first K
        slots; lora_int_id -> slot."""
        k = max(MIN_SLOTS, len(active))
        placed = {lid: s for s, lid in enumerate(self.occupant[:k]) if lid in active}
        free = sorted((s for s in range(k) if self.occupant[s] not in active), key=lambda s: self.occupant[s] is not None)
        for lid, adapter in active.items():
            if lid in placed:
                continue
            slot = free.pop(0)
            if lid in self.occupant:
                self._move(self.occupant.index(lid), slot)
            else:
                self._write(slot, adapter)
            self.occupant[slot] = lid
            placed[lid] = slot
        return placed

    def _move(self, src: int, dst: int) -> None:
        for layer in self.slots.values():
            layer.copy_slot(src, dst)
        self.occupant[src] = None

    @torch.inference_mode()
    def _write(self, slot: int, adapter: LoRAAdapter) -> None:
        by_layer: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        for (layer, fused, i), ab in adapter.weights.items():
            by_layer.setdefault((layer, fused), {})[i] = ab
        for key, layer_slots in self.slots.items():
            layer_slots.set_slot(slot, by_layer.get(key, {}))

def base_shapes(cfg: ModelConfig) -> BaseShapes:
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    h, inter = cfg.hidden_size, cfg.intermediate_size
    return BaseShapes(cfg.num_hidden_layers, {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                                              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)})
