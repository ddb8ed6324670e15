"""AsyncEngine: the engine core in a spawned process, driven from asyncio.

One engine for the module (starting a core process costs seconds); the last test kills its
core process on purpose.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from ember import LLM
from ember.config import CacheConfig, EngineConfig, ModelConfig
from ember.core.sampling_params import SamplingParams
from ember.engine.async_engine import AsyncEngine, EngineDeadError

PROMPTS = ["The quick brown fox", "In the beginning", "Once upon a time there was"]


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def engine(loop, tiny_llama_dir):
    config = EngineConfig(model=ModelConfig(model=str(tiny_llama_dir), dtype="float32"),
                          cache=CacheConfig(num_kv_blocks=64))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EMBER_NUM_THREADS", "1")  # read by the spawned core process
        engine = loop.run_until_complete(AsyncEngine.launch(config))
    yield engine
    loop.run_until_complete(engine.shutdown())


async def collect(engine: AsyncEngine, request_id: str, prompt: str, params: SamplingParams):
    ids = engine.tokenizer.encode(prompt)
    outputs = [out async for out in engine.generate(request_id, ids, params, prompt)]
    return outputs


async def idle_status(engine: AsyncEngine, min_checks: int = 0):
    for _ in range(400):
        status = engine.status
        if (status.engine.num_running == 0 and status.engine.num_waiting == 0
                and status.integrity_checks >= min_checks):
            return status
        await asyncio.sleep(0.025)
    raise AssertionError("the engine never went idle")


def test_concurrent_requests_match_the_offline_engine(loop, engine, tiny_llama_dir) -> None:
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

    async def run():
        return await asyncio.gather(*[collect(engine, f"r{i}", p, params)
                                      for i, p in enumerate(PROMPTS)])

    results = loop.run_until_complete(run())
    offline = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=64).generate(
        PROMPTS, params)
    for outputs, expected in zip(results, offline, strict=True):
        final = outputs[-1]
        assert final.finished and all(not o.finished for o in outputs[:-1])
        assert final.outputs[0].token_ids == expected.outputs[0].token_ids
        assert "".join(o.outputs[0].delta_text for o in outputs) == expected.outputs[0].text
    assert engine.num_open_requests() == 0


def test_n_and_stop_strings_run_on_the_frontend_side(loop, engine) -> None:
    params = SamplingParams(n=2, max_tokens=8, temperature=1.0, seed=3, ignore_eos=True)
    outputs = loop.run_until_complete(collect(engine, "fan", PROMPTS[0], params))
    texts = [c.text for c in outputs[-1].outputs]
    assert len(texts) == 2 and texts[0] != texts[1]
    stop = texts[0][4:7]
    stopped = loop.run_until_complete(collect(engine, "stop", PROMPTS[0], SamplingParams(
        max_tokens=8, temperature=1.0, seed=3, ignore_eos=True, stop=[stop])))
    assert stopped[-1].outputs[0].text == texts[0][:texts[0].index(stop)]
    assert stopped[-1].outputs[0].finish_reason == "stop"


def test_leaving_a_stream_aborts_the_request_and_frees_its_blocks(loop, engine) -> None:
    async def run():
        before = await idle_status(engine)
        stream = engine.generate("long", engine.tokenizer.encode(PROMPTS[1]),
                                 SamplingParams(max_tokens=500, ignore_eos=True))
        async for out in stream:
            if len(out.outputs[0].token_ids) == 3:
                busy_usage = engine.status.engine.kv_usage
                break
        await stream.aclose()
        after = await idle_status(engine, before.integrity_checks + 1)
        return before, busy_usage, after

    before, busy_usage, after = loop.run_until_complete(run())
    assert busy_usage > before.engine.kv_usage
    assert after.engine.kv_usage == before.engine.kv_usage
    assert after.integrity_error is None
    assert engine.num_open_requests() == 0


def test_bad_prompts_fail_synchronously(loop, engine) -> None:
    params = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match="prompt"):
        engine.generate("empty", [], params)
    with pytest.raises(ValueError, match="context"):
        engine.generate("long", [5] * engine.max_model_len, params)
    with pytest.raises(ValueError, match="token ids"):
        engine.generate("vocab", [engine.vocab_size + 5], params)
    assert engine.num_open_requests() == 0


def test_a_dead_core_fails_open_requests_instead_of_hanging(loop, engine) -> None:
    async def run():
        stream = engine.generate("doomed", engine.tokenizer.encode(PROMPTS[2]),
                                 SamplingParams(max_tokens=2000, ignore_eos=True))
        async for out in stream:
            if len(out.outputs[0].token_ids) == 2:
                os.kill(engine.core_pid, signal.SIGKILL)

    with pytest.raises(EngineDeadError, match="died"):
        loop.run_until_complete(asyncio.wait_for(run(), timeout=30))
    assert not engine.is_alive
    with pytest.raises(EngineDeadError):
        engine.generate("after", [1, 2, 3], SamplingParams())
