"""Render OpenAI chat messages (and tools) into a prompt with the model's own jinja template.

Messages are checked and brought into the shape Hugging Face templates expect: text parts are
joined into one string, "developer" is a system message, and an assistant's tool calls carry
their arguments as a dict (templates such as GLM-4.5's iterate over them), while the OpenAI
request carries them as a JSON string. Other message fields pass through to the template.
Every problem raises ValueError naming the field.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from ember.engine.tokenizer import Tokenizer

ROLES = ("system", "developer", "user", "assistant", "tool")
TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
# keyword arguments of HF apply_chat_template that are not template variables
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "tokenize", "padding", "truncation",
    "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs"})


def render_chat_prompt(tokenizer: Tokenizer, messages: Any, tools: Any = None, *,
                       add_generation_prompt: bool = True, continue_final_message: bool = False,
                       chat_template: str | None = None, **template_kwargs: Any) -> str:
    """The prompt text for a chat request; template_kwargs reach the template as variables."""
    conversation = normalize_messages(messages)
    hf_tools = normalize_tools(tools) if tools is not None else None
    reserved = RESERVED_TEMPLATE_KWARGS & set(template_kwargs)
    if reserved:
        raise ValueError(f"chat_template_kwargs: {sorted(reserved)} cannot be set")
    if continue_final_message and (add_generation_prompt
                                   or conversation[-1]["role"] != "assistant"):
        raise ValueError("continue_final_message: needs a final assistant message and "
                         "add_generation_prompt false")
    if not (chat_template or tokenizer.chat_template):
        raise ValueError("messages: this model has no chat template; use /v1/completions")
    from jinja2 import TemplateError

    try:
        return tokenizer.hf.apply_chat_template(
            conversation, tools=hf_tools or None, tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, chat_template=chat_template,
            **template_kwargs)
    except TemplateError as e:
        raise ValueError(f"messages: the model's chat template rejected them: {e}") from None


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages: must be a non-empty array")
    return [_message(m, f"messages[{i}]") for i, m in enumerate(messages)]


def _message(message: Any, where: str) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise ValueError(f"{where}: must be an object")
    role = message.get("role")
    if role not in ROLES:
        raise ValueError(f"{where}.role: must be one of {ROLES}, got {role!r}")
    content = message.get("content")
    if content is None and role != "assistant":
        raise ValueError(f"{where}.content: required for role {role!r}")
    extras = {k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id")}
    out: dict[str, Any] = {**extras, "role": "system" if role == "developer" else role,
                           "content": _text(content, f"{where}.content")}
    name = message.get("name")
    if name is not None:
        out["name"] = _string(name, f"{where}.name")
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise ValueError(f"{where}.tool_call_id: required (a string) for role 'tool'")
        out["tool_call_id"] = call_id
    if role == "assistant":
        tool_calls = message.get("tool_calls")
        if tool_calls is not None:
            if not isinstance(tool_calls, list):
                raise ValueError(f"{where}.tool_calls: must be an array")
            out["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{j}]")
                                 for j, c in enumerate(tool_calls)]
        elif content is None:
            raise ValueError(f"{where}.content: required unless tool_calls are given")
        reasoning = message.get("reasoning_content")
        if reasoning is not None:
            out["reasoning_content"] = _string(reasoning, f"{where}.reasoning_content")
    return out


def _text(content: Any, where: str) -> str:
    """Content as one string: a string, or an array of text parts joined by newlines."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}: must be a string or an array of text parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise ValueError(f"{where}[{j}]: must be an object")
        if part.get("type") != "text":
            raise ValueError(f"{where}[{j}].type: only 'text' parts are supported, "
                             f"got {part.get('type')!r}")
        texts.append(_string(part.get("text"), f"{where}[{j}].text"))
    return "\n".join(texts)


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    if not isinstance(call, dict):
        raise ValueError(f"{where}: must be an object")
    if call.get("type", "function") != "function":
        raise ValueError(f"{where}.type: must be 'function'")
    call_id = _string(call.get("id"), f"{where}.id")
    function = call.get("function")
    if not isinstance(function, dict):
        raise ValueError(f"{where}.function: must be an object")
    name = _string(function.get("name"), f"{where}.function.name")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}.function.arguments: not valid JSON ({e})") from None
    if not isinstance(arguments, dict):
        raise ValueError(f"{where}.function.arguments: must encode a JSON object")
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": arguments}}


def normalize_tools(tools: Any) -> list[dict[str, Any]]:
    """Check OpenAI tool definitions; returns them as {"type", "function": {...}} dicts."""
    if not isinstance(tools, list):
        raise ValueError("tools: must be an array")
    out, names = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ValueError(f"{where}.type: must be 'function'")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ValueError(f"{where}.function: must be an object")
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise ValueError(f"{where}.function.name: must be 1-64 letters, digits, '_' or "
                             f"'-', got {name!r}")
        if name in names:
            raise ValueError(f"{where}.function.name: {name!r} is defined twice")
        names.add(name)
        clean: dict[str, Any] = {"name": name}
        if function.get("description") is not None:
            clean["description"] = _string(function["description"],
                                           f"{where}.function.description")
        parameters = function.get("parameters")
        if parameters is not None:
            if not isinstance(parameters, dict):
                raise ValueError(f"{where}.function.parameters: must be a JSON schema object")
            clean["parameters"] = parameters
        if function.get("strict") is not None:
            if not isinstance(function["strict"], bool):
                raise ValueError(f"{where}.function.strict: must be a boolean")
            clean["strict"] = function["strict"]
        out.append({"type": "function", "function": clean})
    return out


def tool_names(tools: Sequence[dict[str, Any]]) -> list[str]:
    return [t["function"]["name"] for t in tools]


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{where}: must be a string")
    return value
