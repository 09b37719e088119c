"""Converting a GGUF file into an ordinary Hugging Face model folder, once.

The folder holds config.json, model.safetensors (HF names; Q8_0, Q4_0 and Q4_1 tensors kept as
stored, as a quantized checkpoint's, with config.json's quantization_config saying which: see
gguf_tensors.py), tokenizer.json + tokenizer_config.json (with the chat template and special
tokens), generation_config.json and gguf_conversion.json (the conversion's version: a folder
from an older version is converted again), so `load_model` and `Tokenizer` read it like any
other checkpoint. The folder appears atomically: it is written into a temporary
sibling and renamed into place, so an interrupted conversion never leaves a half folder.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from llmserve.errors import ModelLoadError
from llmserve.model.gguf_tensors import GgufWeights, as_float, read_gguf_weights
from llmserve.model.quantize import QuantizedTensor, quantization_config, quantized_entries

logger = logging.getLogger("llmserve.model")

# GGUF general.architecture values whose converted folder our LlamaForCausalLM can run.
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# Written last; names the conversion's version, so a folder from an older llmserve is redone.
MARKER, CONVERSION_VERSION = "gguf_conversion.json", 2
# Files a converted folder must hold; the folder is complete iff all exist (the rename is atomic).
CONVERTED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", MARKER)


def read_gguf_metadata(gguf_path: Path) -> dict[str, Any]:
    """The file's scalar/string metadata (arrays such as the vocabulary left out).

    Raises ModelLoadError naming the file when it is missing, not a GGUF file, or truncated.
    """
    from gguf import GGUFReader

    path = Path(gguf_path)
    if not path.is_file():
        raise ModelLoadError(f"{path}: no such file or directory")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"{path}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    size = path.stat().st_size
    try:
        reader = GGUFReader(path)
        end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    except Exception as e:  # gguf raises bare ValueError/IndexError/struct errors on damaged files
        raise ModelLoadError(
            f"{path}: corrupt or truncated GGUF file ({size} bytes; {type(e).__name__}: {e})"
        ) from None
    if end > size:
        raise ModelLoadError(f"{path}: truncated GGUF file ({size} bytes, tensors need {end})")
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if len(field.data) == 1:  # scalars and strings; skips the vocabulary arrays
            try:
                meta[key] = field.contents()
            except Exception:  # an odd field type we do not need
                continue
    return meta


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Write the HF folder for `gguf_path` at `out_dir` (must not exist yet, or be complete); returns it."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    meta = read_gguf_metadata(gguf_path)
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        supported = ", ".join(SUPPORTED_GGUF_ARCHITECTURES)
        raise ModelLoadError(
            f"{gguf_path}: unsupported GGUF architecture {arch!r}; supported: {supported}"
        )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    start = time.monotonic()
    print(
        f"llmserve: converting {gguf_path.name} -> {out_dir} (once; takes a while)", file=sys.stderr
    )
    try:
        _write_folder(gguf_path, meta, tmp)
        _make_readable(tmp)
        _set_aside_stale(out_dir)
        try:
            tmp.rename(out_dir)
        except OSError:
            # a complete folder from a concurrent conversion is fine; anything else is an error
            if not is_converted(out_dir):
                raise ModelLoadError(
                    f"{out_dir}: exists but is not a complete converted model; delete it"
                ) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"llmserve: converted in {time.monotonic() - start:.1f} s", file=sys.stderr)
    return out_dir


def _set_aside_stale(out_dir: Path) -> None:
    """Remove a folder left by an older conversion (renamed away first, so readers never see half)."""
    if not out_dir.exists() or is_converted(out_dir) or not (out_dir / "config.json").is_file():
        return
    stale = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.stale-", dir=out_dir.parent))
    try:
        out_dir.rename(stale / out_dir.name)
    except OSError:
        pass  # a concurrent conversion moved it already
    shutil.rmtree(stale, ignore_errors=True)


def is_converted(folder: Path) -> bool:
    """The folder is complete and written by this conversion's version."""
    folder = Path(folder)
    if not all((folder / name).is_file() for name in CONVERTED_FILES):
        return False
    try:
        return json.loads((folder / MARKER).read_text()).get("version") == CONVERSION_VERSION
    except (OSError, ValueError, AttributeError):
        return False


def _checkpoint(weights: GgufWeights, tied: bool) -> tuple[dict[str, Any], dict[str, str]]:
    """Tensors to write (quantized ones as quantized_entries) and, per tensor kind, the format
    of those kept quantized. An untied embedding is only looked up, so it is stored as float."""
    tensors: dict[str, Any] = {}
    formats: dict[str, str] = {}
    for name, w in weights.tensors.items():
        if isinstance(w, QuantizedTensor) and (tied or not name.endswith("embed_tokens.weight")):
            tensors.update(quantized_entries(name, w))
            formats[_kind(name)] = w.format
        else:
            tensors[name] = as_float(w).contiguous()
    return tensors, formats


def _kind(name: str) -> str:
    """`model.layers.3.mlp.up_proj.weight` -> `mlp.up_proj`; `model.embed_tokens.weight` -> `embed_tokens`."""
    return re.sub(r"^(model\.)?(layers\.\d+\.)?", "", name).removesuffix(".weight").removesuffix(".bias")


def _stored_types(weights: GgufWeights) -> dict[str, str]:
    """Tensor kind -> the GGUF type(s) the file keeps it in, for the log."""
    found: dict[str, set[str]] = {}
    for name, kind in weights.types.items():
        found.setdefault(_kind(name), set()).add(kind)
    return {k: "+".join(sorted(v)) for k, v in sorted(found.items())}


def _write_folder(gguf_path: Path, meta: dict[str, Any], out: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer

    where, name = str(gguf_path.parent), gguf_path.name
    try:
        tok = AutoTokenizer.from_pretrained(where, gguf_file=name)
        config = AutoConfig.from_pretrained(where, gguf_file=name)
    except Exception as e:  # transformers' GGUF errors are untyped
        raise ModelLoadError(
            f"{gguf_path}: cannot read GGUF model ({type(e).__name__}: {e})"
        ) from None

    # Weights: as stored (gguf_tensors); a file without output.weight ties the LM head.
    arch = meta["general.architecture"]
    weights = read_gguf_weights(gguf_path, arch, config.num_attention_heads, config.num_key_value_heads)
    config.tie_word_embeddings = "lm_head.weight" not in weights.tensors
    tensors, formats = _checkpoint(weights, config.tie_word_embeddings)
    logger.info("%s holds %s", name, ", ".join(f"{role} {t}" for role, t in _stored_types(weights).items()))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    del weights, tensors

    # config.json: quantization_config when weights stay quantized, rope_theta also at top level.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [ARCHITECTURES[arch]]
    config.save_pretrained(out)
    raw = json.loads((out / "config.json").read_text())
    for key in ("_name_or_path", "_model_name_or_path"):
        raw.pop(key, None)
    raw.setdefault("rope_theta", (raw.get("rope_parameters") or {}).get("rope_theta"))
    if formats:
        raw["quantization_config"] = quantization_config(formats)
    (out / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    (out / MARKER).write_text(json.dumps({"version": CONVERSION_VERSION, "source": name}) + "\n")

    _fix_pre_tokenizer(tok, meta.get("tokenizer.ggml.pre"))
    # save_jinja_files=False keeps the chat_template inside tokenizer_config.json
    tok.save_pretrained(out, save_jinja_files=False)
    tc = json.loads((out / "tokenizer_config.json").read_text())
    for key in ("is_local", "local_files_only"):
        tc.pop(key, None)
    tc.update(
        tokenizer_class="PreTrainedTokenizerFast", model_max_length=config.max_position_embeddings
    )
    if "tokenizer.ggml.add_bos_token" in meta:
        tc["add_bos_token"] = bool(meta["tokenizer.ggml.add_bos_token"])
    if meta.get("tokenizer.chat_template"):
        tc["chat_template"] = meta["tokenizer.chat_template"]
    (out / "tokenizer_config.json").write_text(json.dumps(tc, indent=2, ensure_ascii=False) + "\n")

    # generation_config.json: SmolLM2-Instruct's eos is <|im_end|> (id 2), as its GGUF says.
    ids = {
        "bos_token_id": "bos_token_id",
        "eos_token_id": "eos_token_id",
        "pad_token_id": "padding_token_id",
    }
    gen = {
        ours: meta[f"tokenizer.ggml.{k}"]
        for ours, k in ids.items()
        if f"tokenizer.ggml.{k}" in meta
    }
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def _make_readable(folder: Path) -> None:
    """mkdtemp (and safetensors) create owner-only files; give the folder ordinary modes."""
    folder.chmod(0o755)
    for f in folder.iterdir():
        f.chmod(0o644)


def _fix_pre_tokenizer(tok: Any, pre: str | None) -> None:
    """Restore the split rule transformers does not map for some `tokenizer.ggml.pre` values.

    "smollm" (SmolLM/SmolLM2): llama.cpp isolates every digit before the GPT-2 regex, as the
    original tokenizer.json does (Digits(individual_digits) + ByteLevel). transformers falls back
    to the bare GPT-2 regex, which differs on runs of spaces before a digit ("x  2").
    """
    if pre != "smollm":
        return
    from tokenizers import pre_tokenizers

    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
