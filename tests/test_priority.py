"""--scheduling-policy priority: better requests start at once and finish first, preempting the
worst running ones (their greedy tokens unchanged); fcfs serves the same workload in arrival
order and refuses a priority other than 0."""

from __future__ import annotations

import pytest
from test_engine_reference import prompts

from llmserve import LLM, SamplingParams
from llmserve.errors import InvalidRequestError

LOW = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
HIGH = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def run(tiny_model, policy: str, high_priority: int):
    """16 long low-priority requests fill the batch; after 3 steps 4 short ones arrive. Returns
    (engine, requests by id, the order they finished in, whether each late one ran in the step after it arrived)."""
    eng = LLM(tiny_model, dtype="float32", max_num_seqs=16, scheduling_policy=policy).engine
    reqs = {f"low{i}": eng.add_request(f"low{i}", p, LOW, priority=0 if policy == "fcfs" else 1)
            for i, p in enumerate(prompts(16, seed=11, lo=10, hi=40))}
    finished = []
    for _ in range(3):
        finished += [o.request_id for o in eng.step() if o.finished]
    late = {f"high{i}": eng.add_request(f"high{i}", p, HIGH, priority=high_priority)
            for i, p in enumerate(prompts(4, seed=12, lo=5, hi=15))}
    finished += [o.request_id for o in eng.step() if o.finished]
    started_at_once = [r.num_computed_tokens > 0 for r in late.values()]
    while eng.has_unfinished_requests():
        finished += [o.request_id for o in eng.step() if o.finished]
    return eng, {**reqs, **late}, finished, started_at_once


def test_better_requests_start_at_once_and_finish_first(tiny_model):
    eng, reqs, finished, started = run(tiny_model, "priority", high_priority=0)
    assert all(started)
    assert set(finished[:4]) == {f"high{i}" for i in range(4)}
    preempted = [rid for rid, r in reqs.items() if r.num_preemptions]
    assert len(preempted) >= 4 and all(rid.startswith("low") for rid in preempted)
    assert eng.get_stats().num_blocks_used == 0
    # greedy tokens of the preempted requests equal those of an undisturbed run
    alone = LLM(tiny_model, dtype="float32", max_num_seqs=16)
    low_prompts = prompts(16, seed=11, lo=10, hi=40)
    expect = [o.token_ids for o in alone.generate(low_prompts, LOW)]
    for rid in preempted:
        assert reqs[rid].output_token_ids == expect[int(rid.removeprefix("low"))]


def test_fcfs_serves_in_arrival_order(tiny_model):
    _, reqs, finished, started = run(tiny_model, "fcfs", high_priority=0)
    assert not any(started)  # the batch is full: they wait their turn
    assert not any(r.num_preemptions for r in reqs.values())
    assert finished.index("high0") > min(finished.index(f"low{i}") for i in range(16))


def test_priority_is_checked(tiny_model):
    fcfs = LLM(tiny_model, dtype="float32").engine
    with pytest.raises(InvalidRequestError, match="--scheduling-policy priority") as e:
        fcfs.add_request("a", [5, 6, 7], HIGH, priority=-1)
    assert e.value.param == "priority"
    prio = LLM(tiny_model, dtype="float32", scheduling_policy="priority").engine
    for bad in ("1", 1.5, True, None):
        with pytest.raises(InvalidRequestError, match="priority must be an integer"):
            prio.add_request("b", [5, 6, 7], HIGH, priority=bad)
    assert prio.add_request("c", [5, 6, 7], HIGH, priority=-3).priority == -3


def test_every_route_takes_priority_over_http(tiny_model):
    import httpx
    from server_harness import live_server

    with live_server(tiny_model, scheduling_policy="priority") as s, httpx.Client(base_url=s.url, timeout=60) as c:
        user = [{"role": "user", "content": "hi"}]
        for path, body in (("/v1/completions", {"prompt": "a b", "max_tokens": 3, "priority": -2}),
                           ("/v1/chat/completions", {"messages": user, "max_tokens": 3, "priority": 7}),
                           ("/generate", {"prompt": "a b", "max_tokens": 3, "priority": 1})):
            r = c.post(path, json=body)
            assert r.status_code == 200, (path, r.text[:300])
        r = c.post("/v1/completions", json={"prompt": "a", "max_tokens": 3, "priority": 1.5})
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
