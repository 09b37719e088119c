"""A LoRA adapter in PEFT's format, read and checked: `adapter_config.json` and
`adapter_model.safetensors` (or the older `adapter_model.bin`, read with weights_only).

Supported: peft_type LORA on the attention and MLP projections (q_proj, k_proj, v_proj, o_proj,
gate_proj, up_proj, down_proj), `target_modules` as a list or a regex, `r` and `lora_alpha`
with `rank_pattern` / `alpha_pattern`, `use_rslora`. Refused, with the field named: DoRA,
`modules_to_save`, a bias other than "none", fan_in_fan_out, a rank over --max-lora-rank, a
module the base model lacks (lm_head, embeddings, a layer past the last), a weight of the wrong
shape.

Each module's scale (lora_alpha / r, or / sqrt(r) under rslora) is folded into B here, so
serving computes x @ A^T @ B^T and nothing else. Shapes: A [r, in], B [out, r].
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_safetensors

from llmserve.errors import InvalidRequestError
from llmserve.lora.request import LoRARequest

__all__ = ["LoRARequest", "load_adapter"]

# a projection's name in PEFT (Hugging Face's module names) -> (our fused layer, its slice)
PROJECTIONS = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2), "o_proj": ("o_proj", 0),
               "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0)}
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>(?:model\.)?layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\.(?P<proj>\w+))"
                  r"\.lora_(?P<ab>[AB])(?:\.[\w-]+)?\.weight$")


class LoRAAdapterError(InvalidRequestError):
    """An adapter this server cannot serve (a 400 naming the field)."""


class LoRANotFoundError(InvalidRequestError):
    """No adapter at the path given (a 404)."""

    status_code = 404
    error_type = "not_found_error"


@dataclass(slots=True)
class LoRAAdapter:
    name: str
    rank: int  # the largest of its modules
    content_hash: str
    # (layer, fused layer name, slice) -> (A [r, in], B [out, r] with the scale folded in)
    weights: dict[tuple[int, str, int], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True, slots=True)
class BaseShapes:
    """What an adapter must fit: the base model's layers and each projection's (in, out)."""

    num_layers: int
    shapes: dict[str, tuple[int, int]]  # PEFT projection name -> (in_features, out_features)


def load_adapter(name: str, path: str, base: BaseShapes, max_rank: int) -> LoRAAdapter:
    """Read and check the adapter at `path` (typed 4xx errors naming the field)."""
    folder = Path(path)
    config_file = folder / "adapter_config.json"
    if not config_file.is_file():
        raise LoRANotFoundError(f"LoRA adapter {name!r}: no adapter_config.json in {path!r}", "lora_path", "lora_not_found")
    try:
        raw_config = config_file.read_bytes()
        config = json.loads(raw_config)
    except (OSError, ValueError) as e:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: cannot read adapter_config.json: {e}", "lora_path") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: adapter_config.json must hold an object", "lora_path")
    _check_config(name, config)
    tensors, raw_weights = _read_weights(name, folder)
    digest = hashlib.blake2b(raw_config + raw_weights, digest_size=16).hexdigest()
    rank, weights = _modules(name, config, tensors, base, max_rank)
    return LoRAAdapter(name, rank, digest, weights)


def _check_config(name: str, config: dict[str, Any]) -> None:
    def refuse(field: str, why: str) -> LoRAAdapterError:
        return LoRAAdapterError(f"LoRA adapter {name!r}: {field} {why}", field)

    if config.get("peft_type", "LORA") != "LORA":
        raise refuse("peft_type", f"is {config.get('peft_type')!r}; only LORA adapters are supported")
    if config.get("use_dora"):
        raise refuse("use_dora", "is true; DoRA adapters are not supported")
    if config.get("modules_to_save"):
        raise refuse("modules_to_save", f"is {config['modules_to_save']!r}; adapters that replace whole modules are not supported")
    if config.get("bias", "none") != "none":
        raise refuse("bias", f"is {config['bias']!r}; only 'none' is supported")
    if config.get("fan_in_fan_out"):
        raise refuse("fan_in_fan_out", "is true; only Llama-style (out, in) weights are supported")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unknown = [t for t in targets if t not in PROJECTIONS]
        if unknown:
            raise refuse("target_modules", f"names {unknown}, which the base model lacks (it has {', '.join(PROJECTIONS)})")
    elif isinstance(targets, str):
        if not any(re.fullmatch(targets, f"model.layers.0.self_attn.{p}") or re.fullmatch(targets, f"model.layers.0.mlp.{p}")
                   for p in PROJECTIONS):
            raise refuse("target_modules", f"{targets!r} matches none of the base model's projections")
    elif targets is not None:
        raise refuse("target_modules", "must be a list of module names or a regex")
    for field in ("r", "lora_alpha"):
        if not isinstance(config.get(field, 8), int | float) or config.get(field, 8) <= 0:
            raise refuse(field, "must be a positive number")


def _read_weights(name: str, folder: Path) -> tuple[dict[str, torch.Tensor], bytes]:
    st, pt = folder / "adapter_model.safetensors", folder / "adapter_model.bin"
    try:
        if st.is_file():
            raw = st.read_bytes()
            return load_safetensors(raw), raw
        if pt.is_file():
            raw = pt.read_bytes()
            return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True), raw
    except Exception as e:  # a corrupt or truncated file: the library's own error says what
        raise LoRAAdapterError(f"LoRA adapter {name!r}: cannot read its weights: {e}", "lora_path") from None
    raise LoRANotFoundError(f"LoRA adapter {name!r}: no adapter_model.safetensors or adapter_model.bin in {str(folder)!r}",
                        "lora_path", "lora_not_found")


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern: the first key that matches the module's name's end."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _modules(name: str, config: dict[str, Any], tensors: dict[str, torch.Tensor], base: BaseShapes,
             max_rank: int) -> tuple[int, dict]:
    pairs: dict[tuple[int, str, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None or m["proj"] not in PROJECTIONS:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: weight {key!r} targets a module the base model lacks "
                                   f"(it has {', '.join(PROJECTIONS)})", "target_modules")
        layer = int(m["layer"])
        if layer >= base.num_layers:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: weight {key!r} is for layer {layer}; the base model has "
                                   f"{base.num_layers}", "target_modules")
        pairs.setdefault((layer, m["proj"], m["module"]), {})[m["ab"]] = t
    if not pairs:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: its weights hold no LoRA matrices", "lora_path")
    weights, top = {}, 0
    for (layer, proj, module), ab in sorted(pairs.items()):
        a, b = ab.get("A"), ab.get("B")
        if a is None or b is None:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: {module} has lora_{'B' if b is None else 'A'} missing", "lora_path")
        r = int(_pattern_value(config.get("rank_pattern"), module, config.get("r", 8)))
        alpha = float(_pattern_value(config.get("alpha_pattern"), module, config.get("lora_alpha", 8)))
        d_in, d_out = base.shapes[proj]
        if a.shape[0] > max_rank:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: rank {a.shape[0]} of {module} is over --max-lora-rank {max_rank}", "r")
        if a.shape != (r, d_in) or b.shape != (d_out, r):
            raise LoRAAdapterError(f"LoRA adapter {name!r}: {module} has A {tuple(a.shape)} and B {tuple(b.shape)}; expected "
                                   f"({r}, {d_in}) and ({d_out}, {r}) (r from the config)", "r")
        scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        weights[(layer, *PROJECTIONS[proj])] = (a.float().contiguous(), (b.float() * scale).contiguous())
        top = max(top, r)
    return top, weights
