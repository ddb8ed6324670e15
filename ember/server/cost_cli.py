"""`ember cost`: spend and the saving from cached tokens, from the billing ledger."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import sys
import time
from dataclasses import asdict
from pathlib import Path

from ember.server.billing import GROUP_COLUMNS, Ledger, SpendRow
from ember.server.config import default_ledger_path

_RELATIVE = re.compile(r"^(\d+(?:\.\d+)?)([smhdw])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ledger", default=None, metavar="PATH",
                        help=f"the server's ledger (default: {default_ledger_path()})")
    parser.add_argument("--since", default=None, metavar="TIME",
                        help="from this time on: ISO date or datetime (UTC unless it has an "
                             "offset), or a duration back from now such as 24h or 7d")
    parser.add_argument("--until", default=None, metavar="TIME", help="before this time")
    parser.add_argument("--by", choices=sorted(GROUP_COLUMNS), default="model",
                        help="group rows by this (default: model)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def parse_time(value: str, now: float | None = None) -> float:
    """Unix seconds from an ISO date/datetime or a relative duration like 90m."""
    now = time.time() if now is None else now
    match = _RELATIVE.match(value.strip())
    if match:
        return now - float(match.group(1)) * _UNIT_S[match.group(2)]
    try:
        moment = dt.datetime.fromisoformat(value.strip())
    except ValueError:
        raise ValueError(f"not a time: {value!r} (use 2025-01-31, 2025-01-31T12:00 or 24h)"
                         ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=dt.UTC)
    return moment.timestamp()


def format_table(rows: list[SpendRow], by: str) -> str:
    header = [by, "requests", "prompt_tok", "cached_tok", "output_tok", "spend_usd", "saved_usd"]
    body = [[str(r.group) if r.group is not None else "-", str(r.requests), str(r.prompt_tokens),
             str(r.cached_tokens), str(r.completion_tokens), f"{r.cost_usd:.6f}",
             f"{r.saved_usd:.6f}"] for r in rows]
    total = [sum(r.requests for r in rows), sum(r.prompt_tokens for r in rows),
             sum(r.cached_tokens for r in rows), sum(r.completion_tokens for r in rows)]
    body.append(["TOTAL", *map(str, total), f"{sum(r.cost_usd for r in rows):.6f}",
                 f"{sum(r.saved_usd for r in rows):.6f}"])
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    lines = []
    for line in [header, *body]:
        cells = [line[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(line[1:], widths[1:],
                                                                          strict=True)]
        lines.append("  ".join(cells))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    path = Path(args.ledger) if args.ledger else default_ledger_path()
    if not path.exists():
        print(f"ember cost: no ledger at {path}", file=sys.stderr)
        return 1
    try:
        since = parse_time(args.since) if args.since else None
        until = parse_time(args.until) if args.until else None
    except ValueError as exc:
        print(f"ember cost: {exc}", file=sys.stderr)
        return 2
    ledger = Ledger(path)
    try:
        rows = ledger.spend(args.by, since, until)
    finally:
        ledger.close()
    if args.json:
        print(json.dumps({"by": args.by, "since": since, "until": until,
                          "rows": [asdict(r) for r in rows],
                          "total_usd": sum(r.cost_usd for r in rows),
                          "saved_usd": sum(r.saved_usd for r in rows)}, indent=2))
    else:
        print(format_table(rows, args.by))
    return 0
