"""The offline engine as a user drives it: caching counters, seeds, stops, n, logprobs, abort."""

from __future__ import annotations

import inspect
import json

import pytest
import torch

from ember import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(str(tiny_llama_dir), dtype="float32", max_num_batched_tokens=512)


def code_tokens(llm: LLM, n: int) -> list[int]:
    ids = llm.get_tokenizer().encode(inspect.getsource(json.decoder) * 3)
    assert len(ids) >= n
    return ids[:n]


def test_shared_1000_token_prefix_computes_only_new_tokens(llm):
    prefix = code_tokens(llm, 1100)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([prefix[:1040] + [11, 12, 13]], params)
    before = llm.stats().num_computed_tokens
    second_prompt = prefix[:1040] + [21, 22, 23, 24, 25]
    [out] = llm.generate([second_prompt], params)
    computed = llm.stats().num_computed_tokens - before
    block = llm.config.cache.block_size
    assert out.num_cached_tokens == 1040 // block * block
    # only the uncached prompt tail plus the decode steps (each decode computes one token)
    assert computed == len(second_prompt) - out.num_cached_tokens + 3
    llm.engine.check_integrity()


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    prompt = code_tokens(llm, 30)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12,
                            ignore_eos=True)
    alone = llm.generate([prompt], seeded)[0].outputs[0].token_ids
    others = [code_tokens(llm, 50)[i:] for i in range(5)]
    batch = llm.generate([*others, prompt],
                         [SamplingParams(temperature=1.0, max_tokens=12)] * 5 + [seeded])
    assert batch[-1].outputs[0].token_ids == alone
    unseeded = llm.generate([prompt] * 2, SamplingParams(temperature=1.0, max_tokens=12,
                                                         ignore_eos=True))
    assert unseeded[0].outputs[0].token_ids != unseeded[1].outputs[0].token_ids


def test_stop_string_truncates_text_and_ends_the_request(llm):
    prompt = code_tokens(llm, 20)
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20,
                                                 ignore_eos=True))[0].outputs[0]
    stop = free.text[5:8]
    first = free.text.find(stop)
    [out] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, stop=[stop],
                                                  ignore_eos=True))
    comp = out.outputs[0]
    assert comp.text == free.text[:first]
    assert comp.finish_reason == "stop" and comp.stop_reason == stop
    assert len(comp.token_ids) < 20
    llm.engine.check_integrity()


def test_stop_token_ids_and_max_tokens(llm):
    prompt = code_tokens(llm, 20)
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10,
                                                 ignore_eos=True))[0].outputs[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 10
    stop_id = free.token_ids[3]
    [out] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10,
                                                  stop_token_ids=[stop_id], ignore_eos=True))
    assert out.outputs[0].token_ids == free.token_ids[:free.token_ids.index(stop_id) + 1]
    assert out.outputs[0].stop_reason == stop_id


def test_n_completions_and_logprobs(tiny_llama_dir, llm):
    from transformers import AutoModelForCausalLM

    prompt = code_tokens(llm, 25)
    [out] = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=5,
                                                  logprobs=3, ignore_eos=True))
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
    comp = out.outputs[0]
    full = torch.tensor([prompt + comp.token_ids])
    ref = hf(full).logits[0, len(prompt) - 1:-1].log_softmax(-1)
    for step, lp in enumerate(comp.logprobs):
        assert lp.token_id == comp.token_ids[step]
        assert lp.logprob == pytest.approx(ref[step, lp.token_id].item(), abs=1e-4)
        top_ids = ref[step].topk(3).indices.tolist()
        assert list(lp.top) == top_ids


def test_stream_deltas_add_up_and_abort_frees_blocks(llm):
    prompt = code_tokens(llm, 40)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    chunks = list(llm.stream(prompt, params))
    final = chunks[-1].outputs[0]
    assert final.finished
    assert "".join(c.outputs[0].delta_text for c in chunks) == final.text
    assert sum(len(c.outputs[0].delta_token_ids) for c in chunks) == 12
    free_before = llm.engine.kv.num_free_blocks
    stream = llm.stream(prompt + [5, 6, 7], params)
    next(stream)
    assert llm.engine.kv.num_free_blocks < free_before
    stream.close()  # the consumer walks away: the request is aborted
    assert not llm.has_unfinished()
    assert llm.engine.kv.num_free_blocks == free_before
    llm.engine.check_integrity()


def test_multibyte_characters_split_across_tokens_decode_intact(llm):
    text = "naïve café — 日本語のテキスト 🙂🚀 done"
    ids = llm.get_tokenizer().encode(text)
    from ember.engine.detokenizer import IncrementalDetokenizer

    detok = IncrementalDetokenizer(llm.get_tokenizer(), prompt_token_ids=[1])
    pieces = [detok.add(t) for t in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert len(ids) > len(pieces) - pieces.count("")  # some tokens completed no character


def test_bad_requests_raise_value_error(llm):
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[1] * (llm.engine.max_model_len + 1)])
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[10**9]])
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    assert not llm.has_unfinished()
    llm.engine.check_integrity()
