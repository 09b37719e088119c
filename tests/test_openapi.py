"""GET /openapi.json describes every route, and a schema fuzzer (schemathesis) sending valid and
invalid bodies to each one never gets a 5xx; every 4xx it gets has the route's error body
(OpenAI's, or Anthropic's on /v1/messages)."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.specs.openapi import checks
from server_harness import live_server

from llmserve.server.openapi import OPERATIONS, AnthropicErrorResponse

pytestmark = pytest.mark.timeout(600)

KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}
EXAMPLES_PER_ROUTE = 50


@pytest.fixture(scope="module")
def server(tiny_model):
    # max_model_len bounds what one fuzzed request may generate; max_waiting is high enough that
    # the fuzzer's requests, sent one at a time, are never refused for load
    with live_server(tiny_model, api_key=KEY, max_model_len=256) as s:
        yield s


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(server.url + "/openapi.json")


def test_openapi_lists_every_route(server):
    doc = httpx.get(server.url + "/openapi.json").json()  # no API key needed
    assert doc["openapi"].startswith("3.1")
    routes = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
    served = {(m, r.path.replace("{model:path}", "{model}")) for r in server.server.config.app.routes for m in (r.methods or ()) if m != "HEAD"}
    assert routes == served
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    assert set(chat["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert chat["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    assert "messages" in doc["components"]["schemas"]["ChatCompletionRequest"]["required"]
    assert chat["security"] == [{"bearer": []}]
    messages = doc["paths"]["/v1/messages"]["post"]
    assert messages["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/AnthropicErrorResponse")
    assert {"max_tokens", "messages"} <= set(doc["components"]["schemas"]["MessagesRequest"]["required"])
    assert doc["paths"]["/v1/responses/{response_id}"]["get"]["parameters"][0]["name"] == "response_id"


# every route with schema-valid inputs; routes with a body also with invalid ones
FUZZED = [(op, GenerationMode.POSITIVE) for op in OPERATIONS] + [(op, GenerationMode.NEGATIVE) for op in OPERATIONS if op.body]


@pytest.mark.parametrize(("op", "mode"), FUZZED, ids=[f"{op.method.upper()} {op.path} {mode.value}" for op, mode in FUZZED])
def test_fuzzed_requests_never_get_a_5xx(api_schema, op, mode):
    """EXAMPLES_PER_ROUTE requests per route and mode."""
    operation = api_schema[op.path][op.method.upper()]

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES_PER_ROUTE, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    def check(case):
        response = case.call(headers=AUTH, timeout=60)
        case.validate_response(response, checks=[checks.status_code_conformance, checks.content_type_conformance])
        assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
        if response.status_code >= 400 and op.error_body is AnthropicErrorResponse:
            body = response.json()
            assert body["type"] == "error" and set(body["error"]) == {"type", "message"} and body["error"]["message"], response.text[:500]
        elif response.status_code >= 400:
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"], response.text[:500]

    check()
