"""End to end over a real uvicorn server: the official openai client (sync and async) and the
native /generate endpoint give the same greedy tokens and text as the offline LLM.generate."""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import openai
import pytest
from server_harness import sse_data

from llmserve.engine.llm import LLM
from llmserve.sampling import SamplingParams

pytestmark = pytest.mark.timeout(120)

PROMPTS = ["Hello there", "The river town", "café au lait"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about the river."}]


def greedy(offline: LLM, prompt, max_tokens: int, **kw):
    return offline.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0, **kw))[0]


def ids_of(tokens: list[str]) -> list[int]:
    """Token ids from logprobs tokens sent as `token_id:N` (return_tokens_as_token_ids)."""
    return [int(t.removeprefix("token_id:")) for t in tokens]


AS_IDS = {"return_tokens_as_token_ids": True}


def test_completions_match_offline(server, client, offline):
    for prompt in PROMPTS:
        ref = greedy(offline, prompt, 12)
        r = client.completions.create(model=server.model, prompt=prompt, max_tokens=12, temperature=0, logprobs=0, extra_body=AS_IDS)
        c = r.choices[0]
        assert c.text == ref.text
        assert ids_of(c.logprobs.tokens) == ref.token_ids
        assert c.finish_reason == ref.finish_reason
        n_prompt = len(offline.tokenizer.encode(prompt))
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, len(ref.token_ids))
        assert r.usage.total_tokens == n_prompt + len(ref.token_ids)
        assert r.usage.prompt_tokens_details.cached_tokens >= 0
        assert r.object == "text_completion" and r.model == server.model


def test_completions_prompt_shapes(server, client, offline):
    refs = [greedy(offline, p, 8) for p in PROMPTS]
    ids = [offline.tokenizer.encode(p) for p in PROMPTS]
    r = client.completions.create(model=server.model, prompt=PROMPTS, max_tokens=8, temperature=0)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [x.text for x in refs]
    r = client.completions.create(model=server.model, prompt=ids[0], max_tokens=8, temperature=0)
    assert r.choices[0].text == refs[0].text
    r = client.completions.create(model=server.model, prompt=ids, max_tokens=8, temperature=0)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [x.text for x in refs]
    assert r.usage.prompt_tokens == sum(map(len, ids))


def test_completions_stream_and_usage(server, client, offline):
    ref = greedy(offline, PROMPTS[1], 16)
    chunks = list(client.completions.create(model=server.model, prompt=PROMPTS[1], max_tokens=16, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason
    assert all(c.usage is None for c in chunks)
    chunks = list(
        client.completions.create(
            model=server.model, prompt=PROMPTS[1], max_tokens=16, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)
    assert all(c.usage is None for c in chunks[:-1])
    assert "".join(c.choices[0].text for c in chunks[:-1]) == ref.text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_raw_stream_ends_with_done_and_usage_only_when_asked(server, path):
    body = {"model": server.model, "max_tokens": 6, "temperature": 0, "stream": True}
    body |= {"prompt": "Hello"} if "chat" not in path else {"messages": MESSAGES}
    for include_usage in (False, True):
        extra = {"stream_options": {"include_usage": True}} if include_usage else {}
        with httpx.stream("POST", server.url + path, json=body | extra, timeout=60) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            data = sse_data(r.iter_lines())
        assert data[-1] == "[DONE]"
        chunks = [json.loads(d) for d in data[:-1]]
        with_usage = [c for c in chunks if c.get("usage")]
        if include_usage:
            assert with_usage == [chunks[-1]] and chunks[-1]["choices"] == []
        else:
            assert with_usage == [] and all("usage" not in c for c in chunks)
        finals = [ch for c in chunks for ch in c["choices"] if ch["finish_reason"]]
        assert len(finals) == 1 and finals[0]["finish_reason"] == "length"


CHUNK_KEYS = {"/v1/completions": ["index", "text", "logprobs", "finish_reason", "stop_reason"],
              "/v1/chat/completions": ["index", "delta", "logprobs", "finish_reason"]}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_raw_stream_bytes_are_compact_json_events_in_openai_key_order(server, path):
    """Each event is exactly `data: <compact JSON>\\n\\n` (UTF-8 unescaped), fields in OpenAI's order."""
    body = {"model": server.model, "max_tokens": 8, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    body |= {"prompt": "café au lait"} if "chat" not in path else {"messages": MESSAGES}
    with httpx.stream("POST", server.url + path, json=body, timeout=60) as r:
        raw = r.read()
    events = raw.split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""]
    for event in events[:-2]:
        assert event.startswith(b"data: ")
        chunk = json.loads(event[6:])
        assert event[6:] == json.dumps(chunk, separators=(",", ":"), ensure_ascii=False).encode()
        assert list(chunk) == ["id", "object", "created", "model", "choices", "usage"]
        for choice in chunk["choices"]:
            keys = CHUNK_KEYS[path] + (["stop_reason"] if "chat" in path and choice["finish_reason"] else [])
            assert list(choice) == keys
    assert json.loads(events[-3][6:])["usage"]["completion_tokens"] == 8


def test_chat_matches_offline(server, client, offline):
    ids = offline.tokenizer.apply_chat_template(MESSAGES)
    ref = greedy(offline, ids, 12)
    r = client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=12, temperature=0, logprobs=True, top_logprobs=2, extra_body=AS_IDS)
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content == ref.text
    assert ids_of([e.token for e in c.logprobs.content]) == ref.token_ids
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.logprob - 1e-4 for e in c.logprobs.content)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(ref.token_ids))
    # max_completion_tokens is an alias of max_tokens; the stream starts with the role
    chunks = list(client.chat.completions.create(model=server.model, messages=MESSAGES, max_completion_tokens=12, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason
    assert all(ch.usage is None for ch in chunks)


def test_async_client_streams_concurrently(server, offline):
    ids = offline.tokenizer.apply_chat_template(MESSAGES)
    ref_chat, ref_cmpl = greedy(offline, ids, 10), greedy(offline, PROMPTS[0], 10)

    async def main():
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)

        async def chat() -> str:
            stream = await aclient.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=10, temperature=0, stream=True)
            return "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])

        async def completion() -> str:
            r = await aclient.completions.create(model=server.model, prompt=PROMPTS[0], max_tokens=10, temperature=0)
            return r.choices[0].text

        try:
            return await asyncio.wait_for(asyncio.gather(chat(), completion(), chat()), 60)
        finally:
            await aclient.close()

    assert asyncio.run(main()) == [ref_chat.text, ref_cmpl.text, ref_chat.text]


def test_echo_logprobs_scores_the_prompt(server, client, offline):
    prompt = PROMPTS[1]
    ids = offline.tokenizer.encode(prompt)
    ref = offline.generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2))[0]
    r = client.completions.create(model=server.model, prompt=prompt, max_tokens=0, echo=True, logprobs=2, extra_body=AS_IDS)
    c = r.choices[0]
    assert c.text == prompt and r.usage.completion_tokens == 0 and c.finish_reason == "length"
    assert ids_of(c.logprobs.tokens) == ids
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
    want = [lp.logprob for lp in ref.prompt_logprobs[1:]]
    assert all(math.isclose(a, b, abs_tol=1e-3) for a, b in zip(c.logprobs.token_logprobs[1:], want, strict=True))
    assert all(len(t) >= 2 for t in c.logprobs.top_logprobs[1:])
    # echo with generation: prompt text, then the greedy continuation
    gen = greedy(offline, prompt, 5)
    r = client.completions.create(model=server.model, prompt=prompt, max_tokens=5, echo=True, logprobs=1, temperature=0)
    assert r.choices[0].text == prompt + gen.text
    assert len(r.choices[0].logprobs.tokens) == len(ids) + len(gen.token_ids)


def test_n_samples_with_seed_match_offline(server, client, offline):
    ref = offline.generate([PROMPTS[0]], SamplingParams(n=3, max_tokens=8, temperature=0.9, seed=11))[0]
    r = client.completions.create(model=server.model, prompt=PROMPTS[0], n=3, max_tokens=8, temperature=0.9, seed=11)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [o.text for o in ref.outputs]
    assert r.usage.completion_tokens == sum(len(o.token_ids) for o in ref.outputs)


def test_native_generate_matches_offline(server, offline):
    ref = greedy(offline, PROMPTS[0], 12)
    body = {"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0}
    r = httpx.post(server.url + "/generate", json=body, timeout=60)
    final = r.json()
    assert r.status_code == 200 and final["token_ids"] == ref.token_ids and final["generated_text"] == ref.text
    assert final["usage"]["completion_tokens"] == len(ref.token_ids)
    t = final["timings"]
    assert len(t["itl_ms"]) == len(ref.token_ids) - 1 and 0 <= t["queue_ms"] <= t["ttft_ms"] <= t["e2e_ms"]

    ids = offline.tokenizer.encode(PROMPTS[0])
    with httpx.stream("POST", server.url + "/generate", json={"input_ids": ids, "max_tokens": 12, "temperature": 0, "stream": True}, timeout=60) as r:
        events = [json.loads(d) for d in sse_data(r.iter_lines())]
    tokens, last = events[:-1], events[-1]
    assert [e["token"]["id"] for e in tokens] == ref.token_ids and [e["index"] for e in tokens] == list(range(len(tokens)))
    assert "".join(e["token"]["text"] for e in tokens) == last["generated_text"] == ref.text
    assert all(isinstance(e["token"]["logprob"], float) for e in tokens)
    t_ms = [e["t_ms"] for e in tokens]
    assert t_ms == sorted(t_ms) and t_ms[0] == last["timings"]["ttft_ms"]
    assert last["finish_reason"] == ref.finish_reason and last["usage"]["prompt_tokens"] == len(ids)


def test_native_generate_takes_chat_messages(server, offline):
    """/generate with "messages" runs the chat template: the same tokens as the chat route."""
    ids = offline.tokenizer.apply_chat_template(MESSAGES)
    ref = greedy(offline, ids, 12)
    final = httpx.post(server.url + "/generate", json={"messages": MESSAGES, "max_tokens": 12, "temperature": 0}, timeout=60).json()
    assert final["token_ids"] == ref.token_ids and final["generated_text"] == ref.text
    assert final["usage"]["prompt_tokens"] == len(ids)
    both = httpx.post(server.url + "/generate", json={"messages": MESSAGES, "prompt": "x"}, timeout=60)
    assert both.status_code == 400 and both.json()["error"]["param"] == "prompt"


def test_chat_content_forms_openai_accepts(server, client, offline):
    """A list of text parts reads as its joined text; an assistant turn with tool_calls may have
    no content (its calls are shown as tool-call blocks); developer and tool messages are accepted."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "Tell me"}, {"type": "text", "text": "about it."}]}]
    as_text = [{"role": "user", "content": "Tell me\nabout it."}]
    a = client.chat.completions.create(model=server.model, messages=parts, max_tokens=6, temperature=0)
    b = client.chat.completions.create(model=server.model, messages=as_text, max_tokens=6, temperature=0)
    assert a.usage.prompt_tokens == b.usage.prompt_tokens and a.choices[0].message.content == b.choices[0].message.content
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 1}"}}
    turns = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Add."},
             {"role": "assistant", "content": None, "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "c1", "content": "1"}, {"role": "user", "content": "Thanks."}]
    r = client.chat.completions.create(model=server.model, messages=turns, max_tokens=4, temperature=0)
    # the assistant's call is shown to the model as the block it would have written
    block = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    templated = [{"role": m["role"], "content": m["content"] or block} for m in turns]
    assert r.usage.prompt_tokens == len(offline.tokenizer.apply_chat_template(templated))


def test_models_health_tokenize(server, client, offline):
    assert [m.id for m in client.models.list().data][0] == server.model  # then the embedding model, when installed
    assert httpx.get(server.url + "/health").status_code == 200
    ids = offline.tokenizer.encode("café au lait")
    r = httpx.post(server.url + "/tokenize", json={"prompt": "café au lait"}).json()
    assert r["tokens"] == ids and r["count"] == len(ids) and r["max_model_len"] == 1024
    assert httpx.post(server.url + "/detokenize", json={"tokens": ids}).json() == {"prompt": "café au lait"}
    chat = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES}).json()
    assert chat["tokens"] == offline.tokenizer.apply_chat_template(MESSAGES)
