"""Tool-call parsers: whole and streamed (one character at a time, and in odd chunks) agree,
deltas are shaped as OpenAI streams them, and each format's grammar accepts exactly its calls."""

from __future__ import annotations

import json

import llguidance
import llguidance.hf
import pytest

from ember.engine.tokenizer import load_tokenizer
from ember.executor.checkpoint import open_checkpoint
from ember.server.config import ServerConfig
from ember.server.tool_parsers import (
    Glm45ToolParser,
    HermesToolParser,
    KimiK2ToolParser,
    ToolParser,
    default_tool_parser,
    get_tool_parser,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 20},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                  "units": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city", "days"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"},
                                                    "tags": {"type": "array"}}}}}
TOOLS = [WEATHER, SEARCH]

HERMES_TEXT = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
    '"days": 3, "note": "a } and \\" inside"}}\n</tool_call>\n<tool_call>\n'
    '{"name": "search", "arguments": {"query": "rain", "tags": ["a", {"b": [1]}]}}\n'
    "</tool_call>")
KIMI_TEXT = (
    "Checking both.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
    '<|tool_call_argument_begin|>{"city": "Beijing", "days": 2}<|tool_call_end|>'
    "<|tool_call_begin|> functions.search:1 <|tool_call_argument_begin|>  "
    '{"query": "smog"}  <|tool_call_end|><|tool_calls_section_end|>')
GLM_TEXT = (
    "I will look it up.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
    "<arg_value>123</arg_value>\n<arg_key>days</arg_key>\n<arg_value>4</arg_value>\n"
    "</tool_call>\n<tool_call>search\n<arg_key>query</arg_key>\n<arg_value>a < b</arg_value>\n"
    '<arg_key>tags</arg_key>\n<arg_value>["x", 2]</arg_value>\n</tool_call>')

EXPECTED = {
    HermesToolParser: ("Let me check.", [
        ("get_weather", '{"city": "Paris", "days": 3, "note": "a } and \\" inside"}'),
        ("search", '{"query": "rain", "tags": ["a", {"b": [1]}]}')]),
    KimiK2ToolParser: ("Checking both.", [("get_weather", '{"city": "Beijing", "days": 2}'),
                                          ("search", '{"query": "smog"}')]),
    Glm45ToolParser: ("I will look it up.", [("get_weather", '{"city": "123", "days": 4}'),
                                             ("search", '{"query": "a < b", "tags": ["x", 2]}')]),
}
TEXTS = {HermesToolParser: HERMES_TEXT, KimiK2ToolParser: KIMI_TEXT, Glm45ToolParser: GLM_TEXT}


def stream(parser: ToolParser, text: str, chunk: int, pieces: list[int] | None = None
           ) -> tuple[str, list[tuple[str, str]]]:
    """Feed text in chunks; rebuild the result from the deltas as an OpenAI client would.
    `pieces` receives, per call, how many deltas brought it argument text."""
    content, calls = "", {}
    deltas = [parser.feed(text[i:i + chunk]) for i in range(0, len(text), chunk)]
    for delta in deltas + [parser.finish()]:
        content += delta.content
        for d in delta.tool_calls:
            if d.index not in calls:
                assert d.index == len(calls), "calls must start in index order"
                assert d.id and d.name, "a call's first delta carries its id and name"
                calls[d.index] = {"id": d.id, "name": d.name, "arguments": "", "pieces": 0}
            else:
                assert d.id is None and d.name is None
            calls[d.index]["arguments"] += d.arguments
            calls[d.index]["pieces"] += bool(d.arguments)
    if pieces is not None:
        pieces.extend(c["pieces"] for c in calls.values())
    return content, [(c["name"], c["arguments"]) for c in calls.values()]


@pytest.mark.parametrize("cls", [HermesToolParser, KimiK2ToolParser, Glm45ToolParser])
def test_whole_and_streamed_agree(cls: type[ToolParser]) -> None:
    text = TEXTS[cls]
    content, calls = EXPECTED[cls]
    whole = cls(TOOLS).parse(text)
    assert whole.content == content
    assert [(c.name, c.arguments) for c in whole.tool_calls] == calls
    for call in whole.tool_calls:
        json.loads(call.arguments)
    for chunk in (1, 2, 3, 7, len(text)):
        assert stream(cls(TOOLS), text, chunk) == (content, calls), f"chunk={chunk}"
    pieces: list[int] = []
    stream(cls(TOOLS), text, 1, pieces)
    assert min(pieces) >= 2, "arguments arrive while the call is being written"


def test_arguments_stream_before_the_call_ends() -> None:
    parser = HermesToolParser(TOOLS)
    head = '<tool_call>\n{"name": "search", "arguments": {"query": "ra'
    delta = parser.feed(head)
    assert delta.tool_calls[0].name == "search"
    assert delta.tool_calls[0].arguments == '{"query": "ra'
    assert parser.feed('in"}}\n</tool_call>').tool_calls[0].arguments == 'in"}'


def test_kimi_ids_are_the_models_own() -> None:
    calls = KimiK2ToolParser().parse(KIMI_TEXT).tool_calls
    assert [c.id for c in calls] == ["functions.get_weather:0", "functions.search:1"]
    assert len({c.id for c in HermesToolParser().parse(HERMES_TEXT).tool_calls}) == 2


def test_glm_values_follow_the_parameter_types() -> None:
    args = json.loads(Glm45ToolParser(TOOLS).parse(GLM_TEXT).tool_calls[0].arguments)
    assert args == {"city": "123", "days": 4}  # city is a string parameter, days an integer
    untyped = json.loads(Glm45ToolParser().parse(GLM_TEXT).tool_calls[0].arguments)
    assert untyped == {"city": 123, "days": 4}


@pytest.mark.parametrize("cls, text", [
    (HermesToolParser, "plain answer with a < b and <tool"),
    (HermesToolParser, "x <tool_call>\nnot json\n</tool_call> y"),
    (KimiK2ToolParser, "x <|tool_call"),
    (Glm45ToolParser, "<tool_"),
    (HermesToolParser, "  spaced  \n"),
])
def test_text_that_is_no_call_is_content_unchanged(cls: type[ToolParser], text: str) -> None:
    parsed = cls().parse(text)
    assert parsed.tool_calls == []
    assert parsed.content == text
    assert stream(cls(), text, 1) == (text, [])


def test_arguments_before_name_and_string_arguments() -> None:
    text = ('<tool_call>{"arguments": {"q": 1}, "name": "a"}</tool_call>'
            '<tool_call>{"name": "b", "arguments": "{\\"q\\": 2}"}</tool_call>')
    expected = (None, [("a", '{"q": 1}'), ("b", '{"q": 2}')])
    parsed = HermesToolParser().parse(text)
    assert (parsed.content, [(c.name, c.arguments) for c in parsed.tool_calls]) == expected
    assert stream(HermesToolParser(), text, 1) == ("", expected[1])
    empty = HermesToolParser().parse('<tool_call>{"name": "f", "arguments": </tool_call>')
    assert [(c.name, c.arguments) for c in empty.tool_calls] == [("f", "{}")]


def test_cut_short() -> None:
    named = HermesToolParser().parse('Hi <tool_call>\n{"name": "f", "arguments": {"q": ')
    assert named.content == "Hi" and [(c.name, c.arguments) for c in named.tool_calls] == [
        ("f", '{"q": ')]
    unnamed = HermesToolParser().parse('Hi <tool_call>\n{"na')
    assert unnamed.content == 'Hi <tool_call>\n{"na' and unnamed.tool_calls == []


def test_registry_and_defaults() -> None:
    assert get_tool_parser("qwen") is HermesToolParser
    with pytest.raises(ValueError, match="tool_call_parser"):
        get_tool_parser("nope")
    assert default_tool_parser("kimi_k2", None) == "kimi_k2"
    assert default_tool_parser("deepseek_v3", "..<|tool_calls_section_begin|>..") == "kimi_k2"
    assert default_tool_parser("glm4_moe", None) == "glm45"
    assert default_tool_parser("llama", "<arg_key>{{ k }}</arg_key>") == "glm45"
    assert default_tool_parser("llama", None) == "hermes"
    with pytest.raises(ValueError, match="^tool_call_parser"):
        ServerConfig(tool_call_parser="kimi")  # what `ember serve --tool-call-parser` checks
    assert ServerConfig(tool_call_parser="glm45").tool_call_parser == "glm45"


@pytest.fixture(scope="module")
def ll_tokenizer(tiny_llama_dir) -> llguidance.LLTokenizer:
    hf = load_tokenizer(open_checkpoint(str(tiny_llama_dir))).hf
    return llguidance.hf.from_tokenizer(hf, n_vocab=len(hf), eos_token=2)


def accepts(ll_tokenizer: llguidance.LLTokenizer, grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(ll_tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar))
    assert not matcher.is_error(), matcher.get_error()
    tokens = ll_tokenizer.tokenize_str(text)
    return matcher.consume_tokens(tokens) and matcher.is_accepting()


@pytest.mark.parametrize("cls, good, bad", [
    (HermesToolParser,
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n'
     "</tool_call>",
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 9}}\n'
     "</tool_call>"),
    (KimiK2ToolParser,
     "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
     '<|tool_call_argument_begin|>{"city": "Oslo", "days": 2, "units": "c"}<|tool_call_end|>'
     "<|tool_calls_section_end|>",
     "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
     '<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|><|tool_calls_section_end|>'),
    (Glm45ToolParser,
     "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n"
     "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>",
     "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n"
     "<arg_key>units</arg_key>\n<arg_value>k</arg_value>\n</tool_call>"),
])
def test_grammar_accepts_exactly_well_formed_calls(ll_tokenizer, cls, good, bad) -> None:
    grammar = cls.grammar([WEATHER], parallel=False)
    assert accepts(ll_tokenizer, grammar, good)
    assert not accepts(ll_tokenizer, grammar, bad)
    assert not accepts(ll_tokenizer, grammar, "I'd rather chat.")
    parsed = cls([WEATHER]).parse(good)
    assert [c.name for c in parsed.tool_calls] == ["get_weather"]
    assert json.loads(parsed.tool_calls[0].arguments)["city"] == "Oslo"


def test_parallel_grammar_takes_several_calls(ll_tokenizer) -> None:
    call = ('<tool_call>\n{"name": "search", "arguments": {"query": "q"}}\n</tool_call>')
    assert accepts(ll_tokenizer, HermesToolParser.grammar(TOOLS, parallel=True),
                   call + "\n" + call)
    assert not accepts(ll_tokenizer, HermesToolParser.grammar(TOOLS, parallel=False),
                       call + "\n" + call)
