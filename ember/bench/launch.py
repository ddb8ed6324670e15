"""Start a server for the length of its measurement, so peers never share the CPUs.

The command runs under `sh -c` in its own process group (environment assignments and `cd`
work); the whole group is stopped afterwards, since servers spawn workers.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import httpx

from ember.bench.config import Endpoint


class LaunchedServer:
    """Context manager: start `command`, wait until the endpoint lists its models, stop it."""

    def __init__(self, endpoint: Endpoint, command: str, timeout: float,
                 api_key: str | None = None) -> None:
        self.endpoint = endpoint
        self.command = command
        self.timeout = timeout
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.log_path = Path(tempfile.mkstemp(prefix=f"ember-bench-{endpoint.name}-",
                                              suffix=".log")[1])
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> LaunchedServer:
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(["/bin/sh", "-c", self.command], stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait_ready(self.process)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.stop()

    def _wait_ready(self, process: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + self.timeout
        url = f"{self.endpoint.api_url}/models"
        while True:
            if process.poll() is not None:
                raise ConnectionError(f"{self.endpoint.name}: launch command exited with "
                                      f"{process.returncode}; log: {self.log_path}\n"
                                      f"{self.log_tail()}")
            try:
                if httpx.get(url, headers=self.headers, timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise ConnectionError(f"{self.endpoint.name}: {url} not ready after "
                                      f"{self.timeout:g} s; log: {self.log_path}\n"
                                      f"{self.log_tail()}")
            time.sleep(0.5)

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, grace: float = 30.0) -> None:
        """SIGTERM to the process group, SIGKILL after `grace` seconds."""
        if self.process is None:
            return
        self._signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            self.process.wait()
        self.process = None

    def _signal(self, sig: signal.Signals) -> None:
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:  # the whole group has already exited
            pass
