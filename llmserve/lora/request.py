"""LoRARequest: which adapter a request runs under, as it crosses from the server (or the offline
LLM) to the engine. Plain data, no torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """Which adapter a request runs under (vLLM's name): lora_int_id is unique per load, so a
    reloaded adapter never reuses an earlier one's state; content_hash keys every cache."""

    lora_name: str
    lora_int_id: int  # >= 1
    lora_path: str
    content_hash: str = ""
