"""Router test helpers and fixtures: fake upstreams and `ember route` as real processes, the
router app in a server thread. Tests reach the helpers through fixtures only, so they work
under any pytest import mode."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn

from ember.router.app import create_app
from ember.router.config import RouterConfig

FAKE_REPLICA = Path(__file__).with_name("fake_replica.py")
REPO_ROOT = Path(__file__).resolve().parents[2]
ADMIN_KEY = "test-admin-key"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_until(predicate: Callable[[], bool], timeout: float, what: str,
                interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


def responds(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


class FakeReplica:
    """tests/router/fake_replica.py in its own process; kill() is a real SIGKILL."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def spawn(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(FAKE_REPLICA), "--port", str(self.port), "--name", self.name],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def wait_ready(self) -> FakeReplica:
        _wait_until(lambda: responds(self.url + "/health"), 20, f"fake replica {self.name}")
        return self

    def start(self) -> FakeReplica:
        self.spawn()
        return self.wait_ready()

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(10)

    def control(self, **state: object) -> None:
        httpx.post(self.url + "/control", json=state, timeout=5).raise_for_status()

    def requests(self) -> list[str]:
        return httpx.get(self.url + "/stats", timeout=5).json()["requests"]


class RouterThread:
    """The router app under uvicorn in a background thread of the test process."""

    def __init__(self, config: RouterConfig) -> None:
        self.app = create_app(config)
        self.router = self.app.state.router
        self.url = f"http://127.0.0.1:{config.port}"
        self.server = uvicorn.Server(uvicorn.Config(
            self.app, host="127.0.0.1", port=config.port, log_level="warning", lifespan="on",
            server_header=False, date_header=False))  # as `ember route` runs it
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> RouterThread:
        self.thread.start()
        _wait_until(lambda: self.server.started, 20, "the router to start")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(20)

    def replica_state(self, url: str) -> str | None:
        replica = self.router.replicas.get(url)
        return None if replica is None else replica.state.value

    def metric(self, name: str, **labels: str) -> float:
        value = self.router.metrics.registry.get_sample_value(name, labels or None)
        return 0.0 if value is None else value


def _router_config(replicas: list[str], **overrides: object) -> RouterConfig:
    """A config for a router thread: fast health checks, quick ejection, the test admin key."""
    settings: dict = {"replicas": replicas, "port": free_port(), "health_interval": 0.2,
                      "health_timeout": 1.0, "eject_after": 2, "admin_key": ADMIN_KEY}
    settings.update(overrides)
    return RouterConfig(**settings)


class RouteProcess:
    """`python -m ember.cli route --replica ... *args` on a free port, as a child process."""

    def __init__(self, replicas: list[str], *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "ember.cli", "route", "--host", "127.0.0.1", "--port",
                    str(self.port), "--log-level", "warning"]
        for replica in replicas:
            self.cmd += ["--replica", replica]
        self.cmd += list(args)
        self.log_path = Path(tempfile.mkstemp(prefix="ember-route-", suffix=".log")[1])
        self.process: subprocess.Popen | None = None

    def spawn(self) -> RouteProcess:
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                            cwd=REPO_ROOT)
        return self

    def healthy_replicas(self) -> int:
        if self.process is not None and self.process.poll() is not None:
            raise RuntimeError(f"ember route exited with {self.process.returncode}:\n"
                               f"{self.log_path.read_text()[-4000:]}")
        try:
            return int(httpx.get(self.url + "/health", timeout=2).json()["healthy"])
        except (httpx.HTTPError, ValueError, KeyError):
            return 0

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self.log_path.unlink(missing_ok=True)


def child_pids(pid: int) -> list[int]:
    """The live children of a process (from /proc; Linux only)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            children.append(int(stat.parent.name))
    return children


def _kill_now(pid: int) -> list[int]:
    """SIGKILL a process we started; returns the children it had, for reap()."""
    children = child_pids(pid)
    os.kill(pid, signal.SIGKILL)
    return children


def _reap(children: list[int], timeout: float = 30.0) -> None:
    """Wait for a killed server's children to exit on their own; SIGKILL any that do not."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(Path(f"/proc/{c}").exists() for c in children):
        time.sleep(0.2)
    for child in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)


@pytest.fixture(scope="session")
def fake_pool() -> Iterator[list[FakeReplica]]:
    """Three fake replicas (A, B, C) started once, in parallel; killed at the end."""
    replicas = [FakeReplica(name) for name in "ABC"]
    try:
        for replica in replicas:
            replica.spawn()
        yield [replica.wait_ready() for replica in replicas]
    finally:
        for replica in replicas:
            replica.kill()


@pytest.fixture
def fake_replicas(fake_pool: list[FakeReplica]) -> list[FakeReplica]:
    """The pool, each replica alive (restarted on its port if a test killed it) and reset."""
    for replica in fake_pool:
        if replica.process is None or replica.process.poll() is not None:
            replica.start()
        replica.control(reset=True)
    return fake_pool


@pytest.fixture
def start_router() -> Iterator:
    """start_router(replica_urls, **config_overrides) -> a running RouterThread, stopped after
    the test (see _router_config for the defaults)."""
    started: list[RouterThread] = []

    def start(replicas: list[str], **overrides: object) -> RouterThread:
        router = RouterThread(_router_config(replicas, **overrides)).start()
        started.append(router)
        return router

    yield start
    for router in started:
        router.stop()


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    """One keep-alive client per test (a new httpx client per request costs ~30 ms)."""
    with httpx.Client(timeout=30) as client:
        yield client


@pytest.fixture(scope="session")
def wait_until() -> Callable[..., None]:
    """wait_until(predicate, timeout, what): poll until true, else TimeoutError naming what."""
    return _wait_until


@pytest.fixture(scope="session")
def admin_key() -> str:
    return ADMIN_KEY


@pytest.fixture
def start_fake() -> Iterator[Callable[[str], FakeReplica]]:
    """start_fake(name) -> one more fake replica, running; killed after the test."""
    started: list[FakeReplica] = []

    def start(name: str) -> FakeReplica:
        replica = FakeReplica(name)
        started.append(replica)
        return replica.start()

    yield start
    for replica in started:
        replica.kill()


@pytest.fixture(scope="session")
def start_route_process() -> Iterator[Callable[..., RouteProcess]]:
    """start_route_process(replica_urls, *args) -> a spawned `ember route` (not yet waited
    for); stopped at the end of the session unless stopped earlier."""
    started: list[RouteProcess] = []

    def start(replicas: list[str], *args: str) -> RouteProcess:
        process = RouteProcess(replicas, *args)
        started.append(process)
        return process.spawn()

    yield start
    for process in started:
        process.stop()


@pytest.fixture
def kill_process() -> Iterator[Callable[[int], None]]:
    """kill_process(pid): SIGKILL a server this test started, now; the children it leaves
    (an engine-core process) must exit by the end of the test, or are killed then."""
    orphans: list[int] = []

    def kill(pid: int) -> None:
        orphans.extend(_kill_now(pid))

    yield kill
    _reap(orphans)
