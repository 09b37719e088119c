"""GET /stats: the engine's and the caches' figures as JSON (read-only, behind the API
key like every route but /health), so a client can read a server in another process.

{"engine": EngineStats (kv_store: the Redis KV tier's blocks_read / blocks_written /
blocks_rejected / errors / dropped, {} without Redis; memory: the core process's rss_bytes and
glibc heap figures), "server": {"memory": the same figures for this process}, "response_cache":
{"enabled", "backend", "hits", "misses", "errors", "rejected", "stored"}, "semantic_cache":
{"enabled", "backend", "threshold", "entries", "hits", "misses", "errors", "rejected", "stored"}}
"""

from __future__ import annotations

import dataclasses
import math

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from llmserve.errors import InvalidRequestError
from llmserve.memory import memory_stats
from llmserve.profiling import STAGES
from llmserve.server.context import ServerContext, get_context


async def stats(request: Request) -> Response:
    ctx = get_context(request)
    # fresh from the core, which answers after every request sent before (one ordered pipe)
    engine = dataclasses.asdict(await ctx.client.get_stats())
    cache = ctx.response_cache
    response_cache = {
        "enabled": cache is not None,
        "backend": None if cache is None else "redis" if cache.redis is not None else "memory",
        **ctx.response_cache_stats.as_dict(),
    }
    body = {"engine": engine, "server": {"memory": memory_stats()}, "response_cache": response_cache,
            "semantic_cache": _semantic(ctx)}
    replicas = ctx.client.replica_stats()  # engine replicas (--ray); `engine` is their sum
    if replicas:
        body["replicas"] = {rid: dataclasses.asdict(s) for rid, s in sorted(replicas.items())}
    return JSONResponse(body)


def _semantic(ctx: ServerContext) -> dict:
    sc = ctx.semantic_cache
    if sc is None:
        return {"enabled": False}
    return {"enabled": True, "backend": "redis" if sc.feed is not None else "memory", "threshold": sc.threshold,
            "entries": len(sc.index), **sc.stats.as_dict()}


async def live(request: Request) -> Response:
    """GET /stats/live?since=UNIX_SECONDS: the dashboard's points (llmserve.server.live), one per
    second after `since` (default: the whole window)."""
    ctx = get_context(request)
    try:
        since = float(request.query_params.get("since", "0"))
    except ValueError:
        since = math.nan
    if not math.isfinite(since):
        raise InvalidRequestError("since must be a finite number (unix seconds)", "since")
    points = ctx.live.points(since, ctx.stats) if ctx.live is not None else []
    return JSONResponse({"stages": list(STAGES), "points": points})


routes = [Route("/stats", stats, methods=["GET"]), Route("/stats/live", live, methods=["GET"])]
