"""Native routes: POST /generate (per-token events with timings), /tokenize, /detokenize (vLLM's shapes).

/generate takes one of "prompt" (raw text), "input_ids" or "messages" (chat, through the model's
template: what an instruct model needs to answer).

/generate with stream:true sends one SSE event per token,
  {"token": {"id", "text", "logprob"[, "top_logprobs": [{"id", "text", "logprob"}]]}, "index", "t_ms"}
(index = position in the output, t_ms = ms from arrival to the token), then the final object,
  {"id", "finish_reason", "stop_reason", "generated_text", "token_ids", "usage",
   "timings": {"queue_ms", "ttft_ms", "tpot_ms", "e2e_ms", "itl_ms": [...]}};
stream:false returns the final object alone. Token texts concatenate to generated_text.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from llmserve.cache.semantic_cache import SemanticQuery
from llmserve.engine.outputs import TokenLogprobs
from llmserve.errors import InvalidRequestError
from llmserve.profiling import timings_of
from llmserve.server.context import ServerContext, get_context, new_id
from llmserve.server.generation import Generation
from llmserve.server.logprobs import clean
from llmserve.server.protocol import (
    DetokenizeRequest,
    GenerateRequest,
    TokenizeRequest,
    chat_messages,
    read_json,
)
from llmserve.server.semantic import chat_question, prompt_question
from llmserve.server.streaming import GenerationStream, dumps, json_response, unless_disconnected


async def generate(request: Request) -> Response:
    arrival = time.time()
    ctx = get_context(request)
    body = GenerateRequest.parse(await read_json(request, ctx.config.max_request_bytes))
    return await unless_disconnected(request, _generate(ctx, body, arrival))


async def _generate(ctx: ServerContext, body: GenerateRequest, arrival: float) -> Response:
    lora = ctx.check_model(body.model)
    if body.n != 1:
        raise InvalidRequestError("/generate makes one sequence (n must be 1); use /v1/completions for more", "n")
    ids = _prompt_ids(ctx, body)
    params = body.sampling_params(body.max_tokens, logprobs=body.logprobs or 0)
    await ctx.check_structured(params, body.structured()[1])
    gen = Generation(ctx, new_id("gen"), [ids], params, arrival, use_cache=body.cache, semantic=_question(ctx, body),
                     priority=body.priority, lora=lora)
    await gen.start()
    if body.stream:
        return GenerationStream(_events(ctx, gen), gen, done_marker=False)
    try:
        await gen.run()
    finally:
        gen.close()
    return json_response(_final(gen), gen)


def _prompt_ids(ctx: ServerContext, body: GenerateRequest) -> list[int]:
    given = [name for name in ("prompt", "input_ids", "messages") if getattr(body, name) is not None]
    if len(given) != 1:
        raise InvalidRequestError("give exactly one of prompt (text), input_ids (token ids) and messages (chat)", "prompt")
    if body.messages is not None:
        return ctx.tokenizer.apply_chat_template(chat_messages(body.messages), body.add_generation_prompt)
    if body.prompt is not None:
        return ctx.tokenizer.encode(body.prompt, body.add_special_tokens)
    return body.input_ids or []


def _question(ctx: ServerContext, body: GenerateRequest) -> SemanticQuery | None:
    if body.messages is not None:
        return chat_question(ctx, chat_messages(body.messages), add_generation_prompt=body.add_generation_prompt)
    return prompt_question(ctx, body.prompt, add_special_tokens=body.add_special_tokens)


async def _events(ctx: ServerContext, gen: Generation) -> AsyncIterator[bytes]:
    arrival = gen.choices[0].request.arrival_time
    async for _, d in gen.events():
        t_ms = round((d.token_time - arrival) * 1000, 3)
        for j, tid in enumerate(d.token_ids):
            lp = d.logprobs[j] if j < len(d.logprobs) else None
            token = _token(ctx, tid, d.text if j == 0 else "", lp)
            yield dumps({"token": token, "index": d.first_token_index + j, "t_ms": t_ms})
        if d.finish_reason is not None:
            yield dumps(_final(gen))


def _token(ctx: ServerContext, tid: int, text: str, lp: TokenLogprobs | None) -> dict:
    token: dict = {"id": tid, "text": text, "logprob": clean(lp.logprob) if lp else None}
    if lp and lp.top:
        token["top_logprobs"] = [
            {"id": t, "text": ctx.tokenizer.decode([t], skip_special_tokens=False), "logprob": clean(v)} for t, v in lp.top
        ]
    return token


def _final(gen: Generation) -> dict:
    c = gen.choices[0]
    return {
        "id": gen.request_id,
        "finish_reason": c.finish_reason,
        "stop_reason": c.stop_reason,
        "generated_text": c.text,
        "token_ids": c.token_ids,
        "usage": gen.usage(),
        "timings": timings_of(c.timeline).as_ms() if c.timeline else None,
    }


# ---- /tokenize, /detokenize -----------------------------------------------------------------


async def tokenize(request: Request) -> Response:
    ctx = get_context(request)
    body = TokenizeRequest.parse(await read_json(request, ctx.config.max_request_bytes))
    ctx.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequestError("give exactly one of prompt and messages", "prompt")
    if body.messages is not None:
        ids = ctx.tokenizer.apply_chat_template(chat_messages(body.messages), body.add_generation_prompt)
    else:
        ids = ctx.tokenizer.encode(body.prompt or "", body.add_special_tokens)
    strs = [ctx.tokenizer.id_to_token(t) for t in ids] if body.return_token_strs else None
    return JSONResponse({"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids, "token_strs": strs})


async def detokenize(request: Request) -> Response:
    ctx = get_context(request)
    body = DetokenizeRequest.parse(await read_json(request, ctx.config.max_request_bytes))
    ctx.check_model(body.model)
    vocab = ctx.client.info.vocab_size
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidRequestError(f"token id {bad} is outside the vocabulary [0, {vocab})", "tokens")
    return JSONResponse({"prompt": ctx.tokenizer.decode(body.tokens)})


routes = [
    Route("/generate", generate, methods=["POST"]),
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/detokenize", detokenize, methods=["POST"]),
]
