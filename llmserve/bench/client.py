"""One streamed request to an OpenAI-compatible server, timed the way `vllm bench serve` times it.

A token chunk is an SSE chunk whose first choice carries text (completions: "text", chat:
delta "content") or a finish_reason; a role-only or empty chunk is not a token (a server may send
the role before prefill). On the Responses API a token chunk is a response.output_text.delta
event, on the Messages API a content_block_delta event. TTFT = first token chunk - send; ITL =
gaps between token chunks; latency (E2EL) = last token chunk - send. Output tokens come from the
usage chunk (stream_options.include_usage), response.completed or message_delta.

The client is aiohttp (C-accelerated HTTP parsing) and chunks are decoded with msgspec: on a
machine that the server shares with the load generator, the generator's own CPU time per chunk
slows the server it measures.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import aiohttp
import msgspec

from llmserve.bench.datasets import SampleRequest


@dataclass(slots=True)
class RequestRecord:
    index: int
    max_tokens: int
    start_s: float | None = None  # send time, seconds since the run began
    status: int | None = None  # HTTP status
    ttft_s: float | None = None
    latency_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    chunk_times_s: list[float] = field(default_factory=list)  # token chunks, seconds since the run began
    prompt_tokens: int | None = None  # from usage
    output_tokens: int | None = None  # from usage
    finish_reason: str | None = None
    done: bool = False  # saw data: [DONE]
    error: str | None = None

    @property
    def success(self) -> bool:
        return self.error is None and self.ttft_s is not None and (self.done or self.finish_reason is not None)

    def to_json(self) -> dict:
        return {**asdict(self), "success": self.success}


def request_body(endpoint: str, model: str | None, sample: SampleRequest, temperature: float, ignore_eos: bool) -> dict:
    body: dict = {"stream": True, "temperature": temperature}
    if model is not None:
        body["model"] = model
    if endpoint.endswith("/completions") and not endpoint.endswith("/chat/completions"):
        body |= {"prompt": sample.prompt, "max_tokens": sample.max_tokens, "stream_options": {"include_usage": True}}
    elif not isinstance(sample.prompt, str):
        raise ValueError(f"token-id prompts go to /v1/completions, not {endpoint}")
    elif endpoint.endswith("/chat/completions"):
        body |= {"messages": [{"role": "user", "content": sample.prompt}], "max_completion_tokens": sample.max_tokens,
                 "stream_options": {"include_usage": True}}
    elif endpoint.endswith("/responses"):
        body |= {"input": sample.prompt, "max_output_tokens": sample.max_tokens}
    else:  # /v1/messages
        body |= {"messages": [{"role": "user", "content": sample.prompt}], "max_tokens": sample.max_tokens}
    if ignore_eos:
        body["ignore_eos"] = True
    return body


_json_decode = msgspec.json.decode
_json_encode = msgspec.json.encode


async def stream_request(session: aiohttp.ClientSession, url: str, body: dict, rec: RequestRecord, t0: float) -> None:
    """Fill `rec` as the stream arrives (a cancelled call leaves what it saw); raises on transport errors."""
    st = time.perf_counter()
    rec.start_s = st - t0
    async with session.post(url, data=_json_encode(body), headers={"Content-Type": "application/json"}) as resp:
        rec.status = resp.status
        if resp.status != 200:
            text = (await resp.read()).decode(errors="replace")
            rec.error = f"HTTP {resp.status}: {text[:300]}"
            return
        buffer = b""
        last = st
        is_token = _EVENT_READERS.get(url.rsplit("/", 1)[-1], _is_token_chunk)
        async for data in resp.content.iter_any():
            now = time.perf_counter()
            *lines, buffer = (buffer + data).split(b"\n")
            for line in lines:
                if not line.startswith(b"data:"):
                    continue  # blank separators, SSE comments (pings), event names
                last = _on_data(line[5:].strip(), rec, st, last, now, t0, is_token)
                if rec.done or rec.error:
                    return


def _on_data(data: bytes, rec: RequestRecord, st: float, last: float, now: float, t0: float, is_token) -> float:
    """One `data:` payload; returns the time of the last token chunk."""
    if data == b"[DONE]":
        rec.done = True
        return last
    try:
        obj = _json_decode(data)
    except msgspec.DecodeError:
        rec.error = f"bad chunk: {data[:200].decode(errors='replace')}"
        return last
    if "error" in obj or obj.get("type") == "error":
        rec.error = f"error event: {_json_encode(obj.get('error', obj)).decode()[:300]}"
        return last
    if obj.get("usage") and "choices" in obj:
        rec.prompt_tokens = obj["usage"].get("prompt_tokens")
        rec.output_tokens = obj["usage"].get("completion_tokens")
    if not is_token(obj, rec):
        return last
    if rec.ttft_s is None:
        rec.ttft_s = now - st
    else:
        rec.itl_s.append(now - last)
    rec.chunk_times_s.append(now - t0)
    rec.latency_s = now - st
    return now


def _is_token_chunk(obj: dict, rec: RequestRecord) -> bool:
    """/v1/completions and /v1/chat/completions chunks."""
    choices = obj.get("choices")
    if not choices:
        return False
    c = choices[0]
    text = c["delta"].get("content") if "delta" in c else c.get("text")
    rec.finish_reason = c.get("finish_reason") or rec.finish_reason
    return bool(text) or c.get("finish_reason") is not None


def _is_response_delta(obj: dict, rec: RequestRecord) -> bool:
    """/v1/responses events: usage and the end in response.completed."""
    kind = obj.get("type")
    if kind == "response.completed":
        usage, rec.done = obj["response"]["usage"], True
        rec.prompt_tokens, rec.output_tokens = usage["input_tokens"], usage["output_tokens"]
        rec.finish_reason = obj["response"]["status"]
    return kind == "response.output_text.delta" and bool(obj.get("delta"))


def _is_message_delta(obj: dict, rec: RequestRecord) -> bool:
    """/v1/messages events: usage and the stop reason in message_delta, the end at message_stop."""
    kind = obj.get("type")
    if kind == "message_delta":
        usage = obj["usage"]
        rec.prompt_tokens = usage["input_tokens"] + usage.get("cache_read_input_tokens", 0)
        rec.output_tokens, rec.finish_reason = usage["output_tokens"], obj["delta"]["stop_reason"]
    rec.done = rec.done or kind == "message_stop"
    return kind == "content_block_delta"


_EVENT_READERS = {"responses": _is_response_delta, "messages": _is_message_delta}
