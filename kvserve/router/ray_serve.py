"""kvserve on Ray Serve, the routing half: kvserve's routing policy as Ray Serve's request router, and the OpenAI
front as the ingress deployment (``kvserve ray``; the engine replicas are server/ray_replica.py's, the
application that joins them kvserve/ray_app.py's).

- ``KVServeRequestRouter``: Ray Serve's ``RequestRouter`` around a kvserve ``RoutingPolicy``; a request's routing
  key (the rendered prompt's token ids, computed by the ingress) travels as the ``routing_tokens`` keyword.
  Load is Ray Serve's own count of each replica's ongoing requests.
- ``KVServeIngress``: the OpenAI routes; it renders and tokenizes prompts with the replicas' tokenizer and
  streams answers back chunk for chunk.

Ray is an optional extra (``pip install -e '.[ray]'`` in the checkout); nothing else in kvserve imports this
module but the Ray application's builder.
"""

# No ``from __future__ import annotations``: Ray Serve's ingress reads the route methods' annotations at run time.
import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from kvserve.errors import ConfigError, InvalidRequest, NoHealthyReplica
from kvserve.router.policies import RouteRequest, RoutingPolicy, make_policy
from kvserve.router.prompt_tokens import PromptTokens, template_defaults
from kvserve.router.replicas import Replica
from kvserve.server.protocol import error_body
from kvserve.serving_config import RouterConfig
from kvserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

ROUTING_TOKENS = "routing_tokens"
INGRESS_MAX_ONGOING_REQUESTS = 4096
STARTUP_WAIT_S = 60.0
STARTUP_POLL_S = 0.05
# The routing stats a replica reports (server/ray_replica.py: record_routing_stats): its device KV cache in
# tokens, and the shared KV tier it reads with the replicas of its group (a prefix any of them holds is cheap
# there), or None.
KV_CAPACITY_TOKENS = "kv_capacity_tokens"
SHARED_KV_GROUP = "shared_kv_group"


class KVServeRequestRouter(RequestRouter):
    """Ray Serve's request router, deciding with a kvserve routing policy. The replica chosen for a request goes
    to that request: Ray Serve's FIFO mixin would hand it to the oldest one waiting, whatever its prefix."""

    # A replica busy with its engine answers Ray Serve's queue-length probe late; at the default 0.1 s a
    # missed probe makes Ray Serve ask for another choice.
    queue_len_response_deadline_s = 1.0

    def initialize_state(self, expected_replicas: int = 1, **router_options: Any) -> None:
        config = RouterConfig(**router_options)
        if config.policy == "kv_events":
            raise ConfigError("the kv_events policy needs the replicas' URLs: use kvserve route", "policy")
        self._policy: RoutingPolicy = make_policy(config)
        self._views: dict[str, Replica] = {}
        self._expected_replicas = expected_replicas
        self._wait_for_all_until: float | None = time.monotonic() + STARTUP_WAIT_S

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas or self._waiting_for_replicas(candidate_replicas):
            await asyncio.sleep(STARTUP_POLL_S)  # Ray Serve asks again at once, without a back-off
            return []
        views = [self._view(r) for r in candidate_replicas]
        await self._read_loads(candidate_replicas, views)
        tokens = tuple(pending_request.kwargs.get(ROUTING_TOKENS, ())) if pending_request is not None else ()
        decision = self._policy.choose(RouteRequest(None, tokens), views)
        chosen = next(r for r, v in zip(candidate_replicas, views, strict=True) if v is decision.replica)
        # The chosen replica only: were it not confirmed in time (Ray Serve probes its queue length), a second
        # rank would send the request elsewhere while the policy's index says it went here. Ray Serve asks again.
        return [[chosen]]

    def _waiting_for_replicas(self, known: list[RunningReplica]) -> bool:
        """At start-up, until every replica of the deployment is known here and has reported its KV capacity
        (or ``STARTUP_WAIT_S`` has passed): Ray Serve tells a handle of its replicas one by one, and requests
        routed among the first alone would all place their prefixes there; a replica's capacity bounds what
        the policy believes it still holds. Never again once all were known: a replica that dies must not stop
        routing."""
        if self._wait_for_all_until is None:
            return False
        ready = len(known) >= self._expected_replicas and all(KV_CAPACITY_TOKENS in r.routing_stats for r in known)
        if ready or time.monotonic() > self._wait_for_all_until:
            self._wait_for_all_until = None
            return False
        return True

    def _view(self, replica: RunningReplica) -> Replica:
        """The policy's view of ``replica``, with its routing stats as far as Ray Serve has them."""
        key = replica.replica_id.to_full_id_str()
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = Replica(key, healthy=True)
        stats = replica.routing_stats  # a replica reports them a little after it starts serving
        if KV_CAPACITY_TOKENS in stats:
            view.kv_capacity_tokens = stats[KV_CAPACITY_TOKENS]
            group = stats.get(SHARED_KV_GROUP)
            view.shared_kv_group = group if isinstance(group, str) else None
        return view

    async def _read_loads(self, replicas: list[RunningReplica], views: list[Replica]) -> None:
        """Each replica's ongoing requests, from Ray Serve's queue-length cache, probed when not cached."""
        missing = []
        for replica, view in zip(replicas, views, strict=True):
            cached = self._replica_queue_len_cache.get(replica.replica_id) if self._use_replica_queue_len_cache else None
            if cached is None:
                missing.append(replica)
            else:
                view.in_flight = cached
        if missing:
            for replica, queue_len in await self._probe_queue_lens(missing, 0):
                if queue_len is not None:
                    self._view(replica).in_flight = queue_len

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Ray Serve's replica set changed (a replica replaced, scaled down, redeployed): what the policy knew of
        a replica no longer in it is dropped, or it would be kept for good."""
        super().update_replicas(replicas)
        current = {r.replica_id.to_full_id_str() for r in replicas}
        views = getattr(self, "_views", {})  # Ray Serve may tell the replicas before initialize_state runs
        for key in [k for k in views if k not in current]:
            self._policy.forget(views.pop(key))

    def on_replica_actor_died(self, replica_id: Any) -> None:
        super().on_replica_actor_died(replica_id)
        view = self._views.pop(replica_id.to_full_id_str(), None)
        if view is not None:
            self._policy.forget(view)


ingress_app = FastAPI(title="kvserve on Ray Serve")


@serve.deployment
@serve.ingress(ingress_app)
class KVServeIngress:
    """The OpenAI routes in front of the KVServeReplica deployment."""

    def __init__(self, replicas: DeploymentHandle) -> None:
        self._replicas = replicas
        self._prompts = PromptTokens()
        self._models: list[str] = []
        self._created = int(time.time())
        self._learning = asyncio.Lock()

    async def _learn(self) -> None:
        """The replicas' model and tokenizer, asked once (the first requests wait for one answer)."""
        if self._models:
            return
        async with self._learning:
            if not self._models:
                description = await self._replicas.describe.remote()
                tokenizer = Tokenizer.from_description(description["tokenizer"])
                for model in description["models"]:
                    self._prompts.add(model, tokenizer, template_defaults(description["tokenizer"]))
                self._models = description["models"]

    @ingress_app.post("/v1/chat/completions")
    async def chat_completions(self, http: Request) -> Response:
        return await self._forward("/v1/chat/completions", http)

    @ingress_app.post("/v1/completions")
    async def completions(self, http: Request) -> Response:
        return await self._forward("/v1/completions", http)

    @ingress_app.post("/v1/responses")
    async def responses(self, http: Request) -> Response:
        return await self._forward("/v1/responses", http)

    # Any replica answers these alike: routed on no prompt, so that the prefix index records nothing.
    @ingress_app.post("/tokenize")
    async def tokenize(self, http: Request) -> Response:
        return await self._forward("/tokenize", http, route_on_prompt=False)

    @ingress_app.post("/detokenize")
    async def detokenize(self, http: Request) -> Response:
        return await self._forward("/detokenize", http, route_on_prompt=False)

    @ingress_app.get("/v1/models")
    async def models(self) -> Response:
        await self._learn()
        data = [{"id": m, "object": "model", "created": self._created, "owned_by": "kvserve"} for m in self._models]
        return JSONResponse({"object": "list", "data": data})

    @ingress_app.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str) -> Response:
        await self._learn()
        if model_id not in self._models:
            return JSONResponse(error_body(f"the model '{model_id}' does not exist here", "invalid_request_error",
                                           "model", "model_not_found"), status_code=404)
        return JSONResponse({"id": model_id, "object": "model", "created": self._created, "owned_by": "kvserve"})

    @ingress_app.get("/health")
    async def health(self) -> Response:
        return JSONResponse({"status": "ok"})

    async def _forward(self, path: str, http: Request, route_on_prompt: bool = True) -> Response:
        await self._learn()
        body = await http.body()
        try:
            payload = json.loads(body)
            if not isinstance(payload, dict):
                raise ValueError("not a JSON object")
        except ValueError as exc:
            error = InvalidRequest(f"the request body is not a JSON object: {exc}")
            return JSONResponse(error_body(str(error), error.error_type), status_code=400)
        tokens = await asyncio.to_thread(self._prompts.of, path, payload) if route_on_prompt else ()
        headers = {"content-type": "application/json",
                   **{k: v for k, v in http.headers.items() if k in ("authorization", "x-kvserve-timings")}}
        answer = self._replicas.options(stream=True).forward.remote(path, body, headers, routing_tokens=list(tokens))
        try:
            status, content_type = await answer.__anext__()
        except Exception as exc:  # Ray's own failures (a replica that died, back-pressure): the gateway's 503
            logger.warning("no replica answered %s: %r", path, exc)
            error = NoHealthyReplica(f"no replica could take the request ({type(exc).__name__}); retry later")
            return JSONResponse(error_body(str(error), error.error_type, None, error.code), status_code=503,
                                headers={"Retry-After": "1"})
        if content_type.startswith("text/event-stream"):
            return StreamingResponse(self._rest(answer), status_code=status, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        content = b"".join([chunk async for chunk in answer])
        return Response(content, status_code=status, media_type=content_type)

    @staticmethod
    async def _rest(answer: Any) -> AsyncIterator[bytes]:
        async for chunk in answer:
            yield chunk
