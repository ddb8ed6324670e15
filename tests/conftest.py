"""Shared fixtures: tiny random checkpoints built with transformers, saved as safetensors.

The tiny checkpoints reuse the default model's tokenizer (converted once from its GGUF), so
text round-trips like the real model's while the weights stay a few MB.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import torch

from ember.engine.tokenizer import load_tokenizer
from ember.executor.checkpoint import open_checkpoint

TINY_VOCAB = 49152  # the default model's tokenizer


def save_tokenizer(folder: Path) -> None:
    load_tokenizer(open_checkpoint(None)).hf.save_pretrained(str(folder))


def build_tiny_checkpoint(folder: Path, config: object, model_cls: type, seed: int = 0) -> Path:
    """Save a seeded random transformers model plus the default tokenizer into folder."""
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    model.save_pretrained(str(folder), safe_serialization=True)
    save_tokenizer(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048, rope_theta=10000.0,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama"), config, LlamaForCausalLM)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=32, max_position_embeddings=2048, rope_theta=1000000.0,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_qwen3"), config, Qwen3ForCausalLM)


def read_config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


# ---- a real `ember serve` subprocess, for the server, router, bench and batch tests ----------

SERVER_START_TIMEOUT_S = 180.0
REPO_ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EmberServer:
    """`python -m ember.cli serve MODEL --host 127.0.0.1 --port <free> *extra_args` as a child.

    start() waits until GET /health answers 200; stop() sends SIGTERM, then SIGKILL after
    `stop_timeout` seconds. The server's output goes to `log_path` (by default a temp file,
    deleted by stop()); `log()` reads it back. The engine-core process it spawns exits with it.
    """

    def __init__(self, model_dir: Path | str | None, *extra_args: str,
                 env: dict[str, str] | None = None, log_path: Path | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        model = [] if model_dir is None else [str(model_dir)]
        self.cmd = [sys.executable, "-m", "ember.cli", "serve", *model, "--host", "127.0.0.1",
                    "--port", str(self.port), *extra_args]
        # one torch thread: the suite shares two cores with the test process itself
        self.env = {**os.environ, "EMBER_NUM_THREADS": "1", **(env or {})}
        self._own_log = log_path is None
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix="ember-serve-", suffix=".log")
            os.close(fd)
            log_path = Path(name)
        self.log_path = log_path
        self.process: subprocess.Popen | None = None
        self.ledger_path: Path | None = None  # set by fixtures that pass --ledger

    def start(self, timeout: float = SERVER_START_TIMEOUT_S) -> EmberServer:
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                            env=self.env, cwd=REPO_ROOT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"ember serve exited with {self.process.returncode}:\n"
                                   f"{self.log()[-4000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        log = self.log()
        self.stop()
        raise RuntimeError(f"ember serve did not become healthy in {timeout:.0f}s:\n"
                           f"{log[-4000:]}")

    def stop(self, stop_timeout: float = 30.0) -> int | None:
        """Stop the server (if running) and delete the temp log; returns its exit code."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=stop_timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        if self._own_log:
            self.log_path.unlink(missing_ok=True)
        return self.process.returncode

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextlib.contextmanager
def run_ember_server(model_dir: Path | str | None, *extra_args: str,
                     env: dict[str, str] | None = None) -> Iterator[str]:
    """Run `ember serve model_dir *extra_args` on 127.0.0.1 (a free port); yield its base URL
    (http://127.0.0.1:PORT, without /v1) once /health is up; stop it on exit.

    model_dir=None serves the default model. Example:
        with run_ember_server(tiny_llama_dir, "--dtype", "float32") as url:
            openai.OpenAI(base_url=f"{url}/v1", api_key="x")
    """
    server = EmberServer(model_dir, *extra_args, env=env).start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def ember_servers() -> Iterator[Callable[..., EmberServer]]:
    """Factory: ember_servers(model_dir, *extra_args) -> a started EmberServer. Servers still
    running at the end of the session are stopped then; call .stop() to stop one earlier."""
    started: list[EmberServer] = []

    def start(model_dir: Path | str | None, *extra_args: str,
              env: dict[str, str] | None = None) -> EmberServer:
        server = EmberServer(model_dir, *extra_args, env=env)
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.stop()


TINY_SERVER_MODEL = "tiny-llama"


@pytest.fixture(scope="session")
def tiny_server(ember_servers: Callable[..., EmberServer], tiny_llama_dir: Path,
                tmp_path_factory: pytest.TempPathFactory) -> EmberServer:
    """One shared `ember serve` of tiny_llama_dir, served as "tiny-llama": float32, 128 KV
    blocks of 16 tokens, 512-token context, 64 KiB body limit, a ledger of its own
    (`.ledger_path`), no auth. Tests must leave it as they found it (no stray requests)."""
    ledger = tmp_path_factory.mktemp("tiny_server") / "ledger.sqlite"
    server = ember_servers(tiny_llama_dir, "--served-model-name", TINY_SERVER_MODEL,
                           "--dtype", "float32", "--num-kv-blocks", "128",
                           "--max-model-len", "512", "--max-body-bytes", "65536",
                           "--ledger", str(ledger))
    server.ledger_path = ledger
    return server
