"""Turn model text into OpenAI `tool_calls`, all at once or as a stream of deltas.

One small class per output format, registered by name:
- kimi_k2: <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX
  <|tool_call_argument_begin|>{json}<|tool_call_end|>...<|tool_calls_section_end|>
- glm45: <tool_call>NAME\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n...</tool_call>
- hermes (alias qwen): <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>

A parser is fed text deltas and returns content and tool-call deltas (index, id, name, argument
fragments) the way OpenAI streams them; `parse()` is the same machine run over the whole text,
so streamed and complete results always agree. Whitespace between text and a call is dropped.
Each format also writes the grammar that forces a well-formed call (for tool_choice "required"
or a named function), used with constrained decoding.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar

from ember.core.sampling_params import JSON_GRAMMAR_OPTIONS

Literal = Callable[[str], str]  # writes a marker as a grammar item: special token or string


@dataclass
class ToolCallDelta:
    """A piece of one call: id and name come once, in its first delta; arguments accumulate."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ParserDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON text, as OpenAI sends it

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedOutput:
    content: str | None
    tool_calls: list[ToolCall]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def string_literal(marker: str) -> str:
    return json.dumps(marker)


def tool_function(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"]


def parameters_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters as a JSON schema for a forced call: written compactly like the JSON
    output, and with only the declared parameters unless the schema says otherwise."""
    schema = tool_function(tool).get("parameters") or {"type": "object", "properties": {}}
    forced: dict[str, Any] = {"x-guidance": JSON_GRAMMAR_OPTIONS, **schema}
    if forced.get("type") == "object":
        forced.setdefault("additionalProperties", False)
    return forced


def json_rule(schema: dict[str, Any]) -> str:
    return "%json " + json.dumps(schema)


class ToolParser(ABC):
    """Streaming parser for one response; make one per completion choice."""

    name: ClassVar[str]
    start_markers: ClassVar[tuple[str, ...]]
    markers: ClassVar[tuple[str, ...]]  # every marker; special tokens must not be skipped

    def __init__(self, tools: Sequence[dict[str, Any]] | None = None) -> None:
        self.tools = {tool_function(t)["name"]: tool_function(t) for t in tools or []}
        self._buf = ""
        self._state = "text"
        self._index = 0  # index of the current (or next) call
        self._pending_ws = ""  # trailing whitespace of content, held until text follows
        self._strip_leading = False  # content right after a call drops its leading whitespace
        self._calls: list[ToolCall] = []
        self._content = ""
        self._marker = ""  # the start marker of the call being read

    # --- public API

    def feed(self, text: str) -> ParserDelta:
        self._buf += text
        out = ParserDelta()
        while self._step(out):
            pass
        self._record(out)
        return out

    def finish(self) -> ParserDelta:
        """End of output: flush held text. A call cut short stays as far as it got; one cut
        before its name was known is given back as content."""
        out = ParserDelta()
        if self._state != "text" and len(self._calls) <= self._index:
            self._buf = self._marker + self._buf
            self._state = "text"
        if self._state == "text":
            self._emit_text(out, self._buf)
            out.content += self._pending_ws
            self._buf = self._pending_ws = ""
        self._record(out)
        return out

    def parse(self, text: str) -> ParsedOutput:
        self.feed(text)
        self.finish()
        return ParsedOutput(self._content or None, list(self._calls))

    @property
    def has_tool_calls(self) -> bool:
        return bool(self._calls)

    @classmethod
    @abstractmethod
    def grammar(cls, tools: Sequence[dict[str, Any]], parallel: bool,
                literal: Literal = string_literal) -> str:
        """A Lark grammar (llguidance dialect) accepting only calls of the given tools."""

    # --- shared machinery

    def _record(self, out: ParserDelta) -> None:
        self._content += out.content
        for delta in out.tool_calls:
            if delta.index == len(self._calls):
                self._calls.append(ToolCall(delta.id or new_call_id(), delta.name or "", ""))
            self._calls[delta.index].arguments += delta.arguments

    def _step(self, out: ParserDelta) -> bool:
        """Consume what can be consumed in the current state; False when more text is needed."""
        if self._state == "text":
            return self._step_text(out)
        return self._step_call(out)

    @abstractmethod
    def _step_call(self, out: ParserDelta) -> bool:
        """Consume call text (the state is any but "text")."""

    def _step_text(self, out: ParserDelta) -> bool:
        found = [(i, m) for m in self.start_markers if (i := self._buf.find(m)) != -1]
        if found:
            i, marker = min(found)
            self._emit_text(out, self._buf[:i])
            self._marker = self._pending_ws + marker  # given back if no call comes of it
            self._pending_ws = ""
            self._buf = self._buf[i + len(marker):]
            self._begin(marker)
            return True
        hold = _partial_suffix(self._buf, self.start_markers)
        self._emit_text(out, self._buf[:len(self._buf) - hold])
        self._buf = self._buf[len(self._buf) - hold:]
        return False

    @abstractmethod
    def _begin(self, marker: str) -> None:
        """A start marker was consumed: enter the call states."""

    def _emit_text(self, out: ParserDelta, text: str) -> None:
        text = self._pending_ws + text
        self._pending_ws = ""
        if self._strip_leading:
            text = text.lstrip()
            if not text:
                return
            self._strip_leading = False
        body = text.rstrip()
        self._pending_ws = text[len(body):]
        out.content += body

    def _open_call(self, out: ParserDelta, name: str, call_id: str | None = None) -> None:
        out.tool_calls.append(ToolCallDelta(self._index, call_id or new_call_id(), name))

    def _add_arguments(self, out: ParserDelta, text: str) -> None:
        if not text:
            return
        last = out.tool_calls[-1] if out.tool_calls else None
        if last is not None and last.index == self._index:
            last.arguments += text
        else:
            out.tool_calls.append(ToolCallDelta(self._index, arguments=text))

    def _close_call(self) -> None:
        self._index += 1
        self._strip_leading = True


class HermesToolParser(ToolParser):
    """<tool_call>{"name": ..., "arguments": {...}}</tool_call> (Hermes, Qwen 2.5/3)."""

    name = "hermes"
    BEGIN, END = "<tool_call>", "</tool_call>"
    start_markers = (BEGIN,)
    markers = (BEGIN, END)
    NAME = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")')
    ARGS = re.compile(r'\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)')

    def _begin(self, marker: str) -> None:
        self._state = "call"
        self._named = False
        self._args_start: int | None = None
        self._args_span: _JsonSpan | None = None
        self._args_sent = 0
        self._end_from = 0  # where to look for </tool_call> next

    def _step_call(self, out: ParserDelta) -> bool:
        end = self._buf.find(self.END, self._end_from)
        self._end_from = max(0, len(self._buf) - len(self.END) + 1)
        body = self._buf if end == -1 else self._buf[:end]
        if not self._named and (m := self.NAME.match(body)):
            self._open_call(out, json.loads(m.group(1)))
            self._named = True
            self._name_end = m.end()
        if self._named and self._args_start is None and (
                m := self.ARGS.match(body, self._name_end)):
            self._args_start = m.end()
        if self._args_start is not None and body[self._args_start:self._args_start + 1] in (
                "{", "["):
            self._args_span = self._args_span or _JsonSpan(self._args_start)
            stop = min(self._args_span.scan(body), len(body))
            self._add_arguments(out, body[self._args_start + self._args_sent:stop])
            self._args_sent = stop - self._args_start
        if end == -1:
            return False
        self._finish_call(out, body)
        self._buf = self._buf[end + len(self.END):]
        self._state = "text"
        return True

    def _finish_call(self, out: ParserDelta, body: str) -> None:
        """At </tool_call>: fill in what streaming could not (odd key order, string args)."""
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            call = None
        if not self._named:
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                self._emit_text(out, self._marker + body + self.END)  # not a call after all
                return
            self._open_call(out, call["name"])
        if self._args_sent == 0:
            args = call.get("arguments", call.get("parameters", {})) if isinstance(
                call, dict) else {}
            self._add_arguments(out, args if isinstance(args, str) else json.dumps(
                args, ensure_ascii=False))
        self._close_call()

    @classmethod
    def system_prompt(cls, tools: Sequence[dict[str, Any]]) -> str:
        """How Qwen's template announces tools; for templates that do not render them."""
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return ("# Tools\n\nYou may call one or more functions to assist with the user query."
                "\n\nYou are provided with function signatures within <tools></tools> XML "
                f"tags:\n<tools>\n{listing}\n</tools>\n\nFor each function call, return a json "
                "object with function name and arguments within <tool_call></tool_call> XML "
                'tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
                "<args-json-object>}\n</tool_call>")

    @classmethod
    def grammar(cls, tools: Sequence[dict[str, Any]], parallel: bool,
                literal: Literal = string_literal) -> str:
        options = [{"type": "object",
                    "properties": {"name": {"const": tool_function(t)["name"]},
                                   "arguments": parameters_schema(t)},
                    "required": ["name", "arguments"], "additionalProperties": False}
                   for t in tools]
        body = json_rule({"x-guidance": JSON_GRAMMAR_OPTIONS, "anyOf": options})
        repeat = ' ("\\n" call)*' if parallel else ""
        return (f"start: call{repeat}\n"
                f'call: {literal(cls.BEGIN)} "\\n" body "\\n" {literal(cls.END)}\n'
                f"body: {body}\n")


class KimiK2ToolParser(ToolParser):
    """Kimi K2's special-token tool section; call ids are functions.NAME:IDX."""

    name = "kimi_k2"
    SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
    CALL_BEGIN, ARG_BEGIN, CALL_END = ("<|tool_call_begin|>", "<|tool_call_argument_begin|>",
                                       "<|tool_call_end|>")
    start_markers = (SECTION_BEGIN, CALL_BEGIN)
    markers = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARG_BEGIN, CALL_END)

    def _begin(self, marker: str) -> None:
        self._state = "section" if marker == self.SECTION_BEGIN else "call_id"

    def _step_call(self, out: ParserDelta) -> bool:
        if self._state == "section":
            return self._step_section()
        if self._state == "call_id":
            i = self._buf.find(self.ARG_BEGIN)
            if i == -1:
                return False
            call_id = self._buf[:i].strip()
            self._open_call(out, call_id.split(":")[0].split(".")[-1], call_id)
            self._buf = self._buf[i + len(self.ARG_BEGIN):]
            self._state, self._args_ws, self._args_started = "args", "", False
            return True
        end = self._buf.find(self.CALL_END)
        chunk = self._buf[:end] if end != -1 else self._buf[:len(self._buf) - _partial_suffix(
            self._buf, (self.CALL_END,))]
        if not self._args_started:
            chunk = chunk.lstrip()
            self._args_started = bool(chunk)
        text = self._args_ws + chunk
        body = text.rstrip()
        self._args_ws = text[len(body):]
        self._add_arguments(out, body)
        if end == -1:
            self._buf = self._buf[len(self._buf) - _partial_suffix(
                self._buf, (self.CALL_END,)):]
            return False
        if not self._args_started:
            self._add_arguments(out, "{}")
        self._buf = self._buf[end + len(self.CALL_END):]
        self._index += 1
        self._state = "section"
        return True

    def _step_section(self) -> bool:
        stripped = self._buf.lstrip()
        for marker, state in ((self.CALL_BEGIN, "call_id"), (self.SECTION_END, "text")):
            if stripped.startswith(marker):
                self._buf = stripped[len(marker):]
                self._state = state
                if state == "text":
                    self._strip_leading = True
                return True
        if any(m.startswith(stripped) for m in (self.CALL_BEGIN, self.SECTION_END)):
            return False
        self._state = "text"  # stray text inside a section: read on as content
        self._strip_leading = True
        return True

    @classmethod
    def grammar(cls, tools: Sequence[dict[str, Any]], parallel: bool,
                literal: Literal = string_literal) -> str:
        functions = " | ".join(f"fn_{i}" for i in range(len(tools)))
        index = "IDX" if parallel else '"0"'
        lines = [f"start: {literal(cls.SECTION_BEGIN)} call{'+' if parallel else ''} "
                 f"{literal(cls.SECTION_END)}",
                 f"call: {literal(cls.CALL_BEGIN)} ({functions}) {literal(cls.CALL_END)}",
                 "IDX: /[0-9]{1,3}/"]
        for i, tool in enumerate(tools):
            prefix = string_literal(f"functions.{tool_function(tool)['name']}:")
            lines.append(f"fn_{i}: {prefix} {index} {literal(cls.ARG_BEGIN)} "
                         f"{json_rule(parameters_schema(tool))}")
        return "\n".join(lines) + "\n"


class Glm45ToolParser(ToolParser):
    """GLM-4.5/4.6's XML-ish calls; argument values are JSON except for string parameters."""

    name = "glm45"
    BEGIN, END = "<tool_call>", "</tool_call>"
    KEY_BEGIN, KEY_END, VALUE_BEGIN, VALUE_END = ("<arg_key>", "</arg_key>", "<arg_value>",
                                                  "</arg_value>")
    start_markers = (BEGIN,)
    markers = (BEGIN, END, KEY_BEGIN, KEY_END, VALUE_BEGIN, VALUE_END)
    PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)

    def _begin(self, marker: str) -> None:
        self._state = "name"
        self._num_args = 0

    def _step_call(self, out: ParserDelta) -> bool:
        if self._state == "name":
            found = [i for m in ("\n", self.KEY_BEGIN, self.END) if (i := self._buf.find(m)) != -1]
            if not found:
                return False
            i = min(found)
            self._function = self._buf[:i].strip()
            self._open_call(out, self._function)
            self._buf = self._buf[i:]
            self._state = "args"
            return True
        stripped = self._buf.lstrip()
        if stripped.startswith(self.END):
            self._add_arguments(out, "}" if self._num_args else "{}")
            self._buf = stripped[len(self.END):]
            self._state = "text"
            self._close_call()
            return True
        if stripped.startswith(self.KEY_BEGIN):
            pair = self.PAIR.match(stripped)
            if pair is None:
                return False
            key = pair.group(1).strip()
            value = self._value(key, pair.group(2))
            sep = ", " if self._num_args else "{"
            self._add_arguments(out, f"{sep}{json.dumps(key, ensure_ascii=False)}: "
                                     f"{json.dumps(value, ensure_ascii=False)}")
            self._num_args += 1
            self._buf = stripped[pair.end():]
            return True
        if any(m.startswith(stripped) for m in (self.END, self.KEY_BEGIN)):
            return False
        cut = min((i for m in (self.KEY_BEGIN, self.END) if (i := stripped.find(m)) != -1),
                  default=len(stripped) - _partial_suffix(stripped, (self.KEY_BEGIN, self.END)))
        self._buf = stripped[cut:]  # stray text inside a call carries no argument: skip it
        return cut > 0

    def _value(self, key: str, raw: str) -> Any:
        """String parameters stay as written; others are read as JSON, then Python literals."""
        spec = (self.tools.get(self._function, {}).get("parameters") or {}).get(
            "properties", {}).get(key, {})
        if spec.get("type") == "string":
            return raw
        text = raw.strip()
        for parse in (json.loads, ast.literal_eval):
            try:
                return parse(text)
            except (ValueError, SyntaxError, RecursionError):
                continue
        return raw

    @classmethod
    def grammar(cls, tools: Sequence[dict[str, Any]], parallel: bool,
                literal: Literal = string_literal) -> str:
        functions = " | ".join(f"fn_{i}" for i in range(len(tools)))
        repeat = ' ("\\n" call)*' if parallel else ""
        lines = [f"start: call{repeat}",
                 f"call: {literal(cls.BEGIN)} ({functions}) {literal(cls.END)}"]
        for i, tool in enumerate(tools):
            schema = tool_function(tool).get("parameters") or {}
            required = set(schema.get("required", []))
            pairs = []
            for j, (key, prop) in enumerate(schema.get("properties", {}).items()):
                rule = f"arg_{i}_{j}"
                lines.append(f"{rule}: {literal(cls.KEY_BEGIN)} {string_literal(key)} "
                             f'{literal(cls.KEY_END)} "\\n" {literal(cls.VALUE_BEGIN)} '
                             f'{_glm_value(prop)} {literal(cls.VALUE_END)} "\\n"')
                pairs.append(rule if key in required else f"{rule}?")
            name = string_literal(tool_function(tool)["name"])
            lines.append(f'fn_{i}: {name} "\\n" {" ".join(pairs)}'.rstrip())
        return "\n".join(lines) + "\n"


def _glm_value(prop: dict[str, Any]) -> str:
    """A parameter value in GLM's format: strings raw (no '<'), everything else JSON."""
    if prop.get("type") == "string":
        if "enum" in prop:
            return "(" + " | ".join(string_literal(str(v)) for v in prop["enum"]) + ")"
        limit = prop.get("maxLength")
        return f"/[^<]{{0,{int(limit)}}}/" if limit is not None else "/[^<]*/"
    return json_rule({"x-guidance": JSON_GRAMMAR_OPTIONS, **prop})


def _partial_suffix(text: str, markers: Sequence[str]) -> int:
    """Length of the longest end of text that could be the start of a marker."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


class _JsonSpan:
    """Where a JSON object or array starting at `start` ends, scanning each character once
    however the text arrives."""

    def __init__(self, start: int) -> None:
        self.pos = start
        self.depth = 0
        self.in_string = self.escaped = False
        self.end: int | None = None

    def scan(self, text: str) -> int:
        """How far the value reaches in text: its end once closed, else all of text."""
        while self.end is None and self.pos < len(text):
            ch = text[self.pos]
            self.pos += 1
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.end = self.pos
        return len(text) if self.end is None else self.end


TOOL_PARSERS: MappingProxyType[str, type[ToolParser]] = MappingProxyType({
    "hermes": HermesToolParser,
    "qwen": HermesToolParser,
    "kimi_k2": KimiK2ToolParser,
    "glm45": Glm45ToolParser,
})


def get_tool_parser(name: str) -> type[ToolParser]:
    parser = TOOL_PARSERS.get(name)
    if parser is None:
        raise ValueError(f"tool_call_parser: unknown parser {name!r}; "
                         f"choose from {sorted(TOOL_PARSERS)}")
    return parser


def default_tool_parser(model_type: str | None, chat_template: str | None) -> str:
    """Pick the format from the model type, else from what the chat template writes."""
    template = chat_template or ""
    if model_type == "kimi_k2" or KimiK2ToolParser.SECTION_BEGIN in template:
        return "kimi_k2"
    if model_type in ("glm4_moe", "glm4") or Glm45ToolParser.KEY_BEGIN in template:
        return "glm45"
    return "hermes"
