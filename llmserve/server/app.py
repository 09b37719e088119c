"""The Starlette app over one AsyncEngine, and `llmserve serve`: uvicorn with a graceful SIGTERM.

Shutdown (SIGTERM or Ctrl-C): the listening socket closes and new requests get 503; in-flight
requests run on for --shutdown-timeout seconds, then the rest are aborted, so every stream still
ends with a finish_reason ("abort") and [DONE]; then the engine thread stops and the process
exits 0. A second Ctrl-C exits at once.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import FrameType

import uvicorn
from sse_starlette.sse import AppStatus
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from llmserve.cache.response_cache import make_response_cache
from llmserve.config import EngineConfig, ServerConfig
from llmserve.engine.async_engine import AsyncEngine
from llmserve.engine.engine_core import LLMEngine
from llmserve.errors import EngineDeadError, LLMServeError
from llmserve.server import native, openai, stats
from llmserve.server.context import ServerContext, get_context
from llmserve.server.errors import (
    EXCEPTION_HANDLERS,
    AuthenticationError,
    ShuttingDownError,
    error_response,
)
from llmserve.server.metrics import ServerMetrics

logger = logging.getLogger("llmserve.server")
OPEN_PATHS = ("/health", "/metrics")  # no API key, served while draining (Prometheus scrapes)


class Gate:
    """ASGI middleware: the API key (--api-key) and the drain (503 once shutdown began)."""

    def __init__(self, app: ASGIApp, ctx: ServerContext):
        self.app = app
        self.ctx = ctx

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            err = self._refusal(Headers(scope=scope))
            if err is not None:
                headers = {"WWW-Authenticate": "Bearer"} if isinstance(err, AuthenticationError) else None
                await error_response(err, headers)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, headers: Headers) -> LLMServeError | None:
        key = self.ctx.config.api_key
        if key:
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
                return AuthenticationError("invalid or missing API key; send Authorization: Bearer <key>", code="invalid_api_key")
        if self.ctx.draining:
            return ShuttingDownError("the server is shutting down", code="shutting_down")
        return None


async def health(request: Request) -> Response:
    """200 while the engine thread runs; 503 (with an error body) once it died or shutdown began."""
    ctx = get_context(request)
    if not ctx.async_engine.alive:
        return error_response(EngineDeadError(f"the engine is not running: {ctx.async_engine.error!r}", code="engine_dead"))
    if ctx.draining:
        return error_response(ShuttingDownError("the server is shutting down", code="shutting_down"))
    return Response(status_code=200)


def create_app(engine: LLMEngine, config: ServerConfig) -> Starlette:
    """The app over `engine`; its lifespan starts and stops the engine thread.
    app.state.ctx (ServerContext) holds the engine, the AsyncEngine, the config and the response
    cache (in process, or in Redis when the engine has a --redis-url)."""
    cache = make_response_cache(config.response_cache, config.response_cache_ttl, config.response_cache_bytes,
                                engine.config.redis_url, engine.config.redis_timeout)
    ctx = ServerContext(engine, AsyncEngine(engine, config.max_waiting, config.max_waiting_tokens), config, cache)
    metrics = ServerMetrics()
    metrics.attach(ctx.async_engine)  # a step listener, registered before the engine thread starts

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        ctx.loop = asyncio.get_running_loop()
        ctx.async_engine.start()
        logger.info("serving %s (context %d tokens)", ctx.model_name, ctx.max_model_len)
        try:
            yield
        finally:
            ctx.async_engine.abort_all()
            ctx.async_engine.stop()
            await asyncio.to_thread(ctx.async_engine.join, 10.0)
            if ctx.response_cache is not None:
                await ctx.response_cache.close()

    app = Starlette(
        routes=[Route("/health", health, methods=["GET"]), metrics.route(), *native.routes, *openai.routes, *stats.routes],
        middleware=[Middleware(Gate, ctx=ctx)],
        exception_handlers=EXCEPTION_HANDLERS,  # type: ignore[arg-type]
        lifespan=lifespan,
    )
    app.state.ctx = ctx
    app.state.metrics = metrics
    return app


class GracefulServer(uvicorn.Server):
    """uvicorn, but a signal starts our drain, and the process is not re-killed by the signal
    after a clean shutdown (uvicorn re-raises it, which would make the exit status 143)."""

    def __init__(self, config: uvicorn.Config, ctx: ServerContext):
        super().__init__(config)
        self.ctx = ctx

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True
        self.ctx.begin_shutdown()


def run_server(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    """`llmserve serve`: load the model, serve until SIGTERM/SIGINT, drain; the exit code."""
    # Streams end through our drain (abort -> final chunk -> [DONE]), not sse-starlette's own
    # cancel-on-shutdown, which would cut them without a finish_reason.
    AppStatus.disable_automatic_graceful_drain()
    engine = LLMEngine(engine_config)
    app = create_app(engine, server_config)
    ctx: ServerContext = app.state.ctx
    config = uvicorn.Config(
        app,
        host=server_config.host,
        port=server_config.port,
        log_level=server_config.log_level,
        # a backstop only: our drain aborts what is left at shutdown_timeout
        timeout_graceful_shutdown=max(0.0, server_config.shutdown_timeout) + 10,
        lifespan="on",
    )
    server = GracefulServer(config, ctx)
    server.run()
    if not server.started:
        return 1
    return 1 if ctx.async_engine.error is not None else 0
