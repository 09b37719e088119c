"""/v1/responses through the official openai client against a live server: the same tokens (by id)
as the same conversation through /v1/chat/completions; streamed events in OpenAI's order; tools
and JSON schemas; stored responses continued by previous_response_id, in process and in Redis."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from server_harness import live_server, sse_data

pytestmark = pytest.mark.timeout(300)

INSTRUCTIONS = "Be brief."
ADD = {"name": "add", "description": "Add two integers",
       "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}
SHOUT = {"name": "shout", "parameters": {"type": "object", "properties": {"word": {"type": "string", "maxLength": 10}}, "required": ["word"]}}
FLAT_TOOLS = [{"type": "function", **t} for t in (ADD, SHOUT)]  # the Responses API's shape
CHAT_TOOLS = [{"type": "function", "function": t} for t in (ADD, SHOUT)]
IDS = {"return_token_ids": True}
LOGPROBS = ["message.output_text.logprobs"]


class Pet(BaseModel):
    legs: int = Field(ge=0, le=8)
    kind: str = Field(pattern="^(cat|dog|bird)$")


def chat_ids(client: openai.OpenAI, messages: list[dict], **kw) -> list[int]:
    """The output token ids of the same request through /v1/chat/completions."""
    r = client.chat.completions.create(messages=messages, logprobs=True, extra_body={"return_tokens_as_token_ids": True}, **kw)
    return [int(t.token.removeprefix("token_id:")) for t in r.choices[0].logprobs.content]


def history(instructions: str, *turns: str | list) -> list[dict]:
    return [{"role": "system", "content": instructions}, *({"role": "user", "content": t} if isinstance(t, str) else t for t in turns)]


def test_text_matches_chat_and_streams_in_order(server, client):
    kw = dict(model=server.model, instructions=INSTRUCTIONS, max_output_tokens=10, temperature=0)
    r = client.responses.create(input="Tell me about the river.", include=LOGPROBS, top_logprobs=2,
                                extra_body={**IDS, "return_tokens_as_token_ids": True}, **kw)
    ref = chat_ids(client, history(INSTRUCTIONS, "Tell me about the river."), model=server.model, max_tokens=10, temperature=0)
    assert r.token_ids == ref and r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    (message,) = r.output
    part = message.content[0]
    assert message.type == "message" and message.role == "assistant" and part.type == "output_text"
    assert [int(lp.token.removeprefix("token_id:")) for lp in part.logprobs] == ref
    assert all(len(lp.top_logprobs) == 2 for lp in part.logprobs)
    assert r.id.startswith("resp_") and r.object == "response" and r.output_text == part.text
    assert (r.usage.input_tokens, r.usage.output_tokens) == (len(r.prompt_token_ids), 10)
    assert r.usage.total_tokens == r.usage.input_tokens + 10
    with client.responses.stream(input="Tell me about the river.", **kw) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert final.output_text == r.output_text and final.status == "incomplete"
    order = "response.created response.in_progress response.output_item.added response.content_part.added " \
            "(response.output_text.delta )+response.output_text.done response.content_part.done response.output_item.done response.completed"
    assert re.fullmatch(order, " ".join(kinds)), kinds


def test_raw_stream_names_and_numbers_every_event(server):
    body = {"model": server.model, "input": "Hello there", "max_output_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=60) as r:
        lines = list(r.iter_lines())
    names = [line[6:].strip() for line in lines if line.startswith("event:")]
    events = [json.loads(d) for d in sse_data(lines)]
    assert names == [e["type"] for e in events] and "[DONE]" not in lines
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["response"]["usage"]["output_tokens"] == 4


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "shout"}], ids=["required", "named"])
def test_function_calls_parse_match_chat_and_stream(server, client, tool_choice):
    kw = dict(model=server.model, parallel_tool_calls=False, temperature=1)  # the client takes seed through extra_body
    r = client.responses.create(input="hi", tools=FLAT_TOOLS, tool_choice=tool_choice, max_output_tokens=200,
                                extra_body={**IDS, "seed": 7}, **kw)
    (call,) = r.output
    assert call.type == "function_call" and call.call_id.startswith("call_") and r.status == "completed"
    schemas = {t["name"]: t["parameters"] for t in FLAT_TOOLS}
    jsonschema.validate(json.loads(call.arguments), schemas[call.name])
    chat_choice = tool_choice if isinstance(tool_choice, str) else {"type": "function", "function": {"name": "shout"}}
    assert r.token_ids == chat_ids(client, [{"role": "user", "content": "hi"}], tools=CHAT_TOOLS,
                                   tool_choice=chat_choice, max_tokens=200, seed=7, **kw)
    with client.responses.stream(input="hi", tools=FLAT_TOOLS, tool_choice=tool_choice, max_output_tokens=200, extra_body={"seed": 7},
                                 **kw) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert [(c.name, c.arguments) for c in final.output] == [(call.name, call.arguments)]
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds


def test_json_schema_output_parses_and_matches_chat(server, client):
    kw = dict(model=server.model, max_output_tokens=200, temperature=1, extra_body={**IDS, "seed": 4})
    r = client.responses.parse(input="A pet, please.", text_format=Pet, **kw)  # the client sends Pet's strict schema
    assert isinstance(r.output_parsed, Pet)
    schema = {**Pet.model_json_schema(), "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "Pet", "schema": schema}}
    r2 = client.responses.create(input="A pet, please.", text={"format": {"type": "json_schema", "name": "Pet", "schema": schema}}, **kw)
    jsonschema.validate(json.loads(r2.output_text), schema)
    assert r2.token_ids == chat_ids(client, [{"role": "user", "content": "A pet, please."}],
                                                   model=server.model, response_format=fmt, max_tokens=200, temperature=1, seed=4)


def test_three_turns_through_previous_response_id_equal_the_whole_conversation(server, client):
    """Turn two is a tool call, turn three its result; the chain and the whole list give the same
    prompt and output token ids, and those equal chat completions' for the same conversation."""
    kw = dict(model=server.model, instructions=INSTRUCTIONS, tools=FLAT_TOOLS, max_output_tokens=8, temperature=0, extra_body=IDS)
    r1 = client.responses.create(input="Tell me about the river.", **kw)
    r2 = client.responses.create(input="Shout hello.", previous_response_id=r1.id, **{**kw, "tool_choice": {"type": "function", "name": "shout"},
                                                                                      "parallel_tool_calls": False, "max_output_tokens": 200})
    call = r2.output[0]
    assert call.type == "function_call", r2.output
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "5"}
    r3 = client.responses.create(input=[result], previous_response_id=r2.id, **kw)
    whole = [{"role": "user", "content": "Tell me about the river."}, *(i.model_dump(exclude_none=True) for i in r1.output),
             {"role": "user", "content": "Shout hello."}, *(i.model_dump(exclude_none=True) for i in r2.output), result]
    w3 = client.responses.create(input=whole, **kw)
    assert (w3.prompt_token_ids, w3.token_ids) == (r3.prompt_token_ids, r3.token_ids)
    tool_call = {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    messages = history(INSTRUCTIONS, "Tell me about the river.", {"role": "assistant", "content": r1.output_text}, "Shout hello.",
                       {"role": "assistant", "content": None, "tool_calls": [tool_call]},
                       {"role": "tool", "tool_call_id": call.call_id, "content": "5"})
    assert r3.token_ids == chat_ids(client, messages, model=server.model, tools=CHAT_TOOLS, max_tokens=8, temperature=0)
    assert r3.previous_response_id == r2.id


def test_stored_responses_are_read_deleted_and_kept_only_when_asked(server, client):
    r = client.responses.create(model=server.model, input="Hello there", max_output_tokens=4, temperature=0)
    got = client.responses.retrieve(r.id)
    assert (got.id, got.output_text, got.usage.output_tokens) == (r.id, r.output_text, 4)
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=server.model, input="more", previous_response_id=r.id, max_output_tokens=2)
    unstored = client.responses.create(model=server.model, input="Hello there", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_the_store_is_bounded_by_count(tiny_model):
    with live_server(tiny_model, response_store_size=2) as s:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0)
        ids = [client.responses.create(model=s.model, input=f"turn {i}", max_output_tokens=1).id for i in range(3)]
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(ids[0])  # the least recently used went
        assert [client.responses.retrieve(i).id for i in ids[1:]] == ids[1:]


def test_a_store_of_size_zero_keeps_nothing():
    import asyncio

    from llmserve.server.response_store import ResponseStore, StoredResponse

    store = ResponseStore(ttl_s=60, max_entries=0, max_bytes=1 << 20)
    assert asyncio.run(store.put("resp_1", StoredResponse({"id": "resp_1"}, []))) is False
    assert asyncio.run(store.get("resp_1")) is None


def test_a_stored_value_that_is_not_json_is_absent_not_a_500():
    """A sealed record of the right kind whose fields hold what msgpack carries and JSON does not
    (bytes, extension types, integer keys) is treated as absent; a JSON one round-trips."""
    import asyncio
    import zlib

    import msgspec

    from llmserve.cache import records
    from llmserve.server.response_store import KEY_PREFIX, ResponseStore, StoredResponse

    store = ResponseStore(ttl_s=60, max_entries=8, max_bytes=1 << 20)
    good = StoredResponse({"id": "resp_ok", "output": [{"n": 1.5, "ok": True, "x": None}]}, [{"role": "user"}])
    assert asyncio.run(store.put("resp_ok", good)) and asyncio.run(store.get("resp_ok")) == good

    def sealed(fields: list) -> bytes:
        body = msgspec.msgpack.encode(["stored-response/2", *fields])
        return msgspec.msgpack.encode(records.Sealed(zlib.crc32(body), memoryview(body)))

    for bad in ([{"id": b"bytes"}, []], [{"id": "r", "m": {1: 2}}, []], [{"id": "r"}, [{"e": msgspec.msgpack.Ext(5, b"x")}]]):
        store.local.set(KEY_PREFIX + "resp_bad", sealed(bad), 60)  # type: ignore[union-attr]
        assert asyncio.run(store.get("resp_bad")) is None, bad


def test_responses_are_stored_in_redis(tiny_model, redis_server):
    with live_server(tiny_model, redis_url=redis_server.url, redis_timeout=1.0, response_cache_ttl=600) as s:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0)
        r = client.responses.create(model=s.model, input="Hello there", max_output_tokens=4, temperature=0)
        key = f"llmserve:responses:{r.id}"
        assert 0 < redis_server.client().ttl(key) <= 600
        follow = client.responses.create(model=s.model, input="and then?", previous_response_id=r.id, max_output_tokens=2)
        assert follow.status == "incomplete"
        client.responses.delete(r.id)
        assert redis_server.client().exists(key) == 0


def test_a_store_redis_that_does_not_answer_is_a_503_not_a_404(tiny_model):
    """With the store's Redis down, a stored response may still exist: reading, continuing or
    deleting it is a 503 the client may retry, never a 404 that says it is gone."""
    from redis_fixture import free_port
    with live_server(tiny_model, redis_url=f"redis://127.0.0.1:{free_port()}", redis_timeout=0.2) as s:
        gets = [httpx.get(f"{s.url}/v1/responses/resp_abc", timeout=30) for _ in range(2)]  # a failure, then the open breaker
        cont = httpx.post(f"{s.url}/v1/responses", json={"model": s.model, "input": "hi", "previous_response_id": "resp_abc",
                                                        "max_output_tokens": 2}, timeout=30)
        gone = httpx.delete(f"{s.url}/v1/responses/resp_abc", timeout=30)
        for r in [*gets, cont, gone]:
            assert r.status_code == 503, (r.status_code, r.text)
            assert r.json()["error"]["type"] == "service_unavailable"
