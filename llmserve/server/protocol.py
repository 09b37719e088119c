"""Request bodies: read (size and content-type limits, JSON), typed (pydantic, strict), and
turned into SamplingParams. Types and shapes are checked here; value ranges are checked once, by
SamplingParams.validate, so the offline API and the server agree. Unknown fields are ignored.
"""

from __future__ import annotations

import json
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request

from llmserve.errors import InvalidRequestError
from llmserve.sampling import SamplingParams, StructuredOutputsParams
from llmserve.server.errors import PayloadTooLargeError, UnsupportedMediaTypeError
from llmserve.server.tools import call_blocks

INT64 = 2**63 - 1
ROLES = ("system", "developer", "user", "assistant", "tool")
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    """The body as a JSON object; 415 for a non-JSON content type, 413 past `limit` bytes."""
    ctype = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if ctype != "application/json" and not ctype.endswith("+json"):
        raise UnsupportedMediaTypeError(f"the body must be JSON (Content-Type: application/json), got {ctype!r}")
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise PayloadTooLargeError(f"the request body is larger than the limit of {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:  # a chunked body, or a Content-Length that lied
            raise PayloadTooLargeError(f"the request body is larger than the limit of {limit} bytes")
    try:
        data = json.loads(bytes(body), parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        raise InvalidRequestError(f"the body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise InvalidRequestError("the body must be a JSON object")
    return data


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not allowed")


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    @classmethod
    def parse(cls, data: dict[str, Any]) -> Self:
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise _invalid(e) from None


def _invalid(e: ValidationError) -> InvalidRequestError:
    errors = e.errors(include_url=False)
    loc = errors[0]["loc"]
    head: list[str | int] = []
    for part in loc:  # union branches show up in loc as type tags ("str", "list[int]")
        if isinstance(part, str) and (part in _TYPE_TAGS or "[" in part):
            break
        head.append(part)
    param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in head).lstrip(".") or None
    if len(head) < len(loc):
        tags = dict.fromkeys(str(err["loc"][len(head)]) for err in errors if err["loc"][: len(head)] == tuple(head) and len(err["loc"]) > len(head))
        return InvalidRequestError(f"'{param}' must be one of: {', '.join(tags)}", param)
    return InvalidRequestError(f"'{param}': {errors[0]['msg']}", param)


class StreamOptions(_Model):
    include_usage: bool = False


class JsonSchemaFormat(_Model):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Model):
    """OpenAI's response_format: {"type": "text" | "json_object" | "json_schema", "json_schema"}."""

    type: str
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Model):
    """vLLM's structured_outputs: exactly one of json, regex, choice, grammar, json_object."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def params(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(self.json_, self.regex, self.choice, self.grammar, bool(self.json_object))


class SamplingFields(_Model):
    """Fields every generation endpoint shares (OpenAI's, plus vLLM's extras)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1)
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(None, ge=-INT64 - 1, le=INT64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache: bool = True  # false: never answered from (nor stored in) the response cache
    priority: int = 0  # lower runs first under --scheduling-policy priority (vLLM's field)
    speculative: bool = True  # false: no speculative decoding for this request (where the server runs it)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None  # vLLM's older names for structured_outputs
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured(self) -> tuple[StructuredOutputsParams | None, str]:
        """The output structure asked for and the parameter that asked (for errors)."""
        guided = {k: getattr(self, f"guided_{k}") for k in ("json", "regex", "choice", "grammar") if getattr(self, f"guided_{k}") is not None}
        given = [name for name, on in (("response_format", self.response_format is not None and self.response_format.type != "text"),
                                        ("structured_outputs", self.structured_outputs is not None),
                                        *((f"guided_{k}", True) for k in guided)) if on]
        if len(given) > 1:
            raise InvalidRequestError(f"give only one of {', '.join(given)}", given[1])
        if self.structured_outputs is not None:
            return self.structured_outputs.params(), "structured_outputs"
        if guided:
            (kind, value), = guided.items()
            return StructuredOutputsParams(**{kind: value}), f"guided_{kind}"
        if self.response_format is not None:
            return _response_format(self.response_format), "response_format"
        return None, ""

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None = None, prompt_logprobs: int | None = None) -> SamplingParams:
        structured, asked_by = self.structured()
        try:
            return self._sampling_params(max_tokens, logprobs, prompt_logprobs, structured)
        except InvalidRequestError as e:
            raise renamed(e, asked_by) from None

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None,
                         structured: StructuredOutputsParams | None) -> SamplingParams:
        def pick(v: Any, default: Any) -> Any:
            return default if v is None else v

        return SamplingParams(
            n=self.n, max_tokens=max_tokens, temperature=pick(self.temperature, 1.0), top_p=pick(self.top_p, 1.0),
            top_k=pick(self.top_k, -1), min_p=pick(self.min_p, 0.0), repetition_penalty=pick(self.repetition_penalty, 1.0),
            presence_penalty=pick(self.presence_penalty, 0.0), frequency_penalty=pick(self.frequency_penalty, 0.0),
            logit_bias=_logit_bias(self.logit_bias), seed=self.seed, stop=pick(self.stop, []),
            stop_token_ids=pick(self.stop_token_ids, []), ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output, structured_outputs=structured,
            speculative=self.speculative,
        )


def renamed(e: InvalidRequestError, asked_by: str) -> InvalidRequestError:
    """An error about structured_outputs, named after the parameter the request used."""
    if asked_by and e.param and e.param.startswith("structured_outputs") and asked_by != "structured_outputs":
        e.param = asked_by
        e.message = e.message.replace("structured_outputs", asked_by, 1)
    return e


def _response_format(rf: ResponseFormat) -> StructuredOutputsParams | None:
    if rf.type == "text":
        return None
    if rf.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise InvalidRequestError("response_format.json_schema.schema is required", "response_format.json_schema.schema")
        return StructuredOutputsParams(json=rf.json_schema.schema_)
    raise InvalidRequestError(f"response_format.type must be one of text, json_object, json_schema; got {rf.type!r}", "response_format.type")


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    try:
        return {int(k): v for k, v in bias.items()}
    except ValueError:
        raise InvalidRequestError("logit_bias keys must be token ids (integers as strings)", "logit_bias") from None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    return_tokens_as_token_ids: bool = False  # vLLM: logprob tokens as "token_id:123"


class ContentPart(_Model):
    type: str
    text: str | None = None


class ChatMessage(_Model):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None

    def text(self, where: str) -> str:
        """The content as one string; `where` ("messages[2]") names the message in errors.

        OpenAI's rules: content is required (a string, or a non-empty list of text parts) except
        on an assistant message with tool_calls, where it may be null or absent."""
        if self.content is None:
            if self.role == "assistant" and self.tool_calls:
                return ""
            raise InvalidRequestError(f"{where}.content is required for a {self.role} message", f"{where}.content")
        if isinstance(self.content, str):
            return self.content
        if not self.content:
            raise InvalidRequestError(f"{where}.content must not be an empty list", f"{where}.content")
        for j, part in enumerate(self.content):
            if part.type != "text" or part.text is None:
                raise InvalidRequestError(
                    f"{where}.content[{j}]: only text content parts ({{'type': 'text', 'text': ...}}) are supported",
                    f"{where}.content[{j}]",
                )
        return "\n".join(p.text or "" for p in self.content)


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Messages for the chat template: [{"role", "content"}], roles and contents checked; an
    assistant turn's tool_calls are shown as tool-call blocks after its content."""
    if not messages:
        raise InvalidRequestError("messages must not be empty", "messages")
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise InvalidRequestError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {m.role!r}", f"messages[{i}].role")
    out = []
    for i, m in enumerate(messages):
        text = m.text(f"messages[{i}]")
        if m.role == "assistant" and m.tool_calls:
            text = "\n".join(x for x in (text, call_blocks(m.tool_calls)) if x)
        out.append({"role": m.role, "content": text})
    return out


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    max_tokens: int | None = None  # None: up to the context length
    max_completion_tokens: int | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM: go on from the final assistant message (with add_generation_prompt false)
    return_tokens_as_token_ids: bool = False


class GenerateRequest(SamplingFields):
    """POST /generate: exactly one of prompt (raw text), input_ids and messages (through the
    chat template, as /v1/chat/completions applies it)."""

    prompt: str | None = None
    input_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True  # messages only
    max_tokens: int | None = 16
    logprobs: int | None = None  # top-N alternatives; the chosen token's logprob is always sent
    add_special_tokens: bool = True


class TokenizeRequest(_Model):
    """vLLM's /tokenize: a prompt, or chat messages through the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # prompts only: the chat template places its own
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Model):
    model: str | None = None
    tokens: list[int]


class EmbeddingRequest(_Model):
    """OpenAI's /v1/embeddings body (text input only)."""

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: str = "float"
    dimensions: int | None = None
    user: str | None = None
