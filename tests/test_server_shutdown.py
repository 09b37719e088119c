"""`llmserve serve` as a subprocess: SIGTERM during active streams lets them finish or aborts
them after --shutdown-timeout; every stream still ends with a finish_reason (and [DONE] for the
OpenAI routes), new requests are refused, and the process exits 0."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from server_harness import sse_data, wait_for

pytestmark = pytest.mark.timeout(120)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_drains_streams_and_exits_0(tiny_model, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "llmserve.cli", "serve", "--model", tiny_model, "--port", str(port),
           "--shutdown-timeout", "1", "--num-threads", "1", "--log-level", "warning"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMSERVE_")}
    log = open(tmp_path / "server.log", "w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_for(lambda: proc.poll() is not None or _healthy(url), 60, "the server did not come up")
        assert proc.poll() is None, _tail(log)

        long = {"max_tokens": 1000, "temperature": 0, "ignore_eos": True, "stream": True}
        streams = [
            ("/v1/completions", {"prompt": "Hello there", **long}),
            ("/v1/completions", {"prompt": "The river town", **long}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **long}),
            ("/generate", {"prompt": "Hello", **long}),
        ]
        results: list[list[str] | BaseException] = [[] for _ in streams]
        started = threading.Barrier(len(streams) + 1, timeout=60)

        def consume(i: int, path: str, body: dict) -> None:
            try:
                with httpx.stream("POST", url + path, json=body, timeout=60) as r:
                    lines = r.iter_lines()
                    first = next(line for line in lines if line.startswith("data:"))
                    started.wait()
                    results[i] = sse_data([first, *lines])
            except BaseException as e:  # noqa: BLE001 - reported below
                results[i] = e
                started.abort()

        threads = [threading.Thread(target=consume, args=(i, p, b), daemon=True) for i, (p, b) in enumerate(streams)]
        for t in threads:
            t.start()
        started.wait()  # every stream has its first chunk
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)  # the listening socket closes: no new requests
        try:
            late = httpx.post(url + "/v1/completions", json={"prompt": "late", "max_tokens": 2}, timeout=5)
        except httpx.TransportError:
            pass  # the listening socket is closed
        else:
            assert late.status_code == 503, late.text  # raced the close: refused, not served
        for t in threads:
            t.join(30)
        assert proc.wait(30) == 0, _tail(log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)

    for (path, _), data in zip(streams, results, strict=True):
        assert isinstance(data, list), (path, data)
        if path == "/generate":
            final = json.loads(data[-1])
            reason = final["finish_reason"]
            assert final["usage"]["completion_tokens"] == len(data) - 1
        else:
            assert data[-1] == "[DONE]", (path, data[-3:])
            reason = json.loads(data[-2])["choices"][0]["finish_reason"]
        assert reason in ("abort", "length"), (path, reason)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _tail(log) -> str:
    log.seek(0)
    return log.read()[-3000:]
