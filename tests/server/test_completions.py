"""POST /v1/completions against a real `ember serve` with the official openai client."""

from __future__ import annotations

import openai
import pytest

MODEL = "tiny-llama"
EOS_OFF = {"ignore_eos": True}  # random weights: keep lengths fixed
PROMPT = "Once upon a time, in a land far away,"


@pytest.fixture(scope="module")
def client(tiny_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused", max_retries=0,
                         timeout=60)


def test_completion_text_usage_and_echo(client: openai.OpenAI) -> None:
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                     extra_body=EOS_OFF)
    (choice,) = resp.choices
    assert resp.object == "text_completion" and choice.finish_reason == "length"
    assert resp.usage.completion_tokens == 6 and resp.usage.prompt_tokens >= 8
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                       echo=True, extra_body=EOS_OFF)
    assert echoed.choices[0].text == PROMPT + choice.text


def test_default_max_tokens_is_16(client: openai.OpenAI) -> None:
    resp = client.completions.create(model=MODEL, prompt=PROMPT, extra_body=EOS_OFF)
    assert resp.usage.completion_tokens == 16


def test_token_id_prompts_and_batches(client: openai.OpenAI, tiny_llama_dir) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    ids = tokenizer.encode(PROMPT)
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
                                        extra_body=EOS_OFF)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0,
                                       extra_body=EOS_OFF)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == by_text.usage.prompt_tokens == len(ids)
    batch = client.completions.create(model=MODEL, prompt=[ids, tokenizer.encode("The sea")],
                                      n=2, max_tokens=5, temperature=0, extra_body=EOS_OFF)
    assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3]
    texts = {c.index: c.text for c in batch.choices}
    assert texts[0] == texts[1] == by_text.choices[0].text  # greedy: n copies agree
    assert texts[2] == texts[3] != texts[0]
    assert batch.usage.completion_tokens == 20
    assert batch.usage.prompt_tokens > len(ids)


def test_stream_matches_the_whole_answer(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, prompt=[PROMPT, "The sea"], max_tokens=8, temperature=0,
                  extra_body=EOS_OFF)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True,
                                            stream_options={"include_usage": True}))
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for chunk in chunks[:-1]:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert texts == {c.index: c.text for c in whole.choices}
    assert reasons == {0: "length", 1: "length"}
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_stop_string(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, extra_body=EOS_OFF)
    full = client.completions.create(**kwargs).choices[0].text
    stop = full[10:13]
    cut = client.completions.create(**kwargs, stop=stop).choices[0]
    assert cut.text == full[:full.index(stop)] and cut.finish_reason == "stop"


def test_logprobs(client: openai.OpenAI) -> None:
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                     logprobs=2, extra_body=EOS_OFF)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0 and token in top
        assert max(top.values()) == pytest.approx(logprob, abs=1e-4)  # greedy took the best
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4,
                                         temperature=0, logprobs=2, stream=True,
                                         extra_body=EOS_OFF)
    tokens = [t for c in streamed for ch in c.choices if ch.logprobs for t in ch.logprobs.tokens]
    assert tokens == lp.tokens
