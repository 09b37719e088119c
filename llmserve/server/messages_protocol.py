"""POST /v1/messages and /v1/messages/count_tokens bodies (Anthropic's Messages API; vLLM's
sampling extras such as `seed` arrive as plain fields, as the anthropic client's `extra_body`
sends them) and their translation into a chat turn.

Blocks: `text`; `tool_use` {"id", "name", "input"} in assistant turns (a tool call); `tool_result`
{"tool_use_id", "content": str | [text blocks], "is_error"} in user turns (a `tool` message; its
tool_use must come earlier). A user turn's tool results come before its text, as Anthropic asks.
"""

from __future__ import annotations

import json
from typing import Any

from llmserve.errors import InvalidRequestError
from llmserve.server.chat import ChatTurn
from llmserve.server.protocol import ChatMessage, SamplingFields, _Model
from llmserve.server.tools import ToolPlan, plan_tools

TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # Anthropic's -> OpenAI's; "tool" names one


class Block(_Model):
    type: str
    text: str | None = None
    id: str | None = None  # tool_use
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None  # tool_result
    content: str | list[Block] | None = None
    is_error: bool | None = None


class AnthropicMessage(_Model):
    role: str
    content: str | list[Block]


class AnthropicTool(_Model):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: str | None = None  # "custom" or absent; server tools (web_search, bash...) are refused


class AnthropicToolChoice(_Model):
    type: str
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class MessagesPrompt(_Model):
    """What the model is shown: the fields count_tokens takes."""

    model: str | None = None
    messages: list[AnthropicMessage]
    system: str | list[Block] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None

    def turn(self) -> ChatTurn:
        messages = [ChatMessage(role="system", content=_system(self.system))] if self.system else []
        if not self.messages:
            raise InvalidRequestError("messages must not be empty", "messages")
        calls: set[str] = set()
        for i, m in enumerate(self.messages):
            messages += _translate(m, f"messages[{i}]", calls)
        # a final assistant message is a prefill: the answer goes on from its last word, as Anthropic's does
        prefill = messages[-1].role == "assistant" and not messages[-1].tool_calls
        return ChatTurn(messages, self._plan(), add_generation_prompt=not prefill, continue_final_message=prefill)

    def _plan(self) -> ToolPlan:
        tools = []
        for i, t in enumerate(self.tools or []):
            if t.type not in (None, "custom"):
                raise InvalidRequestError(f"tools[{i}]: server tools ({t.type!r}) are not supported; give name, description, input_schema",
                                          f"tools[{i}].type")
            tools.append({"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.input_schema}})
        choice: str | dict | None = None
        parallel = True
        if (tc := self.tool_choice) is not None:
            parallel = not tc.disable_parallel_tool_use
            if tc.type == "tool":
                if tc.name is None:
                    raise InvalidRequestError("tool_choice.name is required when tool_choice.type is 'tool'", "tool_choice.name")
                choice = {"type": "function", "function": {"name": tc.name}}
            elif tc.type in TOOL_CHOICES:
                choice = TOOL_CHOICES[tc.type]
            else:
                raise InvalidRequestError(f"tool_choice.type must be auto, any, tool or none; got {tc.type!r}", "tool_choice.type")
        try:
            return plan_tools(tools, choice, parallel)
        except InvalidRequestError as e:
            e.param = e.param and e.param.replace(".function.parameters", ".input_schema").replace(".function", "")
            e.message = e.message.replace(".function.parameters", ".input_schema").replace(".function.", ".")
            raise


class MessagesRequest(MessagesPrompt, SamplingFields):
    max_tokens: int
    stop_sequences: list[str] | None = None
    metadata: dict[str, Any] | None = None
    return_token_ids: bool = False  # vLLM's extra: the prompt's and the output's token ids in the message

    def check(self) -> None:
        if self.max_tokens < 1:
            raise InvalidRequestError("max_tokens must be at least 1", "max_tokens")
        if self.n != 1:
            raise InvalidRequestError("n must be 1 on /v1/messages", "n")

    def sampling_fields(self) -> SamplingFields:
        """The request's sampling fields, with stop_sequences as stop strings."""
        if not self.stop_sequences:
            return self
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return self.model_copy(update={"stop": stop + self.stop_sequences})


class CountTokensRequest(MessagesPrompt):
    pass


def _system(system: str | list[Block]) -> str:
    if isinstance(system, str):
        return system
    for j, b in enumerate(system):
        if b.type != "text" or b.text is None:
            raise InvalidRequestError(f"system[{j}]: only text blocks are supported in system", f"system[{j}]")
    return "\n".join(b.text or "" for b in system)


def _translate(m: AnthropicMessage, where: str, calls: set[str]) -> list[ChatMessage]:
    """One Anthropic message as chat messages: tool results first (role tool), then the text and
    tool calls of the turn."""
    if m.role not in ("user", "assistant"):
        raise InvalidRequestError(f"{where}.role must be user or assistant, got {m.role!r}", f"{where}.role")
    if isinstance(m.content, str):
        return [ChatMessage(role=m.role, content=m.content)]
    if not m.content:
        raise InvalidRequestError(f"{where}.content must not be empty", f"{where}.content")
    results, texts, tool_calls = [], [], []
    for j, b in enumerate(m.content):
        at = f"{where}.content[{j}]"
        if b.type == "text" and b.text is not None:
            texts.append(b.text)
        elif b.type == "tool_use" and m.role == "assistant":
            tool_calls.append(_tool_call(b, at))
            calls.add(tool_calls[-1]["id"])
        elif b.type == "tool_result" and m.role == "user":
            if b.tool_use_id not in calls:
                raise InvalidRequestError(f"{at}: tool_result for {b.tool_use_id!r}, which no earlier tool_use block made", f"{at}.tool_use_id")
            results.append(ChatMessage(role="tool", tool_call_id=b.tool_use_id, content=_result_text(b, at)))
        else:
            raise InvalidRequestError(f"{at}: block type {b.type!r} is not supported in a {m.role} message", f"{at}.type")
    turn = [ChatMessage(role=m.role, content="\n".join(texts) if texts or not tool_calls else None, tool_calls=tool_calls or None)]
    return results + (turn if texts or tool_calls else [])


def _tool_call(b: Block, at: str) -> dict:
    if not b.id or not b.name or b.input is None:
        raise InvalidRequestError(f"{at}: a tool_use block needs id, name and input", at)
    return {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}


def _result_text(b: Block, at: str) -> str:
    if b.content is None or isinstance(b.content, str):
        return b.content or ""
    for k, inner in enumerate(b.content):
        if inner.type != "text" or inner.text is None:
            raise InvalidRequestError(f"{at}.content[{k}]: only text blocks are supported in a tool_result", f"{at}.content[{k}]")
    return "\n".join(inner.text or "" for inner in b.content)
