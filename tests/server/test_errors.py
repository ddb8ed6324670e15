"""Bad requests get the right 4xx and an OpenAI error body; the server stays healthy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx
import pytest

MODEL = "tiny-llama"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]


@dataclass
class Bad:
    name: str
    path: str
    body: Any  # a dict is sent as JSON, bytes as they are
    status: int
    param: str | None = None
    code: str | None = None
    method: str = "POST"
    headers: dict[str, str] | None = None


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": MSGS, **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hi", **fields}


CASES = [
    Bad("malformed JSON", CHAT, b'{"model": "tiny-llama", "messages": [', 400),
    Bad("body is not an object", CHAT, b"[1, 2, 3]", 400),
    Bad("model missing", CHAT, {"messages": MSGS}, 400, "model"),
    Bad("unknown model", CHAT, chat(model="gpt-9"), 404, "model", "model_not_found"),
    Bad("unknown model (completions)", COMPLETIONS, completion(model="x"), 404, "model",
        "model_not_found"),
    Bad("messages missing", CHAT, {"model": MODEL}, 400, "messages"),
    Bad("messages empty", CHAT, chat(messages=[]), 400, "messages"),
    Bad("unknown role", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400,
        "messages[0].role"),
    Bad("user message without content", CHAT, chat(messages=[{"role": "user"}]), 400,
        "messages[0]"),
    Bad("image content part", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]), 400,
        "messages[0].content"),
    Bad("temperature of the wrong type", CHAT, chat(temperature="hot"), 400, "temperature"),
    Bad("temperature out of range", CHAT, chat(temperature=3.5), 400, "temperature"),
    Bad("top_p zero", CHAT, chat(top_p=0), 400, "top_p"),
    Bad("n zero", CHAT, chat(n=0), 400, "n"),
    Bad("n as a string", COMPLETIONS, completion(n="2"), 400, "n"),
    Bad("max_tokens zero", COMPLETIONS, completion(max_tokens=0), 400, "max_tokens"),
    Bad("max_completion_tokens negative", CHAT, chat(max_completion_tokens=-5), 400,
        "max_completion_tokens"),
    Bad("stop of the wrong type", CHAT, chat(stop=5), 400, "stop"),
    Bad("empty stop string", COMPLETIONS, completion(stop=[""]), 400, "stop"),
    Bad("top_logprobs too large", CHAT, chat(logprobs=True, top_logprobs=50), 400,
        "top_logprobs"),
    Bad("top_logprobs without logprobs", CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    Bad("logprobs too large (completions)", COMPLETIONS, completion(logprobs=50), 400,
        "logprobs"),
    Bad("presence_penalty out of range", CHAT, chat(presence_penalty=5), 400,
        "presence_penalty"),
    Bad("seed not an integer", CHAT, chat(seed="abc"), 400, "seed"),
    Bad("stream not a boolean", CHAT, chat(stream="yes"), 400, "stream"),
    Bad("stream_options without stream", CHAT, chat(stream_options={"include_usage": True}),
        400, "stream_options"),
    Bad("min_p out of range", COMPLETIONS, completion(min_p=2), 400, "min_p"),
    Bad("top_k below -1", COMPLETIONS, completion(top_k=-5), 400, "top_k"),
    Bad("repetition_penalty zero", COMPLETIONS, completion(repetition_penalty=0), 400,
        "repetition_penalty"),
    Bad("logit_bias unsupported", CHAT, chat(logit_bias={"50256": -100}), 400, "logit_bias"),
    Bad("unknown lane", CHAT, chat(lane="urgent"), 400, "lane"),
    Bad("unknown lane header", CHAT, chat(), 400, "lane", headers={"x-ember-lane": "urgent"}),
    Bad("prompt longer than the context", COMPLETIONS, completion(prompt="word " * 600), 400,
        "prompt", "context_length_exceeded"),
    Bad("chat longer than the context", CHAT,
        chat(messages=[{"role": "user", "content": "word " * 600}]), 400, "messages",
        "context_length_exceeded"),
    Bad("max_tokens beyond the context", COMPLETIONS, completion(max_tokens=100_000), 400,
        "max_tokens", "context_length_exceeded"),
    Bad("token id outside the vocabulary", COMPLETIONS, completion(prompt=[1, 2, 10**7]), 400,
        "prompt"),
    Bad("empty prompt list", COMPLETIONS, completion(prompt=[]), 400, "prompt"),
    Bad("empty prompt text", COMPLETIONS, completion(prompt=""), 400, "prompt"),
    Bad("suffix unsupported", COMPLETIONS, completion(suffix="x"), 400, "suffix"),
    Bad("oversized body", COMPLETIONS, completion(prompt="x" * 70_000), 413,
        code="request_too_large"),
    Bad("session id too long", CHAT, chat(), 400, "x-session-affinity",
        headers={"x-session-affinity": "s" * 300}),
    Bad("unknown route", "/v1/nothing-here", chat(), 404),
    Bad("wrong method", CHAT, None, 405, method="GET"),
    Bad("unknown model on /v1/models", f"/v1/models/{'gpt-9'}", None, 404, "model",
        "model_not_found", method="GET"),
]


@pytest.fixture(scope="module")
def http(tiny_server) -> httpx.Client:
    with httpx.Client(base_url=tiny_server.url, timeout=30) as client:
        yield client


def test_table_has_enough_cases() -> None:
    assert len(CASES) >= 20 and len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_gets_an_openai_error(http: httpx.Client, case: Bad) -> None:
    if isinstance(case.body, bytes):
        resp = http.request(case.method, case.path, content=case.body,
                            headers={"content-type": "application/json", **(case.headers or {})})
    else:
        resp = http.request(case.method, case.path, json=case.body, headers=case.headers)
    assert resp.status_code == case.status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == "invalid_request_error" or case.status != 400
    if case.param is not None:
        assert error["param"] == case.param, error
    if case.code is not None:
        assert error["code"] == case.code, error


def test_server_is_healthy_after_the_bad_inputs(http: httpx.Client) -> None:
    assert http.get("/health").json()["status"] == "ok"
    resp = http.post(COMPLETIONS, json=completion(max_tokens=2))
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] <= 2
    metrics = http.get("/metrics").text
    assert 'ember:requests_rejected_total{model_name="tiny-llama",status="400"}' in metrics
