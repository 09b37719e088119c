"""The engine core in its own process: the server reaches it only through the door
(llmserve.engine.client), and the core's death fails every request cleanly, turns /health 503 and
makes the server exit non-zero."""

from __future__ import annotations

import ast
import concurrent.futures
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from server_harness import live_server, server_process, sse_data, wait_for

from llmserve.engine.client import (
    EngineClient,
    EngineCoreRequest,
    EngineStats,
    InFlight,
    RequestOutput,
)
from llmserve.errors import EngineOverloadedError, InvalidRequestError
from llmserve.sampling import SamplingParams

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[1]
DOOR = {"llmserve.engine.client", "llmserve.engine.outputs"}  # what server/ may import of the engine
ENGINE_INTERNALS = ("engine_core", "llm_engine", "scheduler", "block_manager", "model_runner", "sampler", "detokenizer", "request", "llm")


def _engine_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names if node.module == "llmserve.engine"}
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
    return {n for n in names if n.startswith("llmserve.engine")}


def test_server_reaches_the_engine_only_through_the_door():
    files = sorted((ROOT / "llmserve" / "server").glob("*.py"))
    assert files
    used = {f.name: _engine_imports(f) for f in files}
    assert {f: m - DOOR for f, m in used.items() if m - DOOR} == {}
    assert any(used.values())  # the check sees the imports it polices
    # and at run time: the whole server loads none of the engine's internals, nor the model
    code = "import sys, llmserve.server.app, llmserve.cli; print(' '.join(sorted(sys.modules)))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout.split()
    assert "llmserve.engine.client" in loaded
    internals = [m for m in loaded if m.startswith("llmserve.model") or m in {f"llmserve.engine.{n}" for n in ENGINE_INTERNALS}]
    assert internals == []


def test_observability_and_the_router_import_no_engine_internals():
    """profiling.py and tracing.py read the door's records only; the Ray router hashes prefixes
    with the pure block_hash module, not the block manager; the block manager loads no torch."""
    for name in ("profiling.py", "tracing.py"):
        assert _engine_imports(ROOT / "llmserve" / name) - DOOR == set(), name
    router = _engine_imports(ROOT / "llmserve" / "ray_serve" / "router.py")
    assert "llmserve.engine.block_hash" in router and "llmserve.engine.block_manager" not in router
    code = "import sys, llmserve.engine.block_manager; print(' '.join(sorted(sys.modules)))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout.split()
    assert "llmserve.engine.block_manager" in loaded and "torch" not in loaded


def test_sigkill_of_the_core_ends_every_request_and_the_server_exits_nonzero(tiny_model, tmp_path):
    long = {"max_tokens": 900, "temperature": 0, "ignore_eos": True}
    requests = [
        ("/v1/completions", {"prompt": "Hello there", "stream": True, **long}),
        ("/v1/completions", {"prompt": "The river town", "stream": True, **long}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True, **long}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "yo"}], "stream": True, **long}),
        ("/generate", {"prompt": "Hello", "stream": True, **long}),
        ("/generate", {"prompt": "Good day", "stream": True, **long}),
        ("/v1/completions", {"prompt": "Not streamed", "stream": False, **long}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "whole"}], **long}),
    ]
    with server_process(tiny_model, tmp_path / "server.log", "--max-num-seqs", "8") as server:
        core = server.core_pid()
        results: list = [None] * len(requests)
        ended_at = [0.0] * len(requests)
        first_data = threading.Barrier(sum(b["stream"] for _, b in requests if b.get("stream")) + 1, timeout=60)

        def run(i: int, path: str, body: dict) -> None:
            try:
                if body.get("stream"):
                    with httpx.stream("POST", server.url + path, json=body, timeout=30) as r:
                        lines = r.iter_lines()
                        first = next(line for line in lines if line.startswith("data:"))
                        first_data.wait()
                        results[i] = [first[5:].strip(), *sse_data(lines)]
                else:
                    r = httpx.post(server.url + path, json=body, timeout=30)
                    results[i] = (r.status_code, r.json())
            except BaseException as e:  # noqa: BLE001 - reported by the asserts below
                results[i] = e
            ended_at[i] = time.monotonic()

        threads = [threading.Thread(target=run, args=(i, p, b)) for i, (p, b) in enumerate(requests)]
        for t in threads:
            t.start()
        first_data.wait()
        wait_for(lambda: httpx.get(server.url + "/stats", timeout=10).json()["engine"]["num_running"] == len(requests),
                 30, "not every request reached the engine")
        os.kill(core, signal.SIGKILL)
        killed_at = time.monotonic()
        for t in threads:
            t.join(10)
        health = httpx.get(server.url + "/health", timeout=5)
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"

        for (path, body), got, end in zip(requests, results, ended_at, strict=True):
            assert end - killed_at < 5, (path, got)
            if body.get("stream"):
                assert isinstance(got, list), (path, got)
                if path != "/generate":
                    assert got[-1] == "[DONE]"
                    got = got[:-1]
                error = json.loads(got[-1])["error"]
            else:
                assert isinstance(got, tuple) and got[0] == 503, (path, got)
                error = got[1]["error"]
            assert error["type"] == "service_unavailable" and "engine core process died" in error["message"], error
        assert server.proc.wait(15) != 0


def test_an_unreadable_request_is_refused_and_the_core_carries_on(tiny_model):
    """A message the core cannot decode (a server-side bug) fails that one request, not the core."""
    with live_server(tiny_model) as s:
        got: concurrent.futures.Future = concurrent.futures.Future()

        def add() -> None:  # on the server's loop, as the routes call it
            bad = EngineCoreRequest("bad-0", ["not a token id"], SamplingParams(max_tokens=4), 4, time.time())  # type: ignore[list-item]
            s.ctx.client.add_request(bad, got.set_result)

        s.ctx.loop.call_soon_threadsafe(add)
        err = got.result(timeout=10)
        assert isinstance(err, InvalidRequestError) and "could not read the request" in err.message
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "temperature": 0}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert s.ctx.client.alive and s.ctx.client.num_in_flight() == 0 and s.ctx.stats.num_waiting == 0


DOOR_MEMBERS = {
    name for name in vars(EngineClient) if not name.startswith("_")
} | set(EngineClient.__annotations__)


def _door_uses(path: Path) -> set[str]:
    """Attributes read off `client` / `ctx.client` / `self.client` in one file."""
    used = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id == "client") or (isinstance(owner, ast.Attribute) and owner.attr == "client"):
                used.add(node.attr)
    return used


def test_the_server_uses_the_door_and_nothing_else():
    """The door is add/abort requests, outputs to sinks, stats when asked, info, step events and
    the life cycle; no server module reaches past it (no sinks, no per-step stats attribute)."""
    assert {"sinks", "stats", "step_listeners", "num_waiting"}.isdisjoint(DOOR_MEMBERS)
    files = [*(ROOT / "llmserve" / "server").glob("*.py"), ROOT / "llmserve" / "ray_serve" / "app.py"]
    for path in files:
        assert _door_uses(path) <= DOOR_MEMBERS, (path.name, _door_uses(path) - DOOR_MEMBERS)
    assert _door_uses(ROOT / "llmserve" / "server" / "app.py") >= {"add_step_listener", "info"}


def test_the_queue_depth_is_counted_once_in_the_front_end():
    """A request waits from add_request until its first output (or its abort); the 429 limits
    count those requests and their prompt tokens."""
    requests = InFlight(max_waiting=2, max_waiting_tokens=10)
    got: list = []
    def make(rid: str, n: int) -> SimpleNamespace:  # what InFlight reads of an EngineCoreRequest
        return SimpleNamespace(request_id=rid, prompt_token_ids=list(range(1, n + 1)))

    requests.admit(make("a", 6), got.append)
    with pytest.raises(EngineOverloadedError):
        requests.admit(make("b", 5), got.append)  # 11 prompt tokens would wait
    requests.admit(make("b", 4), got.append)
    with pytest.raises(EngineOverloadedError):
        requests.admit(make("c", 1), got.append)  # 3 requests would wait
    requests.deliver(RequestOutput("a", [7], "x", [], False, None, None, 6, 1, 0, 0.0))  # a runs
    assert (requests.num_waiting, requests.waiting_tokens, len(requests)) == (1, 4, 2)
    requests.admit(make("c", 1), got.append)
    assert requests.forget("b") and not requests.forget("b")
    # the stats report what is in flight and not running: c, whether it waits or is preempted
    assert requests.stats(EngineStats.idle()).num_waiting == 2
    assert requests.stats(dataclasses.replace(EngineStats.idle(), num_running=1)).num_waiting == 1
    requests.deliver(RequestOutput("a", [8], "y", [], True, "length", None, 6, 2, 0, 0.0))
    assert (requests.num_waiting, requests.waiting_tokens, len(requests)) == (1, 1, 1)
    assert requests.stats(dataclasses.replace(EngineStats.idle(), num_running=3)).num_waiting == 0
    assert [o.new_text for o in got] == ["x", "y"]
