"""Passthrough: methods, query, headers, status codes and streams go through unchanged."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import openai
import pytest

from ember.router.hashing import owner
from ember.router.proxy import _is_preamble, request_headers, response_headers


def test_hop_by_hop_headers_are_dropped_and_the_rest_kept():
    raw = [(b"Host", b"router"), (b"Connection", b"keep-alive, x-private"), (b"X-Private", b"1"),
           (b"Content-Length", b"3"), (b"Authorization", b"Bearer k"), (b"X-A", b"1"),
           (b"X-A", b"2"), (b"Transfer-Encoding", b"chunked")]
    assert request_headers(raw) == [(b"Authorization", b"Bearer k"), (b"X-A", b"1"),
                                    (b"X-A", b"2")]
    assert (b"Content-Length", b"3") in response_headers(raw)


def test_request_and_response_pass_through_unchanged(fake_replicas, start_router, http):
    router = start_router([r.url for r in fake_replicas])
    body = b'{"anything": [1, 2, 3]}'
    response = http.post(router.url + "/v1/echo?x=1&y=a%20b", content=body,
                          headers={"x-test": "v", "authorization": "Bearer k",
                                   "content-type": "application/json"})
    assert response.status_code == 200
    seen = response.json()
    headers = dict(seen["headers"])
    assert (seen["method"], seen["path"], seen["query"], seen["body"]) == (
        "POST", "/v1/echo", "x=1&y=a%20b", body.decode())
    assert headers["x-test"] == "v" and headers["authorization"] == "Bearer k"
    served_by = response.headers["x-ember-replica"]
    assert headers["host"] == served_by.removeprefix("http://")
    assert response.headers["x-custom"] == "kept"
    assert response.headers.get_list("set-cookie") == ["a=1; Path=/; SameSite=lax",
                                                       "b=2; Path=/; SameSite=lax"]
    assert response.headers["x-replica-name"] in "ABC"
    for method in ("PUT", "DELETE", "PATCH", "GET"):
        assert http.request(method, router.url + "/v1/echo").json()["method"] == method
    assert http.post(router.url + "/v1/echo?status=418").status_code == 418
    assert http.get(router.url + "/v1/no-such-path").status_code == 404


def test_streams_pass_through_chunk_by_chunk_to_the_openai_client(fake_replicas, start_router):
    router = start_router([r.url for r in fake_replicas])
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="k", max_retries=0)
    start = time.perf_counter()
    arrivals, text = [], ""
    stream = client.chat.completions.create(model="fake", messages=[{"role": "user",
                                                                     "content": "hi"}],
                                            max_tokens=4, stream=True,
                                            extra_body={"delay": 0.25})
    for chunk in stream:
        arrivals.append(time.perf_counter() - start)
        text += chunk.choices[0].delta.content
    assert text == "t0 t1 t2 t3 "
    # Each chunk arrived when the replica sent it, not all at the end.
    assert arrivals[-1] - arrivals[0] > 0.6
    assert all(b - a > 0.15 for a, b in zip(arrivals, arrivals[1:], strict=False))


def test_a_replica_dying_mid_stream_ends_the_stream_with_an_error_event(start_router, wait_until,
                                                                        start_fake):
    replica = start_fake("D")
    router = start_router([replica.url], health_interval=1.0)
    events: list[str] = []
    start = time.perf_counter()
    body = {"model": "fake", "messages": [], "max_tokens": 100, "stream": True, "delay": 0.1}
    with httpx.stream("POST", router.url + "/v1/chat/completions", json=body,
                      timeout=30) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data:"):
                events.append(line[5:].strip())
                if len(events) == 2:
                    replica.kill()
    assert time.perf_counter() - start < 10
    assert json.loads(events[0])["replica"] == "D"
    error = json.loads(events[-1])["error"]
    assert error["type"] == "upstream_error" and "mid-stream" in error["message"]
    wait_until(lambda: router.metric("ember:router_upstream_errors_total",
                                     replica=replica.url, phase="mid_stream") == 1, 5,
               "the failure to be counted")
    assert router.router.replicas.get(replica.url).in_flight == 0
    # The openai client raises on the error event instead of waiting forever.
    replica.start()
    wait_until(lambda: router.replica_state(replica.url) == "healthy", 15, "re-admission")
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="k", max_retries=0)
    stream = client.chat.completions.create(
        model="fake", messages=[], max_tokens=100, stream=True, extra_body={"delay": 0.1})
    with pytest.raises(openai.APIError, match="mid-stream"):
        for i, _ in enumerate(stream):
            if i == 1:
                replica.kill()


def test_the_router_adds_no_server_or_date_header_of_its_own(fake_replicas, start_router, http):
    router = start_router([fake_replicas[0].url])
    response = http.get(router.url + "/v1/models")
    assert response.headers.get_list("server") == ["uvicorn"]
    assert len(response.headers.get_list("date")) == 1


def test_only_role_chunks_and_comments_count_as_preamble():
    def event(chunk: dict) -> bytes:
        return b"data: " + json.dumps(chunk).encode()

    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                         "finish_reason": None}]}
    assert _is_preamble(event(role)) and _is_preamble(b": keep-alive")
    token = {"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}]}
    done = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    tool = {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0}]},
                         "finish_reason": None}]}
    for chunk in (token, done, tool, {"choices": [], "usage": {"prompt_tokens": 3}},
                  {"error": {"message": "x"}}):
        assert not _is_preamble(event(chunk)), chunk
    assert not _is_preamble(b"data: [DONE]")


def test_a_replica_dying_after_its_role_chunk_is_retried_invisibly(fake_replicas, start_router):
    urls = [r.url for r in fake_replicas]
    router = start_router(urls, health_interval=60.0)
    session = next(f"s-{i}" for i in range(1000) if owner(f"s-{i}", urls) == urls[0])
    body = {"model": "fake", "messages": [], "max_tokens": 3, "stream": True,
            "preamble": True, "crash_on": "A"}
    response = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=30,
                          headers={"x-session-affinity": session})
    assert response.status_code == 200 and response.headers["x-ember-replica"] != urls[0]
    events = [line[5:].strip() for line in response.text.splitlines()
              if line.startswith("data:")]
    chunks = [json.loads(e) for e in events[:-1]]
    # One role chunk (the retry's), then every token, all from the replica that finished.
    assert [c["choices"][0]["delta"].get("role") for c in chunks] == ["assistant"] + [None] * 3
    assert {c["replica"] for c in chunks} == {response.headers["x-replica-name"]} != {"A"}
    assert events[-1] == "[DONE]"
    assert router.metric("ember:router_retries_total", replica=urls[0]) == 1


def test_a_hung_replica_has_its_streams_ended_when_it_is_ejected(start_router, start_fake):
    replica = start_fake("H")
    router = start_router([replica.url], health_interval=0.2, health_timeout=0.5,
                          eject_after=2)
    body = {"model": "fake", "messages": [], "max_tokens": 100, "stream": True, "delay": 0.1}
    events: list[str] = []
    start = time.perf_counter()
    try:
        with httpx.stream("POST", router.url + "/v1/chat/completions", json=body,
                          timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data:"):
                    events.append(line[5:].strip())
                    if len(events) == 2:  # it hangs with its connections open
                        os.kill(replica.process.pid, signal.SIGSTOP)
    finally:
        os.kill(replica.process.pid, signal.SIGCONT)
    # Ended by the ejection (two checks timing out), not by the 600 s read timeout.
    assert time.perf_counter() - start < 10
    assert router.replica_state(replica.url) == "ejected"
    error = json.loads(events[-1])["error"]
    assert "ejected" in error["message"] and "ReadTimeout" in error["message"]
