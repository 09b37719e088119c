"""Streaming under load over a real uvicorn server: concurrency, UTF-8 and stop-string safety of
SSE chunks, cancellation by the client (blocks freed), and backpressure (429 + Retry-After)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import httpx
import pytest
from server_harness import live_server, sse_data, wait_for

from llmserve.engine.llm import LLM
from llmserve.sampling import SamplingParams

pytestmark = pytest.mark.timeout(120)


async def stream_texts(url: str, body: dict) -> tuple[list[str], dict]:
    """The text of every chunk of a /v1/completions stream, and the last chunk."""
    async with httpx.AsyncClient(timeout=60) as client, client.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        data = sse_data([line async for line in r.aiter_lines()])
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    return [c["choices"][0]["text"] for c in chunks], chunks[-1]


def test_16_concurrent_streams_get_their_own_tokens(server, offline):
    prompts = [f"The river town {i}" if i % 2 else f"Hello there {i}" for i in range(16)]
    refs = offline.generate(prompts, SamplingParams(max_tokens=24, temperature=0))

    async def main():
        bodies = [{"prompt": p, "max_tokens": 24, "temperature": 0, "stream": True, "logprobs": 0, "return_tokens_as_token_ids": True} for p in prompts]
        return await asyncio.wait_for(asyncio.gather(*(stream_chunks(server.url, b) for b in bodies)), 90)

    results = asyncio.run(main())
    assert len({r.text for r in refs}) > 8  # the prompts really differ
    for (text, ids), ref in zip(results, refs, strict=True):
        assert text == ref.text and ids == ref.token_ids


async def stream_chunks(url: str, body: dict) -> tuple[str, list[int]]:
    async with httpx.AsyncClient(timeout=60) as client, client.stream("POST", url + "/v1/completions", json=body) as r:
        data = sse_data([line async for line in r.aiter_lines()])
    chunks = [json.loads(d)["choices"][0] for d in data[:-1]]
    ids = [int(t.removeprefix("token_id:")) for c in chunks for t in c["logprobs"]["tokens"]]
    return "".join(c["text"] for c in chunks), ids


def _spanning_multibyte(offline: LLM, token_ids: list[int]) -> list[str]:
    """Characters of the output whose UTF-8 bytes are split across two tokens (each token
    decoded alone gives U+FFFD where the whole output decodes to the character)."""
    text = offline.tokenizer.decode(token_ids)
    alone = "".join(offline.tokenizer.decode([t]) for t in token_ids)
    return [ch for ch in set(text) if ord(ch) > 0x7F and ch != "\ufffd" and ch not in alone]


def test_utf8_is_never_split_across_chunks(server, offline):
    candidates = ["ñandú", "b", "Hello there", "Ελληνικά", "a", "naïve", "中文"]
    refs = offline.generate(candidates, SamplingParams(max_tokens=24, temperature=0))
    picked = [(p, r) for p, r in zip(candidates, refs, strict=True) if _spanning_multibyte(offline, r.token_ids) and r.text == offline.tokenizer.decode(r.token_ids)]
    assert picked, "no candidate prompt's greedy output has a multi-byte character split across tokens"
    prompt, ref = picked[0]
    texts, _ = asyncio.run(stream_texts(server.url, {"prompt": prompt, "max_tokens": 24, "temperature": 0, "stream": True}))
    assert "".join(texts) == ref.text == offline.tokenizer.decode(ref.token_ids)
    for ch in _spanning_multibyte(offline, ref.token_ids):  # whole, inside one chunk
        assert any(ch in t for t in texts)
    # splitting a character would have produced extra replacement characters
    assert sum(t.count("\ufffd") for t in texts) == ref.text.count("\ufffd")


def test_stop_string_never_appears_in_a_chunk(server, offline):
    prompt = "Grüße"
    ref = offline.generate([prompt], SamplingParams(max_tokens=24, temperature=0))[0]
    pieces = [offline.tokenizer.decode([t]) for t in ref.token_ids]
    k = next(i for i in range(3, len(pieces) - 1) if len(pieces[i]) >= 3 and len(pieces[i + 1]) >= 3)
    stop = pieces[k][-2:] + pieces[k + 1][:2]  # spans the boundary between tokens k and k+1
    cut = ref.text.index(stop)
    stopped = offline.generate([prompt], SamplingParams(max_tokens=24, temperature=0, stop=[stop]))[0]
    assert stopped.text == ref.text[:cut] and stopped.finish_reason == "stop"
    texts, last = asyncio.run(stream_texts(server.url, {"prompt": prompt, "max_tokens": 24, "temperature": 0, "stream": True, "stop": stop}))
    assert all(stop not in t for t in texts)
    assert "".join(texts) == stopped.text
    assert last["choices"][0]["finish_reason"] == "stop" and last["choices"][0]["stop_reason"] == stop


def test_client_disconnects_abort_and_free_blocks(server):
    n = 50

    async def cut_after_two_chunks(client: httpx.AsyncClient, i: int) -> int:
        body = {"prompt": f"Hello there {i}", "max_tokens": 1000, "temperature": 0, "ignore_eos": True, "stream": True}
        path = "/generate" if i % 3 == 0 else "/v1/completions"
        async with client.stream("POST", server.url + path, json=body) as r:
            got = 0
            async for line in r.aiter_lines():
                got += line.startswith("data:")
                if got == 2:
                    break
            return got  # leaving the block closes the connection mid-stream

    async def main():
        limits = httpx.Limits(max_connections=n + 5)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            return await asyncio.wait_for(asyncio.gather(*(cut_after_two_chunks(client, i) for i in range(n))), 90)

    with finish_reasons(server) as reasons:
        assert asyncio.run(main()) == [2] * n
        cut_at = time.monotonic()
        wait_for(lambda: server.stats().num_running == 0 and server.stats().num_waiting == 0, 2.0, f"requests still running: {server.stats()}")
        wait_for(lambda: server.stats().num_blocks_used == 0, 2.0 - (time.monotonic() - cut_at), f"KV blocks still used: {server.stats()}")
    assert reasons == ["abort"] * n  # cut short, not run to max_tokens
    assert server.ctx.client.num_in_flight() == 0  # the server holds nothing for them either
    assert httpx.get(server.url + "/health").status_code == 200


@contextlib.contextmanager
def finish_reasons(server):
    """The finish reasons the engine reports while inside the block (its StepEvents, as they reach
    the server)."""
    reasons: list[str] = []

    def listener(step) -> None:
        reasons.extend(o.finish_reason for o in step.outputs if o.finished)

    remove = server.ctx.client.add_step_listener(listener)
    try:
        yield reasons
    finally:
        remove()


def test_non_streaming_client_gone_aborts(server):
    body = {"prompt": "Hello there", "max_tokens": 1000, "temperature": 0, "ignore_eos": True}
    with finish_reasons(server) as reasons:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.3))
        wait_for(lambda: server.stats().num_running == 0 and server.stats().num_blocks_used == 0, 2.0, f"not aborted: {server.stats()}")
    assert reasons == ["abort"]


def test_backpressure_429_with_retry_after(tiny_model):
    with live_server(tiny_model, max_waiting=2, max_num_seqs=2) as s:

        async def one(client: httpx.AsyncClient, i: int) -> tuple[int, dict, str | None]:
            body = {"prompt": f"Hello {i}", "max_tokens": 64, "temperature": 0, "ignore_eos": True, "stream": i % 2 == 0}
            async with client.stream("POST", s.url + "/v1/completions", json=body) as r:
                raw = (await r.aread()).decode()
                if r.status_code != 200 or not body["stream"]:
                    return r.status_code, json.loads(raw), r.headers.get("retry-after")
                data = sse_data(raw.splitlines())
                assert data[-1] == "[DONE]"
                return 200, json.loads(data[-2]), None

        async def main():
            async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=30)) as client:
                return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(20))), 90)

        results = asyncio.run(main())
        refused = [(b, h) for code, b, h in results if code == 429]
        served = [b for code, b, _ in results if code == 200]
        assert len(refused) + len(served) == 20, [code for code, _, _ in results]
        assert refused and served, (len(refused), len(served))
        for body, retry_after in refused:
            assert retry_after is not None and int(retry_after) >= 1
            assert body["error"]["type"] == "rate_limit_error" and "overloaded" in body["error"]["message"]
        for body in served:
            choice = body["choices"][0]
            assert choice["finish_reason"] == "length"
            if "usage" in body:
                assert body["usage"]["completion_tokens"] == 64
        wait_for(lambda: s.stats().num_running == 0 and s.stats().num_blocks_used == 0, 5, "requests left behind")
