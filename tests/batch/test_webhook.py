"""Job callbacks against a real local HTTP server: retries with backoff, signatures."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json

from ember.batch.config import BatchConfig
from ember.batch.store import JobRecord
from ember.batch.webhook import Webhooks, job_event


def done_job(url: str) -> JobRecord:
    return JobRecord(id="batch_1", kind="batch", endpoint="/v1/completions", model="m",
                     status="completed", created_at=0, expires_at=1, completion_window="1s",
                     total=1, webhook_url=url)


def test_retries_with_backoff_until_accepted(receiver) -> None:
    receiver.statuses = [500, 503]
    hooks = Webhooks(BatchConfig(webhook_attempts=4, webhook_backoff_s=0.2))

    async def go() -> bool:
        try:
            return await hooks.deliver(receiver.url, job_event(done_job(receiver.url)))
        finally:
            await hooks.close()

    assert asyncio.run(go())
    times = [t for t, _, _ in receiver.calls]
    assert len(times) == 3
    assert times[1] - times[0] >= 0.18 and times[2] - times[1] >= 0.38  # 0.2 s, then doubled
    event = json.loads(receiver.calls[-1][2])
    assert event["type"] == "batch.completed" and event["data"] == {"id": "batch_1",
                                                                    "object": "batch"}
    assert "webhook-signature" not in receiver.calls[0][1]


def test_gives_up_after_the_attempts_and_signs_each_call(receiver) -> None:
    receiver.statuses = [500, 500, 500]
    secret = "whsec_" + base64.b64encode(b"0123456789abcdef").decode()
    hooks = Webhooks(BatchConfig(webhook_attempts=2, webhook_backoff_s=0.01,
                                 webhook_secret=secret))

    async def go() -> bool:
        try:
            return await hooks.deliver(receiver.url, job_event(done_job(receiver.url)))
        finally:
            await hooks.close()

    assert not asyncio.run(go())
    assert len(receiver.calls) == 2
    _, headers, body = receiver.calls[0]
    signed = f"{headers['webhook-id']}.{headers['webhook-timestamp']}.".encode() + body
    expected = base64.b64encode(hmac.new(b"0123456789abcdef", signed, hashlib.sha256).digest())
    assert headers["webhook-signature"] == "v1," + expected.decode()


def test_unreachable_urls_are_retried_then_dropped() -> None:
    hooks = Webhooks(BatchConfig(webhook_attempts=2, webhook_backoff_s=0.01,
                                 webhook_timeout_s=2.0))

    async def go() -> bool:
        try:
            return await hooks.deliver("http://127.0.0.1:9/nothing-listens",
                                       job_event(done_job("x")))
        finally:
            await hooks.close()

    assert not asyncio.run(go())
