"""LoRA adapters as the API sees them: names a request can put in `model`, registered at start-up
(--lora-modules) or at run time (POST /v1/load_lora_adapter, /v1/unload_lora_adapter, behind
--allow-runtime-lora), and listed by /v1/models with their base as `parent` and their path as
`root`.

An adapter is read and checked here, off the event loop, before its name is taken (a 4xx naming
the field otherwise); the engine reads it again on first use. Each load gets a new lora_int_id
and its weights' content hash, so a name reloaded with other weights never meets the caches of
the earlier ones.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from llmserve.engine.client import EngineInfo
from llmserve.errors import InvalidRequestError
from llmserve.lora.adapter import load_adapter
from llmserve.lora.request import LoRARequest
from llmserve.server.context import get_context
from llmserve.server.errors import NotFoundError
from llmserve.server.protocol import _Model, read_json


@dataclass(slots=True)
class ServedAdapter:
    request: LoRARequest
    parent: str  # the base model's name
    created: int


class LoRARegistry:
    def __init__(self, info: EngineInfo):
        self.info = info
        self.adapters: dict[str, ServedAdapter] = {}
        self._ids = itertools.count(1)

    def check(self, name: str, path: str, base_model_name: str | None = None) -> ServedAdapter:
        """Read and check an adapter (blocking: run it off the loop); not registered yet."""
        if not self.info.max_loras:
            raise InvalidRequestError("LoRA adapters need the server started with --enable-lora", "lora_name")
        if not name or name == self.info.model_name:
            raise InvalidRequestError(f"{name!r} cannot name an adapter: it is empty or the base model's name", "lora_name")
        if base_model_name is not None and base_model_name != self.info.model_name:
            raise InvalidRequestError(f"base_model_name {base_model_name!r} is not the served model {self.info.model_name!r}",
                                      "base_model_name")
        adapter = load_adapter(name, path, self.info.lora_base, self.info.max_lora_rank)  # type: ignore[arg-type]
        return ServedAdapter(LoRARequest(name, next(self._ids), path, adapter.content_hash), self.info.model_name, int(time.time()))

    def check_free(self, name: str) -> None:
        if name in self.adapters:
            raise InvalidRequestError(f"a LoRA adapter named {name!r} is already loaded; unload it first", "lora_name")

    def add(self, served: ServedAdapter) -> None:
        self.check_free(served.request.lora_name)
        self.adapters[served.request.lora_name] = served

    def remove(self, name: str) -> None:
        if self.adapters.pop(name, None) is None:
            raise NotFoundError(f"no LoRA adapter named {name!r} is loaded", "lora_name", "lora_not_found")

    def lookup(self, name: str) -> LoRARequest | None:
        served = self.adapters.get(name)
        return served.request if served is not None else None


def parse_module(spec: str) -> tuple[str, str, str | None]:
    """--lora-modules entry: name=path, or JSON {"name", "path", "base_model_name"}."""
    if spec.lstrip().startswith("{"):
        try:
            d = json.loads(spec)
            return d["name"], d["path"], d.get("base_model_name")
        except (ValueError, KeyError, TypeError, AttributeError):
            raise InvalidRequestError(f"--lora-modules {spec!r}: JSON needs \"name\" and \"path\"", "lora_modules") from None
    name, eq, path = spec.partition("=")
    if not eq or not name or not path:
        raise InvalidRequestError(f"--lora-modules {spec!r}: expected name=path", "lora_modules")
    return name, path, None


class LoadLoRARequest(_Model):
    lora_name: str
    lora_path: str


class UnloadLoRARequest(_Model):
    lora_name: str


def _runtime_registry(request: Request) -> LoRARegistry:
    ctx = get_context(request)
    if not ctx.config.allow_runtime_lora:
        raise InvalidRequestError("loading adapters at run time is off; start the server with --allow-runtime-lora", "lora_name")
    return ctx.loras  # type: ignore[return-value]


async def load_lora_adapter(request: Request) -> Response:
    registry = _runtime_registry(request)
    body = LoadLoRARequest.parse(await read_json(request, get_context(request).config.max_request_bytes))
    registry.check_free(body.lora_name)  # before reading anything
    served = await asyncio.to_thread(registry.check, body.lora_name, body.lora_path)
    registry.add(served)
    return JSONResponse({"lora_name": body.lora_name, "lora_int_id": served.request.lora_int_id, "status": "loaded"})


async def unload_lora_adapter(request: Request) -> Response:
    registry = _runtime_registry(request)
    body = UnloadLoRARequest.parse(await read_json(request, get_context(request).config.max_request_bytes))
    registry.remove(body.lora_name)
    return JSONResponse({"lora_name": body.lora_name, "status": "unloaded"})


routes = [
    Route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"]),
    Route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"]),
]
