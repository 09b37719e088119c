"""Bad requests get the right 4xx with an OpenAI-style error body, never a 500, and leave the
server healthy. The server requires an API key here, so auth is checked on every route too."""

from __future__ import annotations

import httpx
import openai
import pytest
from server_harness import live_server

pytestmark = pytest.mark.timeout(120)

KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}
CMPL, CHAT, GEN = "/v1/completions", "/v1/chat/completions", "/generate"
RESP, MSG, COUNT = "/v1/responses", "/v1/messages", "/v1/messages/count_tokens"
USER = [{"role": "user", "content": "hi"}]
ADD = {"type": "function", "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}
CALL = {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a": 1}'}
TOOL_USE = {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 1}}


@pytest.fixture(scope="module")
def server(tiny_model):
    with live_server(tiny_model, api_key=KEY) as s:
        yield s


def chunks(total: int, size: int = 64 << 10):
    for _ in range(total // size):
        yield b" " * size


# (name, method, path, json body | raw bytes | None, extra headers, status, param, message part);
# on Anthropic's routes (/v1/messages...) `param` is the expected error.type, as its body has no param
CASES = [
    ("prompt wrong type", "POST", CMPL, {"prompt": 5}, {}, 400, "prompt", "must be one of"),
    ("max_tokens as a string", "POST", CMPL, {"prompt": "x", "max_tokens": "10"}, {}, 400, "max_tokens", ""),
    ("negative max_tokens", "POST", CMPL, {"prompt": "x", "max_tokens": -1}, {}, 400, "max_tokens", ""),
    ("max_tokens 0 without echo", "POST", CMPL, {"prompt": "x", "max_tokens": 0}, {}, 400, "max_tokens", ""),
    ("temperature -1", "POST", CMPL, {"prompt": "x", "temperature": -1}, {}, 400, "temperature", "[0, 100]"),
    ("prompt over the context", "POST", CMPL, {"prompt": [5] * 1100, "max_tokens": 4}, {}, 400, None, "1024"),
    ("max_tokens over the context", "POST", CHAT, {"messages": USER, "max_tokens": 5000}, {}, 400, "max_tokens", "1024"),
    ("empty prompt", "POST", CMPL, {"prompt": ""}, {}, 400, "prompt", "empty"),
    ("empty prompt list", "POST", CMPL, {"prompt": []}, {}, 400, "prompt", "empty"),
    ("token ids out of vocab", "POST", CMPL, {"prompt": [5, 99999]}, {}, 400, "prompt", "1024"),
    ("n=0", "POST", CMPL, {"prompt": "x", "n": 0}, {}, 400, "n", ""),
    ("top_p=0", "POST", CMPL, {"prompt": "x", "top_p": 0}, {}, 400, "top_p", ""),
    ("logprobs too large", "POST", CMPL, {"prompt": "x", "logprobs": 50}, {}, 400, "logprobs", "20"),
    ("stop not a string or list", "POST", CMPL, {"prompt": "x", "stop": 5}, {}, 400, "stop", ""),
    ("stop list of numbers", "POST", CMPL, {"prompt": "x", "stop": [1, 2]}, {}, 400, "stop", ""),
    ("logit_bias key not an id", "POST", CMPL, {"prompt": "x", "logit_bias": {"abc": 1}}, {}, 400, "logit_bias", ""),
    ("logit_bias id out of vocab", "POST", CMPL, {"prompt": "x", "logit_bias": {"99999": 1}}, {}, 400, "logit_bias", "vocabulary"),
    ("presence_penalty out of range", "POST", CMPL, {"prompt": "x", "presence_penalty": 5}, {}, 400, "presence_penalty", ""),
    ("min_tokens above max_tokens", "POST", CMPL, {"prompt": "x", "max_tokens": 2, "min_tokens": 5}, {}, 400, "min_tokens", ""),
    ("seed too large", "POST", CMPL, {"prompt": "x", "seed": 2**70}, {}, 400, "seed", ""),
    ("top_k too large", "POST", CMPL, {"prompt": "x", "top_k": 10**20}, {}, 400, "top_k", ""),
    ("stream not a bool", "POST", CMPL, {"prompt": "x", "stream": "yes"}, {}, 400, "stream", ""),
    ("priority as a string", "POST", CMPL, {"prompt": "x", "priority": "1"}, {}, 400, "priority", ""),
    ("priority as a bool", "POST", CHAT, {"messages": USER, "priority": True}, {}, 400, "priority", ""),
    ("priority under fcfs", "POST", CHAT, {"messages": USER, "priority": 5}, {}, 400, "priority", "--scheduling-policy priority"),
    ("priority under fcfs, generate", "POST", GEN, {"prompt": "x", "priority": -1}, {}, 400, "priority", "--scheduling-policy priority"),
    ("NaN temperature", "POST", CMPL, b'{"prompt": "x", "temperature": NaN}', {}, 400, None, "JSON"),
    ("empty messages", "POST", CHAT, {"messages": []}, {}, 400, "messages", "empty"),
    ("continue_final_message with add_generation_prompt", "POST", CHAT, {"messages": [*USER, {"role": "assistant", "content": "a"}],
     "continue_final_message": True}, {}, 400, "continue_final_message", "add_generation_prompt"),
    ("messages missing", "POST", CHAT, {"model": None}, {}, 400, "messages", "required"),
    ("unknown role", "POST", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, {}, 400, "messages[0].role", "wizard"),
    ("content not text", "POST", CHAT, {"messages": [{"role": "user", "content": 5}]}, {}, 400, "messages[0].content", ""),
    ("image content part", "POST", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, {}, 400, "messages[0].content[0]", "text"),
    # OpenAI's content rules: required on system, user and tool messages; null only on an assistant
    # message with tool_calls
    ("user message without content", "POST", CHAT, {"messages": [{"role": "user"}]}, {}, 400, "messages[0].content", "required"),
    ("user content null", "POST", CHAT, {"messages": [{"role": "user", "content": None}]}, {}, 400, "messages[0].content", "required"),
    ("system content null", "POST", CHAT, {"messages": [{"role": "system", "content": None}, *USER]}, {}, 400, "messages[0].content", "required"),
    ("tool message without content", "POST", CHAT, {"messages": [*USER, {"role": "tool", "tool_call_id": "c1"}]}, {}, 400, "messages[1].content", "required"),
    ("assistant null without tool_calls", "POST", CHAT, {"messages": [*USER, {"role": "assistant", "content": None}, *USER]}, {}, 400, "messages[1].content", "required"),
    ("empty content list", "POST", CHAT, {"messages": [{"role": "user", "content": []}]}, {}, 400, "messages[0].content", "empty"),
    ("text part without text", "POST", CHAT, {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, {}, 400, "messages[0].content[0]", "text"),
    ("stop_token_ids out of vocab", "POST", CMPL, {"prompt": "x", "stop_token_ids": [10**6]}, {}, 400, "stop_token_ids", "vocabulary"),
    ("logit_bias out of vocab", "POST", CMPL, {"prompt": "x", "logit_bias": {"1000000": 1}}, {}, 400, "logit_bias", "vocabulary"),
    ("top_logprobs too large", "POST", CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 30}, {}, 400, "logprobs", "20"),
    ("top_logprobs without logprobs", "POST", CHAT, {"messages": USER, "top_logprobs": 2}, {}, 400, "top_logprobs", ""),
    ("generate with prompt and input_ids", "POST", GEN, {"prompt": "x", "input_ids": [1]}, {}, 400, "prompt", "exactly one"),
    ("generate n=2", "POST", GEN, {"prompt": "x", "n": 2}, {}, 400, "n", ""),
    ("detokenize out of vocab", "POST", "/detokenize", {"tokens": [-1]}, {}, 400, "tokens", ""),
    ("tokenize nothing", "POST", "/tokenize", {}, {}, 400, "prompt", ""),
    ("invalid JSON", "POST", CMPL, b'{"prompt": "x",', {}, 400, None, "JSON"),
    ("empty body", "POST", CMPL, b"", {}, 400, None, "JSON"),
    ("JSON not an object", "POST", CMPL, b"[1, 2]", {}, 400, None, "object"),
    ("deeply nested JSON", "POST", CMPL, b"[" * 200_000 + b"]" * 200_000, {}, 400, None, "JSON"),
    ("wrong content type", "POST", CMPL, b"prompt=x", {"Content-Type": "application/x-www-form-urlencoded"}, 415, None, "JSON"),
    ("text/plain", "POST", CHAT, b'{"messages": []}', {"Content-Type": "text/plain"}, 415, None, "JSON"),
    ("10 MB body", "POST", CMPL, b'{"prompt": "' + b"x" * (10 << 20) + b'"}', {}, 413, None, "limit"),
    ("chunked body over the limit", "POST", CMPL, chunks(2 << 20), {}, 413, None, "limit"),
    ("bad API key", "POST", CMPL, {"prompt": "x"}, {"Authorization": "Bearer wrong"}, 401, None, "API key"),
    ("no API key", "GET", "/v1/models", None, {"Authorization": ""}, 401, None, "API key"),
    ("not a bearer token", "POST", GEN, {"prompt": "x"}, {"Authorization": f"Basic {KEY}"}, 401, None, "API key"),
    ("unknown model", "POST", CMPL, {"prompt": "x", "model": "gpt-9"}, {}, 404, "model", "gpt-9"),
    ("unknown model card", "GET", "/v1/models/gpt-9", None, {}, 404, "model", "gpt-9"),
    ("unknown route", "POST", "/v1/nothing", {}, {}, 404, None, "/v1/nothing"),
    ("wrong method", "GET", CMPL, None, {}, 405, None, "Method Not Allowed"),
    ("wrong method on health", "DELETE", "/health", None, {}, 405, None, ""),
    ("load an adapter without --allow-runtime-lora", "POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/nowhere"}, {},
     400, "lora_name", "--allow-runtime-lora"),
    ("an adapter's name without --enable-lora", "POST", CMPL, {"prompt": "x", "model": "sql-lora"}, {}, 404, "model", "sql-lora"),
    # the Responses API: OpenAI's error shape
    ("responses input missing", "POST", RESP, {"model": None}, {}, 400, "input", "required"),
    ("responses input wrong type", "POST", RESP, {"input": 5}, {}, 400, "input", "must be one of"),
    ("responses empty input", "POST", RESP, {"input": []}, {}, 400, "input", "empty"),
    ("responses unknown item type", "POST", RESP, {"input": [{"type": "image_generation_call"}]}, {}, 400, "input[0].type", "image_generation_call"),
    ("responses image part", "POST", RESP, {"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, {}, 400, "input[0].content[0]", "text"),
    ("responses role tool", "POST", RESP, {"input": [{"role": "tool", "content": "x"}]}, {}, 400, "input[0].role", "tool"),
    ("responses output without its call", "POST", RESP, {"input": [*USER, {"type": "function_call_output", "call_id": "call_9", "output": "3"}]},
     {}, 400, "input[1].call_id", "call_9"),
    ("responses call arguments not JSON", "POST", RESP, {"input": [*USER, {**CALL, "arguments": "{a"}]}, {}, 400, "input[1].arguments", "JSON"),
    ("responses call without call_id", "POST", RESP, {"input": [*USER, {**CALL, "call_id": None}]}, {}, 400, "input[1].call_id", "required"),
    ("responses unknown previous_response_id", "POST", RESP, {"input": "hi", "previous_response_id": "resp_nope"}, {}, 404,
     "previous_response_id", "resp_nope"),
    ("responses background", "POST", RESP, {"input": "hi", "background": True}, {}, 400, "background", "background"),
    ("responses n=2", "POST", RESP, {"input": "hi", "n": 2}, {}, 400, "n", ""),
    ("responses web search tool", "POST", RESP, {"input": "hi", "tools": [{"type": "web_search"}]}, {}, 400, "tools[0].type", "function"),
    ("responses tool without a name", "POST", RESP, {"input": "hi", "tools": [{"type": "function"}]}, {}, 400, "tools[0].name", ""),
    ("responses tool_choice names no tool", "POST", RESP, {"input": "hi", "tools": [ADD], "tool_choice": {"type": "function", "name": "zz"}},
     {}, 400, "tool_choice", "zz"),
    ("responses tool_choice chat-shaped", "POST", RESP, {"input": "hi", "tools": [ADD], "tool_choice": {"type": "allowed_tools"}},
     {}, 400, "tool_choice", ""),
    ("responses json_schema without schema", "POST", RESP, {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}},
     {}, 400, "text.format.schema", ""),
    ("responses unknown text format", "POST", RESP, {"input": "hi", "text": {"format": {"type": "yaml"}}}, {}, 400, "text.format.type", "yaml"),
    ("responses unknown include", "POST", RESP, {"input": "hi", "include": ["everything"]}, {}, 400, "include[0]", "everything"),
    ("responses top_logprobs 30", "POST", RESP, {"input": "hi", "top_logprobs": 30}, {}, 400, "top_logprobs", "20"),
    ("responses priority as a string", "POST", RESP, {"input": "hi", "priority": "high"}, {}, 400, "priority", ""),
    ("responses max_output_tokens over the context", "POST", RESP, {"input": "hi", "max_output_tokens": 5000}, {}, 400,
     "max_output_tokens", "1024"),
    ("responses unknown model", "POST", RESP, {"input": "hi", "model": "gpt-9"}, {}, 404, "model", "gpt-9"),
    ("get an unknown response", "GET", f"{RESP}/resp_nope", None, {}, 404, "response_id", "resp_nope"),
    ("delete an unknown response", "DELETE", f"{RESP}/resp_nope", None, {}, 404, "response_id", "resp_nope"),
    # the Messages API: Anthropic's error shape, its error.type in the param column
    ("messages without max_tokens", "POST", MSG, {"messages": USER}, {}, 400, "invalid_request_error", "max_tokens"),
    ("messages max_tokens 0", "POST", MSG, {"messages": USER, "max_tokens": 0}, {}, 400, "invalid_request_error", "max_tokens"),
    ("messages empty", "POST", MSG, {"messages": [], "max_tokens": 4}, {}, 400, "invalid_request_error", "empty"),
    ("messages system role", "POST", MSG, {"messages": [{"role": "system", "content": "x"}], "max_tokens": 4}, {}, 400,
     "invalid_request_error", "user or assistant"),
    ("messages image block", "POST", MSG, {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}], "max_tokens": 4},
     {}, 400, "invalid_request_error", "image"),
    ("messages tool_use in a user turn", "POST", MSG, {"messages": [{"role": "user", "content": [TOOL_USE]}], "max_tokens": 4},
     {}, 400, "invalid_request_error", "tool_use"),
    ("messages tool_result without its tool_use", "POST", MSG, {"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_9", "content": "3"}]}], "max_tokens": 4}, {}, 400, "invalid_request_error", "toolu_9"),
    ("messages tool_choice tool without a name", "POST", MSG, {"messages": USER, "max_tokens": 4, "tools": [
        {"name": "add", "input_schema": {"type": "object"}}], "tool_choice": {"type": "tool"}}, {}, 400, "invalid_request_error", "name"),
    ("messages tool without input_schema", "POST", MSG, {"messages": USER, "max_tokens": 4, "tools": [{"name": "add"}]}, {}, 400,
     "invalid_request_error", "input_schema"),
    ("messages priority as a string", "POST", MSG, {"messages": USER, "max_tokens": 4, "priority": "1"}, {}, 400, "invalid_request_error", "priority"),
    ("messages temperature -1", "POST", MSG, {"messages": USER, "max_tokens": 4, "temperature": -1}, {}, 400, "invalid_request_error", "temperature"),
    ("messages invalid JSON", "POST", MSG, b'{"messages": ', {}, 400, "invalid_request_error", "JSON"),
    ("messages unknown model", "POST", MSG, {"messages": USER, "max_tokens": 4, "model": "claude-9"}, {}, 404, "not_found_error", "claude-9"),
    ("messages bad x-api-key", "POST", MSG, {"messages": USER, "max_tokens": 4}, {"Authorization": "", "x-api-key": "wrong"}, 401,
     "authentication_error", "API key"),
    ("messages wrong method", "GET", MSG, None, {}, 405, "invalid_request_error", ""),
    ("count_tokens without messages", "POST", COUNT, {"model": None}, {}, 400, "invalid_request_error", "messages"),
]


def test_bad_requests_table(server):
    assert len(CASES) >= 25
    with httpx.Client(base_url=server.url, timeout=30, headers=AUTH) as client:
        for name, method, path, body, headers, status, param, part in CASES:
            kw = {"json": body} if isinstance(body, dict) else {} if body is None else {"content": body}
            r = client.request(method, path, headers=headers, **kw)
            assert r.status_code == status, (name, r.status_code, r.text[:300])
            if path.startswith(MSG):
                body = r.json()
                assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, (name, body)
                err = {**body["error"], "param": param}
                assert body["error"]["type"] == param, (name, body)
            else:
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"} and err["message"], name
            assert param is None or err["param"] == param, (name, err)
            assert part in err["message"], (name, err["message"])
            if status == 405:
                assert "allow" in r.headers, name
            if status == 401:
                assert r.headers.get("www-authenticate") == "Bearer", name
        assert client.get("/health", headers={"Authorization": ""}).status_code == 200  # no key needed
        r = client.post(CMPL, json={"prompt": "Hello", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        r = client.post(MSG, json={"messages": USER, "max_tokens": 4}, headers={"Authorization": "", "x-api-key": KEY})
        assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == 4  # Anthropic's header carries the key too
    assert server.stats().num_running == 0 and server.ctx.client.alive


def test_openai_client_sees_typed_errors(server):
    good = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=server.model, prompt="x", max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        good.chat.completions.create(model="nope", messages=USER, max_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        good.completions.create(model=server.model, prompt="x", temperature=-1)
    assert e.value.body["param"] == "temperature"
    assert good.completions.create(model=server.model, prompt="x", max_tokens=2).usage.completion_tokens == 2
