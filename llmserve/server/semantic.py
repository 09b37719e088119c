"""The semantic cache in the server: built from ServerConfig (make_semantic_cache), and what each
route hands it: the request's question and the rest of it that a hit must share (SemanticQuery),
or None where a semantic hit cannot stand in for a run (the cache is off, the prompt is not text,
the reply echoes or scores the prompt, the last chat turn is not the user's)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llmserve.cache.semantic_cache import (
    RedisSemanticFeed,
    SemanticCache,
    SemanticCacheStats,
    SemanticQuery,
    VectorIndex,
)
from llmserve.config import ServerConfig
from llmserve.embeddings import INSTALL_HINT
from llmserve.errors import InvalidRequestError, ModelLoadError
from llmserve.server.context import ServerContext
from llmserve.server.embeddings import available, embedding_model

EMBEDDING_DIM = 384
MAX_QUESTION_CHARS = 2000  # longer texts are documents, not questions asked again in other words


def make_semantic_cache(ctx: ServerContext, config: ServerConfig, redis_url: str | None, redis_timeout: float,
                        on_embedding: Callable[[float], None]) -> SemanticCache | None:
    """None unless --semantic-cache; a clear error when it cannot work. The embedding model is
    loaded by start_semantic_cache, at start-up."""
    if not config.semantic_cache:
        return None
    if ctx.response_cache is None:
        raise InvalidRequestError("--semantic-cache answers from the response cache: it needs the response cache on", "semantic_cache")
    if not 0.0 < config.semantic_threshold <= 1.0:
        raise InvalidRequestError("--semantic-threshold must be in (0, 1]", "semantic_threshold")
    if config.semantic_cache_size < 1:
        raise InvalidRequestError("--semantic-cache-size must be at least 1", "semantic_cache_size")
    if not available():
        raise ModelLoadError(f"--semantic-cache needs the embedding model: run `{INSTALL_HINT}`")
    stats = SemanticCacheStats()
    feed = RedisSemanticFeed(redis_url, stats, config.semantic_cache_size, redis_timeout) if redis_url else None
    index = VectorIndex(config.semantic_cache_size, EMBEDDING_DIM)

    def embed(texts: list[str]) -> Any:
        return ctx.embedder.encode(texts)[0]

    return SemanticCache(embed, config.semantic_threshold, config.response_cache_ttl, index, feed, on_embedding, stats)


async def start_semantic_cache(ctx: ServerContext) -> None:
    """At start-up, on the server's loop: load the embedding model, follow the shared entries."""
    if ctx.semantic_cache is not None:
        await embedding_model(ctx)
        ctx.semantic_cache.start()


def chat_question(ctx: ServerContext, messages: list[dict[str, str]], **template: Any) -> SemanticQuery | None:
    """messages: as given to the chat template (tools folded in); template: its other arguments."""
    if ctx.semantic_cache is None or messages[-1]["role"] != "user" or len(messages[-1]["content"]) > MAX_QUESTION_CHARS:
        return None
    return SemanticQuery(messages[-1]["content"], {"endpoint": "chat", "earlier": messages[:-1], **template})


def prompt_question(ctx: ServerContext, prompt: Any, **options: Any) -> SemanticQuery | None:
    """prompt: the request's prompt as sent (only a single string qualifies)."""
    if ctx.semantic_cache is None or not isinstance(prompt, str) or len(prompt) > MAX_QUESTION_CHARS:
        return None
    return SemanticQuery(prompt, {"endpoint": "text", **options})
