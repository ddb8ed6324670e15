"""Prices per model and the SQLite ledger of what every request cost.

Prices are USD per million tokens: input, cached input (prompt tokens served from the prefix
cache) and output. A price file is JSON mapping a served model name (or "default") to
{"input": .., "cached_input": .., "output": ..}. Each ledger row stores the cost and the
saving computed at request time, so later price changes never rewrite history.
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

# The published Kimi K2.5 rates, the default for every model without its own entry.
DEFAULT_PRICES = (0.60, 0.10, 3.00)


@dataclass(frozen=True)
class Prices:
    input: float = DEFAULT_PRICES[0]
    cached_input: float = DEFAULT_PRICES[1]
    output: float = DEFAULT_PRICES[2]

    def __post_init__(self) -> None:
        for name, value in (("input", self.input), ("cached_input", self.cached_input),
                            ("output", self.output)):
            if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
                raise ValueError(f"prices.{name}: must be a number >= 0, got {value!r}")

    def cost(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int
             ) -> tuple[float, float]:
        """(USD billed, USD saved by the cached tokens compared with full input price)."""
        billed = ((prompt_tokens - cached_tokens) * self.input + cached_tokens * self.cached_input
                  + completion_tokens * self.output) / 1e6
        saved = cached_tokens * (self.input - self.cached_input) / 1e6
        return billed, saved


class PriceTable:
    def __init__(self, models: dict[str, Prices] | None = None,
                 default: Prices | None = None) -> None:
        self.models = dict(models or {})
        self.default = default or Prices()

    @classmethod
    def from_file(cls, path: str | Path | None) -> PriceTable:
        if path is None:
            return cls()
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"price_file: cannot read {path}: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"price_file: {path} must hold a JSON object")
        models = {}
        for name, entry in data.items():
            if not isinstance(entry, dict) or set(entry) - {"input", "cached_input", "output"}:
                raise ValueError(f"price_file: entry {name!r} must be an object with input, "
                                 "cached_input and output")
            models[name] = Prices(**entry)
        default = models.pop("default", None)
        return cls(models, default)

    def for_model(self, model: str) -> Prices:
        return self.models.get(model, self.default)


@dataclass
class LedgerEntry:
    request_id: str
    model: str
    endpoint: str
    lane: str
    status: str  # "ok", "aborted" or "error"
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cost_usd: float
    saved_usd: float
    key_id: str | None = None
    session_id: str | None = None
    user: str | None = None
    ts: float | None = None  # unix seconds; None: now


@dataclass
class SpendRow:
    group: str | None
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cost_usd: float
    saved_usd: float


GROUP_COLUMNS = {"key": "key_id", "session": "session_id", "model": "model", "lane": "lane",
                 "user": "user"}

_SCHEMA = """
CREATE TABLE IF NOT EXISTS requests (
    id INTEGER PRIMARY KEY,
    ts REAL NOT NULL,
    request_id TEXT NOT NULL,
    model TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    lane TEXT NOT NULL,
    status TEXT NOT NULL,
    key_id TEXT,
    session_id TEXT,
    user TEXT,
    prompt_tokens INTEGER NOT NULL,
    cached_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    cost_usd REAL NOT NULL,
    saved_usd REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS requests_ts ON requests (ts);
"""


class Ledger:
    """One SQLite file in WAL mode: the server appends, `ember cost` reads concurrently."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(self.path))
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)

    def record(self, e: LedgerEntry) -> None:
        self._db.execute(
            "INSERT INTO requests (ts, request_id, model, endpoint, lane, status, key_id, "
            "session_id, user, prompt_tokens, cached_tokens, completion_tokens, cost_usd, "
            "saved_usd) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (time.time() if e.ts is None else e.ts, e.request_id, e.model, e.endpoint, e.lane,
             e.status, e.key_id, e.session_id, e.user, e.prompt_tokens, e.cached_tokens,
             e.completion_tokens, e.cost_usd, e.saved_usd))
        self._db.commit()

    def entries(self, since: float | None = None, until: float | None = None
                ) -> list[LedgerEntry]:
        where, args = _range(since, until)
        rows = self._db.execute(
            "SELECT request_id, model, endpoint, lane, status, prompt_tokens, cached_tokens, "
            "completion_tokens, cost_usd, saved_usd, key_id, session_id, user, ts "
            f"FROM requests {where} ORDER BY id", args).fetchall()
        return [LedgerEntry(*row) for row in rows]

    def spend(self, by: str | None = None, since: float | None = None,
              until: float | None = None) -> list[SpendRow]:
        """Totals over [since, until), grouped by key, session, model, lane or user."""
        if by is not None and by not in GROUP_COLUMNS:
            raise ValueError(f"by: must be one of {sorted(GROUP_COLUMNS)}, got {by!r}")
        column = GROUP_COLUMNS[by] if by else "NULL"
        where, args = _range(since, until)
        rows = self._db.execute(
            f"SELECT {column}, COUNT(*), SUM(prompt_tokens), SUM(cached_tokens), "
            f"SUM(completion_tokens), SUM(cost_usd), SUM(saved_usd) FROM requests {where} "
            f"GROUP BY {column} ORDER BY SUM(cost_usd) DESC", args).fetchall()
        return [SpendRow(r[0], r[1], r[2] or 0, r[3] or 0, r[4] or 0, r[5] or 0.0, r[6] or 0.0)
                for r in rows if r[1]]

    def close(self) -> None:
        self._db.close()


def _range(since: float | None, until: float | None) -> tuple[str, list[float]]:
    clauses, args = [], []
    if since is not None:
        clauses.append("ts >= ?")
        args.append(since)
    if until is not None:
        clauses.append("ts < ?")
        args.append(until)
    return ("WHERE " + " AND ".join(clauses)) if clauses else "", args
