"""Anthropic's Messages API: POST /v1/messages and POST /v1/messages/count_tokens.

A request becomes a chat turn (messages_protocol.py) and runs through chat_generation, as
/v1/chat/completions does. Its output becomes content blocks in order of appearance, `text` and
`tool_use`; MessageBuilder makes both the streamed events and the final message.

Streaming: named SSE events, as Anthropic sends them: message_start, ping, then per block
content_block_start, content_block_delta (text_delta or input_json_delta)..., content_block_stop,
and last message_delta (stop_reason, stop_sequence, usage) and message_stop. Errors, before or
during a stream, take Anthropic's shape ({"type": "error", "error": {"type", "message"}}).

stop_reason: "max_tokens" at the limit, "tool_use" when the output holds tool calls,
"stop_sequence" (with stop_sequence) when a stop string ended it, else "end_turn". usage:
input_tokens counts the prompt tokens not read from the prefix cache, cache_read_input_tokens
those that were.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from llmserve.errors import LLMServeError
from llmserve.server.chat import ChatTurn, OutputSplitter, chat_generation
from llmserve.server.context import ServerContext, get_context
from llmserve.server.errors import ShuttingDownError, anthropic_error_body
from llmserve.server.generation import Generation
from llmserve.server.messages_protocol import CountTokensRequest, MessagesRequest
from llmserve.server.protocol import read_json
from llmserve.server.streaming import Event, GenerationStream, dumps, unless_disconnected


async def create_message(request: Request) -> Response:
    arrival = time.time()
    ctx = get_context(request)
    body = MessagesRequest.parse(await read_json(request, ctx.config.max_request_bytes))
    return await unless_disconnected(request, _create(ctx, body, arrival))


async def _create(ctx: ServerContext, body: MessagesRequest, arrival: float) -> Response:
    lora = ctx.check_model(body.model)
    body.check()
    turn = body.turn()
    gen = await chat_generation(ctx, turn, body.sampling_fields(), body.max_tokens, None, f"msg_{uuid.uuid4().hex}", arrival, lora)
    builder = MessageBuilder(ctx, gen, body, turn)
    await gen.start()  # closes gen itself when it fails
    if body.stream:
        return GenerationStream(builder.stream(), gen, done_marker=False, error_event=_error_event)
    try:
        await gen.run()
    finally:
        gen.close()
    c = gen.choices[0]
    builder.feed(c.text, True)
    return JSONResponse(builder.message(final=True), headers=gen.headers)


def _error_event(e: LLMServeError) -> Event:
    return "error", dumps(anthropic_error_body(e))


async def count_tokens(request: Request) -> Response:
    ctx = get_context(request)
    body = CountTokensRequest.parse(await read_json(request, ctx.config.max_request_bytes))
    ctx.check_model(body.model)
    return JSONResponse({"input_tokens": len(body.turn().prompt_ids(ctx))})


class MessageBuilder:
    """Engine deltas -> content blocks and events; the message at any point."""

    def __init__(self, ctx: ServerContext, gen: Generation, body: MessagesRequest, turn: ChatTurn):
        self.ctx, self.gen, self.body = ctx, gen, body
        self.splitter = OutputSplitter(turn.plan)
        self.content: list[dict] = []
        self.open: dict | None = None  # the text block being written

    def _stop(self) -> tuple[str | None, str | None]:
        c = self.gen.choices[0]
        if c.finish_reason is None:
            return None, None
        if c.finish_reason == "abort":
            raise ShuttingDownError("the request was aborted before it finished (the server is shutting down)")
        if c.finish_reason == "length":
            return "max_tokens", None
        if self.splitter.called:
            return "tool_use", None
        if isinstance(c.stop_reason, str):
            return "stop_sequence", c.stop_reason
        return "end_turn", None

    def usage(self) -> dict:
        c, prompt = self.gen.choices[0], len(self.gen.prompts[0])
        cached = min(c.num_cached_tokens, prompt)
        return {"input_tokens": prompt - cached, "output_tokens": len(c.token_ids), "cache_read_input_tokens": cached,
                "cache_creation_input_tokens": 0}

    def message(self, final: bool) -> dict:
        stop_reason, stop_sequence = self._stop() if final else (None, None)
        msg = {"id": self.gen.request_id, "type": "message", "role": "assistant", "model": self.gen.model_name,
               "content": self.content if final else [], "stop_reason": stop_reason, "stop_sequence": stop_sequence,
               "usage": self.usage()}
        if final and self.body.return_token_ids:
            msg["prompt_token_ids"], msg["token_ids"] = self.gen.prompts[0], self.gen.choices[0].token_ids
        return msg

    def feed(self, text: str, final: bool) -> list[tuple[str, dict]]:
        events: list[tuple[str, dict]] = []
        for piece in self.splitter.feed(text, final):
            events += self._text(piece) if isinstance(piece, str) else self._tool_use(piece)
        if final:
            events += self._close()
        return events

    def _start(self, block: dict) -> tuple[str, dict]:
        self.content.append(block)
        shown = {**block, "text": ""} if block["type"] == "text" else {**block, "input": {}}
        return "content_block_start", {"type": "content_block_start", "index": len(self.content) - 1, "content_block": shown}

    def _close(self) -> list[tuple[str, dict]]:
        if self.open is None:
            return []
        self.open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": len(self.content) - 1})]

    def _text(self, text: str) -> list[tuple[str, dict]]:
        events = []
        if self.open is None:
            self.open = {"type": "text", "text": ""}
            events.append(self._start(self.open))
        self.open["text"] += text
        delta = {"type": "text_delta", "text": text}
        return events + [("content_block_delta", {"type": "content_block_delta", "index": len(self.content) - 1, "delta": delta})]

    def _tool_use(self, call: dict) -> list[tuple[str, dict]]:
        events = self._close()
        fn = call["function"]
        block = {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"), "name": fn["name"], "input": json.loads(fn["arguments"])}
        index = len(self.content)
        delta = {"type": "input_json_delta", "partial_json": fn["arguments"]}
        return events + [self._start(block),
                         ("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}),
                         ("content_block_stop", {"type": "content_block_stop", "index": index})]

    async def stream(self) -> AsyncIterator[Event]:
        yield "message_start", dumps({"type": "message_start", "message": self.message(final=False)})
        yield "ping", dumps({"type": "ping"})
        async for _, d in self.gen.events():
            for kind, payload in self.feed(d.text, d.finish_reason is not None):
                yield kind, dumps(payload)
        final = self.message(final=True)
        delta = {"stop_reason": final["stop_reason"], "stop_sequence": final["stop_sequence"]}
        yield "message_delta", dumps({"type": "message_delta", "delta": delta, "usage": final["usage"]})
        yield "message_stop", dumps({"type": "message_stop"})


routes = [
    Route("/v1/messages", create_message, methods=["POST"]),
    Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
]
