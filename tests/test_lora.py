"""LoRA adapters against peft's PeftModel on the tiny model, with adapters whose B is not zero
(init_lora_weights=False), so an adapter that is not applied fails: fp32 logits within 1e-4 for
prefill, decode and a mixed step where rows of three adapters and the base share the batch;
greedy tokens equal to PeftModel.generate through the engine, eager and compiled; the checks
that refuse what cannot be served."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_model_logits import Paged
from transformers import AutoModelForCausalLM

from llmserve import kernels
from llmserve.engine.llm import LLM
from llmserve.errors import InvalidRequestError
from llmserve.lora.adapter import LoRAAdapterError, LoRANotFoundError, load_adapter
from llmserve.lora.layers import LoRABatch, num_slots
from llmserve.lora.manager import LoRAManager, base_shapes
from llmserve.lora.request import LoRARequest
from llmserve.model.config import ModelConfig
from llmserve.model.loader import load_model
from llmserve.sampling import SamplingParams

pytestmark = pytest.mark.timeout(600)
TOL = 1e-4
# two ranks, three sets of target modules (one with per-module ranks and rsLoRA)
ADAPTERS = {
    "attn": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj"]),
    "mlp": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["gate_proj", "up_proj", "down_proj", "k_proj"],
                rank_pattern={"down_proj": 2}, alpha_pattern={"k_proj": 3}),
    "all": dict(r=16, lora_alpha=32, target_modules="(.*\\.)?(q|k|v|o|gate|up|down)_proj"),
}


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory) -> dict[str, str]:
    """name -> folder, each saved by peft from seeded random (nonzero) A and B."""
    from peft import (  # here: importing peft imports triton, which must wait for
        LoraConfig,
        get_peft_model,
    )
    # test_triton_attention to switch Triton to its interpreter at collection
    folders = {}
    for seed, (name, cfg) in enumerate(ADAPTERS.items()):
        torch.manual_seed(seed + 1)
        base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
        peft_model = get_peft_model(base, LoraConfig(init_lora_weights=False, **cfg))
        with torch.no_grad():  # B at a scale where every adapter moves the logits well past the tolerance
            for n, p in peft_model.named_parameters():
                if "lora_B" in n:
                    p.mul_(0.5)
        folders[name] = str(tmp_path_factory.mktemp(f"lora-{name}"))
        peft_model.save_pretrained(folders[name])
    return folders


def reference(tiny_model: str, folder: str | None):
    from peft import PeftModel
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    return base if folder is None else PeftModel.from_pretrained(base, folder).eval()


def ref_logits(ref, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([tokens])).logits[0].float()


def requests(adapters: dict[str, str]) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(adapters.items())}


@pytest.mark.parametrize("lora_path", ["torch", "native"])
def test_logits_of_mixed_steps_match_peft(tiny_model, adapters, lora_path):
    """Four sequences (three adapters and the base) prefill together, decode together, then a
    mixed step: every row's logits equal its own reference's, with the deltas from torch ops and
    from llmserve::lora_add."""
    cfg = ModelConfig.from_file(Path(tiny_model) / "config.json")
    model = load_model(tiny_model, torch.float32)
    manager = LoRAManager(model.enable_lora(num_slots(4), 16), base_shapes(cfg), 4, 4, 16)
    if lora_path == "native":
        if not kernels.load():
            pytest.skip("the native kernels do not build here")
        model.use_native_lora(True)
    lreqs = requests(adapters)
    names = [*ADAPTERS, None]  # sequence i runs under names[i]
    refs = [reference(tiny_model, adapters[n] if n else None) for n in names]
    slot_of = manager.prepare({r.lora_int_id: manager.adapter(r) for r in lreqs.values()})
    slot = [slot_of[lreqs[n].lora_int_id] if n else -1 for n in names]
    k = len(lreqs)
    paged = Paged(model)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 1000, (n,), generator=gen).tolist() for n in (9, 14, 6, 11)]

    def step(chunks):
        rows = torch.tensor([slot[s] for s, toks in chunks for _ in toks])
        return paged.run(chunks, LoRABatch.of(rows, torch.arange(k), torch.float32, model.lora_widths))

    outs = step([(i, s) for i, s in enumerate(seqs)])  # prefill, all four at once
    for i, s in enumerate(seqs):
        torch.testing.assert_close(outs[i], ref_logits(refs[i], s), atol=TOL, rtol=0)
    for t in range(2):  # decodes
        new = [[7 + t + i] for i in range(4)]
        outs = step([(i, new[i]) for i in range(4)])
        for i in range(4):
            seqs[i] = seqs[i] + new[i]
            torch.testing.assert_close(outs[i][-1], ref_logits(refs[i], seqs[i])[-1], atol=TOL, rtol=0)
    chunk = [40, 41, 42]  # mixed: decodes of 0 and 2, a chunk for 1 and 3
    outs = step([(0, [5]), (2, [6]), (1, chunk), (3, chunk)])
    for (i, toks), out in zip([(0, [5]), (2, [6]), (1, chunk), (3, chunk)], outs, strict=True):
        seqs[i] = seqs[i] + toks
        torch.testing.assert_close(out, ref_logits(refs[i], seqs[i])[-len(toks):], atol=TOL, rtol=0)
    base_only = ref_logits(refs[3], seqs[0])[-1]  # an adapter that was not applied would give this
    assert (outs[0][-1] - base_only).abs().max() > 100 * TOL


@pytest.mark.parametrize("compile_mode", ["none", "inductor"])
def test_greedy_tokens_equal_peft_generate(tiny_model, adapters, compile_mode):
    """8 requests over three adapters and the base, in the same steps, eager and compiled."""
    lreqs = requests(adapters)
    plan = [lreqs["attn"], lreqs["mlp"], lreqs["all"], None, lreqs["all"], lreqs["attn"], None, lreqs["mlp"]]
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 1000, (int(n),), generator=gen).tolist() for n in torch.randint(4, 40, (8,), generator=gen)]
    llm = LLM(tiny_model, dtype="float32", compile=compile_mode, enable_lora=True, max_loras=3, num_threads=1)
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), lora_request=plan)
    finally:
        llm.close()
    for prompt, lora, out in zip(prompts, plan, outs, strict=True):
        ref = reference(tiny_model, adapters[lora.lora_name] if lora else None)
        with torch.no_grad():
            want = ref.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):]
        assert out.token_ids == want.tolist(), (lora and lora.lora_name, out.token_ids, want.tolist())


def test_adapters_that_cannot_be_served_are_refused_by_field(tiny_model, adapters, tmp_path):
    shapes = base_shapes(ModelConfig.from_file(Path(tiny_model) / "config.json"))
    config = json.loads(open(f"{adapters['attn']}/adapter_config.json").read())
    cases = [({"use_dora": True}, "use_dora"), ({"modules_to_save": ["lm_head"]}, "modules_to_save"), ({"bias": "all"}, "bias"),
             ({"target_modules": ["q_proj", "c_attn"]}, "target_modules"), ({"fan_in_fan_out": True}, "fan_in_fan_out"),
             ({"peft_type": "IA3"}, "peft_type")]
    weights = open(f"{adapters['attn']}/adapter_model.safetensors", "rb").read()
    for change, field in cases:
        folder = tmp_path / field
        folder.mkdir()
        (folder / "adapter_config.json").write_text(json.dumps({**config, **change}))
        (folder / "adapter_model.safetensors").write_bytes(weights)
        with pytest.raises(LoRAAdapterError) as e:
            load_adapter("x", str(folder), shapes, 16)
        assert e.value.param == field and field in e.value.message
    with pytest.raises(LoRAAdapterError) as e:  # rank 16 over a limit of 8
        load_adapter("x", adapters["all"], shapes, 8)
    assert e.value.param == "r" and "--max-lora-rank" in e.value.message
    with pytest.raises(LoRANotFoundError):
        load_adapter("x", str(tmp_path / "nowhere"), shapes, 16)
    (tmp_path / "torn").mkdir()
    (tmp_path / "torn" / "adapter_config.json").write_text(json.dumps(config))
    (tmp_path / "torn" / "adapter_model.safetensors").write_bytes(weights[: len(weights) // 2])
    with pytest.raises(LoRAAdapterError):
        load_adapter("x", str(tmp_path / "torn"), shapes, 16)
    a = load_adapter("attn", adapters["attn"], shapes, 16)
    assert a.rank == 8 and {(0, "qkv_proj", 0), (0, "qkv_proj", 2), (0, "o_proj", 0)} <= set(a.weights)
    assert not any(k[1] in ("gate_up_proj", "down_proj") for k in a.weights)


def test_lora_needs_enable_lora(tiny_model, adapters):
    llm = LLM(tiny_model, dtype="float32", compile="none", num_threads=1)
    try:
        with pytest.raises(InvalidRequestError, match="--enable-lora"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), lora_request=requests(adapters)["attn"])
    finally:
        llm.close()


def test_max_loras_bounds_every_step_and_starves_no_adapter(tiny_model, adapters):
    """With --max-loras 1, six requests over three adapters and the base: no step runs two
    adapters, every request finishes, and each gives the tokens it gives with room for all."""
    lreqs = requests(adapters)
    plan = [lreqs["attn"], lreqs["mlp"], None, lreqs["all"], lreqs["attn"], None]
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 1000, (12,), generator=gen).tolist() for _ in plan]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    roomy = LLM(tiny_model, dtype="float32", compile="none", enable_lora=True, max_loras=3, num_threads=1)
    want = [o.token_ids for o in roomy.generate(prompts, params, lora_request=plan)]
    roomy.close()
    llm = LLM(tiny_model, dtype="float32", compile="none", enable_lora=True, max_loras=1, num_threads=1)
    engine = llm.engine
    reqs = [engine.add_request(f"r{i}", p, params, lora_request=lora) for i, (p, lora) in enumerate(zip(prompts, plan, strict=True))]
    most = 0
    while engine.has_unfinished_requests():
        engine.step()
        running = {r.lora_request.lora_int_id for r in engine.scheduler.running if r.lora_request is not None}
        most = max(most, len(running))
    llm.close()
    assert most == 1
    assert [r.output_token_ids for r in reqs] == want


def test_ray_router_keys_prefixes_by_adapter():
    """The Ray ingress's prefix-aware router sends an adapter's prompts by the adapter's own blocks."""
    pytest.importorskip("ray.serve.request_router")
    from types import SimpleNamespace

    from llmserve.ray_serve.router import PrefixAwareRouter

    router = object.__new__(PrefixAwareRouter)
    router.block_size, router.prefix_blocks = 4, 2
    prompt = list(range(10, 22))

    def hashes(lora):
        return router.prefix_hashes(SimpleNamespace(args=[SimpleNamespace(prompt_token_ids=prompt, lora_request=lora)]))

    sql, sql_again = LoRARequest("sql", 1, "/a", "h1"), LoRARequest("sql", 7, "/b", "h1")
    assert len(hashes(None)) == 2 and hashes(sql) == hashes(sql_again)
    assert len({tuple(hashes(x)) for x in (None, sql, LoRARequest("sql", 2, "/a", "h2"))}) == 3


def test_a_better_request_waiting_for_an_adapter_slot_preempts_no_one(tiny_model, adapters):
    """Priority scheduling with the adapter bound: a better request whose adapter has no slot
    waits for one without the running requests being preempted for it step after step."""
    lreqs = requests(adapters)
    llm = LLM(tiny_model, dtype="float32", compile="none", enable_lora=True, max_loras=2, max_num_seqs=3, num_threads=1,
              scheduling_policy="priority", enable_prefix_caching=False)
    engine = llm.engine
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 1000, (20,), generator=gen).tolist()
    running = [engine.add_request(f"r{i}", prompt, params, priority=1, lora_request=lora)
               for i, lora in enumerate([lreqs["attn"], lreqs["mlp"], None])]
    for _ in range(3):
        engine.step()
    better = engine.add_request("better", prompt, params, priority=0, lora_request=lreqs["all"])
    while engine.has_unfinished_requests():
        engine.step()
    llm.close()
    assert engine.scheduler.num_preemptions <= 1
    assert all(len(r.output_token_ids) == 12 for r in [*running, better])


def test_lora_modules_from_the_environment_keep_json_and_spaces():
    from llmserve.config import ServerConfig, from_sources

    env = {"LLMSERVE_LORA_MODULES": """'{"name": "sql", "path": "/adapters/my sql"}' chat=/adapters/chat"""}
    assert from_sources(ServerConfig, env=env).lora_modules == ['{"name": "sql", "path": "/adapters/my sql"}', "chat=/adapters/chat"]
