"""The store contract on both backends: a SQLite file and a real redis-server."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
import redis

from ember.batch.store import BatchStore, FileRecord, ItemSpec, JobRecord, Outcome
from ember.batch.store_redis import RedisStore
from ember.batch.store_sqlite import SQLiteStore

LEASE = 60.0
SHORT = 0.3


@pytest.fixture(params=["sqlite", "redis"])
def open_store(request, tmp_path, redis_url) -> Iterator[Callable[..., BatchStore]]:
    """A factory: each call is another connection to the same store (another replica)."""
    if request.param == "redis":
        redis.Redis.from_url(redis_url).flushdb()
    opened: list[BatchStore] = []

    def make(lease_s: float = LEASE) -> BatchStore:
        store = (SQLiteStore(tmp_path / "batch.sqlite", lease_s) if request.param == "sqlite"
                 else RedisStore(redis_url, lease_s))
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()


def job(job_id: str, total: int, model: str = "m", kind: str = "batch", **kw) -> JobRecord:
    now = int(time.time())
    return JobRecord(id=job_id, kind=kind, endpoint="/v1/chat/completions", model=model,
                     status="in_progress", created_at=now, expires_at=now + 3600,
                     completion_window="1h", total=total, **kw)


def items(n: int, bad: tuple[int, ...] = ()) -> list[ItemSpec]:
    return [ItemSpec(i, f"c{i}", None if i in bad else {"model": "m", "n": i}, f"ref{i}",
                     {"response": None, "error": {"code": "x"}} if i in bad else None)
            for i in range(n)]


def ok(tokens: int = 1) -> Outcome:
    return Outcome(True, {"response": {"status_code": 200}, "error": None}, 3, 1, tokens)


def test_claims_follow_queue_order_and_are_leased(open_store) -> None:
    store = open_store()
    store.create_job(job("j1", 4), items(4))
    first = store.claim("a", ["m"], 3)
    assert [c.index for c in first] == [0, 1, 2]
    assert all(c.attempts == 1 and c.owner == "a" and c.body["n"] == c.index for c in first)
    assert store.get_job("j1").started_at is not None
    second = store.claim("b", ["m"], 3)
    assert [c.index for c in second] == [3]  # the leased ones are not handed out twice
    assert store.claim("b", ["m"], 3) == []
    assert store.claim("b", ["other-model"], 3) == []


def test_failed_items_are_counted_and_never_queued(open_store) -> None:
    store = open_store()
    store.create_job(job("j1", 3), items(3, bad=(1,)))
    assert store.get_job("j1").failed == 1
    assert [c.index for c in store.claim("a", ["m"], 5)] == [0, 2]
    (result,) = store.results("j1")
    assert (result.index, result.custom_id, result.external_reference) == (1, "c1", "ref1")
    assert not result.outcome.ok


def test_an_expired_lease_is_claimed_again_and_the_result_written_once(open_store) -> None:
    store = open_store(SHORT)
    store.create_job(job("j1", 1), items(1))
    (stale,) = store.claim("dead-worker", ["m"], 1)
    assert open_store(SHORT).claim("live-worker", ["m"], 1) == []
    time.sleep(SHORT + 0.15)
    (again,) = open_store(SHORT).claim("live-worker", ["m"], 1)
    assert (again.index, again.attempts, again.owner) == (0, 2, "live-worker")
    writes = [store.complete(again, ok(5)), store.complete(stale, ok(7))]
    assert writes.count(True) == 1  # exactly one of the two runs is recorded
    record = store.get_job("j1")
    assert (record.completed, record.failed) == (1, 0)
    assert record.output_tokens in (5, 7) and record.input_tokens == 3
    assert len(store.results("j1")) == 1
    assert store.claim("x", ["m"], 1) == []


def test_renew_keeps_a_lease_and_names_the_lost_ones(open_store) -> None:
    store, other = open_store(SHORT), open_store(SHORT)
    store.create_job(job("j1", 2), items(2))
    mine = store.claim("a", ["m"], 2)
    for _ in range(3):
        time.sleep(SHORT / 2)
        assert store.renew("a", mine) == []
    assert other.claim("b", ["m"], 2) == []  # renewed: not stale
    time.sleep(SHORT + 0.15)
    stolen = other.claim("b", ["m"], 1)
    assert len(stolen) == 1
    lost = store.renew("a", mine)
    assert [c.index for c in lost] == [stolen[0].index]


def test_release_requeues_at_once_and_only_for_the_holder(open_store) -> None:
    store = open_store()
    store.create_job(job("j1", 1), items(1))
    (claim,) = store.claim("a", ["m"], 1)
    store.release(claim)
    (again,) = store.claim("b", ["m"], 1)
    store.release(claim)  # no longer a's: nothing happens
    assert store.claim("c", ["m"], 1) == []
    assert store.complete(again, ok())
    store.release(again)  # finished: nothing to put back
    assert store.claim("c", ["m"], 1) == []


def test_resolve_rest_fails_what_has_no_result(open_store) -> None:
    store = open_store()
    store.create_job(job("j1", 4), items(4))
    c0, c1 = store.claim("a", ["m"], 2)
    assert store.complete(c0, ok())
    expired = Outcome(False, {"response": None, "error": {"code": "batch_expired"}})
    assert store.resolve_rest("j1", expired) == 3
    assert store.resolve_rest("j1", expired) == 0
    assert not store.complete(c1, ok())  # too late: it already has its expiry result
    record = store.get_job("j1")
    assert (record.completed, record.failed) == (1, 3)
    outcomes = [r.outcome for r in store.results("j1")]
    assert [o.ok for o in outcomes] == [True, False, False, False]
    assert store.claim("a", ["m"], 5) == []


def test_transition_is_compare_and_set(open_store) -> None:
    store = open_store()
    store.create_job(job("j1", 1), items(1))
    won = store.transition("j1", ("in_progress",), "cancelling", cancelling_at=5)
    assert won.status == "cancelling" and won.cancelling_at == 5
    assert store.transition("j1", ("in_progress",), "finalizing") is None
    assert store.claim("a", ["m"], 1) == []  # a stopping job's items are not handed out
    assert [j.id for j in store.active_jobs()] == ["j1"]
    done = store.transition("j1", ("cancelling",), "cancelled", cancelled_at=6,
                            output_file_id="file-x")
    assert (done.status, done.cancelled_at, done.output_file_id) == ("cancelled", 6, "file-x")
    assert store.get_job("j1").status == "cancelled"
    assert store.active_jobs() == []
    assert store.transition("nope", ("in_progress",), "cancelled") is None


def test_jobs_are_listed_newest_first_by_kind_and_key(open_store) -> None:
    store = open_store()
    for i in range(5):
        store.create_job(job(f"j{i}", 1, key_id="k1"), items(1))
    store.create_job(job("other-key", 1, key_id="k2"), items(1))
    store.create_job(job("queued", 1, kind="queue", key_id="k1"), items(1))
    page = store.list_jobs("batch", "k1", None, 2)
    assert [j.id for j in page.jobs] == ["j4", "j3"] and page.has_more
    page = store.list_jobs("batch", "k1", "j3", 2)
    assert [j.id for j in page.jobs] == ["j2", "j1"] and page.has_more
    page = store.list_jobs("batch", "k1", "j1", 2)
    assert [j.id for j in page.jobs] == ["j0"] and not page.has_more
    assert [j.id for j in store.list_jobs("queue", "k1", None, 10).jobs] == ["queued"]
    assert [j.id for j in store.list_jobs("batch", "k2", None, 10).jobs] == ["other-key"]


def test_files(open_store) -> None:
    store = open_store()
    for i in range(3):
        store.put_file(FileRecord(f"file-{i}", "batch", f"f{i}.jsonl", 3, 100 + i, "k"),
                       b"abc")
    assert store.get_file("file-1") == FileRecord("file-1", "batch", "f1.jsonl", 3, 101, "k")
    assert store.file_content("file-2") == b"abc"
    records, more = store.list_files("k", None, 2)
    assert [r.id for r in records] == ["file-2", "file-1"] and more
    assert store.delete_file("file-2") and not store.delete_file("file-2")
    assert store.get_file("file-2") is None and store.file_content("file-2") is None
    assert store.list_files(None, None, 10) == ([], False)


def test_replicas_claiming_at_once_never_share_an_item(open_store) -> None:
    open_store().create_job(job("j1", 120), items(120))
    got: dict[str, list[int]] = {}

    def worker(name: str) -> None:
        store = open_store()
        mine = got.setdefault(name, [])
        while claims := store.claim(name, ["m"], 5):
            mine += [c.index for c in claims]
            for c in claims:
                assert store.complete(c, ok())

    threads = [threading.Thread(target=worker, args=(f"w{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    everything = [i for indices in got.values() for i in indices]
    assert sorted(everything) == list(range(120))
    assert open_store().get_job("j1").completed == 120
