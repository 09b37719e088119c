"""Linear layers with weights pre-packed for oneDNN (the engine's default for float32 and bfloat16).

PackedLinear keeps its weight [out, in] reordered once, at start-up, into oneDNN's blocked
layout, and runs `mkldnn._linear_pointwise` on it. The plain nn.Linear path repacks or reads a
layout that suits the GEMM poorly on every call; measured over the 30 layers of SmolLM2-135M's
shapes, packed weights are 2-4x faster in float32 and 1.1-1.5x in bfloat16 (scripts/bench_offline.py
shows the end-to-end effect). Packing is checked against F.linear on a probe input at start-up
and skipped, with a log line, where this torch build or CPU cannot do it.

Where the native kernels run, every step (eager or compiled) calls the packed weights through
llmserve::onednn_linear(x, handle), a native op (llmserve/kernels) that saves a Python call per
layer and sends steps of few rows to llmserve::gemv; without them, compiled graphs call
llmserve::packed_linear. The handle names an entry of a process-wide table (kept in Python, and
mirrored in the native op's own table for native layers, which alone holds the plain weight), so
the weight never enters the graph. (As a graph constant, an opaque oneDNN tensor needs inductor's freezing and cannot be
pickled, which turns off inductor's on-disk cache; an int handle keeps the graph small and
cacheable, and eager and compiled share one copy of the weights.)
"""

from __future__ import annotations

import functools
import itertools
import logging
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.model.quantize import QuantLinear, dequantize, linear_layers

logger = logging.getLogger("llmserve.model")
BATCH_HINT = 64  # oneDNN picks the packed layout for this many rows; any row count works
_PACKED: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}  # handle -> (packed weight, bias)
_HANDLES = itertools.count()


class PackedLinear(nn.Module):
    """native: every step calls llmserve::onednn_linear (the native kernels are loaded), eager or
    compiled. gemv (native only): also keep the plain weight, and run steps of few rows (at most
    the plan's gemv_max_rows) through llmserve::gemv, which reads it once at close to the
    machine's streaming bandwidth (oneDNN's packed path reads it about a third slower at batch 1)."""

    def __init__(self, linear: nn.Linear, native: bool = False, gemv: bool = False):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # an opaque oneDNN tensor: not a parameter or buffer, so it never enters a state dict
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), BATCH_HINT)
        # an own copy: the loaded weight may sit on the checkpoint's memory map (see pack_linears)
        plain = linear.weight.detach().clone(memory_format=torch.contiguous_format) if native and gemv else None
        self.handle, self.native = next(_HANDLES), native
        _PACKED[self.handle] = (packed, linear.bias)
        if native:
            _register_native_shape()
            torch.ops.llmserve.packed_register(self.handle, packed, linear.bias, plain)
        weakref.finalize(self, _release, self.handle, native)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, in] -> [T, out]
        if self.native:
            return torch.ops.llmserve.onednn_linear(x, self.handle)
        if torch.compiler.is_compiling():
            return torch.ops.llmserve.packed_linear(x, self.handle)
        return packed_linear(x, self.handle)


@functools.cache
def _register_native_shape() -> None:
    torch.library.register_fake("llmserve::onednn_linear")(_packed_linear_shape)


def _release(handle: int, native: bool) -> None:
    _PACKED.pop(handle, None)
    if native:
        torch.ops.llmserve.packed_release(handle)


def packed_linear(x: torch.Tensor, handle: int) -> torch.Tensor:
    """A layer packed without the native kernels (no plain weight, no gemv)."""
    weight, bias = _PACKED[handle]
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _packed_linear_shape(x: torch.Tensor, handle: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], _PACKED[handle][0].shape[0])


_LIB = torch.library.Library("llmserve", "FRAGMENT")
_LIB.define("packed_linear(Tensor x, int handle) -> Tensor")
_LIB.impl("packed_linear", packed_linear, "CPU")
_LIB.impl("packed_linear", _packed_linear_shape, "Meta")


@functools.cache
def packs_correctly(dtype: torch.dtype) -> bool:
    """oneDNN packs `dtype` weights here, and a packed layer equals F.linear on a probe input."""
    if dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return False
    g = torch.Generator().manual_seed(0)
    probe = nn.Linear(64, 48, bias=True).to(dtype)
    x = torch.randn(5, 64, generator=g).to(dtype)
    try:
        with torch.inference_mode():
            got = PackedLinear(probe)(x)
            want = F.linear(x, probe.weight, probe.bias)
    except (RuntimeError, AttributeError, NotImplementedError) as e:
        logger.info("oneDNN weight packing unavailable (%s); using plain linear layers", e)
        return False
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    return bool(torch.allclose(got.float(), want.float(), atol=tol, rtol=tol))


def pack_linears(model: nn.Module, dtype: torch.dtype, native: bool = False, gemv: bool = False) -> int:
    """Swap every nn.Linear for a PackedLinear in place (native, gemv: see PackedLinear); returns
    how many were packed (0: none, where packs_correctly(dtype) is False)."""
    if not packs_correctly(dtype):
        return 0
    layers = [entry for entry in linear_layers(model) if isinstance(entry[3], nn.Linear)]  # QuantLinear stays
    with torch.inference_mode():
        for parent, attr, _, layer in layers:
            setattr(parent, attr, PackedLinear(layer, native, gemv))
    # What stays dense (embeddings, norms, biases) may still sit on the checkpoint's memory map,
    # which keeps every page read from it resident; own copies let the map go.
    for p in model.parameters():
        p.data = p.data.clone()
    return len(layers)


def pack_quantized_copies(model: nn.Module, dtype: torch.dtype) -> list[PackedLinear]:
    """Give every native QuantLinear a oneDNN-packed `dtype` copy of its dequantized weight, for
    the steps of more rows than quant_max_rows (prefill, large batches), which then run oneDNN's
    GEMM as a float model's do, at the cost of that copy's memory; steps of fewer rows still read
    the quantized bytes. Returns the copies, which the caller keeps as long as the model (each
    handle is released with its copy); none where oneDNN cannot pack `dtype` here."""
    if not packs_correctly(dtype):
        return []
    copies = []
    with torch.inference_mode():
        for layer in [m for m in model.modules() if isinstance(m, QuantLinear) and m.native]:
            dense = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta")
            dense.weight = nn.Parameter(dequantize(layer.quantized).to(dtype), requires_grad=False)
            if layer.bias is not None:
                dense.bias = nn.Parameter(layer.bias.to(dtype), requires_grad=False)
            copies.append(PackedLinear(dense, native=True))
            layer.packed = copies[-1].handle
            layer.register_native()
    return copies
