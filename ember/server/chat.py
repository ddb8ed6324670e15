"""POST /v1/chat/completions: render the conversation, generate, answer whole or streamed.

Two seams keep tools and structured output out of the plumbing: `render_prompt` (messages and
tools to prompt text) and `ChoiceMessage` (generated text to the assistant message, whole or
as stream deltas).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import jinja2
from starlette.responses import JSONResponse, Response

from ember.engine.outputs import CompletionOutput, TokenLogprob
from ember.engine.tokenizer import Tokenizer
from ember.server.chat_tools import ChatTools, ToolCallMessage
from ember.server.errors import APIError, bad_request, from_value_error
from ember.server.protocol import ChatCompletionRequest
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
from ember.server.tool_parsers import default_tool_parser, get_tool_parser


class ChoiceMessage:
    """One choice's generated text as the assistant message, whole or as stream deltas.

    This is where tool-call parsing plugs in: a parser-aware version can hold text back in
    `delta` and turn it into `tool_calls` in `message` / `flush`.
    """

    def __init__(self, req: ChatCompletionRequest) -> None:
        self.req = req

    def delta(self, text: str) -> dict[str, Any] | None:
        """The stream delta for newly generated text (None: nothing to send yet)."""
        return {"content": text} if text else None

    def flush(self) -> dict[str, Any] | None:
        """The last delta, once the choice has finished."""
        return None

    def message(self, text: str) -> dict[str, Any]:
        return {"role": "assistant", "content": text}

    def finish_reason(self, reason: str | None) -> str | None:
        return reason


class ChatHandler:
    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.tool_parser = get_tool_parser(state.config.tool_call_parser or default_tool_parser(
            state.engine.model_type, state.tokenizer.chat_template))

    def chat_tools(self, req: ChatCompletionRequest) -> ChatTools:
        """tools, tool_choice and response_format, checked: what to enforce and to parse."""
        try:
            return ChatTools.from_request(
                self.state.tokenizer, self.tool_parser, tools=req.tools,
                tool_choice=req.tool_choice, parallel_tool_calls=req.parallel_tool_calls,
                response_format=req.response_format)
        except ValueError as exc:
            raise from_value_error(exc) from None

    def render_prompt(self, req: ChatCompletionRequest, tools: ChatTools) -> str:
        """The prompt text: the model's chat template over the messages (and tools)."""
        messages = [m.for_template() for m in req.messages]
        kwargs = {**(req.chat_template_kwargs or {}),
                  "add_generation_prompt": req.add_generation_prompt}
        try:
            return tools.render(self.state.tokenizer, messages, **kwargs)
        except ValueError as exc:
            raise from_value_error(exc) from None
        except jinja2.TemplateError as exc:
            raise bad_request(f"messages: the chat template failed: {exc}", "messages") from None

    def choice_message(self, req: ChatCompletionRequest, tools: ChatTools
                       ) -> ChoiceMessage | ToolCallMessage:
        return tools.message_builder() or ChoiceMessage(req)

    async def create(self, body: dict[str, Any], ctx: RequestContext) -> Response:
        state = self.state
        req = parse_body(ChatCompletionRequest, body)
        state.check_model(req.model)
        lane = req.lane_enum(ctx.lane_header)
        state.check_capacity(ctx, lane)
        tools = self.chat_tools(req)
        prompt = self.render_prompt(req, tools)
        prompt_ids = state.tokenizer.encode(prompt, add_special_tokens=False)
        state.check_context(len(prompt_ids), req.max_output_tokens, "messages")
        params = tools.sampling_params(build_params(req, req.max_output_tokens, req.num_logprobs))
        tally = state.new_tally(ctx, req.model, lane, req.user)
        submission = state.submit(ctx, tally, [(prompt_ids, prompt)], params, lane,
                                  req.priority)
        if req.stream:
            return state.sse_response(ctx, self._stream(req, ctx, submission, tools))
        return await self._complete(req, ctx, submission, tools)

    async def _complete(self, req: ChatCompletionRequest, ctx: RequestContext,
                        submission: Submission, tools: ChatTools) -> Response:
        status, final = "error", None
        try:
            async for _, out in submission:
                final = out
            status = "ok"
        finally:
            submission.close()
            submission.tally.finish(status)
        choices = []
        for c in final.outputs:
            builder = self.choice_message(req, tools)
            choices.append({
                "index": c.index,
                "message": builder.message(c.text),
                "logprobs": self._logprobs(req, c.logprobs or []),
                "finish_reason": builder.finish_reason(c.finish_reason),
            })
        return JSONResponse({
            "id": ctx.request_id, "object": "chat.completion", "created": ctx.created,
            "model": req.model, "choices": choices, "usage": submission.tally.usage(),
        }, headers=ctx.response_headers())

    async def _stream(self, req: ChatCompletionRequest, ctx: RequestContext,
                      submission: Submission, tools: ChatTools) -> AsyncIterator[str]:
        tally = submission.tally
        builders = [self.choice_message(req, tools) for _ in range(req.n)]
        finished = [False] * req.n

        def chunk(choices: list[dict[str, Any]]) -> str:
            payload = {"id": ctx.request_id, "object": "chat.completion.chunk",
                       "created": ctx.created, "model": req.model, "choices": choices}
            if req.include_usage:
                payload["usage"] = None
            return sse(payload)

        status = "aborted"
        try:
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                          "logprobs": None, "finish_reason": None} for i in range(req.n)])
            async for _, out in submission:
                choices = [choice for c in out.outputs if not finished[c.index]
                           if (choice := self._delta_choice(req, builders[c.index], c))]
                for c in out.outputs:
                    finished[c.index] = finished[c.index] or c.finished
                if choices:
                    yield chunk(choices)
            status = "ok"
            if req.include_usage:
                yield sse({"id": ctx.request_id, "object": "chat.completion.chunk",
                           "created": ctx.created, "model": req.model, "choices": [],
                           "usage": tally.usage()})
            yield SSE_DONE
        except APIError as err:  # the engine failed mid-stream; headers are long gone
            status = "error"
            yield err.sse()
            yield SSE_DONE
        finally:
            submission.close()
            tally.finish(status)

    def _delta_choice(self, req: ChatCompletionRequest, builder: ChoiceMessage | ToolCallMessage,
                      c: CompletionOutput) -> dict[str, Any] | None:
        delta = builder.delta(c.delta_text) or {}
        if c.finished:
            delta.update(builder.flush() or {})
        logprobs = self._logprobs(req, c.delta_logprobs) if c.delta_logprobs else None
        if not delta and logprobs is None and not c.finished:
            return None
        return {"index": c.index, "delta": delta, "logprobs": logprobs,
                "finish_reason": builder.finish_reason(c.finish_reason) if c.finished else None}

    def _logprobs(self, req: ChatCompletionRequest, lps: list[TokenLogprob]
                  ) -> dict[str, Any] | None:
        if not req.logprobs:
            return None
        tok = self.state.tokenizer
        return {"content": [
            {**_token_entry(tok, lp.token_id, lp.logprob),
             "top_logprobs": [_token_entry(tok, t, v) for t, v in
                              sorted(lp.top.items(), key=lambda kv: -kv[1])]}
            for lp in lps]}


def _token_entry(tokenizer: Tokenizer, token_id: int, logprob: float) -> dict[str, Any]:
    text = token_text(tokenizer, token_id)
    return {"token": text, "logprob": max(logprob, -9999.0), "bytes": list(text.encode())}
