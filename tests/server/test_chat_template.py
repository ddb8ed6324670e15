"""Chat templates: messages are checked and shaped as HF templates expect, and Kimi K2 / GLM-4.5
style templates (small copies of the real ones' structure) render tools, tool calls and tool
results in their formats, which the matching parsers read back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from jinja2 import TemplateError

from ember.engine.tokenizer import Tokenizer, load_tokenizer
from ember.executor.checkpoint import open_checkpoint
from ember.server.chat_template import normalize_tools, render_chat_prompt
from ember.server.tool_parsers import Glm45ToolParser, KimiK2ToolParser

TEMPLATES = Path(__file__).with_name("chat_templates")
KIMI_TEMPLATE = (TEMPLATES / "kimi_k2.jinja").read_text()
GLM_TEMPLATE = (TEMPLATES / "glm45.jinja").read_text()
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer"}},
                   "required": ["city"]}}}
CALLS = [{"id": "functions.get_weather:0", "type": "function",
          "function": {"name": "get_weather", "arguments": '{"city": "Beijing", "days": 2}'}},
         {"id": "functions.get_weather:1", "type": "function",
          "function": {"name": "get_weather", "arguments": '{"city": "Shanghai"}'}}]
CONVERSATION = [
    {"role": "user", "content": [{"type": "text", "text": "Weather in"},
                                 {"type": "text", "text": "Beijing and Shanghai?"}]},
    {"role": "assistant", "content": None, "tool_calls": CALLS},
    {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"},
    {"role": "tool", "tool_call_id": "functions.get_weather:1", "content": "rain"},
]


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir) -> Tokenizer:
    return load_tokenizer(open_checkpoint(str(tiny_llama_dir)))


def test_kimi_format(tokenizer: Tokenizer) -> None:
    prompt = render_chat_prompt(tokenizer, CONVERSATION, [WEATHER],
                                chat_template=KIMI_TEMPLATE)
    declared = json.dumps([WEATHER], separators=(",", ":"))
    assert prompt.startswith(f"<|im_system|>tool_declare<|im_middle|>{declared}<|im_end|>")
    assert "<|im_user|>user<|im_middle|>Weather in\nBeijing and Shanghai?<|im_end|>" in prompt
    section = ("<|tool_calls_section_begin|>"
               "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
               '{"city": "Beijing", "days": 2}<|tool_call_end|>'
               "<|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>"
               '{"city": "Shanghai"}<|tool_call_end|><|tool_calls_section_end|>')
    assert f"<|im_assistant|>assistant<|im_middle|>{section}<|im_end|>" in prompt
    assert ("<|im_system|>tool<|im_middle|>## Return of functions.get_weather:1\nrain<|im_end|>"
            in prompt)
    assert prompt.endswith("<|im_assistant|>assistant<|im_middle|>")
    parsed = KimiK2ToolParser().parse(section)
    assert [(c.id, c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        (c["id"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in CALLS]


def test_glm_format(tokenizer: Tokenizer) -> None:
    prompt = render_chat_prompt(tokenizer, CONVERSATION, [WEATHER], chat_template=GLM_TEMPLATE)
    assert prompt.startswith("[gMASK]<sop><|system|>\n# Tools\n<tools>\n")
    assert json.dumps(WEATHER, ensure_ascii=False) in prompt
    calls = ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Beijing</arg_value>\n"
             "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>\n"
             "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Shanghai</arg_value>\n"
             "</tool_call>")
    assert f"<|assistant|>\n{calls}<|observation|>" in prompt
    assert prompt.count("<|observation|>") == 1
    assert "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n" in prompt
    assert prompt.endswith("</tool_response><|assistant|>")
    parsed = Glm45ToolParser([WEATHER]).parse(calls)
    assert [json.loads(c.arguments) for c in parsed.tool_calls] == [
        {"city": "Beijing", "days": 2}, {"city": "Shanghai"}]


def test_templates_need_arguments_as_a_dict(tokenizer: Tokenizer) -> None:
    """What the conversion is for: GLM's template iterates the arguments' items."""
    raw = [{"role": "assistant", "content": "", "tool_calls": CALLS}]
    with pytest.raises(TemplateError):
        tokenizer.hf.apply_chat_template(raw, tokenize=False, chat_template=GLM_TEMPLATE)
    assert "<arg_key>city</arg_key>" in render_chat_prompt(
        tokenizer, raw, add_generation_prompt=False, chat_template=GLM_TEMPLATE)


def test_model_template_and_generation_prompt(tokenizer: Tokenizer) -> None:
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt = render_chat_prompt(tokenizer, messages)
    assert prompt == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                      "<|im_start|>assistant\n")
    assert not render_chat_prompt(tokenizer, messages, add_generation_prompt=False).endswith(
        "assistant\n")
    cont = render_chat_prompt(tokenizer, [*messages, {"role": "assistant", "content": "Hel"}],
                              add_generation_prompt=False, continue_final_message=True)
    assert cont.endswith("<|im_start|>assistant\nHel")
    assert render_chat_prompt(tokenizer, messages, chat_template="{{ greeting }}",
                              greeting="hello") == "hello"
    extra = [{"role": "user", "content": "Hi", "mood": "sunny"}]
    assert render_chat_prompt(tokenizer, extra, chat_template="{{ messages[0].mood }}") == "sunny"


@pytest.mark.parametrize("messages, field", [
    ([], "messages"),
    ("hi", "messages"),
    (["hi"], r"messages\[0\]"),
    ([{"role": "robot", "content": "x"}], r"messages\[0\].role"),
    ([{"role": "user"}], r"messages\[0\].content"),
    ([{"role": "user", "content": 5}], r"messages\[0\].content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
     r"messages\[0\].content\[0\].type"),
    ([{"role": "user", "content": [{"type": "text"}]}], r"messages\[0\].content\[0\].text"),
    ([{"role": "tool", "content": "x"}], r"messages\[0\].tool_call_id"),
    ([{"role": "assistant", "content": None}], r"messages\[0\].content"),
    ([{"role": "assistant", "tool_calls": {}}], r"messages\[0\].tool_calls"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}],
     r"messages\[0\].tool_calls\[0\].id"),
    ([{"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f",
                                                                    "arguments": "{x"}}]}],
     r"messages\[0\].tool_calls\[0\].function.arguments"),
    ([{"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f",
                                                                    "arguments": "[1]"}}]}],
     r"messages\[0\].tool_calls\[0\].function.arguments"),
    ([{"role": "user", "content": "x", "name": 3}], r"messages\[0\].name"),
])
def test_bad_messages_name_the_field(tokenizer: Tokenizer, messages, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}"):
        render_chat_prompt(tokenizer, messages)


@pytest.mark.parametrize("tools, field", [
    ({}, "tools"),
    ([{"type": "retrieval"}], r"tools\[0\].type"),
    ([{"type": "function"}], r"tools\[0\].function"),
    ([{"type": "function", "function": {"name": "has space"}}], r"tools\[0\].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}],
     r"tools\[0\].function.parameters"),
    ([WEATHER, WEATHER], r"tools\[1\].function.name"),
])
def test_bad_tools_name_the_field(tools, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}"):
        normalize_tools(tools)


def test_template_problems_are_value_errors(tokenizer: Tokenizer, tiny_llama_dir) -> None:
    hi = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="^messages: the model's chat template rejected"):
        render_chat_prompt(tokenizer, hi, chat_template="{{ raise_exception('roles!') }}")
    with pytest.raises(ValueError, match="^chat_template_kwargs"):
        render_chat_prompt(tokenizer, hi, tokenize=True)
    with pytest.raises(ValueError, match="^continue_final_message"):
        render_chat_prompt(tokenizer, hi, continue_final_message=True)
    bare = load_tokenizer(open_checkpoint(str(tiny_llama_dir)))
    bare.hf.chat_template = None
    with pytest.raises(ValueError, match="^messages: this model has no chat template"):
        render_chat_prompt(bare, hi)
