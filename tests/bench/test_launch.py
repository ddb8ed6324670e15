import os
import socket
import sys

import httpx
import pytest

from ember.bench.config import Endpoint
from ember.bench.launch import LaunchedServer


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_launch_waits_for_models_and_stops_the_process_group(tmp_path):
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "models").write_text('{"data": []}')
    port = free_port()
    endpoint = Endpoint("files", f"http://127.0.0.1:{port}")
    # the server runs as a child of a shell, so stopping must reach the whole group
    command = (f"sleep 0.5; {sys.executable} -m http.server {port} --bind 127.0.0.1 "
               f"--directory {tmp_path}; true")
    with LaunchedServer(endpoint, command, timeout=30) as server:
        assert httpx.get(f"{endpoint.api_url}/models").status_code == 200
        pid = server.process.pid
    assert server.process is None and not alive(pid)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{endpoint.api_url}/models")
    assert "GET /v1/models" in server.log_path.read_text()
    server.log_path.unlink()


def test_launch_reports_early_exit_and_timeout_with_the_log():
    endpoint = Endpoint("x", f"http://127.0.0.1:{free_port()}")
    failing = LaunchedServer(endpoint, "echo boom; exit 3", timeout=30)
    with pytest.raises(ConnectionError, match=r"exited with 3(.|\n)*boom"):
        with failing:
            pass
    slow = LaunchedServer(endpoint, "sleep 60", timeout=1)
    with pytest.raises(ConnectionError, match="not ready after 1 s"):
        with slow:
            pass
    assert failing.process is None and slow.process is None
    failing.log_path.unlink()
    slow.log_path.unlink()
