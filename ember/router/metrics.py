"""The router's own Prometheus metrics, in a registry per router (no process-wide state)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ember.router.replicas import ReplicaSet

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                   0.5, 1.0)


class RouterMetrics:
    def __init__(self, replicas: ReplicaSet) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("ember:router_requests", "Requests sent to a replica, by why it "
                                "was chosen", ["replica", "route"], registry=r)
        self.affinity_hits = Counter("ember:router_affinity_hits", "Requests with a session id "
                                     "served by the replica hashing assigns it", registry=r)
        self.prefix_routed = Counter("ember:router_prefix_routed", "Requests without a session "
                                     "id sent where their prompt prefix was sent before",
                                     registry=r)
        self.spills = Counter("ember:router_spills", "Requests moved off an overloaded replica",
                              ["replica"], registry=r)
        self.retries = Counter("ember:router_retries", "Requests retried on another replica "
                               "after failing before their first byte on this one", ["replica"],
                               registry=r)
        self.upstream_errors = Counter("ember:router_upstream_errors", "Failed requests to a "
                                       "replica, by phase", ["replica", "phase"], registry=r)
        self.ejections = Counter("ember:router_ejections", "Replicas taken out of rotation",
                                 ["replica"], registry=r)
        self.readmissions = Counter("ember:router_readmissions", "Ejected replicas brought back",
                                    ["replica"], registry=r)
        self.added_latency = Histogram(
            "ember:router_added_latency_seconds", "Time the router adds to a request: from its "
            "arrival to the upstream send, plus from the upstream's first byte to the client's",
            buckets=LATENCY_BUCKETS, registry=r)
        r.register(_ReplicaGauges(replicas))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _ReplicaGauges(Collector):
    """Per-replica gauges read at scrape time, so removed replicas leave no stale series."""

    def __init__(self, replicas: ReplicaSet) -> None:
        self.replicas = replicas

    def collect(self) -> Iterator[GaugeMetricFamily]:
        healthy = GaugeMetricFamily("ember:router_replica_healthy", "1 when in rotation",
                                    labels=["replica"])
        in_flight = GaugeMetricFamily("ember:router_replica_in_flight",
                                      "Requests this router has open on the replica",
                                      labels=["replica"])
        load = GaugeMetricFamily("ember:router_replica_load", "Load used for routing",
                                 labels=["replica"])
        for replica in self.replicas.all():
            healthy.add_metric([replica.url], 1.0 if replica.healthy else 0.0)
            in_flight.add_metric([replica.url], replica.in_flight)
            load.add_metric([replica.url], replica.load)
        yield from (healthy, in_flight, load)
