"""`ember serve --tensor-parallel-size 2` behind the official openai client: it answers like
one process, and killing one of its worker processes ends the open request with an error
within seconds, never a hang."""

from __future__ import annotations

import argparse
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest

from ember import LLM, SamplingParams
from ember.server.cli import add_arguments, configs

PROMPT = "The quick brown fox jumps over the lazy dog because"
KILL_TO_ERROR_S = 10.0


def child_pids(pid: int) -> list[int]:
    """Live processes whose parent is pid (from /proc)."""
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                children.append(int(entry.name))
    return sorted(children)


@pytest.fixture(scope="module")
def tp_server(ember_servers: Callable, tiny_llama_dir: Path,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    server = ember_servers(tiny_llama_dir, "--dtype", "float32", "--tensor-parallel-size", "2",
                           "--num-kv-blocks", "160", "--max-model-len", "2048", "--ledger",
                           str(tmp_path_factory.mktemp("tp_server") / "ledger.sqlite"))
    yield server
    server.stop()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                         timeout=60.0)


def test_tp2_server_answers_the_openai_client_like_one_process(tp_server, tiny_llama_dir):
    reply = client(tp_server).completions.create(
        model=tiny_llama_dir.name, prompt=PROMPT, max_tokens=12, temperature=0,
        extra_body={"ignore_eos": True})
    one_process = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=64).generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert reply.choices[0].text == one_process.outputs[0].text
    assert reply.usage.completion_tokens == 12


def test_killing_a_worker_fails_the_open_request_within_seconds(tp_server, tiny_llama_dir):
    # the server's children: the engine core (whose children are the two workers) and
    # multiprocessing's helpers
    [workers] = [w for w in map(child_pids, child_pids(tp_server.process.pid)) if len(w) == 2]
    stream = client(tp_server).completions.create(
        model=tiny_llama_dir.name, prompt=PROMPT, max_tokens=1900, temperature=0, stream=True,
        extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)  # generating
    os.kill(workers[-1], signal.SIGKILL)
    killed = time.monotonic()
    with pytest.raises(openai.APIError) as failure:
        for _ in chunks:
            assert time.monotonic() - killed < KILL_TO_ERROR_S
    assert time.monotonic() - killed < KILL_TO_ERROR_S
    assert "worker rank" in str(failure.value) and "killed by signal 9" in str(failure.value)
    # the engine is gone: new requests are refused at once rather than queued forever
    with pytest.raises(openai.APIStatusError) as refused:
        client(tp_server).completions.create(model=tiny_llama_dir.name, prompt=PROMPT,
                                             max_tokens=2)
    assert refused.value.status_code == 503


def test_parallel_flags_reach_the_engine_config() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    _, engine = configs(parser.parse_args([
        "m", "--tensor-parallel-size", "2", "--data-parallel-size", "2",
        "--expert-parallel-size", "4", "--eplb", "--eplb-interval-steps", "8"]))
    p = engine.parallel
    assert (p.tensor_parallel_size, p.data_parallel_size, p.expert_parallel_size) == (2, 2, 4)
    assert p.enable_eplb and p.eplb_interval_steps == 8 and p.num_redundant_experts == 4
    with pytest.raises(ValueError, match="^expert_parallel_size:"):
        configs(parser.parse_args(["m", "--tensor-parallel-size", "2",
                                   "--expert-parallel-size", "3"]))
