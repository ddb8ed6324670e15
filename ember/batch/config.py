"""BatchConfig: the asynchronous batch lane's settings (store, discount, leases, limits)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ember import envs


def default_store_url() -> str:
    """Where jobs live unless --batch-store says otherwise: one SQLite file beside the ledger."""
    return f"sqlite:///{envs.cache_dir() / 'batch.sqlite'}"


@dataclass
class BatchConfig:
    store_url: str | None = None  # sqlite:///path or redis://host:port/db; None: the default
    discount: float = 0.5  # fraction off the price of batch-lane tokens
    max_inflight: int = 32  # batch items this replica runs at once
    lease_s: float = 60.0  # a claimed item returns to the queue if its worker is silent this long
    poll_interval_s: float = 0.5  # how often an idle worker looks for work and sweeps jobs
    max_attempts: int = 5  # claims of one item before it fails for good
    max_file_bytes: int = 200 * 1024 * 1024
    max_requests: int = 50_000  # lines of a batch file, requests of a queued request
    webhook_attempts: int = 5
    webhook_backoff_s: float = 1.0  # first retry delay; it doubles each time
    webhook_timeout_s: float = 10.0
    webhook_secret: str | None = None  # set: callbacks carry Standard Webhooks signatures

    def __post_init__(self) -> None:
        if self.store_url is not None and not self.store_url.startswith(
                ("sqlite:///", "redis://", "rediss://")):
            raise ValueError("store_url: must be sqlite:///PATH or redis://HOST:PORT/DB, got "
                             f"{self.store_url!r}")
        if not 0.0 <= self.discount <= 1.0:
            raise ValueError(f"discount: must be in [0, 1], got {self.discount}")
        if self.max_inflight < 1:
            raise ValueError(f"max_inflight: must be >= 1, got {self.max_inflight}")
        if self.lease_s <= 0:
            raise ValueError(f"lease_s: must be > 0, got {self.lease_s}")
        if self.poll_interval_s <= 0:
            raise ValueError(f"poll_interval_s: must be > 0, got {self.poll_interval_s}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts: must be >= 1, got {self.max_attempts}")
        if self.max_file_bytes < 1:
            raise ValueError(f"max_file_bytes: must be >= 1, got {self.max_file_bytes}")
        if self.max_requests < 1:
            raise ValueError(f"max_requests: must be >= 1, got {self.max_requests}")
        if self.webhook_attempts < 1:
            raise ValueError(f"webhook_attempts: must be >= 1, got {self.webhook_attempts}")
        if self.webhook_backoff_s < 0:
            raise ValueError(f"webhook_backoff_s: must be >= 0, got {self.webhook_backoff_s}")
        if self.webhook_timeout_s <= 0:
            raise ValueError(f"webhook_timeout_s: must be > 0, got {self.webhook_timeout_s}")
        if self.webhook_secret is not None and not self.webhook_secret:
            raise ValueError("webhook_secret: must not be empty")

    @property
    def store(self) -> str:
        return self.store_url or default_store_url()

    @property
    def sqlite_path(self) -> Path | None:
        """The SQLite file the store URL names, None for Redis."""
        url = self.store
        return Path(url.removeprefix("sqlite:///")) if url.startswith("sqlite:///") else None
