"""kvserve on Ray Serve: replicas as a Ray Serve deployment across a Ray cluster, kvserve's routing policy as
Ray Serve's request router, an OpenAI front as the ingress deployment (``kvserve ray``).

- ``KVServeReplica``: one deployment replica runs one ``kvserve serve`` process on its node's loopback (the
  engine keeps its own process, threads and KV; Ray places, restarts and scales it) and relays requests to it.
- ``KVServeRequestRouter``: Ray Serve's ``RequestRouter`` around a kvserve ``RoutingPolicy``; a request's routing
  key (the rendered prompt's token ids, computed by the ingress) travels as the ``routing_tokens`` keyword.
  Load is Ray Serve's own count of each replica's ongoing requests.
- ``KVServeIngress``: the OpenAI routes; it renders and tokenizes prompts with the replicas' tokenizer and
  streams answers back chunk for chunk.

``deploy`` and ``teardown`` are the Ray driver's two jobs, each run as ``python -m kvserve.router.ray_serve``
by ``kvserve ray`` (router/serving.py: run_on_ray). Ray is an optional extra (``pip install 'kvserve[ray]'``);
nothing else in kvserve imports this module.
"""

# No ``from __future__ import annotations``: Ray Serve's ingress reads the route methods' annotations at run time.
import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle
from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from kvserve.config import RouterConfig
from kvserve.errors import ConfigError, InvalidRequest
from kvserve.router.policies import RouteRequest, RoutingPolicy, make_policy
from kvserve.router.prompt_tokens import PromptTokens
from kvserve.router.replicas import Replica
from kvserve.router.serving import die_with_parent, free_port, policy_settings
from kvserve.server.protocol import error_body
from kvserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

ROUTING_TOKENS = "routing_tokens"
INGRESS_MAX_ONGOING_REQUESTS = 4096
APP_NAME = "kvserve"


class KVServeRequestRouter(FIFOMixin, RequestRouter):
    """Ray Serve's request router, deciding with a kvserve routing policy."""

    def initialize_state(self, **router_options: Any) -> None:
        config = RouterConfig(**router_options)
        if config.policy == "kv_events":
            raise ConfigError("the kv_events policy needs the replicas' URLs: use kvserve route", "policy")
        self._policy: RoutingPolicy = make_policy(config)
        self._views: dict[str, Replica] = {}

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        views = [self._view(r) for r in candidate_replicas]
        await self._read_loads(candidate_replicas, views)
        tokens = tuple(pending_request.kwargs.get(ROUTING_TOKENS, ())) if pending_request is not None else ()
        decision = self._policy.choose(RouteRequest(None, tokens), views)
        chosen = next(r for r, v in zip(candidate_replicas, views, strict=True) if v is decision.replica)
        return [[chosen], [r for r in candidate_replicas if r is not chosen]]  # the rest if it rejects

    def _view(self, replica: RunningReplica) -> Replica:
        key = replica.replica_id.to_full_id_str()
        if key not in self._views:
            self._views[key] = Replica(key, healthy=True)
        return self._views[key]

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

    def on_replica_actor_died(self, replica_id: Any) -> None:
        super().on_replica_actor_died(replica_id)
        view = self._views.pop(replica_id.to_full_id_str(), None)
        if view is not None:
            self._policy.forget(view)


@serve.deployment
class KVServeReplica:
    """One ``kvserve serve`` process on this node's loopback, and the relay to it."""

    def __init__(self, serve_args: Sequence[str], startup_timeout_s: float = 300.0) -> None:
        port = free_port()
        self._url = f"http://127.0.0.1:{port}"
        self._proc = subprocess.Popen([sys.executable, "-m", "kvserve.cli", "serve", *serve_args, "--host",
                                       "127.0.0.1", "--port", str(port), "--uvicorn-log-level", "warning"],
                                      preexec_fn=die_with_parent)
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"kvserve serve exited with {self._proc.returncode} before it was ready")
            try:
                if httpx.get(f"{self._url}/health", timeout=1.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"kvserve serve not ready after {startup_timeout_s:.0f}s")
            time.sleep(0.2)
        self._client = httpx.AsyncClient(base_url=self._url, timeout=httpx.Timeout(600.0, connect=10.0))

    async def describe(self) -> dict[str, Any]:
        """The served model's name and the tokenizer description the ingress routes with."""
        models = (await self._client.get("/v1/models")).json()
        tokenizer = (await self._client.get("/kvserve/tokenizer")).json()
        return {"models": [m["id"] for m in models["data"]], "tokenizer": tokenizer}

    async def forward(self, path: str, body: bytes, headers: dict[str, str],
                      routing_tokens: Sequence[int] = ()) -> AsyncIterator[Any]:
        """The answer as the engine's server gives it: first (status, content type), then its raw chunks."""
        async with self._client.stream("POST", path, content=body, headers=headers) as response:
            yield response.status_code, response.headers.get("content-type", "application/json")
            async for chunk in response.aiter_raw():
                yield chunk

    def check_health(self) -> None:
        """Ray Serve's health check: the engine process is alive and answers."""
        if self._proc.poll() is not None:
            raise RuntimeError(f"kvserve serve exited with {self._proc.returncode}")

    def __del__(self) -> None:
        proc = getattr(self, "_proc", None)
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)


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

    async def _learn(self) -> None:
        if not self._models:
            description = await self._replicas.describe.remote()
            self._models = description["models"]
            for model in self._models:
                self._prompts.add(model, Tokenizer.from_description(description["tokenizer"]))

    @ingress_app.post("/v1/chat/completions")
    async def chat_completions(self, http: Request) -> Response:
        return await self._forward("/v1/chat/completions", http)

    @ingress_app.post("/v1/completions")
    async def completions(self, http: Request) -> Response:
        return await self._forward("/v1/completions", http)

    @ingress_app.get("/v1/models")
    async def models(self) -> Response:
        await self._learn()
        data = [{"id": m, "object": "model", "created": self._created, "owned_by": "kvserve"} for m in self._models]
        return JSONResponse({"object": "list", "data": data})

    @ingress_app.get("/health")
    async def health(self) -> Response:
        return JSONResponse({"status": "ok"})

    async def _forward(self, path: str, http: Request) -> Response:
        await self._learn()
        body = await http.body()
        try:
            payload = json.loads(body)
            if not isinstance(payload, dict):
                raise ValueError("not a JSON object")
        except ValueError as exc:
            error = InvalidRequest(f"the request body is not a JSON object: {exc}")
            return JSONResponse(error_body(str(error), error.error_type), status_code=400)
        tokens = await asyncio.to_thread(self._prompts.of, path, payload)
        headers = {"content-type": "application/json",
                   **{k: v for k, v in http.headers.items() if k in ("authorization", "x-kvserve-timings")}}
        answer = self._replicas.options(stream=True).forward.remote(path, body, headers, routing_tokens=list(tokens))
        status, content_type = await answer.__anext__()
        if content_type.startswith("text/event-stream"):
            return StreamingResponse(self._rest(answer), status_code=status, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        content = b"".join([chunk async for chunk in answer])
        return Response(content, status_code=status, media_type=content_type)

    @staticmethod
    async def _rest(answer: Any) -> AsyncIterator[bytes]:
        async for chunk in answer:
            yield chunk


def build_app(serve_args: Sequence[str], num_replicas: int, threads_each: int, config: RouterConfig) -> Any:
    """The Ray Serve application: ingress -> replicas, with kvserve's policy as the replicas' router."""
    replicas = KVServeReplica.options(
        num_replicas=num_replicas, ray_actor_options={"num_cpus": threads_each},
        request_router_config=RequestRouterConfig(request_router_class=KVServeRequestRouter,
                                                  request_router_kwargs=policy_settings(config)),
        health_check_period_s=2, max_ongoing_requests=256,
    ).bind([*serve_args, "--num-threads", str(threads_each)])
    # The ingress only renders, tokenizes and relays: Ray Serve's default of 5 ongoing requests would queue
    # the rest at the proxy, below the replicas' own batching.
    return KVServeIngress.options(ray_actor_options={"num_cpus": 0},
                                  max_ongoing_requests=INGRESS_MAX_ONGOING_REQUESTS).bind(replicas)


def deploy(address: str, serve_args: Sequence[str], num_replicas: int, threads_each: int, config: RouterConfig) -> None:
    """Deploy the application on the Ray cluster at ``address``, HTTP on ``config.host:config.port``, and
    disconnect: Serve applications outlive the driver that deployed them."""
    import ray

    package_root = str(Path(__file__).resolve().parents[2])  # workers import this kvserve, installed or not
    pythonpath = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
    ray.init(address=address, runtime_env={"env_vars": {"PYTHONPATH": pythonpath}}, log_to_driver=False)
    try:
        serve.start(http_options={"host": config.host, "port": config.port})
        serve.run(build_app(serve_args, num_replicas, threads_each, config), name=APP_NAME, route_prefix="/")
    finally:
        ray.shutdown()


def teardown(address: str) -> None:
    """Delete the application and stop Serve on the Ray cluster at ``address``."""
    import ray

    ray.init(address=address, log_to_driver=False)
    try:
        serve.delete(APP_NAME)
        serve.shutdown()
    finally:
        ray.shutdown()


if __name__ == "__main__":
    # ``kvserve ray`` runs the Ray driver here, in a process of its own: Ray's driver aborts its process on
    # SIGTERM, and the command's own process must stop cleanly (kvserve/router/serving.py: run_on_ray).
    command, arguments = sys.argv[1], json.loads(sys.argv[2])
    if command == "deploy":
        deploy(arguments["address"], arguments["serve_args"], arguments["num_replicas"], arguments["threads_each"],
               RouterConfig(**arguments["router"]))
    else:
        teardown(arguments["address"])
