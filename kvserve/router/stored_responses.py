"""Which replica holds each stored Responses API response: a follow-up naming one (``previous_response_id``)
and ``GET`` / ``DELETE /v1/responses/{id}`` must reach the replica that stored it, since each replica keeps
its own (server/response_store.py).

The gateway learns a response's replica from the answer it relays; one it has not seen (stored before the
gateway started, or forgotten past its capacity) is looked for on each healthy replica in turn.
"""

from __future__ import annotations

from collections import OrderedDict
from urllib.parse import quote

import httpx
from fastapi.responses import Response

from kvserve.errors import NoHealthyReplica
from kvserve.router.replicas import Replica, ReplicaPool

REMEMBERED = 65536  # response ids whose replica is kept (least recently used forgotten first)


class StoredResponses:
    def __init__(self, pool: ReplicaPool, client: httpx.AsyncClient, capacity: int = REMEMBERED) -> None:
        self._pool = pool
        self._client = client
        self._capacity = capacity
        self._holders: OrderedDict[str, str] = OrderedDict()  # response id -> replica URL

    def record(self, response_id: object, replica_url: str) -> None:
        if not isinstance(response_id, str):
            return
        self._holders[response_id] = replica_url
        self._holders.move_to_end(response_id)
        while len(self._holders) > self._capacity:
            self._holders.popitem(last=False)

    def forget(self, response_id: str) -> None:
        self._holders.pop(response_id, None)

    async def holder(self, response_id: str, headers: dict[str, str]) -> Replica | Response | None:
        """The replica that stored ``response_id``; a replica's refusal of the client's key (``headers``), passed
        back as it is; or None where no healthy replica holds it. NoHealthyReplica where the replica known to
        hold it is out of the pool (until its health check passes)."""
        known = self._holders.get(response_id)
        if known is not None:
            replica = next((r for r in self._pool.replicas if r.url == known), None)
            if replica is not None and replica.healthy:
                self._holders.move_to_end(response_id)
                return replica
            if replica is not None:
                raise NoHealthyReplica(f"the replica that stored response '{response_id}' ({known}) is not "
                                       "available; retry later")
        for replica in sorted(self._pool.healthy(), key=lambda r: r.load):
            try:
                upstream = await self._client.get(f"{replica.url}/v1/responses/{quote(response_id, safe='')}",
                                                  headers=headers, timeout=5.0)
            except httpx.HTTPError:
                continue
            if upstream.status_code == 200:
                self.record(response_id, replica.url)
                return replica
            if upstream.status_code in (401, 403):
                return Response(upstream.content, status_code=upstream.status_code,
                                media_type=upstream.headers.get("content-type", "application/json"))
        return None
