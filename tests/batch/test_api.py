"""The batch lane's HTTP API against a real `ember serve` (SQLite store), with the official
openai client: files and batches, queued requests, pagination, cancel, expiry, webhooks, bad
input, and the discount in the ledger. One server for the module."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time

import httpx
import openai
import pytest

from ember.server.billing import Ledger, Prices

WEBHOOK_SECRET = "test-secret"
MAX_FILE_BYTES = 65536


@pytest.fixture(scope="module")
def server(ember_servers, tiny_llama_dir, tmp_path_factory, kit):
    folder = tmp_path_factory.mktemp("batch_api")
    srv = ember_servers(tiny_llama_dir, "--served-model-name", kit.MODEL, "--dtype", "float32",
                        "--num-kv-blocks", "256", "--max-model-len", "512",
                        "--ledger", str(folder / "ledger.sqlite"),
                        "--batch-store", f"sqlite:///{folder / 'batch.sqlite'}",
                        "--batch-max-inflight", "8", "--batch-poll-interval", "0.1",
                        "--batch-lease-seconds", "10", "--batch-max-file-bytes",
                        str(MAX_FILE_BYTES), "--batch-webhook-backoff", "0.2",
                        "--batch-webhook-secret", WEBHOOK_SECRET)
    srv.ledger_path = folder / "ledger.sqlite"
    return srv


@pytest.fixture(scope="module")
def client(server, kit) -> openai.OpenAI:
    return kit.client_for(server.url)


def upload(client: openai.OpenAI, content: bytes) -> str:
    return client.files.create(file=("input.jsonl", content), purpose="batch").id


def wait_idle(url: str, timeout: float = 20.0) -> None:
    """Until the engine has no open request (in-flight items of a stopped job are aborted)."""
    deadline = time.monotonic() + timeout
    while httpx.get(f"{url}/health").json()["open_requests"]:
        assert time.monotonic() < deadline, "batch items still running after their job stopped"
        time.sleep(0.05)


def test_a_50_item_batch_through_the_openai_client(client, server, kit) -> None:
    content = kit.batch_file(50) + b"{not json\n" + kit.chat_line(
        "wrong-url", "hi").replace("/v1/chat/completions", "/v1/completions").encode() + b"\n"
    file_id = upload(client, content)
    assert client.files.retrieve(file_id).bytes == len(content)
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"suite": "batch"})
    assert batch.status == "in_progress" and batch.request_counts.total == 52
    assert batch.request_counts.failed == 2  # the bad lines failed at once
    assert batch.metadata == {"suite": "batch"} and batch.expires_at == batch.created_at + 86400
    done = kit.wait_batch(client, batch.id)
    assert done.status == "completed"
    assert (done.request_counts.completed, done.request_counts.failed) == (50, 2)
    assert done.in_progress_at <= done.finalizing_at <= done.completed_at
    out = kit.read_lines(client, done.output_file_id)
    assert sorted(line["custom_id"] for line in out) == sorted(f"req-{i}" for i in range(50))
    assert len({line["id"] for line in out}) == 50
    for line in out:
        body = line["response"]["body"]
        assert line["response"]["status_code"] == 200 and line["error"] is None
        assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] == 4
    err = kit.read_lines(client, done.error_file_id)
    assert [e["error"]["code"] for e in err] == ["invalid_json", "invalid_url"]
    assert err[1]["custom_id"] == "wrong-url" and err[0]["error"]["message"].startswith("line 51")
    usage = done.usage
    assert usage.output_tokens == 200
    assert usage.input_tokens == sum(x["response"]["body"]["usage"]["prompt_tokens"] for x in out)
    assert client.files.retrieve(done.output_file_id).purpose == "batch_output"
    # every item went through the chat handler in the batch lane, billed at half price
    request_ids = {x["response"]["request_id"] for x in out}
    rows = [e for e in Ledger(server.ledger_path).entries() if e.request_id in request_ids]
    assert len(rows) == 50 and {(r.lane, r.endpoint, r.status) for r in rows} == {
        ("batch", "chat.completions", "ok")}
    for r in rows:
        full, _ = Prices().cost(r.prompt_tokens, r.cached_tokens, r.completion_tokens)
        assert r.cost_usd == pytest.approx(full * 0.5)


def test_a_completions_batch(client, kit) -> None:
    lines = [json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"model": kit.MODEL, "prompt": f"Once upon a time {i}",
                                  "max_tokens": 3, "ignore_eos": True, "stream": True}})
             for i in range(3)]
    batch = client.batches.create(input_file_id=upload(client, "\n".join(lines).encode()),
                                  endpoint="/v1/completions", completion_window="1h")
    done = kit.wait_batch(client, batch.id)
    assert (done.status, done.request_counts.completed) == ("completed", 3)
    bodies = [x["response"]["body"] for x in kit.read_lines(client, done.output_file_id)]
    assert all(b["object"] == "text_completion" and b["usage"]["completion_tokens"] == 3
               for b in bodies)  # streaming is off in a batch


def test_50_queued_requests(server, kit) -> None:
    url = f"{server.url}/v1/chat/completions"
    requests = [{"messages": [{"role": "user", "content": "say " + "a " * (i % 5)}],
                 "max_tokens": 3, "ignore_eos": True, "external_reference": f"ref-{i}"}
                for i in range(50)]
    answer = httpx.post(url, params={"queueRequest": "true"},
                        json={"model": kit.MODEL, "requests": requests}, timeout=30).json()
    assert answer["status"] == "queued" and answer["model"] == kit.MODEL
    seen, deadline = set(), time.monotonic() + 90
    while True:  # polling: the body form of the flag this time
        polled = httpx.post(url, json={"queueRequest": True,
                                       "request_id": answer["request_id"]}).json()
        if "responses" in polled:
            break
        seen.add(polled["status"])
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert seen <= {"queued", "running"} and polled["status"] == "completed"
    responses = polled["responses"]
    assert sorted(r["id"] for r in responses) == list(range(50))
    assert all(r["success"] and r["external_reference"] == f"ref-{r['id']}" for r in responses)
    assert all(r["result"]["usage"]["completion_tokens"] == 3 for r in responses)
    assert polled["usage"]["completion_tokens"] == 150
    assert polled["usage"]["prompt_tokens"] == sum(r["result"]["usage"]["prompt_tokens"]
                                                   for r in responses)
    missing = httpx.post(url, params={"queueRequest": "1"}, json={"request_id": "nope"})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "request_id"
    empty = httpx.post(url, params={"queueRequest": "1"}, json={"requests": ["x"]})
    assert empty.status_code == 400 and "requests[0]" in empty.json()["error"]["message"]


def test_listing_pages_newest_first(client, kit) -> None:
    file_id = upload(client, kit.batch_file(1))
    ids = [client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                 completion_window="24h").id for _ in range(3)]
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == ids[::-1][:2] and first.has_more
    second = client.batches.list(limit=2, after=first.data[-1].id)
    assert second.data[0].id == ids[0]
    everything = [b.id for b in client.batches.list(limit=2)]  # the client follows the pages
    assert everything[:3] == ids[::-1] and len(everything) == len(set(everything))
    for batch_id in ids:
        kit.wait_batch(client, batch_id)


def mixed_file(kit) -> bytes:
    """8 quick requests (short prompts: queued first), then 56 that take long."""
    quick = [kit.chat_line(f"quick-{i}", "hi", max_tokens=2) for i in range(8)]
    slow = [kit.chat_line(f"slow-{i}", f"please write a long story {i}", max_tokens=400)
            for i in range(56)]
    return ("\n".join(quick + slow) + "\n").encode()


def check_partial(client, kit, done, code: str) -> None:
    counts = done.request_counts
    assert counts.completed >= 8 and counts.failed >= 1
    assert counts.completed + counts.failed == counts.total == 64
    out = kit.read_lines(client, done.output_file_id)
    err = kit.read_lines(client, done.error_file_id)
    assert len(out) == counts.completed and len(err) == counts.failed
    assert {e["error"]["code"] for e in err} == {code}
    ids = [x["custom_id"] for x in out + err]
    assert len(ids) == len(set(ids)) == 64  # every item once, in one file or the other


def test_cancel_keeps_what_finished(client, server, kit) -> None:
    batch = client.batches.create(input_file_id=upload(client, mixed_file(kit)),
                                  endpoint="/v1/chat/completions", completion_window="24h")
    kit.wait_batch(client, batch.id, until=lambda b: b.request_counts.completed >= 8)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = kit.wait_batch(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at >= done.cancelling_at
    check_partial(client, kit, done, "batch_cancelled")
    wait_idle(server.url)
    assert client.batches.cancel(batch.id).status == "cancelled"  # idempotent
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(kit.wait_batch(client, client.batches.create(
            input_file_id=upload(client, kit.batch_file(1)), endpoint="/v1/chat/completions",
            completion_window="24h").id).id)


def test_expiry_keeps_what_finished(client, server, kit) -> None:
    batch = client.batches.create(input_file_id=upload(client, mixed_file(kit)),
                                  endpoint="/v1/chat/completions", completion_window="2s")
    assert batch.expires_at == batch.created_at + 2
    done = kit.wait_batch(client, batch.id)
    assert done.status == "expired" and done.expired_at >= done.expires_at
    check_partial(client, kit, done, "batch_expired")
    wait_idle(server.url)


def test_webhook_on_completion_is_retried_and_signed(client, kit, receiver) -> None:
    receiver.statuses = [500]
    batch = client.batches.create(input_file_id=upload(client, kit.batch_file(2)),
                                  endpoint="/v1/chat/completions", completion_window="24h",
                                  extra_body={"webhook_url": receiver.url})
    kit.wait_batch(client, batch.id)
    deadline = time.monotonic() + 20
    while len(receiver.calls) < 2:
        assert time.monotonic() < deadline, f"webhook calls: {len(receiver.calls)}"
        time.sleep(0.05)
    (_, headers, body), (_, headers2, body2) = receiver.calls
    event = json.loads(body)
    assert event["type"] == "batch.completed" and event["data"]["id"] == batch.id
    assert body2 == body and headers2["webhook-id"] == headers["webhook-id"]
    signed = f"{headers['webhook-id']}.{headers['webhook-timestamp']}.".encode() + body
    mac = hmac.new(WEBHOOK_SECRET.encode(), signed, hashlib.sha256).digest()
    assert headers["webhook-signature"] == "v1," + base64.b64encode(mac).decode()


def test_bad_input_answers_clear_errors(client, server, kit) -> None:
    file_id = upload(client, kit.batch_file(1))
    with pytest.raises(openai.BadRequestError) as err:
        client.batches.create(input_file_id=file_id, endpoint="/v1/embeddings",
                              completion_window="24h")
    assert err.value.code == "unsupported_endpoint" and "/v1/embeddings" in err.value.message
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                              completion_window="forever")
    with pytest.raises(openai.APIStatusError) as err:
        upload(client, b"x" * (MAX_FILE_BYTES + 1))
    assert err.value.status_code == 413 and err.value.code == "file_too_large"
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("a.jsonl", b"{}"), purpose="fine-tune")
    for call in (lambda: client.batches.retrieve("batch_unknown"),
                 lambda: client.batches.cancel("batch_unknown"),
                 lambda: client.files.retrieve("file-unknown"),
                 lambda: client.files.content("file-unknown"),
                 lambda: client.batches.create(input_file_id="file-unknown",
                                               endpoint="/v1/chat/completions",
                                               completion_window="24h")):
        with pytest.raises(openai.NotFoundError, match="unknown"):
            call()
    failed = client.batches.create(input_file_id=upload(client, b"{nope\n[]\n"),
                                   endpoint="/v1/chat/completions", completion_window="24h")
    assert failed.status == "failed" and failed.failed_at is not None
    assert failed.request_counts.failed == failed.request_counts.total == 2
    assert [e.line for e in failed.errors.data] == [1, 2]
    assert client.batches.retrieve(failed.id).status == "failed"
    raw = httpx.post(f"{server.url}/v1/files", content=b"not multipart",
                     headers={"content-type": "application/jsonl"})
    assert raw.status_code == 400 and raw.json()["error"]["param"] == "file"


def test_files_list_and_delete(client) -> None:
    file_id = upload(client, b'{"a": 1}\n')
    assert file_id in [f.id for f in client.files.list(purpose="batch")]
    assert client.files.delete(file_id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(file_id)
