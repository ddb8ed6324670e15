"""The router's ASGI app: /v1/* proxied, plus /health, /metrics and the admin endpoints.

Admin endpoints need the admin key (`Authorization: Bearer KEY` or `x-admin-key: KEY`) and are
refused when the router was started without one:
  GET    /admin/replicas              every replica with its state and load
  POST   /admin/replicas {"url": U}   add U, check it at once; 201 when new
  DELETE /admin/replicas?url=U        remove U (a JSON body {"url": U} works too)
  POST   /admin/assignments {"ids": [...]}  which replica each session id goes to now
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ember.router.config import RouterConfig
from ember.router.gateway import Gateway
from ember.router.health import HealthChecker
from ember.router.membership import Membership, ReplicasFile
from ember.router.metrics import CONTENT_TYPE, RouterMetrics
from ember.router.policy import Policy
from ember.router.prefix_index import PrefixIndex
from ember.router.proxy import error_response
from ember.router.replicas import ReplicaSet

PROXY_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]


class Router:
    """Everything one router holds; the HTTP clients exist while the app runs."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.replicas = ReplicaSet(config.eject_after, config.readmit_after)
        self.index = PrefixIndex(config.prefix_capacity)
        self.metrics = RouterMetrics(self.replicas)
        self.policy = Policy(config.policy, self.replicas, self.index, config.max_load,
                             config.max_waiting, config.prefix_min_match)
        self.membership = Membership(self.replicas, self.index, self.metrics)
        for url in config.replicas:
            self.replicas.add(url, "cli")
        self.gateway: Gateway | None = None

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Open the clients, check every replica once, then keep checking in the background."""
        config = self.config
        timeout = httpx.Timeout(connect=config.connect_timeout, read=config.read_timeout,
                                write=config.read_timeout, pool=None)
        limits = httpx.Limits(max_connections=config.max_connections,
                              max_keepalive_connections=config.max_connections)
        async with (httpx.AsyncClient(timeout=timeout, limits=limits) as client,
                    httpx.AsyncClient(timeout=config.health_timeout) as health_client):
            checker = HealthChecker(self.replicas, health_client, config.health_path,
                                    config.poll_metrics, self.membership.on_transition)
            self.membership.checker = checker
            self.gateway = Gateway(config, self.replicas, self.index, self.policy, self.metrics,
                                   client, self.membership.on_transition)
            tasks = []
            if config.replicas_file is not None:
                watcher = ReplicasFile(Path(config.replicas_file), self.membership)
                await watcher.sync()
                tasks.append(asyncio.create_task(watcher.run(config.health_interval)))
            await checker.check_all()
            tasks.append(asyncio.create_task(checker.run(config.health_interval)))
            try:
                yield
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                self.membership.checker = None
                self.gateway = None

    async def proxy(self, request: Request) -> Response:
        if self.gateway is None:
            return error_response("ember route: starting up", 503)
        return await self.gateway.handle(request)

    async def health(self, request: Request) -> Response:
        healthy = len(self.replicas.healthy())
        body = {"status": "ok" if healthy else "no healthy replica", "healthy": healthy,
                "replicas": len(self.replicas)}
        return JSONResponse(body, status_code=200 if healthy else 503)

    async def metrics_text(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    def _authorized(self, request: Request) -> Response | None:
        """None when the request carries the admin key, else the response refusing it."""
        if self.config.admin_key is None:
            return error_response("admin endpoints are off: start ember route with an admin "
                                  "key", 403, "permission_error")
        given = request.headers.get("x-admin-key", "")
        auth = request.headers.get("authorization", "")
        if auth.lower().startswith("bearer "):
            given = given or auth[7:].strip()
        if not hmac.compare_digest(given.encode(), self.config.admin_key.encode()):
            return error_response("bad or missing admin key", 401, "authentication_error")
        return None

    async def admin_replicas(self, request: Request) -> Response:
        refused = self._authorized(request)
        if refused is not None:
            return refused
        if request.method == "GET":
            return JSONResponse({"replicas": [r.describe() for r in self.replicas.all()]})
        body = await _json_body(request)
        url = request.query_params.get("url") or (body or {}).get("url")
        if not isinstance(url, str):
            return error_response("url: give the replica's base URL", 400,
                                  "invalid_request_error")
        try:
            if request.method == "DELETE":
                removed = self.membership.remove(url)
                if removed is None:
                    return error_response(f"url: no replica {url}", 404, "not_found_error")
                return JSONResponse({"removed": removed.url})
            replica, new = await self.membership.add(url, "admin")
        except ValueError as exc:
            return error_response(str(exc), 400, "invalid_request_error")
        return JSONResponse(replica.describe(), status_code=201 if new else 200)

    async def admin_assignments(self, request: Request) -> Response:
        refused = self._authorized(request)
        if refused is not None:
            return refused
        ids = (await _json_body(request) or {}).get("ids")
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            return error_response("ids: give a list of session ids", 400,
                                  "invalid_request_error")
        if self.config.policy != "affinity":
            return error_response("the round-robin policy ignores session ids", 409,
                                  "invalid_request_error")
        candidates = self.policy.eligible()
        if not candidates:
            return error_response("no replica is available", 503)
        return JSONResponse({"assignments": {i: self.policy.assign(i, candidates).url
                                             for i in ids}})


async def _json_body(request: Request) -> dict[str, Any] | None:
    raw = await request.body()
    try:
        parsed = json.loads(raw) if raw else None
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) else None


def create_app(config: RouterConfig) -> Starlette:
    router = Router(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with router.running():
            yield

    app = Starlette(routes=[
        Route("/health", router.health, methods=["GET"]),
        Route("/metrics", router.metrics_text, methods=["GET"]),
        Route("/admin/replicas", router.admin_replicas, methods=["GET", "POST", "DELETE"]),
        Route("/admin/assignments", router.admin_assignments, methods=["POST"]),
        Route("/v1/{path:path}", router.proxy, methods=PROXY_METHODS),
    ], lifespan=lifespan)
    app.state.router = router
    return app
