"""One chat turn to one Generation: the path every chat-shaped route takes (/v1/chat/completions,
/v1/responses, /v1/messages). A route translates its body into ChatMessages, a ToolPlan and
SamplingFields; from there the chat template, the tool grammar, structured output, the response
and semantic caches and the engine door are the same for all three.

OutputSplitter turns a choice's streamed text into the pieces each route shows in order: content
strings and finished tool calls (OpenAI's chat shape, {"id", "type", "function": {"name",
"arguments"}}), whatever the route's own shape for them.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmserve.errors import InvalidRequestError
from llmserve.lora.request import LoRARequest
from llmserve.server.context import ServerContext
from llmserve.server.generation import Generation
from llmserve.server.protocol import ChatMessage, SamplingFields, chat_messages
from llmserve.server.semantic import chat_question
from llmserve.server.tools import ToolCallParser, ToolPlan, with_tools


@dataclass(slots=True)
class ChatTurn:
    """What a chat-shaped request asks the model: the conversation and its tools."""

    messages: list[ChatMessage]
    plan: ToolPlan
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last (assistant) message is continued, not closed

    def template_inputs(self, ctx: ServerContext) -> tuple[list[dict], list[dict] | None]:
        """(messages for the chat template, its `tools` argument or None)."""
        return with_tools(chat_messages(self.messages), self.plan, ctx.tokenizer.takes_tools)

    def prompt_ids(self, ctx: ServerContext) -> list[int]:
        messages, tools = self.template_inputs(ctx)
        return self.render(ctx, messages, tools)

    def render(self, ctx: ServerContext, messages: list[dict], tools: list[dict] | None) -> list[int]:
        return ctx.tokenizer.apply_chat_template(messages, self.add_generation_prompt, tools, self.continue_final_message)


async def chat_generation(ctx: ServerContext, turn: ChatTurn, fields: SamplingFields, max_tokens: int | None,
                          logprobs: int | None, request_id: str, arrival: float, lora: LoRARequest | None) -> Generation:
    """The Generation for one chat turn (not started), under `lora` (the adapter `model` named,
    as ctx.check_model resolved it): 400s for what the request got wrong."""
    messages, template_tools = turn.template_inputs(ctx)
    ids = turn.render(ctx, messages, template_tools)
    params = fields.sampling_params(max_tokens, logprobs)
    asked_by = fields.structured()[1]
    if (tool_grammar := turn.plan.structured()) is not None:
        if params.structured_outputs is not None:
            raise InvalidRequestError(f"tool_choice {turn.plan.choice!r} holds the output to tool calls; it cannot be combined with {asked_by}", asked_by)
        params.structured_outputs, asked_by = tool_grammar, "tools"
    await ctx.check_structured(params, asked_by)
    question = chat_question(ctx, messages, tools=template_tools, add_generation_prompt=turn.add_generation_prompt)
    return Generation(ctx, request_id, [ids], params, arrival, use_cache=fields.cache, semantic=question, priority=fields.priority,
                      lora=lora)


Piece = str | dict  # content text, or one finished tool call in OpenAI's chat shape


class OutputSplitter:
    """One choice's text, fed as it streams, split into pieces in order; without tools to parse,
    all of it is content."""

    def __init__(self, plan: ToolPlan):
        self.parser = ToolCallParser({t.name for t in plan.tools}) if plan.parses else None

    def feed(self, text: str, final: bool) -> list[Piece]:
        if self.parser is None:
            return [text] if text else []
        content, calls = self.parser.feed(text)
        if final:
            content += self.parser.finish()
        return ([content] if content else []) + calls

    @property
    def called(self) -> bool:
        return self.parser is not None and bool(self.parser.calls)

