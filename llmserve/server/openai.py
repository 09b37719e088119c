"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models.

Streams are `data: <chunk>` events ending with `data: [DONE]`; with stream_options.include_usage
every chunk carries "usage": null and a last chunk with no choices carries the usage.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from llmserve.embeddings import MAX_TOKENS as EMBEDDING_MAX_TOKENS
from llmserve.embeddings import MODEL_NAME as EMBEDDING_MODEL
from llmserve.errors import InvalidRequestError
from llmserve.server.chat import ChatTurn, chat_generation
from llmserve.server.context import ServerContext, get_context, new_id
from llmserve.server.embeddings import available as embeddings_available
from llmserve.server.generation import Choice, Delta, Generation
from llmserve.server.logprobs import (
    TokenNamer,
    chat_logprobs,
    completion_logprobs,
    merge_completion_logprobs,
)
from llmserve.server.protocol import ChatCompletionRequest, CompletionRequest, read_json
from llmserve.server.semantic import prompt_question
from llmserve.server.streaming import GenerationStream, dumps, json_response, unless_disconnected
from llmserve.server.tools import ToolCallParser, ToolPlan, plan_tools


class _Reply:
    """Common envelope of one response: id, created, model, usage policy."""

    def __init__(self, ctx: ServerContext, gen: Generation, obj: str, include_usage: bool):
        self.ctx, self.gen, self.obj, self.include_usage = ctx, gen, obj, include_usage
        self.created = int(time.time())
        # a stream chunk's JSON = head + choices + tail: the envelope is encoded once per response
        head, _, tail = dumps(self.envelope([])).rpartition(b'"choices":[]')
        self._head, self._tail = head + b'"choices":', tail

    def envelope(self, choices: list[dict], usage: dict | None = None, final: bool = False) -> dict:
        body = {"id": self.gen.request_id, "object": self.obj, "created": self.created, "model": self.gen.model_name, "choices": choices}
        if final or self.include_usage:
            body["usage"] = usage
        return body

    def chunk(self, choices: list[dict]) -> bytes:
        """One stream chunk's JSON: the same bytes as dumps(self.envelope(choices))."""
        return self._head + dumps(choices) + self._tail

    def usage_chunk(self) -> list[bytes]:
        return [dumps(self.envelope([], self.gen.usage()))] if self.include_usage else []


# ---- /v1/completions ------------------------------------------------------------------------


async def create_completion(request: Request) -> Response:
    arrival = time.time()
    ctx = get_context(request)
    body = CompletionRequest.parse(await read_json(request, ctx.config.max_request_bytes))
    return await unless_disconnected(request, _completion(ctx, body, arrival))


def _prompts(ctx: ServerContext, prompt: str | list[str] | list[int] | list[list[int]]) -> list[list[int]]:
    if isinstance(prompt, str):
        return [ctx.tokenizer.encode(prompt)]
    if not prompt:
        raise InvalidRequestError("prompt must not be empty", "prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]  # type: ignore[arg-type]
    return [ctx.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt]


async def _completion(ctx: ServerContext, body: CompletionRequest, arrival: float) -> Response:
    lora = ctx.check_model(body.model)
    prompts = _prompts(ctx, body.prompt)
    score_only = body.max_tokens == 0 and body.echo
    if body.max_tokens == 0 and not body.echo:
        raise InvalidRequestError("max_tokens must be at least 1 (0 is allowed with echo, to score the prompt)", "max_tokens")
    prompt_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
    params = body.sampling_params(1 if score_only else body.max_tokens, body.logprobs, prompt_logprobs)
    await ctx.check_structured(params, body.structured()[1])
    question = None if body.echo else prompt_question(ctx, body.prompt)
    gen = Generation(ctx, new_id("cmpl"), prompts, params, arrival, score_only, body.cache, question, body.priority, lora)
    return await _respond(gen, _CompletionReply(ctx, gen, body), body.stream)


class _CompletionReply(_Reply):
    def __init__(self, ctx: ServerContext, gen: Generation, body: CompletionRequest):
        super().__init__(ctx, gen, "text_completion", body.include_usage)
        self.body = body
        self.name = TokenNamer(ctx.tokenizer, body.return_tokens_as_token_ids)
        self.offsets: dict[int, int] = {}  # choice index -> text offset of its next token
        self.prompt_texts = [ctx.tokenizer.decode(p) if body.echo else "" for p in gen.prompts]

    def _echo(self, c: Choice) -> tuple[str, dict | None]:
        """The prompt part of an echoed choice: its text and (with logprobs) its logprobs."""
        text = self.prompt_texts[c.prompt_index]
        if self.body.logprobs is None:
            return text, None
        ids = self.gen.prompts[c.prompt_index]
        lps, self.offsets[c.index] = completion_logprobs(self.name, ids, c.prompt_logprobs, 0)
        return text, lps

    def _choice(self, c: Choice, text: str, token_ids: list[int], lps: list, finish: str | None, first: bool) -> dict:
        logprobs = None
        if self.body.echo and first:
            prompt_text, logprobs = self._echo(c)
            text = prompt_text + text
        if self.body.logprobs is not None:
            gen_lps, self.offsets[c.index] = completion_logprobs(self.name, token_ids, lps, self.offsets.get(c.index, 0))
            logprobs = merge_completion_logprobs(logprobs, gen_lps) if logprobs else gen_lps
        return {"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": finish, "stop_reason": c.stop_reason if finish else None}

    def full(self) -> dict:
        choices = [self._choice(c, c.text, c.token_ids, c.logprobs, c.finish_reason, True) for c in self.gen.choices]
        return self.envelope(choices, self.gen.usage(), final=True)

    async def stream(self) -> AsyncIterator[bytes]:
        started: set[int] = set()
        async for c, d in self.gen.events():
            first = c.index not in started
            started.add(c.index)
            if not (d.text or d.finish_reason or (first and self.body.echo) or (d.token_ids and self.body.logprobs is not None)):
                continue
            yield self.chunk([self._choice(c, d.text, d.token_ids, d.logprobs, d.finish_reason, first)])
        for chunk in self.usage_chunk():
            yield chunk


# ---- /v1/chat/completions -------------------------------------------------------------------


async def create_chat_completion(request: Request) -> Response:
    arrival = time.time()
    ctx = get_context(request)
    body = ChatCompletionRequest.parse(await read_json(request, ctx.config.max_request_bytes))
    return await unless_disconnected(request, _chat(ctx, body, arrival))


async def _chat(ctx: ServerContext, body: ChatCompletionRequest, arrival: float) -> Response:
    lora = ctx.check_model(body.model)
    turn = ChatTurn(body.messages, plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls), body.add_generation_prompt,
                    body.continue_final_message)
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequestError("top_logprobs requires logprobs: true", "top_logprobs")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    gen = await chat_generation(ctx, turn, body, max_tokens, logprobs, new_id("chatcmpl"), arrival, lora)
    return await _respond(gen, _ChatReply(ctx, gen, body, turn.plan), body.stream)


async def _respond(gen: Generation, reply: _Reply, stream: bool) -> Response:
    """Start the generation (429/503 surface here), then stream it as SSE or answer once."""
    await gen.start()
    if stream:
        return GenerationStream(reply.stream(), gen, done_marker=True)
    try:
        await gen.run()
    finally:
        gen.close()
    return json_response(reply.full(), gen)


class _ChatReply(_Reply):
    def __init__(self, ctx: ServerContext, gen: Generation, body: ChatCompletionRequest, plan: ToolPlan):
        super().__init__(ctx, gen, "chat.completion.chunk" if body.stream else "chat.completion", body.include_usage)
        self.body = body
        self.name = TokenNamer(ctx.tokenizer, body.return_tokens_as_token_ids)
        names = {t.name for t in plan.tools}
        self.parsers = {c.index: ToolCallParser(names) for c in gen.choices} if plan.parses else {}

    def _logprobs(self, token_ids: list[int], lps: list) -> dict | None:
        return {"content": chat_logprobs(self.name, token_ids, lps)} if self.body.logprobs else None

    def _finish(self, c: Choice, finish: str | None) -> str | None:
        parser = self.parsers.get(c.index)
        return "tool_calls" if finish == "stop" and parser is not None and parser.calls else finish

    def full(self) -> dict:
        choices = []
        for c in self.gen.choices:
            message: dict = {"role": "assistant", "content": c.text}
            parser = self.parsers.get(c.index)
            if parser is not None:
                content, calls = parser.feed(c.text)
                content += parser.finish()
                message = {"role": "assistant", "content": (content or None) if calls else content}
                if calls:
                    message["tool_calls"] = calls
            choices.append({
                "index": c.index,
                "message": message,
                "logprobs": self._logprobs(c.token_ids, c.logprobs),
                "finish_reason": self._finish(c, c.finish_reason),
                "stop_reason": c.stop_reason,
            })
        return self.envelope(choices, self.gen.usage(), final=True)

    def _chunk(self, c: Choice, delta: dict, d: Delta | None) -> bytes:
        finish = self._finish(c, d.finish_reason) if d else None
        choice = {
            "index": c.index,
            "delta": delta,
            "logprobs": self._logprobs(d.token_ids, d.logprobs) if d else None,
            "finish_reason": finish,
        }
        if finish:
            choice["stop_reason"] = c.stop_reason
        return self.chunk([choice])

    def _delta(self, c: Choice, d: Delta) -> dict:
        """The delta of one engine output: its text, or (with tools) content and finished calls."""
        parser = self.parsers.get(c.index)
        if parser is None:
            return {"content": d.text} if d.text else {}
        before = len(parser.calls)
        content, calls = parser.feed(d.text)
        if d.finish_reason:
            content += parser.finish()
        delta: dict = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = [{"index": before + k, **call} for k, call in enumerate(calls)]
        return delta

    async def stream(self) -> AsyncIterator[bytes]:
        for c in self.gen.choices:  # the role first, as OpenAI does
            yield self._chunk(c, {"role": "assistant", "content": ""}, None)
        async for c, d in self.gen.events():
            delta = self._delta(c, d)
            if delta or d.finish_reason or (d.token_ids and self.body.logprobs):
                yield self._chunk(c, delta, d)
        for chunk in self.usage_chunk():
            yield chunk


# ---- /v1/models -----------------------------------------------------------------------------


def model_cards(ctx: ServerContext) -> list[dict]:
    """The served model, its LoRA adapters (parent: the base; root: the adapter's path) and the
    embedding model when it is installed."""
    def card(name: str, root: str, max_len: int, parent: str | None = None, created: int | None = None) -> dict:
        return {"id": name, "object": "model", "created": created or ctx.created, "owned_by": "llmserve", "root": root,
                "parent": parent, "max_model_len": max_len}

    cards = [card(ctx.model_name, ctx.client.info.model_dir, ctx.max_model_len)]
    for a in (ctx.loras.adapters.values() if ctx.loras is not None else ()):
        cards.append(card(a.request.lora_name, a.request.lora_path, ctx.max_model_len, a.parent, a.created))
    if embeddings_available():
        cards.append(card(EMBEDDING_MODEL, EMBEDDING_MODEL, EMBEDDING_MAX_TOKENS))
    return cards


async def list_models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": model_cards(get_context(request))})


async def retrieve_model(request: Request) -> Response:
    ctx = get_context(request)
    name = request.path_params["model"]
    card = next((c for c in model_cards(ctx) if c["id"] == name), None)
    if card is None:
        ctx.check_model(name)  # the 404
    return JSONResponse(card)


routes = [
    Route("/v1/completions", create_completion, methods=["POST"]),
    Route("/v1/chat/completions", create_chat_completion, methods=["POST"]),
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/models/{model:path}", retrieve_model, methods=["GET"]),
]
