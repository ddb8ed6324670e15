"""BatchConfig validation and the `ember serve` flags that make it."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from ember.batch.config import BatchConfig
from ember.batch.flags import add_arguments, config_from_args


@pytest.mark.parametrize("field, value", [
    ("store_url", "postgres://x"), ("discount", 1.5), ("discount", -0.1), ("max_inflight", 0),
    ("lease_s", 0), ("poll_interval_s", 0), ("max_attempts", 0), ("max_file_bytes", 0),
    ("max_requests", 0), ("webhook_attempts", 0), ("webhook_backoff_s", -1),
    ("webhook_timeout_s", 0), ("webhook_secret", ""),
])
def test_bad_values_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        BatchConfig(**{field: value})


def test_store_urls(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    assert BatchConfig().sqlite_path == tmp_path / "batch.sqlite"
    assert BatchConfig(store_url="sqlite:///rel/b.db").sqlite_path == Path("rel/b.db")
    assert BatchConfig(store_url="sqlite:////abs/b.db").sqlite_path == Path("/abs/b.db")
    assert BatchConfig(store_url="redis://127.0.0.1:6379/2").sqlite_path is None


def test_flags() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert config_from_args(parser.parse_args([])) == BatchConfig()
    config = config_from_args(parser.parse_args([
        "--batch-store", "redis://h:1/0", "--batch-discount", "0.25", "--batch-max-inflight",
        "3", "--batch-lease-seconds", "5", "--batch-poll-interval", "0.1",
        "--batch-max-file-bytes", "1000", "--batch-webhook-secret", "s",
        "--batch-webhook-attempts", "2", "--batch-webhook-backoff", "0.5"]))
    assert config == BatchConfig(store_url="redis://h:1/0", discount=0.25, max_inflight=3,
                                 lease_s=5.0, poll_interval_s=0.1, max_file_bytes=1000,
                                 webhook_secret="s", webhook_attempts=2, webhook_backoff_s=0.5)
