"""The one mapping from typed errors to HTTP responses with an OpenAI-style body, or
Anthropic's on its routes (/v1/messages...).

OpenAI: {"error": {"message": str, "type": str, "param": str | null, "code": str | null}}.
Anthropic: {"type": "error", "error": {"type": str, "message": str}}, the same status codes.
Errors a client can cause are LLMServeError subclasses (llmserve/errors.py and the HTTP-level
ones below); anything else is a bug and becomes a 500 with a generic message (and a log line).
"""

from __future__ import annotations

import logging

from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from llmserve.errors import (
    EngineDeadError,
    EngineOverloadedError,
    InvalidRequestError,
    LLMServeError,
)

logger = logging.getLogger("llmserve.server")
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left; nobody receives it


class AuthenticationError(LLMServeError):
    status_code = 401
    error_type = "authentication_error"


class NotFoundError(LLMServeError):
    status_code = 404
    error_type = "not_found_error"


class MethodNotAllowedError(LLMServeError):
    status_code = 405
    error_type = "invalid_request_error"


class PayloadTooLargeError(InvalidRequestError):
    status_code = 413


class UnsupportedMediaTypeError(InvalidRequestError):
    status_code = 415


class ShuttingDownError(EngineDeadError):
    """SIGTERM was received: in-flight requests finish, new ones are refused."""


_HTTP_ERRORS: dict[int, type[LLMServeError]] = {
    404: NotFoundError,
    405: MethodNotAllowedError,
    413: PayloadTooLargeError,
    415: UnsupportedMediaTypeError,
}


ANTHROPIC_PATHS = "/v1/messages"  # routes whose errors take Anthropic's shape (a path prefix)
_ANTHROPIC_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                    429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}


def error_body(exc: LLMServeError) -> dict:
    return {"error": {"message": exc.message, "type": exc.error_type, "param": exc.param, "code": exc.code}}


def anthropic_error_body(exc: LLMServeError) -> dict:
    kind = _ANTHROPIC_TYPES.get(exc.status_code, "invalid_request_error" if exc.status_code < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": exc.message}}


def error_response(exc: LLMServeError, headers: dict[str, str] | None = None, path: str = "") -> JSONResponse:
    """`path`: the request's, which picks the body's shape."""
    headers = dict(headers or {})
    if isinstance(exc, EngineOverloadedError):
        headers["Retry-After"] = str(exc.retry_after_s)
    body = anthropic_error_body(exc) if path.startswith(ANTHROPIC_PATHS) else error_body(exc)
    return JSONResponse(body, status_code=exc.status_code, headers=headers)


async def _on_llmserve_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, LLMServeError)
    if isinstance(exc, EngineOverloadedError):
        request.app.state.metrics.on_rejected()
    return error_response(exc, path=request.url.path)


async def _on_http_exception(request: Request, exc: Exception) -> Response:
    # Starlette's router raises these for unknown routes (404) and wrong methods (405, with Allow).
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        err: LLMServeError = NotFoundError(f"no route {request.method} {request.url.path}", code="not_found")
    else:
        cls = _HTTP_ERRORS.get(exc.status_code, InvalidRequestError)
        err = cls(f"{request.method} {request.url.path}: {exc.detail}")
        err.status_code = exc.status_code
    return error_response(err, {k: v for k, v in (exc.headers or {}).items() if k.lower() == "allow"}, request.url.path)


async def _on_client_gone(request: Request, exc: Exception) -> Response:
    return Response(status_code=CLIENT_CLOSED_REQUEST)  # it left while sending its body


async def _on_unexpected(request: Request, exc: Exception) -> Response:
    logger.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    err = LLMServeError("internal server error", code="internal_error")
    return error_response(err, path=request.url.path)


EXCEPTION_HANDLERS = {
    LLMServeError: _on_llmserve_error,
    HTTPException: _on_http_exception,
    ClientDisconnect: _on_client_gone,
    Exception: _on_unexpected,
}
