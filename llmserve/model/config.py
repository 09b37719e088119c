"""ModelConfig: the architecture fields we need, read from a Hugging Face config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmserve.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
REQUIRED_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


@dataclass(slots=True, frozen=True)
class ModelConfig:
    model_type: str  # llama | mistral | qwen2
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # qwen2: q/k/v have bias
    quantization: str | None = None  # quantization_config.quant_method of a quantized checkpoint
    weight_formats: tuple[str, ...] = ()  # the formats its linear weights are stored in (int8, int4), sorted

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        archs = raw.get("architectures") or []
        model_type = raw.get("model_type")
        kind = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if kind is None and model_type in SUPPORTED_ARCHITECTURES.values():
            kind = model_type
        if kind is None:
            names = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
            raise ModelLoadError(
                f"{source}: unsupported architecture {archs or model_type!r}; supported: {names}"
            )
        missing = [f for f in REQUIRED_FIELDS if f not in raw]
        if missing:
            raise ModelLoadError(f"{source}: missing required field(s) {', '.join(missing)}")
        heads = int(raw["num_attention_heads"])
        rope_theta, rope_scaling = _rope_fields(raw)
        return cls(
            model_type=kind,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", kind == "qwen2")),
            quantization=(raw.get("quantization_config") or {}).get("quant_method"),
            weight_formats=tuple(sorted(set(((raw.get("quantization_config") or {}).get("formats") or {}).values()))),
        )

    @classmethod
    def from_file(cls, path: Path) -> ModelConfig:
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ModelLoadError(f"{path}: config.json not found") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise ModelLoadError(f"{path}: expected a JSON object")
        return cls.from_dict(raw, str(path))


def _rope_fields(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """rope_theta and rope_scaling, from either the classic or the newer `rope_parameters` layout."""
    params = raw.get("rope_parameters") or {}
    theta = float(raw.get("rope_theta") or params.get("rope_theta") or 10000.0)
    scaling = raw.get("rope_scaling") or None
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = dict(params)
    if scaling is not None:
        kind = scaling.get("rope_type") or scaling.get("type")
        if kind in (None, "default"):
            scaling = None
        elif kind != "llama3":
            raise ModelLoadError(f"config.json: unsupported rope_scaling type {kind!r} (supported: llama3)")
    return theta, scaling
