"""GGUF files written by the `gguf` package from a seeded HF folder, as llama.cpp's converter lays
them out: llama names, q/k rows permuted for its rope, the BPE vocabulary and merges, and each
2-D weight in a chosen GGUF type. `reference_folder` writes the float model those files hold
(each weight dequantized by the gguf package), which is what the converted file must compute."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, i, *rest = hf.split(".")
    return f"blk.{i}.{LAYER['.'.join(rest[:-1])]}.{rest[-1]}"


def llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """Hugging Face q/k rows -> llama.cpp's: each head's two halves interleaved row by row."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def stored(w: np.ndarray, qtype) -> np.ndarray:
    """The bytes (or floats) a GGUF file holds for w in qtype, and nothing else."""
    import gguf

    return gguf.quants.quantize(w, qtype)


def write_gguf(model_dir: Path, path: Path, types: dict[str, str]) -> Path:
    """types: tensor kind (`linear`, `embedding`) -> GGUF type name, e.g. {"linear": "Q4_1"}; norms F32.
    I8 stores each weight truncated to an integer, for a file llmserve must refuse."""
    import gguf

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    assert not cfg.get("rope_scaling") and (cfg.get("rope_parameters") or {}).get("rope_type", "default") == "default"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])
    w.add_rope_dimension_count(cfg["hidden_size"] // cfg["num_attention_heads"])
    w.add_vocab_size(cfg["vocab_size"])
    _add_tokenizer(w, Path(model_dir), cfg)
    for name, t in _float_tensors(model_dir).items():
        a = t.numpy()
        heads = {"q_proj": cfg["num_attention_heads"], "k_proj": cfg["num_key_value_heads"]}.get(name.split(".")[-2])
        if heads:
            a = llama_permute(a, heads)
        kind = "embedding" if "embed_tokens" in name else "linear" if a.ndim == 2 else None
        qtype = getattr(gguf.GGMLQuantizationType, types.get(kind, "F32")) if kind else gguf.GGMLQuantizationType.F32
        if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.I8):  # the array's dtype says which
            w.add_tensor(gguf_name(name), a.astype(np.int8) if qtype == gguf.GGMLQuantizationType.I8 else a)
        else:
            w.add_tensor(gguf_name(name), stored(a, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def reference_folder(model_dir: Path, out: Path, types: dict[str, str]) -> Path:
    """The float32 HF folder holding what write_gguf(model_dir, ..., types) stores, dequantized."""
    import gguf

    shutil.copytree(model_dir, out)
    tensors = {}
    for name, t in _float_tensors(model_dir).items():
        kind = "embedding" if "embed_tokens" in name else "linear" if t.ndim == 2 else None
        qtype = getattr(gguf.GGMLQuantizationType, types.get(kind, "F32")) if kind else gguf.GGMLQuantizationType.F32
        a = t.numpy()
        if qtype != gguf.GGMLQuantizationType.F32:
            a = gguf.quants.dequantize(stored(a, qtype), qtype)
        tensors[name] = torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))
    save_file(tensors, str(out / "model.safetensors"))
    return out


def _float_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    return {k: v.float() for k, v in load_file(str(Path(model_dir) / "model.safetensors")).items()}


def _add_tokenizer(w, model_dir: Path, cfg: dict) -> None:
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    special = {t["content"] for t in tok["added_tokens"]}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])  # 3: control, 1: normal
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_pad_token_id(cfg["pad_token_id"])


def tied_copy(model_dir: Path, out: Path) -> Path:
    """model_dir with its LM head dropped and tied to the embedding (what SmolLM2 does)."""
    shutil.copytree(model_dir, out)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}, indent=2))
    tensors = _float_tensors(model_dir)
    tensors.pop("lm_head.weight")
    save_file(tensors, str(out / "model.safetensors"))
    return out
