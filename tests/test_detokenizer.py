"""Incremental detokenization: whole UTF-8 characters only, stop strings never emitted."""

from __future__ import annotations

import pytest

from llmserve import LLM, SamplingParams
from llmserve.engine.detokenizer import IncrementalDetokenizer
from llmserve.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(tiny_model) -> Tokenizer:
    return Tokenizer(__import__("pathlib").Path(tiny_model))


def stream(tok: Tokenizer, text: str, **params) -> tuple[list[str], IncrementalDetokenizer]:
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, tok.encode("Prompt:", add_special_tokens=False), SamplingParams(**params))
    chunks = [d.add_token(t) for t in ids]
    if d.stop_string is None:
        chunks.append(d.flush())
    return chunks, d


@pytest.mark.parametrize("text", ["Hello 🙂 world 🚀🌍", "你好，世界。こんにちは", "café naïve — ✨ 안녕하세요"])
def test_multibyte_characters_are_never_split(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split()), "the tokenizer splits these characters across tokens"
    chunks, _ = stream(tok, text)
    assert all("\ufffd" not in c for c in chunks)
    assert "".join(chunks) == text
    assert "" in chunks[:-1]  # some token ended mid-character and released nothing


@pytest.mark.parametrize("stop", ["river town", "er t", "ly."])
def test_stop_string_spanning_tokens_is_never_emitted(tok, stop):
    text = "The river town woke slowly. Then more text follows."
    chunks, d = stream(tok, text, stop=[stop, "never-there"])
    emitted = "".join(chunks)
    assert emitted == text[: text.index(stop)]
    assert d.stop_string == stop
    for i in range(len(chunks)):  # no prefix of the stream ever showed any of the stop string
        assert stop not in "".join(chunks[: i + 1])


def test_stop_string_at_the_start_and_included(tok):
    chunks, d = stream(tok, "The river town", stop=["The"])
    assert "".join(chunks) == "" and d.stop_string == "The"
    chunks, _ = stream(tok, "The river town woke", stop=["town"], include_stop_str_in_output=True)
    assert "".join(chunks) == "The river town"


def test_held_back_text_is_released_when_no_stop_matches(tok):
    chunks, d = stream(tok, "The river town", stop=["town hall"])
    assert "".join(chunks) == "The river town" and d.stop_string is None
    assert chunks[-1].endswith("town")  # held back until the end, then flushed


def test_engine_stops_on_string_and_token(tiny_model):
    llm = LLM(tiny_model, dtype="float32")
    prompt = list(range(10, 30))
    free = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
    text, ids = free.text, free.token_ids
    stop = text[len(text) // 3 : len(text) // 3 + 4]
    assert len(stop) == 4
    stopped = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop]))[0]
    assert stopped.finish_reason == "stop" and stopped.outputs[0].stop_reason == stop
    assert stopped.text == text[: text.index(stop)]
    by_id = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop_token_ids=[ids[5]]))[0]
    assert by_id.finish_reason == "stop" and by_id.token_ids == ids[: ids.index(ids[5]) + 1]
