"""Loading a Hugging Face model folder (config.json + *.safetensors) into LlamaForCausalLM."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch

from llmserve.errors import ModelLoadError
from llmserve.model.config import ModelConfig
from llmserve.model.llama import LlamaForCausalLM
from llmserve.model.quantize import (
    FORMATS,
    GGUF_NAMES,
    QUANT_METHOD,
    QuantizedTensor,
    QuantLinear,
    dequantize,
    dequantize_model,
    quantize_model,
    read_quantized,
)

logger = logging.getLogger("llmserve.model")

# Hugging Face name fragments that we fuse into one weight: ours <- [theirs, ...]
FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{index}: malformed index ({e})") from None
        files = [model_dir / n for n in names]
        for f in files:
            if not f.exists():
                raise ModelLoadError(f"{f}: shard listed in {index.name} is missing")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir}: no *.safetensors weights found")
    return files


def read_safetensors(files: list[Path]) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise ModelLoadError(f"{f}: corrupt or truncated safetensors file ({e})") from None
    return tensors


Weight = torch.Tensor | QuantizedTensor  # a checkpoint weight: float, or block-quantized as stored


def in_features(name: str, cfg: ModelConfig) -> int:
    """The input width of checkpoint weight `name` (a linear layer's, or the embedding's)."""
    if name.endswith("self_attn.o_proj.weight"):
        return cfg.num_attention_heads * cfg.head_dim
    if name.endswith("mlp.down_proj.weight"):
        return cfg.intermediate_size
    return cfg.hidden_size


def read_weights(files: list[Path], cfg: ModelConfig) -> dict[str, Weight]:
    """The checkpoint's tensors, `<name>.qweight/.scales/.mins` read as one QuantizedTensor under
    `<name>.weight`."""
    tensors = read_safetensors(files)
    out: dict[str, Weight] = {}
    for key in [k for k in tensors if k.endswith(".qweight")]:
        name = key.removesuffix(".qweight") + ".weight"
        out[name] = read_quantized(tensors, name, in_features(name, cfg))
    out.update(tensors)
    return out


def hf_to_ours(hf: dict[str, Weight], cfg: ModelConfig, source: str) -> dict[str, Weight]:
    """Rename `model.` keys, fuse q/k/v and gate/up, check every tensor we need is present."""
    hf = {k.removeprefix("model."): v for k, v in hf.items()}
    out: dict[str, Weight] = {}
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        for ours, theirs in FUSED.items():
            for suffix in ("weight", "bias"):
                keys = [f"{p}{t}.{suffix}" for t in theirs]
                if suffix == "bias" and not (ours.startswith("self_attn") and cfg.attention_bias):
                    continue
                out[f"{p}{ours}.{suffix}"] = _fuse(hf, keys, source)
        for name in ("self_attn.o_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm"):
            out[f"{p}{name}.weight"] = _need(hf, f"{p}{name}.weight", source)
    out["embed_tokens.weight"] = _need(hf, "embed_tokens.weight", source)
    out["norm.weight"] = _need(hf, "norm.weight", source)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = _need(hf, "lm_head.weight", source)
    return out


def _need(tensors: dict[str, Weight], key: str, source: str) -> Weight:
    if key not in tensors:
        raise ModelLoadError(f"{source}: tensor {key!r} is missing from the checkpoint")
    return tensors[key]


def _fuse(tensors: dict[str, Weight], keys: list[str], source: str) -> Weight:
    parts = [_need(tensors, k, source) for k in keys]
    quantized = [p for p in parts if isinstance(p, QuantizedTensor)]
    if quantized and len(quantized) == len(parts) and len({(p.format, p.in_features) for p in quantized}) == 1:
        return QuantizedTensor.cat(quantized)
    if quantized:
        logger.info("%s: %s are stored in different formats; fused, they are served as float", source, " + ".join(keys))
        parts = [dequantize(p) if isinstance(p, QuantizedTensor) else p.float() for p in parts]
    try:
        return torch.cat(parts)
    except RuntimeError:
        shapes = ", ".join(f"{k!r} {tuple(t.shape)}" for k, t in zip(keys, parts, strict=True))
        raise ModelLoadError(f"{source}: tensors of mismatched shapes: {shapes}") from None


def _checkpoint_names(key: str) -> str:
    """Our (possibly fused) key -> the checkpoint tensor name(s) it came from, for messages."""
    for ours, theirs in FUSED.items():
        if ours in key:
            return " + ".join(repr(key.replace(ours, t)) for t in theirs) + " (concatenated)"
    return repr(key)


def build_model(cfg: ModelConfig, state: dict[str, Weight], dtype: torch.dtype, source: str) -> LlamaForCausalLM:
    """Our model from fused weights: float tensors load into the module, quantized ones become
    QuantLinear layers; a quantized embedding is dequantized for the lookup and, tied, serves the
    LM head as stored."""
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    for key, tensor in state.items():
        shape = (tensor.out_features, tensor.in_features) if isinstance(tensor, QuantizedTensor) else tuple(tensor.shape)
        if key in expected and shape != tuple(expected[key]):
            raise ModelLoadError(
                f"{source}: tensor {_checkpoint_names(key)} has shape {shape}, config implies {tuple(expected[key])}"
            )
    quantized = {k: state.pop(k) for k in [k for k, v in state.items() if isinstance(v, QuantizedTensor)]}
    embed = quantized.pop("embed_tokens.weight", None)
    if embed is not None:
        logger.info("%s: the embedding is stored as %s (%s); dequantized to %s for the lookup%s", source, embed.format,
                    GGUF_NAMES[embed.format], str(dtype).removeprefix("torch."),
                    ", and the LM head reads it as stored" if cfg.tie_word_embeddings else "")
        state["embed_tokens.weight"] = dequantize(embed)
        if cfg.tie_word_embeddings:
            quantized["lm_head.weight"] = embed
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False, assign=True)
    if cfg.tie_word_embeddings and "lm_head.weight" not in quantized:
        model.lm_head.weight = model.embed_tokens.weight
    for key, weight in quantized.items():
        parent, attr = _module_of(model, key.removesuffix(".weight"))
        bias = state.get(key.removesuffix(".weight") + ".bias")
        setattr(parent, attr, QuantLinear(weight, None if bias is None else bias.to(dtype)))
    model.rotary = type(model.rotary)(cfg)  # rebuild the rope buffers off the meta device
    return model.eval()


def _module_of(model: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    parent, _, attr = name.rpartition(".")
    return (model.get_submodule(parent) if parent else model), attr


def load_model(model_dir: Path, dtype: torch.dtype = torch.float32, quantize: str | None = None) -> LlamaForCausalLM:
    """An HF folder (or a quantized checkpoint: `llmserve quantize`, a converted GGUF file) -> our
    model, eval mode. quantize: None serves the weights as stored; `none` dequantizes every
    layer; int8 or int4 puts every linear layer in that format (quantize.quantize_model)."""
    model_dir = Path(model_dir)
    if not model_dir.exists():
        raise ModelLoadError(f"{model_dir}: no such file or directory")
    cfg = ModelConfig.from_file(model_dir / "config.json")
    files = weight_files(model_dir)
    source = str(files[0] if len(files) == 1 else model_dir)  # what messages name
    if cfg.quantization not in (None, QUANT_METHOD):
        raise ModelLoadError(f"{model_dir / 'config.json'}: unsupported quantization {cfg.quantization!r} "
                             f"(supported: {QUANT_METHOD}; write one with `llmserve quantize`)")
    state = hf_to_ours(read_weights(files, cfg), cfg, source)
    model = build_model(cfg, state, dtype, source)
    if quantize == "none":
        return dequantize_model(model, dtype)
    if quantize in FORMATS:
        return quantize_model(model, quantize)
    return model


def fingerprint(model_dir: Path) -> str:
    """A short identity of the weights: config plus size and edges of every weight file."""
    h = hashlib.sha256((Path(model_dir) / "config.json").read_bytes())
    for f in weight_files(Path(model_dir)):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with f.open("rb") as fh:
            h.update(fh.read(1 << 20))
            fh.seek(max(0, size - (1 << 20)))
            h.update(fh.read(1 << 20))
    return h.hexdigest()[:16]
