"""The router configuration, validated on construction (ValueError names the field)."""

from __future__ import annotations

from dataclasses import dataclass, field

POLICIES = ("affinity", "round-robin")


def _require(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{field_name}: {message}")


def normalize_url(url: str, field_name: str = "replicas") -> str:
    """A replica's identity: its base URL without a trailing slash or /v1."""
    _require(url.startswith(("http://", "https://")), field_name,
             f"must start with http:// or https://, got {url!r}")
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


@dataclass
class RouterConfig:
    """Everything `ember route` does.

    Load is a replica's in-flight requests as this router counts them, or the running plus
    waiting requests its /metrics last reported, whichever is larger. A replica is overloaded
    when its load reaches `max_load` or its waiting requests reach `max_waiting`.
    """

    replicas: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 8080
    policy: str = "affinity"
    affinity_header: str = "x-session-affinity"
    # Prefix-aware routing: chained hashes of fixed-size character blocks of the prompt.
    prefix_block_chars: int = 256
    prefix_max_blocks: int = 64
    prefix_capacity: int = 65536  # blocks remembered per replica (LRU)
    prefix_min_match: float = 0.5  # fraction of a prompt's blocks a prefix route must match
    max_load: int = 32
    max_waiting: int = 8
    # Health.
    health_interval: float = 1.0
    health_timeout: float = 2.0
    health_path: str = "/health"
    poll_metrics: bool = True
    eject_after: int = 3  # consecutive failures
    readmit_after: int = 1  # consecutive successful active checks
    # Upstream HTTP.
    connect_timeout: float = 5.0
    read_timeout: float = 600.0  # longest silence between two chunks of a response
    max_connections: int = 1024
    retries: int = 1  # on another replica, when a request fails before its first byte
    # Run-time membership.
    admin_key: str | None = None
    replicas_file: str | None = None

    def __post_init__(self) -> None:
        self.replicas = [normalize_url(u) for u in self.replicas]
        _require(len(set(self.replicas)) == len(self.replicas), "replicas",
                 f"must be unique, got {self.replicas}")
        _require(bool(self.replicas) or self.replicas_file is not None
                 or self.admin_key is not None, "replicas",
                 "need at least one --replica, or a --replicas-file or --admin-key to add them")
        _require(1 <= self.port <= 65535, "port", f"must be in 1..65535, got {self.port}")
        _require(self.policy in POLICIES, "policy",
                 f"must be one of {POLICIES}, got {self.policy!r}")
        _require(bool(self.affinity_header), "affinity_header", "must not be empty")
        self.affinity_header = self.affinity_header.lower()
        for name in ("prefix_block_chars", "prefix_max_blocks", "prefix_capacity", "max_load",
                     "max_waiting", "eject_after", "readmit_after", "max_connections"):
            _require(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        for name in ("health_interval", "health_timeout", "connect_timeout", "read_timeout"):
            _require(getattr(self, name) > 0, name, f"must be > 0, got {getattr(self, name)}")
        _require(0 < self.prefix_min_match <= 1, "prefix_min_match",
                 f"must be in (0, 1], got {self.prefix_min_match}")
        _require(self.health_path.startswith("/"), "health_path",
                 f"must start with /, got {self.health_path!r}")
        _require(self.retries in (0, 1), "retries", f"must be 0 or 1, got {self.retries}")
        _require(self.admin_key is None or len(self.admin_key) >= 8, "admin_key",
                 "must be at least 8 characters")
