"""Host (DRAM) tier: LRU order, capacity bound, retention, write-back hand-off."""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.storage.base import KVStore
from kvserve.storage.disk import DiskKVStore
from kvserve.storage.host import HostKVStore


def k(i: int) -> bytes:
    return i.to_bytes(24, "big")


def test_satisfies_protocol() -> None:
    assert isinstance(HostKVStore(100, 10.0), KVStore)


def test_round_trip_miss_and_stats() -> None:
    store = HostKVStore(1000, 60.0)
    assert store.put(k(1), b"abc")
    assert store.get(k(1)) == b"abc"
    assert store.get(k(2)) is None
    assert store.contains(k(1)) and not store.contains(k(2))
    stats = store.stats()
    assert (stats.hits, stats.misses, stats.bytes_read, stats.bytes_written) == (1, 1, 3, 3)
    assert (stats.entries, stats.bytes_held) == (1, 3)
    assert stats.load_count == 2 and stats.load_latency_s >= 0


def test_lru_order_eviction_and_on_evict() -> None:
    evicted: list[tuple[bytes, bytes]] = []
    store = HostKVStore(30, 60.0, on_evict=lambda key, value: evicted.append((key, value)))
    for i in range(3):
        assert store.put(k(i), bytes([i]) * 10)
    assert store.get(k(0)) == b"\0" * 10  # 0 becomes most recently used
    assert store.keys() == [k(1), k(2), k(0)]
    assert store.put(k(3), b"\3" * 10)
    assert evicted == [(k(1), b"\1" * 10)]
    assert store.keys() == [k(2), k(0), k(3)]
    assert store.used_bytes == 30 and store.num_entries == 3
    assert store.stats().evictions == 1


def test_contains_does_not_touch_lru_order() -> None:
    store = HostKVStore(20, 60.0)
    store.put(k(0), b"x" * 10)
    store.put(k(1), b"y" * 10)
    assert store.contains(k(0))
    store.put(k(2), b"z" * 10)
    assert not store.contains(k(0)) and store.contains(k(1))


def test_one_big_put_evicts_several() -> None:
    evicted: list[bytes] = []
    store = HostKVStore(30, 60.0, on_evict=lambda key, _value: evicted.append(key))
    for i in range(3):
        store.put(k(i), b"x" * 10)
    assert store.put(k(9), b"y" * 25)
    assert evicted == [k(0), k(1), k(2)]
    assert store.keys() == [k(9)] and store.used_bytes == 25


def test_value_larger_than_capacity_is_refused_without_evicting() -> None:
    store = HostKVStore(10, 60.0)
    store.put(k(0), b"x" * 10)
    assert not store.put(k(1), b"y" * 11)
    assert store.get(k(0)) == b"x" * 10 and store.stats().evictions == 0


def test_overwrite_replaces_size() -> None:
    store = HostKVStore(100, 60.0)
    store.put(k(0), b"x" * 40)
    store.put(k(0), b"y" * 10)
    assert store.used_bytes == 10 and store.get(k(0)) == b"y" * 10 and store.num_entries == 1


def test_put_copies_mutable_buffers() -> None:
    store = HostKVStore(100, 60.0)
    buf = bytearray(b"abcd")
    store.put(k(0), buf)  # type: ignore[arg-type]
    buf[0] = ord("z")
    assert store.get(k(0)) == b"abcd"


def test_batch_forms_and_delete() -> None:
    store = HostKVStore(100, 60.0)
    assert store.put_many([(k(0), b"a"), (k(1), b"b"), (k(2), b"c" * 200)]) == 2
    assert store.get_many([k(0), k(2), k(1)]) == [b"a", None, b"b"]
    assert store.contains_many([k(0), k(2)]) == [True, False]
    store.delete(k(0))
    store.delete(k(42))  # absent: no error
    assert store.get(k(0)) is None and store.used_bytes == 1


def test_retention_with_injected_clock(clock) -> None:
    evicted: list[bytes] = []
    store = HostKVStore(100, 10.0, clock=clock, on_evict=lambda key, _v: evicted.append(key))
    store.put(k(0), b"a")
    clock.advance(5)
    store.put(k(1), b"b")
    clock.advance(4.9)
    assert store.get(k(0)) == b"a"  # 9.9 s old: still there; reading does not extend its life
    clock.advance(0.1)
    assert store.get(k(0)) is None
    assert store.contains(k(1))
    clock.advance(5)
    assert not store.contains(k(1))
    assert store.stats().expirations == 2 and store.used_bytes == 0
    assert evicted == []  # expired entries are dropped, never handed down


def test_sweep_drops_expired(clock) -> None:
    store = HostKVStore(100, 10.0, clock=clock)
    store.put(k(0), b"a")
    store.put(k(1), b"b")
    clock.advance(6)
    store.put(k(2), b"c")
    clock.advance(5)
    assert store.sweep() == 2
    assert store.keys() == [k(2)] and store.stats().expirations == 2


def test_expired_lru_entries_are_not_handed_down(clock) -> None:
    evicted: list[bytes] = []
    store = HostKVStore(20, 10.0, clock=clock, on_evict=lambda key, _v: evicted.append(key))
    store.put(k(0), b"x" * 10)
    clock.advance(11)
    store.put(k(1), b"y" * 10)
    store.put(k(2), b"z" * 10)  # pushes out k(0), which is already expired
    assert evicted == [] and store.stats().expirations == 1


def test_failing_on_evict_does_not_fail_the_put() -> None:
    def boom(_key: bytes, _value: bytes) -> None:
        raise RuntimeError("lower tier bug")

    store = HostKVStore(10, 60.0, on_evict=boom)
    store.put(k(0), b"x" * 10)
    assert store.put(k(1), b"y" * 10)
    assert store.get(k(1)) == b"y" * 10 and store.stats().errors == 1


def test_write_back_to_disk(tmp_path, meta) -> None:
    disk = DiskKVStore(tmp_path / "kv", 10_000, 60.0, meta=meta)
    host = HostKVStore(20, 60.0, on_evict=disk.put)
    for i in range(4):
        host.put(k(i), bytes([i]) * 10)
    assert host.keys() == [k(2), k(3)]
    assert disk.get(k(0)) == b"\0" * 10 and disk.get(k(1)) == b"\1" * 10
    assert not disk.contains(k(2))


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["put", "get", "delete"]), st.integers(0, 7), st.integers(0, 40)),
                    max_size=60))
def test_matches_reference_lru(ops) -> None:
    capacity = 64
    evicted: list[bytes] = []
    store = HostKVStore(capacity, 1e9, on_evict=lambda key, _v: evicted.append(key))
    model: OrderedDict[bytes, bytes] = OrderedDict()
    model_evicted: list[bytes] = []
    for op, i, size in ops:
        key, value = k(i), bytes([i]) * size
        if op == "put":
            stored = store.put(key, value)
            assert stored == (size <= capacity)
            if stored:
                model.pop(key, None)
                model[key] = value
                while sum(map(len, model.values())) > capacity:
                    model_evicted.append(model.popitem(last=False)[0])
        elif op == "get":
            assert store.get(key) == model.get(key)
            if key in model:
                model.move_to_end(key)
        else:
            store.delete(key)
            model.pop(key, None)
        assert store.used_bytes <= capacity
        assert store.used_bytes == sum(map(len, model.values()))
        assert store.keys() == list(model)
    assert evicted == model_evicted


def test_rejects_bad_parameters() -> None:
    with pytest.raises(ValueError):
        HostKVStore(-1, 10.0)
    with pytest.raises(ValueError):
        HostKVStore(10, 0.0)
