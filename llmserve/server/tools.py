"""Tool calling on /v1/chat/completions: OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`.

The model sees the tools through its chat template when the template takes `tools`; otherwise
through a system message (TOOLS_PROMPT) that asks for calls in the Hermes format:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

tool_choice "auto": the output is free; ToolCallParser finds such blocks in it (also while it
streams) and turns them into `tool_calls`. "required" or a named function: the output is held
by a grammar to one or more such blocks (one when parallel_tool_calls is false) whose JSON
matches a tool's name and parameter schema, so it always parses. "none": the tools are not shown
and nothing is parsed. Earlier assistant turns with `tool_calls` are shown to the model as the
same blocks; `role: "tool"` messages pass through.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from llmserve.errors import InvalidRequestError
from llmserve.sampling import StructuredOutputsParams

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
TOOLS_PROMPT = """You can call functions to help answer. Their signatures, one JSON object each:
<tools>
{tools}
</tools>
To call one, answer with a JSON object holding its name and arguments inside <tool_call></tool_call> tags:
<tool_call>
{{"name": "<function name>", "arguments": {{<arguments as a JSON object>}}}}
</tool_call>"""


@dataclass(slots=True)
class ToolSpec:
    name: str
    description: str | None
    parameters: dict[str, Any]


@dataclass(slots=True)
class ToolPlan:
    """What a request's tools mean for its prompt, its output grammar and its reply."""

    tools: list[ToolSpec]
    choice: str  # "none" | "auto" | "required" | "function"
    named: str | None = None
    parallel: bool = True

    @property
    def parses(self) -> bool:
        return bool(self.tools) and self.choice != "none"

    def structured(self) -> StructuredOutputsParams | None:
        """The grammar that holds the output to tool calls (required / named), else None."""
        if self.choice not in ("required", "function"):
            return None
        chosen = [t for t in self.tools if self.choice == "required" or t.name == self.named]
        schema = {"anyOf": [_call_schema(t) for t in chosen]} if len(chosen) > 1 else _call_schema(chosen[0])
        schema["x-guidance"] = JSON_STYLE
        more = ' ("\\n" call)*' if self.parallel else ""
        grammar = f'start: call{more}\ncall: "{OPEN}\\n" body "\\n{CLOSE}"\nbody: %json {json.dumps(schema)}\n'
        return StructuredOutputsParams(grammar=grammar)


def _call_schema(t: ToolSpec) -> dict[str, Any]:
    """{"name": <t.name>, "arguments": <t.parameters>}; arguments hold only declared parameters
    (OpenAI's strict mode), so a model cannot wander off into keys nobody asked for."""
    args = t.parameters
    if args.get("type") == "object" and "additionalProperties" not in args:
        args = {**args, "additionalProperties": False}
    return {"type": "object", "properties": {"name": {"const": t.name}, "arguments": args},
            "required": ["name", "arguments"], "additionalProperties": False}


def plan_tools(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None, parallel: bool) -> ToolPlan:
    """Checked tools and tool_choice (400 with the parameter named)."""
    specs = []
    for i, t in enumerate(tools or []):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise InvalidRequestError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", f"tools[{i}]")
        name, params = fn.get("name"), fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidRequestError(f"tools[{i}].function.name must be 1-64 letters, digits, _ or -", f"tools[{i}].function.name")
        if not isinstance(params, dict):
            raise InvalidRequestError(f"tools[{i}].function.parameters must be a JSON schema object", f"tools[{i}].function.parameters")
        if any(s.name == name for s in specs):
            raise InvalidRequestError(f"tools[{i}]: the function name {name!r} is used twice", f"tools[{i}].function.name")
        desc = fn.get("description")
        specs.append(ToolSpec(name, desc if isinstance(desc, str) else None, params))
    choice, named = _choice(tool_choice, specs)
    return ToolPlan(specs, choice, named, parallel)


def _choice(tool_choice: str | dict[str, Any] | None, specs: list[ToolSpec]) -> tuple[str, str | None]:
    if tool_choice is None:
        return ("auto" if specs else "none"), None
    if not specs:
        raise InvalidRequestError("tool_choice needs tools", "tool_choice")
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise InvalidRequestError(f"tool_choice must be none, auto, required or a function; got {tool_choice!r}", "tool_choice")
        return tool_choice, None
    fn = tool_choice.get("function") if tool_choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise InvalidRequestError("tool_choice must be {'type': 'function', 'function': {'name': ...}}", "tool_choice")
    if not any(s.name == name for s in specs):
        raise InvalidRequestError(f"tool_choice names {name!r}, which is not in tools", "tool_choice")
    return "function", name


def with_tools(messages: list[dict[str, Any]], plan: ToolPlan, template_takes_tools: bool) -> tuple[list[dict[str, Any]], list[dict] | None]:
    """(messages for the template, its `tools` argument or None): without template support the
    tools go into the system message."""
    if not plan.tools or plan.choice == "none":
        return messages, None
    functions = [{"name": t.name, **({"description": t.description} if t.description else {}), "parameters": t.parameters} for t in plan.tools]
    if template_takes_tools:
        return messages, [{"type": "function", "function": f} for f in functions]
    text = TOOLS_PROMPT.format(tools="\n".join(json.dumps(f) for f in functions))
    out = list(messages)
    if out and out[0]["role"] in ("system", "developer"):
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{text}"}
    else:
        out.insert(0, {"role": "system", "content": text})
    return out, None


def call_blocks(tool_calls: list[dict[str, Any]]) -> str:
    """An assistant turn's tool_calls as the blocks the model writes."""
    return "\n".join(f"{OPEN}\n{json.dumps(_call_of(c))}\n{CLOSE}" for c in tool_calls)


def _call_of(call: Any) -> dict[str, Any]:
    fn = call.get("function", {}) if isinstance(call, dict) else {}
    args = fn.get("arguments", "{}")
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except ValueError:
        pass
    return {"name": fn.get("name", ""), "arguments": args}


@dataclass(slots=True)
class ToolCallParser:
    """Splits one choice's streamed text into content and tool calls. feed() returns what can be
    shown now: content up to a possible `<tool_call>` start, and each call once its block closed."""

    tools: set[str]
    buffer: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self.buffer += text
        content, new = "", []
        while True:
            start = self.buffer.find(OPEN)
            if start < 0:
                keep = _partial_suffix(self.buffer, OPEN)
                content += self.buffer[: len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep :]
                return content, new
            content += self.buffer[:start]
            end = self.buffer.find(CLOSE, start)
            if end < 0:
                self.buffer = self.buffer[start:]
                return content, new
            block, self.buffer = self.buffer[start : end + len(CLOSE)], self.buffer[end + len(CLOSE) :].lstrip("\n")
            call = self._call(block)
            if call is None:
                content += block
            else:
                new.append(call)

    def finish(self) -> str:
        """What is left (an unclosed block stays text)."""
        rest, self.buffer = self.buffer, ""
        return rest

    def _call(self, block: str) -> dict[str, Any] | None:
        m = _BLOCK.fullmatch(block)
        try:
            obj = json.loads(m.group(1)) if m else None
        except ValueError:
            return None
        if not isinstance(obj, dict) or obj.get("name") not in self.tools or not isinstance(obj.get("arguments", {}), dict):
            return None
        call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": obj["name"], "arguments": json.dumps(obj.get("arguments", {}))}}
        self.calls.append(call)
        return call


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (held back until it is decided)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
