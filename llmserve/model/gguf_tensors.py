"""A GGUF file's tensors as checkpoint tensors under Hugging Face names, quantized ones as stored.

Q8_0 blocks become int8 QuantizedTensors and Q4_1 blocks int4 ones, byte for byte (the layouts
are the same: see quantize.py); Q4_0 blocks (w = d * (q - 8)) become int4 with the minimum
m = -8 d, which float16 holds exactly, so every weight is the same number. F32, F16 and BF16
tensors are read as float; every other type is dequantized to float32 by the gguf package, and
the log says so once per type. llama.cpp stores llama/mistral q and k rows interleaved for its
rope; they are put back in Hugging Face order (a row permutation, which keeps blocks whole).
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from llmserve.errors import ModelLoadError
from llmserve.model.quantize import QuantizedTensor, dequantize

logger = logging.getLogger("llmserve.model")

# GGUF names -> Hugging Face names (blk.N.<key> -> model.layers.N.<value>)
TOP_LEVEL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
LAYER = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
         "attn_output": "self_attn.o_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
         "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
IGNORED = ("rope_freqs.weight",)  # rope scaling factors; the config carries them
FLOAT_TYPES = ("F32", "F16", "BF16", "F64")
# the block-quantized GGUF types served as stored -> (our format, bytes per block of 32)
AS_STORED = {"Q8_0": ("int8", 34), "Q4_1": ("int4", 20), "Q4_0": ("int4", 18)}
PERMUTED_ARCHITECTURES = ("llama", "mistral")


@dataclass(frozen=True)
class GgufWeights:
    tensors: dict[str, torch.Tensor | QuantizedTensor]  # Hugging Face names
    types: dict[str, str]  # Hugging Face name -> the GGUF type it was stored in


def hf_name(gguf_name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None for an unknown name."""
    if gguf_name in TOP_LEVEL:
        return TOP_LEVEL[gguf_name]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if m is None or m.group(2) not in LAYER:
        return None
    return f"model.layers.{m.group(1)}.{LAYER[m.group(2)]}.{m.group(3)}"


def read_gguf_weights(path: Path, arch: str, num_heads: int, num_kv_heads: int) -> GgufWeights:
    """Every tensor of the file under its Hugging Face name (see the module docstring)."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    tensors, types, converted = {}, {}, Counter()
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            if t.name not in IGNORED:
                logger.info("%s: tensor %r is not one llmserve reads; skipped", path.name, t.name)
            continue
        kind = t.tensor_type.name
        weight = _tensor(t, kind, path)
        if kind not in AS_STORED and kind not in FLOAT_TYPES:
            converted[kind] += 1
        heads = {"q_proj": num_heads, "k_proj": num_kv_heads}.get(name.split(".")[-2])
        if heads and arch in PERMUTED_ARCHITECTURES:
            weight = _unpermute(weight, heads)
        tensors[name], types[name] = weight, kind
    for kind, n in sorted(converted.items()):
        logger.info("%s: %d tensors are %s, which llmserve does not serve as stored; dequantized to float32",
                    path.name, n, kind)
    return GgufWeights(tensors, types)


def _tensor(t, kind: str, path: Path) -> torch.Tensor | QuantizedTensor:
    """One GGUF tensor: [out, in] (GGUF lists dimensions innermost first), or [n] for vectors."""
    shape = tuple(int(n) for n in reversed(t.shape))
    data = np.asarray(t.data)
    if kind in AS_STORED:
        return _blocks(data, kind, shape)
    if kind in FLOAT_TYPES:
        if kind == "BF16":
            return torch.from_numpy(data.copy()).view(torch.bfloat16).reshape(shape).float()
        return torch.from_numpy(data.astype(np.float32)).reshape(shape)
    from gguf.quants import dequantize as gguf_dequantize

    try:
        return torch.from_numpy(gguf_dequantize(data, t.tensor_type).astype(np.float32)).reshape(shape)
    except NotImplementedError:
        raise ModelLoadError(
            f"{path}: tensor {t.name!r} is stored as GGUF type {kind}, which llmserve cannot read "
            f"(it serves {', '.join(AS_STORED)} as stored and dequantizes the other quantized types)"
        ) from None


def _blocks(data: np.ndarray, kind: str, shape: tuple[int, ...]) -> QuantizedTensor:
    """data: [out, kb * bytes per block] uint8 -> the QuantizedTensor of the same weights."""
    out, k = shape if len(shape) == 2 else (1, shape[0])
    raw = torch.from_numpy(data.copy()).view(torch.uint8).reshape(out, -1, AS_STORED[kind][1])
    d = raw[..., 0:2].contiguous().view(torch.float16)[..., 0]  # [out, kb]
    if kind == "Q8_0":
        q = raw[..., 2:].contiguous().view(torch.int8)
        return QuantizedTensor(q.reshape(out, -1), d, None, k)
    if kind == "Q4_1":
        m = raw[..., 2:4].contiguous().view(torch.float16)[..., 0]
        return QuantizedTensor(raw[..., 4:].reshape(out, -1).contiguous(), d, m, k)
    return QuantizedTensor(raw[..., 2:].reshape(out, -1).contiguous(), d, d * -8, k)  # Q4_0


def _unpermute(w: torch.Tensor | QuantizedTensor, heads: int) -> torch.Tensor | QuantizedTensor:
    """Rows of each head from llama.cpp's (pairs interleaved) order back to halves: GGUF row
    h*D + 2j + s holds Hugging Face row h*D + s*D/2 + j."""
    out = w.out_features if isinstance(w, QuantizedTensor) else w.shape[0]
    index = torch.arange(out).view(heads, out // heads // 2, 2).transpose(1, 2).reshape(-1)
    return w.rows(index) if isinstance(w, QuantizedTensor) else w[index].contiguous()


def as_float(w: torch.Tensor | QuantizedTensor) -> torch.Tensor:
    return dequantize(w) if isinstance(w, QuantizedTensor) else w

