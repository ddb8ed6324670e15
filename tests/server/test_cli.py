"""`ember serve` end to end: API keys, per-key limits, reject-if-busy, SIGTERM, and a dead
engine core.

One guarded server for the flags, stopped with SIGTERM by its last test; one more whose
engine core is killed on purpose.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

MODEL = "guarded"
KEY = "sk-main"
LIMITED_KEY = "sk-limited"  # 2 requests per minute
SMALL_KEY = "sk-small"  # 40 tokens per minute
HI = [{"role": "user", "content": "hi"}]


def client_for(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)


def descendants(pid: int) -> list[int]:
    """Live processes below pid (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def waiting(metrics_text: str) -> float:
    return sum(s.value for family in text_string_to_metric_families(metrics_text)
               for s in family.samples
               if s.name == "ember:num_requests_waiting" and s.labels["lane"] == "interactive")


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture(scope="module")
def guarded(ember_servers, tiny_llama_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("guarded")
    keys = folder / "keys.txt"
    keys.write_text(f"{LIMITED_KEY} name=limited rpm=2\n{SMALL_KEY} name=small tpm=40\n")
    return ember_servers(tiny_llama_dir, "--served-model-name", MODEL, "--dtype", "float32",
                         "--num-kv-blocks", "64", "--max-model-len", "256", "--api-key", KEY,
                         "--api-keys-file", str(keys), "--max-num-seqs", "1",
                         "--max-queue-depth", "1", "--graceful-shutdown-timeout", "60",
                         "--ledger", str(folder / "ledger.sqlite"))


def test_requests_without_a_valid_key_get_401(guarded) -> None:
    with pytest.raises(openai.AuthenticationError) as err:
        client_for(guarded.url, "sk-wrong").chat.completions.create(model=MODEL, messages=HI,
                                                                    max_tokens=1)
    assert err.value.status_code == 401
    assert err.value.body["type"] == "authentication_error"
    no_key = httpx.post(f"{guarded.url}/v1/chat/completions",
                        json={"model": MODEL, "messages": HI})
    assert no_key.status_code == 401 and no_key.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{guarded.url}/v1/models").status_code == 401
    assert httpx.get(f"{guarded.url}/health").status_code == 200  # probes need no key
    ok = client_for(guarded.url, KEY).chat.completions.create(model=MODEL, messages=HI,
                                                               max_tokens=2)
    assert ok.usage.completion_tokens <= 2


def test_requests_per_minute_limit_answers_429_with_retry_after(guarded) -> None:
    client = client_for(guarded.url, LIMITED_KEY)
    for _ in range(2):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1)
    with pytest.raises(openai.RateLimitError) as err:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1)
    retry_after = int(err.value.response.headers["retry-after"])
    assert 1 <= retry_after <= 60
    assert err.value.body["code"] == "rate_limit_exceeded"
    # other keys are not affected
    client_for(guarded.url, KEY).completions.create(model=MODEL, prompt="hi", max_tokens=1)


def test_tokens_per_minute_limit(guarded) -> None:
    client = client_for(guarded.url, SMALL_KEY)
    with pytest.raises(openai.RateLimitError) as err:
        client.completions.create(model=MODEL, prompt="word " * 60, max_tokens=1)
    assert err.value.body["code"] == "tokens_exceeded"
    client.completions.create(model=MODEL, prompt="word " * 25, max_tokens=1)
    with pytest.raises(openai.RateLimitError) as err:
        client.completions.create(model=MODEL, prompt="word " * 25, max_tokens=1)
    assert err.value.body["code"] == "rate_limit_exceeded"
    assert int(err.value.response.headers["retry-after"]) >= 1


def test_reject_if_busy(guarded) -> None:
    """With one sequence at a time and a queue depth of 1: one request runs, one waits,
    and a third that asks to be rejected when busy gets 429 at once."""
    url = guarded.url
    headers = {"authorization": f"Bearer {KEY}"}
    long_body = {"model": MODEL, "prompt": "go", "max_tokens": 200, "ignore_eos": True,
                 "stream": True}
    waiting_result: dict[str, int] = {}

    def queued() -> None:
        resp = httpx.post(f"{url}/v1/completions", headers=headers, timeout=60,
                          json={"model": MODEL, "prompt": "wait", "max_tokens": 2})
        waiting_result["status"] = resp.status_code

    with httpx.Client(timeout=60) as http, http.stream("POST", f"{url}/v1/completions",
                                                       json=long_body, headers=headers) as run:
        lines = run.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # it runs
        waiter = threading.Thread(target=queued)
        waiter.start()
        deadline = time.monotonic() + 20
        while waiting(http.get(f"{url}/metrics").text) < 1:
            assert time.monotonic() < deadline, "the second request never queued"
            time.sleep(0.05)
        started = time.monotonic()
        busy = http.post(f"{url}/v1/completions", headers={**headers,
                                                           "x-ember-reject-if-busy": "true"},
                         json={"model": MODEL, "prompt": "me too", "max_tokens": 2})
        assert time.monotonic() - started < 5
        assert busy.status_code == 429 and busy.json()["error"]["code"] == "server_busy"
        assert int(busy.headers["retry-after"]) >= 1
    waiter.join(timeout=60)  # leaving the stream aborted the long request
    assert waiting_result == {"status": 200}


def test_sigterm_finishes_in_flight_requests_and_stops_the_engine(guarded) -> None:
    url = guarded.url
    children = descendants(guarded.process.pid)
    assert children, "the engine core runs in a child process"
    body = {"model": MODEL, "prompt": "go on", "max_tokens": 60, "ignore_eos": True,
            "stream": True}
    events = []
    with httpx.Client(timeout=60) as http, http.stream(
            "POST", f"{url}/v1/completions", json=body,
            headers={"authorization": f"Bearer {KEY}"}) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if len(events) == 2:
                guarded.process.send_signal(signal.SIGTERM)
    assert events[-1] == "[DONE]"
    assert '"finish_reason": "length"' in events[-2]  # ran to the end despite SIGTERM
    assert guarded.process.wait(timeout=30) == 0
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in children)
    log = guarded.log()
    assert "Traceback" not in log, log[-3000:]


def core_pid(server_pid: int) -> int:
    (pid,) = [p for p in descendants(server_pid)
              if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]
    return pid


def test_a_dead_engine_core_fails_requests_with_a_clear_error(ember_servers, tiny_llama_dir,
                                                              tmp_path) -> None:
    server = ember_servers(tiny_llama_dir, "--served-model-name", MODEL, "--dtype", "float32",
                           "--num-kv-blocks", "32", "--max-model-len", "256",
                           "--ledger", str(tmp_path / "ledger.sqlite"))
    body = {"model": MODEL, "prompt": "go on", "max_tokens": 200, "ignore_eos": True,
            "stream": True}
    events = []
    with httpx.Client(base_url=server.url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=body) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 2:
                        os.kill(core_pid(server.process.pid), signal.SIGKILL)
        error = json.loads(events[-2])["error"]
        assert events[-1] == "[DONE]"
        assert error["code"] == "engine_unavailable" and "died" in error["message"]
        health = http.get("/health")
        assert health.status_code == 503 and "died" in health.json()["engine"]
        again = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
        assert again.status_code == 503 and again.json()["error"]["code"] == "engine_unavailable"
        assert "ember:engine_core_alive{model_name=\"guarded\"} 0.0" in http.get("/metrics").text
    assert server.stop() == 0
