"""Jobs: from submitted input to queued items, and from resolved items to a finished job.

A job is a batch (OpenAI Batch API: a JSONL file of requests) or a queued request (one POST
with `{"requests": [...]}`). Submitting validates every request line by line: a bad line
becomes an item that failed at once (it lands in the error file), the rest are queued in
order of prompt length, so that items a worker runs together are of similar length.

`JobLifecycle.sweep` moves active jobs on: a job whose items all have results is finalized
as completed; one past its completion window, or being cancelled, first gives its unfinished
items a `batch_expired` / `batch_cancelled` failure, then is finalized with what finished.
Finalizing writes the output and error files (batches) and calls the job's webhook.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any

from ember.batch.store import BatchStore, FileRecord, ItemResult, ItemSpec, JobRecord, Outcome
from ember.server.errors import APIError, bad_request

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
DEFAULT_WINDOW = "24h"
MAX_WINDOW_S = 30 * 86400
MAX_REPORTED_ERRORS = 100
_WINDOW = re.compile(r"^(\d+)([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_window(value: Any) -> int:
    """Seconds of a completion window such as "24h" (OpenAI's only value), "90m" or "30s"."""
    match = _WINDOW.match(value) if isinstance(value, str) else None
    seconds = int(match.group(1)) * _UNIT_S[match.group(2)] if match else 0
    if not 0 < seconds <= MAX_WINDOW_S:
        raise bad_request(f"completion_window: must be a duration such as '24h', '90m' or "
                          f"'30s', at most 30d; got {value!r}", "completion_window")
    return seconds


def item_id(job_id: str, index: int) -> str:
    """The stable id of an item's result line."""
    return "batch_req_" + hashlib.sha256(f"{job_id}:{index}".encode()).hexdigest()[:24]


def result_file_id(job_id: str, which: str) -> str:
    """Output and error files have ids derived from the job's, so finalizing twice (after a
    crash mid-way) rewrites the same files."""
    return "file-" + hashlib.sha256(f"{job_id}:{which}".encode()).hexdigest()[:24]


def failure(code: str, message: str) -> dict[str, Any]:
    return {"response": None, "error": {"code": code, "message": message}}


def _length(body: dict[str, Any]) -> int:
    """A cheap stand-in for the prompt length: characters of the messages or prompt."""
    if isinstance(body.get("messages"), list):
        return sum(len(json.dumps(m.get("content"))) if isinstance(m, dict) else 0
                   for m in body["messages"])
    return len(json.dumps(body.get("prompt")))


@dataclass
class ParsedInput:
    items: list[ItemSpec]  # by index
    model: str | None  # the one model of the job's valid requests
    errors: list[dict[str, Any]]  # per bad line: code, line, message, param

    def queue_order(self) -> list[ItemSpec]:
        """Failed items first (they never queue), then the rest by prompt length."""
        return sorted(self.items, key=lambda it: (it.failure is None,
                                                  _length(it.body) if it.body else 0, it.index))

    @property
    def num_valid(self) -> int:
        return sum(1 for it in self.items if it.failure is None)


class _Collector:
    """Builds the items one request at a time, holding the job to one model."""

    def __init__(self, served_models: list[str]) -> None:
        self.served = served_models
        self.items: list[ItemSpec] = []
        self.errors: list[dict[str, Any]] = []
        self.model: str | None = None

    def bad(self, code: str, message: str, param: str | None, custom_id: str | None = None,
            reference: Any = None) -> None:
        index = len(self.items)
        line = index + 1
        if len(self.errors) < MAX_REPORTED_ERRORS:
            self.errors.append({"code": code, "line": line, "message": message, "param": param})
        self.items.append(ItemSpec(index, custom_id, None, reference,
                                   failure(code, f"line {line}: {message}")))

    def good(self, body: dict[str, Any], custom_id: str | None, reference: Any = None) -> None:
        model = body.get("model")
        if not isinstance(model, str):
            return self.bad("invalid_request", "body.model: must be a string", "body.model",
                            custom_id, reference)
        if model not in self.served:
            return self.bad("model_not_found", f"The model '{model}' does not exist",
                            "body.model", custom_id, reference)
        if self.model is None:
            self.model = model
        elif model != self.model:
            return self.bad("mismatched_model", f"all requests of a job must use one model: "
                            f"expected '{self.model}', got '{model}'", "body.model", custom_id,
                            reference)
        self.items.append(ItemSpec(len(self.items), custom_id, body, reference))

    def parsed(self) -> ParsedInput:
        return ParsedInput(self.items, self.model, self.errors)


def parse_batch_file(content: bytes, endpoint: str, served_models: list[str],
                     max_requests: int) -> ParsedInput:
    """The requests of a batch input file, one JSON object a line (blank lines skipped)."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError:
        raise bad_request("input_file_id: the file is not UTF-8 text", "input_file_id") from None
    lines = [line for line in text.splitlines() if line.strip()]
    if len(lines) > max_requests:
        raise bad_request(f"input_file_id: the file has {len(lines)} requests; the limit is "
                          f"{max_requests}", "input_file_id", "too_many_requests")
    out = _Collector(served_models)
    seen: set[str] = set()
    for line in lines:
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            out.bad("invalid_json", f"not valid JSON: {exc}", None)
            continue
        if not isinstance(obj, dict):
            out.bad("invalid_request", "each line must be a JSON object", None)
            continue
        custom_id = obj.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            out.bad("invalid_request", "custom_id: must be a non-empty string", "custom_id")
        elif custom_id in seen:
            out.bad("duplicate_custom_id", f"custom_id '{custom_id}' is used more than once",
                    "custom_id", custom_id)
        elif obj.get("method") != "POST":
            out.bad("invalid_request", "method: must be 'POST'", "method", custom_id)
        elif obj.get("url") != endpoint:
            out.bad("invalid_url", f"url: must be the batch's endpoint '{endpoint}', got "
                    f"{obj.get('url')!r}", "url", custom_id)
        elif not isinstance(obj.get("body"), dict):
            out.bad("invalid_request", "body: must be a JSON object", "body", custom_id)
        else:
            out.good(obj["body"], custom_id)
        if isinstance(custom_id, str):
            seen.add(custom_id)
    return out.parsed()


def parse_queue_requests(body: dict[str, Any], served_models: list[str],
                         max_requests: int) -> ParsedInput:
    """The `requests` of a queued request; each inherits the top-level `model`."""
    requests = body.get("requests")
    if not isinstance(requests, list) or not requests:
        raise bad_request("requests: must be a non-empty list of chat completion requests",
                          "requests")
    if len(requests) > max_requests:
        raise bad_request(f"requests: {len(requests)} requests; the limit is {max_requests}",
                          "requests", "too_many_requests")
    default_model = body.get("model", served_models[0])
    out = _Collector(served_models)
    for request in requests:
        if not isinstance(request, dict):
            out.bad("invalid_request", "each request must be a JSON object", None)
            continue
        request = dict(request)
        reference = request.pop("external_reference", None)
        request.setdefault("model", default_model)
        out.good(request, None, reference)
    return out.parsed()


def check_webhook_url(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.startswith(("http://", "https://")):
        raise bad_request("webhook_url: must be an http:// or https:// URL", "webhook_url")
    return value


def check_metadata(value: Any) -> dict[str, str] | None:
    """OpenAI's rule: at most 16 pairs, keys up to 64 and values up to 512 characters."""
    if value is None:
        return None
    if (not isinstance(value, dict) or len(value) > 16
            or any(not isinstance(k, str) or not isinstance(v, str) or len(k) > 64
                   or len(v) > 512 for k, v in value.items())):
        raise bad_request("metadata: at most 16 string pairs, keys up to 64 and values up to "
                          "512 characters", "metadata")
    return value


def new_job(kind: str, endpoint: str, parsed: ParsedInput, window: str, key_id: str | None,
            **fields: Any) -> JobRecord:
    """The job for parsed input: in progress, or failed when no request is valid."""
    now = int(time.time())
    job_id = f"batch_{uuid.uuid4().hex}" if kind == "batch" else str(uuid.uuid4())
    job = JobRecord(id=job_id, kind=kind, endpoint=endpoint, model=parsed.model,
                    status="in_progress", created_at=now, expires_at=now + parse_window(window),
                    completion_window=window, total=len(parsed.items), key_id=key_id,
                    errors=parsed.errors, in_progress_at=now, **fields)
    if parsed.num_valid == 0:
        job.status, job.failed_at, job.in_progress_at = "failed", now, None
        if not job.errors:
            job.errors = [{"code": "empty_file", "line": None, "param": None,
                           "message": "the input has no requests"}]
    return job


# ---- API objects ------------------------------------------------------------------------

def batch_object(job: JobRecord) -> dict[str, Any]:
    """The OpenAI Batch object."""
    return {
        "id": job.id, "object": "batch", "endpoint": job.endpoint, "model": job.model,
        "errors": {"object": "list", "data": job.errors} if job.errors else None,
        "input_file_id": job.input_file_id, "completion_window": job.completion_window,
        "status": job.status, "output_file_id": job.output_file_id,
        "error_file_id": job.error_file_id, "created_at": job.created_at,
        "in_progress_at": job.in_progress_at, "expires_at": job.expires_at,
        "finalizing_at": job.finalizing_at, "completed_at": job.completed_at,
        "failed_at": job.failed_at, "expired_at": job.expired_at,
        "cancelling_at": job.cancelling_at, "cancelled_at": job.cancelled_at,
        "request_counts": {"total": job.total, "completed": job.completed,
                           "failed": job.failed},
        "metadata": job.metadata,
        "usage": {"input_tokens": job.input_tokens,
                  "input_tokens_details": {"cached_tokens": job.cached_tokens},
                  "output_tokens": job.output_tokens,
                  "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": job.input_tokens + job.output_tokens},
    }


def queue_status(job: JobRecord, results: list[ItemResult] | None) -> dict[str, Any]:
    """A queued request polled: its status while active, its responses once finished."""
    if results is None:
        status = "running" if job.started_at is not None else "queued"
        return {"status": status, "request_id": job.id}
    responses = []
    for r in results:
        line = r.outcome.line
        response = line.get("response")
        result = response["body"] if response else {"error": line.get("error")}
        responses.append({"id": r.index, "result": result, "success": r.outcome.ok,
                          "external_reference": r.external_reference})
    return {"status": job.status, "request_id": job.id, "responses": responses,
            "usage": {"prompt_tokens": job.input_tokens, "completion_tokens": job.output_tokens,
                      "total_tokens": job.input_tokens + job.output_tokens,
                      "prompt_tokens_details": {"cached_tokens": job.cached_tokens}}}


def not_found(what: str, object_id: str, param: str) -> APIError:
    return APIError(404, f"No {what} found with id '{object_id}'", "invalid_request_error",
                    param, "not_found")


# ---- finishing jobs ---------------------------------------------------------------------

STOP_CODES = {"expired": ("batch_expired", "This request could not be executed before the "
                                           "completion window expired."),
              "cancelled": ("batch_cancelled", "This request was not executed because the "
                                               "batch was cancelled.")}


class JobLifecycle:
    """Sweeps active jobs: completion, expiry, cancellation, finalization (store calls only;
    the worker runs it in a thread)."""

    def __init__(self, store: BatchStore, stale_after_s: float) -> None:
        self.store = store
        self.stale_after_s = stale_after_s  # a finalizer silent this long is taken over

    def sweep(self, now: float | None = None) -> tuple[list[JobRecord], list[JobRecord]]:
        """(the active jobs as found, the jobs this call finished)."""
        now = time.time() if now is None else now
        active = self.store.active_jobs()
        finished = []
        for job in active:
            done = None
            if job.status == "in_progress" and job.resolved >= job.total:
                done = self.finalize(job, "completed", now)
            elif job.status == "in_progress" and now >= job.expires_at:
                done = self.stop(job, "expired", now)
            elif job.status == "cancelling":
                done = self.stop(job, "cancelled", now)
            elif (job.status == "finalizing" and job.finalizing_at is not None
                  and now - job.finalizing_at > self.stale_after_s):
                done = self.finalize(job, job.final_status or "completed", now)
            if done is not None:
                finished.append(done)
        return active, finished

    def stop(self, job: JobRecord, target: str, now: float) -> JobRecord | None:
        code, message = STOP_CODES[target]
        self.store.resolve_rest(job.id, Outcome(False, failure(code, message)))
        return self.finalize(job, target, now)

    def finalize(self, job: JobRecord, target: str, now: float) -> JobRecord | None:
        claimed = self.store.transition(job.id, (job.status,), "finalizing",
                                        finalizing_at=int(now), final_status=target)
        if claimed is None:
            return None  # another replica got there first
        updates: dict[str, Any] = {f"{target}_at": int(now)}
        if job.kind == "batch":
            updates.update(self._write_files(claimed, now))
        return self.store.transition(job.id, ("finalizing",), target, **updates)

    def _write_files(self, job: JobRecord, now: float) -> dict[str, str | None]:
        lines: dict[bool, list[str]] = {True: [], False: []}
        for r in self.store.results(job.id):
            line = {"id": item_id(job.id, r.index), "custom_id": r.custom_id, **r.outcome.line}
            lines[r.outcome.ok].append(json.dumps(line, ensure_ascii=False))
        ids: dict[str, str | None] = {}
        for ok, field_name, which in ((True, "output_file_id", "output"),
                                      (False, "error_file_id", "error")):
            if not lines[ok]:
                ids[field_name] = None
                continue
            content = ("\n".join(lines[ok]) + "\n").encode()
            record = FileRecord(result_file_id(job.id, which), "batch_output",
                                f"{job.id}_{which}.jsonl", len(content), int(now), job.key_id)
            self.store.put_file(record, content)
            ids[field_name] = record.id
        return ids
