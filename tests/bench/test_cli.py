"""End to end: `ember bench` subprocesses against a real `ember serve` on 127.0.0.1.

The server serves a tiny random Llama that carries the default model's tokenizer (fast on
CPU); the bench cuts prompts with that same tokenizer, so the prompt lengths it plans must
equal the server's `usage.prompt_tokens` exactly.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
CONTEXT = 256  # --context-length for long-context and interference: short prefills on CPU


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path):
    """`ember serve` on a tiny random Llama, stopped by pid at the end."""
    port = free_port()
    folder = tmp_path_factory.mktemp("serve")
    log = folder / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ember.cli", "serve", str(tiny_llama_dir), "--host",
             "127.0.0.1", "--port", str(port), "--ledger", str(folder / "ledger.sqlite"),
             "--kv-cache-memory-gb", "0.25"],
            cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            if proc.poll() is not None:
                pytest.fail(f"ember serve exited with {proc.returncode}:\n{log.read_text()}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"ember serve not healthy after 240 s:\n{log.read_text()}")
            time.sleep(0.5)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def bench(tmp_path: Path, *args: str) -> tuple[dict, subprocess.CompletedProcess]:
    out = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, "-m", "ember.cli", "bench", *args, "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env=os.environ | {"PYTHONUNBUFFERED": "1"})
    assert done.returncode == 0, done.stderr
    return json.loads(out.read_text()), done


def check_summary(summary: dict, records: list[dict]) -> None:
    """Recompute a summary from its records."""
    ok = [r for r in records if r["error"] is None]
    assert summary["requests"] == len(records) and summary["succeeded"] == len(ok)
    span = max(r["start_s"] + r["e2e_s"] for r in records) - min(r["start_s"] for r in records)
    assert summary["duration_s"] == pytest.approx(span)
    prompt = sum(r["prompt_tokens"] for r in ok)
    completion = sum(r["completion_tokens"] for r in ok)
    cached = sum(r["cached_tokens"] for r in ok)
    assert (summary["prompt_tokens"], summary["completion_tokens"],
            summary["cached_tokens"]) == (prompt, completion, cached)
    assert summary["output_tokens_per_s"] == pytest.approx(completion / span)
    assert summary["total_tokens_per_s"] == pytest.approx((prompt + completion) / span)
    assert summary["requests_per_s"] == pytest.approx(len(ok) / span)
    assert summary["cached_fraction"] == pytest.approx(cached / prompt)
    for key in ("ttft_s", "e2e_s"):
        values = [r[key] for r in ok]
        for q in (50, 90, 99):
            assert summary[key][f"p{q}"] == pytest.approx(float(np.percentile(values, q)))
    gaps = [g for r in ok for g in r["itl_s"]]
    assert summary["itl_s"]["count"] == len(gaps)
    if gaps:
        assert summary["itl_s"]["p50"] == pytest.approx(float(np.percentile(gaps, 50)))
    prices = summary["cost"]["prices_usd_per_million"]
    cost = sum((r["prompt_tokens"] - r["cached_tokens"]) * prices["input"]
               + r["cached_tokens"] * prices["cached_input"]
               + r["completion_tokens"] * prices["output"] for r in ok) / 1e6
    assert summary["cost"]["usd"] == pytest.approx(cost)


def check_requests(records: list[dict]) -> None:
    """Every request succeeded, and its counts agree with the server's usage."""
    for r in records:
        assert r["error"] is None and r["status"] == 200, r
        assert r["usage_source"] == "server"
        assert r["prompt_tokens"] == r["expected_prompt_tokens"]
        assert 1 <= r["completion_tokens"] <= r["max_tokens"]
        assert len(r["itl_s"]) + 1 <= r["completion_tokens"]  # one chunk carries >= 1 token
        assert 0 < r["ttft_s"] <= r["e2e_s"]
        assert 0 <= r["cached_tokens"] <= r["prompt_tokens"]


def test_chat_against_itself_with_ratios_plot_and_progress(server, tmp_path):
    png = tmp_path / "bench.png"
    report, done = bench(tmp_path, "--base-url", server, "--name", "first",
                         "--compare", f"second={server}/v1", "--workload", "chat",
                         "--concurrency", "2", "--num-requests", "4", "--input-len",
                         "uniform:60:90", "--output-len", "6", "--seed", "7",
                         "--plot", str(png), "--progress")
    params = report["parameters"]
    assert params["workload"] == "chat" and params["num_requests"] == 4 and params["seed"] == 7
    assert params["workload_parameters"] == {"input_len": "uniform:60:90", "output_len": "6"}
    first, second = report["endpoints"]
    for endpoint in (first, second):
        records = endpoint["requests"]
        assert len(records) == 4
        check_requests(records)
        assert all(60 <= r["prompt_tokens"] <= 90 for r in records)
        check_summary(endpoint["summary"], records)
    # the same request stream went to both endpoints
    assert sorted(r["prompt_tokens"] for r in first["requests"]) == sorted(
        r["prompt_tokens"] for r in second["requests"])
    ratios = report["comparison"]["ratios"]["second"]
    assert report["comparison"]["baseline"] == "first"
    assert ratios["output_tokens_per_s"] == pytest.approx(
        second["summary"]["output_tokens_per_s"] / first["summary"]["output_tokens_per_s"])
    assert ratios["ttft_s.p99"] == pytest.approx(
        second["summary"]["ttft_s"]["p99"] / first["summary"]["ttft_s"]["p99"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "second/first" in done.stdout
    assert "4/4" in done.stderr  # the progress bar reached the end


def test_agent_sessions_carry_affinity_and_hit_the_prefix_cache(server, tmp_path):
    report, _ = bench(tmp_path, "--base-url", server, "--workload", "agent",
                      "--concurrency", "2", "--num-requests", "6", "--turns", "3",
                      "--system-len", "48", "--file-len", "96", "--tool-result-len", "16",
                      "--output-len", "4")
    endpoint = report["endpoints"][0]
    records = endpoint["requests"]
    check_requests(records)
    check_summary(endpoint["summary"], records)
    assert len({r["session"] for r in records}) == 2
    assert all(r["affinity"] and r["affinity_echo"] == r["affinity"] for r in records)
    for r in records:
        if r["turn"] > 0:
            earlier = next(e for e in records
                           if e["session"] == r["session"] and e["turn"] == r["turn"] - 1)
            assert r["prompt_tokens"] > earlier["prompt_tokens"] + earlier["completion_tokens"]
    assert endpoint["summary"]["cached_tokens"] > 0
    assert 0 < endpoint["summary"]["cached_fraction"] < 1


def test_long_context_prompts_fill_the_context(server, tmp_path):
    report, _ = bench(tmp_path, "--base-url", server, "--workload", "long-context",
                      "--context-length", str(CONTEXT), "--concurrency", "1",
                      "--num-requests", "2", "--output-len", "4")
    endpoint = report["endpoints"][0]
    check_requests(endpoint["requests"])
    check_summary(endpoint["summary"], endpoint["requests"])
    assert report["parameters"]["workload_parameters"]["input_len"] == CONTEXT - 4 - 8
    assert all(r["prompt_tokens"] == CONTEXT - 12 for r in endpoint["requests"])


def test_interference_measures_short_chats_beside_long_prefills(server, tmp_path):
    report, _ = bench(tmp_path, "--base-url", server, "--workload", "interference",
                      "--context-length", str(CONTEXT), "--concurrency", "2",
                      "--num-requests", "4", "--input-len", "50", "--output-len", "8",
                      "--long-requests", "2")
    endpoint = report["endpoints"][0]
    short = [r for r in endpoint["requests"] if r["stream"] == "short"]
    long = [r for r in endpoint["requests"] if r["stream"] == "long"]
    assert endpoint["measured_stream"] == "short" and len(short) == 4
    check_requests(short)
    check_requests(long)
    check_summary(endpoint["summary"], short)
    assert endpoint["by_stream"]["short"] == endpoint["summary"]
    assert all(r["prompt_tokens"] == CONTEXT - 9 and r["max_tokens"] == 1 for r in long)
    assert len(long) + endpoint["cancelled_background_requests"] >= 1
    assert all(r["prompt_tokens"] == 50 for r in short)


def parse(*argv: str):
    import argparse

    from ember.bench.cli import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(["--base-url", "http://h:1", *argv]))


def test_arguments_become_one_validated_config(tmp_path):
    table = tmp_path / "prices.json"
    table.write_text('{"kimi": {"input": 1, "cached_input": 0.5, "output": 4}}')
    config = parse("--name", "ember", "--compare", "vllm=http://h:2/v1", "--workload", "agent",
                   "--prices", "0.3,0.03,1.2", "--price-table", str(table),
                   "--launch", "vllm=VAR=1 python -m server --x=y", "--output-len",
                   "uniform:4:8")
    assert [(e.name, e.api_url) for e in config.endpoints] == [
        ("ember", "http://h:1/v1"), ("vllm", "http://h:2/v1")]
    assert config.launch == {"vllm": "VAR=1 python -m server --x=y"}
    assert config.prices_for("other").output == 1.2
    assert config.prices_for("kimi").cached_input == 0.5
    assert config.output_len.upper() == 8 and config.num_requests == 40


@pytest.mark.parametrize("argv, field_name", [
    (["--compare", "nourl"], "compare"),
    (["--prices", "1,2"], "prices"),
    (["--launch", "nobody=sleep 1"], "launch"),
    (["--input-len", "uniform:9"], "input_len"),
    (["--concurrency", "0"], "concurrency"),
])
def test_bad_arguments_name_the_field(argv, field_name):
    with pytest.raises(ValueError, match=f"^{field_name}: "):
        parse(*argv)
