"""Prompt sets for the load test: random words, shared prefixes with unique suffixes, or a JSONL file.

Lengths are in words; with common English words most tokenizers spend about one token per word.
The real prompt token counts come back in each response's usage.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from llmserve.errors import InvalidRequestError

WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had by "
    "word but not what all were we when your can said there use an each which she do how their if will up "
    "other about out many then them these so some her would make like him into time has look two more write "
    "go see number no way could people my than first water been call who oil its now find long down day did "
    "get come made may part over new sound take only little work know place year live me back give most very "
    "after thing our just name good sentence man think say great where help through much before line right "
    "too mean old any same tell boy follow came want show also around form three small set put end does "
    "another well large must big even such because turn here why ask went men read need land different home "
    "us move try kind hand picture again change off play spell air away animal house point page letter mother"
).split()


@dataclass(slots=True)
class SampleRequest:
    prompt: str | list[int]  # text, or token ids (/v1/completions only: exact prompt lengths)
    max_tokens: int


def build_dataset(
    kind: str, num_prompts: int, input_len: int, output_len: int, range_ratio: float = 0.0, seed: int = 0,
    prefix_len: int = 0, num_prefixes: int = 1, path: str | None = None,
) -> list[SampleRequest]:
    """num_prompts requests; deterministic for a given seed."""
    rng = random.Random(seed)
    if kind == "jsonl":
        return _jsonl(path, num_prompts, output_len)
    if not 0.0 <= range_ratio < 1.0:
        raise InvalidRequestError("--range-ratio must be in [0, 1)", "range_ratio")

    def length(n: int) -> int:
        return max(1, rng.randint(int(n * (1 - range_ratio)), int(n * (1 + range_ratio))))

    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    if kind == "random":
        return [SampleRequest(words(length(input_len)), length(output_len)) for _ in range(num_prompts)]
    if kind == "prefix-repetition":
        prefixes = [words(prefix_len) for _ in range(max(1, num_prefixes))]
        out = [SampleRequest(f"{prefixes[i % len(prefixes)]} {words(length(input_len))}", length(output_len)) for i in range(num_prompts)]
        rng.shuffle(out)
        return out
    raise InvalidRequestError(f"unknown dataset {kind!r}", "dataset")


def _jsonl(path: str | None, num_prompts: int, output_len: int) -> list[SampleRequest]:
    """Lines {"prompt": str, "max_tokens"?: int}, cycled to num_prompts."""
    if not path:
        raise InvalidRequestError("--dataset jsonl needs --dataset-path", "dataset_path")
    rows = []
    for i, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            rows.append(SampleRequest(str(obj["prompt"]), int(obj.get("max_tokens", output_len))))
        except (ValueError, KeyError, TypeError) as e:
            raise InvalidRequestError(f"{path}:{i}: expected {{\"prompt\": ...}}: {e}", "dataset_path") from None
    if not rows:
        raise InvalidRequestError(f"{path}: no prompts", "dataset_path")
    return [rows[i % len(rows)] for i in range(num_prompts)]
