"""KV storage tiers below device memory: host DRAM, local disk, Redis. Reached only through ``KVStore``.

``RedisKVStore`` lives in ``kvserve.storage.redis`` and is not re-exported, so that importing the package
does not import the redis client.
"""

from __future__ import annotations

from kvserve.storage.base import (
    Backoff,
    CorruptEntry,
    EntryHeader,
    EntryMeta,
    KeyNamespace,
    KVStore,
    TierStats,
    decode_entry,
    decode_entry_with_header,
    encode_entry,
    make_key,
    read_header,
)
from kvserve.storage.disk import DiskKVStore
from kvserve.storage.host import HostKVStore

__all__ = [
    "Backoff",
    "CorruptEntry",
    "DiskKVStore",
    "EntryHeader",
    "EntryMeta",
    "HostKVStore",
    "KVStore",
    "KeyNamespace",
    "TierStats",
    "decode_entry",
    "decode_entry_with_header",
    "encode_entry",
    "make_key",
    "read_header",
]
