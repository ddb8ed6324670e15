"""`ember route`: an OpenAI-compatible gateway over replicas, keeping sessions on their cache."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from ember.router.config import POLICIES, RouterConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = RouterConfig.__dataclass_fields__
    parser.add_argument("--replica", action="append", default=[], metavar="URL",
                        help="a replica's base URL, e.g. http://10.0.0.5:8000; repeatable")
    parser.add_argument("--replicas-file", default=None, metavar="PATH",
                        help="a file of replica URLs, one a line, re-read when it changes")
    parser.add_argument("--host", default=d["host"].default)
    parser.add_argument("--port", type=int, default=d["port"].default)
    parser.add_argument("--policy", choices=POLICIES, default=d["policy"].default,
                        help="affinity: session hashing, then prefix, then load (default); "
                             "round-robin: the baseline")
    parser.add_argument("--affinity-header", default=d["affinity_header"].default)
    parser.add_argument("--max-load", type=int, default=d["max_load"].default,
                        help="requests in flight (or running + waiting on the replica) at "
                             "which it counts as overloaded and requests spill elsewhere")
    parser.add_argument("--max-waiting", type=int, default=d["max_waiting"].default,
                        help="requests waiting on the replica at which it counts as overloaded")
    parser.add_argument("--prefix-block-chars", type=int,
                        default=d["prefix_block_chars"].default)
    parser.add_argument("--prefix-max-blocks", type=int, default=d["prefix_max_blocks"].default)
    parser.add_argument("--prefix-capacity", type=int, default=d["prefix_capacity"].default,
                        help="prompt blocks remembered per replica")
    parser.add_argument("--prefix-min-match", type=float, default=d["prefix_min_match"].default,
                        help="fraction of a prompt's leading blocks a replica must have been "
                             "sent for a prefix route; below it the least loaded replica wins")
    parser.add_argument("--health-interval", type=float, default=d["health_interval"].default)
    parser.add_argument("--health-timeout", type=float, default=d["health_timeout"].default)
    parser.add_argument("--health-path", default=d["health_path"].default)
    parser.add_argument("--no-poll-metrics", dest="poll_metrics", action="store_false",
                        help="do not read load gauges from the replicas' /metrics")
    parser.add_argument("--eject-after", type=int, default=d["eject_after"].default,
                        help="consecutive failures that take a replica out of rotation")
    parser.add_argument("--readmit-after", type=int, default=d["readmit_after"].default,
                        help="consecutive passed checks that bring it back")
    parser.add_argument("--connect-timeout", type=float, default=d["connect_timeout"].default)
    parser.add_argument("--read-timeout", type=float, default=d["read_timeout"].default,
                        help="longest silence allowed between two chunks of a response")
    parser.add_argument("--retries", type=int, choices=(0, 1), default=d["retries"].default)
    parser.add_argument("--admin-key", default=None,
                        help="enables /admin/*; prefer --admin-key-file (argv is visible)")
    parser.add_argument("--admin-key-file", default=None, metavar="PATH")
    parser.add_argument("--log-level", default="info",
                        choices=("critical", "error", "warning", "info", "debug"))


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    admin_key = args.admin_key
    if args.admin_key_file:
        admin_key = Path(args.admin_key_file).read_text().strip()
    return RouterConfig(
        replicas=args.replica, host=args.host, port=args.port, policy=args.policy,
        affinity_header=args.affinity_header, prefix_block_chars=args.prefix_block_chars,
        prefix_max_blocks=args.prefix_max_blocks, prefix_capacity=args.prefix_capacity,
        prefix_min_match=args.prefix_min_match,
        max_load=args.max_load, max_waiting=args.max_waiting,
        health_interval=args.health_interval, health_timeout=args.health_timeout,
        health_path=args.health_path, poll_metrics=args.poll_metrics,
        eject_after=args.eject_after, readmit_after=args.readmit_after,
        connect_timeout=args.connect_timeout, read_timeout=args.read_timeout,
        retries=args.retries, admin_key=admin_key, replicas_file=args.replicas_file,
    )


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except (ValueError, OSError) as exc:
        print(f"ember route: {exc}", file=sys.stderr)
        return 2
    import uvicorn

    from ember.router.app import create_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s "
                        "%(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per proxied request
    # The replicas' Server and Date headers pass through; the router adds none of its own.
    uvicorn.run(create_app(config), host=config.host, port=config.port,
                log_level=args.log_level, access_log=False, server_header=False,
                date_header=False)
    return 0
