"""Optional features and the extras that install them. `pip install llmserve` gives the server
and the engine; each of these needs its extra:
  embeddings  onnxruntime, onnx: /v1/embeddings and the semantic cache run in ONNX Runtime
              (without them, in torch, several times slower)
  bench       aiohttp, matplotlib: `llmserve bench serve` and its --plot
  ray         ray[serve]: `llmserve serve --ray`
A feature whose extra is missing says so in one line that names it."""

from __future__ import annotations

import importlib
from types import ModuleType

from llmserve.errors import LLMServeError


class MissingExtraError(LLMServeError):
    status_code = 501
    error_type = "not_implemented"


def install_hint(extra: str) -> str:
    return f"pip install 'llmserve[{extra}]'"


def require(module: str, extra: str, feature: str) -> ModuleType:
    """`module`, imported; MissingExtraError naming the extra when it is not installed."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingExtraError(f"{feature} needs {module}, which is not installed: {install_hint(extra)}") from e
