"""int8 weight-only quantization with per-output-channel scales.

Int8Linear keeps weight_int8 [out, in] and weight_scale [out]; y = (x @ weight_int8.T) * scale
runs through ATen's fused int8-weight kernel (`_weight_int8pack_mm`), which reads int8 weights
and never materialises a dequantized matrix. Embeddings and norms stay in the model dtype; the
LM head is quantized too (for tied embeddings it gets its own int8 copy).

A quantized checkpoint is an HF folder whose config.json carries
`quantization_config: {"quant_method": "llmserve-int8"}` and whose safetensors hold, per linear
layer, `<name>.weight_int8` and `<name>.weight_scale` (our fused names: qkv_proj, gate_up_proj).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from torch import nn

QUANT_METHOD = "llmserve-int8"


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [out, in] float -> (int8 [out, in], scale [out] float32), symmetric per output channel."""
    scale = w.float().abs().amax(dim=1).clamp(min=1e-8) / 127.0
    q = torch.round(w.float() / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


class Int8Linear(nn.Module):
    def __init__(self, weight_int8: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.compute_dtype = torch.bfloat16  # the int8 kernel is fast with bf16 activations on CPU
        self.register_buffer("weight_int8", weight_int8.contiguous())
        self.register_buffer("weight_scale", weight_scale.to(self.compute_dtype))
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)
        self.out_dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in] -> [..., out]
        shape = x.shape
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, shape[-1]).to(self.compute_dtype), self.weight_int8, self.weight_scale)
        y = y.to(self.out_dtype).reshape(*shape[:-1], -1)
        return y if self.bias is None else y + self.bias


def linear_layers(model: nn.Module) -> list[tuple[nn.Module, str, str, nn.Linear]]:
    """(parent, attribute, qualified name, layer) for every nn.Linear, collected before any swap."""
    return [
        (parent, attr, f"{name}.{attr}" if name else attr, child)
        for name, parent in model.named_modules()
        for attr, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]


def quantize_model(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Replace every nn.Linear in place by an Int8Linear (the LM head included)."""
    for parent, attr, _, layer in linear_layers(model):
        q, s = quantize_weight(layer.weight.data)
        setattr(parent, attr, Int8Linear(q, s, layer.bias, dtype))
    return model


def int8_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.contiguous() for k, v in model.state_dict().items()}


def save_quantized(model_dir: Path, out_dir: Path, model: nn.Module) -> Path:
    """Write a quantized checkpoint next to copies of the tokenizer and generation config."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json"):
        if (Path(model_dir) / name).exists():
            shutil.copy(Path(model_dir) / name, out_dir / name)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    config["quantization_config"] = {"quant_method": QUANT_METHOD, "bits": 8, "granularity": "per_output_channel"}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    state = {k: v for k, v in int8_state_dict(model).items() if not k.startswith("rotary.")}
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": QUANT_METHOD})
    return out_dir


def load_quantized(model: nn.Module, state: dict[str, torch.Tensor], dtype: torch.dtype, source: str) -> nn.Module:
    """Build Int8Linear modules from a quantized state dict into a meta-initialised model."""
    from llmserve.errors import ModelLoadError

    for parent, attr, key, _ in linear_layers(model):
        q, s = state.pop(f"{key}.weight_int8", None), state.pop(f"{key}.weight_scale", None)
        if q is None or s is None:
            raise ModelLoadError(f"{source}: quantized tensor {key}.weight_int8/.weight_scale is missing")
        setattr(parent, attr, Int8Linear(q, s.float(), state.pop(f"{key}.bias", None), dtype))
    return model
