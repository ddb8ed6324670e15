"""Through a real `ember serve` and the official openai client: structured output and forced tool
calls come out well-formed from a tiny random model, streamed and not."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 10},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "admin": {"type": "boolean"}},
          "required": ["name", "age", "admin"], "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema",
                   "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
WEATHER_PARAMS = {"type": "object",
                  "properties": {"city": {"type": "string", "maxLength": 12},
                                 "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                  "required": ["city", "days"]}
TIME_PARAMS = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
               "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMS}}]
PARAMS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(tiny_server: Any) -> openai.OpenAI:
    """The official client on conftest's shared `ember serve` of the tiny Llama."""
    return openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def check_call(name: str, arguments: str) -> None:
    assert name in PARAMS
    jsonschema.validate(json.loads(arguments), PARAMS[name])


def test_json_schema_response_validates(client: openai.OpenAI, model: str) -> None:
    reply = client.chat.completions.create(
        model=model, messages=ASK, max_tokens=60, temperature=0,
        response_format=RESPONSE_FORMAT)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PERSON)
    stream = client.chat.completions.create(
        model=model, messages=ASK, max_tokens=60, temperature=1.0, seed=4, n=2,
        response_format=RESPONSE_FORMAT, stream=True)
    texts = ["", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)


def test_invalid_schema_is_a_400_naming_response_format(client: openai.OpenAI, model: str,
                                                        tiny_server: Any) -> None:
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 3,
                                               "maximum": 1}}, "required": ["a"]}}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=ASK,
                                       response_format=bad)
    error = err.value.body
    assert error["type"] == "invalid_request_error"
    assert error["param"].startswith("response_format")
    assert "unsatisfiable" in error["message"]
    assert httpx.get(f"{tiny_server.url}/health", timeout=10).status_code == 200


def test_tool_choice_required_yields_well_formed_calls(client: openai.OpenAI, model: str) -> None:
    reply = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_tokens=80, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id
    check_call(call.function.name, call.function.arguments)


def test_tool_choice_required_streamed(client: openai.OpenAI, model: str) -> None:
    stream = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_tokens=80, temperature=1.0, seed=2, stream=True)
    calls: dict[int, dict[str, str]] = {}
    finish, deltas = None, 0
    for chunk in stream:
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for d in choice.delta.tool_calls or []:
            deltas += 1
            if d.index not in calls:
                assert d.id and d.type == "function" and d.function.name
                calls[d.index] = {"name": d.function.name, "arguments": ""}
            calls[d.index]["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls"
    assert list(calls) == [0] and deltas > 2  # the arguments arrive in pieces
    check_call(calls[0]["name"], calls[0]["arguments"])


def test_named_function_is_the_one_called(client: openai.OpenAI, model: str) -> None:
    reply = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, max_tokens=60, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    check_call(call.function.name, call.function.arguments)


def test_a_conversation_with_tool_results_is_accepted(client: openai.OpenAI, model: str) -> None:
    messages = [*ASK,
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {
                        "name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    reply = client.chat.completions.create(model=model, messages=messages,
                                           tools=TOOLS, tool_choice="none", max_tokens=3)
    assert reply.choices[0].message.tool_calls is None
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=ASK, tools=TOOLS,
                                       tool_choice={"type": "function",
                                                    "function": {"name": "nope"}})
    assert err.value.body["param"] == "tool_choice.function.name"
