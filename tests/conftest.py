"""Shared fixtures: seeded random-weight model folders (built once per test session), a real
redis-server on a free loopback port (tests/redis_fixture.py), and per test module a live server
over the tiny model, its offline reference and an openai client (a module that needs other
server options defines its own `server`)."""

from __future__ import annotations

import shutil

import pytest

from llmserve.model.presets import make_model


@pytest.fixture(scope="session", autouse=True)
def native_kernels_built():
    """Build the native kernels once, up front, rather than inside a server's start-up timeout."""
    from llmserve import kernels

    return kernels.load()


@pytest.fixture(scope="module", params=["avx512", "avx2", "portable"])
def cpu_isa(request):
    """Each ISA variant of the native kernels this CPU runs, selected for the module's tests in
    turn (the AVX2 one on an AVX-512 machine too); skipped where the CPU lacks it."""
    from llmserve import kernels

    if not (shutil.which("c++") or shutil.which("g++")):
        pytest.skip("no C++ compiler: the engine runs the pure-torch attention")
    assert kernels.load(), "a C++ compiler is present but the native kernels did not build (see the log)"
    before = kernels.selected_isa()
    try:
        kernels.select_isa(request.param)
    except RuntimeError as e:
        assert "this CPU lacks" in str(e)
        pytest.skip(f"this CPU lacks {request.param}")
    assert kernels.selected_isa() == request.param
    yield request.param
    kernels.select_isa(before)


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    """make(preset, seed=0) -> path of an HF folder, cached per (preset, seed)."""
    cache: dict[tuple[str, int], str] = {}

    def make(preset: str = "tiny", seed: int = 0) -> str:
        key = (preset, seed)
        if key not in cache:
            cache[key] = str(make_model(preset, tmp_path_factory.mktemp(f"{preset}-{seed}"), seed=seed))
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_model(model_factory) -> str:
    return model_factory("tiny")


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    """A running redis-server on a free loopback port (skipped if the binary is missing)."""
    from redis_fixture import REDIS_SERVER, SKIP_REASON, RedisServer

    if not REDIS_SERVER:
        pytest.skip(SKIP_REASON)
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def server(tiny_model):
    from server_harness import live_server

    with live_server(tiny_model) as s:
        yield s


@pytest.fixture(scope="module")
def offline(tiny_model):
    from server_harness import offline_llm

    with offline_llm(tiny_model) as llm:
        yield llm


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
