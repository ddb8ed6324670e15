"""POST /v1/completions: one or several prompts (text or token ids), n choices each."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import JSONResponse, Response

from ember.engine.outputs import CompletionOutput, TokenLogprob
from ember.server.errors import APIError, bad_request
from ember.server.protocol import CompletionRequest
from ember.server.serving import (
    SSE_DONE,
    RequestContext,
    ServerState,
    Submission,
    build_params,
    parse_body,
    sse,
    token_text,
)


class CompletionHandler:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def create(self, body: dict[str, Any], ctx: RequestContext) -> Response:
        state = self.state
        req = parse_body(CompletionRequest, body)
        state.check_model(req.model)
        lane = req.lane_enum(ctx.lane_header)
        state.check_capacity(ctx, lane)
        prompts = []
        for p in req.prompts():
            if isinstance(p, str):
                prompts.append((state.tokenizer.encode(p), p))
            else:
                prompts.append((list(p), None))
        for ids, _ in prompts:
            if not ids:
                raise bad_request("prompt: must not be empty", "prompt")
            state.check_context(len(ids), req.max_tokens, "prompt")
        params = build_params(req, req.max_tokens, req.logprobs)
        tally = state.new_tally(ctx, req.model, lane, req.user)
        submission = state.submit(ctx, tally, prompts, params, lane, req.priority)
        echoes = [self._echo(req, ids, text) for ids, text in prompts]
        if req.stream:
            return state.sse_response(ctx, self._stream(req, ctx, submission, echoes))
        return await self._complete(req, ctx, submission, echoes)

    def _echo(self, req: CompletionRequest, ids: list[int], text: str | None) -> str:
        if not req.echo:
            return ""
        return text if text is not None else self.state.tokenizer.decode(ids)

    async def _complete(self, req: CompletionRequest, ctx: RequestContext,
                        submission: Submission, echoes: list[str]) -> Response:
        status, finals = "error", {}
        try:
            async for i, out in submission:
                finals[i] = out
            status = "ok"
        finally:
            submission.close()
            submission.tally.finish(status)
        choices = []
        for i in range(len(echoes)):
            for c in finals[i].outputs:
                choices.append({
                    "index": i * req.n + c.index,
                    "text": echoes[i] + c.text,
                    "logprobs": self._logprobs(req, c.logprobs or [], len(echoes[i])),
                    "finish_reason": c.finish_reason,
                })
        return JSONResponse({
            "id": ctx.request_id, "object": "text_completion", "created": ctx.created,
            "model": req.model, "choices": choices, "usage": submission.tally.usage(),
        }, headers=ctx.response_headers())

    async def _stream(self, req: CompletionRequest, ctx: RequestContext,
                      submission: Submission, echoes: list[str]) -> AsyncIterator[str]:
        tally = submission.tally
        echoed: set[int] = set()
        finished: set[int] = set()
        offsets: dict[int, int] = {}

        def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> str:
            payload = {"id": ctx.request_id, "object": "text_completion", "created": ctx.created,
                       "model": req.model, "choices": choices}
            if req.include_usage:
                payload["usage"] = usage
            return sse(payload)

        status = "aborted"
        try:
            async for i, out in submission:
                choices = []
                for c in out.outputs:
                    index = i * req.n + c.index
                    if index in finished:
                        continue
                    choice = self._delta_choice(req, c, index, echoes[i], echoed, offsets)
                    if choice is not None:
                        choices.append(choice)
                    if c.finished:
                        finished.add(index)
                if choices:
                    yield chunk(choices)
            status = "ok"
            if req.include_usage:
                yield chunk([], tally.usage())
            yield SSE_DONE
        except APIError as err:  # the engine failed mid-stream; headers are long gone
            status = "error"
            yield err.sse()
            yield SSE_DONE
        finally:
            submission.close()
            tally.finish(status)

    def _delta_choice(self, req: CompletionRequest, c: CompletionOutput, index: int, echo: str,
                      echoed: set[int], offsets: dict[int, int]) -> dict[str, Any] | None:
        text = c.delta_text
        if index not in echoed:
            echoed.add(index)
            text = echo + text
            offsets[index] = len(echo)
        if not text and not c.delta_logprobs and not c.finished:
            return None
        logprobs = None
        if req.logprobs is not None:
            logprobs = self._logprobs(req, c.delta_logprobs, offsets[index])
            offsets[index] += sum(len(t) for t in logprobs["tokens"])
        return {"index": index, "text": text, "logprobs": logprobs,
                "finish_reason": c.finish_reason if c.finished else None}

    def _logprobs(self, req: CompletionRequest, lps: list[TokenLogprob], offset: int
                  ) -> dict[str, Any] | None:
        if req.logprobs is None:
            return None
        tok = self.state.tokenizer
        tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
        for lp in lps:
            text = token_text(tok, lp.token_id)
            tokens.append(text)
            token_logprobs.append(max(lp.logprob, -9999.0))
            top = {token_text(tok, t): max(v, -9999.0)
                   for t, v in sorted(lp.top.items(), key=lambda kv: -kv[1])}
            top.setdefault(text, token_logprobs[-1])
            top_logprobs.append(top)
            text_offset.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs,
                "top_logprobs": top_logprobs, "text_offset": text_offset}
