"""The durable store behind the batch lane: files, jobs, a queue of items with leases, results.

Two backends keep one contract (store_sqlite.py, store_redis.py), chosen by URL:

- `claim` hands out queued items of the given models under a lease of `lease_s` (the store's,
  so every replica sharing a store should use the same); an item whose lease ran out (its
  worker died or went silent) is handed out again.
- `renew` extends the leases a live worker still holds and names the ones it lost.
- `complete` writes an item's result only if the item has none yet: whatever races happen
  (a lease expired, two workers finished the same item, a job was expired meanwhile), each
  item gets exactly one result, and the job's counters count it exactly once.
- `release` puts an unfinished item back in the queue (a transient failure, a shutdown).
- `resolve_rest` gives every item still without a result the same failure (cancel, expiry).
- `transition` moves a job between statuses only from the expected ones (compare and set),
  so of several replicas sweeping the same jobs, one wins each step.

Calls are synchronous and short; async code runs them in a thread.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Protocol

from ember.batch.config import BatchConfig

JOB_KINDS = ("batch", "queue")
ACTIVE_STATUSES = ("in_progress", "finalizing", "cancelling")
TERMINAL_STATUSES = ("failed", "completed", "expired", "cancelled")


@dataclass
class FileRecord:
    id: str
    purpose: str
    filename: str
    bytes: int
    created_at: int
    key_id: str | None = None

    def to_api(self) -> dict[str, Any]:
        return {"id": self.id, "object": "file", "bytes": self.bytes,
                "created_at": self.created_at, "filename": self.filename,
                "purpose": self.purpose, "status": "processed", "expires_at": None,
                "status_details": None}


@dataclass
class ItemSpec:
    """One request of a job as submitted. `failure` set: it failed validation and never runs."""

    index: int
    custom_id: str | None
    body: dict[str, Any] | None
    external_reference: Any = None
    failure: dict[str, Any] | None = None  # the result line (less custom_id) of a bad line


@dataclass
class Claim:
    """An item handed to a worker (`owner`); `token` identifies this lease."""

    job_id: str
    index: int
    model: str
    owner: str
    token: str
    attempts: int
    endpoint: str
    key_id: str | None
    custom_id: str | None
    body: dict[str, Any]


@dataclass
class Outcome:
    """What running an item produced: its result line (less custom_id) and its usage."""

    ok: bool
    line: dict[str, Any]
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str | bytes) -> Outcome:
        return cls(**json.loads(text))


@dataclass
class ItemResult:
    index: int
    custom_id: str | None
    external_reference: Any
    outcome: Outcome


@dataclass
class JobRecord:
    """A batch (OpenAI Batch API) or a queued request; counters are maintained by the store."""

    id: str
    kind: str  # "batch" or "queue"
    endpoint: str
    model: str | None
    status: str
    created_at: int
    expires_at: int
    completion_window: str
    total: int
    key_id: str | None = None
    input_file_id: str | None = None
    metadata: dict[str, str] | None = None
    webhook_url: str | None = None
    errors: list[dict[str, Any]] = field(default_factory=list)
    in_progress_at: int | None = None
    started_at: int | None = None  # the first claim of one of its items
    finalizing_at: int | None = None
    final_status: str | None = None  # where finalizing leads
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    completed: int = 0
    failed: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0

    @property
    def resolved(self) -> int:
        return self.completed + self.failed

    def to_fields(self) -> dict[str, str]:
        """Flat string fields (a Redis hash, a JSON column); None fields are left out."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                out[f.name] = json.dumps(value)
        return out

    @classmethod
    def from_fields(cls, raw: dict[str, str] | dict[bytes, bytes]) -> JobRecord:
        values = {}
        for key, value in raw.items():
            name = key.decode() if isinstance(key, bytes) else key
            values[name] = json.loads(value)
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})


@dataclass
class JobPage:
    jobs: list[JobRecord]
    has_more: bool


class BatchStore(Protocol):
    def put_file(self, record: FileRecord, content: bytes) -> None: ...

    def get_file(self, file_id: str) -> FileRecord | None: ...

    def file_content(self, file_id: str) -> bytes | None: ...

    def list_files(self, key_id: str | None, after: str | None, limit: int
                   ) -> tuple[list[FileRecord], bool]: ...

    def delete_file(self, file_id: str) -> bool: ...

    def create_job(self, job: JobRecord, items: list[ItemSpec]) -> None:
        """Store the job and its items; items without `failure` are queued in list order."""

    def get_job(self, job_id: str) -> JobRecord | None: ...

    def list_jobs(self, kind: str, key_id: str | None, after: str | None, limit: int
                  ) -> JobPage:
        """Newest first; `after` is the id of the last job of the previous page."""

    def active_jobs(self) -> list[JobRecord]: ...

    def transition(self, job_id: str, expect: tuple[str, ...], status: str,
                   **updates: Any) -> JobRecord | None:
        """Set status (and fields) if the job's status is one of `expect`; None otherwise."""

    lease_s: float

    def claim(self, owner: str, models: list[str], n: int) -> list[Claim]: ...

    def renew(self, owner: str, claims: list[Claim]) -> list[Claim]:
        """Extend these leases; returns the claims whose lease this owner no longer holds."""

    def complete(self, claim: Claim, outcome: Outcome) -> bool:
        """Record the item's result unless it has one; True if this call wrote it."""

    def release(self, claim: Claim) -> None: ...

    def resolve_rest(self, job_id: str, outcome: Outcome) -> int:
        """Give every item of the job without a result this one; returns how many."""

    def results(self, job_id: str) -> list[ItemResult]:
        """Results so far, by item index."""

    def close(self) -> None: ...


def open_store(config: BatchConfig) -> BatchStore:
    """The store the URL names: sqlite:///PATH (relative; sqlite:////abs for an absolute
    path) or redis://HOST:PORT/DB."""
    url = config.store
    if url.startswith("sqlite:///"):
        from ember.batch.store_sqlite import SQLiteStore

        return SQLiteStore(config.sqlite_path, config.lease_s)
    from ember.batch.store_redis import RedisStore

    return RedisStore(url, config.lease_s)
