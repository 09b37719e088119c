"""POST /v1/responses bodies (OpenAI's Responses API, with vLLM's sampling extras) and their
translation into a chat turn: Responses items become ChatMessages, flat function tools become
chat tools, `text.format` becomes structured output.

Items (`input` as a list; a string is one user message):
  {"type": "message" (or absent), "role", "content": str | [{"type": "input_text" | "output_text", "text"}]}
  {"type": "function_call", "call_id", "name", "arguments": "<JSON>"}: joins the assistant turn before it
  {"type": "function_call_output", "call_id", "output"}: a `tool` message; its call must come earlier
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field

from llmserve.errors import InvalidRequestError
from llmserve.sampling import StructuredOutputsParams
from llmserve.server.protocol import ROLES, ChatMessage, SamplingFields, _Model
from llmserve.server.tools import ToolPlan, plan_tools

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# what OpenAI's `include` may name; only the logprobs apply to this server's outputs
KNOWN_INCLUDES = {LOGPROBS_INCLUDE, "reasoning.encrypted_content", "message.input_image.image_url", "file_search_call.results",
                  "web_search_call.results", "web_search_call.action.sources", "computer_call_output.output.image_url",
                  "code_interpreter_call.outputs"}
TEXT_PARTS = ("input_text", "output_text", "text")


class ResponseContentPart(_Model):
    type: str
    text: str | None = None


class ResponseItem(_Model):
    """One input item: a message, a function call, or a function call's output."""

    type: str = "message"
    role: str | None = None
    content: str | list[ResponseContentPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[ResponseContentPart] | None = None
    id: str | None = None
    status: str | None = None


class ResponseTextFormat(_Model):
    type: str
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseText(_Model):
    format: ResponseTextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(SamplingFields):
    input: str | list[ResponseItem]
    instructions: str | None = None
    max_output_tokens: int | None = None  # None: up to the context length
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: ResponseText | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    store: bool = True
    previous_response_id: str | None = None
    background: bool = False
    metadata: dict[str, str] | None = None
    truncation: str | None = None
    reasoning: dict[str, Any] | None = None
    return_tokens_as_token_ids: bool = False  # vLLM: logprob tokens as "token_id:123"
    return_token_ids: bool = False  # vLLM: the prompt's and the output's token ids in the response

    def structured(self) -> tuple[StructuredOutputsParams | None, str]:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return super().structured()
        if (other := super().structured()[1]):
            raise InvalidRequestError(f"give only one of text.format, {other}", other)
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True), "text.format"
        if fmt.type == "json_schema":
            if fmt.schema_ is None:
                raise InvalidRequestError("text.format.schema is required for a json_schema format", "text.format.schema")
            return StructuredOutputsParams(json=fmt.schema_), "text.format"
        raise InvalidRequestError(f"text.format.type must be one of text, json_object, json_schema; got {fmt.type!r}", "text.format.type")

    def check(self) -> None:
        """What the route does not do, refused by name."""
        if self.background:
            raise InvalidRequestError("background responses are not supported; send background: false", "background")
        if self.n != 1:
            raise InvalidRequestError("n must be 1 on /v1/responses", "n")
        for i, name in enumerate(self.include or []):
            if name not in KNOWN_INCLUDES:
                raise InvalidRequestError(f"include[{i}]: unknown value {name!r}", f"include[{i}]")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise InvalidRequestError("top_logprobs must be between 0 and 20", "top_logprobs")

    @property
    def logprobs(self) -> int | None:
        """Top alternatives per token when the logprobs are included, else None."""
        return (self.top_logprobs or 0) if LOGPROBS_INCLUDE in (self.include or []) else None

    def items(self) -> list[dict[str, Any]]:
        """`input` as items (plain dicts, as stored)."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        if not self.input and self.previous_response_id is None:
            raise InvalidRequestError("input must not be empty", "input")
        return [item.model_dump(exclude_none=True, by_alias=True) for item in self.input]

    def tool_plan(self) -> ToolPlan:
        """Flat function tools and tool_choice, checked as chat tools are."""
        tools = []
        for i, t in enumerate(self.tools or []):
            if t.get("type") != "function":
                raise InvalidRequestError(f"tools[{i}]: only function tools are supported, got type {t.get('type')!r}", f"tools[{i}].type")
            tools.append({"type": "function", "function": {k: v for k, v in t.items() if k in ("name", "description", "parameters")}})
        choice = self.tool_choice
        if isinstance(choice, dict):
            if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
                raise InvalidRequestError("tool_choice must be none, auto, required or {'type': 'function', 'name': ...}", "tool_choice")
            choice = {"type": "function", "function": {"name": choice["name"]}}
        try:
            return plan_tools(tools, choice, self.parallel_tool_calls)
        except InvalidRequestError as e:
            e.param = e.param and e.param.replace(".function", "")
            e.message = e.message.replace(".function.", ".").replace("{'type': 'function', 'function': {...}}", "{'type': 'function', 'name': ...}")
            raise


def chat_history(instructions: str | None, items: list[dict[str, Any]], first_new: int = 0) -> list[ChatMessage]:
    """Items as chat messages, `instructions` first as the system message. Items before
    `first_new` came from a stored conversation; errors name the others as input[i]."""
    messages = [ChatMessage(role="system", content=instructions)] if instructions is not None else []
    calls: set[str] = set()
    for i, item in enumerate(items):
        where = f"input[{i - first_new}]" if i >= first_new else f"stored item {i}"
        _add_item(messages, calls, item, where)
    if not messages or all(m.role == "system" for m in messages):
        raise InvalidRequestError("input has no message to answer", "input")
    return messages


def _add_item(messages: list[ChatMessage], calls: set[str], item: dict[str, Any], where: str) -> None:
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ROLES or role == "tool":
            raise InvalidRequestError(f"{where}.role must be one of user, system, developer, assistant; got {role!r}", f"{where}.role")
        messages.append(ChatMessage(role=role, content=_text(item.get("content"), f"{where}.content")))
    elif kind == "function_call":
        call_id, name = _field(item, "call_id", where), _field(item, "name", where)
        call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": _arguments(item, where)}}
        calls.add(call_id)
        last = messages[-1] if messages else None
        if last is not None and last.role == "assistant":
            last.tool_calls = [*(last.tool_calls or []), call]
        else:
            messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
    elif kind == "function_call_output":
        call_id = _field(item, "call_id", where)
        if call_id not in calls:
            raise InvalidRequestError(f"{where}: no function_call with call_id {call_id!r} comes before this output", f"{where}.call_id")
        messages.append(ChatMessage(role="tool", tool_call_id=call_id, content=_text(item.get("output"), f"{where}.output")))
    else:
        raise InvalidRequestError(f"{where}.type {kind!r} is not supported (message, function_call, function_call_output)", f"{where}.type")


def _field(item: dict[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"{where}.{name} is required for a {item.get('type')} item", f"{where}.{name}")
    return value


def _arguments(item: dict[str, Any], where: str) -> str:
    args = _field(item, "arguments", where)
    try:
        json.loads(args)
    except ValueError:
        raise InvalidRequestError(f"{where}.arguments must be a JSON string", f"{where}.arguments") from None
    return args


def _text(content: Any, where: str) -> str:
    """A string, or text parts (input_text, output_text) joined by newlines."""
    if isinstance(content, str):
        return content
    if not content:
        raise InvalidRequestError(f"{where} is required", where)
    for j, part in enumerate(content):
        if part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise InvalidRequestError(f"{where}[{j}]: only text parts (input_text, output_text) are supported", f"{where}[{j}]")
    return "\n".join(part["text"] for part in content)
