"""Constrained decoding: specs are checked up front, masks allow exactly the grammar's tokens
(EOS only once it is complete), and a tiny random model's output obeys the constraint."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from ember import LLM, SamplingParams
from ember.core.sampling_params import StructuredOutputSpec
from ember.engine.tokenizer import load_tokenizer
from ember.executor.checkpoint import open_checkpoint
from ember.executor.structured_output import StructuredOutputManager

EOS = 2  # tiny_llama_dir's eos_token_id
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "role": {"enum": ["admin", "user", "guest"]},
                   "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("kind, spec, field", [
    ("xml", "", "kind"),
    ("json_schema", "{not json", "spec"),
    ("json_schema", "[1, 2]", "spec"),
    ("json_schema", '{"type": "objectx"}', "spec"),
    ("json_schema", '{"type": "integer", "minimum": 5, "maximum": 1}', "spec"),
    ("regex", "(unclosed", "spec"),
    ("regex", "", "spec"),
    ("grammar", "start: undefined_rule", "spec"),
])
def test_invalid_specs_are_rejected_naming_the_field(kind: str, spec: str, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}"):
        StructuredOutputSpec(kind, spec)


def test_sampling_params_take_only_a_spec() -> None:
    with pytest.raises(ValueError, match="structured_output"):
        SamplingParams(structured_output='{"type": "object"}')  # type: ignore[arg-type]
    spec = StructuredOutputSpec("json")
    assert SamplingParams(structured_output=spec).structured_output is spec


@pytest.fixture(scope="module")
def manager(tiny_llama_dir) -> StructuredOutputManager:
    hf = load_tokenizer(open_checkpoint(str(tiny_llama_dir))).hf
    return StructuredOutputManager(hf, len(hf), [EOS])


def allowed(manager: StructuredOutputManager, request_id: str,
            spec: StructuredOutputSpec) -> set[int]:
    logits = torch.zeros(2, manager.vocab_size)
    manager.mask_logits(logits, [(1, request_id, spec)])
    assert torch.all(logits[0] == 0), "rows without a spec are left alone"
    return set(torch.nonzero(logits[1] == 0).view(-1).tolist())


def test_mask_follows_the_grammar_and_allows_eos_only_at_the_end(manager, tiny_llama_dir
                                                                  ) -> None:
    hf = load_tokenizer(open_checkpoint(str(tiny_llama_dir))).hf
    spec = StructuredOutputSpec("regex", "ab(c|d)")
    first = allowed(manager, "r1", spec)
    assert EOS not in first
    assert first and all("abc".startswith(hf.decode([t])) or "abd".startswith(hf.decode([t]))
                         for t in first)
    for token in hf.encode("abd", add_special_tokens=False):
        assert EOS not in allowed(manager, "r1", spec)
        manager.accept("r1", token)
    assert allowed(manager, "r1", spec) == {EOS}, "complete: only EOS may follow"
    assert manager.num_matchers == 1
    manager.free(["r1"])
    assert manager.num_matchers == 0
    assert allowed(manager, "r1", spec) == first, "a freed id starts afresh"
    half = torch.zeros(2, manager.vocab_size, dtype=torch.bfloat16)  # the torch (GPU) path
    manager.mask_logits(half, [(0, "r1", spec)])
    assert set(torch.nonzero(half[0] == 0).view(-1).tolist()) == first
    assert torch.all(half[1] == 0)
    manager.free(["r1"])


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=256)


def test_json_schema_output_validates_even_from_a_random_model(llm: LLM) -> None:
    spec = StructuredOutputSpec("json_schema", json.dumps(SCHEMA))
    greedy = SamplingParams(temperature=0, max_tokens=80, structured_output=spec)
    sampled = SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=80, structured_output=spec)
    outputs = llm.generate(["Describe a user:", "JSON please"], [greedy, sampled])
    completions = [c for out in outputs for c in out.outputs]
    assert len(completions) == 3
    for c in completions:
        assert c.finish_reason == "stop", c.text  # the grammar's end ended the request
        jsonschema.validate(json.loads(c.text), SCHEMA)
        assert c.token_ids[-1] == EOS
    assert llm.engine.runner.structured_output is not None
    llm.generate("x", SamplingParams(max_tokens=1))  # a step that frees finished requests
    assert llm.engine.runner.structured_output.num_matchers == 0


def test_regex_output_matches(llm: LLM) -> None:
    pattern = r"(yes|no), [0-9]{1,3} (apples|pears)!"
    out = llm.generate("Answer:", SamplingParams(
        temperature=1.0, seed=3, max_tokens=40,
        structured_output=StructuredOutputSpec("regex", pattern)))[0].outputs[0]
    assert re.fullmatch(pattern, out.text), out.text


def test_unconstrained_requests_in_the_same_batch_are_unaffected(llm: LLM) -> None:
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = llm.generate("The weather today", plain)[0].outputs[0].token_ids
    spec = StructuredOutputSpec("json_schema", json.dumps(SCHEMA))
    batch = llm.generate(["The weather today", "{"], [
        plain, SamplingParams(temperature=0, max_tokens=60, structured_output=spec)])
    assert batch[0].outputs[0].token_ids == alone
    json.loads(batch[1].outputs[0].text)
