"""The replicas behind the gateway: what each serves, whether it is healthy, and how loaded it is.

A replica is checked at start-up (it must answer ``GET /v1/models`` as an OpenAI server does), then every
``health_interval_s``: ``GET /health`` decides its health, ``GET /metrics`` its reported load (running and
waiting requests, read from any ``*:num_requests_running`` / ``*:num_requests_waiting`` gauge, as kvserve
and vLLM export them), ``GET /v1/models`` what it serves (LoRA adapters come and go at run time). A request that cannot reach it, or gets a 5xx, takes it out at once; the next health
check that passes puts it back. The router's own count of requests in flight is exact and immediate; the
reported load adds what other routers sent.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from kvserve.errors import ConfigError

logger = logging.getLogger(__name__)

DEFAULT_CAPACITY_TOKENS = 1 << 20
_GAUGE = re.compile(r"^[A-Za-z_]*:?(num_requests_running|num_requests_waiting)(?:\{[^}]*\})? ([0-9.eE+-]+)$",
                    re.MULTILINE)


@dataclass
class Replica:
    """One upstream server, as the router sees it. Mutated only on the gateway's event loop."""

    url: str
    models: tuple[str, ...] = ()
    healthy: bool = False
    is_kvserve: bool = False
    block_size: int | None = None
    kv_capacity_tokens: int | None = None
    # The shared KV tier it reads and the kind of KV it keeps there: replicas of one group read each other's KV
    # (the same Redis, the same model computed the same way); None: no shared tier.
    shared_kv_group: str | None = None
    kv_events: bool = False  # it publishes its prefix cache's block events
    block_hash_extra: bytes = b""  # what it mixes into its block hashes (model fingerprint, salt)
    # Its LoRA adapters (model names) and what each one's requests add to their block hashes after that.
    lora_cache_keys: dict[str, bytes] = field(default_factory=dict)
    in_flight: int = 0  # requests this router has sent and not yet seen end
    queued_prompt_tokens: int = 0  # uncached prompt tokens (as the policy estimated) not yet answered a first byte
    reported_running: int = 0
    reported_waiting: int = 0
    in_flight_at_read: int = 0  # this router's in_flight when the replica's report was read
    load_read_at: float = 0.0  # time.monotonic() of the last load read; 0 = never
    last_error: str = ""
    times_taken_out: int = 0  # a health check begun before the latest failure does not put it back
    # Reads of /v1/models begun, and the latest begun whose answer was applied: an answer that comes back after
    # a later read's is older news (a health check's read overtaken by the one after a LoRA load) and dropped.
    models_reads: int = 0
    models_read_applied: int = 0

    @property
    def load(self) -> int:
        """Requests on the replica: the router's own count, exact and current, plus the others' (other
        routers', other clients') that its last report held beyond this router's count at the time. Not
        the report itself: up to a health interval old, it still holds this router's requests that have
        ended since, and a replica would look busy while it idles."""
        others = self.reported_running + self.reported_waiting - self.in_flight_at_read
        return self.in_flight + max(0, others)

    def serves(self, model: str | None) -> bool:
        return model is None or model in self.models


class ReplicaPool:
    """The replicas, their start-up check and their health loop."""

    def __init__(self, urls: tuple[str, ...], client: httpx.AsyncClient, health_interval_s: float,
                 headers: dict[str, str]) -> None:
        self.replicas = [Replica(url.rstrip("/")) for url in urls]
        self._client = client
        self._interval = health_interval_s
        self._headers = headers
        self._task: asyncio.Task[None] | None = None
        self.on_change: list[Callable[[Replica], None]] = []  # run when a replica goes down or comes back
        self._refreshing = asyncio.Lock()
        self._refreshed_at = 0.0  # time.monotonic() of the last refresh_all

    def healthy(self, model: str | None = None) -> list[Replica]:
        return [r for r in self.replicas if r.healthy and r.serves(model)]

    def models(self) -> list[str]:
        return list(dict.fromkeys(m for r in self.replicas for m in r.models))

    # --- start-up ---------------------------------------------------------------------------------------------
    async def check_all(self, timeout_s: float) -> None:
        """Wait (up to ``timeout_s`` each, all at once) for every replica to answer as an OpenAI server;
        ConfigError naming the first that does not."""
        await asyncio.gather(*(self._first_contact(r, timeout_s) for r in self.replicas))

    async def _first_contact(self, replica: Replica, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                response = await self._client.get(f"{replica.url}/v1/models", headers=self._headers, timeout=5.0)
                break
            except httpx.TransportError as exc:
                if time.monotonic() > deadline:
                    raise ConfigError(f"replica {replica.url} did not answer within {timeout_s:.0f}s: {exc!r}",
                                      "replicas") from None
                await asyncio.sleep(0.25)
        replica.models = _model_ids(replica.url, response)
        await self._read_kvserve_info(replica)
        await self._read_load(replica)
        replica.healthy = True

    async def _read_kvserve_info(self, replica: Replica) -> None:
        try:
            response = await self._client.get(f"{replica.url}/kvserve/info", headers=self._headers, timeout=5.0)
            info = response.json() if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            info = None
        if not isinstance(info, dict) or not isinstance(info.get("block_size"), int):
            return  # not a kvserve replica: routed on its OpenAI routes alone
        replica.is_kvserve = True
        replica.block_size = info["block_size"]
        group = info.get("shared_kv_group")
        # A replica that says it shares a tier but not with whom is taken to share it with every such replica.
        replica.shared_kv_group = (group if isinstance(group, str)
                                   else "" if info.get("shared_kv_tier") is True else None)
        if info.get("kv_events") is True and isinstance(info.get("block_hash_extra"), str):
            try:
                replica.block_hash_extra = bytes.fromhex(info["block_hash_extra"])
                replica.kv_events = True
            except ValueError:
                logger.warning("replica %s reports a block hash extra that is not hex: %r", replica.url,
                               info["block_hash_extra"])
        if isinstance(info.get("num_kv_blocks"), int):
            replica.kv_capacity_tokens = info["num_kv_blocks"] * info["block_size"]
        adapters = info.get("lora_cache_keys")
        if isinstance(adapters, dict):
            try:
                replica.lora_cache_keys = {str(name): bytes.fromhex(key) for name, key in adapters.items()}
            except (TypeError, ValueError):
                logger.warning("replica %s reports LoRA cache keys that are not hex: %r", replica.url, adapters)

    # --- health loop ------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._health_loop(), name="kvserve-router-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _health_loop(self) -> None:
        # One loop per replica: a replica whose checks hang does not hold back the others'.
        await asyncio.gather(*(self._replica_loop(r) for r in self.replicas))

    async def _replica_loop(self, replica: Replica) -> None:
        while True:
            await self._check_logged(replica)
            await asyncio.sleep(self._interval)

    async def _check_logged(self, replica: Replica) -> None:
        """A check whose unexpected failure (an odd answer) is logged: it must not end the health loop, or a
        replica taken out would never be put back."""
        try:
            await self.check(replica)
        except Exception:
            logger.exception("health check of %s failed", replica.url)

    async def check(self, replica: Replica) -> None:
        """One health check and load read; a change of health is logged and announced."""
        taken_out_before = replica.times_taken_out
        try:
            response = await self._client.get(f"{replica.url}/health", headers=self._headers,
                                              timeout=self._interval + 1.0)
            ok = response.status_code == 200
            reason = "" if ok else f"/health answered {response.status_code}"
        except httpx.HTTPError as exc:
            ok, reason = False, f"/health: {exc!r}"
        if ok:
            await self._read_load(replica)  # a load that cannot be read keeps the last one read
            if replica.healthy:
                await self.refresh_models(replica)
            # Back only on a check begun after the replica was last taken out: a request that failed on it while
            # this check was in flight knows more than this check's answer.
            if not replica.healthy and replica.times_taken_out == taken_out_before:
                await self._comes_back(replica, taken_out_before)
        elif replica.healthy:
            self.mark_down(replica, reason)

    async def refresh_models(self, replica: Replica, read_info: bool = False) -> str | None:
        """Read again what ``replica`` serves (and, where that changed or ``read_info``, its ``/kvserve/info``:
        its LoRA adapters' cache keys); its last list is kept where it does not answer. Returns why it did not,
        or None."""
        replica.models_reads += 1
        read = replica.models_reads
        try:
            response = await self._client.get(f"{replica.url}/v1/models", headers=self._headers, timeout=5.0)
            models = _model_ids(replica.url, response)
        except (httpx.HTTPError, ConfigError) as exc:
            return str(exc)
        if read < replica.models_read_applied:
            return None  # a later read's answer is already in
        replica.models_read_applied = read
        if models != replica.models or read_info:
            replica.models = models
            await self._read_kvserve_info(replica)
        return None

    async def refresh_all(self, min_interval_s: float) -> None:
        """``refresh_models`` of every healthy replica: a model no replica was known to serve may be an adapter
        loaded since the last health check. Callers that ask while a refresh runs wait for it, and one within
        ``min_interval_s`` of the last is not repeated (a stream of requests for a model nobody serves costs
        one round of reads per interval)."""
        async with self._refreshing:
            if time.monotonic() - self._refreshed_at < min_interval_s:
                return
            self._refreshed_at = time.monotonic()
            await asyncio.gather(*(self.refresh_models(r) for r in self.healthy()))

    async def _comes_back(self, replica: Replica, taken_out_before: int) -> None:
        # Read again what it serves: a restarted replica may hold other LoRA adapters.
        failure = await self.refresh_models(replica, read_info=True)
        if failure is not None:
            logger.warning("replica %s answers /health but not /v1/models (%s): it stays out", replica.url, failure)
            return
        if replica.times_taken_out != taken_out_before:  # a request failed on it meanwhile
            return
        replica.healthy = True
        logger.warning("replica %s is healthy again", replica.url)
        for callback in self.on_change:
            callback(replica)

    def mark_down(self, replica: Replica, reason: str) -> None:
        """Take ``replica`` out of routing until a health check passes. Counted also when it is already out: a
        check in flight then does not put it back on what it read before this failure."""
        replica.last_error = reason
        replica.times_taken_out += 1
        if not replica.healthy:
            return
        replica.healthy = False
        logger.warning("replica %s taken out: %s", replica.url, reason)
        for callback in self.on_change:
            callback(replica)

    async def _read_load(self, replica: Replica) -> bool:
        """The replica's load from its ``/metrics``; False when it could not be read (then kept as it was)."""
        in_flight_before = replica.in_flight
        try:
            response = await self._client.get(f"{replica.url}/metrics", headers=self._headers,
                                              timeout=self._interval + 1.0)
            values = {name: float(value) for name, value in _GAUGE.findall(response.text)}
            running = int(values.get("num_requests_running", 0))
            waiting = int(values.get("num_requests_waiting", 0))
        except (httpx.HTTPError, ValueError, OverflowError):  # unreachable, or not numbers (nan, inf)
            return False
        if response.status_code != 200:
            return True  # not a Prometheus endpoint (another OpenAI server): the router's own count stands
        replica.reported_running = running
        replica.reported_waiting = waiting
        # The report was taken at some point of the read: the larger count errs towards fewer others' requests.
        replica.in_flight_at_read = max(in_flight_before, replica.in_flight)
        replica.load_read_at = time.monotonic()
        return True


def _model_ids(url: str, response: httpx.Response) -> tuple[str, ...]:
    """The model ids of a ``GET /v1/models`` answer; ConfigError if it is not an OpenAI model list."""
    try:
        body = response.json()
    except ValueError:
        body = None
    data = body.get("data") if isinstance(body, dict) else None
    if response.status_code != 200 or not isinstance(data, list) or not all(
            isinstance(m, dict) and isinstance(m.get("id"), str) for m in data):
        raise ConfigError(f"{url} is not an OpenAI-compatible server: GET /v1/models answered "
                          f"{response.status_code} {response.text[:200]!r}", "replicas")
    return tuple(m["id"] for m in data)
