"""The KV tiers below device memory, seen as one store: host DRAM, then local disk and/or Redis. No torch.

What goes where (keys are ``make_key(block_hash, namespace)``; a value is the block's identity, its parent's
hash and its token ids (``kvserve.block_hash.block_identity``), then its serialised KV)::

    write_back     put_blocks ──► host (LRU) ──host evicts──► disk, redis
                   (no host tier: put_blocks ──► disk, redis)
    write_through  put_blocks ──► host, disk, redis           (host evictions are already below)

    lookup_run     block i is taken from the first tier holding it (host → disk → redis); the run ends
                   at the first block no tier holds or whose payload fails to load. Blocks found below
                   the host are promoted into it, so a request that waits and looks up again reads DRAM.

Every tier keeps the ``KVStore`` contract (never raises; a corrupt entry, a dead Redis or a full disk is a
miss, logged once per outage and counted), so nothing here needs a try. On top of it this class checks
each value's length against the block size the runner will write, so a wrong-length value (one the
framing accepted, e.g. from an in-process host tier fed by a buggy writer) is a miss, not a crash.

A hit is confirmed on the tokens, as in the device tree: the key (namespace: model fingerprint, dtype,
block size, layout; 128-bit chained hash) finds the entry, and its stored identity must equal the identity
of the block looked up, else the entry is refused (a miss, counted) and deleted. A hash collision or a
foreign writer sharing the Redis keyspace can then cost a hit, never give a wrong answer.

Each tier store guards itself with its own lock, so the methods that touch only the stores (``fetch``,
``locate``, ``write_lower``, ``write_down``, ``sweep``) may run on worker threads while the engine loop
goes on; the rest (``put_host``, ``finish``, the admission counters) belong to the engine loop
(cache/tier_coordinator.py says which thread does what). ``put_blocks`` and ``lookup_run`` do it all at
once, synchronously.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable, Iterable, Sequence

from kvserve.block_hash import BlockHash, block_identity
from kvserve.config import DEFAULT_DISK_GB, StorageConfig
from kvserve.errors import ConfigError
from kvserve.storage.base import EntryMeta, KeyNamespace, KVStore, TierStats, encode_entry, make_key
from kvserve.storage.disk import DiskKVStore, entry_bytes
from kvserve.storage.host import HostKVStore

logger = logging.getLogger(__name__)

GIB = 1 << 30

PERSIST_BATCH = 64  # blocks written a batch at a time at shutdown
BlockKV = tuple[BlockHash, bytes, bytes]  # (chained hash, block_identity, serialised KV) of one full block


def disk_capacity_bytes(directory: str, disk_gb: float | None) -> int:
    """The disk tier's capacity: ``disk_gb``, or by default ``DEFAULT_DISK_GB`` capped at half the space
    free in ``directory`` (so that the default never fills the disk), the tier's own files from an earlier
    run counted as free (else each restart would shrink the capacity and evict what it kept)."""
    if disk_gb is not None:
        return int(disk_gb * GIB)
    default = int(DEFAULT_DISK_GB * GIB)
    try:
        os.makedirs(directory, exist_ok=True)
        capacity = min(default, (shutil.disk_usage(directory).free + entry_bytes(directory)) // 2)
    except OSError:  # the tier itself reports the directory's problem (unhealthy, every lookup a miss)
        capacity = default
    logger.info("disk tier in %s: %.1f GiB (the default; --kv-disk-gb sets it)", directory, capacity / GIB)
    return capacity


class TieredKVStore:
    """Host, disk and Redis tiers (each optional) behind ``put_blocks`` / ``lookup_run``."""

    def __init__(
        self,
        config: StorageConfig,
        namespace: KeyNamespace,
        block_shape: Sequence[int],
        *,
        payload_nbytes: int | None = None,
        clock: Callable[[], float] = time.time,
        redis_socket_timeout: float = 0.5,
        redis_key_prefix: str = "kvserve:",
    ) -> None:
        self.config = config
        self.namespace = namespace
        self.meta = EntryMeta.for_namespace(namespace, block_shape)
        self.payload_nbytes = payload_nbytes  # of the serialised KV alone
        self.identity_nbytes = len(block_identity(None, [0] * namespace.block_size))
        self.write_through = config.write_policy == "write_through"
        self.retention_s = config.retention_s
        self._handed_down: list[tuple[bytes, bytes]] = []  # host evictions waiting to be written below
        self._refused_entries: list[tuple[KVStore, bytes]] = []  # found wrong by ``finish``: to delete (I/O)

        self.disk: DiskKVStore | None = None
        self.redis: KVStore | None = None
        if config.disk_dir:
            self.disk = DiskKVStore(config.disk_dir, disk_capacity_bytes(config.disk_dir, config.disk_gb),
                                    config.retention_s, meta=self.meta, clock=clock)
        if config.redis_url:
            from kvserve.storage.redis import RedisKVStore  # only importing redis-py when it is used

            self.redis = RedisKVStore(config.redis_url, config.retention_s, meta=self.meta,
                                      key_prefix=redis_key_prefix, socket_timeout=redis_socket_timeout)
        self.lower: list[KVStore] = [t for t in (self.disk, self.redis) if t is not None]
        self.host: HostKVStore | None = None
        if config.host_gb > 0:
            write_down = self.lower and not self.write_through
            self.host = HostKVStore(int(config.host_gb * GIB), config.retention_s, clock=clock,
                                    on_evict=self._on_host_evict if write_down else None)
        self.tiers: list[KVStore] = [t for t in (self.host, self.disk, self.redis) if t is not None]
        if payload_nbytes is not None:
            self._check_room(self.identity_nbytes + payload_nbytes)
        self.names = [t.name for t in self.tiers]
        # Admission-time counters, in tokens: per tier, tokens found there / looked for there and not found.
        self._hit_tokens = dict.fromkeys(self.names, 0)
        self._miss_tokens = dict.fromkeys(self.names, 0)
        self._bad_payloads = dict.fromkeys(self.names, 0)  # wrong length for a block: counted as errors
        self._refused = dict.fromkeys(self.names, 0)  # stored identity differs from the block looked up

    def _check_room(self, entry_nbytes: int) -> None:
        """A tier that cannot hold one block would silently hold nothing: refuse it at start-up."""
        header_nbytes = len(encode_entry(b"", self.meta))  # the disk tier frames each entry
        for tier, option, size in ((self.host, "host_gb", entry_nbytes),
                                   (self.disk, "disk_gb", entry_nbytes + header_nbytes)):
            if tier is not None and tier.capacity_bytes < size:
                self.close()
                raise ConfigError(f"the {tier.name} tier ({tier.capacity_bytes} bytes) cannot hold one KV block "
                                  f"({size} bytes): give it more room", option)

    # --- writes -------------------------------------------------------------------------------------------
    def put_blocks(self, items: Sequence[BlockKV]) -> None:
        """Store blocks offloaded from device memory (see the module map for where they go), synchronously."""
        self.write_lower(self.put_host(items))
        self.write_down(self.take_handed_down())

    def put_host(self, items: Sequence[BlockKV]) -> list[tuple[bytes, bytes]]:
        """The host tier's share of ``put_blocks``; returns the entries that go straight to the lower tiers
        (``write_lower``). What the host evicts meanwhile waits in ``take_handed_down``."""
        if not items:
            return []
        entries = [(make_key(block_hash, self.namespace), identity + payload) for block_hash, identity, payload in items]
        if self.host is not None:
            self.host.put_many(entries)
        return entries if (self.write_through or self.host is None) and self.lower else []

    def write_lower(self, entries: Sequence[tuple[bytes, bytes]]) -> None:
        for tier in self.lower:
            tier.put_many(entries)

    def _on_host_evict(self, key: bytes, value: bytes) -> None:
        # Called synchronously inside host.put_many; batched into one put_many per lower tier afterwards.
        self._handed_down.append((key, value))

    def take_handed_down(self) -> list[tuple[bytes, bytes]]:
        """Entries the host tier evicted since the last call, for ``write_down``."""
        items, self._handed_down = self._handed_down, []
        return items

    def write_down(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        """Write entries the host tier evicted to the lower tiers."""
        if not items:
            return
        for tier in self.lower:
            if tier is self.disk:
                # A block promoted from disk into the host is still on disk: don't rewrite the file.
                present = tier.contains_many([key for key, _ in items])
                todo = [item for item, there in zip(items, present, strict=True) if not there]
            else:
                todo = items  # Redis: a re-put refreshes the entry's expiry for every engine sharing it
            if todo:
                tier.put_many(todo)

    # --- reads --------------------------------------------------------------------------------------------
    @property
    def remote(self) -> bool:
        """Whether a tier is across the network (Redis): even asking it for presence is a round trip."""
        return self.redis is not None

    def holds(self, block_hash: BlockHash) -> bool:
        """Whether the first local tier already holds a block (cheap, no I/O): an eviction can skip it."""
        tier = self.host if self.host is not None else self.disk
        return tier is not None and tier.contains(make_key(block_hash, self.namespace))

    def lookup_run(self, block_hashes: Sequence[BlockHash], identities: Sequence[bytes]) -> list[tuple[str, bytes]]:
        """The longest run of blocks, from ``block_hashes[0]`` on, that the tiers can load: (tier, serialised
        KV) per block. Synchronous: ``locate``, ``fetch``, ``finish``."""
        owners = self.locate(block_hashes)
        found = self.finish(block_hashes, identities, owners, self.fetch(block_hashes, owners)) if owners else []
        self.write_down(self.take_handed_down())
        self.delete_refused(self.take_refused())
        return found

    def take_refused(self) -> list[tuple[KVStore, bytes]]:
        """The entries ``finish`` found wrong since the last call (another block, a wrong size), to delete."""
        refused, self._refused_entries = self._refused_entries, []
        return refused

    @staticmethod
    def delete_refused(refused: Sequence[tuple[KVStore, bytes]]) -> None:
        """Delete the entries ``take_refused`` gave (file unlinks, Redis round trips: off the step loop)."""
        for tier, key in refused:
            tier.delete(key)

    def locate(self, block_hashes: Sequence[BlockHash]) -> list[KVStore]:
        """Which tier holds each block of the longest present run (presence asked of each tier in order,
        batched). Cheap: in-memory indexes for host and disk, one pipelined round trip for Redis."""
        n = len(block_hashes)
        if n == 0 or not self.tiers:
            return []
        keys = [make_key(h, self.namespace) for h in block_hashes]
        owner: list[KVStore | None] = [None] * n
        for tier in self.tiers:
            todo = [i for i in range(n) if owner[i] is None]
            if not todo:
                break
            for i, present in zip(todo, tier.contains_many([keys[i] for i in todo]), strict=True):
                if present:
                    owner[i] = tier
        run = next((i for i, tier in enumerate(owner) if tier is None), n)
        return owner[:run]  # type: ignore[return-value]

    def needs_io(self, owners: Sequence[KVStore]) -> bool:
        """Whether fetching these blocks reads a file or the network (worth doing off the engine loop)."""
        return any(tier is not self.host for tier in owners)

    def fetch(self, block_hashes: Sequence[BlockHash], owners: Sequence[KVStore]) -> list[bytes | None]:
        """Each tier's share of the run in one ``get_many``. Touches only the tier stores (each guarded by
        its own lock), so it may run on a worker thread while the engine loop goes on."""
        keys = [make_key(h, self.namespace) for h in block_hashes[: len(owners)]]
        payloads: list[bytes | None] = [None] * len(owners)
        for tier in self.tiers:
            idx = [i for i, owner in enumerate(owners) if owner is tier]
            if idx:
                for i, payload in zip(idx, tier.get_many([keys[i] for i in idx]), strict=True):
                    payloads[i] = payload
        return payloads

    def finish(self, block_hashes: Sequence[BlockHash], identities: Sequence[bytes], owners: Sequence[KVStore],
               values: Sequence[bytes | None]) -> list[tuple[str, bytes]]:
        """On the engine loop: drop values of the wrong size or of another block (its stored identity is
        not the one looked up), cut the run at the first missing block, and promote what came from below
        into the host tier (what that pushes out waits in ``take_handed_down``)."""
        keys = [make_key(h, self.namespace) for h in block_hashes[: len(owners)]]
        checked: list[bytes | None] = list(values)
        for i, value in enumerate(checked):
            if value is not None and not self._is_block(value, identities[i], owners[i]):
                self._refused_entries.append((owners[i], keys[i]))
                checked[i] = None
        end = next((i for i, value in enumerate(checked) if value is None), len(checked))
        if self.host is not None:
            promote = [(keys[i], checked[i]) for i in range(end) if owners[i] is not self.host]
            if promote:
                self.host.put_many(promote)  # type: ignore[arg-type]
        n = self.identity_nbytes
        return [(owners[i].name, checked[i][n:]) for i in range(end)]  # type: ignore[index]

    def _is_block(self, value: bytes, identity: bytes, tier: KVStore) -> bool:
        """Whether a stored value has the right size and holds the block whose identity is ``identity``."""
        want = None if self.payload_nbytes is None else self.identity_nbytes + self.payload_nbytes
        if (want is not None and len(value) != want) or len(value) < self.identity_nbytes:
            self._bad_payloads[tier.name] += 1
            logger.warning("%s: deleting a KV entry of %d bytes (a block takes %s)", tier.name, len(value), want)
            return False
        if value[: self.identity_nbytes] != identity:
            self._refused[tier.name] += 1
            logger.warning("%s: refusing a KV entry whose tokens differ from the block looked up (a hash "
                           "collision or a foreign writer); deleting it", tier.name)
            return False
        return True

    def record_admission(self, num_query_tokens: int, tokens_by_tier: dict[str, int]) -> None:
        """Count one admitted request's lookup, in tokens: a tier's hits are the tokens it supplied; its
        misses are the tokens looked up that neither device memory nor any tier above it supplied and it
        did not either."""
        remaining = num_query_tokens - tokens_by_tier.get("device", 0)
        for name in self.names:
            hits = tokens_by_tier.get(name, 0)
            self._hit_tokens[name] += hits
            self._miss_tokens[name] += max(0, remaining - hits)
            remaining -= hits

    # --- upkeep -------------------------------------------------------------------------------------------
    def sweep(self) -> int:
        """Drop expired entries from the local tiers (Redis expires its own); returns how many."""
        dropped = 0
        for tier in (self.host, self.disk):
            if tier is not None:
                dropped += tier.sweep()
        return dropped

    @property
    def sweep_interval_s(self) -> float:
        """How often the engine should call ``sweep``: often enough for short retentions, cheap for long ones."""
        return min(60.0, max(0.5, self.retention_s / 4))

    def stats(self) -> dict[str, TierStats]:
        """Per tier, the store's own counters, with ``hits``/``misses`` in tokens at admission (see
        ``record_admission``) instead of the store's per-read block counts."""
        out: dict[str, TierStats] = {}
        for tier in self.tiers:
            s = tier.stats()
            s.hits = self._hit_tokens[tier.name]
            s.misses = self._miss_tokens[tier.name]
            s.errors += self._bad_payloads[tier.name]
            s.refused = self._refused[tier.name]
            out[tier.name] = s
        return out

    def healthy(self) -> dict[str, bool]:
        return {tier.name: tier.healthy for tier in self.tiers}

    def persist(self, items: Iterable[BlockKV], batch: int = PERSIST_BATCH) -> None:
        """Write blocks straight to the tiers that outlive the process (disk, Redis), with what the host
        tier holds: called at shutdown so that write-back KV survives a restart. ``items`` are written
        ``batch`` at a time as they come (one Redis pipeline each, the device read a part at a time)."""
        if not self.lower:
            return
        entries = self.take_handed_down()
        if self.host is not None:
            keys = self.host.keys()
            entries.extend(
                (key, value) for key, value in zip(keys, self.host.get_many(keys), strict=True) if value is not None
            )
        for start in range(0, len(entries), batch):
            self.write_down(entries[start:start + batch])
        pending: list[tuple[bytes, bytes]] = []
        for block_hash, identity, payload in items:
            pending.append((make_key(block_hash, self.namespace), identity + payload))
            if len(pending) == batch:
                self.write_down(pending)
                pending = []
        self.write_down(pending)

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()
