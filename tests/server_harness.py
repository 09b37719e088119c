"""A real server on 127.0.0.1 with an ephemeral port: uvicorn in a background thread of the test
process over an engine-core process of its own (live_server), or all of `llmserve serve` as a
subprocess (server_process: e.g. replicas sharing one Redis, or a server whose exit code counts).

Either way the engine runs in its own process, as in production; live.stats() reads it through
GET /stats. Torch runs on one thread: on a shared 2-core machine, intra-op threads mostly wait
for each other.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import torch
import uvicorn
from redis_fixture import free_port

from llmserve.config import EngineConfig, ServerConfig, from_sources
from llmserve.engine.client import EngineCoreClient
from llmserve.engine.llm import LLM
from llmserve.engine.outputs import EngineStats
from llmserve.server.app import GracefulServer, create_app
from llmserve.server.context import ServerContext

ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}


@dataclasses.dataclass
class LiveServer:
    url: str
    ctx: ServerContext
    server: uvicorn.Server

    @property
    def model(self) -> str:
        return self.ctx.model_name

    def stats(self) -> EngineStats:
        """The engine's stats now, through GET /stats."""
        key = self.ctx.config.api_key
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return EngineStats(**httpx.get(self.url + "/stats", headers=headers, timeout=10).json()["engine"])


@contextlib.contextmanager
def torch_threads_restored() -> Iterator[None]:
    """Engines here set torch's (process-wide) thread count; give it back to later tests."""
    n = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(n)


@contextlib.contextmanager
def offline_llm(model_dir: str) -> Iterator[LLM]:
    """The offline reference, with the same engine settings as live_server."""
    with torch_threads_restored():
        yield LLM(model_dir, dtype="float32", num_threads=1)


@contextlib.contextmanager
def live_server(model_dir: str, **options) -> Iterator[LiveServer]:
    """options: any EngineConfig or ServerConfig field (e.g. max_num_seqs=2, max_waiting=2). The
    engine runs float32, eager, unless options say otherwise: the references tests compare with
    are float32, whatever dtype `auto` picks on this CPU."""
    engine_opts = {"num_threads": 1, "dtype": "float32", "compile": "none", **{k: v for k, v in options.items() if k in ENGINE_FIELDS}}
    server_opts = {"log_level": "warning", **{k: v for k, v in options.items() if k not in ENGINE_FIELDS}}
    server_config = from_sources(ServerConfig, env={}, **server_opts)
    client = EngineCoreClient.launch(from_sources(EngineConfig, env={}, model=model_dir, **engine_opts),
                                 server_config.log_level, server_config.max_waiting, server_config.max_waiting_tokens)
    try:
        app = create_app(client, server_config)
    except BaseException:
        client.close()
        raise
    # proto IPPROTO_TCP, as uvicorn binds its own: asyncio sets TCP_NODELAY only on such sockets
    # (without it, a JSON reply on a kept-alive connection waits ~40 ms for a delayed ACK)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level=server_opts["log_level"], lifespan="on", timeout_graceful_shutdown=5)
    server = GracefulServer(config, app.state.ctx)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="test-uvicorn", daemon=True)
    thread.start()
    wait_for(lambda: server.started or not thread.is_alive(), 60, "the server did not start")
    assert thread.is_alive(), "the server thread died during startup"
    try:
        yield LiveServer(f"http://127.0.0.1:{port}", app.state.ctx, server)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
        client.close()


def wait_for(cond: Callable[[], bool], timeout: float, message: str, interval: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(message)
        time.sleep(interval)


def sse_data(lines: Iterator[str] | list[str]) -> list[str]:
    """The `data:` payloads of an SSE body, in order (comments and blank lines dropped)."""
    return [line[5:].strip() for line in lines if line.startswith("data:")]


@dataclasses.dataclass
class ServerProcess:
    url: str
    proc: subprocess.Popen

    def core_pid(self) -> int:
        """The engine-core process: the server's one child."""
        children = [int(p) for t in Path(f"/proc/{self.proc.pid}/task").iterdir() for p in (t / "children").read_text().split()]
        assert len(children) == 1, children
        return children[0]


@contextlib.contextmanager
def server_process(model_dir: str, log_path: Path, *args: str, timeout_s: float = 90, port: int | None = None,
                   extra_env: dict[str, str] | None = None) -> Iterator[ServerProcess]:
    """`python -m llmserve.cli serve --model DIR --port P ARGS...` on `port` (default: a free
    one); yields it once /health answers 200; SIGTERM (then SIGKILL) on exit. Its log goes to
    log_path."""
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "llmserve.cli", "serve", "--model", model_dir, "--port", str(port),
           "--num-threads", "1", "--dtype", "float32", "--compile", "none", "--log-level", "warning", *args]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMSERVE_")} | (extra_env or {})
    with open(log_path, "w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            wait_for(lambda: proc.poll() is not None or _healthy(url), timeout_s, f"{url} did not come up")
            if proc.poll() is not None:
                log.seek(0)
                raise AssertionError(f"the server exited with {proc.returncode}: {log.read()[-3000:]}")
            yield ServerProcess(url, proc)
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
