"""One PNG per bench run: latency distributions and throughput, one colour per endpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

LATENCIES = (("ttft_s", "time to first token (s)"), ("itl_s", "inter-token latency (s)"),
             ("e2e_s", "end-to-end latency (s)"))


def _values(endpoint: dict[str, Any], key: str) -> list[float]:
    """Latencies of the measured stream's successful requests."""
    requests = [r for r in endpoint["requests"]
                if r["stream"] == endpoint["measured_stream"] and r["error"] is None]
    if key == "itl_s":
        return [gap for r in requests for gap in r["itl_s"]]
    return [r[key] for r in requests if r[key] is not None]


def plot_report(report: dict[str, Any], path: str | Path) -> None:
    """Empirical CDFs of TTFT, ITL and end-to-end latency, and output tokens/s as bars."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    endpoints = report["endpoints"]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (key, label) in zip(axes.flat, LATENCIES, strict=False):
        for endpoint in endpoints:
            values = sorted(_values(endpoint, key))
            if values:
                fractions = [(i + 1) / len(values) for i in range(len(values))]
                ax.step(values, fractions, where="post", label=endpoint["name"])
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3)
        ax.legend()
    bars = axes.flat[3]
    names = [e["name"] for e in endpoints]
    throughput = [e["summary"].get("output_tokens_per_s") or 0.0 for e in endpoints]
    drawn = bars.bar(names, throughput, color=[f"C{i}" for i in range(len(names))])
    bars.bar_label(drawn, fmt="%.1f")
    bars.set_ylabel("output tokens/s")
    bars.grid(alpha=0.3, axis="y")
    params = report["parameters"]
    fig.suptitle(f"ember bench: {params['workload']}, concurrency {params['concurrency']}, "
                 f"{', '.join(sorted(set(params['models'].values())))}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
