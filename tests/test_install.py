"""llmserve installs from a wheel and runs from anywhere: the wheel goes into a fresh venv in a
temporary directory, `llmserve make-model` and `llmserve serve` run from another working
directory with a fresh home, the native kernel builds, a completion comes back, and every cache
lands in the user cache directory (nothing is written beside the installed package)."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import httpx
import pytest
from redis_fixture import free_port

pytestmark = pytest.mark.timeout(900)
ROOT = Path(__file__).resolve().parents[1]


def _run(*cmd: str | Path, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=600, **kw)
    assert proc.returncode == 0, f"{cmd}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """(the fresh venv's bin folder, an environment whose home is empty)."""
    tmp = tmp_path_factory.mktemp("install")
    _run(sys.executable, "-m", "pip", "wheel", ROOT, "--no-deps", "--no-build-isolation", "-q", "-w", tmp / "dist")
    wheel = next((tmp / "dist").glob("llmserve-*.whl"))
    _run(sys.executable, "-m", "venv", tmp / "venv")
    venv_site = Path(_run(tmp / "venv/bin/python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip())
    # the dependencies (torch, transformers, ...) come from this test run's environment, as a
    # plain path entry (its .pth files, e.g. an editable llmserve, are not processed)
    (venv_site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run(tmp / "venv/bin/pip", "install", "-q", "--no-deps", "--no-index", wheel)
    home = tmp / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LLMSERVE_", "XDG_", "PYTHON", "VIRTUAL_ENV"))}
    env |= {"HOME": str(home), "PATH": f"{tmp / 'venv/bin'}:{env.get('PATH', '')}"}
    return tmp / "venv/bin", env


def test_wheel_serves_from_any_directory(installed, tmp_path):
    bin_dir, env = installed
    work = tmp_path / "elsewhere"
    work.mkdir()
    where = _run(bin_dir / "python", "-c", "import llmserve, sys; print(llmserve.__file__)", cwd=work, env=env).stdout.strip()
    assert where.startswith(str(bin_dir.parent)), where  # the wheel's copy, not the checkout
    models = _run(bin_dir / "python", "-c", "from llmserve.model.resolve import models_dir; print(models_dir())", cwd=work, env=env)
    assert models.stdout.strip() == str(Path(env["HOME"]) / ".cache/llmserve/models")  # converted GGUF models go there
    _run(bin_dir / "llmserve", "make-model", "tiny", work / "tiny", cwd=work, env=env)  # presets ship in the wheel
    port = free_port()
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen(
        [str(bin_dir / "llmserve"), "serve", "--model", "tiny", "--port", str(port), "--num-threads", "1"],
        cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and server.poll() is None:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 5, "temperature": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    finally:
        server.terminate()
        assert server.wait(60) == 0
        log.close()
    cache = Path(env["HOME"]) / ".cache" / "llmserve"
    assert list((cache / "kernels").glob("torch-*/llmserve_kernels*.so")), "the native kernel was not built into the user cache"
    assert "native kernels unavailable" not in (tmp_path / "server.log").read_text()
    package = Path(where).parent
    assert not list(package.rglob("*.so")) and not (package.parent / "models").exists()  # nothing written beside the package
