"""Block-quantized weights (Q8_0 and Q4_1 layouts) compute what their dequantized float32 weights
compute: `llmserve quantize` checkpoints and GGUF files alike load as stored, without a float
round trip, and give the dequantized model's greedy tokens, eager and compiled."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.model.loader import load_model
from llmserve.model.quantize import QuantLinear
from llmserve.model.resolve import resolve_model

sys.path.insert(0, str(Path(__file__).parent))
from gguf_files import reference_folder, tied_copy, write_gguf  # noqa: E402

PROMPTS = [list(range(3, 3 + n)) for n in (5, 17, 40, 3, 60, 9, 22, 31)]  # 8 concurrent requests
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmserve.cli", *args], capture_output=True, text=True, timeout=timeout)


def engine(model: str | Path, **options) -> LLM:
    return LLM(str(model), dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, **options)


def tokens(model: str | Path, **options) -> list[list[int]]:
    return [o.token_ids for o in engine(model, **options).generate(PROMPTS, GREEDY)]


def layer_formats(model: torch.nn.Module) -> set[str]:
    """The storage of every linear layer: its block format, or `float`."""
    return {m.format if isinstance(m, QuantLinear) else "float"
            for m in model.modules() if isinstance(m, QuantLinear | torch.nn.Linear)}


@pytest.fixture(scope="module", params=["int8", "int4"])
def checkpoint(request, tiny_model, tmp_path_factory):
    """`llmserve quantize --format FMT` over the seeded tiny model."""
    out = tmp_path_factory.mktemp(f"q-{request.param}") / "model"
    r = cli("quantize", "--model", tiny_model, "--out", str(out), "--format", request.param)
    assert r.returncode == 0, r.stderr
    return request.param, out


def test_a_quantize_checkpoint_is_stored_quantized(checkpoint):
    from safetensors.torch import load_file

    fmt, folder = checkpoint
    assert layer_formats(load_model(folder)) == {fmt}
    assert json.loads((folder / "config.json").read_text())["quantization_config"]["formats"]["linear"] == fmt
    stored = load_file(str(folder / "model.safetensors"))
    assert not [k for k in stored if k.endswith("_proj.weight") or k == "lm_head.weight"]  # no float copy
    per_block = {"int8": 34, "int4": 20}[fmt]  # Q8_0: d + 32 bytes; Q4_1: d, m + 16 bytes
    for key in [k for k in stored if k.endswith(".qweight")]:
        parts = [stored[key.replace("qweight", p)] for p in ("qweight", "scales", "mins") if key.replace("qweight", p) in stored]
        assert sum(t.numel() * t.element_size() for t in parts) == stored[key.replace("qweight", "scales")].numel() * per_block


@pytest.mark.parametrize("compile,large", [("none", "tiles"), ("none", "packed"), ("inductor", "packed")])
def test_quantized_tokens_equal_the_dequantized_float32_model(checkpoint, compile, large):
    """Prefill chunks and the 8-row decode steps run the large-step path (dequantized tiles, or
    the packed float copy); the steps of fewer rows than quant_max_rows the quantized GEMV, which
    skips a compiled batch-1 step's padding row."""
    fmt, folder = checkpoint
    reference = tokens(folder, quantize="none")  # the same weights, dequantized, through nn.Linear
    llm = engine(folder, compile=compile, quant_large_steps=large)
    assert llm.engine.plan.quant_large_steps.value == large
    layers = [m for m in llm.engine.model.modules() if isinstance(m, QuantLinear)]
    assert layers and all((m.packed >= 0) == (large == "packed") for m in layers)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
    alone = llm.generate(PROMPTS[2], GREEDY)[0]  # batch-1 decode steps, padded when compiled
    assert alone.token_ids == reference[2]
    assert any(r.num_decode_seqs == 1 and not r.num_prefill_tokens for r in llm.engine.step_records)


def test_quantize_flag_equals_a_quantize_checkpoint(checkpoint, tiny_model):
    fmt, folder = checkpoint
    assert tokens(tiny_model, quantize=fmt) == tokens(folder)


GGUF_CASES = {
    "Q8_0": ({"linear": "Q8_0", "embedding": "Q8_0"}, False, {"int8"}),
    "Q4_1 tied": ({"linear": "Q4_1", "embedding": "Q8_0"}, True, {"int4", "int8"}),  # as the default model ships
    "Q4_0": ({"linear": "Q4_0"}, False, {"int4"}),
    "Q5_0": ({"linear": "Q5_0"}, False, {"float"}),  # dequantized on conversion
}


@pytest.mark.parametrize("case", GGUF_CASES)
def test_gguf_blocks_load_as_stored_and_give_the_dequantized_tokens(case, tiny_model, tmp_path, caplog):
    types, tied, formats = GGUF_CASES[case]
    src = tied_copy(Path(tiny_model), tmp_path / "tied") if tied else Path(tiny_model)
    gguf = write_gguf(src, tmp_path / "model.gguf", types)
    with caplog.at_level("INFO", logger="llmserve.model"):
        folder = resolve_model(str(gguf), cache_dir=tmp_path / "converted")
    model = load_model(folder)
    assert layer_formats(model) == formats
    held = [r.getMessage() for r in caplog.records if " holds " in r.getMessage()]
    assert len(held) == 1 and f"mlp.up_proj {types['linear']}" in held[0]
    if formats == {"float"}:
        assert any("Q5_0, which llmserve does not serve as stored" in r.getMessage() for r in caplog.records)
    assert tokens(folder) == tokens(reference_folder(src, tmp_path / "reference", types))


def test_a_folder_from_an_older_conversion_is_converted_again(tiny_model, tmp_path):
    gguf = write_gguf(Path(tiny_model), tmp_path / "model.gguf", {"linear": "Q8_0"})
    folder = resolve_model(str(gguf), cache_dir=tmp_path / "converted")
    (folder / "gguf_conversion.json").write_text(json.dumps({"version": 1}))
    assert resolve_model(str(gguf), cache_dir=tmp_path / "converted") == folder
    assert json.loads((folder / "gguf_conversion.json").read_text())["version"] == 2


@pytest.mark.parametrize("args,sentence", [
    (["--quantize", "int3"], "argument --quantize: invalid choice: 'int3'"),
    (["--quantize", "int8", "--enable-lora"], "--quantize int8 does not support --enable-lora"),
])
def test_bad_quantize_options_exit_2_with_one_sentence(tiny_model, args, sentence):
    r = cli("generate", "hi", "--model", tiny_model, "--max-tokens", "2", *args)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert sentence in r.stderr.strip().splitlines()[-1]


def test_a_gguf_type_llmserve_cannot_read_exits_2_with_one_sentence(tiny_model, tmp_path):
    gguf = write_gguf(Path(tiny_model), tmp_path / "odd.gguf", {"linear": "I8"})  # no model ships weights as I8
    r = cli("generate", "hi", "--model", str(gguf), "--max-tokens", "2")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert re.search(r"odd\.gguf: tensor '[\w.]+' is stored as GGUF type I8, which llmserve cannot read", last)
