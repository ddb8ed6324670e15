"""The batch lane's `ember serve` flags and the BatchConfig they make."""

from __future__ import annotations

import argparse

from ember.batch.config import BatchConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = BatchConfig()
    group = parser.add_argument_group("batch lane (queued requests, /v1/files, /v1/batches)")
    group.add_argument("--batch-store", default=None, metavar="URL",
                       help="where jobs live: sqlite:///PATH (sqlite:////ABS/PATH) or "
                            "redis://HOST:PORT/DB to share one queue between replicas "
                            "(default: sqlite in ~/.cache/ember/batch.sqlite)")
    group.add_argument("--batch-discount", type=float, default=d.discount, metavar="FRACTION",
                       help="fraction off the price of batch-lane tokens in the ledger")
    group.add_argument("--batch-max-inflight", type=int, default=d.max_inflight, metavar="N",
                       help="batch items this replica runs at once")
    group.add_argument("--batch-lease-seconds", type=float, default=d.lease_s,
                       metavar="SECONDS",
                       help="an item whose worker is silent this long is run again elsewhere")
    group.add_argument("--batch-poll-interval", type=float, default=d.poll_interval_s,
                       metavar="SECONDS", help="how often an idle worker looks for work")
    group.add_argument("--batch-max-file-bytes", type=int, default=d.max_file_bytes,
                       metavar="N", help="largest accepted batch input file")
    group.add_argument("--batch-webhook-secret", default=None, metavar="SECRET",
                       help="sign job callbacks (Standard Webhooks; whsec_... or plain text)")
    group.add_argument("--batch-webhook-attempts", type=int, default=d.webhook_attempts,
                       metavar="N", help="tries per job callback")
    group.add_argument("--batch-webhook-backoff", type=float, default=d.webhook_backoff_s,
                       metavar="SECONDS", help="first retry delay of a callback; it doubles")


def config_from_args(args: argparse.Namespace) -> BatchConfig:
    return BatchConfig(store_url=args.batch_store, discount=args.batch_discount,
                       max_inflight=args.batch_max_inflight, lease_s=args.batch_lease_seconds,
                       poll_interval_s=args.batch_poll_interval,
                       max_file_bytes=args.batch_max_file_bytes,
                       webhook_secret=args.batch_webhook_secret,
                       webhook_attempts=args.batch_webhook_attempts,
                       webhook_backoff_s=args.batch_webhook_backoff)
