"""ChatTools ties a chat request's tools and formats to the prompt, the decoding constraint and
the assistant message; with Kimi's markers as real special tokens a random model is forced into
a well-formed call through the offline engine."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch

from ember import LLM, SamplingParams
from ember.engine.tokenizer import Tokenizer, load_tokenizer
from ember.executor.checkpoint import open_checkpoint
from ember.server.chat_tools import ChatTools, ToolCallMessage
from ember.server.tool_parsers import HermesToolParser, KimiK2ToolParser

KIMI_TEMPLATE = (Path(__file__).with_name("chat_templates") / "kimi_k2.jinja").read_text()
PARAMS = {"type": "object",
          "properties": {"city": {"type": "string", "maxLength": 12},
                         "days": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["city", "days"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}
HI = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir) -> Tokenizer:
    return load_tokenizer(open_checkpoint(str(tiny_llama_dir)))


def test_what_each_tool_choice_asks(tokenizer: Tokenizer) -> None:
    none = ChatTools.from_request(tokenizer, HermesToolParser, tools=[WEATHER],
                                  tool_choice="none")
    assert none.parser is None and none.structured_output is None
    auto = ChatTools.from_request(tokenizer, HermesToolParser, tools=[WEATHER])
    assert auto.parser is HermesToolParser and auto.structured_output is None
    required = ChatTools.from_request(tokenizer, HermesToolParser, tools=[WEATHER],
                                      tool_choice="required", parallel_tool_calls=False)
    assert required.structured_output.kind == "grammar"
    params = required.sampling_params(SamplingParams(max_tokens=5))
    assert params.structured_output is required.structured_output and params.max_tokens == 5
    fmt = ChatTools.from_request(tokenizer, HermesToolParser, tools=[WEATHER],
                                 response_format={"type": "json_object"})
    assert fmt.parser is None and fmt.structured_output.kind == "json"
    with pytest.raises(ValueError, match="^response_format: cannot be combined"):
        ChatTools.from_request(tokenizer, HermesToolParser, tools=[WEATHER],
                               tool_choice="required", response_format={"type": "json_object"})
    with pytest.raises(ValueError, match=r"^tools\[0\]"):
        ChatTools.from_request(tokenizer, HermesToolParser, tools=[{"type": "function"}])


def test_tools_are_announced_when_the_template_ignores_them(tokenizer: Tokenizer) -> None:
    tools = ChatTools.from_request(tokenizer, HermesToolParser, tools=[WEATHER])
    prompt = tools.render(tokenizer, [{"role": "system", "content": "Be brief."}, *HI])
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert json.dumps(WEATHER) in prompt and "<tool_call>" in prompt
    plain = ChatTools.from_request(tokenizer, HermesToolParser)
    assert "# Tools" not in plain.render(tokenizer, HI)
    own = tools.render(tokenizer, HI, chat_template="{{ tools | length }} tools")
    assert own == "1 tools"  # a template that renders tools itself is left alone


def test_message_builder_shapes_openai_output() -> None:
    text = ('Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
            '"days": 2}}\n</tool_call>')
    builder = ToolCallMessage(HermesToolParser([WEATHER]))
    message = builder.message(text)
    assert message["content"] == "Sure."
    assert message["tool_calls"][0]["type"] == "function"
    assert message["tool_calls"][0]["function"] == {"name": "get_weather",
                                                    "arguments": '{"city": "Oslo", "days": 2}'}
    assert builder.finish_reason("stop") == "tool_calls"
    assert builder.finish_reason("length") == "length"
    streamed = ToolCallMessage(HermesToolParser([WEATHER]))
    deltas = [d for i in range(0, len(text), 4) if (d := streamed.delta(text[i:i + 4]))]
    deltas.append(streamed.flush() or {})
    assert "".join(d.get("content", "") for d in deltas) == "Sure."
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert calls[0]["id"].startswith("call_") and calls[0]["function"]["name"] == "get_weather"
    assert all("id" not in c and "name" not in c["function"] for c in calls[1:])
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Oslo", "days": 2}'
    plain = ToolCallMessage(HermesToolParser())
    assert plain.message("no call") == {"role": "assistant", "content": "no call"}
    assert plain.finish_reason("stop") == "stop"


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Path:
    """A tiny random Llama with the default tokenizer plus Kimi K2's tool markers as special
    tokens (past the end of the vocabulary, as in the real one) and a Kimi-style template."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny_kimi")
    hf = load_tokenizer(open_checkpoint(str(tiny_llama_dir))).hf
    base_vocab = len(hf)
    hf.add_special_tokens({"additional_special_tokens": list(KimiK2ToolParser.markers)})
    hf.chat_template = KIMI_TEMPLATE
    hf.save_pretrained(str(folder))
    config = LlamaConfig(vocab_size=base_vocab + 8, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2)
    torch.manual_seed(1)
    LlamaForCausalLM(config).save_pretrained(str(folder), safe_serialization=True)
    return folder


def test_kimi_special_tokens_forced_into_a_well_formed_call(kimi_dir: Path) -> None:
    llm = LLM(str(kimi_dir), dtype="float32", num_kv_blocks=64)
    tokenizer = llm.get_tokenizer()
    marker_ids = set(tokenizer.hf.convert_tokens_to_ids(list(KimiK2ToolParser.markers)))
    assert marker_ids == set(range(len(tokenizer.hf) - 5, len(tokenizer.hf)))  # added tokens
    tools = ChatTools.from_request(tokenizer, KimiK2ToolParser, tools=[WEATHER],
                                   tool_choice="required", parallel_tool_calls=False)
    assert tools.keep_special_tokens
    assert "<|tool_call_begin|>" in tools.structured_output.spec  # as a token, not as text
    prompt = tools.render(tokenizer, HI)
    assert prompt.startswith("<|im_system|>tool_declare<|im_middle|>")
    params = tools.sampling_params(SamplingParams(temperature=1.0, seed=11, max_tokens=80))
    assert not params.skip_special_tokens
    out = llm.generate(tokenizer.encode(prompt, add_special_tokens=False), params)[0].outputs[0]
    assert out.finish_reason == "stop", out.text
    builder = tools.message_builder()
    message = builder.message(out.text)
    assert builder.finish_reason(out.finish_reason) == "tool_calls"
    (call,) = message["tool_calls"]
    assert call["id"] == "functions.get_weather:0"
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMS)
    used = [t for t in out.token_ids if t in marker_ids]
    assert tokenizer.hf.convert_ids_to_tokens(used) == [
        KimiK2ToolParser.SECTION_BEGIN, KimiK2ToolParser.CALL_BEGIN, KimiK2ToolParser.ARG_BEGIN,
        KimiK2ToolParser.CALL_END, KimiK2ToolParser.SECTION_END]
