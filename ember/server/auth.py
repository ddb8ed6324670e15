"""API keys (Bearer tokens) and per-key limits on requests and tokens per minute.

Only SHA-256 digests of the keys are kept in memory; the ledger records a key id (the name a
keys file gives it, else a digest prefix), never the secret.

Keys file: one key per line, optionally followed by `name=ID rpm=N tpm=N`; blank lines and
lines starting with # are skipped.
"""

from __future__ import annotations

import hashlib
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ember.server.config import ServerConfig
from ember.server.errors import rate_limited, unauthorized

WINDOW_S = 60.0


@dataclass(frozen=True)
class ApiKey:
    key_id: str | None  # None: auth is off and the caller is anonymous
    rpm: int | None = None
    tpm: int | None = None


def key_digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def parse_keys_file(path: Path, default_rpm: int | None, default_tpm: int | None
                    ) -> dict[str, ApiKey]:
    keys: dict[str, ApiKey] = {}
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        secret, *options = line.split()
        values: dict[str, str] = {}
        for opt in options:
            name, sep, value = opt.partition("=")
            if not sep or name not in ("name", "rpm", "tpm") or not value:
                raise ValueError(f"api_keys_file: {path}:{lineno}: expected name=, rpm= or tpm=, "
                                 f"got {opt!r}")
            values[name] = value
        try:
            rpm = int(values["rpm"]) if "rpm" in values else default_rpm
            tpm = int(values["tpm"]) if "tpm" in values else default_tpm
        except ValueError:
            raise ValueError(f"api_keys_file: {path}:{lineno}: rpm and tpm must be integers"
                             ) from None
        digest = key_digest(secret)
        keys[digest] = ApiKey(values.get("name", f"key-{digest[:12]}"), rpm, tpm)
    return keys


class ApiKeys:
    def __init__(self, keys: dict[str, ApiKey], anonymous: ApiKey) -> None:
        self._keys = keys  # digest -> key
        self._anonymous = anonymous

    @classmethod
    def from_config(cls, config: ServerConfig) -> ApiKeys:
        rpm, tpm = config.rate_limit_rpm, config.rate_limit_tpm
        keys = {}
        for secret in config.api_keys:
            digest = key_digest(secret)
            keys[digest] = ApiKey(f"key-{digest[:12]}", rpm, tpm)
        if config.api_keys_file:
            keys.update(parse_keys_file(Path(config.api_keys_file), rpm, tpm))
        return cls(keys, ApiKey(None, rpm, tpm))

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def authenticate(self, authorization: str | None) -> ApiKey:
        """The key an `Authorization: Bearer ...` header names; APIError 401 if none is valid."""
        if not self._keys:
            return self._anonymous
        if not authorization:
            raise unauthorized("Missing API key: send it as 'Authorization: Bearer <key>'")
        scheme, _, secret = authorization.partition(" ")
        key = self._keys.get(key_digest(secret.strip())) if scheme.lower() == "bearer" else None
        if key is None:
            raise unauthorized("Incorrect API key provided")
        return key


@dataclass
class _Window:
    requests: deque[float] = field(default_factory=deque)
    tokens: deque[tuple[float, int]] = field(default_factory=deque)
    token_sum: int = 0

    def prune(self, now: float) -> None:
        while self.requests and self.requests[0] <= now - WINDOW_S:
            self.requests.popleft()
        while self.tokens and self.tokens[0][0] <= now - WINDOW_S:
            self.token_sum -= self.tokens.popleft()[1]


class RateLimiter:
    """Sliding one-minute windows per key; a refusal raises APIError 429 with Retry-After."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._windows: dict[str | None, _Window] = {}

    def _window(self, key: ApiKey) -> tuple[_Window, float]:
        now = self._clock()
        window = self._windows.setdefault(key.key_id, _Window())
        window.prune(now)
        return window, now

    def admit_request(self, key: ApiKey) -> None:
        """Count one request against the key's requests-per-minute limit."""
        window, now = self._window(key)
        if key.rpm is not None and len(window.requests) >= key.rpm:
            retry = window.requests[len(window.requests) - key.rpm] + WINDOW_S - now
            raise rate_limited(f"Rate limit reached: {key.rpm} requests per minute", retry)
        window.requests.append(now)

    def admit_tokens(self, key: ApiKey, num_tokens: int) -> None:
        """Count a request's prompt tokens against the tokens-per-minute limit."""
        window, now = self._window(key)
        if key.tpm is not None:
            if num_tokens > key.tpm:
                raise rate_limited(f"Request too large: {num_tokens} tokens, over the limit of "
                                   f"{key.tpm} tokens per minute", WINDOW_S, "tokens_exceeded")
            if window.token_sum + num_tokens > key.tpm:
                excess = window.token_sum + num_tokens - key.tpm
                freed, retry = 0, WINDOW_S
                for t, n in window.tokens:
                    freed += n
                    if freed >= excess:
                        retry = t + WINDOW_S - now
                        break
                raise rate_limited(f"Rate limit reached: {key.tpm} tokens per minute", retry)
        self.record_tokens(key, num_tokens)

    def record_tokens(self, key: ApiKey, num_tokens: int) -> None:
        """Count tokens after the fact (a finished request's completion tokens)."""
        if num_tokens <= 0:
            return
        window, now = self._window(key)
        window.tokens.append((now, num_tokens))
        window.token_sum += num_tokens
