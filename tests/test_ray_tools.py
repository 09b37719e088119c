"""Ray's own tools beside `llmserve serve --ray` when it starts a local Ray instance: the log says
how to reach them, `ray status` and `ray list actors` answer with Ray's token auth, and the
dashboard is up (ray[default], which the ray extra brings)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from redis_fixture import free_port
from server_harness import server_process

pytestmark = pytest.mark.timeout(400)
RAY = str(Path(sys.executable).parent / "ray")


def ray_cli(home: Path, *args: str, token: bool = True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | {"HOME": str(home)}
    if token:
        env["RAY_AUTH_MODE"] = "token"
    return subprocess.run([RAY, *args], capture_output=True, text=True, env=env, timeout=120)


def test_ray_status_list_actors_and_the_dashboard_work_beside_a_local_instance(tiny_model, tmp_path):
    home, dashboard = tmp_path / "home", free_port()  # Ray keeps its token in ~/.ray/auth_token
    home.mkdir()
    log = tmp_path / "ray.log"
    with server_process(tiny_model, log, "--ray", "--num-replicas", "1", "--replica-cpus", "1", "--kv-cache-memory",
                        str(32 << 20), "--ray-dashboard-port", str(dashboard), "--log-level", "info",
                        extra_env={"HOME": str(home)}, timeout_s=240):
        hint = re.search(r"ray status --address (\S+)`, `RAY_AUTH_MODE=token ray list actors --address (\S+)`", log.read_text())
        assert hint is not None, log.read_text()[-3000:]
        gcs, api = hint.groups()
        assert api == f"http://127.0.0.1:{dashboard}"
        status = ray_cli(home, "status", "--address", gcs)
        assert status.returncode == 0 and "CPU" in status.stdout, status.stderr[-2000:]
        assert ray_cli(home, "status", "--address", gcs, token=False).returncode != 0  # token auth is on
        actors = ray_cli(home, "list", "actors", "--address", api, "--format", "json")
        assert actors.returncode == 0, actors.stderr[-2000:]
        classes = {a["class_name"] for a in json.loads(actors.stdout) if a["state"] == "ALIVE"}
        assert any("Engine" in c for c in classes) and "StatsBoard" in classes, classes
        assert httpx.get(api, timeout=10).status_code == 200
