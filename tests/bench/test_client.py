import asyncio
import json

import httpx
import pytest

from ember.bench.client import ChatClient, list_models
from ember.bench.config import Endpoint

ENDPOINT = Endpoint("stub", "http://stub:1")


def sse(*chunks):
    text = "".join(f"data: {c if isinstance(c, str) else json.dumps(c)}\n\n" for c in chunks)
    return text.encode()


def delta(text, finish=None):
    return {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}


def chat(handler, **kwargs):
    async def go():
        client = ChatClient(ENDPOINT, "m", "key", 5.0, 4, transport=httpx.MockTransport(handler))
        try:
            return await client.chat([{"role": "user", "content": "hi"}], 8, 0.0, **kwargs)
        finally:
            await client.aclose()
    return asyncio.run(go())


def test_stream_is_timed_per_chunk_and_usage_and_headers_are_kept():
    seen = {}

    async def body():
        yield sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        for word in ("Hello", " there"):
            await asyncio.sleep(0.05)
            yield sse(delta(word))
        yield sse(delta("", "length"),
                  {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2,
                                            "prompt_tokens_details": {"cached_tokens": 4}}},
                  "[DONE]")

    def handler(request):
        seen["body"] = json.loads(request.content)
        seen["headers"] = request.headers
        return httpx.Response(200, content=body(),
                              headers={"x-session-affinity": request.headers["x-session-affinity"]})

    result = chat(handler, affinity="sess-1", ignore_eos=True)
    assert result.ok and result.status == 200
    assert result.text == "Hello there" and result.finish_reason == "length"
    assert len(result.chunk_times) == 2  # the role-only chunk carries no output
    assert result.chunk_times[0] - result.start >= 0.05
    assert result.chunk_times[1] - result.chunk_times[0] >= 0.04
    assert result.end >= result.chunk_times[1]
    assert result.usage["prompt_tokens_details"]["cached_tokens"] == 4
    assert result.affinity_echo == "sess-1"
    assert seen["body"]["stream"] is True and seen["body"]["stream_options"] == {
        "include_usage": True}
    assert seen["body"]["ignore_eos"] is True and seen["body"]["max_tokens"] == 8
    assert seen["headers"]["authorization"] == "Bearer key"
    assert seen["body"]["model"] == "m"


def test_error_status_keeps_the_openai_message():
    def handler(request):
        return httpx.Response(429, json={"error": {"message": "busy", "type": "rate_limit"}})

    result = chat(handler)
    assert not result.ok and result.status == 429 and result.error == "busy"
    assert result.chunk_times == [] and result.usage is None


def test_errors_inside_the_stream_and_transport_failures():
    def mid_stream(request):
        return httpx.Response(200, content=sse(delta("a"), {"error": {"message": "oom"}}))

    result = chat(mid_stream)
    assert result.error == "oom" and result.status == 200 and len(result.chunk_times) == 1

    def refused(request):
        raise httpx.ConnectError("refused")

    result = chat(refused)
    assert result.status is None and result.error.startswith("ConnectError")


def test_stream_without_usage_leaves_usage_empty():
    result = chat(lambda r: httpx.Response(200, content=sse(delta("x"), delta("y"), "[DONE]")))
    assert result.ok and result.usage is None and result.text == "xy"


def test_list_models():
    def handler(request):
        assert request.url.path == "/v1/models"
        return httpx.Response(200, json={"data": [{"id": "a", "max_model_len": 64}]})

    cards = asyncio.run(list_models(ENDPOINT, None, transport=httpx.MockTransport(handler)))
    assert cards == [{"id": "a", "max_model_len": 64}]
    with pytest.raises(httpx.HTTPStatusError):
        asyncio.run(list_models(ENDPOINT, None, transport=httpx.MockTransport(
            lambda r: httpx.Response(404))))
