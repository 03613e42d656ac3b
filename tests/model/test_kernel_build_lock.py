"""A build of the C++ kernels killed part way leaves torch's lock file, on which every later start would wait
for ever: the loader waits while a live build holds it and removes it once it is stale."""

from __future__ import annotations

import os
from pathlib import Path

from kvserve.model.cpu_kernels import _build_lock, release_stale_build_lock

STALE_S = 600.0


class FakeTime:
    """A clock that moves only when slept on; ``on_sleep`` runs after each sleep (another build finishing)."""

    def __init__(self, start: float, on_sleep=None) -> None:
        self.now = start
        self.sleeps: list[float] = []
        self.on_sleep = on_sleep

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        if self.on_sleep is not None:
            self.on_sleep(len(self.sleeps))


def lock_made_at(path: Path, when: float) -> Path:
    path.touch()
    os.utime(path, (when, when))
    return path


def test_no_lock_means_no_wait(tmp_path: Path) -> None:
    time = FakeTime(1_000_000.0)
    assert not release_stale_build_lock(tmp_path / "lock", STALE_S, time.clock, time.sleep)
    assert time.sleeps == []


def test_a_live_build_is_waited_for_until_its_lock_goes(tmp_path: Path) -> None:
    lock = lock_made_at(tmp_path / "lock", 1_000_000.0)
    time = FakeTime(1_000_010.0, on_sleep=lambda n: lock.unlink() if n == 3 else None)
    assert not release_stale_build_lock(lock, STALE_S, time.clock, time.sleep)
    assert len(time.sleeps) == 3 and not lock.exists()


def test_a_lock_older_than_any_build_is_removed_at_once(tmp_path: Path) -> None:
    lock = lock_made_at(tmp_path / "lock", 1_000_000.0)
    time = FakeTime(1_000_000.0 + STALE_S + 1)
    assert release_stale_build_lock(lock, STALE_S, time.clock, time.sleep)
    assert not lock.exists() and time.sleeps == []


def test_a_lock_left_by_a_build_killed_just_now_is_removed_once_it_is_stale(tmp_path: Path) -> None:
    lock = lock_made_at(tmp_path / "lock", 1_000_000.0)
    time = FakeTime(1_000_000.0)
    assert release_stale_build_lock(lock, STALE_S, time.clock, time.sleep)
    assert not lock.exists()
    assert sum(time.sleeps) == STALE_S and max(time.sleeps) <= 1.0  # woke each second, then gave up on it


def test_the_lock_is_where_torch_builds_the_kernels(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = _build_lock()
    assert lock is not None and lock.name == "lock" and lock.parent.parent == tmp_path
