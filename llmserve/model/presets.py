"""Seeded random-weight models from the presets in llmserve/model/presets/ (package data), saved as
ordinary HF folders.

`llmserve make-model PRESET OUT` writes config.json, model.safetensors, a byte-level BPE tokenizer
(trained on presets/corpus.txt, ChatML template) and generation_config.json. Both
transformers and llmserve load the result.
"""

from __future__ import annotations

import json
from pathlib import Path

from llmserve.errors import ModelLoadError

PRESET_DIR = Path(__file__).with_name("presets")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def preset_config(name: str) -> dict:
    path = PRESET_DIR / f"{name}.json"
    if not path.exists():
        raise ModelLoadError(f"unknown preset {name!r}; available: {', '.join(preset_names())}")
    return json.loads(path.read_text())


def make_model(preset: str, out: Path, seed: int = 0, dtype: str = "float32") -> Path:
    """Write a seeded random-weight model folder for `preset` into `out`; returns `out`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = preset_config(preset)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok_vocab = _write_tokenizer(out, min(raw["vocab_size"], 1024))
    raw = dict(raw, bos_token_id=None, eos_token_id=tok_vocab["<|im_end|>"], pad_token_id=tok_vocab["<|endoftext|>"])
    config = AutoConfig.for_model(raw.pop("model_type"), **{k: v for k, v in raw.items() if k != "architectures"})
    config.architectures = raw["architectures"]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    with torch.no_grad():  # HF's init (std 0.02) gives near-uniform logits; widen it so greedy is decisive
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, 1.0 / p.shape[-1] ** 0.5)
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": tok_vocab["<|im_end|>"], "bos_token_id": None}, indent=2)
    )
    return out


def _write_tokenizer(out: Path, vocab_size: int) -> dict[str, int]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = (PRESET_DIR / "corpus.txt").read_text()
    tok.train_from_iterator(text.splitlines(), trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "unk_token": None,
                "model_max_length": 1024,
                "chat_template": CHATML_TEMPLATE,
            },
            indent=2,
        )
    )
    return {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
