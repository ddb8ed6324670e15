"""Runs one batch item through the server's own chat / completions handling, in the batch lane.

The item's body goes to the same handler an HTTP request would reach (validation, chat
template, sampling parameters, usage, ledger), with `lane` forced to "batch" and streaming
off. The handler's answer becomes the item's result line; an error the client caused (4xx)
fails the item, an error of the server (5xx: the engine died, the server is stopping) leaves
it for another attempt.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.responses import Response

from ember.batch.store import Claim, Outcome
from ember.engine.async_engine import EngineDeadError
from ember.server.auth import ApiKey
from ember.server.errors import APIError
from ember.server.serving import RequestContext

logger = logging.getLogger(__name__)

Handler = Callable[[dict[str, Any], RequestContext], Awaitable[Response]]

# batch endpoint -> (the ledger's endpoint name, request id prefix)
ENDPOINT_NAMES = {"/v1/chat/completions": ("chat.completions", "chatcmpl"),
                  "/v1/completions": ("completions", "cmpl")}


class RetryLater(Exception):
    """The item could not run for a reason of the server's; it goes back to the queue."""


class ItemRunner:
    def __init__(self, handlers: dict[str, Handler]) -> None:
        self.handlers = handlers

    async def run(self, claim: Claim) -> Outcome:
        """The item's outcome; raises RetryLater for server-side failures."""
        handler = self.handlers.get(claim.endpoint)
        if handler is None:
            raise RetryLater(f"this replica serves no {claim.endpoint}")
        endpoint, prefix = ENDPOINT_NAMES[claim.endpoint]
        ctx = RequestContext(request_id=f"{prefix}-{uuid.uuid4().hex}", endpoint=endpoint,
                             key=ApiKey(claim.key_id), session_id=None, reject_if_busy=False,
                             lane_header="batch", client_request_id=None)
        body = {k: v for k, v in claim.body.items() if k not in ("stream", "stream_options")}
        body["lane"] = "batch"
        try:
            response = await handler(body, ctx)
        except APIError as err:
            if err.status >= 500 or err.status == 429:
                raise RetryLater(err.message) from None
            return Outcome(False, {"response": {"status_code": err.status,
                                                "request_id": ctx.request_id,
                                                "body": err.body()}, "error": None})
        except EngineDeadError as exc:
            raise RetryLater(str(exc)) from None
        payload = json.loads(bytes(response.body))
        usage = payload.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        return Outcome(True, {"response": {"status_code": response.status_code,
                                           "request_id": ctx.request_id, "body": payload},
                              "error": None},
                       input_tokens=usage.get("prompt_tokens", 0),
                       cached_tokens=details.get("cached_tokens", 0),
                       output_tokens=usage.get("completion_tokens", 0))
