"""Greedy output is identical to transformers, whatever the batching, chunking and caching."""

from __future__ import annotations

import inspect
import json
import textwrap
from pathlib import Path

import pytest
import torch

from ember import LLM, SamplingParams
from ember.executor.checkpoint import default_model_path

MAX_TOKENS = 10
PROMPT_LENGTHS = [7, 19, 40, 64, 96, 130, 170, 230]


def stdlib_prompts(tokenizer) -> list[list[int]]:
    """Eight prompts cut from standard-library sources; four share growing prefixes."""
    shared = tokenizer.encode(inspect.getsource(json.decoder))
    other = [tokenizer.encode(inspect.getsource(m)) for m in (textwrap, inspect, Path)]
    prompts = [shared[:n] for n in PROMPT_LENGTHS[::2]]
    prompts += [other[i % 3][50:50 + n] for i, n in enumerate(PROMPT_LENGTHS[1::2])]
    return prompts


def reference_tokens(hf_model, prompts: list[list[int]]) -> list[list[int]]:
    out = []
    for ids in prompts:
        gen = hf_model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS,
                                min_new_tokens=MAX_TOKENS, do_sample=False)
        out.append(gen[0, len(ids):].tolist())
    return out


VARIANTS = {
    "prefix-cache, one big step": dict(enable_prefix_caching=True, max_num_batched_tokens=4096),
    "no prefix cache, chunk 32": dict(enable_prefix_caching=False, max_num_batched_tokens=32),
    "prefix cache, chunk 32": dict(enable_prefix_caching=True, max_num_batched_tokens=32),
    "KV too small for the batch": dict(enable_prefix_caching=True, max_num_batched_tokens=64,
                                       block_size=16, num_kv_blocks=24),
}


def check_all_variants(model: str, prompts, expected) -> None:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for name, kwargs in VARIANTS.items():
        llm = LLM(model, dtype="float32", **kwargs)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert got == expected, name
        llm.engine.check_integrity()
        if "small" in name:
            assert llm.stats().num_preemptions > 0
        if kwargs["enable_prefix_caching"]:
            again = llm.generate(prompts, params)  # every prompt now hits the cache
            assert [o.outputs[0].token_ids for o in again] == expected, f"{name}, cached"
            assert sum(o.num_cached_tokens for o in again) > 0
            llm.engine.check_integrity()


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen3_dir"])
def test_tiny_checkpoints_match_transformers(fixture, request):
    from transformers import AutoModelForCausalLM

    folder = request.getfixturevalue(fixture)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    llm = LLM(str(folder), dtype="float32")
    prompts = stdlib_prompts(llm.get_tokenizer())
    check_all_variants(str(folder), prompts, reference_tokens(hf, prompts))


def test_default_model_matches_transformers():
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                              dtype=torch.float32)
    llm = LLM(dtype="float32")
    prompts = stdlib_prompts(llm.get_tokenizer())
    expected = reference_tokens(hf, prompts)
    assert [o.outputs[0].token_ids for o in llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    ] == expected
    check_all_variants(None, prompts, expected)


def test_stdlib_prompts_have_the_planned_lengths(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=64)
    lengths = sorted(len(p) for p in stdlib_prompts(llm.get_tokenizer()))
    assert lengths == PROMPT_LENGTHS
    assert textwrap.dedent  # the corpus modules exist in this Python
