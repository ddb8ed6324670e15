"""Greedy output is identical to transformers, whatever the batching, chunking and caching."""

from __future__ import annotations

import inspect
import json
import textwrap
from pathlib import Path

import pytest
import torch

from ember import LLM, SamplingParams
from ember.engine.tokenizer import load_tokenizer
from ember.executor.checkpoint import open_checkpoint

MAX_TOKENS = 10
PROMPT_LENGTHS = [7, 19, 40, 64, 96, 130, 170, 230]


def stdlib_prompts(tokenizer) -> list[list[int]]:
    """Eight prompts cut from standard-library sources; four share growing prefixes."""
    shared = tokenizer.encode(inspect.getsource(json.decoder))
    other = [tokenizer.encode(inspect.getsource(m)) for m in (textwrap, inspect, Path)]
    prompts = [shared[:n] for n in PROMPT_LENGTHS[::2]]
    prompts += [other[i % 3][50:50 + n] for i, n in enumerate(PROMPT_LENGTHS[1::2])]
    return prompts


def assert_greedy_matches(hf_model, prompts: list[list[int]], outputs: list[list[int]]) -> None:
    """transformers' greedy choice at every step equals ember's token.

    One teacher-forced forward per prompt is equivalent to comparing with `generate` (by
    induction over the steps) and much cheaper.
    """
    for ids, out in zip(prompts, outputs, strict=True):
        assert len(out) == MAX_TOKENS
        with torch.inference_mode():
            logits = hf_model(torch.tensor([ids + out[:-1]])).logits[0, len(ids) - 1:]
        assert logits.argmax(-1).tolist() == out


VARIANTS = {
    "prefix-cache, one big step": dict(enable_prefix_caching=True, max_num_batched_tokens=4096),
    "no prefix cache, chunk 32": dict(enable_prefix_caching=False, max_num_batched_tokens=32),
    "prefix cache, chunk 32": dict(enable_prefix_caching=True, max_num_batched_tokens=32),
    "KV too small for the batch": dict(enable_prefix_caching=True, max_num_batched_tokens=64,
                                       block_size=16, num_kv_blocks=24),
}


def check_all_variants(model: str | None, hf_model, prompts) -> None:
    """The first variant matches transformers; every other variant matches the first."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = None
    for name, kwargs in VARIANTS.items():
        llm = LLM(model, dtype="float32", **kwargs)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        if expected is None:
            assert_greedy_matches(hf_model, prompts, got)
            expected = got
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
    tokenizer = load_tokenizer(open_checkpoint(str(folder)))
    check_all_variants(str(folder), hf, stdlib_prompts(tokenizer))


def test_default_model_matches_transformers():
    """transformers runs the GGUF's dequantized weights as a plain LlamaForCausalLM (that the
    dequantized weights equal transformers' own GGUF loading is tests/executor/test_gguf.py)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    checkpoint = open_checkpoint(None)
    hf = LlamaForCausalLM(LlamaConfig(**checkpoint.hf_config))
    hf.load_state_dict(dict(checkpoint.tensors()), strict=False)  # lm_head is tied
    check_all_variants(None, hf.eval(), stdlib_prompts(load_tokenizer(checkpoint)))


def test_stdlib_prompts_have_the_planned_lengths(tiny_llama_dir):
    prompts = stdlib_prompts(load_tokenizer(open_checkpoint(str(tiny_llama_dir))))
    assert sorted(len(p) for p in prompts) == PROMPT_LENGTHS
