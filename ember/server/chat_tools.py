"""A chat request's tools and output format, from the request to the assistant message.

ChatTools holds what the request asked (tools, tool_choice, parallel_tool_calls,
response_format) once checked: it renders the prompt, sets the decoding constraint on the
SamplingParams, and makes one ToolCallMessage per choice, which turns the generated text into
content and `tool_calls`, whole or as OpenAI stream deltas.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ember.core.sampling_params import SamplingParams, StructuredOutputSpec
from ember.engine.tokenizer import Tokenizer
from ember.server.chat_template import (
    normalize_messages,
    normalize_tools,
    render_chat_prompt,
    tool_names,
)
from ember.server.structured_output import (
    ToolChoice,
    marker_is_special,
    marker_literal,
    parse_tool_choice,
    response_format_spec,
    tool_call_spec,
)
from ember.server.tool_parsers import HermesToolParser, ParserDelta, ToolParser


@dataclass
class ChatTools:
    """One chat request's checked tools and format; make it with from_request()."""

    tools: list[dict[str, Any]] = field(default_factory=list)
    choice: ToolChoice = ToolChoice("none")
    parser: type[ToolParser] | None = None  # None: the output is plain content
    structured_output: StructuredOutputSpec | None = None
    keep_special_tokens: bool = False  # the parser's markers are special tokens

    @classmethod
    def from_request(cls, tokenizer: Tokenizer, parser: type[ToolParser], *,
                     tools: Any = None, tool_choice: Any = None,
                     parallel_tool_calls: bool | None = None,
                     response_format: Any = None) -> ChatTools:
        """Raises ValueError naming the request field at fault."""
        checked = normalize_tools(tools) if tools is not None else []
        choice = parse_tool_choice(tool_choice, tool_names(checked))
        spec = response_format_spec(response_format)
        forced = tool_call_spec(parser, checked, choice, parallel_tool_calls is not False,
                                marker_literal(tokenizer))
        if spec is not None and forced is not None:
            raise ValueError("response_format: cannot be combined with tool_choice 'required' "
                             "or a named function")
        active = parser if checked and choice.mode != "none" and spec is None else None
        return cls(checked, choice, active, spec or forced,
                   active is not None and marker_is_special(tokenizer, active))

    def render(self, tokenizer: Tokenizer, messages: Any, **template_kwargs: Any) -> str:
        """The prompt. A template that ignores tools gets them announced in the system
        message, in the hermes format, when that is the format being parsed."""
        conversation = normalize_messages(messages)
        template = template_kwargs.get("chat_template") or tokenizer.chat_template or ""
        if (self.tools and self.parser is HermesToolParser
                and "tools" not in str(template)):
            prompt = HermesToolParser.system_prompt(self.tools)
            if conversation[0]["role"] == "system":
                first = conversation[0]
                conversation[0] = {**first, "content": f"{first['content']}\n\n{prompt}"}
            else:
                conversation.insert(0, {"role": "system", "content": prompt})
        return render_chat_prompt(tokenizer, conversation, self.tools or None,
                                  **template_kwargs)

    def sampling_params(self, params: SamplingParams) -> SamplingParams:
        if self.structured_output is None and not self.keep_special_tokens:
            return params
        return replace(params, structured_output=self.structured_output,
                       skip_special_tokens=params.skip_special_tokens
                       and not self.keep_special_tokens)

    def message_builder(self) -> ToolCallMessage | None:
        """A builder for one choice, or None when the output is plain content."""
        return ToolCallMessage(self.parser(self.tools)) if self.parser is not None else None


class ToolCallMessage:
    """One choice's text as an assistant message with tool_calls (the chat handler's seam)."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser

    def delta(self, text: str) -> dict[str, Any] | None:
        return _openai_delta(self.parser.feed(text)) if text else None

    def flush(self) -> dict[str, Any] | None:
        return _openai_delta(self.parser.finish())

    def message(self, text: str) -> dict[str, Any]:
        parsed = self.parser.parse(text)
        if not parsed.tool_calls:
            return {"role": "assistant", "content": parsed.content or ""}
        return {"role": "assistant", "content": parsed.content,
                "tool_calls": [c.to_openai() for c in parsed.tool_calls]}

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.parser.has_tool_calls else reason


def _openai_delta(delta: ParserDelta) -> dict[str, Any] | None:
    if not delta:
        return None
    out: dict[str, Any] = {}
    if delta.content:
        out["content"] = delta.content
    if delta.tool_calls:
        calls = []
        for d in delta.tool_calls:
            call: dict[str, Any] = {"index": d.index}
            function: dict[str, Any] = {"arguments": d.arguments}
            if d.name is not None:
                call.update(id=d.id, type="function")
                function = {"name": d.name, "arguments": d.arguments}
            call["function"] = function
            calls.append(call)
        out["tool_calls"] = calls
    return out
