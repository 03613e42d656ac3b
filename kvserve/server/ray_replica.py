"""A kvserve engine as a Ray Serve deployment replica (``kvserve ray``; router/ray_serve.py routes to it).

The replica holds the engine in its own process, as ``kvserve serve`` does, and answers the ingress by calling
the same OpenAI app in-process (server/in_process.py): the routes, validation, errors and streams are the
server's own, with no socket and no second process between Ray and the engine. Ray places, restarts and
scales it. Ray is an optional extra (``pip install -e '.[ray]'`` in the checkout); nothing else in kvserve
imports this module but the Ray application's builder (kvserve/ray_app.py).
"""

# No ``from __future__ import annotations``: Ray Serve reads the deployment's signatures at run time.
import argparse
import json
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import Any

from ray import serve

from kvserve.config_args import (
    add_engine_arguments,
    add_server_arguments,
    engine_config_from_args,
    server_config_from_args,
)
from kvserve.router.ray_serve import KV_CAPACITY_TOKENS, SHARED_KV_GROUP
from kvserve.router.serving import disk_dir_of_replica
from kvserve.server.in_process import call_app
from kvserve.server.serving import SERVE_GIL_SWITCH_INTERVAL_S, build_server


@serve.deployment
class KVServeReplica:
    """One engine and the OpenAI app over it, called in-process."""

    def __init__(self, serve_args: Sequence[str]) -> None:
        sys.setswitchinterval(SERVE_GIL_SWITCH_INTERVAL_S)  # as kvserve serve: the engine thread shares the GIL
        parser = argparse.ArgumentParser(prog="kvserve ray")
        add_engine_arguments(parser)
        add_server_arguments(parser)
        # Co-located replicas each take a disk tier directory of their own, by rank: a replacement replica
        # takes the rank it replaces, and with it the entries that replica wrote.
        args = parser.parse_args(disk_dir_of_replica(serve_args, _replica_rank()))
        # No response is stored (answered store: false): the ingress does not send a follow-up to the replica
        # that would hold the response it continues.
        server_config = replace(server_config_from_args(args), response_store_mib=0)
        self._engine, self._async_engine, self._app = build_server(engine_config_from_args(args), server_config)
        # The replica's own calls (describe) carry the key the app requires of every /v1 caller.
        self._own_headers = {"authorization": f"Bearer {server_config.api_key}"} if server_config.api_key else {}

    async def describe(self) -> dict[str, Any]:
        """The served model's name and the tokenizer description the ingress routes with."""
        models = json.loads(await self._body("GET", "/v1/models"))
        tokenizer = json.loads(await self._body("GET", "/kvserve/tokenizer"))
        return {"models": [m["id"] for m in models["data"]], "tokenizer": tokenizer}

    async def forward(self, path: str, body: bytes, headers: dict[str, str],
                      routing_tokens: Sequence[int] = ()) -> AsyncIterator[Any]:
        """The answer as the server gives it: first (status, content type), then its chunks as they are sent.
        ``routing_tokens`` is the request router's (router/ray_serve.py), unused here."""
        async for item in call_app(self._app, "POST", path, body, headers):
            yield item

    def record_routing_stats(self) -> dict[str, Any]:
        """What Ray Serve hands the request router of this replica (``RunningReplica.routing_stats``): the
        tokens its device KV cache holds, which bound the router's estimate of the prefixes still here, and
        the shared KV tier it reads with the replicas of its group (Engine.shared_kv_group)."""
        config = self._engine.config
        return {KV_CAPACITY_TOKENS: self._async_engine.stats().num_kv_blocks * config.cache.block_size,
                SHARED_KV_GROUP: self._engine.shared_kv_group}

    def check_health(self) -> None:
        """Ray Serve's health check: the engine loop is running."""
        if not self._async_engine.is_alive:
            raise RuntimeError(f"the engine loop has stopped: {self._async_engine.dead!r}")

    async def _body(self, method: str, path: str) -> bytes:
        answer = call_app(self._app, method, path, headers=self._own_headers)
        status, _ = await answer.__anext__()
        content = b"".join([chunk async for chunk in answer])  # type: ignore[misc]
        if status != 200:
            raise RuntimeError(f"{method} {path} answered {status}: {content[:200]!r}")
        return content

    def __del__(self) -> None:
        # Ray Serve calls this when it stops the replica.
        async_engine = getattr(self, "_async_engine", None)
        if async_engine is not None:
            self._engine.close(persist=async_engine.shutdown())


def _replica_rank() -> int:
    """This replica's rank in its deployment, 0 to N-1 (Ray Serve's ``ReplicaRank``; an int in older Rays)."""
    rank = serve.get_replica_context().rank
    return int(getattr(rank, "rank", rank))
