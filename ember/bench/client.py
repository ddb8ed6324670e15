"""An async streaming chat client that times every chunk as it arrives."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from ember.bench.config import Endpoint

AFFINITY_HEADER = "x-session-affinity"


@dataclass
class RequestResult:
    """One request as the client saw it; times are time.perf_counter() values."""

    start: float
    end: float = 0.0
    status: int | None = None
    error: str | None = None
    chunk_times: list[float] = field(default_factory=list)  # chunks that carried output
    text: str = ""
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None
    affinity_echo: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class ChatClient:
    """POSTs streaming chat completions with `stream_options.include_usage` to one endpoint."""

    def __init__(self, endpoint: Endpoint, model: str, api_key: str | None, timeout: float,
                 max_connections: int, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.endpoint = endpoint
        self.model = model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(
            base_url=endpoint.api_url, headers=headers, transport=transport,
            timeout=httpx.Timeout(timeout, connect=min(timeout, 30.0)),
            limits=httpx.Limits(max_connections=max_connections,
                                max_keepalive_connections=max_connections),
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def chat(self, messages: list[dict[str, str]], max_tokens: int, temperature: float,
                   ignore_eos: bool = False, affinity: str | None = None) -> RequestResult:
        body: dict[str, Any] = {
            "model": self.model, "messages": messages, "max_tokens": max_tokens,
            "temperature": temperature, "stream": True,
            "stream_options": {"include_usage": True},
        }
        if ignore_eos:
            body["ignore_eos"] = True
        headers = {AFFINITY_HEADER: affinity} if affinity else {}
        result = RequestResult(start=time.perf_counter())
        try:
            async with self._http.stream("POST", "/chat/completions", json=body,
                                         headers=headers) as response:
                result.status = response.status_code
                result.affinity_echo = response.headers.get(AFFINITY_HEADER)
                if response.status_code != 200:
                    result.error = _error_message(await response.aread())
                else:
                    await _read_stream(response, result)
        except httpx.HTTPError as exc:
            result.error = f"{type(exc).__name__}: {exc}"
        result.end = time.perf_counter()
        return result


async def _read_stream(response: httpx.Response, result: RequestResult) -> None:
    """Server-sent events: `data: {chunk}` lines up to `data: [DONE]`."""
    pieces: list[str] = []
    async for line in response.aiter_lines():
        now = time.perf_counter()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError:
            result.error = f"malformed stream chunk: {data[:200]}"
            return
        if "error" in chunk:
            result.error = _error_message(data.encode())
            return
        if chunk.get("usage"):
            result.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            text = (delta.get("content") or delta.get("reasoning_content")
                    or delta.get("reasoning") or "")
            if text or delta.get("tool_calls"):
                pieces.append(text)
                result.chunk_times.append(now)
            if choice.get("finish_reason"):
                result.finish_reason = choice["finish_reason"]
    result.text = "".join(pieces)


def _error_message(body: bytes) -> str:
    """The message of an OpenAI-style error body, or the start of whatever came back."""
    try:
        error = json.loads(body).get("error")
    except (json.JSONDecodeError, AttributeError):
        error = None
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])[:500]
    if isinstance(error, str):
        return error[:500]
    return body.decode(errors="replace")[:500] or "empty error body"


async def list_models(endpoint: Endpoint, api_key: str | None, timeout: float = 30.0,
                      transport: httpx.AsyncBaseTransport | None = None) -> list[dict[str, Any]]:
    """GET /v1/models: the model cards (vLLM's carry max_model_len)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=endpoint.api_url, headers=headers, timeout=timeout,
                                 transport=transport) as http:
        response = await http.get("/models")
        response.raise_for_status()
        return list(response.json().get("data") or [])
