"""Structured output and tools. A random-weight model is the hardest case: only the token mask
makes its output valid. Sampled requests over JSON schemas, regexes and choices must all parse
and validate; unconstrained rows batched with constrained ones are unchanged; the official openai
client's parse() and tool calls work; bad structures get a 400 naming the parameter."""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from llmserve.sampling import SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.timeout(300)
USER = [{"role": "user", "content": "hi"}]
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                                                "required": ["x", "y"], "additionalProperties": False},
                                      "label": {"type": "string", "pattern": "^[a-z]{2,5}$"}},
     "required": ["point"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "note": {"type": "string", "maxLength": 8}}, "required": ["ok"],
     "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 2, "maxItems": 4},
]
REGEX = r"[A-Z]{2}-[0-9]{3}(-[a-z]{1,6})?"
CHOICES = ["yes", "no", "it depends"]
TOOLS = [
    {"type": "function", "function": {"name": "add", "description": "Add two integers",
                                      "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                                                     "required": ["a", "b"]}}},
    {"type": "function", "function": {"name": "shout", "parameters": {"type": "object", "properties": {"word": {"type": "string", "maxLength": 10}},
                                                                      "required": ["word"]}}},
]


def sampled(seed: int, so: StructuredOutputsParams, max_tokens: int = 256) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, structured_outputs=so)


def test_sampled_json_regex_and_choice_outputs_are_valid(offline):
    params = [sampled(i, StructuredOutputsParams(json=SCHEMAS[i % len(SCHEMAS)])) for i in range(50)]
    params += [sampled(100 + i, StructuredOutputsParams(regex=REGEX)) for i in range(10)]
    params += [sampled(200 + i, StructuredOutputsParams(choice=CHOICES)) for i in range(10)]
    outs = offline.generate(["Once upon a time"] * len(params), params)
    for i, o in enumerate(outs[:50]):
        assert o.finish_reason == "stop", (i, o.text)
        jsonschema.validate(json.loads(o.text), SCHEMAS[i % len(SCHEMAS)])
    assert all(re.fullmatch(REGEX, o.text) and o.finish_reason == "stop" for o in outs[50:60]), [o.text for o in outs[50:60]]
    assert all(o.text in CHOICES for o in outs[60:]), [o.text for o in outs[60:]]
    assert len({o.text for o in outs[:50]}) > 25  # sampled, not one fixed answer


def test_unconstrained_rows_are_unchanged_beside_constrained_ones(offline):
    prompts = ["The river town", "Hello there", "A cat sat"]
    greedy = SamplingParams(max_tokens=16, temperature=0)
    alone = [o.token_ids for o in offline.generate(prompts, greedy)]
    mixed = offline.generate(prompts + prompts, [greedy] * 3 + [sampled(i, StructuredOutputsParams(json=SCHEMAS[i])) for i in range(3)])
    assert [o.token_ids for o in mixed[:3]] == alone
    assert all(o.finish_reason == "stop" for o in mixed[3:])


def test_matchers_survive_preemption_and_chunked_prefill(tiny_model):
    """Seeded constrained outputs are the same on a roomy engine and on a cramped one that
    preempts (recomputing prompt + output) and prefills in small chunks; all stay valid."""
    from llmserve.engine.llm import LLM

    rng = random.Random(5)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randint(40, 100))] for _ in range(8)]
    digits = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 30, "maxItems": 30}
    params = [sampled(i, StructuredOutputsParams(json=digits), max_tokens=120) for i in range(len(prompts))]
    roomy = [o.text for o in LLM(tiny_model, dtype="float32", num_threads=1).generate(prompts, params)]
    cramped = LLM(tiny_model, dtype="float32", num_threads=1, num_blocks=30, block_size=8, max_num_batched_tokens=32)
    got = [o.text for o in cramped.generate(prompts, params)]
    assert cramped.get_stats().num_preemptions > 0
    assert got == roomy
    for text in got:
        jsonschema.validate(json.loads(text), digits)


def test_n_logprobs_and_stop_strings_with_a_grammar(server):
    body = {"prompt": "x", "n": 4, "max_tokens": 40, "temperature": 1, "seed": 11, "logprobs": 2, "structured_outputs": {"choice": CHOICES}}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    assert len(r["choices"]) == 4 and all(c["text"] in CHOICES and c["finish_reason"] == "stop" for c in r["choices"])
    assert all("".join(c["logprobs"]["tokens"]) == c["text"] and len(c["logprobs"]["top_logprobs"][0]) >= 2 for c in r["choices"])
    # a stop string inside the structure ends the output there, and is not shown
    body = {"prompt": "x", "max_tokens": 40, "temperature": 0, "stop": ["depends"], "structured_outputs": {"choice": ["it depends"]}}
    c = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert (c["text"], c["finish_reason"], c["stop_reason"]) == ("it ", "stop", "depends")


def test_http_routes_take_every_spelling(server):
    schema = SCHEMAS[0]
    bodies = {
        "/v1/chat/completions": [{"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}},
                                 {"messages": USER, "guided_json": schema},
                                 {"messages": USER, "response_format": {"type": "json_object"}}],
        "/v1/completions": [{"prompt": "x", "structured_outputs": {"json": json.dumps(schema)}},
                            {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}}],
        "/generate": [{"prompt": "x", "structured_outputs": {"json": schema}}],
    }
    for path, variants in bodies.items():
        for seed, body in enumerate(variants):
            r = httpx.post(server.url + path, json={**body, "max_tokens": 200, "temperature": 1, "seed": seed}, timeout=120)
            assert r.status_code == 200, (path, body, r.text)
            doc = r.json()
            text = doc["generated_text"] if path == "/generate" else doc["choices"][0].get("message", doc["choices"][0]).get("content") or doc["choices"][0].get("text")
            if "json_object" in json.dumps(body):  # any object: a random model may write one until max_tokens
                assert text.startswith("{") and (doc["choices"][0]["finish_reason"] == "length" or isinstance(json.loads(text), dict))
            else:
                jsonschema.validate(json.loads(text), schema)
    for kind, so, check in (("regex", {"regex": REGEX}, lambda t: re.fullmatch(REGEX, t)), ("choice", {"guided_choice": CHOICES}, lambda t: t in CHOICES)):
        body = {"prompt": "x", "max_tokens": 40, "temperature": 1, "seed": 3, **(so if kind == "choice" else {"structured_outputs": so})}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and check(r.json()["choices"][0]["text"]), r.text


class Pet(BaseModel):
    name: str = Field(max_length=10)
    legs: int = Field(ge=0, le=8)
    kind: str = Field(pattern="^(cat|dog|bird)$")


def test_openai_client_parse_returns_the_model(server, client):
    r = client.chat.completions.parse(model=server.model, messages=USER, response_format=Pet, max_tokens=200, temperature=1, seed=4)
    pet = r.choices[0].message.parsed
    assert isinstance(pet, Pet) and 0 <= pet.legs <= 8 and pet.kind in ("cat", "dog", "bird")


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "shout"}}], ids=["required", "named"])
def test_tool_calls_validate_and_stream_to_the_same_call(server, client, tool_choice):
    kw = dict(model=server.model, messages=USER, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False,
              max_tokens=200, temperature=1, seed=7)
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c
    call = c.message.tool_calls[0]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    if isinstance(tool_choice, dict):
        assert call.function.name == "shout"
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    assert call.id.startswith("call_") and call.type == "function"
    # streamed, the deltas reassemble to the same call
    name, args, finish = None, "", None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for d in chunk.choices[0].delta.tool_calls or []:
            assert d.index == 0
            name = d.function.name or name
            args += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (name, args, finish) == (call.function.name, call.function.arguments, "tool_calls")


def test_auto_parses_hermes_calls_and_history_is_accepted(server, client):
    # a grammar stands in for a model that decides to call a tool: "auto" parses what it wrote
    grammar = 'start: "Sure. <tool_call>\\n{\\"name\\": \\"add\\", \\"arguments\\": {\\"a\\": 1, \\"b\\": 2}}\\n</tool_call>"'
    r = client.chat.completions.create(model=server.model, messages=USER, tools=TOOLS, max_tokens=60, temperature=0,
                                       extra_body={"structured_outputs": {"grammar": grammar}})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Sure. "
    assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == [("add", {"a": 1, "b": 2})]
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [t.model_dump() for t in c.message.tool_calls]},
               {"role": "tool", "tool_call_id": c.message.tool_calls[0].id, "content": "3"}]
    follow = client.chat.completions.create(model=server.model, messages=history, tools=TOOLS, tool_choice="none", max_tokens=4, temperature=0)
    assert follow.choices[0].finish_reason in ("stop", "length") and follow.choices[0].message.tool_calls is None


def test_tools_reach_a_template_that_takes_them(tiny_model, tmp_path):
    """A chat template that renders `tools` gets them; one that does not (the tiny model's)
    gets them in a system message instead."""
    from llmserve.server.tools import plan_tools, with_tools
    from llmserve.tokenizer import Tokenizer

    plan = plan_tools(TOOLS, "auto", True)
    plain = Tokenizer(Path(tiny_model))
    msgs, template_tools = with_tools(list(USER), plan, plain.takes_tools)
    assert not plain.takes_tools and template_tools is None
    assert msgs[0]["role"] == "system" and '"name": "add"' in msgs[0]["content"] and msgs[1:] == USER
    model = tmp_path / "with-tools"
    shutil.copytree(tiny_model, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% if tools %}<|im_start|>system\nTOOLS {{ tools | tojson }}<|im_end|>\n{% endif %}" + config["chat_template"]
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer(model)
    msgs, template_tools = with_tools(list(USER), plan, tok.takes_tools)
    assert tok.takes_tools and msgs == USER and [t["function"]["name"] for t in template_tools] == ["add", "shout"]
    text = tok.decode(tok.apply_chat_template(msgs, True, template_tools), skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nTOOLS [") and '"shout"' in text


CHAT = "/v1/chat/completions"
ERRORS = [
    ("malformed schema", CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}}, "response_format"),
    ("unknown type", CHAT, {"structured_outputs": {"json": {"type": "objekt"}}}, "structured_outputs"),
    ("unsupported keyword", CHAT, {"guided_json": {"type": "string", "format": "no-such-format"}}, "guided_json"),
    ("schema missing", CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ("unknown response_format", CHAT, {"response_format": {"type": "yaml"}}, "response_format.type"),
    ("empty choice", CHAT, {"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ("empty guided_choice", "/v1/completions", {"prompt": "x", "guided_choice": []}, "guided_choice"),
    ("bad regex", CHAT, {"structured_outputs": {"regex": "(("}}, "structured_outputs"),
    ("bad grammar", "/generate", {"prompt": "x", "structured_outputs": {"grammar": "start: missing_rule"}}, "structured_outputs"),
    ("bad GBNF", CHAT, {"guided_grammar": "root ::= ("}, "guided_grammar"),
    ("two kinds", CHAT, {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ("response_format and structured_outputs", CHAT, {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ("unknown tool in tool_choice", CHAT, {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ("tool_choice without tools", CHAT, {"tool_choice": "required"}, "tool_choice"),
    ("bad tool_choice", CHAT, {"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ("tool not a function", CHAT, {"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ("tool name", CHAT, {"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools[0].function.name"),
    ("tools required with a format", CHAT, {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
]


def test_bad_structures_get_a_400_naming_the_parameter(server):
    for name, path, body, param in ERRORS:
        body = {**({"messages": USER} if path == CHAT else {}), **body}
        r = httpx.post(server.url + path, json={"max_tokens": 4, **body}, timeout=60)
        assert r.status_code == 400, (name, r.status_code, r.text)
        assert r.json()["error"]["param"] == param, (name, r.json())
    assert server.stats().num_running == 0 and server.ctx.client.alive
