"""The bench configuration, validated on construction (ValueError names the field)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

WORKLOADS = ("chat", "agent", "long-context", "interference")

# Published Kimi K2.5 rates, USD per million tokens; the same default as the server's ledger.
DEFAULT_PRICES = (0.60, 0.10, 3.00)


def _require(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{field_name}: {message}")


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution: `N` (fixed), `uniform:LO:HI` or `normal:MEAN:STD`."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, spec: str, field_name: str) -> LengthDist:
        parts = spec.split(":")
        try:
            if len(parts) == 1:
                dist = cls("fixed", float(int(parts[0])))
            elif len(parts) == 3 and parts[0] in ("uniform", "normal"):
                dist = cls(parts[0], float(parts[1]), float(parts[2]))
            else:
                raise ValueError(spec)
        except ValueError:
            raise ValueError(f"{field_name}: expected N, uniform:LO:HI or normal:MEAN:STD, "
                             f"got {spec!r}") from None
        dist.validate(field_name)
        return dist

    def validate(self, field_name: str) -> None:
        _require(self.kind in ("fixed", "uniform", "normal"), field_name,
                 f"unknown distribution {self.kind!r}")
        _require(self.a >= 1, field_name, f"lengths must be >= 1, got {self.a:g}")
        if self.kind == "uniform":
            _require(self.b >= self.a, field_name, f"uniform needs HI >= LO, got {self.b:g}")
        if self.kind == "normal":
            _require(self.b >= 0, field_name, f"normal needs STD >= 0, got {self.b:g}")

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        return max(1, min(self.upper(), round(rng.gauss(self.a, self.b))))

    def upper(self) -> int:
        """The largest length this distribution yields (normal is cut at mean + 3 std)."""
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return int(self.b)
        return int(self.a + 3 * self.b)

    def describe(self) -> str:
        if self.kind == "fixed":
            return str(int(self.a))
        return f"{self.kind}:{self.a:g}:{self.b:g}"


@dataclass(frozen=True)
class Prices:
    """USD per million tokens: uncached input, cached input, output."""

    input: float
    cached_input: float
    output: float

    def __post_init__(self) -> None:
        for name in ("input", "cached_input", "output"):
            _require(getattr(self, name) >= 0, f"prices.{name}",
                     f"must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class Endpoint:
    """One server to measure. `model=None` means the first model its /v1/models lists."""

    name: str
    base_url: str
    model: str | None = None

    def __post_init__(self) -> None:
        _require(bool(self.name), "endpoint.name", "must not be empty")
        _require(self.base_url.startswith(("http://", "https://")), "endpoint.base_url",
                 f"must start with http:// or https://, got {self.base_url!r}")

    @property
    def api_url(self) -> str:
        """The base URL ending in /v1, whether or not the user wrote it."""
        url = self.base_url.rstrip("/")
        return url if url.endswith("/v1") else url + "/v1"


# Per workload: (input length, output length) when the user gives none.
WORKLOAD_DEFAULT_LENGTHS = {
    "chat": ("256", "128"),
    "agent": ("256", "64"),
    "long-context": ("256", "16"),
    "interference": ("64", "64"),
}


@dataclass
class BenchConfig:
    """Everything one `ember bench` invocation does; the report records it verbatim."""

    endpoints: list[Endpoint]
    workload: str = "chat"
    concurrency: int = 4
    rate: float | None = None
    num_requests: int | None = None
    duration: float | None = None
    seed: int = 0
    input_len: LengthDist | None = None
    output_len: LengthDist | None = None
    turns: int = 4
    system_len: int = 512
    file_len: int = 1024
    tool_result_len: int = 128
    context_length: int | None = None
    long_requests: int = 4
    temperature: float = 0.0
    ignore_eos: bool = False
    warmup: int = 0
    request_timeout: float = 600.0
    api_key: str | None = None
    prices: Prices = field(default_factory=lambda: Prices(*DEFAULT_PRICES))
    price_table: dict[str, Prices] = field(default_factory=dict)
    launch: dict[str, str] = field(default_factory=dict)  # endpoint name -> shell command
    launch_timeout: float = 600.0

    def __post_init__(self) -> None:
        _require(len(self.endpoints) >= 1, "endpoints", "need at least one")
        names = [e.name for e in self.endpoints]
        _require(len(set(names)) == len(names), "endpoints", f"names must be unique, got {names}")
        _require(self.workload in WORKLOADS, "workload",
                 f"must be one of {WORKLOADS}, got {self.workload!r}")
        _require(self.concurrency >= 1, "concurrency", f"must be >= 1, got {self.concurrency}")
        _require(self.rate is None or self.rate > 0, "rate", f"must be > 0, got {self.rate}")
        _require(self.num_requests is None or self.num_requests >= 1, "num_requests",
                 f"must be >= 1, got {self.num_requests}")
        _require(self.duration is None or self.duration > 0, "duration",
                 f"must be > 0, got {self.duration}")
        for name in ("turns", "system_len", "file_len", "tool_result_len", "long_requests"):
            _require(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        _require(self.context_length is None or self.context_length >= 32, "context_length",
                 f"must be >= 32, got {self.context_length}")
        _require(self.temperature >= 0, "temperature", f"must be >= 0, got {self.temperature}")
        _require(self.warmup >= 0, "warmup", f"must be >= 0, got {self.warmup}")
        _require(self.request_timeout > 0, "request_timeout",
                 f"must be > 0, got {self.request_timeout}")
        unknown = sorted(set(self.launch) - set(names))
        _require(not unknown, "launch", f"no endpoint named {', '.join(unknown)}")
        _require(self.launch_timeout > 0, "launch_timeout",
                 f"must be > 0, got {self.launch_timeout}")
        if self.num_requests is None and self.duration is None:
            self.num_requests = 10 * self.concurrency
        default_in, default_out = WORKLOAD_DEFAULT_LENGTHS[self.workload]
        if self.input_len is None:
            self.input_len = LengthDist.parse(default_in, "input_len")
        if self.output_len is None:
            self.output_len = LengthDist.parse(default_out, "output_len")

    def prices_for(self, model: str) -> Prices:
        return self.price_table.get(model, self.price_table.get("default", self.prices))
