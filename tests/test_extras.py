"""`pip install llmserve` without extras: the server serves a completion, /v1/embeddings runs in
torch, and each optional feature whose extra is missing says in one line which extra to install.
A missing extra is simulated by a sitecustomize that makes its packages fail to import (a fresh
venv would need the package index)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from server_harness import server_process

from llmserve.embeddings import MODEL_NAME, default_model_dir

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[1]
EXTRAS_PACKAGES = ("onnxruntime", "onnx", "aiohttp", "matplotlib", "ray")  # [embeddings], [bench], [ray]
BLOCKER = """
import sys
class _Hide:  # a finder that does not see the blocked packages, as if they were not installed
    def __init__(self, inner):
        self.inner = inner
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            return None
        return self.inner.find_spec(name, path, target)
    def __getattr__(self, attr):
        return getattr(self.inner, attr)
sys.meta_path[:] = [_Hide(f) if hasattr(f, "find_spec") else f for f in sys.meta_path]
"""


@pytest.fixture
def without_extras(tmp_path, monkeypatch) -> dict[str, str]:
    """PYTHONPATH for subprocesses in which no package of any extra imports."""
    folder = tmp_path / "site"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(BLOCKER.format(blocked=set(EXTRAS_PACKAGES)))
    monkeypatch.setenv("PYTHONPATH", str(folder))
    probe = subprocess.run([sys.executable, "-c", "import onnxruntime"], capture_output=True, text=True)
    assert probe.returncode != 0 and "onnxruntime" in probe.stderr  # the blocker works
    return {"PYTHONPATH": str(folder)}


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmserve.cli", *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


@pytest.mark.parametrize("args,extra", [
    (("bench", "serve", "--base-url", "http://127.0.0.1:9", "--num-prompts", "1"), "bench"),
    (("serve", "--ray", "--model", "none"), "ray"),
])
def test_a_feature_without_its_extra_names_it(without_extras, args, extra):
    p = _cli(*args)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert f"pip install 'llmserve[{extra}]'" in lines[0]


def test_without_extras_the_server_serves_and_embeds_in_torch(without_extras, tiny_model, tmp_path):
    log = tmp_path / "server.log"
    with server_process(tiny_model, log, "--log-level", "info") as server:
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 4, "temperature": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        if default_model_dir() is None:
            return  # the embedding model package is not installed: test_embeddings says so
        r = httpx.post(server.url + "/v1/embeddings", json={"model": MODEL_NAME, "input": "hello"}, timeout=120)
        assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 384
    warnings = [line for line in log.read_text().splitlines() if "onnxruntime is not installed" in line]
    assert len(warnings) == 1 and "pip install 'llmserve[embeddings]'" in warnings[0], warnings
