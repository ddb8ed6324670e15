"""ServerConfig: everything `ember serve` adds on top of the engine's configuration."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ember import envs
from ember.batch.config import BatchConfig

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def default_ledger_path() -> Path:
    """Where the billing ledger lives unless --ledger says otherwise."""
    return envs.cache_dir() / "ledger.sqlite"


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_names: list[str] = field(default_factory=list)  # empty: the checkpoint's name
    api_keys: list[str] = field(default_factory=list)
    api_keys_file: str | None = None
    rate_limit_rpm: int | None = None  # per API key, requests per minute
    rate_limit_tpm: int | None = None  # per API key, prompt + completion tokens per minute
    max_queue_depth: int = 64  # past it, `x-ember-reject-if-busy: true` requests get 429
    max_body_bytes: int = 16 * 1024 * 1024
    ledger_path: str | None = None  # None: default_ledger_path()
    price_file: str | None = None
    graceful_shutdown_timeout_s: float = 30.0
    log_level: str = "info"
    tool_call_parser: str | None = None  # None: chosen from the model type and template
    batch: BatchConfig = field(default_factory=BatchConfig)  # the asynchronous batch lane

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port: must be in [0, 65535], got {self.port}")
        if self.rate_limit_rpm is not None and self.rate_limit_rpm < 1:
            raise ValueError(f"rate_limit_rpm: must be >= 1, got {self.rate_limit_rpm}")
        if self.rate_limit_tpm is not None and self.rate_limit_tpm < 1:
            raise ValueError(f"rate_limit_tpm: must be >= 1, got {self.rate_limit_tpm}")
        if self.max_queue_depth < 0:
            raise ValueError(f"max_queue_depth: must be >= 0, got {self.max_queue_depth}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes: must be >= 1024, got {self.max_body_bytes}")
        if self.graceful_shutdown_timeout_s < 0:
            raise ValueError("graceful_shutdown_timeout_s: must be >= 0, got "
                             f"{self.graceful_shutdown_timeout_s}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level: must be one of {LOG_LEVELS}, got {self.log_level!r}")
        if self.tool_call_parser is not None:
            from ember.server.tool_parsers import get_tool_parser

            get_tool_parser(self.tool_call_parser)  # raises ValueError naming the field
        if any(not k for k in self.api_keys):
            raise ValueError("api_keys: keys must be non-empty")

    @property
    def ledger(self) -> Path:
        return Path(self.ledger_path) if self.ledger_path else default_ledger_path()
