"""Parsing job input line by line, and the lifecycle that finishes jobs (on a SQLite store)."""

from __future__ import annotations

import json
import time

import pytest

from ember.batch.jobs import (
    JobLifecycle,
    batch_object,
    new_job,
    parse_batch_file,
    parse_queue_requests,
    parse_window,
    queue_status,
    result_file_id,
)
from ember.batch.store import Outcome
from ember.batch.store_sqlite import SQLiteStore
from ember.server.errors import APIError

EP = "/v1/chat/completions"
MODELS = ["m", "alias"]


def line(custom_id: object, content: str = "hi", url: str = EP, model: str = "m",
         method: str = "POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url,
                       "body": {"model": model, "messages": [{"role": "user",
                                                              "content": content}]}})


def test_each_bad_line_fails_alone_with_its_line_number() -> None:
    text = "\n".join([
        line("a"),
        "{oops",
        json.dumps([1, 2]),
        line(""),
        line("a"),  # duplicate
        line("b", method="GET"),
        line("c", url="/v1/embeddings"),
        json.dumps({"custom_id": "d", "method": "POST", "url": EP, "body": "text"}),
        line("e", model="unknown"),
        line("f", model="alias"),  # a second model in one job
        "",
        line("g", content="a much longer prompt " * 5),
    ])
    parsed = parse_batch_file(text.encode(), EP, MODELS, 100)
    assert parsed.model == "m" and parsed.num_valid == 2
    codes = [(e["line"], e["code"], e["param"]) for e in parsed.errors]
    assert codes == [(2, "invalid_json", None), (3, "invalid_request", None),
                     (4, "invalid_request", "custom_id"), (5, "duplicate_custom_id", "custom_id"),
                     (6, "invalid_request", "method"), (7, "invalid_url", "url"),
                     (8, "invalid_request", "body"), (9, "model_not_found", "body.model"),
                     (10, "mismatched_model", "body.model")]
    bad = [it for it in parsed.items if it.failure]
    assert bad[0].failure["error"]["message"].startswith("line 2: not valid JSON")
    assert [it.custom_id for it in bad][3:] == ["a", "b", "c", "d", "e", "f"]
    assert [it.custom_id for it in parsed.items if not it.failure] == ["a", "g"]


def test_queue_order_groups_by_prompt_length() -> None:
    lengths = [50, 3, 400, 7, 120]
    text = "\n".join(line(f"r{i}", "w " * n) for i, n in enumerate(lengths))
    parsed = parse_batch_file(text.encode(), EP, MODELS, 100)
    assert [it.index for it in parsed.queue_order()] == [1, 3, 0, 4, 2]


def test_file_level_errors() -> None:
    with pytest.raises(APIError, match="UTF-8"):
        parse_batch_file(b"\xff\xfe", EP, MODELS, 10)
    with pytest.raises(APIError, match="limit is 2") as err:
        parse_batch_file("\n".join(line(f"r{i}") for i in range(3)).encode(), EP, MODELS, 2)
    assert err.value.code == "too_many_requests"


def test_a_job_without_valid_requests_fails_validation() -> None:
    empty = new_job("batch", EP, parse_batch_file(b"\n\n", EP, MODELS, 10), "24h", None)
    assert empty.status == "failed" and empty.errors[0]["code"] == "empty_file"
    bad = new_job("batch", EP, parse_batch_file(b"{", EP, MODELS, 10), "24h", None)
    assert bad.status == "failed" and bad.total == 1 and bad.errors[0]["code"] == "invalid_json"
    obj = batch_object(bad)
    assert obj["errors"]["data"][0]["line"] == 1 and obj["failed_at"] is not None


def test_completion_windows() -> None:
    assert parse_window("24h") == 86400
    assert parse_window("90m") == 5400 and parse_window("2s") == 2
    assert parse_window("7d") == 7 * 86400
    for bad in ("", "0s", "24", "1w", "31d", 5, None):
        with pytest.raises(APIError, match="completion_window"):
            parse_window(bad)


def test_queued_requests_inherit_the_model_and_keep_references() -> None:
    parsed = parse_queue_requests(
        {"model": "alias", "requests": [
            {"messages": [], "external_reference": "x"},
            {"messages": [], "model": "m"},
            "not an object"]}, MODELS, 10)
    assert parsed.model == "alias"
    assert parsed.items[0].external_reference == "x" and "external_reference" not in \
        parsed.items[0].body
    assert [e["code"] for e in parsed.errors] == ["mismatched_model", "invalid_request"]
    for body in ({}, {"requests": []}, {"requests": {"a": 1}}):
        with pytest.raises(APIError, match="requests"):
            parse_queue_requests(body, MODELS, 10)


def make_job(store: SQLiteStore, n: int, window: str = "1h", kind: str = "batch",
             bad: int = 0):
    text = "\n".join([line(f"r{i}") for i in range(n)] + ["{"] * bad)
    parsed = parse_batch_file(text.encode(), EP, MODELS, 100)
    job = new_job(kind, EP, parsed, window, "key", webhook_url="http://x")
    store.create_job(job, parsed.queue_order())
    return job


def ok_outcome(i: int) -> Outcome:
    return Outcome(True, {"response": {"status_code": 200, "body": {"n": i}}, "error": None},
                   10, 2, 3)


def test_finished_jobs_are_finalized_once_with_output_and_error_files(tmp_path) -> None:
    store = SQLiteStore(tmp_path / "b.sqlite", 60.0)
    job = make_job(store, 3, bad=1)
    a, b = JobLifecycle(store, 60.0), JobLifecycle(SQLiteStore(tmp_path / "b.sqlite", 60.0), 60.0)
    assert a.sweep()[1] == []  # nothing finished yet
    for claim in store.claim("w", ["m"], 5):
        store.complete(claim, ok_outcome(claim.index))
    _, done = a.sweep()
    (finished,) = done
    assert finished.status == "completed" and finished.completed_at is not None
    assert b.sweep() == ([], [])  # the other replica finds nothing left to do
    assert finished.output_file_id == result_file_id(job.id, "output")
    out = store.file_content(finished.output_file_id).decode().splitlines()
    err = store.file_content(finished.error_file_id).decode().splitlines()
    assert [json.loads(x)["custom_id"] for x in out] == ["r0", "r1", "r2"]
    assert json.loads(out[1])["response"]["body"] == {"n": 1}
    assert json.loads(err[0])["error"]["code"] == "invalid_json"
    obj = batch_object(store.get_job(job.id))
    assert obj["request_counts"] == {"total": 4, "completed": 3, "failed": 1}
    assert obj["usage"]["input_tokens"] == 30 and obj["usage"]["total_tokens"] == 39
    assert obj["usage"]["input_tokens_details"]["cached_tokens"] == 6


def test_expiry_keeps_what_finished_and_fails_the_rest(tmp_path) -> None:
    store = SQLiteStore(tmp_path / "b.sqlite", 60.0)
    job = make_job(store, 4)
    first, second, *_ = store.claim("w", ["m"], 4)
    store.complete(first, ok_outcome(0))
    lifecycle = JobLifecycle(store, 60.0)
    assert lifecycle.sweep(now=time.time())[1] == []
    (expired,) = lifecycle.sweep(now=job.expires_at + 1)[1]
    assert expired.status == "expired" and expired.expired_at == job.expires_at + 1
    assert (expired.completed, expired.failed) == (1, 3)
    assert not store.complete(second, ok_outcome(1))  # finished too late: not counted
    err = [json.loads(x) for x in store.file_content(expired.error_file_id).splitlines()]
    assert {e["error"]["code"] for e in err} == {"batch_expired"} and len(err) == 3


def test_cancelling_and_a_stale_finalizer(tmp_path) -> None:
    store = SQLiteStore(tmp_path / "b.sqlite", 60.0)
    job = make_job(store, 2, kind="queue")
    store.transition(job.id, ("in_progress",), "cancelling", cancelling_at=1)
    (cancelled,) = JobLifecycle(store, 60.0).sweep()[1]
    assert cancelled.status == "cancelled" and cancelled.failed == 2
    assert cancelled.output_file_id is None  # queued requests are read by polling, not files
    polled = queue_status(cancelled, store.results(job.id))
    assert [r["success"] for r in polled["responses"]] == [False, False]
    assert polled["responses"][0]["result"]["error"]["code"] == "batch_cancelled"
    # a finalizer that died mid-way is taken over once it has been silent long enough
    other = make_job(store, 1)
    store.transition(other.id, ("in_progress",), "finalizing", finalizing_at=100,
                     final_status="completed")
    assert JobLifecycle(store, 60.0).sweep(now=130)[1] == []
    (taken,) = JobLifecycle(store, 60.0).sweep(now=200)[1]
    assert taken.id == other.id and taken.status == "completed"
