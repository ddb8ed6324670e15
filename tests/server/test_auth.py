"""API keys and per-key rate limits (unit level; the HTTP side is in test_cli.py)."""

from __future__ import annotations

import pytest

from ember.server.auth import ApiKey, ApiKeys, RateLimiter, key_digest, parse_keys_file
from ember.server.config import ServerConfig
from ember.server.errors import APIError


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_auth_off_lets_everyone_in_anonymously() -> None:
    keys = ApiKeys.from_config(ServerConfig(rate_limit_rpm=5))
    assert not keys.enabled
    assert keys.authenticate(None) == ApiKey(None, 5, None)


def test_bearer_keys(tmp_path) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text("# team keys\nsk-team name=team rpm=3 tpm=100\n\nsk-other\n")
    keys = ApiKeys.from_config(ServerConfig(api_keys=["sk-cli"], api_keys_file=str(keys_file),
                                            rate_limit_rpm=60))
    assert keys.authenticate("Bearer sk-team") == ApiKey("team", 3, 100)
    assert keys.authenticate("bearer  sk-cli") == ApiKey(f"key-{key_digest('sk-cli')[:12]}",
                                                          60, None)
    other = keys.authenticate("Bearer sk-other")
    assert other.key_id.startswith("key-") and "sk-other" not in other.key_id
    for header in (None, "", "Bearer", "Bearer sk-wrong", "Basic sk-team", "sk-team"):
        with pytest.raises(APIError) as err:
            keys.authenticate(header)
        assert err.value.status == 401 and err.value.type == "authentication_error"


def test_keys_file_errors_name_the_line(tmp_path) -> None:
    path = tmp_path / "keys"
    path.write_text("sk-a colour=red\n")
    with pytest.raises(ValueError, match=r"api_keys_file: .*:1"):
        parse_keys_file(path, None, None)
    path.write_text("sk-a\nsk-b rpm=many\n")
    with pytest.raises(ValueError, match=r"api_keys_file: .*:2"):
        parse_keys_file(path, None, None)


def test_requests_per_minute_slide() -> None:
    clock = Clock()
    limiter = RateLimiter(clock)
    key = ApiKey("k", rpm=2)
    limiter.admit_request(key)
    clock.now += 10
    limiter.admit_request(key)
    clock.now += 5
    with pytest.raises(APIError) as err:
        limiter.admit_request(key)
    assert err.value.status == 429 and err.value.headers["retry-after"] == "45"
    limiter.admit_request(ApiKey("other", rpm=2))  # limits are per key
    clock.now += 45
    limiter.admit_request(key)  # the first request left the window


def test_tokens_per_minute() -> None:
    clock = Clock()
    limiter = RateLimiter(clock)
    key = ApiKey("k", tpm=100)
    limiter.admit_tokens(key, 40)
    clock.now += 20
    limiter.record_tokens(key, 50)  # a finished request's completion tokens
    with pytest.raises(APIError) as err:
        limiter.admit_tokens(key, 30)
    assert err.value.status == 429 and err.value.headers["retry-after"] == "40"
    with pytest.raises(APIError) as err:
        limiter.admit_tokens(key, 101)
    assert err.value.code == "tokens_exceeded"
    clock.now += 40
    limiter.admit_tokens(key, 30)
    limiter.admit_tokens(ApiKey("unlimited"), 10**9)
