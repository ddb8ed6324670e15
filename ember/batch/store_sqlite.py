"""The batch store in one SQLite file (WAL): the default, for one host.

Several processes may share the file: every write that reads first runs in a
`BEGIN IMMEDIATE` transaction, so claims and compare-and-set transitions never interleave.
An item is `queued`, `running` (leased: `token`, `lease_until`) or `done` (has its outcome).
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ember.batch.store import (
    ACTIVE_STATUSES,
    Claim,
    FileRecord,
    ItemResult,
    ItemSpec,
    JobPage,
    JobRecord,
    Outcome,
)

_COUNTERS = ("completed", "failed", "input_tokens", "cached_tokens", "output_tokens")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY,
    purpose TEXT NOT NULL,
    filename TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    key_id TEXT,
    content BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    kind TEXT NOT NULL,
    key_id TEXT,
    endpoint TEXT NOT NULL,
    status TEXT NOT NULL,
    data TEXT NOT NULL,
    completed INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0,
    input_tokens INTEGER NOT NULL DEFAULT 0,
    cached_tokens INTEGER NOT NULL DEFAULT 0,
    output_tokens INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS jobs_status ON jobs (status);
CREATE TABLE IF NOT EXISTS items (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT NOT NULL,
    idx INTEGER NOT NULL,
    model TEXT,
    custom_id TEXT,
    external_reference TEXT,
    body TEXT,
    status TEXT NOT NULL,
    token TEXT,
    lease_until REAL,
    attempts INTEGER NOT NULL DEFAULT 0,
    outcome TEXT,
    UNIQUE (job_id, idx)
);
CREATE INDEX IF NOT EXISTS items_queue ON items (status, model, seq);
"""


class SQLiteStore:
    def __init__(self, path: str | Path, lease_s: float) -> None:
        self.path = Path(path)
        self.lease_s = lease_s
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(self.path), isolation_level=None,
                                   check_same_thread=False, timeout=30.0)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")  # WAL: a killed process loses nothing
        with self._lock:
            self._db.executescript(_SCHEMA)

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _query(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # ---- files --------------------------------------------------------------------------

    def put_file(self, record: FileRecord, content: bytes) -> None:
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO files (id, purpose, filename, bytes, created_at, "
                       "key_id, content) VALUES (?, ?, ?, ?, ?, ?, ?)",
                       (record.id, record.purpose, record.filename, record.bytes,
                        record.created_at, record.key_id, content))

    def get_file(self, file_id: str) -> FileRecord | None:
        rows = self._query("SELECT id, purpose, filename, bytes, created_at, key_id FROM files "
                           "WHERE id = ?", (file_id,))
        return FileRecord(*rows[0]) if rows else None

    def file_content(self, file_id: str) -> bytes | None:
        rows = self._query("SELECT content FROM files WHERE id = ?", (file_id,))
        return bytes(rows[0][0]) if rows else None

    def list_files(self, key_id: str | None, after: str | None, limit: int
                   ) -> tuple[list[FileRecord], bool]:
        rows = self._query(
            "SELECT id, purpose, filename, bytes, created_at, key_id FROM files "
            "WHERE key_id IS ? AND rowid < COALESCE((SELECT rowid FROM files WHERE id = ?), "
            "9223372036854775807) ORDER BY rowid DESC LIMIT ?", (key_id, after, limit + 1))
        return [FileRecord(*r) for r in rows[:limit]], len(rows) > limit

    def delete_file(self, file_id: str) -> bool:
        with self._tx() as db:
            return db.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount > 0

    # ---- jobs ---------------------------------------------------------------------------

    def create_job(self, job: JobRecord, items: list[ItemSpec]) -> None:
        failed = sum(1 for it in items if it.failure is not None)
        with self._tx() as db:
            db.execute("INSERT INTO jobs (id, kind, key_id, endpoint, status, data, failed) "
                       "VALUES (?, ?, ?, ?, ?, ?, ?)",
                       (job.id, job.kind, job.key_id, job.endpoint, job.status,
                        _job_data(job), job.failed + failed))
            db.executemany(
                "INSERT INTO items (job_id, idx, model, custom_id, external_reference, body, "
                "status, outcome) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                [(job.id, it.index, job.model, it.custom_id, json.dumps(it.external_reference),
                  None if it.body is None else json.dumps(it.body),
                  "queued" if it.failure is None else "done",
                  None if it.failure is None else Outcome(False, it.failure).to_json())
                 for it in items])

    def get_job(self, job_id: str) -> JobRecord | None:
        rows = self._query(f"SELECT data, status, {', '.join(_COUNTERS)} FROM jobs WHERE id = ?",
                           (job_id,))
        return _job(rows[0]) if rows else None

    def list_jobs(self, kind: str, key_id: str | None, after: str | None, limit: int
                  ) -> JobPage:
        rows = self._query(
            f"SELECT data, status, {', '.join(_COUNTERS)} FROM jobs WHERE kind = ? AND "
            "key_id IS ? AND rowid < COALESCE((SELECT rowid FROM jobs WHERE id = ?), "
            "9223372036854775807) ORDER BY rowid DESC LIMIT ?", (kind, key_id, after, limit + 1))
        return JobPage([_job(r) for r in rows[:limit]], len(rows) > limit)

    def active_jobs(self) -> list[JobRecord]:
        marks = ", ".join("?" * len(ACTIVE_STATUSES))
        rows = self._query(f"SELECT data, status, {', '.join(_COUNTERS)} FROM jobs "
                           f"WHERE status IN ({marks}) ORDER BY rowid", ACTIVE_STATUSES)
        return [_job(r) for r in rows]

    def transition(self, job_id: str, expect: tuple[str, ...], status: str,
                   **updates: Any) -> JobRecord | None:
        with self._tx() as db:
            row = db.execute(f"SELECT data, status, {', '.join(_COUNTERS)} FROM jobs "
                             "WHERE id = ?", (job_id,)).fetchone()
            if row is None or row[1] not in expect:
                return None
            job = _job(row)
            for name, value in updates.items():
                setattr(job, name, value)
            job.status = status
            db.execute("UPDATE jobs SET status = ?, data = ? WHERE id = ?",
                       (status, _job_data(job), job_id))
            return job

    # ---- the queue ----------------------------------------------------------------------

    def claim(self, owner: str, models: list[str], n: int) -> list[Claim]:
        if not models or n <= 0:
            return []
        now = time.time()
        marks = ", ".join("?" * len(models))
        select = ("SELECT i.seq, i.job_id, i.idx, i.model, i.attempts, i.custom_id, i.body, "
                  "j.endpoint, j.key_id FROM items i JOIN jobs j ON j.id = i.job_id "
                  f"WHERE i.status = ? AND i.model IN ({marks}) AND j.status = 'in_progress' ")
        if not self._query(f"SELECT 1 FROM items WHERE status IN ('queued', 'running') "
                           f"AND model IN ({marks}) LIMIT 1", tuple(models)):
            return []  # nothing to take: no write lock needed
        with self._tx() as db:
            rows = db.execute(select + "AND i.lease_until < ? ORDER BY i.seq LIMIT ?",
                              ("running", *models, now, n)).fetchall()
            if len(rows) < n:
                rows += db.execute(select + "ORDER BY i.seq LIMIT ?",
                                   ("queued", *models, n - len(rows))).fetchall()
            claims = []
            for seq, job_id, idx, model, attempts, custom_id, body, endpoint, key_id in rows:
                token = f"{owner}:{uuid.uuid4().hex}"
                db.execute("UPDATE items SET status = 'running', token = ?, lease_until = ?, "
                           "attempts = attempts + 1 WHERE seq = ?",
                           (token, now + self.lease_s, seq))
                claims.append(Claim(job_id, idx, model, owner, token, attempts + 1, endpoint,
                                    key_id, custom_id, json.loads(body)))
            for job_id in {c.job_id for c in claims}:
                db.execute("UPDATE jobs SET data = json_set(data, '$.started_at', ?) "
                           "WHERE id = ? AND json_extract(data, '$.started_at') IS NULL",
                           (int(now), job_id))
            return claims

    def renew(self, owner: str, claims: list[Claim]) -> list[Claim]:
        lost = []
        until = time.time() + self.lease_s
        with self._tx() as db:
            for c in claims:
                cur = db.execute("UPDATE items SET lease_until = ? WHERE job_id = ? AND idx = ? "
                                 "AND status = 'running' AND token = ?",
                                 (until, c.job_id, c.index, c.token))
                if cur.rowcount == 0:
                    lost.append(c)
        return lost

    def complete(self, claim: Claim, outcome: Outcome) -> bool:
        with self._tx() as db:
            cur = db.execute("UPDATE items SET status = 'done', outcome = ?, token = NULL "
                             "WHERE job_id = ? AND idx = ? AND status = 'running' AND token = ?",
                             (outcome.to_json(), claim.job_id, claim.index, claim.token))
            if cur.rowcount == 0:
                return False
            db.execute("UPDATE jobs SET completed = completed + ?, failed = failed + ?, "
                       "input_tokens = input_tokens + ?, cached_tokens = cached_tokens + ?, "
                       "output_tokens = output_tokens + ? WHERE id = ?",
                       (int(outcome.ok), int(not outcome.ok), outcome.input_tokens,
                        outcome.cached_tokens, outcome.output_tokens, claim.job_id))
            return True

    def release(self, claim: Claim) -> None:
        with self._tx() as db:
            db.execute("UPDATE items SET status = 'queued', token = NULL, lease_until = NULL "
                       "WHERE job_id = ? AND idx = ? AND status = 'running' AND token = ?",
                       (claim.job_id, claim.index, claim.token))

    def resolve_rest(self, job_id: str, outcome: Outcome) -> int:
        with self._tx() as db:
            count = db.execute("UPDATE items SET status = 'done', outcome = ?, token = NULL "
                               "WHERE job_id = ? AND status != 'done'",
                               (outcome.to_json(), job_id)).rowcount
            column = "completed" if outcome.ok else "failed"
            db.execute(f"UPDATE jobs SET {column} = {column} + ? WHERE id = ?", (count, job_id))
            return count

    def results(self, job_id: str) -> list[ItemResult]:
        rows = self._query("SELECT idx, custom_id, external_reference, outcome FROM items "
                           "WHERE job_id = ? AND status = 'done' ORDER BY idx", (job_id,))
        return [ItemResult(idx, custom_id, json.loads(ref), Outcome.from_json(outcome))
                for idx, custom_id, ref, outcome in rows]

    def close(self) -> None:
        with self._lock:
            self._db.close()


def _job_data(job: JobRecord) -> str:
    data = asdict(job)
    for name in _COUNTERS:
        data.pop(name)
    return json.dumps(data)


def _job(row: tuple[Any, ...]) -> JobRecord:
    data = json.loads(row[0])
    data["status"] = row[1]
    data.update(zip(_COUNTERS, row[2:], strict=True))
    return JobRecord(**data)
