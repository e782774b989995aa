"""Shared fixtures: tiny real checkpoints (transformers from_config) built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """tiny(arch, **kwargs) -> folder of a tiny HF checkpoint, cached for the session."""
    from tests.fixtures.tiny import make_tiny

    cache: dict[tuple, Path] = {}

    def get(arch: str, **kwargs) -> Path:
        key = (arch, tuple(sorted(kwargs.items())))
        if key not in cache:
            name = arch + "".join(f"-{k}{v}" for k, v in sorted(kwargs.items()))
            cache[key] = make_tiny(arch, tmp_path_factory.mktemp(name) / "src", **kwargs)
        return cache[key]

    return get


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setenv("RESHARD_DISABLE_PROGRESS", "1")
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.delenv("RESHARD_DEBUG", raising=False)
