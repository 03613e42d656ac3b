"""Disk tier: LRU bound, restart, retention, atomic writes, and every fault degrading to a miss."""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
from pathlib import Path

import pytest

from kvserve.storage import disk as disk_module
from kvserve.storage.base import Backoff, KeyNamespace, KVStore, encode_entry, make_key, read_header
from kvserve.storage.disk import DiskKVStore

PAYLOAD = b"p" * 100


def k(i: int) -> bytes:
    return i.to_bytes(24, "big")


def blob_size(meta) -> int:
    return len(encode_entry(PAYLOAD, meta))


def entry_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.suffix == ".kv")


def all_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "kv"


def make(root: Path, meta, capacity: int = 1 << 20, retention_s: float = 3600.0, **kwargs) -> DiskKVStore:
    return DiskKVStore(root, capacity, retention_s, meta=meta, **kwargs)


def test_satisfies_protocol(root, meta) -> None:
    assert isinstance(make(root, meta), KVStore)


def test_round_trip_writes_one_framed_file(root, meta, clock) -> None:
    store = make(root, meta, clock=clock)
    assert store.put(k(1), PAYLOAD)
    assert store.get(k(1)) == PAYLOAD
    assert store.get(k(2)) is None
    (path,) = entry_files(root)
    assert path == store.path_for(k(1)) and path.name == k(1).hex() + ".kv"
    assert len(path.parent.name) == 2
    header = read_header(path.read_bytes())
    assert header.meta == meta and header.created_at == clock()
    stats = store.stats()
    assert (stats.hits, stats.misses, stats.entries, stats.bytes_held) == (1, 1, 1, path.stat().st_size)
    assert stats.bytes_written == stats.bytes_read == len(PAYLOAD)
    assert store.healthy


def test_batch_forms_and_delete(root, meta) -> None:
    store = make(root, meta)
    assert store.put_many([(k(0), b"a"), (k(1), b"b")]) == 2
    assert store.get_many([k(1), k(5), k(0)]) == [b"b", None, b"a"]
    assert store.contains_many([k(0), k(5)]) == [True, False]
    store.delete(k(0))
    store.delete(k(7))
    assert store.get(k(0)) is None and len(entry_files(root)) == 1


def test_lru_eviction_keeps_disk_under_capacity(root, meta, clock) -> None:
    size = blob_size(meta)
    store = make(root, meta, capacity=3 * size, clock=clock)
    for i in range(3):
        clock.advance(1)
        assert store.put(k(i), PAYLOAD)
    clock.advance(1)
    assert store.get(k(0)) == PAYLOAD  # 0 becomes most recently used
    assert store.put(k(3), PAYLOAD)
    assert store.keys() == [k(2), k(0), k(3)]
    assert not store.path_for(k(1)).exists()
    assert sum(p.stat().st_size for p in all_files(root)) <= 3 * size
    assert store.used_bytes == 3 * size and store.stats().evictions == 1


def test_entry_bigger_than_capacity_is_refused(root, meta) -> None:
    store = make(root, meta, capacity=10)
    assert not store.put(k(0), PAYLOAD)
    assert entry_files(root) == [] and store.healthy


def test_overwrite_does_not_evict_itself(root, meta) -> None:
    size = blob_size(meta)
    store = make(root, meta, capacity=2 * size)
    store.put(k(0), PAYLOAD)
    store.put(k(1), PAYLOAD)
    assert store.put(k(0), b"q" * 100)
    assert store.get(k(0)) == b"q" * 100 and store.get(k(1)) == PAYLOAD
    assert store.used_bytes == 2 * size and store.stats().evictions == 0


def test_restart_rebuilds_index_in_lru_order(root, meta, clock) -> None:
    # File times come from the tier's clock. Put it far past the real time so that an implicit atime
    # update by the kernel (relatime) cannot produce the expected order by accident.
    clock.now = 4_000_000_000.0
    size = blob_size(meta)
    first = make(root, meta, capacity=3 * size, clock=clock)
    for i in range(3):
        clock.advance(1)
        first.put(k(i), bytes([i]) * 100)
    clock.advance(1)
    first.get(k(0))
    first.close()

    clock.advance(1)
    second = make(root, meta, capacity=3 * size, clock=clock)
    assert second.keys() == [k(1), k(2), k(0)]
    assert second.used_bytes == 3 * size and second.num_entries == 3
    assert second.get(k(2)) == b"\2" * 100
    assert second.put(k(3), PAYLOAD)  # evicts the least recently used: k(1)
    assert not second.contains(k(1)) and second.contains(k(0))


def test_restart_with_smaller_capacity_evicts(root, meta) -> None:
    size = blob_size(meta)
    first = make(root, meta, capacity=4 * size)
    for i in range(4):
        first.put(k(i), PAYLOAD)
    second = make(root, meta, capacity=2 * size)
    assert second.num_entries == 2 and len(entry_files(root)) == 2


def test_restart_deletes_stray_tmp_files_and_ignores_foreign_files(root, meta) -> None:
    store = make(root, meta)
    store.put(k(1), PAYLOAD)
    subdir = store.path_for(k(1)).parent
    stray = subdir / f".tmp-{k(2).hex()}-123-abcd"
    stray.write_bytes(b"half a wri")
    foreign = root / "README"
    foreign.write_text("not ours")
    bad_name = subdir / "zz-not-hex.kv"
    bad_name.write_bytes(b"x")
    again = make(root, meta)
    assert not stray.exists()
    assert foreign.exists() and bad_name.exists()
    assert again.keys() == [k(1)]


def test_retention_on_read_and_sweep(root, meta, clock) -> None:
    store = make(root, meta, retention_s=10.0, clock=clock)
    store.put(k(0), PAYLOAD)
    clock.advance(6)
    store.put(k(1), PAYLOAD)
    clock.advance(3.9)
    assert store.get(k(0)) == PAYLOAD  # 9.9 s old; the read does not extend its life
    clock.advance(0.1)
    assert store.get(k(0)) is None
    assert not store.path_for(k(0)).exists()  # expired on read: the file goes too
    store.put(k(2), PAYLOAD)
    clock.advance(6)
    assert store.sweep() == 1  # k(1), written 16 s ago
    assert store.keys() == [k(2)]
    assert [p.name for p in entry_files(root)] == [k(2).hex() + ".kv"]
    assert store.stats().expirations == 2


def test_restart_drops_expired_files(root, meta, clock) -> None:
    first = make(root, meta, retention_s=10.0, clock=clock)
    first.put(k(0), PAYLOAD)
    clock.advance(5)
    first.put(k(1), PAYLOAD)
    clock.advance(6)
    second = make(root, meta, retention_s=10.0, clock=clock)
    assert second.keys() == [k(1)]
    assert len(entry_files(root)) == 1 and second.stats().expirations == 1


def test_write_is_atomic(root, meta, monkeypatch) -> None:
    store = make(root, meta)
    real_replace = os.replace
    seen: list[tuple[bool, int]] = []

    def checking_replace(src, dst):
        # At the moment of the rename the final name does not exist yet and the temp file is complete.
        seen.append((Path(dst).exists(), Path(src).stat().st_size))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", checking_replace)
    assert store.put(k(0), PAYLOAD)
    assert seen == [(False, blob_size(meta))]


def test_crash_before_rename_leaves_old_value_and_no_partial_file(root, meta, monkeypatch, backoff_clock) -> None:
    store = make(root, meta, backoff=Backoff("disk", clock=backoff_clock))
    store.put(k(0), PAYLOAD)

    def crash(src, dst):
        raise OSError(errno.EIO, "simulated crash")

    monkeypatch.setattr(os, "replace", crash)
    assert not store.put(k(0), b"new" * 10)
    assert not store.put(k(1), b"new" * 10)
    monkeypatch.undo()
    assert [p.name for p in all_files(root)] == [k(0).hex() + ".kv"]  # no temp file, no k(1)
    backoff_clock.advance(5)
    assert store.get(k(0)) == PAYLOAD


@pytest.mark.parametrize("how", ["truncated", "garbage", "empty"])
def test_damaged_file_is_a_miss_deleted_and_counted(root, meta, how) -> None:
    store = make(root, meta)
    store.put(k(0), PAYLOAD)
    store.put(k(1), PAYLOAD)
    path = store.path_for(k(0))
    data = path.read_bytes()
    path.write_bytes({"truncated": data[: len(data) - 7], "garbage": os.urandom(len(data)), "empty": b""}[how])
    assert store.get(k(0)) is None
    assert not path.exists()
    assert not store.contains(k(0))
    stats = store.stats()
    assert stats.corrupt == 1 and stats.misses == 1 and stats.entries == 1
    assert store.healthy  # a bad file is not an outage
    assert store.get(k(1)) == PAYLOAD


def test_entry_of_another_model_is_a_miss(root, meta) -> None:
    ours = make(root, meta)
    ours.put(k(0), PAYLOAD)
    other_meta = dataclasses.replace(meta, model_fingerprint="other-model@def")
    other = make(root, other_meta)
    assert other.contains(k(0))  # the name matches (a key collision) ...
    assert other.get(k(0)) is None  # ... but the header does not: CorruptEntry, deleted, counted
    assert other.stats().corrupt == 1 and not ours.path_for(k(0)).exists()


def test_keys_of_different_models_never_collide(root, meta) -> None:
    store = make(root, meta)
    block_hash = bytes(range(16))
    ns_a = KeyNamespace(meta.model_fingerprint, meta.kv_dtype, meta.block_size)
    ns_b = dataclasses.replace(ns_a, model_fingerprint="other-model@def")
    store.put(make_key(block_hash, ns_a), PAYLOAD)
    assert store.get(make_key(block_hash, ns_b)) is None
    assert store.get(make_key(block_hash, ns_a)) == PAYLOAD


def test_file_deleted_behind_our_back_is_a_plain_miss(root, meta) -> None:
    store = make(root, meta)
    store.put(k(0), PAYLOAD)
    store.path_for(k(0)).unlink()
    assert store.get(k(0)) is None
    assert store.healthy and store.stats().errors == 0 and store.num_entries == 0


def test_full_disk_put_returns_false_then_recovers(root, meta, monkeypatch, backoff_clock, caplog) -> None:
    store = make(root, meta, backoff=Backoff("disk", initial_s=1.0, clock=backoff_clock))
    store.put(k(0), PAYLOAD)
    calls = 0

    def full(src, dst):
        nonlocal calls
        calls += 1
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    with caplog.at_level(logging.WARNING, logger="kvserve.storage.disk"):
        assert not store.put(k(1), PAYLOAD)
        for i in range(2, 10):
            assert not store.put(k(i), PAYLOAD)  # short-circuited: the disk is not touched
        assert store.get(k(0)) is None  # unhealthy: every operation is a miss until the backoff elapses
    assert calls == 1
    assert not store.healthy and store.stats().errors == 1
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    assert [p.name for p in all_files(root)] == [k(0).hex() + ".kv"]  # temp file removed

    backoff_clock.advance(1.0)
    assert not store.put(k(1), PAYLOAD)  # the probe fails: still full
    assert calls == 2
    monkeypatch.undo()
    backoff_clock.advance(1.5)
    assert not store.put(k(1), PAYLOAD)  # 2 s backoff now
    backoff_clock.advance(0.6)
    assert store.put(k(1), PAYLOAD)
    assert store.healthy and store.get(k(0)) == PAYLOAD


def test_enospc_while_writing_leaves_no_temp_file(root, meta, monkeypatch) -> None:
    store = make(root, meta)
    real_write = os.write

    def half_then_full(fd, data):
        if len(data) > 10:
            return real_write(fd, bytes(data[:10]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", half_then_full)
    assert not store.put(k(0), PAYLOAD)
    monkeypatch.undo()
    assert all_files(root) == [] and not store.healthy


def test_directory_that_is_a_file_degrades_and_recovers(tmp_path, meta, backoff_clock) -> None:
    path = tmp_path / "not-a-dir"
    path.write_text("oops")
    store = DiskKVStore(path, 1 << 20, 60.0, meta=meta, backoff=Backoff("disk", clock=backoff_clock))
    assert not store.healthy
    assert store.get(k(0)) is None
    assert not store.put(k(0), PAYLOAD)
    assert store.contains_many([k(0)]) == [False]
    assert store.stats().errors == 1

    path.unlink()  # the operator fixes it; the next probe after the backoff rescans
    backoff_clock.advance(1.0)
    assert store.put(k(0), PAYLOAD)
    assert store.healthy and store.get(k(0)) == PAYLOAD


def test_unreadable_files_are_misses_not_deletions(root, meta, monkeypatch, backoff_clock, caplog) -> None:
    store = make(root, meta, backoff=Backoff("disk", clock=backoff_clock))
    store.put(k(0), PAYLOAD)

    def denied(*_args, **_kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(disk_module, "open", denied, raising=False)
    with caplog.at_level(logging.WARNING, logger="kvserve.storage.disk"):
        for _ in range(5):
            assert store.get(k(0)) is None
    assert not store.healthy
    assert store.stats().errors == 1 and store.stats().corrupt == 0
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    assert store.path_for(k(0)).exists()
    monkeypatch.undo()
    backoff_clock.advance(1.0)
    assert store.get(k(0)) == PAYLOAD and store.healthy


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root ignores directory permissions")
def test_unreadable_directory_with_permissions(tmp_path, meta) -> None:
    path = tmp_path / "locked"
    path.mkdir()
    path.chmod(0)
    try:
        store = DiskKVStore(path, 1 << 20, 60.0, meta=meta)
        assert not store.healthy
        assert store.get(k(0)) is None and not store.put(k(0), PAYLOAD)
    finally:
        path.chmod(0o755)


def test_rejects_bad_parameters(root, meta) -> None:
    with pytest.raises(ValueError):
        make(root, meta, capacity=-1)
    with pytest.raises(ValueError):
        make(root, meta, retention_s=0)


def test_a_file_under_its_key_is_always_indexed_even_when_setting_its_times_fails(root, meta, monkeypatch) -> None:
    store = make(root, meta)

    def refuse(path, times):
        raise OSError(errno.EPERM, "this mount refuses utime")

    monkeypatch.setattr(os, "utime", refuse)
    assert not store.put(k(0), PAYLOAD)
    monkeypatch.undo()
    assert entry_files(root) == [] and store.stats().bytes_held == 0  # nothing on disk the index does not count


def test_a_read_error_ends_the_batch_as_misses_with_one_failure_counted(root, meta, monkeypatch) -> None:
    store = make(root, meta)
    keys = [k(i) for i in range(5)]
    for key in keys:
        assert store.put(key, PAYLOAD)

    def failing_open(path, mode="r", *args, **kwargs):
        raise OSError(errno.EIO, "bad sector")

    monkeypatch.setattr(disk_module, "open", failing_open, raising=False)
    assert store.get_many(keys) == [None] * 5
    stats = store.stats()
    assert stats.errors == 1 and stats.misses == 5  # one failure, not five (the backoff counts failures)


def test_the_default_capacity_counts_the_tiers_own_files_as_free(tmp_path, monkeypatch) -> None:
    from kvserve.cache import tiers

    directory = tmp_path / "kv"
    (directory / "3f").mkdir(parents=True)
    (directory / "3f" / ("ab" * 24 + ".kv")).write_bytes(b"x" * (3 << 20))
    (directory / "3f" / "notes.txt").write_bytes(b"x" * (5 << 20))  # not an entry: not counted

    class Usage:
        free = 2 << 20

    monkeypatch.setattr(tiers.shutil, "disk_usage", lambda path: Usage)
    assert tiers.disk_capacity_bytes(str(directory), None) == ((2 << 20) + (3 << 20)) // 2


def test_index_lookups_and_stats_never_wait_for_a_file_being_written(root, meta, monkeypatch) -> None:
    import threading

    store = make(root, meta)
    assert store.put(k(0), PAYLOAD)
    writing, release = threading.Event(), threading.Event()
    real_write = store._write_file

    def slow_disk(tmp, blob):
        writing.set()
        release.wait(30)
        real_write(tmp, blob)

    monkeypatch.setattr(store, "_write_file", slow_disk)
    writer = threading.Thread(target=store.put, args=(k(1), PAYLOAD))
    writer.start()
    assert writing.wait(10)
    answered: list[object] = []
    engine_thread = threading.Thread(target=lambda: answered.extend(
        [store.contains_many([k(0), k(1)]), store.stats().entries, store.get(k(0))]))
    engine_thread.start()
    engine_thread.join(10)  # a hang detector: with the lock held over the write it waits for `release`
    release.set()
    writer.join(10)
    assert answered == [[True, False], 1, PAYLOAD]
    assert store.get(k(1)) == PAYLOAD
