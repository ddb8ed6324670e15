"""One proxied request: choose a replica, send, retry once elsewhere, relay, account.

A request is retried on another replica when the first one fails before its first body byte:
always when the connection could not be made (the replica never saw it), otherwise only for
reads and inference endpoints, which are safe to run twice (a POST /v1/batches is not).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import httpx
from starlette.requests import Request
from starlette.responses import Response

from ember.router import proxy
from ember.router.config import RouterConfig
from ember.router.metrics import RouterMetrics
from ember.router.policy import Decision, Policy
from ember.router.prefix_index import PrefixIndex
from ember.router.prompt import block_hashes, render
from ember.router.replicas import Replica, ReplicaSet, Transition

RETRY_STATUSES = frozenset({502, 503, 504})
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
INFERENCE_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings",
                             "/v1/responses"})
REPLICA_HEADER = b"x-ember-replica"
ROUTE_HEADER = b"x-ember-route"


class Gateway:
    def __init__(self, config: RouterConfig, replicas: ReplicaSet, index: PrefixIndex,
                 policy: Policy, metrics: RouterMetrics, client: httpx.AsyncClient,
                 on_transition: Callable[[Replica, Transition], None]) -> None:
        self.config = config
        self.replicas = replicas
        self.index = index
        self.policy = policy
        self.metrics = metrics
        self.client = client
        self.on_transition = on_transition

    def prompt_hashes(self, body: bytes) -> list[int]:
        """Leading block hashes of the prompt in a JSON body; [] when there is none."""
        if self.policy.name != "affinity" or not body.lstrip().startswith(b"{"):
            return []
        try:
            parsed = json.loads(body)
        except ValueError:
            return []
        text = render(parsed) if isinstance(parsed, dict) else None
        if text is None:
            return []
        return block_hashes(text, self.config.prefix_block_chars, self.config.prefix_max_blocks)

    async def handle(self, request: Request) -> Response:
        arrival = time.perf_counter()
        body = await request.body()
        affinity = request.headers.get(self.config.affinity_header) or None
        hashes = self.prompt_hashes(body) if request.method == "POST" else []
        headers = proxy.request_headers(request.headers.raw)
        path = request.url.path
        target = path + (f"?{request.url.query}" if request.url.query else "")
        repeatable = request.method in SAFE_METHODS or path in INFERENCE_PATHS
        tried: list[str] = []
        last_error = "no replica is available"
        for attempt in range(1 + self.config.retries):
            decision = self.policy.choose(affinity, hashes, tried)
            if decision is None:
                break
            replica = decision.replica
            if attempt:
                self.metrics.retries.labels(tried[-1]).inc()
            route = self._count(decision, attempt)
            replica.in_flight += 1
            sent_at = time.perf_counter()
            try:
                upstream = await proxy.send(self.client, replica.url + target, request.method,
                                            headers, body)
            except proxy.UpstreamError as exc:
                replica.in_flight -= 1
                self._failed(replica, str(exc), "before_first_byte" if exc.sent else "connect",
                             unreachable=True)
                tried.append(replica.url)
                last_error = f"{replica.url}: {exc}"
                if exc.sent and not repeatable:
                    break
                continue
            can_retry = repeatable and attempt < self.config.retries
            if upstream.status_code in RETRY_STATUSES:
                self._failed(replica, f"returned {upstream.status_code}", "status")
                if can_retry and len(self.policy.eligible([*tried, replica.url])) > 0:
                    replica.in_flight -= 1
                    await upstream.aclose()
                    tried.append(replica.url)
                    continue
            else:
                self.replicas.record_success(replica)
                if upstream.status_code < 400 and hashes and replica.url in self.replicas:
                    self.index.record(replica.url, hashes)
            return self._relay(upstream, replica, route, sent_at - arrival)
        status = 503 if not tried else 502
        return proxy.error_response(f"ember route: {last_error}", status)

    def _relay(self, upstream: proxy.Upstream, replica: Replica, route: str,
               before_send: float) -> Response:
        received_at = time.perf_counter()
        observed = False

        def on_first_byte() -> None:
            nonlocal observed
            observed = True
            self.metrics.added_latency.observe(before_send + time.perf_counter() - received_at)

        def on_finish(error: str | None) -> None:
            replica.in_flight -= 1
            replica.streams.discard(response)
            if not observed:
                self.metrics.added_latency.observe(before_send)
            if error is not None:
                self._failed(replica, error, "mid_stream", unreachable=True)

        headers = proxy.response_headers(upstream.response.headers.raw) + [
            (REPLICA_HEADER, replica.url.encode()), (ROUTE_HEADER, route.encode())]
        response = proxy.RelayResponse(upstream, headers, on_first_byte, on_finish)
        replica.streams.add(response)
        return response

    def _count(self, decision: Decision, attempt: int) -> str:
        """Count the request; returns its route label: the decision's, or spill, or retry."""
        route = "retry" if attempt else decision.route
        if decision.spilled_from is not None:
            route = "spill"
            self.metrics.spills.labels(decision.spilled_from.url).inc()
        elif attempt == 0 and decision.route == "affinity":
            self.metrics.affinity_hits.inc()
        elif attempt == 0 and decision.route == "prefix":
            self.metrics.prefix_routed.inc()
        self.metrics.requests.labels(decision.replica.url, route).inc()
        return route

    def _failed(self, replica: Replica, error: str, phase: str,
                unreachable: bool = False) -> None:
        self.metrics.upstream_errors.labels(replica.url, phase).inc()
        transition = self.replicas.record_failure(replica, error, unreachable)
        if transition is not None and replica.url in self.replicas:
            self.on_transition(replica, transition)
