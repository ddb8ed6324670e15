"""The batch store in Redis: several replicas share one queue.

Layout (prefix `ember:batch`): a job is a hash of JSON-encoded fields; its items, results and
claim counts are hashes keyed by item index; queued items are entries of one stream per model,
read by the consumer group `workers`, one consumer per replica. A claim is a delivered entry;
its lease is the entry's idle time in the group's pending list: `renew` resets it, and an
entry idle past the lease is taken over with XAUTOCLAIM. Results are written with HSETNX in
the same Lua script that counts them, so each item gets one result, counted once.
"""

from __future__ import annotations

import json
import time
from typing import Any

import redis

from ember.batch.store import (
    TERMINAL_STATUSES,
    Claim,
    FileRecord,
    ItemResult,
    ItemSpec,
    JobPage,
    JobRecord,
    Outcome,
)

PREFIX = "ember:batch"
GROUP = "workers"

_TRANSITION = """
local cur = redis.call('HGET', KEYS[1], 'status')
if not cur then return false end
local n = tonumber(ARGV[1])
local ok = false
for i = 2, n + 1 do if ARGV[i] == cur then ok = true end end
if not ok then return false end
redis.call('HSET', KEYS[1], 'status', ARGV[n + 2])
for i = n + 4, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
if ARGV[n + 3] ~= '' then redis.call('SREM', KEYS[2], ARGV[n + 3]) end
return redis.call('HGETALL', KEYS[1])
"""

_RENEW = """
local lost = {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #p == 0 or p[1][2] ~= ARGV[2] then
    table.insert(lost, ARGV[i])
  else
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
  end
end
return lost
"""

_COMPLETE = """
local wrote = redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2])
if wrote == 1 then
  redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
  redis.call('HINCRBY', KEYS[2], 'input_tokens', ARGV[4])
  redis.call('HINCRBY', KEYS[2], 'cached_tokens', ARGV[5])
  redis.call('HINCRBY', KEYS[2], 'output_tokens', ARGV[6])
end
redis.call('XACK', KEYS[3], ARGV[7], ARGV[8])
redis.call('XDEL', KEYS[3], ARGV[8])
return wrote
"""

_RELEASE = """
local p = redis.call('XPENDING', KEYS[2], ARGV[2], ARGV[3], ARGV[3], 1)
if #p == 0 or p[1][2] ~= ARGV[4] then return 0 end
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then
  redis.call('XADD', KEYS[2], '*', 'job', ARGV[5], 'idx', ARGV[1])
end
redis.call('XACK', KEYS[2], ARGV[2], ARGV[3])
redis.call('XDEL', KEYS[2], ARGV[3])
return 1
"""

_RESOLVE_REST = """
local total = tonumber(redis.call('HGET', KEYS[2], 'total'))
local n = 0
for i = 0, total - 1 do
  n = n + redis.call('HSETNX', KEYS[1], tostring(i), ARGV[1])
end
redis.call('HINCRBY', KEYS[2], ARGV[2], n)
return n
"""


class RedisStore:
    def __init__(self, url: str, lease_s: float) -> None:
        self.lease_s = lease_s
        self._r = redis.Redis.from_url(url, socket_timeout=30.0, socket_connect_timeout=10.0)
        try:
            self._r.ping()
        except redis.RedisError as exc:
            raise ValueError(f"store_url: cannot reach Redis at {url}: {exc}") from None
        self._transition = self._r.register_script(_TRANSITION)
        self._renew = self._r.register_script(_RENEW)
        self._complete = self._r.register_script(_COMPLETE)
        self._release = self._r.register_script(_RELEASE)
        self._resolve_rest = self._r.register_script(_RESOLVE_REST)
        self._groups: set[str] = set()

    # ---- keys ---------------------------------------------------------------------------

    @staticmethod
    def _job_key(job_id: str, part: str = "") -> str:
        return f"{PREFIX}:job:{job_id}" + (f":{part}" if part else "")

    @staticmethod
    def _queue_key(model: str) -> str:
        return f"{PREFIX}:queue:{model}"

    @staticmethod
    def _index_key(kind: str, key_id: str | None) -> str:
        return f"{PREFIX}:{kind}:{key_id or '-'}"

    _ACTIVE = f"{PREFIX}:jobs:active"
    _SEQ = f"{PREFIX}:seq"

    def _ensure_group(self, stream: str) -> None:
        if stream in self._groups:
            return
        try:
            self._r.xgroup_create(stream, GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._groups.add(stream)

    # ---- files --------------------------------------------------------------------------

    def put_file(self, record: FileRecord, content: bytes) -> None:
        meta = {k: json.dumps(v) for k, v in vars(record).items()}
        seq = self._r.incr(self._SEQ)
        pipe = self._r.pipeline()
        pipe.hset(f"{PREFIX}:file:{record.id}", mapping=meta)
        pipe.set(f"{PREFIX}:file:{record.id}:content", content)
        pipe.zadd(self._index_key("files", record.key_id), {record.id: seq})
        pipe.execute()

    def get_file(self, file_id: str) -> FileRecord | None:
        raw = self._r.hgetall(f"{PREFIX}:file:{file_id}")
        if not raw:
            return None
        return FileRecord(**{k.decode(): json.loads(v) for k, v in raw.items()})

    def file_content(self, file_id: str) -> bytes | None:
        return self._r.get(f"{PREFIX}:file:{file_id}:content")

    def list_files(self, key_id: str | None, after: str | None, limit: int
                   ) -> tuple[list[FileRecord], bool]:
        ids, has_more = self._page(self._index_key("files", key_id), after, limit)
        records = [self.get_file(i) for i in ids]
        return [r for r in records if r is not None], has_more

    def delete_file(self, file_id: str) -> bool:
        record = self.get_file(file_id)
        if record is None:
            return False
        pipe = self._r.pipeline()
        pipe.delete(f"{PREFIX}:file:{file_id}", f"{PREFIX}:file:{file_id}:content")
        pipe.zrem(self._index_key("files", record.key_id), file_id)
        pipe.execute()
        return True

    def _page(self, index: str, after: str | None, limit: int) -> tuple[list[str], bool]:
        top: str | float = "+inf"
        if after is not None:
            score = self._r.zscore(index, after)
            if score is not None:
                top = f"({score}"
        ids = self._r.zrevrangebyscore(index, top, "-inf", start=0, num=limit + 1)
        return [i.decode() for i in ids[:limit]], len(ids) > limit

    # ---- jobs ---------------------------------------------------------------------------

    def create_job(self, job: JobRecord, items: list[ItemSpec]) -> None:
        stream = self._queue_key(job.model or "")
        queued = [it for it in items if it.failure is None]
        if queued:
            self._ensure_group(stream)
        seq = self._r.incr(self._SEQ)
        pipe = self._r.pipeline(transaction=True)
        key = self._job_key(job.id)
        fields = job.to_fields()
        fields["failed"] = json.dumps(job.failed + sum(1 for it in items if it.failure))
        pipe.hset(key, mapping=fields)
        specs = {str(it.index): json.dumps({"custom_id": it.custom_id, "body": it.body,
                                            "external_reference": it.external_reference})
                 for it in items}
        if specs:
            pipe.hset(self._job_key(job.id, "items"), mapping=specs)
        failures = {str(it.index): Outcome(False, it.failure).to_json()
                    for it in items if it.failure is not None}
        if failures:
            pipe.hset(self._job_key(job.id, "results"), mapping=failures)
        pipe.zadd(self._index_key(job.kind, job.key_id), {job.id: seq})
        if job.status not in TERMINAL_STATUSES:
            pipe.sadd(self._ACTIVE, job.id)
        for it in queued:
            pipe.xadd(stream, {"job": job.id, "idx": str(it.index)})
        pipe.execute()

    def get_job(self, job_id: str) -> JobRecord | None:
        raw = self._r.hgetall(self._job_key(job_id))
        return JobRecord.from_fields(raw) if raw else None

    def list_jobs(self, kind: str, key_id: str | None, after: str | None, limit: int
                  ) -> JobPage:
        ids, has_more = self._page(self._index_key(kind, key_id), after, limit)
        jobs = [self.get_job(i) for i in ids]
        return JobPage([j for j in jobs if j is not None], has_more)

    def active_jobs(self) -> list[JobRecord]:
        jobs = [self.get_job(i.decode()) for i in self._r.smembers(self._ACTIVE)]
        return sorted((j for j in jobs if j is not None), key=lambda j: (j.created_at, j.id))

    def transition(self, job_id: str, expect: tuple[str, ...], status: str,
                   **updates: Any) -> JobRecord | None:
        args: list[str] = [str(len(expect)), *(json.dumps(s) for s in expect), json.dumps(status),
                           job_id if status in TERMINAL_STATUSES else ""]
        for name, value in updates.items():
            args += [name, json.dumps(value)]
        raw = self._transition(keys=[self._job_key(job_id), self._ACTIVE], args=args)
        if not raw:
            return None
        return JobRecord.from_fields(dict(zip(raw[::2], raw[1::2], strict=True)))

    # ---- the queue ----------------------------------------------------------------------

    def claim(self, owner: str, models: list[str], n: int) -> list[Claim]:
        claims: list[Claim] = []
        for model in models:
            if len(claims) >= n:
                break
            stream = self._queue_key(model)
            self._ensure_group(stream)
            entries = self._stale(stream, owner, n - len(claims))
            if len(entries) < n - len(claims):
                got = self._r.xreadgroup(GROUP, owner, {stream: ">"},
                                         count=n - len(claims) - len(entries))
                entries += got[0][1] if got else []
            claims += self._to_claims(stream, model, owner, entries)
        return claims

    def _stale(self, stream: str, owner: str, n: int) -> list[tuple[bytes, dict[bytes, bytes]]]:
        """Entries whose lease (idle time) ran out, taken over by this consumer."""
        entries: list[tuple[bytes, dict[bytes, bytes]]] = []
        cursor: bytes | str = "0-0"
        for _ in range(10):  # each call scans a bounded part of the pending list
            cursor, got, *_ = self._r.xautoclaim(stream, GROUP, owner, int(self.lease_s * 1000),
                                                 start_id=cursor, count=n - len(entries))
            entries += [e for e in got if e[1]]
            if len(entries) >= n or cursor in (b"0-0", "0-0"):
                break
        return entries

    def _to_claims(self, stream: str, model: str, owner: str,
                   entries: list[tuple[bytes, dict]]) -> list[Claim]:
        now = int(time.time())
        pipe = self._r.pipeline()
        for _, fields in entries:
            job_id, idx = fields[b"job"].decode(), fields[b"idx"].decode()
            pipe.hmget(self._job_key(job_id), "status", "endpoint", "key_id")
            pipe.hexists(self._job_key(job_id, "results"), idx)
            pipe.hget(self._job_key(job_id, "items"), idx)
            pipe.hincrby(self._job_key(job_id, "attempts"), idx, 1)
            pipe.hsetnx(self._job_key(job_id), "started_at", json.dumps(now))
        replies = pipe.execute()
        claims, stale = [], []
        for i, (entry_id, fields) in enumerate(entries):
            (status, endpoint, key_id), done, spec, attempts, _ = replies[5 * i:5 * i + 5]
            if status is None or json.loads(status) != "in_progress" or done or spec is None:
                stale.append(entry_id)  # a finished, stopped or vanished job's item
                continue
            item = json.loads(spec)
            claims.append(Claim(fields[b"job"].decode(), int(fields[b"idx"]), model, owner,
                                entry_id.decode(), attempts, json.loads(endpoint),
                                json.loads(key_id) if key_id else None, item["custom_id"],
                                item["body"]))
        if stale:
            pipe = self._r.pipeline()
            pipe.xack(stream, GROUP, *stale)
            pipe.xdel(stream, *stale)
            pipe.execute()
        return claims

    def renew(self, owner: str, claims: list[Claim]) -> list[Claim]:
        lost: list[Claim] = []
        by_model: dict[str, list[Claim]] = {}
        for c in claims:
            by_model.setdefault(c.model, []).append(c)
        for model, group in by_model.items():
            gone = {i.decode() for i in self._renew(keys=[self._queue_key(model)],
                                                     args=[GROUP, owner,
                                                           *(c.token for c in group)])}
            lost += [c for c in group if c.token in gone]
        return lost

    def complete(self, claim: Claim, outcome: Outcome) -> bool:
        keys = [self._job_key(claim.job_id, "results"), self._job_key(claim.job_id),
                self._queue_key(claim.model)]
        args = [str(claim.index), outcome.to_json(), "completed" if outcome.ok else "failed",
                outcome.input_tokens, outcome.cached_tokens, outcome.output_tokens, GROUP,
                claim.token]
        return bool(self._complete(keys=keys, args=args))

    def release(self, claim: Claim) -> None:
        self._release(keys=[self._job_key(claim.job_id, "results"), self._queue_key(claim.model)],
                      args=[str(claim.index), GROUP, claim.token, claim.owner, claim.job_id])

    def resolve_rest(self, job_id: str, outcome: Outcome) -> int:
        return int(self._resolve_rest(
            keys=[self._job_key(job_id, "results"), self._job_key(job_id)],
            args=[outcome.to_json(), "completed" if outcome.ok else "failed"]))

    def results(self, job_id: str) -> list[ItemResult]:
        outcomes = self._r.hgetall(self._job_key(job_id, "results"))
        specs = self._r.hmget(self._job_key(job_id, "items"), list(outcomes)) if outcomes else []
        out = []
        for (idx, outcome), spec in zip(outcomes.items(), specs, strict=True):
            item = json.loads(spec) if spec else {}
            out.append(ItemResult(int(idx), item.get("custom_id"),
                                  item.get("external_reference"), Outcome.from_json(outcome)))
        return sorted(out, key=lambda r: r.index)

    def close(self) -> None:
        self._r.close()
