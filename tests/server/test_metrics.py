"""/metrics: parses with prometheus_client, moves as requests run; disconnects free the KV."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

MODEL = "tiny-llama"
LABELS = {"model_name": MODEL}


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics, keyed by (name, sorted labels)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted({**LABELS, **labels}.items())))]


def wait_until_idle(url: str, min_integrity_checks: float = 0, timeout: float = 30.0) -> dict:
    """Scrape until no request runs or waits and the engine has run at least
    min_integrity_checks idle-time integrity checks."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(url)
        busy = sum(v for (name, _), v in samples.items()
                   if name in ("ember:num_requests_running", "ember:num_requests_waiting"))
        checks = value(samples, "ember:kv_integrity_checks_total")
        if (busy == 0 and checks >= min_integrity_checks) or time.monotonic() > deadline:
            return samples
        time.sleep(0.1)


@pytest.fixture(scope="module")
def client(tiny_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused", max_retries=0,
                         timeout=60)


def test_metrics_parse_and_move(tiny_server, client: openai.OpenAI) -> None:
    before = wait_until_idle(tiny_server.url)
    names = {name for name, _ in before}
    for expected in ("ember:kv_cache_usage_perc", "ember:num_requests_running",
                     "ember:num_requests_waiting", "ember:prefix_cache_queries_total",
                     "ember:prefix_cache_hits_total", "ember:num_preemptions_total",
                     "ember:engine_core_alive"):
        assert expected in names
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                   max_tokens=5, extra_body={"ignore_eos": True})
    resp = client.completions.create(model=MODEL, prompt="count with me", max_tokens=7,
                                     extra_body={"ignore_eos": True})
    after = wait_until_idle(tiny_server.url)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - before.get(
            (name, tuple(sorted({**LABELS, **labels}.items()))), 0.0)

    assert delta("ember:generation_tokens_total") == 12
    assert delta("ember:prompt_tokens_total") >= resp.usage.prompt_tokens + 1
    assert delta("ember:time_to_first_token_seconds_count") == 2
    assert delta("ember:e2e_request_latency_seconds_count") == 2
    assert delta("ember:inter_token_latency_seconds_count") == 10  # 4 + 6 gaps
    assert delta("ember:request_success_total", finished_reason="length") == 2
    assert delta("ember:billed_usd_total") > 0
    assert delta("ember:prefix_cache_queries_total") > 0
    assert delta("ember:engine_steps_total") >= 7
    assert value(after, "ember:engine_core_alive") == 1
    assert value(after, "ember:num_requests_running", lane="interactive") == 0


def test_client_disconnect_mid_stream_frees_the_kv_cache(tiny_server) -> None:
    url = tiny_server.url
    before = wait_until_idle(url)
    usage_before = value(before, "ember:kv_cache_usage_perc")
    body = {"model": MODEL, "prompt": "a long story: " * 20, "max_tokens": 400,
            "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=30) as http, http.stream("POST", f"{url}/v1/completions",
                                                       json=body) as resp:
        assert resp.status_code == 200
        events = 0
        for line in resp.iter_lines():
            if line.startswith("data: "):
                json.loads(line[6:])
                events += 1
            if events == 3:
                busy = scrape(url)  # mid-stream: the request holds KV blocks
                break
    assert value(busy, "ember:num_requests_running", lane="interactive") == 1
    assert value(busy, "ember:kv_cache_usage_perc") > usage_before
    after = wait_until_idle(url, value(busy, "ember:kv_integrity_checks_total") + 1)
    assert value(after, "ember:num_requests_running", lane="interactive") == 0
    assert value(after, "ember:kv_cache_usage_perc") == usage_before
    aborted = value(after, "ember:request_success_total", finished_reason="abort") - before.get(
        ("ember:request_success_total",
         tuple(sorted({**LABELS, "finished_reason": "abort"}.items()))), 0.0)
    assert aborted == 1
    assert value(after, "ember:generation_tokens_total") - value(
        before, "ember:generation_tokens_total") < 400  # stopped early
    # the engine checked its KV cache when it went idle again, and found it consistent
    assert value(after, "ember:kv_integrity_checks_total") > value(
        busy, "ember:kv_integrity_checks_total")
    assert value(after, "ember:kv_integrity_ok") == 1
    health = httpx.get(f"{url}/health").json()
    assert health["kv_integrity"] == "ok" and health["open_requests"] == 0
