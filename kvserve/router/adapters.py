"""Runtime LoRA adapters across the fleet: vLLM's ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``
sent to the gateway go to every healthy replica, and the gateway reads again what each serves, so the adapter
is routed (or no longer routed) as soon as the answer comes back.

A load succeeds where every replica serves the adapter afterwards (one that already did, and refused to load it
again, counts as serving it); otherwise the first refusal of a replica that does not serve it comes back as the
replica gave it (the replicas that did load it keep it and are routed to for it). An unload succeeds where no
replica holds the adapter afterwards: a replica that did not hold it (404) is not a failure, unless none did.
A request naming its base model (``"model"``, a kvserve extension its replicas check too) goes to that model's
replicas only: in a fleet of several models, the others would refuse an adapter of another shape. Without it,
every replica is asked.
"""

from __future__ import annotations

import asyncio
import json

import httpx
from fastapi.responses import PlainTextResponse, Response

from kvserve.errors import BadUpstreamResponse, ModelNotFound, NoHealthyReplica
from kvserve.router.replicas import Replica, ReplicaPool
from kvserve.router.stored_responses import passed_back
from kvserve.server.protocol import error_body

ADAPTER_ROUTES = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")


async def to_every_replica(pool: ReplicaPool, client: httpx.AsyncClient, path: str, body: bytes,
                           headers: dict[str, str]) -> Response:
    """``path`` (one of ``ADAPTER_ROUTES``) with ``body`` sent to every healthy replica at once; the fleet's
    answer, as the module says."""
    name, model = _payload_field(body, "lora_name"), _payload_field(body, "model")
    if model is not None and model not in pool.models():
        error = ModelNotFound(f"no replica serves the base model '{model}'")
        error.param = "model"  # type: ignore[attr-defined]
        raise error
    replicas = pool.healthy(model)
    if not replicas:
        raise NoHealthyReplica("no healthy replica to load or unload the adapter on; retry later")
    answers = await asyncio.gather(*(_send(client, r, path, body, headers) for r in replicas))
    await asyncio.gather(*(pool.refresh_models(r) for r in replicas))
    if path.endswith("/unload_lora_adapter"):
        failed = [a for a in answers if a.status_code >= 300]
        gone = [a for a in failed if a.status_code == 404]
        if len(gone) < len(answers):  # held somewhere, and every other replica did not hold it
            failed = [a for a in failed if a.status_code != 404]
    else:
        failed = [a for r, a in zip(replicas, answers, strict=True)
                  if a.status_code >= 300 and (name is None or name not in r.models)]
    if failed:
        return passed_back(failed[0])
    succeeded = [a for a in answers if a.status_code < 300]
    if succeeded:
        return passed_back(succeeded[0])
    # every replica refused because it already served the adapter: the fleet is as asked
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


def _payload_field(body: bytes, field: str) -> str | None:
    """A string field of the request's JSON body, stripped; None where there is none (the replicas judge the
    body's form)."""
    try:
        payload = json.loads(body)
    except ValueError:
        return None
    value = payload.get(field) if isinstance(payload, dict) else None
    return value.strip() if isinstance(value, str) else None


async def _send(client: httpx.AsyncClient, replica: Replica, path: str, body: bytes,
                headers: dict[str, str]) -> httpx.Response:
    """The replica's answer; a 502 of the gateway's own where it did not answer (its health check decides
    whether it is down)."""
    try:
        # Loading reads and converts the adapter's tensors: longer than a generation request's first byte.
        return await client.post(f"{replica.url}{path}", content=body, headers=headers, timeout=120.0)
    except httpx.HTTPError as exc:
        error = BadUpstreamResponse(f"replica {replica.url} did not answer {path}: {exc!r}")
        return httpx.Response(error.http_status, json=error_body(str(error), error.error_type, None, error.code))
