"""What a chat request asks the decoder to enforce: response_format and forced tool calls.

Both become a StructuredOutputSpec on the request's SamplingParams; the executor compiles and
enforces it (ember/executor/structured_output.py). Invalid input raises ValueError naming the
request field (response_format, tool_choice, tools), which the server answers with 400.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ember.core.sampling_params import StructuredOutputSpec
from ember.engine.tokenizer import Tokenizer
from ember.server.tool_parsers import ToolParser, string_literal

SCHEMA_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


def response_format_spec(response_format: Any) -> StructuredOutputSpec | None:
    """{"type": "text" | "json_object" | "json_schema", ...} as a decoding constraint."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise ValueError("response_format: must be an object")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputSpec("json")
    if kind != "json_schema":
        raise ValueError("response_format.type: must be 'text', 'json_object' or 'json_schema', "
                         f"got {kind!r}")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise ValueError("response_format.json_schema: must be an object with name and schema")
    name = spec.get("name")
    if not isinstance(name, str) or not SCHEMA_NAME.match(name):
        raise ValueError("response_format.json_schema.name: must be 1-64 letters, digits, '_' "
                         f"or '-', got {name!r}")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise ValueError("response_format.json_schema.strict: must be a boolean")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict | bool):
        raise ValueError("response_format.json_schema.schema: must be a JSON schema object")
    try:
        return StructuredOutputSpec("json_schema", json.dumps(schema))
    except ValueError as e:
        raise ValueError(f"response_format.json_schema.schema: {_reason(e)}") from None


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # "none" | "auto" | "required" | "function"
    function: str | None = None  # the forced function's name when mode is "function"


def parse_tool_choice(tool_choice: Any, tool_names: Sequence[str]) -> ToolChoice:
    """OpenAI's tool_choice; the default is "auto" with tools and "none" without."""
    if tool_choice is None:
        return ToolChoice("auto" if tool_names else "none")
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise ValueError("tool_choice: must be 'none', 'auto', 'required' or "
                             f"{{'type': 'function', 'function': {{'name': ...}}}}, "
                             f"got {tool_choice!r}")
        if tool_choice != "none" and not tool_names:
            raise ValueError(f"tool_choice: {tool_choice!r} needs tools")
        return ToolChoice(tool_choice)
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if (not isinstance(tool_choice, dict) or tool_choice.get("type") != "function"
            or not isinstance(function, dict)):
        raise ValueError("tool_choice: must be a string or "
                         "{'type': 'function', 'function': {'name': ...}}")
    name = function.get("name")
    if name not in tool_names:
        raise ValueError(f"tool_choice.function.name: no tool named {name!r} in tools")
    return ToolChoice("function", name)


def marker_literal(tokenizer: Tokenizer) -> Callable[[str], str]:
    """Write a format marker into a grammar: as a special token where the vocabulary has it as
    one (Kimi's <|tool_call_begin|>, GLM's <tool_call>), else as plain text."""
    special = {t.content for t in tokenizer.hf.added_tokens_decoder.values() if t.special}
    return lambda marker: marker if marker in special else string_literal(marker)


def marker_is_special(tokenizer: Tokenizer, parser: type[ToolParser]) -> bool:
    special = {t.content for t in tokenizer.hf.added_tokens_decoder.values() if t.special}
    return any(m in special for m in parser.markers)


def tool_call_spec(parser: type[ToolParser], tools: Sequence[dict[str, Any]],
                   choice: ToolChoice, parallel: bool,
                   literal: Callable[[str], str] = string_literal
                   ) -> StructuredOutputSpec | None:
    """The grammar forcing well-formed calls: one or more of any tool for "required", exactly
    one of the named tool for a named function; None when the model may answer freely."""
    if choice.mode == "function":
        tools = [t for t in tools if t["function"]["name"] == choice.function]
        parallel = False
    elif choice.mode != "required":
        return None
    try:
        return StructuredOutputSpec("grammar", parser.grammar(tools, parallel, literal))
    except ValueError as e:
        raise ValueError(f"tools: the parameters cannot be enforced: {_reason(e)}") from None


def _reason(error: ValueError) -> str:
    """A spec error without its own field prefix, to be reported under the request's field."""
    return str(error).removeprefix("spec: ").removeprefix("spec ")
