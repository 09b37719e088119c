"""Transport helpers: SSE responses that own a Generation, JSON encoding, and cancellation of
work whose client has gone away.

Cancellation paths (each ends in Generation.close(), which aborts unfinished engine requests):
- before the response starts (queueing, prefill, any non-streaming request): `unless_disconnected`
  races the handler against the client's http.disconnect and cancels the handler;
- mid-stream: sse-starlette notices the disconnect (or a failed send) and stops iterating;
  GenerationStream closes its Generation however the response ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import msgspec
from sse_starlette.sse import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Message, Receive, Scope, Send

from llmserve.errors import LLMServeError
from llmserve.server.errors import CLIENT_CLOSED_REQUEST, error_body
from llmserve.server.generation import CACHE_HEADER, Generation

__all__ = ["CACHE_HEADER", "Event", "GenerationStream", "dumps", "json_response", "unless_disconnected"]


_json = msgspec.json.Encoder()
Event = bytes | tuple[str, bytes]  # one SSE event: its JSON (a `data:` line), or (name, JSON) with an `event:` line too


def dumps(obj: Any) -> bytes:
    """Compact UTF-8 JSON (msgspec: several times json.dumps' speed on the per-token path)."""
    return _json.encode(obj)


def json_response(body: dict, gen: Generation) -> JSONResponse:
    """A whole (non-streaming) response, marked with the response cache's verdict."""
    return JSONResponse(body, headers=gen.headers)


class GenerationStream(EventSourceResponse):
    """SSE over a started Generation; closes it when the response ends. Its headers carry the
    response cache's verdict (x-llmserve-cache: hit | miss). Events are framed here, as bytes,
    which sse-starlette sends as they are. An error after the headers went out becomes the
    route's error event (`error_event`; OpenAI's error body by default); OpenAI's chat and
    completion streams end with `data: [DONE]` (done_marker)."""

    def __init__(self, events: AsyncIterator[Event], gen: Generation, done_marker: bool, headers: dict[str, str] | None = None,
                 error_event: Callable[[LLMServeError], Event] = lambda e: dumps(error_body(e))):
        super().__init__(_guard(events, done_marker, error_event), headers={**gen.headers, **(headers or {})}, sep="\n")
        self.generation = gen

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.generation.close()

    async def _send_with_timeout(self, send: Send, message: Message) -> None:
        """sse-starlette's per-send wrapper opens an anyio cancel scope around every event even
        with no send_timeout (about a tenth of the server's time per token); without a timeout
        the event goes straight to `send`, and a send that fails is still marked interrupted (its
        shutdown path sends nothing more then)."""
        if self.send_timeout is not None:
            return await super()._send_with_timeout(send, message)
        try:
            await send(message)
        except BaseException:
            self._send_interrupted = True
            raise


def _frame(event: Event) -> bytes:
    if isinstance(event, bytes):
        return b"data: " + event + b"\n\n"
    name, payload = event
    return b"event: " + name.encode() + b"\ndata: " + payload + b"\n\n"


async def _guard(events: AsyncIterator[Event], done_marker: bool, error_event: Callable[[LLMServeError], Event]) -> AsyncIterator[bytes]:
    try:
        async for event in events:
            yield _frame(event)
    except LLMServeError as e:
        yield _frame(error_event(e))
    if done_marker:
        yield _frame(b"[DONE]")


async def unless_disconnected(request: Request, work: Coroutine[Any, Any, Response]) -> Response:
    """Run a handler (its body already read) unless the client disconnects first; then cancel it."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()  # its finally blocks close the Generation, aborting engine requests
    if task.done() and not task.cancelled():
        return task.result()
    return Response(status_code=CLIENT_CLOSED_REQUEST)


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
