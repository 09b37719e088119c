"""Loading a Hugging Face model folder (config.json + *.safetensors) into LlamaForCausalLM."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from llmserve.errors import ModelLoadError
from llmserve.model.config import ModelConfig
from llmserve.model.llama import LlamaForCausalLM
from llmserve.model.quantize import QUANT_METHOD, load_quantized, quantize_model

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


def hf_to_ours(hf: dict[str, torch.Tensor], cfg: ModelConfig, source: str) -> dict[str, torch.Tensor]:
    """Rename `model.` keys, fuse q/k/v and gate/up, check every tensor we need is present."""
    hf = {k.removeprefix("model."): v for k, v in hf.items()}
    out: dict[str, torch.Tensor] = {}
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


def _need(tensors: dict[str, torch.Tensor], key: str, source: str) -> torch.Tensor:
    if key not in tensors:
        raise ModelLoadError(f"{source}: tensor {key!r} is missing from the checkpoint")
    return tensors[key]


def _fuse(tensors: dict[str, torch.Tensor], keys: list[str], source: str) -> torch.Tensor:
    parts = [_need(tensors, k, source) for k in keys]
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


def build_model(cfg: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype, source: str) -> LlamaForCausalLM:
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    for key, tensor in state.items():
        if key in expected and tuple(tensor.shape) != tuple(expected[key]):
            raise ModelLoadError(
                f"{source}: tensor {_checkpoint_names(key)} has shape {tuple(tensor.shape)}, "
                f"config implies {tuple(expected[key])}"
            )
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary = type(model.rotary)(cfg)  # rebuild the rope buffers off the meta device
    return model.eval()


def load_model(model_dir: Path, dtype: torch.dtype = torch.float32, quantize: str | None = None) -> LlamaForCausalLM:
    """An HF folder (or a checkpoint written by `llmserve quantize`) -> our model, eval mode."""
    model_dir = Path(model_dir)
    if not model_dir.exists():
        raise ModelLoadError(f"{model_dir}: no such file or directory")
    cfg = ModelConfig.from_file(model_dir / "config.json")
    files = weight_files(model_dir)
    source = str(files[0] if len(files) == 1 else model_dir)  # what messages name
    if cfg.quantization not in (None, QUANT_METHOD):
        raise ModelLoadError(f"{model_dir / 'config.json'}: unsupported quantization {cfg.quantization!r} (supported: {QUANT_METHOD})")
    if cfg.quantization == QUANT_METHOD:
        return _load_int8_checkpoint(cfg, read_safetensors(files), dtype, source)
    state = hf_to_ours(read_safetensors(files), cfg, source)
    model = build_model(cfg, state, dtype, source)
    return quantize_model(model, dtype) if quantize == "int8" else model


def _load_int8_checkpoint(cfg: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype, source: str) -> LlamaForCausalLM:
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model.lm_head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device="meta")  # untie
    load_quantized(model, state, dtype, source)
    for key in ("embed_tokens.weight", "norm.weight"):
        _need(state, key, source)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False, assign=True)
    model.rotary = type(model.rotary)(cfg)
    return model.eval()


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
