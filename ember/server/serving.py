"""What every generation endpoint shares: admission, submission, accounting, SSE.

ServerState holds the server's parts (engine, tokenizer, keys, limits, prices, ledger,
metrics). A request goes: admit (auth, requests per minute) -> parse -> check model and load
(reject-if-busy) -> tokenize -> check context and tokens per minute -> submit -> stream or
collect, while a RequestTally counts its tokens and time and, exactly once at the end, bills
it to the ledger and the metrics.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse

from ember.core.request import Lane
from ember.core.sampling_params import SamplingParams
from ember.engine.async_engine import AsyncEngine, EngineDeadError
from ember.engine.outputs import RequestOutput
from ember.engine.tokenizer import Tokenizer
from ember.server.auth import ApiKey, ApiKeys, RateLimiter
from ember.server.billing import Ledger, LedgerEntry, PriceTable
from ember.server.config import ServerConfig
from ember.server.errors import (
    APIError,
    bad_request,
    engine_unavailable,
    from_validation_error,
    from_value_error,
    model_not_found,
    rate_limited,
)
from ember.server.metrics import ServerMetrics
from ember.server.protocol import GenerationRequest

logger = logging.getLogger(__name__)

SESSION_HEADER = "x-session-affinity"
REJECT_IF_BUSY_HEADER = "x-ember-reject-if-busy"
LANE_HEADER = "x-ember-lane"
REQUEST_ID_HEADER = "x-request-id"
MAX_HEADER_ID_LEN = 256

M = TypeVar("M", bound=BaseModel)


@dataclass
class RequestContext:
    """Who asks and how: what admission learned from the HTTP request."""

    request_id: str
    endpoint: str
    key: ApiKey
    session_id: str | None
    reject_if_busy: bool
    lane_header: str | None
    client_request_id: str | None
    arrival: float = field(default_factory=time.monotonic)
    created: int = field(default_factory=lambda: int(time.time()))

    def response_headers(self) -> dict[str, str]:
        headers = {REQUEST_ID_HEADER: self.client_request_id or self.request_id}
        if self.session_id is not None:
            headers[SESSION_HEADER] = self.session_id
        return headers


@dataclass
class ServerState:
    config: ServerConfig
    engine: AsyncEngine
    tokenizer: Tokenizer
    model_names: list[str]
    keys: ApiKeys
    limiter: RateLimiter
    prices: PriceTable
    ledger: Ledger
    metrics: ServerMetrics

    # ---- admission ----------------------------------------------------------------------

    def admit(self, request: Request, endpoint: str, prefix: str) -> RequestContext:
        """Authenticate and count the request against its key's requests per minute."""
        key = self.keys.authenticate(request.headers.get("authorization"))
        self.limiter.admit_request(key)
        headers = request.headers
        return RequestContext(
            request_id=f"{prefix}-{uuid.uuid4().hex}",
            endpoint=endpoint,
            key=key,
            session_id=_header_id(headers.get(SESSION_HEADER), SESSION_HEADER),
            reject_if_busy=headers.get(REJECT_IF_BUSY_HEADER, "").strip().lower()
            in ("1", "true", "yes"),
            lane_header=headers.get(LANE_HEADER),
            client_request_id=_header_id(headers.get(REQUEST_ID_HEADER), REQUEST_ID_HEADER),
        )

    async def read_json(self, request: Request) -> dict[str, Any]:
        """The body as a JSON object, refusing bodies over max_body_bytes (413)."""
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise _too_large(limit)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
        try:
            body = json.loads(b"".join(chunks))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise bad_request(f"We could not parse the JSON body of your request: {exc}") from None
        if not isinstance(body, dict):
            raise bad_request("The request body must be a JSON object")
        return body

    def check_model(self, model: str) -> None:
        if model not in self.model_names:
            raise model_not_found(model)

    def check_capacity(self, ctx: RequestContext, lane: Lane) -> None:
        """429 at once for a reject-if-busy request when the queue ahead of it is too deep."""
        if not self.engine.is_alive:
            raise engine_unavailable(self.engine.dead_reason or "the engine is not running")
        if not ctx.reject_if_busy:
            return
        ahead = tuple(x for x in Lane if x <= lane)  # batch work waits behind interactive
        depth = self.engine.num_unstarted(ahead)
        if depth >= self.config.max_queue_depth:
            raise rate_limited(f"The server is busy: {depth} requests are queued "
                               f"(limit {self.config.max_queue_depth})", 1.0, "server_busy")

    def check_context(self, num_prompt_tokens: int, max_tokens: int | None, param: str) -> None:
        limit = self.engine.max_model_len
        if num_prompt_tokens >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, your "
                f"{param} resulted in {num_prompt_tokens} tokens. Please reduce its length.",
                param, "context_length_exceeded")
        if max_tokens is not None and num_prompt_tokens + max_tokens > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the {param}, "
                f"{max_tokens} in the completion). Please reduce the length of the {param} or "
                "completion.", "max_tokens", "context_length_exceeded")

    # ---- running ------------------------------------------------------------------------

    def new_tally(self, ctx: RequestContext, model: str, lane: Lane, user: str | None
                  ) -> RequestTally:
        return RequestTally(self, ctx, model, lane, user)

    def submit(self, ctx: RequestContext, tally: RequestTally,
               prompts: list[tuple[list[int], str | None]], params: SamplingParams, lane: Lane,
               priority: int) -> Submission:
        """Start one engine request per prompt (all or none)."""
        self.limiter.admit_tokens(ctx.key, sum(len(ids) for ids, _ in prompts))
        submission = Submission(self.engine, tally)
        try:
            for i, (ids, text) in enumerate(prompts):
                rid = ctx.request_id if len(prompts) == 1 else f"{ctx.request_id}-{i}"
                submission.add(rid, self.engine.generate(rid, ids, params, text, lane, priority,
                                                         ctx.session_id))
                tally.prompt_tokens += len(ids)
        except ValueError as exc:
            submission.close()
            raise from_value_error(exc) from None
        except EngineDeadError as exc:
            submission.close()
            raise engine_unavailable(str(exc)) from None
        return submission

    def sse_response(self, ctx: RequestContext, events: AsyncIterator[str]) -> StreamingResponse:
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers={**ctx.response_headers(), "cache-control": "no-cache"})


def parse_body(model: type[M], body: dict[str, Any]) -> M:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def build_params(req: GenerationRequest, max_tokens: int | None, logprobs: int | None
                 ) -> SamplingParams:
    try:
        return req.sampling_params(max_tokens, logprobs)
    except ValueError as exc:
        raise from_value_error(exc) from None


class Submission:
    """The engine requests behind one API request. Iterate it for (prompt index, output);
    engine failures surface as APIError. close() aborts whatever has not finished, so call
    it in a finally."""

    def __init__(self, engine: AsyncEngine, tally: RequestTally) -> None:
        self.engine = engine
        self.tally = tally
        self._request_ids: list[str] = []
        self._streams: list[AsyncIterator[RequestOutput]] = []
        self._tasks: list[asyncio.Task[None]] = []

    def add(self, request_id: str, stream: AsyncIterator[RequestOutput]) -> None:
        self._request_ids.append(request_id)
        self._streams.append(stream)

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for rid in self._request_ids:
            self.engine.abort(rid)

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of all prompts, interleaved as they arrive."""
        queue: asyncio.Queue[tuple[int, RequestOutput | Exception | None]] = asyncio.Queue()

        async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
            try:
                async for out in stream:
                    queue.put_nowait((i, out))
                queue.put_nowait((i, None))
            except Exception as exc:
                queue.put_nowait((i, exc))

        try:
            if len(self._streams) == 1:
                async for out in self._streams[0]:
                    self.tally.on_output(out)
                    yield 0, out
                return
            self._tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(self._streams)]
            remaining = len(self._streams)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    self.tally.on_output(item)
                    yield i, item
        except ValueError as exc:  # the engine core refused a request
            raise from_value_error(exc) from None
        except EngineDeadError as exc:
            raise engine_unavailable(str(exc)) from None


class RequestTally:
    """Tokens, timing and cost of one API request (one or several prompts, n choices each)."""

    def __init__(self, state: ServerState, ctx: RequestContext, model: str, lane: Lane,
                 user: str | None) -> None:
        self.state = state
        self.ctx = ctx
        self.model = model
        self.lane = lane
        self.user = user
        self.prompt_tokens = 0
        self._latest: dict[str, RequestOutput] = {}
        self._first_token: float | None = None
        self._last_output: float | None = None
        self._gaps: list[float] = []
        self._done = False

    def on_output(self, out: RequestOutput) -> None:
        now = time.monotonic()
        self._latest[out.request_id] = out
        if not any(c.delta_token_ids for c in out.outputs):
            return
        if self._first_token is None:
            self._first_token = now
        elif self._last_output is not None:
            self._gaps.append(now - self._last_output)
        self._last_output = now

    @property
    def cached_tokens(self) -> int:
        return sum(out.num_cached_tokens for out in self._latest.values())

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for out in self._latest.values() for c in out.outputs)

    def usage(self) -> dict[str, Any]:
        completion = self.completion_tokens
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    def finish(self, status: str) -> None:
        """Bill the request (ledger, metrics, tokens per minute) once, however it ended."""
        if self._done:
            return
        self._done = True
        state, ctx = self.state, self.ctx
        cached, completion = self.cached_tokens, self.completion_tokens
        billed, saved = state.prices.for_model(self.model).cost(self.prompt_tokens, cached,
                                                                completion)
        if self.lane == Lane.BATCH:  # batch-lane tokens are sold at a discount
            keep = 1.0 - state.config.batch.discount
            billed, saved = billed * keep, saved * keep
        reasons = [c.finish_reason or "abort" for out in self._latest.values()
                   for c in out.outputs]
        state.metrics.observe_finished(
            ttft_s=None if self._first_token is None else self._first_token - ctx.arrival,
            e2e_s=time.monotonic() - ctx.arrival, itl_s=self._gaps,
            prompt_tokens=self.prompt_tokens, cached_tokens=cached,
            completion_tokens=completion, finish_reasons=reasons, billed_usd=billed,
            saved_usd=saved)
        state.limiter.record_tokens(ctx.key, completion)
        try:
            state.ledger.record(LedgerEntry(
                request_id=ctx.request_id, model=self.model, endpoint=ctx.endpoint,
                lane=self.lane.name.lower(), status=status, prompt_tokens=self.prompt_tokens,
                cached_tokens=cached, completion_tokens=completion, cost_usd=billed,
                saved_usd=saved, key_id=ctx.key.key_id, session_id=ctx.session_id,
                user=self.user))
        except Exception:  # a full disk must not turn a served answer into an error
            logger.exception("ledger: could not record request %s", ctx.request_id)


def _header_id(value: str | None, name: str) -> str | None:
    if value is None:
        return None
    value = value.strip()
    if not value or len(value) > MAX_HEADER_ID_LEN or not value.isprintable():
        raise bad_request(f"{name} must be 1 to {MAX_HEADER_ID_LEN} printable characters", name)
    return value


def _too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than the limit of {limit} bytes",
                    "invalid_request_error", None, "request_too_large")


async def cancel_on_disconnect(request: Request, handler: Awaitable[Response]) -> Response:
    """Run a non-streaming handler, cancelling it (and so aborting its requests) if the
    client goes away first. Streaming responses notice disconnects by themselves."""
    work = asyncio.ensure_future(handler)
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
    if work.cancelled():
        return Response(status_code=499)
    return work.result()


async def _wait_disconnect(request: Request) -> None:
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except ClientDisconnect:
        return


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    """One token as text, for logprobs (special tokens included)."""
    return tokenizer.decode([token_id], skip_special_tokens=False)


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
