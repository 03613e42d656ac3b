"""Fixtures for the storage tiers: a fake clock and an entry meta (the redis-server fixture is in tests/conftest.py)."""

from __future__ import annotations

import pytest

from kvserve.storage.base import EntryMeta


class FakeClock:
    """A clock the test moves by hand (for retention and backoff)."""

    def __init__(self, start: float = 1_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def backoff_clock() -> FakeClock:
    return FakeClock(start=0.0)


@pytest.fixture
def meta() -> EntryMeta:
    return EntryMeta(model_fingerprint="test-model@abc", kv_dtype="bfloat16", block_size=16, shape=(2, 2, 16, 8))
