"""POST /v1/embeddings (OpenAI's shape) over llmserve.embeddings.EmbeddingModel.

The model loads on the first request (a few seconds; the ONNX export once per machine), off the
event loop, and every batch is embedded in a worker thread. It runs on one thread: the cores
belong to the engine.
"""

from __future__ import annotations

import asyncio
import base64

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from llmserve.embeddings import INSTALL_HINT, MODEL_NAME, EmbeddingModel, default_model_dir
from llmserve.errors import InvalidRequestError
from llmserve.server.context import ServerContext, get_context
from llmserve.server.errors import NotFoundError
from llmserve.server.protocol import EmbeddingRequest, read_json

MAX_INPUTS = 2048


def available() -> bool:
    return default_model_dir() is not None


async def embedding_model(ctx: ServerContext) -> EmbeddingModel:
    """The server's one embedding model (shared with the semantic cache), loaded once."""
    async with ctx.embedder_lock:
        if ctx.embedder is None:
            ctx.embedder = await asyncio.to_thread(EmbeddingModel, ctx.config.embedding_backend, None, 1)
        return ctx.embedder


def _texts(body: EmbeddingRequest) -> list[str]:
    texts = [body.input] if isinstance(body.input, str) else body.input
    if not texts:
        raise InvalidRequestError("input must not be empty", "input")
    if len(texts) > MAX_INPUTS:
        raise InvalidRequestError(f"input may hold at most {MAX_INPUTS} texts", "input")
    if not all(isinstance(t, str) for t in texts):
        raise InvalidRequestError("input must be text (a string or a list of strings); token ids are not supported", "input")
    if not all(texts):
        raise InvalidRequestError("input must not contain empty strings", "input")
    return texts  # type: ignore[return-value]


async def create_embeddings(request: Request) -> Response:
    ctx = get_context(request)
    body = EmbeddingRequest.parse(await read_json(request, ctx.config.max_request_bytes))
    if body.model is not None and body.model != MODEL_NAME:
        raise NotFoundError(f"the embedding model `{body.model}` does not exist; this server embeds with `{MODEL_NAME}`", "model", "model_not_found")
    if body.encoding_format not in ("float", "base64"):
        raise InvalidRequestError("encoding_format must be float or base64", "encoding_format")
    if body.dimensions is not None and body.dimensions != 384:
        raise InvalidRequestError(f"{MODEL_NAME} makes 384-dimensional embeddings; dimensions cannot change that", "dimensions")
    texts = _texts(body)
    if not available():
        raise NotFoundError(f"the embedding model is not installed on this server ({INSTALL_HINT})", "model", "model_not_found")
    model = await embedding_model(ctx)
    vectors, counts = await asyncio.to_thread(model.encode, texts)
    data = [
        {"object": "embedding", "index": i,
         "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode() if body.encoding_format == "base64" else v.tolist()}
        for i, v in enumerate(vectors)
    ]
    n = sum(counts)
    return JSONResponse({"object": "list", "data": data, "model": MODEL_NAME, "usage": {"prompt_tokens": n, "total_tokens": n}})


routes = [Route("/v1/embeddings", create_embeddings, methods=["POST"])]
