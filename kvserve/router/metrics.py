"""The gateway's Prometheus metrics, in the ``kvserve_router:`` namespace, on a registry of its own."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvserve.router.replicas import Replica

NAMESPACE = "kvserve_router:"


class RouterMetrics:
    def __init__(self, replicas: Callable[[], Sequence[Replica]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r, n = self.registry, NAMESPACE
        self.requests = Counter(f"{n}requests", "Requests answered, by replica and HTTP status ('none': no "
                                "replica was reached).", ["replica", "status"], registry=r)
        self.decisions = Counter(f"{n}routing_decisions", "Replica choices, by policy and reason.",
                                 ["policy", "reason"], registry=r)
        self.retries = Counter(f"{n}retries", "Requests sent again to another replica, by what went wrong.",
                               ["reason"], registry=r)
        self.stream_failures = Counter(f"{n}stream_failures", "Streams cut by their replica after the first chunk "
                                       "(ended with an error event; not retried).", ["replica"], registry=r)
        self.prompt_tokens = Counter(f"{n}prompt_tokens", "Prompt tokens, from the replicas' usage.", ["replica"],
                                     registry=r)
        self.completion_tokens = Counter(f"{n}completion_tokens", "Completion tokens, from the replicas' usage.",
                                         ["replica"], registry=r)
        self.cached_tokens = Counter(f"{n}cached_tokens", "Prompt tokens the replica found cached (its usage's "
                                     "cached_tokens).", ["replica"], registry=r)
        self.estimated_cached_tokens = Counter(f"{n}estimated_cached_tokens", "Prompt tokens the policy expected "
                                               "the replica to have cached.", ["replica"], registry=r)
        self.model_choices = Counter(f"{n}model_choices", "Requests for the auto model, by the model that answered "
                                     "and the model policy's reason.", ["policy", "model", "reason"], registry=r)
        self.errors = Counter(f"{n}http_errors", "Requests the router itself answered with an error, by status.",
                              ["status"], registry=r)
        r.register(_ReplicaCollector(replicas))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _ReplicaCollector(Collector):
    """Per replica, read at scrape time: health, requests in flight, reported load."""

    def __init__(self, replicas: Callable[[], Sequence[Replica]]) -> None:
        self._replicas = replicas

    def collect(self) -> Iterator[Metric]:
        n = NAMESPACE
        gauges = {
            "replica_healthy": ("1 while the replica takes requests, 0 while it is out.",
                                lambda r: float(r.healthy)),
            "replica_in_flight": ("Requests this router has sent to the replica and not yet seen end.",
                                  lambda r: r.in_flight),
            "replica_reported_load": ("Running and waiting requests, as the replica last reported them.",
                                      lambda r: r.reported_running + r.reported_waiting),
        }
        for name, (doc, value) in gauges.items():
            family = GaugeMetricFamily(f"{n}{name}", doc, labels=["replica"])
            for replica in self._replicas():
                family.add_metric([replica.url], value(replica))
            yield family
