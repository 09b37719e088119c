"""Tokenizer: encode/decode with `tokenizers`, chat templates and special ids from the model folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llmserve.errors import InvalidRequestError, ModelLoadError


class Tokenizer:
    def __init__(self, model_dir: Path):
        from tokenizers import Tokenizer as HFTokenizer
        from transformers import AutoTokenizer

        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise ModelLoadError(f"{path}: tokenizer.json not found")
        try:
            self.fast = HFTokenizer.from_file(str(path))
            self.hf = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        except Exception as e:  # the tokenizers/transformers errors are not typed
            raise ModelLoadError(f"{path}: cannot read tokenizer ({e})") from None
        self.bos_token_id: int | None = self.hf.bos_token_id
        self.eos_token_id: int | None = self.hf.eos_token_id
        self.chat_template: str | None = self.hf.chat_template
        self.vocab_size = self.fast.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.fast.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.fast.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        return self.fast.id_to_token(token_id) or ""

    @property
    def takes_tools(self) -> bool:
        """Whether the chat template renders a `tools` argument."""
        return bool(self.chat_template) and "tools" in str(self.chat_template)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, continue_final_message: bool = False) -> list[int]:
        """continue_final_message: the last (assistant) message is left open, for the model to go
        on from its last word (a "prefill"), rather than closed and followed by a new turn."""
        if not self.chat_template:
            raise InvalidRequestError("this model has no chat template; use /v1/completions", "messages")
        if continue_final_message and (add_generation_prompt or messages[-1]["role"] != "assistant"):
            raise InvalidRequestError("continue_final_message continues a final assistant message; it cannot be combined "
                                      "with add_generation_prompt", "continue_final_message")
        try:
            text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, tools=tools,
                                               continue_final_message=continue_final_message)
        except Exception as e:  # jinja2 raises on templates that reject the conversation
            raise InvalidRequestError(f"chat template rejected the messages: {e}", "messages") from None
        return self.encode(text, add_special_tokens=False)


def read_generation_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "generation_config.json"
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from None


def eos_token_ids(tokenizer: Tokenizer, generation_config: dict[str, Any]) -> tuple[int, ...]:
    """EOS ids: generation_config's eos_token_id (int or list), else the tokenizer's."""
    eos = generation_config.get("eos_token_id", tokenizer.eos_token_id)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)
