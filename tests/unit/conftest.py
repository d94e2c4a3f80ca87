"""Unit-test fixtures (see _fake_upstream.py)."""

import sys

import pytest
from _fake_upstream import FakeUpstream


@pytest.fixture(autouse=True)
def fingerprint_cache_in_tmp(tmp_path, monkeypatch):
    """The registry's fingerprint cache ($XDG_CACHE_HOME/zb-patch) starts empty in every test, outside $HOME."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.fixture
def upstream(tmp_path):
    fake = FakeUpstream(tmp_path)
    yield fake
    fake.unload()
    if str(tmp_path) in sys.path:
        sys.path.remove(str(tmp_path))
