"""Which replica holds each stored Responses API response: a follow-up naming one (``previous_response_id``)
and ``GET`` / ``DELETE /v1/responses/{id}`` must reach the replica that stored it, since each replica keeps
its own (server/response_store.py).

The gateway learns a response's replica from the answer it relays; one it has not seen (stored before the
gateway started, or forgotten past its capacity) is asked of every healthy replica at once.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from urllib.parse import quote

import httpx
from fastapi.responses import Response

from kvserve.errors import NoHealthyReplica
from kvserve.router.replicas import Replica, ReplicaPool

REMEMBERED = 65536  # response ids whose replica is kept (least recently used forgotten first)


def passed_back(upstream: httpx.Response) -> Response:
    """A replica's answer, to the client as it came."""
    return Response(upstream.content, status_code=upstream.status_code,
                    media_type=upstream.headers.get("content-type", "application/json"))


def stored_response_path(response_id: str, suffix: str = "") -> str:
    return f"/v1/responses/{quote(response_id, safe='')}{suffix}"


class StoredResponses:
    """Response ids and the replica that stored each, learnt from answers and looked up by asking."""

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
        back as it is; or None where every replica says it holds none. NoHealthyReplica where one that may
        hold it cannot say so now (out of the pool, unreachable, failing)."""
        try:
            response_id.encode()
        except UnicodeEncodeError:  # a lone surrogate: no response id, and no URL can name it
            return None
        known = self._holders.get(response_id)
        replica = next((r for r in self._pool.replicas if r.url == known), None) if known is not None else None
        if replica is not None and replica.healthy:
            self._holders.move_to_end(response_id)
            return replica
        if replica is not None:  # its replica restarted or died: no other one has it
            raise NoHealthyReplica(f"the replica that stored response '{response_id}' is not available; retry later")
        candidates = self._pool.healthy()
        answers = await asyncio.gather(*(self._ask(r, response_id, headers) for r in candidates))
        for replica, upstream in zip(candidates, answers, strict=True):
            if upstream is not None and upstream.status_code == 200 and _answer_id(upstream) == response_id:
                self.record(response_id, replica.url)
                return replica
        for upstream in answers:
            if upstream is not None and upstream.status_code in (401, 403):
                return passed_back(upstream)
        out_of_the_pool = len(candidates) < len(self._pool.replicas)
        if out_of_the_pool or any(upstream is None or upstream.status_code != 404 for upstream in answers):
            raise NoHealthyReplica(f"not every replica could say whether it holds response '{response_id}'; retry "
                                   "later")
        return None

    async def _ask(self, replica: Replica, response_id: str, headers: dict[str, str]) -> httpx.Response | None:
        try:
            return await self._client.get(replica.url + stored_response_path(response_id), headers=headers,
                                          timeout=5.0)
        except httpx.HTTPError:
            return None


def _answer_id(upstream: httpx.Response) -> object:
    """The ``id`` of a JSON answer (a stored response's), or None: a 200 that is not one says nothing."""
    try:
        answer = upstream.json()
    except ValueError:
        return None
    return answer.get("id") if isinstance(answer, dict) else None
