"""HTTP passthrough to one replica: headers, status and body bytes go through unchanged.

`send` returns only once the replica has produced its first body bytes, and for an event
stream its first event with output: the role-only chunk an OpenAI server sends as soon as it
accepts a request is held back with it. So everything that can go wrong before the client sees
a byte (no connection, a reset, a 502 from a dying server, a replica dying in the queue or in
prefill) is still the router's to handle, by a retry elsewhere. After that, `RelayResponse`
copies raw chunks as they arrive; when the replica dies mid-stream, a server-sent-event stream
ends with an OpenAI-style error event, any other body is cut off (the client sees a broken
response, never a hang).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import anyio
import httpx
from starlette.responses import JSONResponse, StreamingResponse
from starlette.types import Receive, Scope, Send

# RFC 9110 section 7.6.1, plus what httpx and the router's own server set themselves.
HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
    b"trailer", b"transfer-encoding", b"upgrade", b"proxy-connection", b"host",
})
RawHeaders = list[tuple[bytes, bytes]]
PREAMBLE_LIMIT = 65536  # bytes of an event stream held back at most, waiting for output


class UpstreamError(Exception):
    """The replica failed before its first body byte. `sent` is False only when the request
    surely never reached it (the connection was refused or never established)."""

    def __init__(self, message: str, sent: bool) -> None:
        super().__init__(message)
        self.sent = sent


class MidStreamError(Exception):
    """The replica broke off a body the client had started to receive."""


def _drop_hop_by_hop(raw: RawHeaders, also: frozenset[bytes]) -> RawHeaders:
    named = {token.strip().lower() for key, value in raw if key.lower() == b"connection"
             for token in value.split(b",")}
    return [(k, v) for k, v in raw
            if (key := k.lower()) not in HOP_BY_HOP and key not in also and key not in named]


def request_headers(raw: RawHeaders) -> RawHeaders:
    """Client headers to forward; httpx sets content-length from the body it sends."""
    return _drop_hop_by_hop(raw, frozenset({b"content-length"}))


def response_headers(raw: RawHeaders) -> RawHeaders:
    """Replica headers to return. content-length stays: raw bytes pass through unchanged."""
    return _drop_hop_by_hop(raw, frozenset())


@dataclass
class Upstream:
    """An open response from a replica whose first body bytes have arrived."""

    response: httpx.Response
    chunks: AsyncIterator[bytes]
    first: bytes

    @property
    def status_code(self) -> int:
        return self.response.status_code

    async def body(self) -> AsyncIterator[bytes]:
        if self.first:
            yield self.first
        async for chunk in self.chunks:
            yield chunk

    async def aclose(self) -> None:
        await self.response.aclose()


async def send(client: httpx.AsyncClient, url: str, method: str, headers: RawHeaders,
               body: bytes) -> Upstream:
    request = client.build_request(method, url, headers=headers, content=body)
    try:
        response = await client.send(request, stream=True)
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
        raise UpstreamError(f"{type(exc).__name__}: {exc}", sent=False) from exc
    except httpx.HTTPError as exc:
        raise UpstreamError(f"{type(exc).__name__}: {exc}", sent=True) from exc
    chunks = response.aiter_raw()
    try:
        first = await anext(chunks, b"")
        if _is_plain_event_stream(response.headers):
            first = await _read_preamble(first, chunks)
    except httpx.HTTPError as exc:
        await response.aclose()
        raise UpstreamError(f"{type(exc).__name__} before the first output: {exc}",
                            sent=True) from exc
    return Upstream(response, chunks, first)


def _is_plain_event_stream(headers: httpx.Headers) -> bool:
    return (headers.get("content-type", "").startswith("text/event-stream")
            and "content-encoding" not in headers)


async def _read_preamble(buffered: bytes, chunks: AsyncIterator[bytes]) -> bytes:
    """Read on while every complete event so far is preamble (at most PREAMBLE_LIMIT bytes)."""
    while len(buffered) < PREAMBLE_LIMIT:
        complete = buffered.replace(b"\r\n", b"\n").split(b"\n\n")[:-1]
        if complete and not all(_is_preamble(event) for event in complete):
            break
        chunk = await anext(chunks, None)
        if chunk is None:
            break
        buffered += chunk
    return buffered


def _is_preamble(event: bytes) -> bool:
    """An event with no output in it: a comment, or a chunk whose choices only name the role."""
    data = [line[5:].strip() for line in event.splitlines() if line.startswith(b"data:")]
    if not data:
        return True
    try:
        chunk = json.loads(b"\n".join(data))
    except ValueError:
        return False
    if not isinstance(chunk, dict) or chunk.get("usage") or "error" in chunk:
        return False
    choices = chunk.get("choices")
    if not isinstance(choices, list) or not choices:
        return False
    for choice in choices:
        delta = choice.get("delta") if isinstance(choice, dict) else None
        if not isinstance(delta, dict) or choice.get("finish_reason") is not None:
            return False
        if any(value for key, value in delta.items() if key != "role"):
            return False
    return True


def error_body(message: str, status: int, kind: str = "upstream_error") -> dict[str, object]:
    return {"error": {"message": message, "type": kind, "code": status}}


def error_response(message: str, status: int, kind: str = "upstream_error") -> JSONResponse:
    return JSONResponse(error_body(message, status, kind), status_code=status)


def sse_error_event(message: str) -> bytes:
    return b"data: " + json.dumps(error_body(message, 502)).encode() + b"\n\n"


class ReplicaAborted(Exception):
    """abort() ended the stream."""


class RelayResponse(StreamingResponse):
    """Streams an Upstream to the client and calls on_finish exactly once however the
    response ends, with the replica's error or None (finished, or the client went away).
    abort() ends it early with an error, for a replica that hangs without closing its
    connections."""

    def __init__(self, upstream: Upstream, headers: RawHeaders,
                 on_first_byte: Callable[[], None],
                 on_finish: Callable[[str | None], None]) -> None:
        super().__init__(self._relay(), status_code=upstream.status_code)
        self.raw_headers = headers
        self.upstream = upstream
        self.on_first_byte = on_first_byte
        self.on_finish = on_finish
        self.error: str | None = None
        self._reading: anyio.CancelScope | None = None
        names = {k.lower() for k, _ in headers}
        content_type = upstream.response.headers.get("content-type", "")
        # An error event can be appended only to a plain event stream of unknown length.
        self.event_stream = (content_type.startswith("text/event-stream")
                             and b"content-length" not in names
                             and b"content-encoding" not in names)

    def abort(self, reason: str) -> None:
        if self.error is None:
            self.error = reason
        if self._reading is not None:
            self._reading.cancel()

    async def _next(self, chunks: AsyncIterator[bytes]) -> bytes | None:
        """The next chunk from the replica, None at the end; abort() cancels the wait."""
        with anyio.CancelScope() as scope:
            self._reading = scope
            if self.error is not None:
                scope.cancel()
            chunk = await anext(chunks, None)
        self._reading = None
        if scope.cancelled_caught:
            raise ReplicaAborted(self.error)
        return chunk

    async def _relay(self) -> AsyncIterator[bytes]:
        tail = b"\n\n"
        first = True
        chunks = self.upstream.body()
        try:
            while (chunk := await self._next(chunks)) is not None:
                yield chunk
                if first:
                    self.on_first_byte()
                    first = False
                tail = (tail + chunk)[-2:]
        except (httpx.HTTPError, ReplicaAborted) as exc:
            if isinstance(exc, httpx.HTTPError):
                self.error = f"replica failed mid-stream: {type(exc).__name__}: {exc}"
            if not self.event_stream:
                raise MidStreamError(self.error) from exc
            yield (b"" if tail == b"\n\n" else b"\n\n") + sse_error_event(str(self.error))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_finish(self.error)
            with anyio.CancelScope(shield=True):
                await self.upstream.aclose()
