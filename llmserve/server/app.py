"""The Starlette app over one engine door (EngineCoreClient, or RayEngineClient under `--ray`), and `llmserve serve`: the engine core in its own
process, uvicorn in this one, with a graceful SIGTERM.

Shutdown (SIGTERM or Ctrl-C): the listening socket closes and new requests get 503; in-flight
requests run on for --shutdown-timeout seconds, then the rest are aborted, so every stream still
ends with a finish_reason ("abort") and [DONE]; then the core process stops and the server
exits 0. A second Ctrl-C exits at once.

Death of the core process: every in-flight stream ends with an error event (then [DONE]),
every waiting non-streaming request with a 503 error body, /health answers 503 and new requests
503; DEATH_LINGER_S later the server exits 1, so that a supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
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
from llmserve.engine.client import EngineClient, EngineCoreClient, EngineInfo, EngineStats
from llmserve.errors import EngineDeadError, InvalidRequestError, LLMServeError
from llmserve.server import (
    embeddings,
    lora,
    messages,
    native,
    openai,
    openapi,
    playground,
    responses,
    router_probe,
    stats,
)
from llmserve.server.context import ServerContext, get_context
from llmserve.server.errors import (
    EXCEPTION_HANDLERS,
    AuthenticationError,
    ShuttingDownError,
    error_response,
)
from llmserve.server.live import LiveStats
from llmserve.server.lora import LoRARegistry, parse_module
from llmserve.server.metrics import ServerMetrics
from llmserve.server.response_store import make_response_store
from llmserve.server.semantic import make_semantic_cache, start_semantic_cache
from llmserve.structured import GrammarCompiler
from llmserve.tokenizer import Tokenizer

logger = logging.getLogger("llmserve.server")
DEATH_LINGER_S = 1.0  # after the core dies: time for error bodies to flush and /health to say 503


class Gate:
    """ASGI middleware: the API key (--api-key; as `Authorization: Bearer KEY`, or as Anthropic's
    clients send it, `x-api-key: KEY`) and the drain (503 once shutdown began)."""

    def __init__(self, app: ASGIApp, ctx: ServerContext):
        self.app = app
        self.ctx = ctx

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in openapi.OPEN_PATHS:
            err = self._refusal(Headers(scope=scope))
            if err is not None:
                headers = {"WWW-Authenticate": "Bearer"} if isinstance(err, AuthenticationError) else None
                await error_response(err, headers, scope["path"])(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, headers: Headers) -> LLMServeError | None:
        key = self.ctx.config.api_key
        if key and not _has_key(headers, key):
            return AuthenticationError("invalid or missing API key; send Authorization: Bearer <key> (or x-api-key: <key>)", code="invalid_api_key")
        if self.ctx.draining:
            return ShuttingDownError("the server is shutting down", code="shutting_down")
        return None


def _has_key(headers: Headers, key: str) -> bool:
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode()):
        return True
    return hmac.compare_digest(headers.get("x-api-key", "").strip().encode(), key.encode())


async def health(request: Request) -> Response:
    """200 while the engine core runs; 503 (with an error body) once it died or shutdown began."""
    ctx = get_context(request)
    if not ctx.client.alive:
        why = ctx.client.error.message if ctx.client.error else "it has stopped"
        return error_response(EngineDeadError(f"the engine is not running: {why}", code="engine_dead"))
    if ctx.draining:
        return error_response(ShuttingDownError("the server is shutting down", code="shutting_down"))
    return Response(status_code=200)


def create_app(client: EngineClient, config: ServerConfig) -> Starlette:
    """The app over the engine behind `client` (launched, not yet started; a local core process or
    Ray engine replicas); its lifespan attaches the client to the loop and stops it at the end.
    app.state.ctx (ServerContext) holds the client, the tokenizer, the config, the response cache
    (in process, or in Redis when the engine has a --redis-url) and the semantic cache in front of
    it (--semantic-cache; its entries shared through the same Redis)."""
    engine_config = client.config
    cache = make_response_cache(config.response_cache, config.response_cache_ttl, config.response_cache_bytes,
                                engine_config.redis_url, engine_config.redis_timeout)
    tokenizer = Tokenizer(Path(client.info.model_dir))
    ctx = ServerContext(client, tokenizer, config, cache)
    ctx.responses = make_response_store(config.response_cache_ttl, config.response_store_size, config.response_store_bytes,
                                        engine_config.redis_url, engine_config.redis_timeout)
    ctx.grammars = GrammarCompiler(tokenizer.fast.to_str(), client.info.vocab_size, client.info.eos_token_ids)
    ctx.loras = served_adapters(client.info, config)
    metrics = ServerMetrics()
    ctx.semantic_cache = make_semantic_cache(ctx, config, engine_config.redis_url, engine_config.redis_timeout, metrics.embedding.observe)
    ctx.stats = EngineStats.idle(client.info.num_kv_blocks)
    client.add_step_listener(ctx.on_step)
    metrics.attach(client, lambda: ctx.stats, lambda: ctx.response_cache_stats, ctx.semantic_cache and (lambda: ctx.semantic_cache.stats))
    ctx.live = LiveStats(lambda: ctx.stats, lambda: ctx.response_cache_stats)
    client.add_step_listener(ctx.live.on_step)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        ctx.loop = asyncio.get_running_loop()
        await client.start()
        try:
            await start_semantic_cache(ctx)
            logger.info("serving %s (context %d tokens)", ctx.model_name, ctx.max_model_len)
            yield
        finally:
            client.abort_all()
            await client.shutdown()
            for cache in (ctx.response_cache, ctx.semantic_cache, ctx.responses):
                if cache is not None:
                    await cache.close()

    pages = playground.routes if config.playground else []
    app = Starlette(
        routes=[Route("/health", health, methods=["GET"]), metrics.route(), *native.routes, *openai.routes, *responses.routes,
                *messages.routes, *lora.routes, *embeddings.routes,
                *stats.routes, *router_probe.routes, *openapi.routes, *pages],
        middleware=[Middleware(Gate, ctx=ctx)],
        exception_handlers=EXCEPTION_HANDLERS,  # type: ignore[arg-type]
        lifespan=lifespan,
    )
    app.state.ctx = ctx
    app.state.metrics = metrics
    return app


def served_adapters(info: EngineInfo, config: ServerConfig) -> LoRARegistry:
    """The registry of LoRA adapters, with --lora-modules read and checked (a typed error, which
    stops the start, for one that cannot be served)."""
    registry = LoRARegistry(info)
    if config.lora_modules and not info.max_loras:
        raise InvalidRequestError("--lora-modules needs --enable-lora", "lora_modules")
    for spec in config.lora_modules or []:
        served = registry.check(*parse_module(spec))
        registry.add(served)
        logger.info("LoRA adapter %s (rank up to %d) from %s", served.request.lora_name, info.max_lora_rank, served.request.lora_path)
    return registry


class GracefulServer(uvicorn.Server):
    """uvicorn, but a signal starts our drain, the process is not re-killed by the signal after a
    clean shutdown (uvicorn re-raises it, which would make the exit status 143), and the death of
    the engine core stops the server DEATH_LINGER_S later."""

    def __init__(self, config: uvicorn.Config, ctx: ServerContext):
        super().__init__(config)
        self.ctx = ctx
        self.engine_dead_since: float | None = None

    async def on_tick(self, counter: int) -> bool:
        if self.ctx.client.error is not None:
            now = time.monotonic()
            self.engine_dead_since = self.engine_dead_since or now
            if now - self.engine_dead_since >= DEATH_LINGER_S and not self.should_exit:
                logger.error("the engine core is gone: the server stops")
                self.should_exit = True
        return await super().on_tick(counter)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True
        self.ctx.begin_shutdown()


def run_server(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    """`llmserve serve`: start the engine core, serve until SIGTERM/SIGINT (or the core's death),
    drain; the exit code (1 when the core died)."""
    # Streams end through our drain (abort -> final chunk -> [DONE]), not sse-starlette's own
    # cancel-on-shutdown, which would cut them without a finish_reason.
    AppStatus.disable_automatic_graceful_drain()
    client = EngineCoreClient.launch(engine_config, server_config.log_level, server_config.max_waiting, server_config.max_waiting_tokens)
    try:
        app = create_app(client, server_config)
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
    finally:
        client.close()
    if not server.started:
        return 1
    return 1 if client.error is not None else 0
