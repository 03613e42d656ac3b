"""The contract every KV storage tier keeps, plus what all tiers share: keys, entry framing, stats, backoff.

A tier stores opaque ``bytes`` payloads (the KV of one block, serialised by the cache layer above) under
``bytes`` keys. Contract, for every tier:

- ``get`` returns exactly the bytes ``put`` was given, or ``None``. Never a wrong payload, never an
  exception: a failing or corrupt tier degrades to a miss, logged and counted.
- ``put`` returns ``True`` when the entry was stored, ``False`` when it was not (too big, tier down, disk
  full); it never raises either.
- Entries expire ``retention_s`` after they were last written (re-putting refreshes them); reads move an
  entry to the most-recently-used end but do not extend its life.

Tiers that leave the process (disk, Redis) frame each payload with a header (``encode_entry``) and verify
it on the way back (``decode_entry``), so a truncated file, a flipped bit or an entry written by another
model reads as a miss instead of wrong KV. Keys (``make_key``) carry the model fingerprint, KV dtype,
block size and layout version too, so a key built for one model can never name another model's entry.

Nothing here imports torch: tiers never see devices or tensors.
"""

from __future__ import annotations

import hashlib
import logging
import struct
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Protocol, runtime_checkable

from kvserve.errors import StorageError

logger = logging.getLogger(__name__)

BLOCK_HASH_SIZE = 16  # kvserve.block_hash.hash_block digests
# What a block's entry holds, and how the engine computes a model's KV from its files; bump it when either
# changes (2: the block's parent hash and token ids come first; 3: rotary scaling computed, and Gemma 3 27B's
# query scale, so that KV an earlier version wrote for such a model is not read as its own).
LAYOUT_VERSION = 3
NAMESPACE_DIGEST_SIZE = 8


class CorruptEntry(StorageError):
    """A stored entry failed verification: truncated, bad checksum, or written for another model/layout.

    ``reason`` is a short machine-friendly phrase ("bad magic", "fingerprint mismatch", ...).
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"corrupt KV entry: {reason}" + (f" ({detail})" if detail else ""))
        self.reason = reason


# ---------------------------------------------------------------------------------------------------------
# Keys
# ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class KeyNamespace:
    """What a block hash alone does not say: whose KV it is, computed how, and how it is laid out."""

    model_fingerprint: str
    kv_dtype: str  # "bfloat16", "float16", "float32", ...
    block_size: int
    layout_version: int = LAYOUT_VERSION
    # How the weights were multiplied, where that is not the dtype alone ("gguf-int8": kept in their GGUF
    # blocks, int8 activations): engines that compute the same model another way do not read each other's KV.
    numerics: str = ""

    def digest(self) -> bytes:
        """``NAMESPACE_DIGEST_SIZE`` bytes that differ whenever any field differs."""
        text = f"{self.layout_version}\0{self.model_fingerprint}\0{self.kv_dtype}\0{self.block_size}"
        if self.numerics:
            text += f"\0{self.numerics}"
        return hashlib.blake2b(text.encode(), digest_size=NAMESPACE_DIGEST_SIZE).digest()

    @property
    def model_identity(self) -> str:
        """The fingerprint an entry's header carries: the model's, and how it was computed where that is said."""
        return f"{self.model_fingerprint}/{self.numerics}" if self.numerics else self.model_fingerprint


def make_key(block_hash: bytes, namespace: KeyNamespace) -> bytes:
    """Tier key of one block: namespace digest (8 bytes) followed by the chained block hash (16 bytes).

    ``[0, 8)`` namespace digest | ``[8, 24)`` block hash
    """
    if len(block_hash) != BLOCK_HASH_SIZE:
        raise ValueError(f"block hash must be {BLOCK_HASH_SIZE} bytes, got {len(block_hash)}")
    return namespace.digest() + bytes(block_hash)


# ---------------------------------------------------------------------------------------------------------
# Entry framing
# ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class EntryMeta:
    """What an entry's payload is: checked on every read against what the reader expects."""

    model_fingerprint: str
    kv_dtype: str
    block_size: int
    shape: tuple[int, ...]  # shape of the block's KV as the layer above serialised it
    layout_version: int = LAYOUT_VERSION

    @classmethod
    def for_namespace(cls, namespace: KeyNamespace, shape: Sequence[int]) -> EntryMeta:
        return cls(namespace.model_identity, namespace.kv_dtype, namespace.block_size, tuple(shape),
                   namespace.layout_version)


@dataclass(frozen=True, slots=True)
class EntryHeader:
    """A parsed header; ``meta`` is what the writer claimed, ``created_at`` its clock at write time."""

    meta: EntryMeta
    created_at: float
    payload_len: int
    header_len: int


ENTRY_MAGIC = b"KVSE"
ENTRY_FORMAT_VERSION = 1
# Fixed part of the header, little-endian; variable parts follow it, then the payload:
#
#   offset  size  field
#   0       4     magic b"KVSE"
#   4       2     format version
#   6       2     header length (fixed + variable parts)
#   8       8     created_at (float64, writer's clock)
#   16      8     payload length
#   24      4     block size
#   28      2     layout version
#   30      1     ndim
#   31      1     len(kv dtype)
#   32      2     len(model fingerprint)
#   34      4     crc32 of (header with this field zeroed) + payload
#   38      8*ndim shape (uint64 each)
#   ..      ..    kv dtype (ascii), model fingerprint (utf-8)
#   header_len    payload
_FIXED = struct.Struct("<4sHHdQIHBBHI")
_CRC_OFFSET = 34
_MAX_DIMS = 255


def encode_entry(payload: bytes, meta: EntryMeta, *, created_at: float | None = None) -> bytes:
    """Frame ``payload`` with a self-describing, checksummed header (see the map above)."""
    dtype = meta.kv_dtype.encode("ascii")
    fingerprint = meta.model_fingerprint.encode("utf-8")
    if len(meta.shape) > _MAX_DIMS or len(dtype) > 255 or len(fingerprint) > 0xFFFF:
        raise ValueError(f"entry metadata too large to frame: {meta!r}")
    variable = struct.pack(f"<{len(meta.shape)}Q", *meta.shape) + dtype + fingerprint
    header_len = _FIXED.size + len(variable)
    when = time.time() if created_at is None else created_at
    fixed = _FIXED.pack(ENTRY_MAGIC, ENTRY_FORMAT_VERSION, header_len, when, len(payload), meta.block_size,
                        meta.layout_version, len(meta.shape), len(dtype), len(fingerprint), 0)
    header = bytearray(fixed + variable)
    crc = zlib.crc32(payload, zlib.crc32(header))
    struct.pack_into("<I", header, _CRC_OFFSET, crc)
    return bytes(header) + bytes(payload)


def read_header(blob: bytes) -> EntryHeader:
    """Parse and sanity-check the header (magic, version, lengths, checksum) without comparing metadata."""
    if len(blob) < _FIXED.size:
        raise CorruptEntry("truncated", f"{len(blob)} bytes is shorter than the header")
    (magic, version, header_len, created_at, payload_len, block_size, layout_version, ndim, dtype_len,
     fp_len, crc) = _FIXED.unpack_from(blob)
    if magic != ENTRY_MAGIC:
        raise CorruptEntry("bad magic", repr(magic))
    if version != ENTRY_FORMAT_VERSION:
        raise CorruptEntry("format version mismatch", f"got {version}, want {ENTRY_FORMAT_VERSION}")
    if header_len != _FIXED.size + 8 * ndim + dtype_len + fp_len:
        raise CorruptEntry("bad header length", str(header_len))
    if len(blob) != header_len + payload_len:
        reason = "truncated" if len(blob) < header_len + payload_len else "trailing bytes"
        raise CorruptEntry(reason, f"{len(blob)} bytes, header says {header_len + payload_len}")
    view = memoryview(blob)
    header = bytearray(view[:header_len])
    struct.pack_into("<I", header, _CRC_OFFSET, 0)
    if zlib.crc32(view[header_len:], zlib.crc32(header)) != crc:
        raise CorruptEntry("bad checksum")
    offset = _FIXED.size
    shape = struct.unpack_from(f"<{ndim}Q", blob, offset)
    offset += 8 * ndim
    try:
        dtype = bytes(view[offset : offset + dtype_len]).decode("ascii")
        fingerprint = bytes(view[offset + dtype_len : header_len]).decode("utf-8")
    except UnicodeDecodeError as e:
        raise CorruptEntry("bad header text", str(e)) from None
    meta = EntryMeta(fingerprint, dtype, block_size, tuple(shape), layout_version)
    return EntryHeader(meta, created_at, payload_len, header_len)


def decode_entry_with_header(blob: bytes, expected: EntryMeta) -> tuple[EntryHeader, bytes]:
    """Verify ``blob`` against ``expected`` and return its header and payload; raises CorruptEntry."""
    header = read_header(blob)
    got = header.meta
    for field_name, reason in (
        ("model_fingerprint", "fingerprint mismatch"),
        ("kv_dtype", "dtype mismatch"),
        ("block_size", "block size mismatch"),
        ("shape", "shape mismatch"),
        ("layout_version", "layout version mismatch"),
    ):
        have, want = getattr(got, field_name), getattr(expected, field_name)
        if have != want:
            raise CorruptEntry(reason, f"entry has {have!r}, expected {want!r}")
    return header, blob[header.header_len :]


def decode_entry(blob: bytes, expected: EntryMeta) -> bytes:
    """The payload of a framed entry, verified against ``expected``; raises CorruptEntry on any mismatch."""
    return decode_entry_with_header(blob, expected)[1]


# ---------------------------------------------------------------------------------------------------------
# Stats
# ---------------------------------------------------------------------------------------------------------
@dataclass(slots=True)
class TierStats:
    """Counters one tier exports (Prometheus, per tier). Monotonic except ``entries`` and ``bytes_held``.

    ``bytes_read`` / ``bytes_written`` count payload bytes returned by hits and accepted by puts.
    ``entries`` / ``bytes_held`` are gauges filled in by ``stats()``; ``None`` where the tier cannot know
    them cheaply (a shared Redis). ``load_latency_s`` is a sum over ``load_count`` get/get_many calls.
    """

    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    entries: int | None = 0
    bytes_held: int | None = 0
    evictions: int = 0
    expirations: int = 0
    errors: int = 0
    corrupt: int = 0
    refused: int = 0  # entries holding another block than the one looked up (set by the cache layer)
    load_latency_s: float = 0.0
    load_count: int = 0

    def copy(self) -> TierStats:
        return TierStats(**{f.name: getattr(self, f.name) for f in fields(self)})

    def as_dict(self) -> dict[str, float | int | None]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


# ---------------------------------------------------------------------------------------------------------
# The protocol
# ---------------------------------------------------------------------------------------------------------
@runtime_checkable
class KVStore(Protocol):
    """One storage tier. See the module docstring for the contract (never raises, misses on failure)."""

    name: str

    def contains(self, key: bytes) -> bool: ...

    def get(self, key: bytes) -> bytes | None: ...

    def put(self, key: bytes, value: bytes) -> bool: ...

    def delete(self, key: bytes) -> None: ...

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]: ...

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]: ...

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> int: ...

    @property
    def capacity_bytes(self) -> int | None:
        """Upper bound on ``used_bytes``; ``None`` when kvserve does not bound the tier (Redis)."""
        ...

    @property
    def used_bytes(self) -> int | None: ...

    @property
    def num_entries(self) -> int | None: ...

    @property
    def healthy(self) -> bool: ...

    def stats(self) -> TierStats: ...

    def close(self) -> None: ...


# ---------------------------------------------------------------------------------------------------------
# Backoff for tiers whose environment fails (Redis down, disk unreadable or full)
# ---------------------------------------------------------------------------------------------------------
class Backoff:
    """Health of one tier. After a failure the tier is unhealthy and ``allow()`` says no until
    ``retry_after``; then exactly one operation is let through as a probe. A failed probe doubles the
    delay (capped at ``max_s``); a success makes the tier healthy again.

    One warning is logged per outage (at its first failure) and one info line at recovery, so a dead
    Redis does not flood the log with a line per lookup. Thread-safe.
    """

    def __init__(
        self,
        name: str,
        *,
        initial_s: float = 1.0,
        max_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        log: logging.Logger | None = None,
    ) -> None:
        if initial_s <= 0 or max_s < initial_s:
            raise ValueError(f"need 0 < initial_s <= max_s, got {initial_s}, {max_s}")
        self.name = name
        self.initial_s = initial_s
        self.max_s = max_s
        self._clock = clock
        self._log = log or logger
        self._lock = threading.Lock()
        self._healthy = True
        self._num_failures = 0  # consecutive, in the current outage
        self._total_failures = 0
        self._retry_after = 0.0
        self._outage_start = 0.0

    @property
    def healthy(self) -> bool:
        return self._healthy

    @property
    def retry_after(self) -> float:
        """Clock time after which the next probe is allowed (meaningless while healthy)."""
        return self._retry_after

    @property
    def num_failures(self) -> int:
        """Consecutive failures in the current outage (0 while healthy)."""
        return self._num_failures

    @property
    def total_failures(self) -> int:
        return self._total_failures

    def _delay(self) -> float:
        return min(self.max_s, self.initial_s * 2.0 ** max(0, self._num_failures - 1))

    def allow(self) -> bool:
        """Whether to attempt an operation now. While unhealthy, True once per elapsed backoff period."""
        with self._lock:
            if self._healthy:
                return True
            now = self._clock()
            if now < self._retry_after:
                return False
            # Let this one caller probe; others keep short-circuiting until it reports back.
            self._retry_after = now + self._delay()
            return True

    def record_success(self) -> None:
        if self._healthy:
            return
        with self._lock:
            if self._healthy:
                return
            self._log.info("%s: storage tier recovered after %d failed attempt(s) over %.1f s", self.name,
                           self._num_failures, self._clock() - self._outage_start)
            self._healthy = True
            self._num_failures = 0

    def record_failure(self, error: BaseException | str) -> None:
        with self._lock:
            now = self._clock()
            self._total_failures += 1
            self._num_failures += 1
            if self._healthy:
                self._healthy = False
                self._outage_start = now
                self._log.warning("%s: storage tier unavailable, treating it as a miss (retrying with "
                                  "backoff up to %.0f s): %s", self.name, self.max_s, error)
            else:
                self._log.debug("%s: retry failed (%d in a row): %s", self.name, self._num_failures, error)
            self._retry_after = now + self._delay()
