"""ServerConfig validation and how `ember serve` flags become configs."""

from __future__ import annotations

import argparse

import pytest

from ember.server import cli
from ember.server.config import ServerConfig, default_ledger_path


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize("fields, bad", [
    ({"port": 70000}, "port"),
    ({"rate_limit_rpm": 0}, "rate_limit_rpm"),
    ({"rate_limit_tpm": -1}, "rate_limit_tpm"),
    ({"max_queue_depth": -1}, "max_queue_depth"),
    ({"max_body_bytes": 10}, "max_body_bytes"),
    ({"graceful_shutdown_timeout_s": -1.0}, "graceful_shutdown_timeout_s"),
    ({"log_level": "loud"}, "log_level"),
    ({"api_keys": [""]}, "api_keys"),
])
def test_invalid_fields_are_named(fields: dict, bad: str) -> None:
    with pytest.raises(ValueError, match=f"^{bad}:"):
        ServerConfig(**fields)


def test_no_model_means_the_default_model() -> None:
    server, engine = cli.configs(parse())
    assert engine.model.model is None
    assert (server.host, server.port) == ("127.0.0.1", 8000)
    assert server.ledger == default_ledger_path()


def test_flags_reach_the_configs(tmp_path) -> None:
    server, engine = cli.configs(parse(
        "/models/x", "--port", "9001", "--served-model-name", "a", "--served-model-name", "b",
        "--dtype", "float32", "--max-model-len", "1024", "--num-kv-blocks", "77",
        "--max-num-batched-tokens", "512", "--api-key", "k1", "--rate-limit-rpm", "10",
        "--max-queue-depth", "3", "--ledger", str(tmp_path / "l.sqlite")))
    assert engine.model.model == "/models/x" and engine.model.dtype == "float32"
    assert engine.model.max_model_len == 1024 and engine.cache.num_kv_blocks == 77
    assert engine.scheduler.max_num_batched_tokens == 512
    assert server.served_model_names == ["a", "b"] and server.api_keys == ["k1"]
    assert server.rate_limit_rpm == 10 and server.max_queue_depth == 3
    assert server.ledger == tmp_path / "l.sqlite"


def test_bad_flags_exit_with_a_message(capsys) -> None:
    assert cli.run(parse("--max-queue-depth", "-2")) == 2
    assert "max_queue_depth" in capsys.readouterr().err
