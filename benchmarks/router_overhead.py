"""Router overhead: the latency `ember route` adds to a request, against calling its replica
directly, in the same run.

Starts one `ember serve` replica and one `ember route` in front of it (both real processes on
127.0.0.1), then sends the same requests to both, alternating which goes first so drift in the
machine's load hits both sides alike. Two kinds of request:
  models  GET /v1/models: no model work, so the difference is the router's HTTP path alone;
  chat    a streamed chat completion, max_tokens 1: time to the first content byte (the router
          holds back the role-only chunk until then) and to the end of the stream.
Reports p50 / p90 / p99 of each side and their differences, plus the router's own
ember:router_added_latency_seconds histogram over the measured requests.

    python benchmarks/router_overhead.py [--model PATH] [--requests 400] [--concurrency 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
PERCENTILES = (50, 90, 99)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(cmd: list[str], ready_url: str, timeout: float, env: dict[str, str] | None = None
          ) -> subprocess.Popen:
    log = tempfile.NamedTemporaryFile(prefix="router-overhead-", suffix=".log", delete=False)
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                               env={**os.environ, **(env or {})})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{cmd[3]} exited: see {log.name}")
        try:
            if httpx.get(ready_url, timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    process.kill()
    raise RuntimeError(f"{cmd[3]} did not start in {timeout:.0f}s: see {log.name}")


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks, as numpy's default."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


async def timed_models(client: httpx.AsyncClient, base: str) -> dict[str, float]:
    start = time.perf_counter()
    response = await client.get(base + "/v1/models")
    response.raise_for_status()
    return {"total": time.perf_counter() - start}


async def timed_chat(client: httpx.AsyncClient, base: str, model: str) -> dict[str, float]:
    body = {"model": model, "max_tokens": 1, "stream": True, "temperature": 0,
            "messages": [{"role": "user", "content": "Name one prime number."}]}
    start = time.perf_counter()
    first = None
    async with client.stream("POST", base + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if first is None and line.startswith("data:") and line[5:].strip() != "[DONE]":
                choices = json.loads(line[5:]).get("choices") or []
                if any((c.get("delta") or {}).get("content") for c in choices):
                    first = time.perf_counter() - start
    return {"first_byte": first if first is not None else float("nan"),
            "total": time.perf_counter() - start}


async def measure(kind: str, direct: str, routed: str, model: str, requests: int,
                  warmup: int, concurrency: int) -> dict[str, dict[str, list[float]]]:
    samples: dict[str, dict[str, list[float]]] = {"direct": {}, "routed": {}}
    limits = httpx.Limits(max_connections=2 * concurrency)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:

        async def one(base: str) -> dict[str, float]:
            if kind == "models":
                return await timed_models(client, base)
            return await timed_chat(client, base, model)

        async def worker(index: int) -> None:
            for i in range(index, warmup + requests, concurrency):
                order = [("direct", direct), ("routed", routed)]
                if i % 2:
                    order.reverse()
                for side, base in order:
                    result = await one(base)
                    if i >= warmup:
                        for key, value in result.items():
                            samples[side].setdefault(key, []).append(value)

        await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return samples


def histogram(metrics_text: str) -> dict[float, float]:
    """Cumulative bucket counts of ember:router_added_latency_seconds."""
    buckets = {}
    for line in metrics_text.splitlines():
        if line.startswith("ember:router_added_latency_seconds_bucket"):
            bound = line.split('le="', 1)[1].split('"', 1)[0]
            buckets[float(bound)] = float(line.rsplit(" ", 1)[1])
    return buckets


def histogram_percentile(before: dict[float, float], after: dict[float, float],
                         q: float) -> float:
    """The q-th percentile of the observations between two scrapes, interpolated within its
    bucket as Prometheus' histogram_quantile does."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    total = counts[-1]
    rank = total * q / 100
    lower, below = 0.0, 0.0
    for bound, count in zip(bounds, counts, strict=True):
        if count >= rank:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = bound, count
    return lower


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None,
                        help="checkpoint folder for the replica (default: the default model)")
    parser.add_argument("--requests", type=int, default=400, help="measured, per side and kind")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args()

    replica_port, router_port = free_port(), free_port()
    direct = f"http://127.0.0.1:{replica_port}"
    routed = f"http://127.0.0.1:{router_port}"
    serve = [sys.executable, "-m", "ember.cli", "serve", *([args.model] if args.model else []),
             "--host", "127.0.0.1", "--port", str(replica_port), "--served-model-name", "m"]
    route = [sys.executable, "-m", "ember.cli", "route", "--replica", direct, "--host",
             "127.0.0.1", "--port", str(router_port), "--log-level", "warning"]
    processes = []
    try:
        processes.append(start(serve, direct + "/health", 300, {"EMBER_NUM_THREADS": "1"}))
        processes.append(start(route, routed + "/health", 120))
        report: dict[str, object] = {"argv": sys.argv[1:], "load_average": os.getloadavg()}
        for kind in ("models", "chat"):
            before = histogram(httpx.get(routed + "/metrics").text)
            samples = asyncio.run(measure(kind, direct, routed, "m", args.requests,
                                          args.warmup, args.concurrency))
            after = histogram(httpx.get(routed + "/metrics").text)
            figures: dict[str, object] = {}
            for key in samples["direct"]:
                row = {}
                for q in PERCENTILES:
                    d = percentile(samples["direct"][key], q) * 1e3
                    r = percentile(samples["routed"][key], q) * 1e3
                    row[f"p{q}"] = {"direct_ms": round(d, 3), "routed_ms": round(r, 3),
                                    "added_ms": round(r - d, 3)}
                figures[key] = row
            figures["router_histogram_ms"] = {
                f"p{q}": round(histogram_percentile(before, after, q) * 1e3, 3)
                for q in PERCENTILES}
            report[kind] = figures
            print(f"\n{kind} ({args.requests} requests per side, concurrency "
                  f"{args.concurrency})")
            for key, row in figures.items():
                print(f"  {key}: " + ", ".join(
                    f"{p} {v['routed_ms']:.2f} vs {v['direct_ms']:.2f} ms "
                    f"(+{v['added_ms']:.2f})" if isinstance(v, dict) else f"{p} {v:.3f} ms"
                    for p, v in row.items()))
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    finally:
        for process in reversed(processes):
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
