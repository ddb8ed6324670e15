"""Per-request records, per-run summaries, ratios between endpoints and the JSON report.

Everything here is arithmetic on records, so it can be checked by hand.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from ember.bench.config import Prices
from ember.bench.runner import EndpointRun, Sent
from ember.bench.tokenizer import BenchTokenizer

PERCENTILES = (50, 90, 99)
# (metric path in a summary, whether higher is better): the rows of the comparison.
COMPARED: tuple[tuple[str, bool], ...] = (
    ("output_tokens_per_s", True),
    ("total_tokens_per_s", True),
    ("requests_per_s", True),
    ("ttft_s.p50", False),
    ("ttft_s.p90", False),
    ("ttft_s.p99", False),
    ("itl_s.p50", False),
    ("itl_s.p99", False),
    ("tpot_s.p50", False),
    ("e2e_s.p50", False),
    ("e2e_s.p99", False),
    ("cached_fraction", True),
    ("cost.usd_per_request", False),
    ("error_rate", False),
)


@dataclass
class RequestRecord:
    """One request; seconds are relative to the endpoint run's start."""

    stream: str
    session: str
    turn: int
    start_s: float
    e2e_s: float
    ttft_s: float | None
    itl_s: list[float] = field(default_factory=list)
    max_tokens: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    expected_prompt_tokens: int | None = None
    usage_source: str = "server"  # "server", or "tokenizer" when the server sent no usage
    status: int | None = 200
    error: str | None = None
    finish_reason: str | None = None
    affinity: str | None = None
    affinity_echo: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first."""
        if self.ttft_s is None or self.completion_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.completion_tokens - 1)


def to_record(sent: Sent, run_start: float, tokenizer: BenchTokenizer) -> RequestRecord:
    """Derive a record from what the client saw; token counts come from `usage` when the
    server sent it and from the tokenizer otherwise."""
    result = sent.result
    times = result.chunk_times
    expected = tokenizer.count_chat(sent.messages)
    usage = result.usage or {}
    if result.usage is not None:
        details = usage.get("prompt_tokens_details") or {}
        prompt, completion = int(usage.get("prompt_tokens", 0)), int(
            usage.get("completion_tokens", 0))
        cached, source = int(details.get("cached_tokens") or 0), "server"
    else:
        prompt, completion, cached, source = expected, tokenizer.count(result.text), 0, "tokenizer"
    return RequestRecord(
        stream=sent.stream, session=sent.session_id, turn=sent.turn,
        start_s=result.start - run_start, e2e_s=result.end - result.start,
        ttft_s=times[0] - result.start if times else None,
        itl_s=[b - a for a, b in zip(times, times[1:], strict=False)],
        max_tokens=sent.max_tokens, prompt_tokens=prompt, completion_tokens=completion,
        cached_tokens=cached, expected_prompt_tokens=expected, usage_source=source,
        status=result.status, error=result.error, finish_reason=result.finish_reason,
        affinity=sent.affinity, affinity_echo=result.affinity_echo,
    )


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default method)."""
    if not values:
        raise ValueError("percentile: no values")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def distribution(values: list[float]) -> dict[str, float | int | None]:
    summary: dict[str, float | int | None] = {"count": len(values)}
    keys = ["mean", "min", "max"] + [f"p{q}" for q in PERCENTILES]
    if not values:
        return summary | dict.fromkeys(keys)
    summary |= {"mean": sum(values) / len(values), "min": min(values), "max": max(values)}
    summary |= {f"p{q}": percentile(values, q) for q in PERCENTILES}
    return summary


def request_cost(record: RequestRecord, prices: Prices) -> float:
    uncached = record.prompt_tokens - record.cached_tokens
    return (uncached * prices.input + record.cached_tokens * prices.cached_input
            + record.completion_tokens * prices.output) / 1e6


def summarize(records: list[RequestRecord], prices: Prices) -> dict[str, Any]:
    """Throughput over the span from the first start to the last end; latencies, tokens and
    cost over the requests that succeeded; error rate over all."""
    if not records:
        return {"requests": 0}
    ok = [r for r in records if r.ok]
    span = max(r.start_s + r.e2e_s for r in records) - min(r.start_s for r in records)
    prompt = sum(r.prompt_tokens for r in ok)
    completion = sum(r.completion_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    cost = sum(request_cost(r, prices) for r in ok)
    saved = cached * (prices.input - prices.cached_input) / 1e6
    rate = (lambda amount: amount / span) if span > 0 else (lambda amount: None)
    errors = Counter(str(r.status) if r.status is not None else "transport"
                     for r in records if not r.ok)
    return {
        "requests": len(records),
        "succeeded": len(ok),
        "failed": len(records) - len(ok),
        "error_rate": (len(records) - len(ok)) / len(records),
        "errors_by_status": dict(sorted(errors.items())),
        "duration_s": span,
        "requests_per_s": rate(len(ok)),
        "output_tokens_per_s": rate(completion),
        "total_tokens_per_s": rate(prompt + completion),
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "cached_tokens": cached,
        "cached_fraction": cached / prompt if prompt else 0.0,
        "usage_from_server": sum(r.usage_source == "server" for r in ok),
        "ttft_s": distribution([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_s": distribution([gap for r in ok for gap in r.itl_s]),
        "tpot_s": distribution([r.tpot_s for r in ok if r.tpot_s is not None]),
        "e2e_s": distribution([r.e2e_s for r in ok]),
        "cost": {
            "usd": cost,
            "usd_per_request": cost / len(ok) if ok else None,
            "saved_by_cache_usd": saved,
            "prices_usd_per_million": asdict(prices),
        },
    }


def metric(summary: dict[str, Any], path: str) -> float | None:
    value: Any = summary
    for key in path.split("."):
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value


def ratios(baseline: dict[str, Any], other: dict[str, Any]) -> dict[str, float | None]:
    """other / baseline for each compared metric; None where the baseline is 0 or missing."""
    out: dict[str, float | None] = {}
    for path, _ in COMPARED:
        base, value = metric(baseline, path), metric(other, path)
        out[path] = value / base if base and value is not None else None
    return out


def endpoint_report(run: EndpointRun, tokenizer: BenchTokenizer,
                    prices: Prices) -> dict[str, Any]:
    records = [to_record(sent, run.start, tokenizer) for sent in run.requests]
    records.sort(key=lambda r: r.start_s)
    streams = sorted({r.stream for r in records} | {run.measured_stream})
    return {
        "name": run.endpoint.name,
        "base_url": run.endpoint.base_url,
        "model": run.model,
        "measured_stream": run.measured_stream,
        "cancelled_background_requests": run.cancelled,
        "summary": summarize([r for r in records if r.stream == run.measured_stream], prices),
        "by_stream": {s: summarize([r for r in records if r.stream == s], prices)
                      for s in streams},
        "requests": [asdict(r) | {"tpot_s": r.tpot_s} for r in records],
    }


def comparison(endpoints: list[dict[str, Any]]) -> dict[str, Any]:
    """Each endpoint's measured summary against the first endpoint's."""
    baseline = endpoints[0]
    return {
        "baseline": baseline["name"],
        "higher_is_better": {path: better for path, better in COMPARED},
        "ratios": {e["name"]: ratios(baseline["summary"], e["summary"]) for e in endpoints[1:]},
    }


def format_table(report: dict[str, Any]) -> str:
    """A plain-text side-by-side table of the compared metrics, with ratios to the baseline."""
    endpoints = report["endpoints"]
    names = [e["name"] for e in endpoints]
    baseline = report["comparison"]["baseline"]
    header = ["metric"] + names + [f"{n}/{baseline}" for n in names[1:]]
    rows = [header]
    for path, _ in (("requests", True), ("failed", False)) + COMPARED:
        values = [metric(e["summary"], path) for e in endpoints]
        cells = [_fmt(v) for v in values]
        cells += [_fmt(report["comparison"]["ratios"][n].get(path), ratio=True)
                  for n in names[1:]]
        rows.append([path] + cells)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                               for i, (cell, w) in enumerate(zip(row, widths, strict=True)))
                     for row in rows)


def _fmt(value: float | None, ratio: bool = False) -> str:
    if value is None:
        return "-"
    if ratio:
        return f"{value:.2f}x"
    if isinstance(value, int):
        return str(value)
    return f"{value:.4g}"
