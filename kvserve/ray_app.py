"""kvserve as a Ray Serve application (``kvserve ray``): the OpenAI ingress (router/ray_serve.py) in front of
engine replicas (server/ray_replica.py), kvserve's routing policy as the replicas' request router.

``deploy`` and ``teardown`` are the Ray driver's two jobs, each run as ``python -m kvserve.ray_app`` by
``kvserve ray`` (router/serving.py: run_on_ray). Ray is an optional extra (``pip install -e '.[ray]'`` in the
checkout); nothing else in kvserve imports this module.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from kvserve.router.ray_serve import INGRESS_MAX_ONGOING_REQUESTS, KVServeIngress, KVServeRequestRouter
from kvserve.router.serving import policy_settings
from kvserve.server.ray_replica import KVServeReplica
from kvserve.serving_config import RouterConfig

APP_NAME = "kvserve"
# How often Ray Serve asks each replica for its routing stats: the router waits for the first at start-up.
ROUTING_STATS_PERIOD_S = 1.0

# Every Ray worker's environment. OMP_WAIT_POLICY as kvserve serve sets it (cli.py), before torch loads.
WORKER_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


def build_app(serve_args: Sequence[str], num_replicas: int, threads_each: int, config: RouterConfig) -> Any:
    """The Ray Serve application: ingress -> replicas, with kvserve's policy as the replicas' router."""
    replicas = KVServeReplica.options(
        num_replicas=num_replicas, ray_actor_options={"num_cpus": threads_each},
        request_router_config=RequestRouterConfig(request_router_class=KVServeRequestRouter,
                                                  request_router_kwargs={**policy_settings(config),
                                                                         "expected_replicas": num_replicas},
                                                  request_routing_stats_period_s=ROUTING_STATS_PERIOD_S),
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

    package_root = str(Path(__file__).resolve().parents[1])  # workers import this kvserve, installed or not
    pythonpath = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
    ray.init(address=address, runtime_env={"env_vars": {"PYTHONPATH": pythonpath, **WORKER_ENV}},
             log_to_driver=False)
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
