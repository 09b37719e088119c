"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}.

A request becomes a chat turn (responses_protocol.py) and runs through chat_generation, as
/v1/chat/completions does. Its output becomes items in order of appearance: `message` items
(one `output_text` part each) and `function_call` items; ResponseBuilder makes both the
streamed events and the final response object, so the two cannot disagree.

Streaming: named SSE events (`event: <type>` and `data: {"type", "sequence_number", ...}`):
response.created, response.in_progress, then per item output_item.added, (content_part.added,
output_text.delta..., output_text.done, content_part.done) or (function_call_arguments.delta,
function_call_arguments.done), output_item.done, and last response.completed, which carries
the whole response; its status is "incomplete" (incomplete_details.reason "max_output_tokens")
when the output hit the limit, as vLLM sends it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from llmserve.errors import InvalidRequestError, LLMServeError
from llmserve.server.chat import ChatTurn, OutputSplitter, chat_generation
from llmserve.server.context import ServerContext, get_context
from llmserve.server.errors import NotFoundError
from llmserve.server.generation import Generation
from llmserve.server.logprobs import TokenNamer, chat_logprobs
from llmserve.server.protocol import read_json
from llmserve.server.response_store import StoredResponse
from llmserve.server.responses_protocol import ResponsesRequest, chat_history
from llmserve.server.streaming import Event, GenerationStream, dumps, unless_disconnected


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


async def create_response(request: Request) -> Response:
    arrival = time.time()
    ctx = get_context(request)
    body = ResponsesRequest.parse(await read_json(request, ctx.config.max_request_bytes))
    return await unless_disconnected(request, _create(ctx, body, arrival))


async def _earlier(ctx: ServerContext, body: ResponsesRequest) -> list[dict[str, Any]]:
    """The stored conversation that previous_response_id continues (404 when it is not stored)."""
    if body.previous_response_id is None:
        return []
    stored = await ctx.responses.get(body.previous_response_id)  # type: ignore[union-attr]
    if stored is None:
        raise NotFoundError(f"no stored response with id {body.previous_response_id!r}", "previous_response_id", "response_not_found")
    return stored.conversation


async def _create(ctx: ServerContext, body: ResponsesRequest, arrival: float) -> Response:
    lora = ctx.check_model(body.model)
    body.check()
    earlier, items = await _earlier(ctx, body), body.items()
    turn = ChatTurn(chat_history(body.instructions, earlier + items, len(earlier)), body.tool_plan())
    try:
        gen = await chat_generation(ctx, turn, body, body.max_output_tokens, body.logprobs, _id("resp"), arrival, lora)
    except InvalidRequestError as e:
        if e.param == "max_tokens":  # checked under the engine's name
            e.param, e.message = "max_output_tokens", e.message.replace("max_tokens", "max_output_tokens")
        raise
    builder = ResponseBuilder(ctx, gen, body, turn, earlier + items)
    await gen.start()  # closes gen itself when it fails
    if body.stream:
        return GenerationStream(builder.stream(), gen, done_marker=False, error_event=builder.error_event)
    try:
        await gen.run()
    finally:
        gen.close()
    for _ in builder.feed_all():
        pass
    return JSONResponse(await builder.finish(), headers=gen.headers)


class ResponseBuilder:
    """Engine deltas -> output items and events; the response object at any point."""

    def __init__(self, ctx: ServerContext, gen: Generation, body: ResponsesRequest, turn: ChatTurn, conversation: list[dict]):
        self.ctx, self.gen, self.body, self.conversation = ctx, gen, body, conversation
        self.created_at = int(time.time())
        self.splitter = OutputSplitter(turn.plan)
        self.name = TokenNamer(ctx.tokenizer, body.return_tokens_as_token_ids)
        self.output: list[dict] = []  # items in order; the last is open while it is a message being written
        self.open: dict | None = None  # the message item text is going to
        self.pending_logprobs: list[dict] = []  # of tokens whose text is held back (a possible tool call)
        self.sequence = 0

    # ---- the response object

    def response(self, status: str) -> dict:
        body = self.body
        choice = self.gen.choices[0]
        usage = self.gen.usage()
        obj = {
            "id": self.gen.request_id, "object": "response", "created_at": self.created_at, "status": status,
            "error": None, "incomplete_details": None, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "model": self.gen.model_name, "output": self.output,
            "parallel_tool_calls": body.parallel_tool_calls, "previous_response_id": body.previous_response_id,
            "reasoning": None, "store": body.store, "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": {"format": (body.text.format.model_dump(exclude_none=True, by_alias=True) if body.text and body.text.format
                                else {"type": "text"})},
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto", "tools": body.tools or [],
            "top_p": 1.0 if body.top_p is None else body.top_p, "truncation": "disabled", "user": body.user,
            "metadata": body.metadata or {}, "background": False,
            "usage": None if status == "in_progress" else {
                "input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
                "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage["total_tokens"]},
        }
        if status == "incomplete":
            obj["incomplete_details"] = {"reason": "max_output_tokens"}
        if body.return_token_ids and status != "in_progress":
            obj["prompt_token_ids"], obj["token_ids"] = self.gen.prompts[0], choice.token_ids
        return obj

    def _status(self) -> str:
        reason = self.gen.choices[0].finish_reason
        return {"length": "incomplete", "abort": "cancelled"}.get(reason or "", "completed")

    async def finish(self) -> dict:
        """The final response object, stored when asked (before anyone is told it exists)."""
        obj = self.response(self._status())
        if self.body.store and obj["status"] != "cancelled":
            record = StoredResponse(obj, self.conversation + [_as_input(item) for item in self.output])
            if not await self.ctx.responses.put(obj["id"], record):  # type: ignore[union-attr]
                obj["store"] = False  # too large to keep, or Redis failed: say so rather than 404 later
        return obj

    # ---- events

    def _event(self, kind: str, **fields: Any) -> tuple[str, dict]:
        self.sequence += 1
        return kind, {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def error_event(self, e: LLMServeError) -> Event:
        kind, payload = self._event("error", code=e.code, message=e.message, param=e.param)
        return kind, dumps(payload)

    def feed_all(self) -> list[tuple[str, dict]]:
        c = self.gen.choices[0]
        return self._feed(c.text, c.token_ids, c.logprobs, True)

    def _feed(self, text: str, token_ids: list[int], logprobs: list, final: bool) -> list[tuple[str, dict]]:
        if self.body.logprobs is not None:
            self.pending_logprobs += chat_logprobs(self.name, token_ids, logprobs)
        events: list[tuple[str, dict]] = []
        for piece in self.splitter.feed(text, final):
            events += self._text(piece) if isinstance(piece, str) else self._call(piece)
        if final:
            events += self._close_message()
        return events

    def _text(self, text: str) -> list[tuple[str, dict]]:
        events = []
        if self.open is None:
            self.open = {"id": _id("msg"), "type": "message", "status": "in_progress", "role": "assistant", "content": []}
            self.output.append(self.open)
            events.append(self._event("response.output_item.added", output_index=len(self.output) - 1, item=_copy(self.open)))
            self.open["content"].append({"type": "output_text", "text": "", "annotations": [], "logprobs": []})
            events.append(self._event("response.content_part.added", **self._where(), part=_copy(self.open["content"][0])))
        part = self.open["content"][0]
        part["text"] += text
        lps, self.pending_logprobs = self.pending_logprobs, []
        part["logprobs"] += lps
        events.append(self._event("response.output_text.delta", **self._where(), delta=text, logprobs=lps))
        return events

    def _where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": self.output.index(self.open), "content_index": 0}  # type: ignore[index]

    def _close_message(self) -> list[tuple[str, dict]]:
        if self.open is None:
            return []
        where, part = self._where(), self.open["content"][0]
        self.open["status"] = "completed"
        events = [self._event("response.output_text.done", **where, text=part["text"], logprobs=part["logprobs"]),
                  self._event("response.content_part.done", **where, part=_copy(part)),
                  self._event("response.output_item.done", output_index=where["output_index"], item=_copy(self.open))]
        self.open = None
        return events

    def _call(self, call: dict) -> list[tuple[str, dict]]:
        events = self._close_message()
        fn = call["function"]
        item = {"id": _id("fc"), "type": "function_call", "status": "in_progress", "call_id": call["id"], "name": fn["name"], "arguments": ""}
        self.output.append(item)
        index = len(self.output) - 1
        events.append(self._event("response.output_item.added", output_index=index, item=_copy(item)))
        item["arguments"], item["status"] = fn["arguments"], "completed"
        events += [self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index, delta=fn["arguments"]),
                   self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index, arguments=fn["arguments"]),
                   self._event("response.output_item.done", output_index=index, item=_copy(item))]
        return events

    async def stream(self) -> AsyncIterator[Event]:
        for kind, payload in (self._event("response.created", response=self.response("in_progress")),
                              self._event("response.in_progress", response=self.response("in_progress"))):
            yield kind, dumps(payload)
        async for _, d in self.gen.events():
            for kind, payload in self._feed(d.text, d.token_ids, d.logprobs, d.finish_reason is not None):
                yield kind, dumps(payload)
        kind, payload = self._event("response.completed", response=await self.finish())
        yield kind, dumps(payload)


def _copy(item: dict) -> dict:
    """A snapshot of an item as it is now (it changes as the output grows)."""
    return {k: ([dict(p) for p in v] if k == "content" else v) for k, v in item.items()}


def _as_input(item: dict) -> dict:
    """An output item as the client would send it back as input."""
    if item["type"] == "function_call":
        return {"type": "function_call", "call_id": item["call_id"], "name": item["name"], "arguments": item["arguments"]}
    return {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": p["text"]} for p in item["content"]]}


async def retrieve_response(request: Request) -> Response:
    ctx = get_context(request)
    stored = await ctx.responses.get(request.path_params["response_id"])  # type: ignore[union-attr]
    if stored is None:
        raise NotFoundError(f"no stored response with id {request.path_params['response_id']!r}", "response_id", "response_not_found")
    return JSONResponse(stored.response)


async def delete_response(request: Request) -> Response:
    ctx = get_context(request)
    response_id = request.path_params["response_id"]
    if not await ctx.responses.delete(response_id):  # type: ignore[union-attr]
        raise NotFoundError(f"no stored response with id {response_id!r}", "response_id", "response_not_found")
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


routes = [
    Route("/v1/responses", create_response, methods=["POST"]),
    Route("/v1/responses/{response_id}", retrieve_response, methods=["GET"]),
    Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"]),
]
