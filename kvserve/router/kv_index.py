"""The precise prefix index of the ``kv_events`` policy: the blocks each kvserve replica's device prefix cache
holds, followed from its block events (``GET /kvserve/kv_events``).

A prompt's blocks are keyed as the replica keys them (``kvserve.block_hash.hash_block``: chained over the token ids
of each full block and the replica's ``block_hash_extra``, which carries its model fingerprint), so a match
here is a match there, up to the follow interval: events are read every ``interval_s``, so a block stored or
evicted since is not yet known.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

import httpx

from kvserve.block_hash import BlockHash, hash_block
from kvserve.router.replicas import Replica

logger = logging.getLogger(__name__)


class KVBlockIndex:
    """Per replica: the hashes of the blocks it holds, and how far its events have been applied."""

    def __init__(self) -> None:
        self._blocks: dict[str, set[BlockHash]] = {}
        self._cursor: dict[str, tuple[str | None, int]] = {}
        self._generation: dict[str, int] = {}  # per replica, how many times it was forgotten

    def cursor(self, replica: str) -> tuple[str | None, int]:
        """(epoch, seq) of the last events applied for ``replica``; (None, 0) before any."""
        return self._cursor.get(replica, (None, 0))

    def generation(self, replica: str) -> int:
        """Changes whenever ``replica`` is forgotten: a read begun before must not be applied after."""
        return self._generation.get(replica, 0)

    def apply(self, replica: str, answer: dict[str, Any], generation: int | None = None) -> None:
        """One answer of ``GET /kvserve/kv_events``: a snapshot replaces what was known, events update it.
        ``generation``: the replica's when the read began; an answer read before it was forgotten is dropped
        (its events would continue a cursor the forgetting reset, over blocks it cleared)."""
        if generation is not None and generation != self.generation(replica):
            return
        if "snapshot" in answer:
            self._blocks[replica] = {bytes.fromhex(h) for h in answer["snapshot"].get("device", [])}
        else:
            blocks = self._blocks.setdefault(replica, set())
            for event in answer["events"]:
                if event["tier"] != "device":
                    continue
                hashes = (bytes.fromhex(h) for h in event["block_hashes"])
                if event["kind"] == "stored":
                    blocks.update(hashes)
                else:
                    blocks.difference_update(hashes)
        self._cursor[replica] = (answer["epoch"], int(answer["seq"]))

    def blocks(self, replica: str) -> set[BlockHash]:
        return self._blocks.get(replica, set())

    def forget(self, replica: str) -> None:
        self._blocks.pop(replica, None)
        self._cursor.pop(replica, None)
        self._generation[replica] = self.generation(replica) + 1

    def match(self, block_hashes: Sequence[BlockHash], replicas: Sequence[str]) -> dict[str, int]:
        """For each replica: how many leading blocks of ``block_hashes`` it holds."""
        matched = {}
        for replica in replicas:
            held = self._blocks.get(replica, set())
            n = 0
            while n < len(block_hashes) and block_hashes[n] in held:
                n += 1
            matched[replica] = n
        return matched


def block_hashes(token_ids: Sequence[int], block_size: int, extra: bytes) -> list[BlockHash]:
    """The keys a kvserve replica gives the full blocks of ``token_ids``."""
    hashes: list[BlockHash] = []
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start:start + block_size], extra)
        hashes.append(parent)
    return hashes


class KVEventFollower:
    """Reads every replica's new block events each ``interval_s`` into a KVBlockIndex."""

    def __init__(self, client: httpx.AsyncClient, headers: dict[str, str], index: KVBlockIndex,
                 replicas: Callable[[], Sequence[Replica]], interval_s: float) -> None:
        self._client = client
        self._headers = headers
        self.index = index
        self._replicas = replicas
        self._interval = interval_s
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="kvserve-router-kv-events")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self._interval)

    async def refresh(self) -> None:
        await asyncio.gather(*(self._follow(r) for r in self._replicas() if r.kv_events and r.healthy))

    async def _follow(self, replica: Replica) -> None:
        epoch, seq = self.index.cursor(replica.url)
        generation = self.index.generation(replica.url)
        params: dict[str, str | int] = {"after": seq, **({"epoch": epoch} if epoch else {})}
        try:
            response = await self._client.get(f"{replica.url}/kvserve/kv_events", params=params,
                                              headers=self._headers, timeout=self._interval + 5.0)
            answer = response.json() if response.status_code == 200 else None
            if isinstance(answer, dict):
                self.index.apply(replica.url, answer, generation)
        except (httpx.TransportError, ValueError, KeyError, TypeError) as exc:
            logger.debug("kv events of %s: %r", replica.url, exc)
        except Exception:  # an answer of an unexpected shape must not end the loop: the index would freeze
            logger.exception("kv events of %s", replica.url)
