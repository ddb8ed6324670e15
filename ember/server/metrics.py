"""Prometheus metrics, `ember:`-prefixed and named in parallel with vLLM's where one exists.

Request-level metrics (latency histograms, token and dollar counters) are observed here in the
API process as requests finish. Engine-level ones (KV usage, queues, prefix cache, preemptions)
are read at scrape time from the latest CoreStatus the engine core sent, by a custom
collector, so they cost nothing between scrapes. Each server owns its registry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ember.engine.core_process import CoreStatus

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
               50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class ServerMetrics:
    def __init__(self, model_name: str, status: Callable[[], CoreStatus | None],
                 alive: Callable[[], bool]) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self.ttft = Histogram("ember:time_to_first_token_seconds",
                              "Time from request arrival to its first output token.", labels,
                              registry=r, buckets=TTFT_BUCKETS)
        self.itl = Histogram("ember:inter_token_latency_seconds",
                             "Time between consecutive outputs of a request.", labels,
                             registry=r, buckets=ITL_BUCKETS)
        self.e2e = Histogram("ember:e2e_request_latency_seconds",
                             "Time from request arrival to its last output.", labels,
                             registry=r, buckets=E2E_BUCKETS)
        self.prompt_tokens = Counter("ember:prompt_tokens", "Prompt tokens processed.", labels,
                                     registry=r)
        self.cached_tokens = Counter("ember:prompt_tokens_cached",
                                     "Prompt tokens served from the prefix cache.", labels,
                                     registry=r)
        self.generation_tokens = Counter("ember:generation_tokens", "Tokens generated.", labels,
                                         registry=r)
        self.request_success = Counter("ember:request_success",
                                       "Requests finished, by finish reason.",
                                       labels + ["finished_reason"], registry=r)
        self.billed_usd = Counter("ember:billed_usd", "US dollars billed.", labels, registry=r)
        self.saved_usd = Counter("ember:saved_usd",
                                 "US dollars saved by cached prompt tokens (billed at the "
                                 "cached-input rate instead of the input rate).", labels,
                                 registry=r)
        self.rejected = Counter("ember:requests_rejected",
                                "Requests answered with an error, by HTTP status.",
                                labels + ["status"], registry=r)
        r.register(EngineCollector(model_name, status, alive))

    def observe_finished(self, *, ttft_s: float | None, e2e_s: float, itl_s: list[float],
                         prompt_tokens: int, cached_tokens: int, completion_tokens: int,
                         finish_reasons: list[str], billed_usd: float, saved_usd: float) -> None:
        m = self.model_name
        if ttft_s is not None:
            self.ttft.labels(m).observe(ttft_s)
        for gap in itl_s:
            self.itl.labels(m).observe(gap)
        self.e2e.labels(m).observe(e2e_s)
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        self.cached_tokens.labels(m).inc(cached_tokens)
        self.generation_tokens.labels(m).inc(completion_tokens)
        for reason in finish_reasons:
            self.request_success.labels(m, reason).inc()
        self.billed_usd.labels(m).inc(billed_usd)
        self.saved_usd.labels(m).inc(saved_usd)

    def observe_rejected(self, status: int) -> None:
        self.rejected.labels(self.model_name, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class EngineCollector(Collector):
    """Engine-core state at scrape time, from the last CoreStatus it reported."""

    def __init__(self, model_name: str, status: Callable[[], CoreStatus | None],
                 alive: Callable[[], bool]) -> None:
        self.model_name = model_name
        self.status = status
        self.alive = alive

    def collect(self) -> Iterator[Metric]:
        m = self.model_name
        alive = GaugeMetricFamily("ember:engine_core_alive",
                                  "1 while the engine core process is running.",
                                  labels=["model_name"])
        alive.add_metric([m], 1.0 if self.alive() else 0.0)
        yield alive
        status = self.status()
        if status is None:
            return
        s = status.engine
        yield _gauge("ember:kv_cache_usage_perc",
                     "Fraction of KV-cache blocks held by requests (0 to 1).", m, s.kv_usage)
        yield _gauge("ember:num_kv_blocks", "KV-cache blocks in the pool.", m, s.num_kv_blocks)
        for name, doc, by_lane in (
                ("ember:num_requests_running", "Requests in the running batch.",
                 s.num_running_by_lane),
                ("ember:num_requests_waiting", "Requests waiting to be scheduled.",
                 s.num_waiting_by_lane)):
            family = GaugeMetricFamily(name, doc, labels=["model_name", "lane"])
            for lane, count in sorted(by_lane.items()):
                family.add_metric([m, lane], count)
            yield family
        yield _counter("ember:prefix_cache_queries", "Prompt tokens looked up in the prefix "
                       "cache.", m, s.prefix_queries)
        yield _counter("ember:prefix_cache_hits", "Prompt tokens found in the prefix cache.", m,
                       s.prefix_hits)
        yield _counter("ember:num_preemptions", "Requests preempted for lack of KV blocks.", m,
                       s.num_preemptions)
        yield _counter("ember:engine_steps", "Engine steps that ran the model.", m, s.num_steps)
        yield _counter("ember:kv_integrity_checks", "KV-cache integrity checks run when idle.",
                       m, status.integrity_checks)
        yield _gauge("ember:kv_integrity_ok", "1 unless an integrity check has failed.", m,
                     0.0 if status.integrity_error else 1.0)
        yield from self._moe_metrics(status)

    def _moe_metrics(self, status: CoreStatus) -> Iterator[Metric]:
        """Per-layer expert load imbalance (max/mean tokens per expert) for MoE models."""
        imbalance = status.engine.expert_load_imbalance
        if not imbalance:
            return
        family = GaugeMetricFamily("ember:moe_expert_load_imbalance",
                                   "Max over mean tokens per expert, by MoE layer.",
                                   labels=["model_name", "layer"])
        for layer, value in sorted(imbalance.items()):
            family.add_metric([self.model_name, str(layer)], value)
        yield family


def _gauge(name: str, doc: str, model: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=["model_name"])
    family.add_metric([model], value)
    return family


def _counter(name: str, doc: str, model: str, value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=["model_name"])
    family.add_metric([model], value)
    return family
