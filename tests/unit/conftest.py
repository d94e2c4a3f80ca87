"""Unit-test fixtures (see _fake_upstream.py)."""

import sys

import pytest

from _fake_upstream import FakeUpstream


@pytest.fixture
def upstream(tmp_path):
    fake = FakeUpstream(tmp_path)
    yield fake
    fake.unload()
    if str(tmp_path) in sys.path:
        sys.path.remove(str(tmp_path))
