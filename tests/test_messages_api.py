"""/v1/messages through the official anthropic client against a live server that requires an API
key (which the client sends as x-api-key): the same tokens (by id) as the same conversation
through /v1/chat/completions; Anthropic's named stream events; tool use; count_tokens; the prefix
cache in usage."""

from __future__ import annotations

import json
import re

import anthropic
import httpx
import jsonschema
import openai
import pytest
from server_harness import live_server, sse_data

pytestmark = pytest.mark.timeout(300)

KEY = "sekret"
SYSTEM = "Be brief."
ADD = {"name": "add", "description": "Add two integers",
       "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}
SHOUT = {"name": "shout", "input_schema": {"type": "object", "properties": {"word": {"type": "string", "maxLength": 10}}, "required": ["word"]}}
TOOLS = [ADD, SHOUT]
CHAT_TOOLS = [{"type": "function", "function": {"name": t["name"], "description": t.get("description"), "parameters": t["input_schema"]}}
              for t in TOOLS]
USER = [{"role": "user", "content": "Tell me about the river."}]


@pytest.fixture(scope="module")
def server(tiny_model):
    with live_server(tiny_model, api_key=KEY) as s:
        yield s


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


def chat_ids(client: openai.OpenAI, messages: list[dict], extra_body: dict | None = None, **kw) -> list[int]:
    r = client.chat.completions.create(messages=messages, logprobs=True, extra_body={"return_tokens_as_token_ids": True, **(extra_body or {})},
                                       **kw)
    return [int(t.token.removeprefix("token_id:")) for t in r.choices[0].logprobs.content]


def sampling(temperature: float, seed: int | None = None, **extra) -> dict:
    """Sampling fields the anthropic client sends through extra_body (it has no seed)."""
    return {"extra_body": {"temperature": temperature, "return_token_ids": True, **({"seed": seed} if seed is not None else {}), **extra}}


def test_text_matches_chat_and_streams_the_same(server, claude, client):
    kw = dict(model=server.model, system=SYSTEM, messages=USER, max_tokens=10)
    m = claude.messages.create(**kw, **sampling(0))
    ref = chat_ids(client, [{"role": "system", "content": SYSTEM}, *USER], model=server.model, max_tokens=10, temperature=0)
    assert m.token_ids == ref
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant" and m.model == server.model
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    assert m.usage.output_tokens == 10 and m.usage.input_tokens + m.usage.cache_read_input_tokens == len(m.prompt_token_ids)
    with claude.messages.stream(**kw, extra_body={"temperature": 0}) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == final.content[0].text == m.content[0].text
    assert (final.stop_reason, final.usage.output_tokens) == ("max_tokens", 10)


def test_raw_stream_uses_anthropic_event_names(server):
    body = {"model": server.model, "messages": USER, "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"}) as r:
        lines = list(r.iter_lines())
    names = [line[6:].strip() for line in lines if line.startswith("event:")]
    events = [json.loads(d) for d in sse_data(lines)]
    assert names == [e["type"] for e in events]
    order = "message_start ping content_block_start (content_block_delta )+content_block_stop message_delta message_stop"
    assert re.fullmatch(order, " ".join(names)), names
    assert events[0]["message"]["content"] == [] and events[-2]["usage"]["output_tokens"] == 4


def test_system_blocks_and_stop_sequences(server, claude):
    kw = dict(model=server.model, messages=USER, max_tokens=12)
    plain = claude.messages.create(**kw, system=SYSTEM, **sampling(0))
    blocks = claude.messages.create(**kw, system=[{"type": "text", "text": SYSTEM}], **sampling(0))
    assert blocks.token_ids == plain.token_ids
    text = plain.content[0].text
    stop = text[len(text) // 2:][:2].strip() or text[-1]
    cut = claude.messages.create(**kw, system=SYSTEM, stop_sequences=[stop], **sampling(0))
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
    cut_text = cut.content[0].text if cut.content else ""  # nothing at all when the stop string came first
    assert stop not in cut_text and text.startswith(cut_text) and len(cut.token_ids) < len(plain.token_ids)


@pytest.mark.parametrize("tool_choice", [{"type": "any"}, {"type": "tool", "name": "shout"}], ids=["any", "named"])
def test_tool_use_parses_matches_chat_and_streams(server, claude, client, tool_choice):
    kw = dict(model=server.model, messages=[{"role": "user", "content": "hi"}], tools=TOOLS, max_tokens=200)
    choice = {**tool_choice, "disable_parallel_tool_use": True}
    m = claude.messages.create(**kw, tool_choice=choice, **sampling(1, 7))
    (use,) = m.content
    assert use.type == "tool_use" and use.id.startswith("toolu_") and m.stop_reason == "tool_use"
    jsonschema.validate(use.input, {t["name"]: t["input_schema"] for t in TOOLS}[use.name])
    chat_choice = "required" if tool_choice["type"] == "any" else {"type": "function", "function": {"name": "shout"}}
    assert m.token_ids == chat_ids(client, [{"role": "user", "content": "hi"}], model=server.model, tools=CHAT_TOOLS,
                                   tool_choice=chat_choice, parallel_tool_calls=False, max_tokens=200, temperature=1, seed=7)
    with claude.messages.stream(**kw, tool_choice=choice, extra_body={"temperature": 1, "seed": 7}) as stream:
        final = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", use.name, use.input)]
    assert final.stop_reason == "tool_use"


def test_tool_results_continue_the_conversation_as_chat_does(server, claude, client):
    use = {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 2, "b": 3}}
    messages = [*USER, {"role": "assistant", "content": [{"type": "text", "text": "Let me add."}, use]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "5"}]},
                                             {"type": "text", "text": "And now?"}]}]
    m = claude.messages.create(model=server.model, system=SYSTEM, messages=messages, tools=TOOLS, max_tokens=8, **sampling(0))
    call = {"id": "toolu_1", "type": "function", "function": {"name": "add", "arguments": json.dumps({"a": 2, "b": 3})}}
    chat = [{"role": "system", "content": SYSTEM}, *USER, {"role": "assistant", "content": "Let me add.", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "5"}, {"role": "user", "content": "And now?"}]
    assert m.token_ids == chat_ids(client, chat, model=server.model, tools=CHAT_TOOLS, max_tokens=8, temperature=0)
    counted = claude.messages.count_tokens(model=server.model, system=SYSTEM, messages=messages, tools=TOOLS)
    assert counted.input_tokens == len(m.prompt_token_ids)


def test_count_tokens_and_the_prefix_cache_in_usage(server, claude):
    long = [{"role": "user", "content": "The river town had a mill, a bridge and a market square. " * 6}]
    n = claude.messages.count_tokens(model=server.model, messages=long).input_tokens
    first = claude.messages.create(model=server.model, messages=long, max_tokens=2, **sampling(0, cache=False))
    again = claude.messages.create(model=server.model, messages=long, max_tokens=2, **sampling(0, cache=False))
    assert n == len(first.prompt_token_ids) == first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert again.usage.cache_read_input_tokens > 0 and again.usage.input_tokens + again.usage.cache_read_input_tokens == n


def test_the_key_is_required_on_the_messages_routes(server):
    bad = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model=server.model, messages=USER, max_tokens=2)
    assert e.value.body["error"]["type"] == "authentication_error"
    good = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)
    with pytest.raises(anthropic.NotFoundError):
        good.messages.create(model="claude-9", messages=USER, max_tokens=2)
    with pytest.raises(anthropic.BadRequestError) as e:
        good.messages.create(model=server.model, messages=[{"role": "user", "content": [{"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": "AA=="}}]}], max_tokens=2)
    assert "image" in e.value.body["error"]["message"]


def test_priority_is_refused_under_fcfs(tiny_model, server):
    r = httpx.post(server.url + "/v1/messages", headers={"x-api-key": KEY},
                   json={"messages": USER, "max_tokens": 2, "priority": 3})
    assert r.status_code == 400 and "--scheduling-policy priority" in r.json()["error"]["message"]
    with live_server(tiny_model, scheduling_policy="priority") as s:
        r = httpx.post(s.url + "/v1/messages", json={"messages": USER, "max_tokens": 2, "priority": -3})
        assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == 2


def test_a_final_assistant_message_is_continued(server, claude, client):
    """Anthropic's prefill: the answer goes on from the assistant's last word, as chat completions'
    continue_final_message (vLLM's) does, and holds only the new text."""
    prefill = [*USER, {"role": "assistant", "content": "The river"}]
    m = claude.messages.create(model=server.model, messages=prefill, max_tokens=6, **sampling(0))
    template = server.ctx.tokenizer.hf.apply_chat_template(prefill, tokenize=False, continue_final_message=True)
    assert m.prompt_token_ids == server.ctx.tokenizer.encode(template, add_special_tokens=False)
    assert template.endswith("The river")
    assert m.token_ids == chat_ids(client, prefill, model=server.model, max_tokens=6, temperature=0,
                                   extra_body={"add_generation_prompt": False, "continue_final_message": True})
