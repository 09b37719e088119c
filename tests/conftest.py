"""Shared fixtures: seeded random-weight model folders (built once per test session)."""

from __future__ import annotations

import pytest

from llmserve.model.presets import make_model


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
