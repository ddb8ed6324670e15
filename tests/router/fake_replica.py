"""A small OpenAI-shaped upstream for the router's own tests, run as its own process.

`python tests/router/fake_replica.py --port P --name NAME` serves:
  GET  /health                 200, or 503 after POST /control {"healthy": false}
  GET  /metrics                ember:num_requests_running / _waiting (running counts open
                               requests; both can be raised with /control)
  POST /control                {"healthy", "status", "running", "waiting"}; status makes every
                               /v1 request answer with that code; {"reset": true} restores
                               the defaults and clears /stats
  GET  /stats                  {"requests": [paths in order]}
  GET  /v1/models              one model
  POST /v1/chat/completions    SSE when "stream": one chunk per max_tokens, `delay` seconds
                               apart (a body field); JSON otherwise. Every chunk names the
                               replica. "preamble": true sends a role-only chunk first;
                               "crash_on": NAME makes replica NAME exit right after it.
  *    /v1/echo                the request as seen (method, path, query, headers, body);
                               ?status=N answers with N; sets two cookies and x-custom.
It imports nothing from ember, so it starts in well under a second.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route


def create_app(name: str) -> Starlette:
    state = {"healthy": True, "status": None, "running": 0, "waiting": 0, "open": 0}
    seen: list[str] = []

    async def health(request: Request) -> Response:
        return JSONResponse({"ok": state["healthy"]}, status_code=200 if state["healthy"] else 503)

    async def metrics(request: Request) -> Response:
        return PlainTextResponse(
            "# TYPE ember:num_requests_running gauge\n"
            f'ember:num_requests_running{{model_name="fake"}} {state["running"] + state["open"]}\n'
            "# TYPE ember:num_requests_waiting gauge\n"
            f'ember:num_requests_waiting{{model_name="fake"}} {state["waiting"]}\n')

    async def control(request: Request) -> Response:
        update = await request.json()
        if update.pop("reset", False):
            state.update(healthy=True, status=None, running=0, waiting=0)
            seen.clear()
        state.update(update)
        return JSONResponse(state)

    async def stats(request: Request) -> Response:
        return JSONResponse({"requests": seen})

    def forced() -> Response | None:
        if state["status"] is None:
            return None
        return JSONResponse({"error": {"message": f"{name} forced", "code": state["status"]}},
                            status_code=state["status"])

    async def models(request: Request) -> Response:
        seen.append(request.url.path)
        return forced() or JSONResponse({"object": "list", "data": [{"id": "fake",
                                                                      "object": "model"}]})

    async def chat(request: Request) -> Response:
        seen.append(request.url.path)
        refusal = forced()
        if refusal is not None:
            return refusal
        body = await request.json()
        n, delay = int(body.get("max_tokens", 3)), float(body.get("delay", 0.0))
        headers = {"x-replica-name": name}
        if not body.get("stream"):
            return JSONResponse({"object": "chat.completion", "replica": name, "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "x" * n},
                 "finish_reason": "length"}]}, headers=headers)

        async def events():
            state["open"] += 1
            try:
                if body.get("preamble"):
                    chunk = {"replica": name, "choices": [
                        {"index": 0, "delta": {"role": "assistant", "content": ""},
                         "finish_reason": None}]}
                    yield f"data: {json.dumps(chunk)}\n\n".encode()
                if body.get("crash_on") == name:
                    await asyncio.sleep(0.2)
                    os._exit(1)  # the replica dies before its first token
                for i in range(n):
                    chunk = {"replica": name, "choices": [
                        {"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}]}
                    yield f"data: {json.dumps(chunk)}\n\n".encode()
                    await asyncio.sleep(delay)
                yield b"data: [DONE]\n\n"
            finally:
                state["open"] -= 1

        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    async def echo(request: Request) -> Response:
        seen.append(request.url.path)
        refusal = forced()
        if refusal is not None:
            return refusal
        body = await request.body()
        response = JSONResponse(
            {"replica": name, "method": request.method, "path": request.url.path,
             "query": request.url.query, "headers": [[k, v] for k, v in request.headers.items()],
             "body": body.decode()},
            status_code=int(request.query_params.get("status", 200)),
            headers={"x-custom": "kept", "x-replica-name": name})
        response.set_cookie("a", "1")
        response.set_cookie("b", "2")
        return response

    return Starlette(routes=[
        Route("/health", health), Route("/metrics", metrics),
        Route("/control", control, methods=["POST"]), Route("/stats", stats),
        Route("/v1/models", models), Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/echo", echo, methods=["GET", "POST", "PUT", "DELETE", "PATCH"]),
    ])


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", required=True)
    args = parser.parse_args()
    uvicorn.run(create_app(args.name), host="127.0.0.1", port=args.port, log_level="warning")
