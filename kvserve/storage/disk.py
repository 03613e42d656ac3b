"""Disk tier: one framed file per key, LRU-bounded, rebuilt from the directory at start.

Layout (fan-out by a hash of the key, so keys sharing a namespace prefix still spread out)::

    <directory>/
      3f/                                   blake2b(key, 1 byte).hex()
        <key.hex()>.kv                      encode_entry(payload, meta): header + payload
        .tmp-<key.hex()>-<pid>-<rand>       a write in flight; os.replace()d onto the .kv name

File times carry the index across restarts: mtime = when the entry was written (retention counts from
it), atime = when it was last read (LRU order). Both are set explicitly with os.utime from the tier's
clock, so neither relies on the mount's atime policy.

Faults never reach the caller. A missing file is a plain miss. A file that fails verification (truncated,
garbage, another model's) is deleted and counted as corrupt. Environmental errors (directory unreadable,
disk full, I/O error) count an error and mark the tier unhealthy: operations short-circuit to miss / no-op
until the backoff allows a probe.

One process owns a directory: stray temporary files are deleted at start, and another process's writes
are not seen until restart (the index lives in memory).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from kvserve.storage.base import (
    Backoff,
    CorruptEntry,
    EntryMeta,
    TierStats,
    decode_entry_with_header,
    encode_entry,
)
from kvserve.storage.lru_index import IndexEntry, LRUIndex

logger = logging.getLogger(__name__)

_SUFFIX = ".kv"
_TMP_PREFIX = ".tmp-"
_MAX_KEY_BYTES = 100  # hex name + suffix must fit in a 255-byte file name


def entry_bytes(directory: str | os.PathLike[str]) -> int:
    """Bytes of the entry files a disk tier left in ``directory`` (0 if it holds none or cannot be read)."""
    total = 0
    try:
        with os.scandir(directory) as top:
            subdirs = [d.path for d in top if len(d.name) == 2 and d.is_dir(follow_symlinks=False)]
        for subdir in subdirs:
            with os.scandir(subdir) as files:
                total += sum(f.stat(follow_symlinks=False).st_size for f in files
                             if f.name.endswith(_SUFFIX) and f.is_file(follow_symlinks=False))
    except OSError:
        return total
    return total


class DiskKVStore:
    """One file per key under ``directory``, at most ``capacity_bytes`` of files (headers included)."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        capacity_bytes: int,
        retention_s: float,
        *,
        meta: EntryMeta,
        clock: Callable[[], float] = time.time,
        fsync: bool = False,
        backoff: Backoff | None = None,
        name: str = "disk",
    ) -> None:
        # Sizes are bytes on disk (header + payload); the payloads stay in the files.
        self._index: LRUIndex[None] = LRUIndex(capacity_bytes, retention_s)
        self.name = name
        self.directory = Path(directory)
        self.meta = meta
        self._clock = clock
        self._fsync = fsync
        self._backoff = backoff or Backoff(name, log=logger)
        # Guards the index, the counters and the backoff, and the steps that make a file's name and its index
        # entry agree (a rename, an unlink by name); files are read and written with it free, so that the
        # engine thread's index lookups and stats never wait behind a batch of writes.
        self._lock = threading.RLock()
        self._stats = TierStats()
        self._index_ready = False
        with self._lock:
            self._try_rebuild()

    # --- sizes ------------------------------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self._index.capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self._index.used_bytes

    @property
    def num_entries(self) -> int:
        return len(self._index)

    @property
    def healthy(self) -> bool:
        return self._backoff.healthy and self._index_ready

    def keys(self) -> list[bytes]:
        """Indexed keys from least to most recently used (for tests and debugging)."""
        with self._lock:
            return self._index.keys()

    # --- paths ------------------------------------------------------------------------------------------
    def path_for(self, key: bytes) -> Path:
        fan = hashlib.blake2b(key, digest_size=1).hexdigest()
        return self.directory / fan / (key.hex() + _SUFFIX)

    # --- start-up ---------------------------------------------------------------------------------------
    def _try_rebuild(self) -> bool:
        """Build the index from the directory (caller holds the lock). False, and unhealthy, if it cannot."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            found = self._scan()
        except OSError as e:
            self._fail(e)
            return False
        now = self._clock()
        # LRU order = last access (atime); ties broken by name for a deterministic order.
        found.sort(key=lambda item: (item[2], item[0]))
        self._index.clear()
        for key, size, _atime_ns, created_at in found:
            entry = IndexEntry(size, created_at, None)
            if self._index.is_expired(entry, now):
                self._unlink(self.path_for(key))
                self._stats.expirations += 1
                continue
            self._index.put(key, entry)
        self._index_ready = True
        self._backoff.record_success()
        self._evict_to_fit(0)  # the capacity may have shrunk since the last run
        logger.info("%s: indexed %d entries (%d bytes) in %s", self.name, len(self._index), self._index.used_bytes,
                    self.directory)
        return True

    def _scan(self) -> list[tuple[bytes, int, int, float]]:
        """(key, size, atime_ns, mtime) of every entry file; deletes stray temporary files."""
        found: list[tuple[bytes, int, int, float]] = []
        with os.scandir(self.directory) as top:
            subdirs = [d.path for d in top if len(d.name) == 2 and d.is_dir(follow_symlinks=False)]
        for subdir in subdirs:
            with os.scandir(subdir) as files:
                for f in files:
                    if f.name.startswith(_TMP_PREFIX):
                        self._unlink(Path(f.path))
                        continue
                    if not f.name.endswith(_SUFFIX) or not f.is_file(follow_symlinks=False):
                        continue
                    try:
                        key = bytes.fromhex(f.name[: -len(_SUFFIX)])
                    except ValueError:
                        continue
                    if self.path_for(key) != Path(f.path):
                        continue  # not a name this tier would write: leave it alone
                    try:
                        st = f.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue  # deleted while we scanned
                    found.append((key, st.st_size, st.st_atime_ns, st.st_mtime))
        return found

    def _ready(self, *, writing: bool) -> bool:
        """Whether to touch the disk now. While unhealthy, once per backoff period, let one operation
        probe: rescan if the start-up scan failed; a write is its own probe; a read first checks that the
        directory can be listed (a lookup of an unindexed key would otherwise never touch the disk)."""
        if not self._backoff.allow():
            return False
        if self._backoff.healthy:
            return True
        if not self._index_ready:
            return self._try_rebuild()
        if writing:
            return True
        try:
            with os.scandir(self.directory):
                pass
        except OSError as e:
            self._fail(e)
            return False
        self._backoff.record_success()
        return True

    # --- reads ------------------------------------------------------------------------------------------
    def _indexed(self, key: bytes, now: float) -> IndexEntry[None] | None:
        if self._index.pop_if_expired(key, now):
            self._unlink(self.path_for(key))
            self._stats.expirations += 1
            return None
        return self._index.get(key)

    def contains(self, key: bytes) -> bool:
        """Index lookup only (no disk access); False while the tier is down."""
        return self.contains_many([key])[0]

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            if not self._backoff.healthy or not self._index_ready:
                return [False] * len(keys)
            now = self._clock()
            return [self._indexed(key, now) is not None for key in keys]

    def get(self, key: bytes) -> bytes | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        start = time.perf_counter()
        with self._lock:
            if not self._ready(writing=False):
                self._stats.misses += len(keys)
                return [None] * len(keys)
        out: list[bytes | None] = []
        for key in keys:
            if not self._backoff.healthy:  # the environment failed: the rest are misses, not more failures
                with self._lock:
                    self._stats.misses += len(keys) - len(out)
                out += [None] * (len(keys) - len(out))
                break
            out.append(self._get_one(key))
        with self._lock:
            self._stats.load_latency_s += time.perf_counter() - start
            self._stats.load_count += 1
        return out

    def _get_one(self, key: bytes) -> bytes | None:
        """One entry, its file read with the lock free (the engine thread's index lookups and stats wait only
        for the index's own updates). A file replaced or deleted meanwhile is read whole or not at all
        (writes are renamed into place): a miss, or the entry as it was."""
        now = self._clock()
        with self._lock:
            entry = self._indexed(key, now)
            if entry is None:
                self._stats.misses += 1
                return None
        path = self.path_for(key)
        try:
            with open(path, "rb") as f:
                blob = f.read()
        except FileNotFoundError:
            with self._lock:
                if self._index.get(key) is entry:  # deleted behind our back: a plain miss
                    self._index.remove(key)
                self._stats.misses += 1
            return None
        except OSError as e:
            with self._lock:
                self._fail(e)
                self._stats.misses += 1
            return None
        try:
            header, payload = decode_entry_with_header(blob, self.meta)
        except CorruptEntry as e:
            logger.warning("%s: deleting corrupt entry %s: %s", self.name, path, e.reason)
            with self._lock:
                self._stats.corrupt += 1
                self._stats.misses += 1
                if self._index.get(key) is entry:  # not a valid entry written since
                    self._index.remove(key)
                    self._unlink(path)
            return None
        with self._lock:
            self._backoff.record_success()
            self._stats.hits += 1
            self._stats.bytes_read += len(payload)
            if self._index.get(key) is entry:  # the file read is still the one under the key
                self._index.touch(key)
                try:
                    os.utime(path, (now, header.created_at))  # atime = last read, mtime = written
                except OSError:
                    pass  # LRU order across restarts is best-effort
        return payload

    # --- writes -----------------------------------------------------------------------------------------
    def put(self, key: bytes, value: bytes) -> bool:
        return self.put_many([(key, value)]) == 1

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        num_stored = 0
        with self._lock:
            if not self._ready(writing=True):
                return 0
        for key, value in items:
            if not self._put_one(key, value):
                if not self._backoff.healthy:
                    break  # environment failed: stop trying the rest of the batch
                continue
            num_stored += 1
        return num_stored

    def _put_one(self, key: bytes, value: bytes) -> bool:
        """One entry: its room made and its index entry added under the lock, its file written (and the
        evicted ones deleted) with the lock free."""
        if len(key) > _MAX_KEY_BYTES:
            logger.debug("%s: key of %d bytes is too long for a file name", self.name, len(key))
            return False
        now = self._clock()
        blob = encode_entry(value, self.meta, created_at=now)
        if len(blob) > self._index.capacity_bytes:
            return False
        with self._lock:
            old = self._index.get(key)
            evicted = self._make_room(len(blob) - (old.size if old else 0), keep=key)
        for victim in evicted:
            self._unlink(self.path_for(victim))
        path = self.path_for(key)
        tmp = path.with_name(f"{_TMP_PREFIX}{key.hex()}-{os.getpid()}-{os.urandom(4).hex()}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._write_file(tmp, blob)
            os.utime(tmp, (now, now))  # before the rename: a file under its key is always indexed
            with self._lock:  # the rename and its index entry as one (a rename only touches metadata)
                os.replace(tmp, path)
                self._backoff.record_success()
                self._index.put(key, IndexEntry(len(blob), now, None))
                self._stats.bytes_written += len(value)
        except OSError as e:
            self._unlink(tmp)
            if e.errno == errno.ENOSPC:
                logger.debug("%s: disk full writing %s", self.name, path)
            with self._lock:
                self._fail(e)
            return False
        return True

    def _write_file(self, tmp: Path, blob: bytes) -> None:
        # O_EXCL: never write into a file another writer is also writing.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(blob)
            while view:
                view = view[os.write(fd, view) :]
            if self._fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def delete(self, key: bytes) -> None:
        with self._lock:
            if self._index_ready:
                self._index.remove(key)
            self._unlink(self.path_for(key))

    def sweep(self) -> int:
        """Delete every expired entry; returns how many."""
        with self._lock:
            expired = self._index.pop_expired(self._clock())
            self._stats.expirations += len(expired)
        for key in expired:
            self._unlink(self.path_for(key))
        return len(expired)

    # --- internals (caller holds the lock) ---------------------------------------------------------------
    def _evict_to_fit(self, incoming: int, keep: bytes | None = None) -> None:
        """Delete LRU files until ``incoming`` more bytes fit under capacity (never the key ``keep``)."""
        for key in self._make_room(incoming, keep):
            self._unlink(self.path_for(key))

    def _make_room(self, incoming: int, keep: bytes | None = None) -> list[bytes]:
        """Take LRU entries out of the index until ``incoming`` more bytes fit under capacity (never the key
        ``keep``); their keys, whose files the caller deletes."""
        evicted = [key for key, _ in self._index.pop_lru_until_fits(incoming, keep)]
        self._stats.evictions += len(evicted)
        return evicted

    def _unlink(self, path: Path) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            logger.debug("%s: could not delete %s: %r", self.name, path, e)

    def _fail(self, error: OSError) -> None:
        self._stats.errors += 1
        self._backoff.record_failure(error)

    # --- reporting --------------------------------------------------------------------------------------
    def stats(self) -> TierStats:
        with self._lock:
            snapshot = self._stats.copy()
            snapshot.entries = len(self._index)
            snapshot.bytes_held = self._index.used_bytes
            return snapshot

    def close(self) -> None:
        """Nothing to flush: every put is complete (renamed into place) when it returns."""
