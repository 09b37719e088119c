"""The endpoints external routers probe, so that llmserve replicas can sit behind sglang-router
or vllm-router (SGLang's names and shapes):

  GET /get_model_info   {model_path, tokenizer_path, is_generation, served_model_name, ...}
  GET /get_server_info  the engine and server settings (secrets left out), dp_size, version and
                        internal_states (the engine's stats; one per replica under --ray)
  GET /get_load         [{dp_rank, num_reqs, num_waiting_reqs, num_tokens}], one per engine:
                        sglang-router's power_of_two policy sums num_tokens; ?format=object gives
                        {"load": num_reqs, ...} as vllm-router reads it
/model_info and /server_info are the newer names of the first two. Routers in cache_aware mode
need only /health and the generation routes; these let them label and weigh workers.
"""

from __future__ import annotations

import dataclasses
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from llmserve import __version__
from llmserve.engine.client import EngineStats
from llmserve.errors import InvalidRequestError
from llmserve.server.context import ServerContext, get_context

SECRETS = ("api_key",)  # settings never shown


async def model_info(request: Request) -> Response:
    ctx = get_context(request)
    info = ctx.client.info
    return JSONResponse({"model_path": info.model_dir, "tokenizer_path": info.model_dir, "is_generation": True,
                         "served_model_name": info.model_name, "preferred_sampling_params": None,
                         "weight_version": info.fingerprint, "max_model_len": info.max_model_len,
                         "vocab_size": info.vocab_size})


async def server_info(request: Request) -> Response:
    ctx = get_context(request)
    settings = {**dataclasses.asdict(ctx.client.config), **dataclasses.asdict(ctx.config)}
    settings = {k: v for k, v in settings.items() if k not in SECRETS}
    settings["redis_url"] = _without_password(settings.get("redis_url"))
    info = ctx.client.info
    return JSONResponse({
        **settings, "model_path": info.model_dir, "served_model_name": info.model_name, "dp_size": 1, "version": __version__,
        "max_total_num_tokens": info.num_kv_blocks * info.block_size, "max_running_requests": ctx.client.config.max_num_seqs,
        "max_prefill_tokens": ctx.client.config.max_num_batched_tokens, "max_model_len": info.max_model_len,
        "execution_plan": info.execution_plan,
        "internal_states": [dataclasses.asdict(s) for s in _engines(ctx)],
    })


async def get_load(request: Request) -> Response:
    ctx = get_context(request)
    fmt = request.query_params.get("format", "list")
    if fmt not in ("list", "object"):
        raise InvalidRequestError("format must be `list` (sglang-router) or `object` (vllm-router)", "format")
    loads = [_load(rank, s, ctx.client.info.block_size) for rank, s in enumerate(_engines(ctx))]
    if fmt == "list":
        return JSONResponse(loads)
    return JSONResponse({"load": sum(x["num_reqs"] for x in loads), "num_waiting_reqs": sum(x["num_waiting_reqs"] for x in loads),
                         "num_tokens": sum(x["num_tokens"] for x in loads)})


def _engines(ctx: ServerContext) -> list[EngineStats]:
    """One engine's stats, or each replica's (--ray); waiting counts what is on its way too."""
    replicas = ctx.client.replica_stats()
    if replicas:
        return [replicas[r] for r in sorted(replicas)]
    return [ctx.stats]


def _load(rank: int, s: EngineStats, block_size: int) -> dict:
    return {"dp_rank": rank, "num_reqs": s.num_running + s.num_waiting, "num_waiting_reqs": s.num_waiting,
            "num_tokens": s.num_blocks_used * block_size}


def _without_password(url: str | None) -> str | None:
    """`url` with its password masked: in the user info, or as a `password=` query parameter."""
    if not url:
        return url
    parts = urlsplit(url)
    netloc = parts.netloc
    if parts.password is not None:
        user, _, host = netloc.rpartition("@")
        netloc = f"{user.partition(':')[0]}:***@{host}"
    query = urlencode([(k, "***" if k.lower() == "password" else v) for k, v in parse_qsl(parts.query, keep_blank_values=True)],
                      safe="*")
    return urlunsplit(parts._replace(netloc=netloc, query=query))


routes = [
    *(Route(p, model_info, methods=["GET"]) for p in ("/get_model_info", "/model_info")),
    *(Route(p, server_info, methods=["GET"]) for p in ("/get_server_info", "/server_info")),
    Route("/get_load", get_load, methods=["GET"]),
]
