"""`ember route` arguments map onto RouterConfig."""

from __future__ import annotations

import argparse

from ember.router.cli import add_arguments, config_from_args, run


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_arguments_become_the_config(tmp_path):
    key = tmp_path / "key"
    key.write_text("s3cret-admin-key\n")
    config = config_from_args(parse(
        "--replica", "http://a:1", "--replica", "http://b:2/v1", "--port", "9000",
        "--policy", "round-robin", "--max-load", "7", "--no-poll-metrics",
        "--admin-key-file", str(key), "--prefix-min-match", "0.8"))
    assert config.replicas == ["http://a:1", "http://b:2"]
    assert (config.port, config.policy, config.max_load) == (9000, "round-robin", 7)
    assert config.poll_metrics is False and config.admin_key == "s3cret-admin-key"
    assert config.prefix_min_match == 0.8


def test_bad_arguments_exit_with_2_and_name_the_field(capsys):
    assert run(parse("--replica", "a:1")) == 2
    assert "replicas: must start with http" in capsys.readouterr().err
    assert run(parse()) == 2
