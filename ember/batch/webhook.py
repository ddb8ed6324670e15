"""Job callbacks: POST an event to the job's webhook URL when it finishes, with retries.

The event has OpenAI's webhook shape (`{"object": "event", "type": "batch.completed",
"data": {"id": ...}}`). Any answer but 2xx, and any connection error, is retried after
backoff, backoff * 2, backoff * 4 ... up to the configured number of attempts. With a secret
configured, each call is signed as Standard Webhooks specify (webhook-id, webhook-timestamp,
webhook-signature: v1,base64(HMAC-SHA256(secret, "id.timestamp.body"))). Deliveries live in
this process: a restart mid-retry drops them.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import logging
import time
import uuid
from typing import Any

import httpx

from ember.batch.config import BatchConfig
from ember.batch.store import JobRecord

logger = logging.getLogger(__name__)


def job_event(job: JobRecord) -> dict[str, Any]:
    return {"id": f"evt_{uuid.uuid4().hex}", "object": "event",
            "type": f"batch.{job.status}", "created_at": int(time.time()),
            "data": {"id": job.id, "object": "batch" if job.kind == "batch"
                     else "queued_request"}}


def sign(secret: str, event_id: str, timestamp: int, body: bytes) -> str:
    """A Standard Webhooks signature; a `whsec_` secret is base64 after the prefix."""
    key = (base64.b64decode(secret.removeprefix("whsec_")) if secret.startswith("whsec_")
           else secret.encode())
    digest = hmac.new(key, f"{event_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


class Webhooks:
    def __init__(self, config: BatchConfig) -> None:
        self.config = config
        self._client = httpx.AsyncClient(timeout=config.webhook_timeout_s)
        self._tasks: set[asyncio.Task[bool]] = set()

    def notify(self, job: JobRecord) -> None:
        """Deliver the job's finish event in the background, if it has a webhook."""
        if job.webhook_url is None:
            return
        task = asyncio.create_task(self.deliver(job.webhook_url, job_event(job)))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def deliver(self, url: str, event: dict[str, Any]) -> bool:
        """POST the event until it is accepted (True) or the attempts run out (False)."""
        body = json.dumps(event).encode()
        delay = self.config.webhook_backoff_s
        for attempt in range(1, self.config.webhook_attempts + 1):
            timestamp = int(time.time())
            headers = {"content-type": "application/json", "webhook-id": event["id"],
                       "webhook-timestamp": str(timestamp)}
            if self.config.webhook_secret:
                headers["webhook-signature"] = sign(self.config.webhook_secret, event["id"],
                                                    timestamp, body)
            try:
                response = await self._client.post(url, content=body, headers=headers)
                if response.is_success:
                    return True
                reason = f"HTTP {response.status_code}"
            except httpx.HTTPError as exc:
                reason = f"{type(exc).__name__}: {exc}"
            logger.warning("webhook %s for %s: attempt %d/%d failed (%s)", url,
                           event["data"]["id"], attempt, self.config.webhook_attempts, reason)
            if attempt < self.config.webhook_attempts:
                await asyncio.sleep(delay)
                delay *= 2
        return False

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._client.aclose()
