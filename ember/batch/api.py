"""HTTP endpoints of the batch lane: OpenAI's Files and Batches APIs, and queued requests.

Files: POST /v1/files (multipart, purpose "batch"), GET /v1/files, GET/DELETE
/v1/files/{id}, GET /v1/files/{id}/content. Batches: POST /v1/batches, GET /v1/batches
(newest first, `after` / `limit`), GET /v1/batches/{id}, POST /v1/batches/{id}/cancel.
Queued requests ride on POST /v1/chat/completions (see `queue_or`). A key sees only its own
files and jobs. Errors have OpenAI's shape (ember.server.errors).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ember.batch.jobs import (
    DEFAULT_WINDOW,
    ENDPOINTS,
    batch_object,
    check_metadata,
    check_webhook_url,
    new_job,
    not_found,
    parse_batch_file,
    parse_queue_requests,
    queue_status,
)
from ember.batch.runner import Handler
from ember.batch.service import BatchService
from ember.batch.store import TERMINAL_STATUSES, FileRecord, JobRecord
from ember.server.auth import ApiKey
from ember.server.errors import APIError, bad_request
from ember.server.serving import RequestContext, ServerState

MULTIPART_OVERHEAD = 64 * 1024  # form headers and boundaries around the file
FILE_PAGE_MAX = 10_000
BATCH_PAGE_MAX = 100

router = APIRouter()


def _service(request: Request) -> tuple[BatchService, ApiKey]:
    state: ServerState = request.app.state.ember
    key = state.keys.authenticate(request.headers.get("authorization"))
    return request.app.state.batch, key


def _limit(request: Request, default: int, most: int) -> int:
    raw = request.query_params.get("limit")
    if raw is None:
        return default
    if not raw.isdigit() or not 1 <= int(raw) <= most:
        raise bad_request(f"limit: must be an integer in [1, {most}], got {raw!r}", "limit")
    return int(raw)


def _page(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}


def _too_large(limit: int) -> APIError:
    return APIError(413, f"The file is larger than the limit of {limit} bytes",
                    "invalid_request_error", "file", "file_too_large")


# ---- files ------------------------------------------------------------------------------

async def _read_upload(request: Request, limit: int) -> tuple[UploadFile, str]:
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise bad_request("Send the file as multipart/form-data with fields 'file' and "
                          "'purpose'", "file")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit + MULTIPART_OVERHEAD:
        raise _too_large(limit)

    async def limited() -> AsyncIterator[bytes]:
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit + MULTIPART_OVERHEAD:
                raise _too_large(limit)
            yield chunk

    try:
        form = await MultiPartParser(request.headers, limited(), max_files=1,
                                     max_fields=8).parse()
    except MultiPartException as exc:
        raise bad_request(f"The multipart body could not be parsed: {exc.message}") from None
    upload, purpose = form.get("file"), form.get("purpose")
    if not isinstance(upload, UploadFile):
        raise bad_request("you must provide a 'file' parameter", "file")
    if purpose != "batch":
        raise bad_request(f"purpose: only 'batch' is supported, got {purpose!r}", "purpose")
    return upload, purpose


@router.post("/v1/files")
async def create_file(request: Request) -> Response:
    batch, key = _service(request)
    limit = batch.config.max_file_bytes
    upload, purpose = await _read_upload(request, limit)
    content = await upload.read()
    await upload.close()
    if len(content) > limit:
        raise _too_large(limit)
    record = FileRecord(f"file-{uuid.uuid4().hex[:24]}", purpose, upload.filename or "upload",
                        len(content), int(time.time()), key.key_id)
    await batch.run(batch.store.put_file, record, content)
    return JSONResponse(record.to_api())


async def _file(batch: BatchService, key: ApiKey, file_id: str) -> FileRecord:
    record = await batch.run(batch.store.get_file, file_id)
    if record is None or record.key_id != key.key_id:
        raise not_found("file", file_id, "file_id")
    return record


@router.get("/v1/files")
async def list_files(request: Request) -> Response:
    batch, key = _service(request)
    limit = _limit(request, FILE_PAGE_MAX, FILE_PAGE_MAX)
    purpose = request.query_params.get("purpose")
    records, has_more = await batch.run(batch.store.list_files, key.key_id,
                                        request.query_params.get("after"), limit)
    return JSONResponse(_page([r.to_api() for r in records
                               if purpose is None or r.purpose == purpose], has_more))


@router.get("/v1/files/{file_id}")
async def retrieve_file(request: Request, file_id: str) -> Response:
    batch, key = _service(request)
    return JSONResponse((await _file(batch, key, file_id)).to_api())


@router.delete("/v1/files/{file_id}")
async def delete_file(request: Request, file_id: str) -> Response:
    batch, key = _service(request)
    await _file(batch, key, file_id)
    deleted = await batch.run(batch.store.delete_file, file_id)
    return JSONResponse({"id": file_id, "object": "file", "deleted": deleted})


@router.get("/v1/files/{file_id}/content")
async def file_content(request: Request, file_id: str) -> Response:
    batch, key = _service(request)
    await _file(batch, key, file_id)
    content = await batch.run(batch.store.file_content, file_id)
    if content is None:
        raise not_found("file", file_id, "file_id")
    return Response(content, media_type="application/octet-stream")


# ---- batches ----------------------------------------------------------------------------

async def _job(batch: BatchService, key: ApiKey, job_id: str, kind: str) -> JobRecord:
    job = await batch.run(batch.store.get_job, job_id)
    if job is None or job.kind != kind or job.key_id != key.key_id:
        raise not_found("batch" if kind == "batch" else "queued request", job_id,
                        "batch_id" if kind == "batch" else "request_id")
    return job


@router.post("/v1/batches")
async def create_batch(request: Request) -> Response:
    batch, key = _service(request)
    state: ServerState = request.app.state.ember
    body = await state.read_json(request)
    endpoint = body.get("endpoint")
    if endpoint not in ENDPOINTS:
        raise bad_request(f"endpoint: {endpoint!r} is not supported; use one of "
                          f"{', '.join(ENDPOINTS)}", "endpoint", "unsupported_endpoint")
    file_id = body.get("input_file_id")
    if not isinstance(file_id, str):
        raise bad_request("you must provide an 'input_file_id' parameter", "input_file_id")
    window = body.get("completion_window", DEFAULT_WINDOW)
    metadata = check_metadata(body.get("metadata"))
    webhook_url = check_webhook_url(body.get("webhook_url"))
    record = await _file(batch, key, file_id)
    if record.purpose != "batch":
        raise bad_request(f"input_file_id: file {file_id} has purpose '{record.purpose}', "
                          "not 'batch'", "input_file_id")
    content = await batch.run(batch.store.file_content, file_id) or b""
    parsed = await batch.run(parse_batch_file, content, endpoint, batch.models,
                             batch.config.max_requests)
    job = new_job("batch", endpoint, parsed, window, key.key_id, input_file_id=file_id,
                  metadata=metadata, webhook_url=webhook_url)
    await batch.run(batch.store.create_job, job, parsed.queue_order())
    job = await batch.run(batch.store.get_job, job.id) or job  # with the store's counts
    if job.status == "failed":  # no valid request: it ends here
        batch.webhooks.notify(job)
    batch.worker.wake()
    return JSONResponse(batch_object(job))


@router.get("/v1/batches")
async def list_batches(request: Request) -> Response:
    batch, key = _service(request)
    limit = _limit(request, 20, BATCH_PAGE_MAX)
    page = await batch.run(batch.store.list_jobs, "batch", key.key_id,
                           request.query_params.get("after"), limit)
    return JSONResponse(_page([batch_object(j) for j in page.jobs], page.has_more))


@router.get("/v1/batches/{batch_id}")
async def retrieve_batch(request: Request, batch_id: str) -> Response:
    batch, key = _service(request)
    return JSONResponse(batch_object(await _job(batch, key, batch_id, "batch")))


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(request: Request, batch_id: str) -> Response:
    batch, key = _service(request)
    job = await _job(batch, key, batch_id, "batch")
    if job.status == "in_progress":
        job = (await batch.run(batch.store.transition, batch_id, ("in_progress",),
                               "cancelling", cancelling_at=int(time.time()))
               or await batch.run(batch.store.get_job, batch_id))
        batch.worker.wake()
    if job.status not in ("cancelling", "cancelled"):
        raise APIError(409, f"Cannot cancel a batch with status '{job.status}'",
                       "invalid_request_error", "batch_id", "batch_not_cancellable")
    return JSONResponse(batch_object(job))


# ---- queued requests --------------------------------------------------------------------

def _truthy(value: Any) -> bool:
    return value is True or (isinstance(value, str) and value.lower() in ("true", "1", "yes"))


def queue_or(request: Request, handler: Handler) -> Handler:
    """The chat handler, or, for `queueRequest=true` (query or body), the queue: a body of
    `{"requests": [...]}` is queued and answered with a request_id at once; a body of
    `{"request_id": ...}` polls it."""

    async def handle(body: dict[str, Any], ctx: RequestContext) -> Response:
        if not (_truthy(request.query_params.get("queueRequest"))
                or _truthy(body.get("queueRequest"))):
            return await handler(body, ctx)
        batch: BatchService = request.app.state.batch
        if "requests" not in body and "request_id" in body:
            return JSONResponse(await _poll(batch, ctx, body["request_id"]),
                                headers=ctx.response_headers())
        return JSONResponse(await _enqueue(batch, ctx, body), headers=ctx.response_headers())

    return handle


async def _enqueue(batch: BatchService, ctx: RequestContext, body: dict[str, Any]
                   ) -> dict[str, Any]:
    parsed = parse_queue_requests(body, batch.models, batch.config.max_requests)
    if parsed.num_valid == 0:
        first = parsed.errors[0]
        raise bad_request(f"requests[{first['line'] - 1}]: {first['message']}", "requests",
                          first["code"])
    job = new_job("queue", "/v1/chat/completions", parsed,
                  body.get("completion_window", DEFAULT_WINDOW), ctx.key.key_id,
                  webhook_url=check_webhook_url(body.get("webhook_url")))
    await batch.run(batch.store.create_job, job, parsed.queue_order())
    batch.worker.wake()
    return {"status": "queued", "request_id": job.id, "model": job.model}


async def _poll(batch: BatchService, ctx: RequestContext, request_id: Any) -> dict[str, Any]:
    if not isinstance(request_id, str):
        raise bad_request("request_id: must be a string", "request_id")
    job = await _job(batch, ctx.key, request_id, "queue")
    if job.status not in TERMINAL_STATUSES:
        return queue_status(job, None)
    return queue_status(job, await batch.run(batch.store.results, job.id))
