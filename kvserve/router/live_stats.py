"""What the gateway's dashboard reads: its routing counters and each replica's own ``/kvserve/stats``,
fetched together at each poll (``GET /kvserve/stats`` on ``kvserve route``), and a recent request's trip
from whichever replica served it."""

from __future__ import annotations

import asyncio
import time
from typing import Any
from urllib.parse import quote

import httpx
from prometheus_client import Counter

from kvserve.router.replicas import Replica

STATS_TIMEOUT_S = 1.0  # a replica slower than this shows as without stats for one poll


def counter_values(counter: Counter, label: str) -> dict[str, float]:
    """A labelled counter's totals by one label (summed over the others)."""
    values: dict[str, float] = {}
    for family in counter.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                key = sample.labels.get(label, "")
                values[key] = values.get(key, 0.0) + sample.value
    return values


async def replica_stats(client: httpx.AsyncClient, replica: Replica, headers: dict[str, str]) -> dict[str, Any] | None:
    if not (replica.healthy and replica.is_kvserve):
        return None
    try:
        response = await client.get(f"{replica.url}/kvserve/stats", headers=headers, timeout=STATS_TIMEOUT_S)
        return response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


async def gateway_snapshot(client: httpx.AsyncClient, replicas: list[Replica], headers: dict[str, str],
                           policy: str, started_at: float, decisions: Counter, requests: Counter,
                           retries: Counter) -> dict[str, Any]:
    """The body of the gateway's ``GET /kvserve/stats`` (docs/dashboard.md)."""
    stats = await asyncio.gather(*(replica_stats(client, r, headers) for r in replicas))
    return {
        "gateway": True,
        "time": time.time(),
        "uptime_s": round(time.time() - started_at, 3),
        "policy": policy,
        "routing": {"decisions": counter_values(decisions, "reason"), "requests": counter_values(requests, "replica"),
                    "retries": counter_values(retries, "reason")},
        "replicas": [{"url": r.url, "healthy": r.healthy, "in_flight": r.in_flight, "load": r.load,
                      "last_error": r.last_error, "stats": s} for r, s in zip(replicas, stats, strict=True)],
    }


async def find_trip(client: httpx.AsyncClient, replicas: list[Replica], headers: dict[str, str],
                    request_id: str) -> dict[str, Any] | None:
    """The trip of ``request_id`` from the replica that served it, with that replica's address."""
    async def ask(replica: Replica) -> dict[str, Any] | None:
        if not (replica.healthy and replica.is_kvserve):
            return None
        url = f"{replica.url}/kvserve/stats/requests/{quote(request_id, safe='')}"
        try:
            response = await client.get(url, headers=headers, timeout=STATS_TIMEOUT_S)
        except httpx.HTTPError:
            return None
        return {**response.json(), "replica": replica.url} if response.status_code == 200 else None

    found = [t for t in await asyncio.gather(*(ask(r) for r in replicas)) if t is not None]
    return found[0] if found else None
