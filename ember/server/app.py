"""The FastAPI application: routes, error handlers, and the lifespan that owns the engine."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ember import __doc__ as ember_doc
from ember.batch.api import queue_or
from ember.batch.api import router as batch_router
from ember.batch.service import BatchService
from ember.config import EngineConfig
from ember.engine.async_engine import AsyncEngine, EngineDeadError
from ember.server.auth import ApiKeys, RateLimiter
from ember.server.billing import Ledger, PriceTable
from ember.server.chat import ChatHandler
from ember.server.completions import CompletionHandler
from ember.server.config import ServerConfig
from ember.server.errors import APIError, engine_unavailable
from ember.server.metrics import ServerMetrics
from ember.server.serving import RequestContext, ServerState, cancel_on_disconnect

logger = logging.getLogger(__name__)

Handler = Callable[[dict[str, Any], RequestContext], Awaitable[Response]]

_STATUS_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                 405: "invalid_request_error", 429: "rate_limit_error"}


async def start_state(config: ServerConfig, engine_config: EngineConfig) -> ServerState:
    """Everything the routes need; the engine core process is spawned here."""
    prices = PriceTable.from_file(config.price_file)
    keys = ApiKeys.from_config(config)
    ledger = Ledger(config.ledger)
    try:
        engine = await AsyncEngine.launch(engine_config)
    except BaseException:
        ledger.close()
        raise
    names = config.served_model_names or [engine.model_name]
    metrics = ServerMetrics(names[0], lambda: engine.status, lambda: engine.is_alive)
    logger.info("serving %s (max_model_len %d) with the engine core in process %s",
                ", ".join(names), engine.max_model_len, engine.core_pid)
    return ServerState(config, engine, engine.tokenizer, names, keys, RateLimiter(), prices,
                       ledger, metrics)


def build_app(config: ServerConfig, engine_config: EngineConfig) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state = await start_state(config, engine_config)
        app.state.ember = state
        app.state.chat = ChatHandler(state)
        app.state.completions = CompletionHandler(state)
        app.state.started = int(time.time())
        app.state.batch = None
        try:
            app.state.batch = await BatchService.for_server(state, app.state.chat.create,
                                                            app.state.completions.create)
            yield
        finally:
            if app.state.batch is not None:
                await app.state.batch.stop()
            await state.engine.shutdown()
            state.ledger.close()

    app = FastAPI(title="ember", description=ember_doc, lifespan=lifespan, docs_url=None,
                  redoc_url=None)
    _add_error_handlers(app)
    app.include_router(batch_router)

    @app.get("/health")
    async def health(request: Request) -> Response:
        state: ServerState = request.app.state.ember
        engine = state.engine
        status = engine.status
        integrity_error = status.integrity_error if status else None
        ok = engine.is_alive and integrity_error is None
        body = {"status": "ok" if ok else "unhealthy",
                "engine": "running" if engine.is_alive else engine.dead_reason,
                "kv_integrity": integrity_error or "ok",
                "kv_integrity_checks": status.integrity_checks if status else 0,
                "open_requests": engine.num_open_requests()}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        state: ServerState = request.app.state.ember
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models(request: Request) -> Response:
        state: ServerState = request.app.state.ember
        state.keys.authenticate(request.headers.get("authorization"))
        return JSONResponse({"object": "list",
                             "data": [_model_card(request, name) for name in state.model_names]})

    @app.get("/v1/models/{model:path}")
    async def get_model(request: Request, model: str) -> Response:
        state: ServerState = request.app.state.ember
        state.keys.authenticate(request.headers.get("authorization"))
        state.check_model(model)
        return JSONResponse(_model_card(request, model))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _generate(request, "chat.completions", "chatcmpl",
                               queue_or(request, request.app.state.chat.create))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(request, "completions", "cmpl",
                               request.app.state.completions.create)

    return app


async def _generate(request: Request, endpoint: str, prefix: str, handler: Handler) -> Response:
    state: ServerState = request.app.state.ember
    ctx = state.admit(request, endpoint, prefix)
    try:
        body = await state.read_json(request)
        return await cancel_on_disconnect(request, handler(body, ctx))
    except APIError as err:
        err.headers = {**ctx.response_headers(), **err.headers}
        raise


def _model_card(request: Request, name: str) -> dict[str, Any]:
    state: ServerState = request.app.state.ember
    return {"id": name, "object": "model", "created": request.app.state.started,
            "owned_by": "ember", "root": state.engine.model_name,
            "max_model_len": state.engine.max_model_len}


def _add_error_handlers(app: FastAPI) -> None:
    def rejected(request: Request, err: APIError) -> Response:
        state: ServerState | None = getattr(request.app.state, "ember", None)
        if state is not None:
            state.metrics.observe_rejected(err.status)
        return err.response()

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError) -> Response:
        return rejected(request, err)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, err: EngineDeadError) -> Response:
        return rejected(request, engine_unavailable(str(err)))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> Response:
        return rejected(request, APIError(err.status_code, str(err.detail),
                                          _STATUS_TYPES.get(err.status_code,
                                                            "invalid_request_error")))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, err: RequestValidationError) -> Response:
        return rejected(request, APIError(400, str(err)))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception) -> Response:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return rejected(request, APIError(500, "The server had an error while processing your "
                                               "request", "server_error", None, "internal_error"))
