"""Fixtures of the batch lane's tests: a real redis-server, and the helpers (batch files, job
polling) as the `kit` fixture, so tests reach them under any pytest import mode."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import Any

import openai
import pytest
import redis

MODEL = "tiny-llama"
TERMINAL = ("completed", "failed", "expired", "cancelled")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A throwaway `redis-server` on 127.0.0.1 (no persistence), stopped by pid at the end."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed (apt-get install -y redis-server)")
    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT)
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 20
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail("redis-server did not start")
            time.sleep(0.05)
    client.close()
    try:
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


class Receiver:
    """Answers each POST with the next status of `statuses` (then 200) and records it."""

    def __init__(self) -> None:
        self.statuses: list[int] = []
        self.calls: list[tuple[float, dict[str, str], bytes]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["content-length"]))
                receiver.calls.append((time.monotonic(), dict(self.headers), body))
                status = receiver.statuses.pop(0) if receiver.statuses else 200
                self.send_response(status)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    """A local HTTP server that records webhook calls."""
    r = Receiver()
    yield r
    r.close()


def chat_line(custom_id: str, content: str, max_tokens: int = 4, **body: Any) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": MODEL, "messages": [{"role": "user",
                                                              "content": content}],
                                "max_tokens": max_tokens, "ignore_eos": True, **body}})


def batch_file(n: int, max_tokens: int = 4, prefix: str = "req") -> bytes:
    """n chat requests of varied prompt lengths."""
    return ("\n".join(chat_line(f"{prefix}-{i}", "tell me about item " + "x " * (i % 9), max_tokens)
                      for i in range(n)) + "\n").encode()


def wait_batch(client: openai.OpenAI, batch_id: str, timeout: float = 90.0,
               until: Callable[[Any], bool] = lambda b: b.status in TERMINAL) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if until(batch):
            return batch
        if time.monotonic() > deadline:
            raise AssertionError(f"batch {batch_id} still {batch.status} after {timeout}s: "
                                 f"{batch.request_counts}")
        time.sleep(0.1)


def read_lines(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def client_for(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def kit() -> SimpleNamespace:
    return SimpleNamespace(MODEL=MODEL, TERMINAL=TERMINAL, chat_line=chat_line,
                           batch_file=batch_file, wait_batch=wait_batch, read_lines=read_lines,
                           client_for=client_for)
