"""response_format and tool_choice become decoding constraints; bad ones name their field."""

from __future__ import annotations

import json

import pytest

from ember.server.structured_output import (
    ToolChoice,
    parse_tool_choice,
    response_format_spec,
    tool_call_spec,
)
from ember.server.tool_parsers import HermesToolParser

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOL = {"type": "function", "function": {"name": "f", "parameters": SCHEMA}}


def test_response_formats() -> None:
    assert response_format_spec(None) is None
    assert response_format_spec({"type": "text"}) is None
    assert response_format_spec({"type": "json_object"}).kind == "json"
    spec = response_format_spec({"type": "json_schema", "json_schema": {
        "name": "thing", "schema": SCHEMA, "strict": True}})
    assert spec.kind == "json_schema" and json.loads(spec.spec) == SCHEMA


@pytest.mark.parametrize("response_format, field", [
    ("json", "response_format"),
    ({"type": "yaml"}, "response_format.type"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"schema": SCHEMA}},
     "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "a b", "schema": SCHEMA}},
     "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": "yes"}},
     "response_format.json_schema.strict"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}},
     "response_format.json_schema.schema"),
])
def test_bad_response_formats_name_the_field(response_format, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field.replace('.', '[.]')}:"):
        response_format_spec(response_format)


def test_tool_choices() -> None:
    assert parse_tool_choice(None, []) == ToolChoice("none")
    assert parse_tool_choice(None, ["f"]) == ToolChoice("auto")
    assert parse_tool_choice("required", ["f"]) == ToolChoice("required")
    named = {"type": "function", "function": {"name": "f"}}
    assert parse_tool_choice(named, ["f"]) == ToolChoice("function", "f")


@pytest.mark.parametrize("tool_choice, names, field", [
    ("sometimes", ["f"], "tool_choice"),
    ("required", [], "tool_choice"),
    ({"type": "function"}, ["f"], "tool_choice"),
    ({"type": "function", "function": {"name": "g"}}, ["f"], "tool_choice.function.name"),
    (3, ["f"], "tool_choice"),
])
def test_bad_tool_choices_name_the_field(tool_choice, names, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field.replace('.', '[.]')}:"):
        parse_tool_choice(tool_choice, names)


def test_forced_calls_get_a_grammar_free_ones_do_not() -> None:
    assert tool_call_spec(HermesToolParser, [TOOL], ToolChoice("auto"), True) is None
    required = tool_call_spec(HermesToolParser, [TOOL], ToolChoice("required"), True)
    assert required.kind == "grammar" and '("\\n" call)*' in required.spec
    named = tool_call_spec(HermesToolParser, [TOOL, {"type": "function", "function": {
        "name": "g"}}], ToolChoice("function", "g"), True)
    assert '"const": "g"' in named.spec and '"const": "f"' not in named.spec
    assert "call)*" not in named.spec  # a named function is called exactly once
    broken = {"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}
    with pytest.raises(ValueError, match="^tools:"):
        tool_call_spec(HermesToolParser, [broken], ToolChoice("required"), True)
