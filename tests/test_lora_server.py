"""LoRA adapters over HTTP: named in `model` on every route, listed by /v1/models, loaded and
unloaded at run time, kept apart in the response cache, the prefix cache and the Redis KV tier,
and answers equal to peft's PeftModel.generate."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch
from server_harness import live_server
from test_lora import adapters, reference  # noqa: F401  (the module's adapters fixture)

pytestmark = pytest.mark.timeout(600)
PROMPT = "The river town had a mill, a bridge and a market square, and every morning"  # over two KV blocks


def peft_tokens(tiny_model: str, folder: str | None, prompt_ids: list[int], n: int) -> list[int]:
    ref = reference(tiny_model, folder)
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


@pytest.fixture(scope="module")
def server(tiny_model, adapters):  # noqa: F811
    modules = [f"attn={adapters['attn']}", json.dumps({"name": "mlp", "path": adapters["mlp"], "base_model_name": None})]
    with live_server(tiny_model, enable_lora=True, max_loras=2, lora_modules=modules, allow_runtime_lora=True) as s:
        yield s


def complete(server, model: str, **kw) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "return_tokens_as_token_ids": True, **kw}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=60)


def ids_of(r: httpx.Response) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in r.json()["choices"][0]["logprobs"]["tokens"]]


def test_models_lists_adapters_with_their_base(server, adapters):  # noqa: F811
    cards = {c["id"]: c for c in httpx.get(server.url + "/v1/models").json()["data"]}
    assert cards["attn"]["parent"] == cards["mlp"]["parent"] == server.model
    assert cards["attn"]["root"] == adapters["attn"] and cards[server.model]["parent"] is None


def test_each_adapter_answers_as_peft_and_the_base_as_itself(server, tiny_model, adapters):  # noqa: F811
    prompt_ids = server.ctx.tokenizer.encode(PROMPT)
    answers = {}
    for model, folder in ((server.model, None), ("attn", adapters["attn"]), ("mlp", adapters["mlp"])):
        r = complete(server, model)
        assert r.status_code == 200, r.text
        answers[model] = ids_of(r)
        assert answers[model] == peft_tokens(tiny_model, folder, prompt_ids, 6), model
    assert len({tuple(a) for a in answers.values()}) == 3
    messages = [{"role": "user", "content": "hi"}]
    template_ids = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()["tokens"]
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    chat = client.chat.completions.create(model="attn", messages=messages, max_tokens=4, temperature=0, logprobs=True,
                                          extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    assert [int(t.token.removeprefix("token_id:")) for t in chat.choices[0].logprobs.content] == \
        peft_tokens(tiny_model, adapters["attn"], template_ids, 4)
    assert chat.model == "attn"  # the name asked for, as vLLM reports it
    r = httpx.post(server.url + "/generate", json={"model": "mlp", "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True})
    assert r.json()["token_ids"] == answers["mlp"]


def test_caches_never_cross_adapters(server):
    """The response cache and the prefix cache: an adapter never reads the base's entries or blocks."""
    prompt = "A lighthouse keeper counted the ships each night and wrote their names in a long blue book"  # new here
    first = complete(server, server.model, prompt=prompt)
    again = complete(server, server.model, prompt=prompt)
    assert again.headers["x-llmserve-cache"] == "hit" and ids_of(again) == ids_of(first)
    other = complete(server, "attn", prompt=prompt)
    assert other.headers["x-llmserve-cache"] == "miss" and ids_of(other) != ids_of(first)
    assert other.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # the base's blocks are not its own
    fresh = complete(server, "attn", prompt=prompt, cache=False)
    assert fresh.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # its own blocks are
    assert complete(server, "attn", prompt=prompt).headers["x-llmserve-cache"] == "hit"  # and its own answer


def test_runtime_load_reload_and_unload(server, adapters, tiny_model):  # noqa: F811
    url = server.url
    prompt_ids = server.ctx.tokenizer.encode(PROMPT)
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "live", "lora_path": adapters["attn"]})
    assert r.status_code == 200, r.text
    before = complete(server, "live", cache=True)
    assert ids_of(before) == peft_tokens(tiny_model, adapters["attn"], prompt_ids, 6)
    assert httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "live", "lora_path": adapters["all"]}).status_code == 400
    assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "live"}).status_code == 200
    assert complete(server, "live").status_code == 404
    assert httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "live", "lora_path": adapters["all"]}).status_code == 200
    after = complete(server, "live", cache=True)  # the same name, new weights: nothing of the old one is reused
    assert after.headers["x-llmserve-cache"] == "miss"
    assert ids_of(after) == peft_tokens(tiny_model, adapters["all"], prompt_ids, 6) != ids_of(before)
    httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "live"})


def test_bad_adapters_get_4xx_naming_the_field(server, adapters, tmp_path):  # noqa: F811
    config = json.loads(open(f"{adapters['attn']}/adapter_config.json").read())
    dora = tmp_path / "dora"
    dora.mkdir()
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    (dora / "adapter_model.safetensors").write_bytes(open(f"{adapters['attn']}/adapter_model.safetensors", "rb").read())
    cases = [({"lora_name": "x", "lora_path": str(tmp_path / "missing")}, 404, "lora_path"),
             ({"lora_name": "x", "lora_path": str(dora)}, 400, "use_dora"),
             ({"lora_name": "attn", "lora_path": adapters["attn"]}, 400, "lora_name"),
             ({"lora_name": server.model, "lora_path": adapters["attn"]}, 400, "lora_name"),
             ({"lora_name": "x"}, 400, "lora_path")]
    for body, status, param in cases:
        r = httpx.post(server.url + "/v1/load_lora_adapter", json=body)
        assert r.status_code == status and r.json()["error"]["param"] == param, (body, r.text)
    r = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "nobody"})
    assert r.status_code == 404
    assert complete(server, "nobody").status_code == 404


def test_lora_metrics(server):
    complete(server, "attn")
    text = httpx.get(server.url + "/metrics").text
    line = next(x for x in text.splitlines() if x.startswith("llmserve:lora_requests_info{"))
    assert 'max_lora="2"' in line


def test_redis_kv_tier_keeps_adapters_apart(tiny_model, adapters, redis_server):  # noqa: F811
    """Two servers share one Redis: the base's blocks written by one are read by the other for
    the base, never for an adapter."""
    opts = dict(enable_lora=True, lora_modules=[f"attn={adapters['attn']}"], redis_url=redis_server.url, redis_timeout=1.0,
                response_cache=False)
    with live_server(tiny_model, **opts) as a:  # its queued Redis writes are sent when it stops
        assert complete(a, a.model).status_code == 200
    with live_server(tiny_model, **opts) as b:
        adapter = complete(b, "attn")
        base = complete(b, b.model)
        assert adapter.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert base.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_enable_lora_without_adapters_serves_the_base(tiny_model):
    with live_server(tiny_model, enable_lora=True) as s:
        r = complete(s, s.model)
        assert r.status_code == 200 and len(ids_of(r)) == 6
        assert complete(s, "attn").status_code == 404
