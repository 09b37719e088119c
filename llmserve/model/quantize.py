"""Block-quantized weights that stay quantized: GGUF's Q8_0 and Q4_1 layouts, served as stored.

Two formats, each with blocks of 32 weights along K (the input dimension):
- int8 (Q8_0): w = d * q, q int8, one float16 scale d a block (1.06 bytes a weight);
- int4 (Q4_1): w = d * q + m, q in 0..15 (two a byte), float16 d and m a block (0.63 bytes a weight).
QuantizedTensor keeps q [out, kb * 32] int8 or [out, kb * 16] uint8 (in block b, weight j < 16 is
the low nibble of byte 16b + j, weight j + 16 its high nibble), d and m [out, kb] float16;
kb = ceil(in / 32), and a partial last block is padded.

QuantLinear runs llmserve::qlinear (kernels/quant_linear.cpp: its weight registered once, by
handle, so that a compiled graph holds an int a layer), which reads the packed bytes
and dequantizes in registers for steps of few rows, and dequantizes tiles into cache for the
GEMM otherwise; without the native kernels it dequantizes in torch. Every path computes the same
weights: d * q (+ m) as one fp32 FMA, exactly what `dequantize` returns.

A quantized checkpoint (written by `llmserve quantize`, or converted from a GGUF file) is an HF
folder whose config.json carries `quantization_config: {"quant_method": "llmserve-blockwise"}`
and whose safetensors hold, for each quantized weight `<name>.weight`, `<name>.qweight`,
`<name>.scales` and (int4) `<name>.mins` instead, under the checkpoint's own (unfused) names.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import shutil
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger("llmserve.model")
QUANT_METHOD = "llmserve-blockwise"
BLOCK = 32
FORMATS = ("int8", "int4")
GGUF_NAMES = {"int8": "Q8_0", "int4": "Q4_1"}  # the GGUF type each format's layout comes from
_HANDLES = itertools.count()
_OUT_FEATURES: dict[int, int] = {}  # handle -> out_features of each weight registered with llmserve::qlinear


@dataclass(frozen=True)
class QuantizedTensor:
    """A [out, in] weight in one of FORMATS (see the module docstring for the layout)."""

    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None
    in_features: int

    @property
    def format(self) -> str:
        return "int4" if self.m is not None else "int8"

    @property
    def out_features(self) -> int:
        return self.q.shape[0]

    def rows(self, index: torch.Tensor | slice) -> QuantizedTensor:
        """The weight's rows `index` (a row permutation or selection keeps every block whole)."""
        return QuantizedTensor(self.q[index], self.d[index], None if self.m is None else self.m[index], self.in_features)

    @staticmethod
    def cat(parts: list[QuantizedTensor]) -> QuantizedTensor:
        """Rows of `parts` one after the other; every part of one format and width."""
        assert len({(p.format, p.in_features) for p in parts}) == 1
        m = None if parts[0].m is None else torch.cat([p.m for p in parts])
        return QuantizedTensor(torch.cat([p.q for p in parts]), torch.cat([p.d for p in parts]), m, parts[0].in_features)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.d, self.m) if t is not None)


def num_blocks(in_features: int) -> int:
    return -(-in_features // BLOCK)


def quantize(w: torch.Tensor, fmt: str) -> QuantizedTensor:
    """w: [out, in] float -> its `fmt` blocks (Q8_0: d = max|w| / 127; Q4_1: d = (max - min) / 15,
    m = min), with q computed against the float16-rounded d and m that are stored."""
    out, k = w.shape
    kb = num_blocks(k)
    wf = F.pad(w.detach().float(), (0, kb * BLOCK - k)).view(out, kb, BLOCK)
    if fmt == "int8":
        d = (wf.abs().amax(-1) / 127).half()
        inv = torch.where(d == 0, 0.0, 1.0 / d.float())
        q = torch.round(wf * inv[..., None]).clamp(-127, 127).to(torch.int8)
        return QuantizedTensor(q.view(out, kb * BLOCK), d, None, k)
    if fmt != "int4":
        raise ValueError(f"unknown format {fmt!r}")
    lo, hi = wf.amin(-1), wf.amax(-1)
    d, m = ((hi - lo) / 15).half(), lo.half()
    inv = torch.where(d == 0, 0.0, 1.0 / d.float())
    q = torch.round((wf - m.float()[..., None]) * inv[..., None]).clamp(0, 15).to(torch.uint8)
    packed = (q[..., :16] | (q[..., 16:] << 4)).reshape(out, kb * 16)
    return QuantizedTensor(packed, d, m, k)


def dequantize(t: QuantizedTensor) -> torch.Tensor:
    """The [out, in] float32 weight every path computes with."""
    out, kb = t.d.shape
    if t.m is None:
        q = t.q.view(out, kb, BLOCK).float()
        w = q * t.d.float()[..., None]
    else:
        b = t.q.view(out, kb, 16)
        q = torch.cat([b & 15, b >> 4], dim=-1).float()
        w = torch.addcmul(t.m.float()[..., None], q, t.d.float()[..., None])
    return w.reshape(out, kb * BLOCK)[:, : t.in_features]


class QuantLinear(nn.Module):
    """A linear layer over a QuantizedTensor. After use_native(True) (the native kernels are
    loaded, the layer final): llmserve::qlinear over the weight registered under `handle`;
    otherwise the weight is dequantized in torch on each call."""

    def __init__(self, weight: QuantizedTensor, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features, self.format = weight.in_features, weight.out_features, weight.format
        self.register_buffer("qweight", weight.q.contiguous())
        self.register_buffer("scales", weight.d.contiguous())
        self.register_buffer("mins", None if weight.m is None else weight.m.contiguous())
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.native = False
        self.packed = -1  # a oneDNN-packed float copy's handle, for steps above quant_max_rows (model/packed.py)
        self.handle = next(_HANDLES)

    def use_native(self, enabled: bool) -> None:
        """Run through llmserve::qlinear (True) or torch from now on."""
        self.native = bool(enabled)
        if self.native:
            self.register_native()

    def register_native(self) -> None:
        """(Re)register the weight, bias and packed copy with llmserve::qlinear under self.handle;
        released with the layer."""
        if self.handle not in _OUT_FEATURES:
            _register_native_shape()
            weakref.finalize(self, _release, self.handle)
        _OUT_FEATURES[self.handle] = self.out_features
        torch.ops.llmserve.quant_register(self.handle, self.qweight, self.scales, self.mins, self.bias,
                                          self.in_features, self.packed)

    @property
    def quantized(self) -> QuantizedTensor:
        return QuantizedTensor(self.qweight, self.scales, self.mins, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, in] -> [T, out]
        if self.native:
            return torch.ops.llmserve.qlinear(x, self.handle)
        return F.linear(x, dequantize(self.quantized).to(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.format}"


def _release(handle: int) -> None:
    _OUT_FEATURES.pop(handle, None)
    torch.ops.llmserve.quant_release(handle)


@functools.cache
def _register_native_shape() -> None:
    @torch.library.register_fake("llmserve::qlinear")
    def _(x: torch.Tensor, handle: int) -> torch.Tensor:
        return x.new_empty(x.shape[0], _OUT_FEATURES[handle])


def linear_layers(model: nn.Module) -> list[tuple[nn.Module, str, str, nn.Module]]:
    """(parent, attribute, qualified name, layer) for every nn.Linear and QuantLinear, collected
    before any swap."""
    return [
        (parent, attr, f"{name}.{attr}" if name else attr, child)
        for name, parent in model.named_modules()
        for attr, child in parent.named_children()
        if isinstance(child, nn.Linear | QuantLinear)
    ]


def quantize_model(model: nn.Module, fmt: str) -> nn.Module:
    """Every linear layer (the LM head included) in `fmt`, in place: float layers are quantized,
    layers already in `fmt` are kept, layers in another format are requantized from their
    dequantized weights (said in the log). A tied embedding then looks up the LM head's
    dequantized weights, as a quantized checkpoint's does."""
    embed = getattr(model, "embed_tokens", None)
    tied = embed is not None and isinstance(getattr(model, "lm_head", None), nn.Linear) and model.lm_head.weight is embed.weight
    for parent, attr, name, layer in linear_layers(model):
        if isinstance(layer, QuantLinear):
            if layer.format == fmt:
                continue
            logger.info("%s: %s weights requantized to %s (--quantize %s)", name, layer.format, fmt, fmt)
            w = dequantize(layer.quantized)
        else:
            w = layer.weight.data
        setattr(parent, attr, QuantLinear(quantize(w, fmt), layer.bias))
    if tied:
        embed.weight = nn.Parameter(dequantize(model.lm_head.quantized).to(embed.weight.dtype), requires_grad=False)
    return model


def dequantize_model(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Every QuantLinear back to a float nn.Linear in `dtype` (--quantize none)."""
    for parent, attr, _, layer in linear_layers(model):
        if isinstance(layer, QuantLinear):
            dense = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta")
            dense.weight = nn.Parameter(dequantize(layer.quantized).to(dtype), requires_grad=False)
            if layer.bias is not None:
                dense.bias = nn.Parameter(layer.bias.to(dtype), requires_grad=False)
            setattr(parent, attr, dense)
    return model


def use_native_quant(model: nn.Module, enabled: bool) -> int:
    """QuantLinear layers through llmserve::qlinear (True) or torch; returns how many."""
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    for layer in layers:
        layer.use_native(enabled)
    return len(layers)


def weight_formats(model: nn.Module) -> str:
    """What the linear layers hold: e.g. `int4`, `int4+int8` (mixed), or `float`; keys caches."""
    found = sorted({layer.format if isinstance(layer, QuantLinear) else "float" for *_, layer in linear_layers(model)})
    return "+".join(found)


def quantize_checkpoint(hf: dict, fmt: str, tied: bool) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A checkpoint's weights (HF names, float or QuantizedTensor) with every linear weight in
    `fmt`: the LM head and, when tied to it, the embedding; norms and biases stay float.
    Returns the tensors to write (quantized_entries for each quantized weight) and the formats
    recorded in config.json."""
    out: dict[str, torch.Tensor] = {}
    for name, w in hf.items():
        linear = name.endswith("_proj.weight") or name.endswith("lm_head.weight") or (tied and name.endswith("embed_tokens.weight"))
        if not linear:
            out[name] = dequantize(w) if isinstance(w, QuantizedTensor) else w
            continue
        if not (isinstance(w, QuantizedTensor) and w.format == fmt):
            w = quantize(dequantize(w) if isinstance(w, QuantizedTensor) else w, fmt)
        out.update(quantized_entries(name, w))
    return out, {"linear": fmt, **({"embedding": fmt} if tied else {})}


def save_quantized(model_dir: Path, out_dir: Path, tensors: dict[str, torch.Tensor], formats: dict[str, str]) -> Path:
    """Write a quantized checkpoint: `tensors` under checkpoint names, next to copies of the
    tokenizer and generation config; `formats` (layer kind -> format) is recorded in config.json."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json"):
        if (Path(model_dir) / name).exists() and Path(model_dir).resolve() != out_dir.resolve():
            shutil.copy(Path(model_dir) / name, out_dir / name)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    config["quantization_config"] = quantization_config(formats)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / "model.safetensors"),
              metadata={"format": QUANT_METHOD})
    return out_dir


def quantization_config(formats: dict[str, str]) -> dict:
    return {"quant_method": QUANT_METHOD, "block_size": BLOCK, "formats": dict(sorted(formats.items()))}


def quantized_entries(name: str, t: QuantizedTensor) -> dict[str, torch.Tensor]:
    """A weight's checkpoint tensors: `<name>.weight` -> qweight, scales (, mins)."""
    base = name.removesuffix(".weight")
    out = {f"{base}.qweight": t.q, f"{base}.scales": t.d}
    if t.m is not None:
        out[f"{base}.mins"] = t.m
    return out


def read_quantized(tensors: dict[str, torch.Tensor], name: str, in_features: int) -> QuantizedTensor | None:
    """The QuantizedTensor stored for weight `name` (popped from `tensors`), or None."""
    base = name.removesuffix(".weight")
    if f"{base}.qweight" not in tensors:
        return None
    q, d, m = tensors.pop(f"{base}.qweight"), tensors.pop(f"{base}.scales", None), tensors.pop(f"{base}.mins", None)
    return QuantizedTensor(q, d, m, in_features) if d is not None else None
