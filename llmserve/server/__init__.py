"""HTTP server: OpenAI-compatible and native routes over the engine client (Starlette + uvicorn + SSE)."""

from llmserve.server.app import create_app, run_server

__all__ = ["create_app", "run_server"]
