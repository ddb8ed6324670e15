"""POST /v1/chat/completions against a real `ember serve` with the official openai client."""

from __future__ import annotations

import math

import openai
import pytest

MODEL = "tiny-llama"
EOS_OFF = {"ignore_eos": True}  # random weights: keep lengths fixed
HELLO = [{"role": "user", "content": "Tell me a story about a dragon."}]


@pytest.fixture(scope="module")
def client(tiny_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused", max_retries=0,
                         timeout=60)


def test_models_lists_the_served_name(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_chat_completion_reports_text_and_usage(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=HELLO, max_tokens=8, temperature=0, extra_body=EOS_OFF,
        extra_headers={"x-session-affinity": "chat-session-1"})
    resp = raw.parse()
    assert raw.headers["x-session-affinity"] == "chat-session-1"
    assert raw.headers["x-request-id"] == resp.id
    assert resp.object == "chat.completion" and resp.model == MODEL
    (choice,) = resp.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert resp.usage.completion_tokens == 8
    assert resp.usage.prompt_tokens > len(HELLO[0]["content"].split())  # template tokens too
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 8
    assert resp.usage.prompt_tokens_details.cached_tokens >= 0


def test_stream_matches_the_whole_answer(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, messages=HELLO, max_completion_tokens=12, temperature=0,
                  extra_body=EOS_OFF)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == "length" and all(f is None for f in finals[:-1])
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_n_choices(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model=MODEL, messages=HELLO, n=3, max_tokens=6,
                                          temperature=1.0, seed=7, extra_body=EOS_OFF)
    assert sorted(c.index for c in resp.choices) == [0, 1, 2]
    assert len({c.message.content for c in resp.choices}) == 3  # random model, sampled
    assert resp.usage.completion_tokens == 18
    streamed = client.chat.completions.create(model=MODEL, messages=HELLO, n=3, max_tokens=6,
                                              temperature=1.0, seed=7, extra_body=EOS_OFF,
                                              stream=True)
    texts = ["", "", ""]
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [c.message.content for c in sorted(resp.choices, key=lambda c: c.index)]


def test_seed_makes_sampling_reproducible(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        return client.chat.completions.create(
            model=MODEL, messages=HELLO, max_tokens=10, temperature=1.0, seed=seed,
            extra_body=EOS_OFF).choices[0].message.content

    assert sample(1234) == sample(1234)
    assert sample(1234) != sample(4321)


def test_stop_string_cuts_the_answer(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, messages=HELLO, max_tokens=24, temperature=0, extra_body=EOS_OFF)
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    stop = full[12:15]
    assert stop.strip(), f"pick another slice of {full!r}"
    cut = client.chat.completions.create(**kwargs, stop=[stop, "never-generated-xyz"])
    assert cut.choices[0].message.content == full[:full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens < 24
    streamed = client.chat.completions.create(**kwargs, stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == full[:full.index(stop)]


def test_logprobs(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5,
                                          temperature=0, extra_body=EOS_OFF, logprobs=True,
                                          top_logprobs=3)
    content = resp.choices[0].logprobs.content
    assert len(content) == 5
    assert resp.usage.completion_tokens == 5
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert math.isclose(entry.logprob, tops[0], abs_tol=1e-4)  # greedy took the best
        assert entry.bytes == list(entry.token.encode())
    plain = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_lane_and_priority_are_accepted(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3,
                                          extra_body={"lane": "batch", "priority": 5})
    assert resp.usage.completion_tokens <= 3
    resp = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3,
                                          extra_headers={"x-ember-lane": "batch"})
    assert resp.choices[0].finish_reason in ("stop", "length")
