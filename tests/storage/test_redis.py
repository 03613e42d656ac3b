"""Redis tier against a real redis-server on loopback: sharing, expiry, corruption, outages, recovery."""

from __future__ import annotations

import dataclasses
import logging
import socket
import time
from urllib.parse import urlsplit

import pytest
import redis

from kvserve.errors import InvalidRequest
from kvserve.storage.base import Backoff, KVStore
from kvserve.storage.redis import RedisKVStore, redact_url
from tests.conftest import SocketSpy

PAYLOAD = b"kv" * 200
REDIS_LOG = logging.getLogger("kvserve.storage.redis")


def k(i: int) -> bytes:
    return i.to_bytes(24, "big")


def raw_client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=1.0)


def port_of(url: str) -> int:
    port = urlsplit(url).port
    assert port is not None
    return port


@pytest.fixture
def closed_port_url() -> str:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"redis://127.0.0.1:{port}/0"


def test_round_trip_prefix_and_ttl(redis_server, meta) -> None:
    store = RedisKVStore(redis_server.url, 60.0, meta=meta, key_prefix="t1:")
    assert isinstance(store, KVStore)
    assert store.healthy
    assert store.put(k(1), PAYLOAD)
    assert store.get(k(1)) == PAYLOAD
    assert store.get(k(2)) is None
    raw = raw_client(redis_server.url)
    assert raw.keys("*") == [b"t1:" + k(1).hex().encode()]
    assert 59_000 < raw.pttl(store.redis_key(k(1))) <= 60_000
    stats = store.stats()
    assert (stats.hits, stats.misses, stats.bytes_read, stats.bytes_written) == (1, 1, len(PAYLOAD), len(PAYLOAD))
    assert stats.entries is None and store.capacity_bytes is None
    store.close()


def test_batches(redis_server, meta) -> None:
    store = RedisKVStore(redis_server.url, 60.0, meta=meta)
    assert store.put_many([(k(i), bytes([i]) * 10) for i in range(5)]) == 5
    assert store.get_many([k(4), k(9), k(0)]) == [b"\4" * 10, None, b"\0" * 10]
    assert store.contains_many([k(1), k(9)]) == [True, False]
    assert store.get_many([]) == [] and store.put_many([]) == 0
    store.delete(k(1))
    assert not store.contains(k(1))


def test_two_instances_share_entries(redis_server, meta) -> None:
    a = RedisKVStore(redis_server.url, 60.0, meta=meta)
    b = RedisKVStore(redis_server.url, 60.0, meta=meta)
    assert a.put(k(1), b"from a")
    assert b.put(k(2), b"from b")
    assert b.get(k(1)) == b"from a"
    assert a.get(k(2)) == b"from b"
    other_prefix = RedisKVStore(redis_server.url, 60.0, meta=meta, key_prefix="elsewhere:")
    assert other_prefix.get(k(1)) is None


def test_entries_expire_after_retention_in_real_time(redis_server, meta) -> None:
    store = RedisKVStore(redis_server.url, 1.0, meta=meta)
    assert store.put(k(1), PAYLOAD)
    assert store.get(k(1)) == PAYLOAD
    time.sleep(1.1)
    assert store.get(k(1)) is None


def test_corrupt_value_is_a_miss_deleted_and_counted(redis_server, meta) -> None:
    store = RedisKVStore(redis_server.url, 60.0, meta=meta)
    store.put(k(1), PAYLOAD)
    store.put(k(2), PAYLOAD)
    raw = raw_client(redis_server.url)
    raw.set(store.redis_key(k(1)), b"garbage")
    blob = raw.get(store.redis_key(k(2)))
    raw.set(store.redis_key(k(2)), blob[:-3])  # truncated
    assert store.get_many([k(1), k(2)]) == [None, None]
    assert raw.exists(store.redis_key(k(1)), store.redis_key(k(2))) == 0
    stats = store.stats()
    assert stats.corrupt == 2 and stats.misses == 2 and store.healthy


def test_entry_of_another_model_is_a_miss(redis_server, meta) -> None:
    ours = RedisKVStore(redis_server.url, 60.0, meta=meta)
    theirs = RedisKVStore(redis_server.url, 60.0, meta=dataclasses.replace(meta, kv_dtype="float32"))
    ours.put(k(1), PAYLOAD)
    assert theirs.get(k(1)) is None
    assert theirs.stats().corrupt == 1


def test_never_started_is_fast_miss_without_exceptions(closed_port_url, meta, backoff_clock, caplog,
                                                       monkeypatch) -> None:
    spy = SocketSpy.install(monkeypatch, port_of(closed_port_url))
    with caplog.at_level(logging.WARNING, logger="kvserve.storage.redis"):
        store = RedisKVStore(closed_port_url, 60.0, meta=meta, socket_timeout=0.2,
                             backoff=Backoff("redis", initial_s=1.0, clock=backoff_clock, log=REDIS_LOG))
        assert not store.healthy
        assert spy.connects() == [0.2]  # the constructor's PING: one attempt, bounded, no client-side retry
        for _ in range(20):
            assert store.get(k(1)) is None
            assert not store.put(k(1), PAYLOAD)
            assert store.contains_many([k(1), k(2)]) == [False, False]
            store.delete(k(1))
    assert spy.num_calls == 1  # the rest short-circuited without touching the network
    assert store.stats().errors == 1  # the constructor's PING; the rest short-circuited
    assert store.stats().misses == 20
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1


def test_probe_is_bounded_by_socket_timeout_when_server_hangs(meta, backoff_clock, monkeypatch) -> None:
    # A listener that never accepts or answers: connect succeeds (backlog), reads time out.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(16)
        url = f"redis://127.0.0.1:{hung.getsockname()[1]}/0"
        spy = SocketSpy.install(monkeypatch, hung.getsockname()[1])
        store = RedisKVStore(url, 60.0, meta=meta, socket_timeout=0.3,
                             backoff=Backoff("redis", initial_s=1.0, clock=backoff_clock))
        # One connection and one read that waits out the socket timeout per call: a client-side retry would
        # show a second of each.
        assert not store.healthy
        assert (len(spy.connects()), spy.num_timed_out()) == (1, 1)
        backoff_clock.advance(1.0)
        assert store.get(k(1)) is None  # the probe itself
        assert (len(spy.connects()), spy.num_timed_out()) == (2, 2)
        backoff_clock.advance(2.0)
        assert not store.put_many([(k(1), PAYLOAD), (k(2), PAYLOAD)])
        assert (len(spy.connects()), spy.num_timed_out()) == (3, 3)
        assert store.stats().errors == 3
        assert spy.bounded_by(0.3)  # no connect or read could wait longer than the socket timeout


def test_killed_mid_run_then_recovers(redis_server, meta, backoff_clock, caplog, monkeypatch) -> None:
    store = RedisKVStore(redis_server.url, 60.0, meta=meta, socket_timeout=0.3,
                         backoff=Backoff("redis", initial_s=1.0, clock=backoff_clock))
    assert store.put(k(1), PAYLOAD) and store.get(k(1)) == PAYLOAD

    redis_server.kill()
    spy = SocketSpy.install(monkeypatch, redis_server.port)
    with caplog.at_level(logging.INFO, logger="kvserve.storage.base"):
        assert store.get(k(1)) is None
        # The failing call reconnects at most once, bounded by the socket timeout; the next ones short-circuit.
        assert len(spy.connects()) <= 1 and spy.bounded_by(0.3) and spy.num_timed_out() == 0
        after_failure = spy.num_calls
        assert not store.put(k(2), PAYLOAD)
        assert store.contains_many([k(1)]) == [False]
        assert spy.num_calls == after_failure
        assert not store.healthy and store.stats().errors == 1

        backoff_clock.advance(1.0)
        assert store.get(k(1)) is None  # probe while still down: fails, backoff doubles
        assert store.stats().errors == 2

        redis_server.start()  # same port, empty (no persistence)
        backoff_clock.advance(1.0)
        assert not store.put(k(2), PAYLOAD)  # 2 s backoff not over: still short-circuited
        assert store.stats().errors == 2
        backoff_clock.advance(1.0)
        assert store.put(k(2), PAYLOAD)  # probe on a fresh connection succeeds
        assert store.healthy
        assert store.get(k(2)) == PAYLOAD
        assert store.get(k(1)) is None  # lost with the old server: a plain miss
    messages = [r.getMessage() for r in caplog.records]
    assert sum("unavailable" in m for m in messages) == 1
    assert any("recovered" in m for m in messages)


def test_invalid_url_is_a_config_error(meta) -> None:
    with pytest.raises(InvalidRequest):
        RedisKVStore("notredis://127.0.0.1:1", 60.0, meta=meta)


def test_redact_url() -> None:
    assert redact_url("redis://user:secret@127.0.0.1:6379/0") == "redis://user:***@127.0.0.1:6379/0"
    assert redact_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


def test_rejects_bad_retention(meta) -> None:
    with pytest.raises(ValueError):
        RedisKVStore("redis://127.0.0.1:1/0", 0.0, meta=meta)
