"""ServerContext: what every route needs (the engine client, the tokenizer, config, the response
cache), and the drain state."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from starlette.requests import Request

from llmserve.cache.response_cache import ResponseCache, ResponseCacheStats
from llmserve.cache.semantic_cache import SemanticCache
from llmserve.config import ServerConfig
from llmserve.engine.client import EngineClient, EngineStats, StepEvent
from llmserve.errors import InvalidRequestError
from llmserve.sampling import SamplingParams
from llmserve.server.errors import NotFoundError
from llmserve.server.live import LiveStats
from llmserve.server.protocol import renamed
from llmserve.server.response_store import ResponseStore
from llmserve.structured import COMPILE_TIMEOUT_S, GrammarCompiler
from llmserve.tokenizer import Tokenizer

if TYPE_CHECKING:
    from llmserve.lora.request import LoRARequest
    from llmserve.server.lora import LoRARegistry

logger = logging.getLogger("llmserve.server")


@dataclass(slots=True)
class ServerContext:
    client: EngineClient  # the one door to the engine (a core process, or Ray engine replicas)
    tokenizer: Tokenizer
    config: ServerConfig
    response_cache: ResponseCache | None = None  # None: --no-response-cache
    semantic_cache: SemanticCache | None = None  # --semantic-cache (its model loads at start-up)
    responses: ResponseStore | None = None  # stored /v1/responses (in process, or in Redis with --redis-url)
    loras: LoRARegistry | None = None  # the LoRA adapters a request may name in `model` (--enable-lora)
    live: LiveStats | None = None  # the dashboard's per-second figures (GET /stats/live)
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False  # set on SIGTERM: new requests get 503, in-flight ones finish
    loop: asyncio.AbstractEventLoop | None = None  # the server's loop, set at startup
    grammars: GrammarCompiler | None = None  # checks structured-output grammars (400 on a bad one)
    embedder: Any = None  # llmserve.embeddings.EmbeddingModel, loaded by the first request that embeds
    embedder_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # the engine's stats as of the last step event (the queue depth counted in the front end)
    stats: EngineStats = field(default_factory=EngineStats.idle)
    _deadline: asyncio.TimerHandle | None = field(default=None, init=False)  # aborts what is left

    @property
    def model_name(self) -> str:
        return self.client.info.model_name

    @property
    def max_model_len(self) -> int:
        return self.client.info.max_model_len

    def on_step(self, event: StepEvent) -> None:
        self.stats = event.stats

    @property
    def response_cache_stats(self) -> ResponseCacheStats:
        """hits, misses, errors, rejected, stored (all zero when the cache is off)."""
        return self.response_cache.stats if self.response_cache is not None else ResponseCacheStats()

    def check_model(self, name: str | None) -> LoRARequest | None:
        """`model` may be omitted; otherwise it must name the served model (None) or one of its
        LoRA adapters (the adapter's LoRARequest)."""
        if name is None or name == self.model_name:
            return None
        lora = self.loras.lookup(name) if self.loras is not None else None
        if lora is None:
            raise NotFoundError(f"the model `{name}` does not exist; this server serves `{self.model_name}`", "model", "model_not_found")
        return lora

    async def check_structured(self, params: SamplingParams, asked_by: str) -> None:
        """Compile the request's grammar once, off the event loop, within COMPILE_TIMEOUT_S; a
        400 naming `asked_by` when it does not compile in time or at all."""
        so = params.structured_outputs
        if so is None or self.grammars is None:
            return
        try:
            await asyncio.wait_for(asyncio.to_thread(self.grammars.check, so, asked_by), COMPILE_TIMEOUT_S)
        except TimeoutError:
            raise InvalidRequestError(f"{asked_by}: the grammar did not compile within {COMPILE_TIMEOUT_S:g} s", asked_by) from None
        except InvalidRequestError as e:
            raise renamed(e, asked_by) from None

    def begin_shutdown(self) -> None:
        """Any thread (a signal handler): refuse new requests, abort the rest after the grace period."""
        self.draining = True
        if self.loop is not None and self._deadline is None:
            self.loop.call_soon_threadsafe(self._arm_deadline)

    def _arm_deadline(self) -> None:
        if self._deadline is None:
            grace = max(0.0, self.config.shutdown_timeout)
            logger.info("shutting down: in-flight requests have %.1fs to finish", grace)
            self._deadline = self.loop.call_later(grace, self._abort_in_flight)  # type: ignore[union-attr]

    def _abort_in_flight(self) -> None:
        n = self.client.abort_all()
        if n:
            logger.info("grace period over: aborted %d request(s)", n)


def get_context(request: Request) -> ServerContext:
    return request.app.state.ctx


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
