"""Shared fixtures: a clean working directory and a fresh plugin host per test."""

from __future__ import annotations

from pathlib import Path

import pytest

from dlrover_core.plugins import reset_host


@pytest.fixture(autouse=True)
def _fresh_plugins(monkeypatch):
    """Each test sees a freshly loaded plugin host (plugins registered by a test vanish)."""
    monkeypatch.delenv("DLROVER_PLUGINS", raising=False)
    monkeypatch.delenv("DLROVER_DISABLE_PLUGINS", raising=False)
    reset_host()
    yield
    reset_host()


@pytest.fixture
def workdir(tmp_path, monkeypatch) -> Path:
    """Run the test from an empty temporary directory."""
    monkeypatch.chdir(tmp_path)
    return tmp_path
