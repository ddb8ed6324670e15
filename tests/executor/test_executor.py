"""The multi-process executor: workers started by a launcher (torchrun's environment) that
connect to the engine, and failures that surface as errors naming the rank, not hangs."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from ember import LLM, SamplingParams
from ember.executor.executor import WorkerFailedError

from ..conftest import REPO_ROOT, free_port

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [5, 6, 7, 8, 9, 10, 11, 12, 20, 21, 22]]
PARAMS = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
ARGS = dict(dtype="float32", num_kv_blocks=32, block_size=4, max_num_batched_tokens=8)


@pytest.fixture(autouse=True)
def one_thread_per_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBER_NUM_THREADS", "1")


def greedy(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]


def test_launched_workers_connect_to_the_engine(tiny_llama_dir, monkeypatch) -> None:
    """What `torchrun --nproc-per-node 2 -m ember.executor.worker --engine HOST:PORT` does."""
    expected = greedy(LLM(str(tiny_llama_dir), **ARGS))
    monkeypatch.setenv("EMBER_WORKER_AUTHKEY", "test-key")
    engine_port = free_port()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": "2"}
    workers = [subprocess.Popen([sys.executable, "-m", "ember.executor.worker", "--engine",
                                 f"127.0.0.1:{engine_port}"], cwd=REPO_ROOT,
                                env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)})
               for rank in range(2)]
    try:
        llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, worker_launcher="external",
                  worker_listen=f"127.0.0.1:{engine_port}", **ARGS)
        assert sorted(llm.engine.runner.worker_pids) == sorted(w.pid for w in workers)
        assert greedy(llm) == expected
        llm.shutdown()
        assert [w.wait(timeout=30) for w in workers] == [0, 0]
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()


def test_a_rank_failing_to_load_fails_the_engine_with_its_error(tiny_llama_dir) -> None:
    start = time.monotonic()
    with pytest.raises(WorkerFailedError,
                       match=r"worker rank \d failed: ValueError: tensor_parallel_size: 3 ranks "
                             r"cannot split attention heads \(4\) evenly"):
        LLM(str(tiny_llama_dir), tensor_parallel_size=3, **ARGS)
    assert time.monotonic() - start < 60
