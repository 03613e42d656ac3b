"""Redis tier: framed entries in a (possibly shared) Redis, expiring after the retention time.

Every key is ``key_prefix + key.hex()``; values are ``encode_entry`` blobs, written with ``SET ... PX``
so Redis itself expires them ``retention_s`` after the write. Batches are one round trip: ``MGET`` for
reads, a non-transactional pipeline of ``SET``/``EXISTS`` for the rest. Several engines pointed at the
same server and prefix share entries.

Redis being down never stalls or fails the engine: the client does no retries of its own, every call is
bounded by ``socket_timeout`` (``connect_timeout`` to connect), and a connection error marks the tier
unhealthy so that calls short-circuit to miss / no-op until the backoff lets one probe through.

(This module is ``kvserve.storage.redis``; ``import redis`` below is an absolute import and gets the
redis-py package, not this file.)
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvserve.errors import InvalidRequest
from kvserve.storage.base import Backoff, CorruptEntry, EntryMeta, TierStats, decode_entry, encode_entry

logger = logging.getLogger(__name__)

# Errors that mean "the server cannot be reached or answered nonsense": the tier goes unhealthy.
_CONNECTION_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)


def redact_url(url: str) -> str:
    """``url`` without its password, for logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


class RedisKVStore:
    """KV tier on a Redis server. ``capacity_bytes``, ``used_bytes`` and ``num_entries`` are ``None``:
    the server (``maxmemory``) bounds it and may be shared, so this process cannot count it cheaply."""

    def __init__(
        self,
        url: str,
        retention_s: float,
        *,
        meta: EntryMeta,
        key_prefix: str = "kvserve:",
        socket_timeout: float = 0.5,
        connect_timeout: float | None = None,
        backoff: Backoff | None = None,
        name: str = "redis",
    ) -> None:
        if retention_s <= 0:
            raise ValueError(f"retention_s must be > 0, got {retention_s}")
        self.name = name
        self.meta = meta
        self.url = redact_url(url)
        self._prefix = key_prefix
        self._retention_ms = max(1, round(retention_s * 1000))
        self._backoff = backoff or Backoff(f"{name} ({self.url})", log=logger)
        self._lock = threading.Lock()  # guards the counters only; redis-py's pool is thread-safe
        self._stats = TierStats(entries=None, bytes_held=None)
        try:
            self._client = redis.Redis.from_url(
                url,
                socket_timeout=socket_timeout,
                socket_connect_timeout=socket_timeout if connect_timeout is None else connect_timeout,
                retry=Retry(NoBackoff(), 0),  # redis-py retries 3x with backoff by default: we must not wait
                health_check_interval=0,
            )
        except ValueError as e:
            raise InvalidRequest(f"invalid redis_url {self.url!r}: {e}", "redis_url") from None
        try:
            self._client.ping()
        except (redis.exceptions.RedisError, OSError) as e:
            self._fail(e)

    # --- sizes ------------------------------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int | None:
        return None

    @property
    def used_bytes(self) -> int | None:
        return None

    @property
    def num_entries(self) -> int | None:
        return None

    @property
    def healthy(self) -> bool:
        return self._backoff.healthy

    def redis_key(self, key: bytes) -> str:
        return self._prefix + key.hex()

    # --- plumbing ---------------------------------------------------------------------------------------
    def _ready(self) -> bool:
        if not self._backoff.allow():
            return False
        if not self._backoff.healthy:
            # A probe: drop pooled connections that died with the old server, or the probe fails on them.
            self._client.connection_pool.disconnect()
        return True

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            self._stats.errors += 1
        self._backoff.record_failure(error)

    def _count(self, **deltas: float) -> None:
        with self._lock:
            for field_name, delta in deltas.items():
                setattr(self._stats, field_name, getattr(self._stats, field_name) + delta)

    # --- reads ------------------------------------------------------------------------------------------
    def contains(self, key: bytes) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        if not keys:
            return []
        if not self._ready():
            return [False] * len(keys)
        try:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self.redis_key(key))
            counts = pipe.execute()
        except _CONNECTION_ERRORS as e:
            self._fail(e)
            return [False] * len(keys)
        except redis.exceptions.RedisError as e:
            self._count(errors=1)
            logger.warning("%s: EXISTS failed: %r", self.name, e)
            return [False] * len(keys)
        self._backoff.record_success()
        return [bool(c) for c in counts]

    def get(self, key: bytes) -> bytes | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        if not keys:
            return []
        start = time.perf_counter()
        if not self._ready():
            self._count(misses=len(keys))
            return [None] * len(keys)
        try:
            blobs = self._client.mget([self.redis_key(k) for k in keys])
        except _CONNECTION_ERRORS as e:
            self._fail(e)
            self._count(misses=len(keys))
            return [None] * len(keys)
        except redis.exceptions.RedisError as e:
            self._count(errors=1, misses=len(keys))
            logger.warning("%s: MGET failed: %r", self.name, e)
            return [None] * len(keys)
        self._backoff.record_success()
        out: list[bytes | None] = []
        corrupt: list[str] = []
        hits = bytes_read = 0
        for key, blob in zip(keys, blobs, strict=True):
            if blob is None:
                out.append(None)
                continue
            try:
                payload = decode_entry(blob, self.meta)
            except CorruptEntry as e:
                logger.warning("%s: deleting corrupt entry %s: %s", self.name, self.redis_key(key), e.reason)
                corrupt.append(self.redis_key(key))
                out.append(None)
                continue
            hits += 1
            bytes_read += len(payload)
            out.append(payload)
        if corrupt:
            self._delete_names(corrupt)
        self._count(hits=hits, misses=len(keys) - hits, bytes_read=bytes_read, corrupt=len(corrupt),
                    load_latency_s=time.perf_counter() - start, load_count=1)
        return out

    # --- writes -----------------------------------------------------------------------------------------
    def put(self, key: bytes, value: bytes) -> bool:
        return self.put_many([(key, value)]) == 1

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        if not items:
            return 0
        if not self._ready():
            return 0
        try:
            pipe = self._client.pipeline(transaction=False)
            for key, value in items:
                pipe.set(self.redis_key(key), encode_entry(value, self.meta), px=self._retention_ms)
            results = pipe.execute(raise_on_error=False)
        except _CONNECTION_ERRORS as e:
            self._fail(e)
            return 0
        failures = [r for r in results if isinstance(r, Exception)]
        if failures and all(isinstance(r, _CONNECTION_ERRORS) for r in failures):
            self._fail(failures[0])
        else:
            self._backoff.record_success()
            if failures:  # e.g. OOM under maxmemory: the server is fine, these writes were refused
                self._count(errors=len(failures))
                logger.warning("%s: %d of %d SETs refused: %r", self.name, len(failures), len(items), failures[0])
        num_stored = sum(1 for r in results if r is True)
        bytes_written = sum(len(v) for (_, v), r in zip(items, results, strict=True) if r is True)
        self._count(bytes_written=bytes_written)
        return num_stored

    def delete(self, key: bytes) -> None:
        if self._ready():
            self._delete_names([self.redis_key(key)])

    def _delete_names(self, names: list[str]) -> None:
        try:
            self._client.delete(*names)
        except _CONNECTION_ERRORS as e:
            self._fail(e)
        except redis.exceptions.RedisError as e:
            self._count(errors=1)
            logger.warning("%s: DEL failed: %r", self.name, e)

    # --- reporting --------------------------------------------------------------------------------------
    def stats(self) -> TierStats:
        with self._lock:
            return self._stats.copy()

    def close(self) -> None:
        try:
            self._client.close()
        except (redis.exceptions.RedisError, OSError) as e:
            logger.debug("%s: error while closing: %r", self.name, e)
