"""Run-time builds go to the user cache directory, never beside the (possibly read-only) package."""

from __future__ import annotations

from pathlib import Path

from llmserve.paths import cache_dir


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("LLMSERVE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir("inductor") == tmp_path / "xdg" / "llmserve" / "inductor"
    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_dir("kernels") == tmp_path / "mine" / "kernels"
    monkeypatch.delenv("LLMSERVE_CACHE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir() == Path.home() / ".cache" / "llmserve"
