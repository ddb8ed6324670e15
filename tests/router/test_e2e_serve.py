"""`ember route` in front of three real `ember serve` replicas of a tiny model.

One cluster for the module: three replicas, an affinity router and a round-robin router over
them, and a fourth replica that joins in the last test, all real processes on 127.0.0.1.
Workloads are small (a few sessions, a few tokens) to keep the module near two minutes on two
cores.
"""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from ember.cli import main
from ember.router.hashing import owner

MODEL = "tiny"
SERVE_ARGS = ("--served-model-name", MODEL, "--dtype", "float32", "--num-kv-blocks", "1024",
              "--max-model-len", "1024")
ROUTE_ARGS = ("--health-interval", "0.5", "--eject-after", "2")
IDS = [f"session-{i}" for i in range(10_000)]
TURNS = 6


@dataclass
class Cluster:
    replicas: list  # EmberServer (tests/conftest.py), the three routed from the start
    affinity: object  # RouteProcess (tests/router/conftest.py)
    round_robin: object
    admin_key: str
    fourth: Future  # of an EmberServer, not routed until the last test adds it

    @property
    def urls(self) -> list[str]:
        return [server.url for server in self.replicas]

    def admin(self, method: str, path: str, **kwargs) -> httpx.Response:
        response = httpx.request(method, self.affinity.url + path, timeout=30,
                                 headers={"x-admin-key": self.admin_key}, **kwargs)
        response.raise_for_status()
        return response

    def assignments(self) -> dict[str, str]:
        return self.admin("POST", "/admin/assignments", json={"ids": IDS}).json()["assignments"]

    def state(self, url: str) -> str:
        listed = self.admin("GET", "/admin/replicas").json()["replicas"]
        return next(r["state"] for r in listed if r["url"] == url)


@pytest.fixture(scope="module")
def cluster(ember_servers, start_route_process, wait_until, admin_key, tiny_llama_dir: Path):
    pool = ThreadPoolExecutor(4)
    starting = [pool.submit(ember_servers, tiny_llama_dir, *SERVE_ARGS) for _ in range(4)]
    replicas = [future.result() for future in starting[:3]]
    urls = [server.url for server in replicas]
    routers = [start_route_process(urls, "--admin-key", admin_key, *ROUTE_ARGS),
               start_route_process(urls, "--policy", "round-robin", *ROUTE_ARGS)]
    try:
        for router in routers:
            wait_until(lambda r=router: r.healthy_replicas() == 3, 60, "the routers")
        # The fourth keeps starting while the first tests run; the last one waits for it.
        yield Cluster(replicas, *routers, admin_key, starting[3])
    finally:
        for router in routers:
            router.stop()
        pool.shutdown()
        for server in replicas + [starting[3].result()]:
            server.stop()


def cached_fraction(url: str, seed: int, tokenizer: Path, out: Path) -> float:
    """The agent workload of `ember bench` against url; its cached-token fraction.

    One session at a time, so where round-robin puts each turn (always the next replica) does
    not depend on how concurrent sessions happen to interleave on a busy machine."""
    assert main(["bench", "--base-url", url, "--workload", "agent", "--concurrency", "1",
                 "--num-requests", "24", "--turns", "3", "--system-len", "16",
                 "--file-len", "256", "--tool-result-len", "16", "--output-len", "4",
                 "--ignore-eos", "--seed", str(seed), "--tokenizer", str(tokenizer),
                 "--out", str(out), "--no-progress"]) == 0
    summary = json.loads(out.read_text())["endpoints"][0]["summary"]
    assert summary["succeeded"] == 24 and summary["usage_from_server"]
    return summary["cached_fraction"]


def test_affinity_keeps_the_cache_hit_rate_of_one_replica(cluster, tiny_llama_dir, tmp_path):
    # Different seeds: no run can hit blocks another one left in a replica's cache.
    single = cached_fraction(cluster.replicas[0].url, 1, tiny_llama_dir, tmp_path / "1.json")
    routed = cached_fraction(cluster.affinity.url, 2, tiny_llama_dir, tmp_path / "2.json")
    spread = cached_fraction(cluster.round_robin.url, 3, tiny_llama_dir, tmp_path / "3.json")
    print(f"cached-token fraction: one replica {single:.3f}, affinity {routed:.3f}, "
          f"round-robin {spread:.3f}")
    assert abs(routed - single) < 0.05
    assert routed - spread > 0.3
    metrics = httpx.get(cluster.affinity.url + "/metrics").text
    assert "ember:router_affinity_hits_total 24.0" in metrics


@dataclass
class Sent:
    session: str
    started_at: float
    replica: str | None = None
    chunks: int = 0  # stream chunks the client received
    error: str | None = None


async def run_sessions(router_url: str, sessions: list[str], turns: int,
                       kill_after: int, kill) -> tuple[list[Sent], float]:
    """Every session sends `turns` streamed requests in a row, all sessions at once; after
    `kill_after` requests have finished, kill() runs. Returns what was sent and when the
    kill happened."""
    client = openai.AsyncOpenAI(base_url=router_url + "/v1", api_key="unused", max_retries=0,
                                timeout=60)
    sent: list[Sent] = []
    killed_at = [float("inf")]
    finished = asyncio.Event()

    async def session(sid: str) -> None:
        messages = [{"role": "system", "content": "You review code. Be brief."},
                    {"role": "user", "content": f"Review module {sid}: " + "x = 1\n" * 40}]
        for _ in range(turns):
            record = Sent(sid, time.monotonic())
            sent.append(record)
            try:
                raw = await client.chat.completions.with_raw_response.create(
                    model=MODEL, messages=messages, max_tokens=12, stream=True,
                    extra_headers={"x-session-affinity": sid}, extra_body={"ignore_eos": True})
                record.replica = raw.headers.get("x-ember-replica")
                async for _ in raw.parse():
                    record.chunks += 1  # any chunk at all: the client has seen bytes
            except openai.APIError as exc:
                record.error = str(exc)
            if sum(r.error is None and r.chunks > 0 for r in sent) >= kill_after:
                finished.set()
            messages = messages + [{"role": "assistant", "content": "ok"},
                                   {"role": "user", "content": "Tool result: 3 passed."}]

    async def killer() -> None:
        await finished.wait()
        await asyncio.to_thread(kill)
        killed_at[0] = time.monotonic()

    kill_task = asyncio.create_task(killer())
    await asyncio.wait_for(asyncio.gather(*(session(s) for s in sessions)), 240)
    await kill_task
    await client.close()
    return sent, killed_at[0]


def test_killing_a_replica_loses_no_unstarted_request_and_moves_only_its_sessions(
        cluster, kill_process, wait_until):
    router, urls = cluster.affinity, cluster.urls
    victim = cluster.replicas[1]
    survivors = [u for u in urls if u != victim.url]
    before = cluster.assignments()
    assert before == {i: owner(i, urls) for i in IDS}
    # Three sessions on each replica (ports, hence owners, differ from run to run).
    sessions = [s for url in urls for s in [i for i in IDS if before[i] == url][:3]]

    start = time.monotonic()
    sent, killed_at = asyncio.run(run_sessions(router.url, sessions, TURNS, 6,
                                               lambda: kill_process(victim.process.pid)))
    assert time.monotonic() - start < 240  # no stream hung
    assert killed_at < float("inf") and len(sent) == len(sessions) * TURNS
    # A request that had not started streaming was never lost: it was retried elsewhere.
    assert [r for r in sent if r.error is not None and r.chunks == 0] == []
    # Only a request cut off mid-stream may fail, and it says so instead of hanging.
    for record in sent:
        if record.error is not None:
            assert "mid-stream" in record.error and record.replica == victim.url
    # Before the kill the victim served its sessions; after it, they went to their second
    # choice, the replica rendezvous hashing ranks next among the survivors.
    victims_sessions = [s for s in sessions if owner(s, urls) == victim.url]
    assert any(r.replica == victim.url for r in sent if r.started_at < killed_at)
    after_kill = [r for r in sent if r.started_at > killed_at]
    assert any(r.session in victims_sessions for r in after_kill)
    # (Among the survivors, every other session keeps the replica it had.)
    assert [r.replica for r in after_kill] == [owner(r.session, survivors) for r in after_kill]

    wait_until(lambda: cluster.state(victim.url) == "ejected", 10, "the ejection")
    during = cluster.assignments()
    moved = {i for i in IDS if during[i] != before[i]}
    assert moved == {i for i in IDS if before[i] == victim.url}

    victim.start()  # the same command, so the same port
    wait_until(lambda: cluster.state(victim.url) == "healthy", 30, "re-admission")
    assert cluster.assignments() == before  # only its share moved back
    sid = next(s for s in victims_sessions)
    response = httpx.post(router.url + "/v1/chat/completions", timeout=60,
                          headers={"x-session-affinity": sid},
                          json={"model": MODEL, "max_tokens": 2,
                                "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 200 and response.headers["x-ember-replica"] == victim.url
    metrics = httpx.get(router.url + "/metrics").text
    assert f'ember:router_ejections_total{{replica="{victim.url}"}} 1.0' in metrics
    assert f'ember:router_readmissions_total{{replica="{victim.url}"}} 1.0' in metrics


def test_adding_a_fourth_replica_moves_a_quarter_of_sessions_to_it(cluster):
    router, fourth = cluster.affinity, cluster.fourth.result()
    before = cluster.assignments()
    added = cluster.admin("POST", "/admin/replicas", json={"url": fourth.url})
    assert added.status_code == 201 and added.json()["state"] == "healthy"
    after = cluster.assignments()
    moved = [i for i in IDS if after[i] != before[i]]
    print(f"adding a fourth replica moved {len(moved) / len(IDS):.4f} of {len(IDS)} ids")
    assert 0.22 < len(moved) / len(IDS) < 0.28
    assert {after[i] for i in moved} == {fourth.url}
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "hello"}],
        extra_headers={"x-session-affinity": moved[0]})
    assert raw.headers["x-ember-replica"] == fourth.url
    assert raw.parse().usage.completion_tokens == 3
