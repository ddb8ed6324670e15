"""Workers against real `ember serve` processes: a server killed with SIGKILL mid-job and
restarted on the same SQLite store; two servers sharing one queue in a real redis-server,
one of them killed mid-job. No item may be lost, none may appear twice."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis

from ember.batch.worker import AdmissionGate
from ember.server.billing import Ledger

LEASE_S = "2"
TAKEN_OVER = "an earlier claim ended unfinished"


def serve(ember_servers, model_dir, kit, store_url: str, ledger: Path):
    return ember_servers(model_dir, "--served-model-name", kit.MODEL, "--dtype", "float32",
                         "--num-kv-blocks", "128", "--max-model-len", "512",
                         "--ledger", str(ledger), "--batch-store", store_url,
                         "--batch-max-inflight", "8", "--batch-poll-interval", "0.1",
                         "--batch-lease-seconds", LEASE_S)


def submit(client, kit, n: int, max_tokens: int, prefix: str) -> str:
    file_id = client.files.create(file=("in.jsonl", kit.batch_file(n, max_tokens, prefix)),
                                  purpose="batch").id
    return client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                 completion_window="24h").id


def kill_mid_job(server, client, kit, batch_id: str) -> int:
    """SIGKILL the server once a few items are done; returns how many were done by then."""
    running = kit.wait_batch(client, batch_id, timeout=120,
                             until=lambda b: b.request_counts.completed >= 4)
    server.process.kill()
    server.process.wait(timeout=30)
    assert running.request_counts.completed < 50, "the job ended before the kill"
    return running.request_counts.completed


def check_exactly_once(client, kit, batch_id: str, prefix: str, timeout: float = 150) -> None:
    done = kit.wait_batch(client, batch_id, timeout=timeout)
    assert done.status == "completed"
    assert (done.request_counts.completed, done.request_counts.failed) == (50, 0)
    out = kit.read_lines(client, done.output_file_id)
    assert sorted(x["custom_id"] for x in out) == sorted(f"{prefix}-{i}" for i in range(50))
    assert done.error_file_id is None


def test_kill_9_then_restart_on_the_same_store(ember_servers, tiny_llama_dir, tmp_path,
                                               kit) -> None:
    store = f"sqlite:///{tmp_path / 'batch.sqlite'}"
    first = serve(ember_servers, tiny_llama_dir, kit, store, tmp_path / "ledger1.sqlite")
    batch_id = submit(kit.client_for(first.url), kit, 50, 32, "crash")
    kill_mid_job(first, kit.client_for(first.url), kit, batch_id)
    second = serve(ember_servers, tiny_llama_dir, kit, store, tmp_path / "ledger2.sqlite")
    client = kit.client_for(second.url)
    check_exactly_once(client, kit, batch_id, "crash")
    assert TAKEN_OVER in second.log()  # the dead server's leased items ran again here
    second.stop()


@pytest.fixture
def two_servers(ember_servers, tiny_llama_dir, tmp_path, kit, redis_url):
    redis.Redis.from_url(redis_url).flushdb()
    ledgers = [tmp_path / f"ledger{i}.sqlite" for i in range(2)]
    with ThreadPoolExecutor(2) as pool:  # start both at once: startup waits on I/O too
        servers = list(pool.map(lambda ledger: serve(ember_servers, tiny_llama_dir, kit,
                                                     redis_url, ledger), ledgers))
    return servers, ledgers


def test_two_servers_share_a_redis_queue_and_survive_a_kill(two_servers, kit) -> None:
    (a, b), ledgers = two_servers
    on_a, on_b = kit.client_for(a.url), kit.client_for(b.url)
    # created on one replica, run by both, read from the other
    batch_id = submit(on_a, kit, 50, 8, "shared")
    check_exactly_once(on_b, kit, batch_id, "shared")
    rows = [[e for e in Ledger(path).entries() if e.lane == "batch"] for path in ledgers]
    assert len(rows[0]) + len(rows[1]) == 50  # each item ran once, on one of the two
    assert rows[0] and rows[1], "one replica did all the work"
    # SIGKILL one replica mid-job: the other takes over its leased items
    batch_id = submit(on_b, kit, 50, 32, "survivor")
    kill_mid_job(a, on_a, kit, batch_id)
    check_exactly_once(on_b, kit, batch_id, "survivor")
    assert TAKEN_OVER in b.log()
    b.stop()


def test_admission_gate_paces_batch_items_behind_interactive_ones() -> None:
    load = {"unstarted": 0, "running": 0, "steps": 7}
    gate = AdmissionGate(lambda: load["unstarted"], lambda: load["running"],
                         lambda: load["steps"])
    assert gate.allow(5) == 5 and gate.allow(0) == 0  # no interactive work: fill up
    load["running"] = 2
    assert gate.pacing
    assert [gate.allow(5), gate.allow(5)] == [1, 0]  # one item per engine step
    load["steps"] += 1
    assert gate.allow(5) == 1
    load["steps"] += 1
    load["unstarted"] = 1
    assert gate.allow(5) == 0  # an interactive request waits to start: nothing new
    load.update(unstarted=0, running=0)
    assert not gate.pacing and gate.allow(3) == 3
