"""A real redis-server on a free loopback port, for the Redis tests (no fakes on these paths).

RedisServer(port, workdir).start() / kill() (SIGKILL, as a crash) / start() again on the same
port / stop(). No persistence: a restarted server comes back empty, as after a failover.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis

REDIS_SERVER = shutil.which("redis-server")
SKIP_REASON = "the redis-server binary is not installed (apt-get install redis-server, or `make redis`)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, workdir: Path, port: int | None = None):
        self.port = port or free_port()
        self.workdir = Path(workdir)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2, socket_connect_timeout=2)

    def start(self, timeout_s: float = 10.0) -> None:
        assert REDIS_SERVER, SKIP_REASON
        self.workdir.mkdir(parents=True, exist_ok=True)
        cmd = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
               "--dir", str(self.workdir), "--logfile", str(self.workdir / "redis.log")]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with self.client() as c:
                    c.ping()
                return
            except redis.RedisError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    log = (self.workdir / "redis.log").read_text(errors="replace")[-2000:] if (self.workdir / "redis.log").exists() else ""
                    self.stop()
                    raise RuntimeError(f"redis-server did not come up on port {self.port}: {log}") from None
                time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL, as a crash; the port is free again once it returns."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None
