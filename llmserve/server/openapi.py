"""GET /openapi.json: the API described as OpenAPI 3.1, generated from the pydantic request
models in protocol.py, so the description cannot drift from what the server validates.

Every route is listed with its request body, its success media types (application/json, and
text/event-stream where "stream": true is allowed) and the error body of each 4xx/5xx it can
answer: OpenAI's shape, or Anthropic's on its routes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from llmserve import __version__
from llmserve.server import playground
from llmserve.server.context import get_context
from llmserve.server.lora import LoadLoRARequest, UnloadLoRARequest
from llmserve.server.messages_protocol import CountTokensRequest, MessagesRequest
from llmserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    GenerateRequest,
    TokenizeRequest,
)
from llmserve.server.responses_protocol import ResponsesRequest

REF = "#/components/schemas/{model}"
# no API key, served while draining (Prometheus scrapes, routers probe); the playground's page and
# assets too (the page asks for the key)
OPEN_PATHS = ("/health", "/metrics", "/openapi.json", "/get_load", *playground.OPEN_PATHS)
ERROR_STATUSES = {
    400: "Invalid request (the body names the bad parameter in error.param)",
    401: "Missing or wrong API key (with --api-key)",
    404: "Unknown model (or stored response)",
    413: "Body larger than --max-request-bytes",
    415: "Body is not JSON",
    429: "Server overloaded; retry after the Retry-After header",
    503: "Engine not running or shutting down, or a shared store it needs (Redis) did not answer",
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    type: str
    error: AnthropicErrorDetail


@dataclass(frozen=True, slots=True)
class Operation:
    path: str
    method: str
    summary: str
    body: type[BaseModel] | None = None
    streams: bool = False  # "stream": true answers text/event-stream
    success: str = "application/json"
    errors: tuple[int, ...] = (400, 401, 404, 413, 415, 429, 503)
    query: tuple[tuple[str, str], ...] = ()  # (name, JSON type) of optional query parameters
    error_body: type[BaseModel] = ErrorResponse


OPERATIONS = (
    Operation("/v1/completions", "post", "Text completion (OpenAI)", CompletionRequest, streams=True),
    Operation("/v1/chat/completions", "post", "Chat completion (OpenAI)", ChatCompletionRequest, streams=True),
    Operation("/v1/responses", "post", "Create a response (OpenAI Responses API)", ResponsesRequest, streams=True),
    Operation("/v1/responses/{response_id}", "get", "A stored response (OpenAI Responses API)", errors=(401, 404)),
    Operation("/v1/responses/{response_id}", "delete", "Delete a stored response (OpenAI Responses API)", errors=(401, 404)),
    Operation("/v1/messages", "post", "Create a message (Anthropic Messages API)", MessagesRequest, streams=True,
              error_body=AnthropicErrorResponse),
    Operation("/v1/messages/count_tokens", "post", "Count a message's input tokens (Anthropic Messages API)", CountTokensRequest,
              errors=(400, 401, 404, 413, 415), error_body=AnthropicErrorResponse),
    Operation("/v1/load_lora_adapter", "post", "Load a LoRA adapter (vLLM; with --enable-lora --allow-runtime-lora)", LoadLoRARequest,
              errors=(400, 401, 404, 413, 415)),
    Operation("/v1/unload_lora_adapter", "post", "Unload a LoRA adapter (vLLM; with --allow-runtime-lora)", UnloadLoRARequest,
              errors=(400, 401, 404, 413, 415)),
    Operation("/generate", "post", "Generate with per-token timings", GenerateRequest, streams=True),
    Operation("/v1/embeddings", "post", "Text embeddings with all-MiniLM-L6-v2 (OpenAI)", EmbeddingRequest, errors=(400, 401, 404, 413, 415)),
    Operation("/tokenize", "post", "Prompt or chat messages to token ids (vLLM)", TokenizeRequest, errors=(400, 401, 404, 413, 415)),
    Operation("/detokenize", "post", "Token ids to text (vLLM)", DetokenizeRequest, errors=(400, 401, 404, 413, 415)),
    Operation("/v1/models", "get", "The served model (OpenAI)", errors=(401,)),
    Operation("/v1/models/{model}", "get", "One model card (OpenAI)", errors=(401, 404)),
    Operation("/health", "get", "200 while the engine runs, 503 otherwise", success="", errors=(503,)),
    Operation("/metrics", "get", "Prometheus metrics", success="text/plain", errors=()),
    Operation("/stats", "get", "Engine, memory and cache figures as JSON", errors=(401,)),
    Operation("/openapi.json", "get", "This description", errors=()),
    *(Operation(p, "get", "The model, as sglang-router and vllm-router read it", errors=(401,)) for p in ("/get_model_info", "/model_info")),
    *(Operation(p, "get", "Engine and server settings and state, as sglang-router reads them", errors=(401,))
      for p in ("/get_server_info", "/server_info")),
    Operation("/get_load", "get", "Load per engine, as sglang-router (list) or vllm-router (object) reads it",
              errors=(400,), query=(("format", "string"),)),
    Operation("/stats/live", "get", "The dashboard's per-second figures", errors=(400, 401), query=(("since", "number"),)),
    *(Operation(p, "get", "The browser playground and dashboard (a page)", success="text/html", errors=()) for p in playground.PAGES),
    *(Operation(p, "get", "An asset of the playground", success=t, errors=()) for p, (_, t) in playground.ASSETS.items()),
)


def _operation(op: Operation) -> dict[str, Any]:
    doc: dict[str, Any] = {"summary": op.summary, "operationId": f"{op.method}_{re.sub('[{}]', '', op.path.strip('/').replace('/', '_'))}"}
    if op.body is not None:
        doc["requestBody"] = {"required": True, "content": {"application/json": {"schema": {"$ref": REF.format(model=op.body.__name__)}}}}
    if names := re.findall(r"{(\w+)}", op.path):
        doc["parameters"] = [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}} for name in names]
    if op.query:
        doc["parameters"] = [{"name": n, "in": "query", "required": False, "schema": {"type": t}} for n, t in op.query]
    ok: dict[str, Any] = {"description": "Success"}
    if op.success:
        ok["content"] = {op.success: {"schema": {"type": "object"} if op.success.endswith("json") else {"type": "string"}}}
    if op.streams:
        ok["content"]["text/event-stream"] = {"schema": {"type": "string", "description": "SSE: one `data: <json>` event per chunk (named by an `event:` line on the Responses and Messages routes)"}}
    error = {"application/json": {"schema": {"$ref": REF.format(model=op.error_body.__name__)}}}
    responses = {"200": ok} | {str(s): {"description": ERROR_STATUSES[s], "content": error} for s in op.errors}
    doc["responses"] = responses
    return doc


def build_openapi(title: str, secured: bool, pages: bool = True) -> dict[str, Any]:
    """The OpenAPI 3.1 document; `secured`: every route but /health, /metrics, the playground's
    and this one needs a bearer key; `pages`: the playground is served."""
    models = list(dict.fromkeys([op.body for op in OPERATIONS if op.body is not None] + [ErrorResponse, AnthropicErrorResponse]))
    _, defs = models_json_schema([(m, "validation") for m in models], ref_template=REF)
    paths: dict[str, dict[str, Any]] = {}
    for op in OPERATIONS:
        if not pages and op.path in playground.OPEN_PATHS:
            continue
        doc = _operation(op)
        if secured and op.path not in OPEN_PATHS:
            doc["security"] = [{"bearer": []}]
        paths.setdefault(op.path, {})[op.method] = doc
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": __version__},
        "paths": paths,
        "components": {"schemas": defs["$defs"], "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }


async def openapi_json(request: Request) -> Response:
    ctx = get_context(request)
    return JSONResponse(build_openapi(f"llmserve ({ctx.model_name})", bool(ctx.config.api_key), ctx.config.playground))


routes = [Route("/openapi.json", openapi_json, methods=["GET"])]
