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
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tiny_model):
    with live_server(tiny_model, api_key=KEY) as s:
        yield s


def chunks(total: int, size: int = 64 << 10):
    for _ in range(total // size):
        yield b" " * size


# (name, method, path, json body | raw bytes | None, extra headers, status, param, message part)
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
]


def test_bad_requests_table(server):
    assert len(CASES) >= 25
    with httpx.Client(base_url=server.url, timeout=30, headers=AUTH) as client:
        for name, method, path, body, headers, status, param, part in CASES:
            kw = {"json": body} if isinstance(body, dict) else {} if body is None else {"content": body}
            r = client.request(method, path, headers=headers, **kw)
            assert r.status_code == status, (name, r.status_code, r.text[:300])
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
