"""Active health checks: GET /health on every replica each interval, plus its load gauges.

A check passes on a 200 within the timeout. When it passes and polling is on, the replica's
/metrics is read for `ember:num_requests_running` and `ember:num_requests_waiting`, summed
over label sets except `lane="batch"`: the batch lane only fills idle capacity and yields to
interactive work, so it must not make a replica look busy. A replica that exports neither
keeps reporting zero, and the router's own in-flight count alone measures its load.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families

from ember.router.replicas import Replica, ReplicaSet, Transition

RUNNING_GAUGE = "ember:num_requests_running"
WAITING_GAUGE = "ember:num_requests_waiting"

OnTransition = Callable[[Replica, Transition], None]


def parse_load(text: str) -> tuple[int, int] | None:
    """(running, waiting) from Prometheus text, or None when neither gauge is there."""
    totals: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            if family.name in (RUNNING_GAUGE, WAITING_GAUGE):
                totals[family.name] = sum(s.value for s in family.samples
                                          if s.name == family.name
                                          and s.labels.get("lane") != "batch")
    except ValueError:
        return None
    if not totals:
        return None
    return int(totals.get(RUNNING_GAUGE, 0)), int(totals.get(WAITING_GAUGE, 0))


class HealthChecker:
    def __init__(self, replicas: ReplicaSet, client: httpx.AsyncClient, path: str,
                 poll_metrics: bool, on_transition: OnTransition) -> None:
        self.replicas = replicas
        self.client = client
        self.path = path
        self.poll_metrics = poll_metrics
        self.on_transition = on_transition

    async def check(self, replica: Replica) -> None:
        unreachable = False
        try:
            response = await self.client.get(replica.url + self.path)
            error = None
            if response.status_code != 200:
                error = f"{self.path} returned {response.status_code}"
        except httpx.HTTPError as exc:
            error, unreachable = f"{self.path}: {type(exc).__name__}: {exc}", True
        if replica.url not in self.replicas:
            return  # removed while the check was in flight
        if error is not None:
            transition = self.replicas.record_failure(replica, error, unreachable)
        else:
            transition = self.replicas.record_check(replica)
            if self.poll_metrics:
                await self._read_load(replica)
        if transition is not None:
            self.on_transition(replica, transition)

    async def _read_load(self, replica: Replica) -> None:
        try:
            response = await self.client.get(replica.url + "/metrics")
        except httpx.HTTPError:
            return
        load = parse_load(response.text) if response.status_code == 200 else None
        if load is not None:
            replica.reported_running, replica.reported_waiting = load

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(r) for r in self.replicas.all()))

    async def run(self, interval: float) -> None:
        """Check forever, every `interval` seconds; cancel the task to stop."""
        while True:
            await asyncio.sleep(interval)
            await self.check_all()
