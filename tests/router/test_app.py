"""The router's own endpoints: /health, /metrics, admin membership, the replicas file."""

from __future__ import annotations

import time
from collections import Counter

IDS = [f"id-{i}" for i in range(10_000)]


def test_health_reflects_the_replicas(fake_replicas, start_router, http, wait_until):
    urls = [r.url for r in fake_replicas]
    router = start_router(urls[:1], health_interval=0.1)
    assert http.get(router.url + "/health").json() == {"status": "ok", "healthy": 1,
                                                       "replicas": 1}
    fake_replicas[0].kill()
    wait_until(lambda: http.get(router.url + "/health").status_code == 503, 5,
               "the router to report no healthy replica")


def test_metrics_count_requests_and_added_latency(fake_replicas, start_router, http):
    urls = [r.url for r in fake_replicas]
    router = start_router(urls)
    for i in range(9):
        http.post(router.url + "/v1/chat/completions", json={"model": "fake", "messages": []},
                  headers={"x-session-affinity": f"s{i}"})
    text = http.get(router.url + "/metrics").text
    for name in ("ember:router_requests_total", "ember:router_affinity_hits_total 9.0",
                 "ember:router_added_latency_seconds_count 9.0",
                 "ember:router_replica_healthy", "ember:router_spills_total",
                 "ember:router_prefix_routed_total", "ember:router_retries_total",
                 "ember:router_ejections_total"):
        assert name in text, name
    per_replica = sum(router.metric("ember:router_requests_total", replica=u, route="affinity")
                      for u in urls)
    assert per_replica == 9
    # The router's own share of a request is well under the whole.
    assert router.metric("ember:router_added_latency_seconds_sum") / 9 < 0.05


def test_admin_endpoints_need_the_key(fake_replicas, start_router, http, admin_key):
    auth = {"authorization": f"Bearer {admin_key}"}
    router = start_router([fake_replicas[0].url])
    assert http.get(router.url + "/admin/replicas").status_code == 401
    assert http.get(router.url + "/admin/replicas",
                    headers={"authorization": "Bearer wrong-key!"}).status_code == 401
    listed = http.get(router.url + "/admin/replicas", headers={"x-admin-key": admin_key})
    assert [r["url"] for r in listed.json()["replicas"]] == [fake_replicas[0].url]
    closed = start_router([fake_replicas[0].url], admin_key=None)
    assert http.get(closed.url + "/admin/replicas", headers=auth).status_code == 403
    bad = http.post(router.url + "/admin/replicas", json={"url": "ftp://x"}, headers=auth)
    assert bad.status_code == 400 and "url: must start with http" in bad.text
    spread = start_router([fake_replicas[0].url], policy="round-robin")
    assert http.post(spread.url + "/admin/assignments", json={"ids": ["a"]},
                     headers=auth).status_code == 409


def test_adding_a_fourth_replica_at_run_time_moves_a_quarter_of_sessions(
        fake_replicas, start_router, http, admin_key, start_fake):
    auth = {"authorization": f"Bearer {admin_key}"}
    urls = [r.url for r in fake_replicas]
    router = start_router(urls)

    def assignments() -> dict[str, str]:
        response = http.post(router.url + "/admin/assignments", json={"ids": IDS}, headers=auth)
        return response.json()["assignments"]

    before = assignments()
    fourth = start_fake("D")
    try:
        added = http.post(router.url + "/admin/replicas", json={"url": fourth.url},
                          headers=auth)
        assert added.status_code == 201 and added.json()["state"] == "healthy"
        after = assignments()
        moved = [i for i in IDS if before[i] != after[i]]
        assert 0.22 < len(moved) / len(IDS) < 0.28
        assert Counter(after[i] for i in moved) == {fourth.url: len(moved)}
        # Real requests for a moved session now land on the new replica.
        response = http.post(router.url + "/v1/chat/completions", json={"messages": []},
                             headers={"x-session-affinity": moved[0]})
        assert response.headers["x-replica-name"] == "D"
        removed = http.delete(router.url + "/admin/replicas", params={"url": fourth.url},
                              headers=auth)
        assert removed.json() == {"removed": fourth.url}
        assert assignments() == before
        assert http.delete(router.url + "/admin/replicas", params={"url": fourth.url},
                           headers=auth).status_code == 404
    finally:
        fourth.kill()


def test_a_watched_replicas_file_adds_and_removes_its_replicas(fake_replicas, start_router,
                                                               tmp_path, wait_until):
    urls = [r.url for r in fake_replicas]
    listing = tmp_path / "replicas.txt"
    listing.write_text(f"# pool\n{urls[1]}\n{urls[2]}/v1  # trailing /v1 is fine\n")
    router = start_router(urls[:1], replicas_file=str(listing),
                                        health_interval=0.1)
    members = router.router.replicas
    assert {r.url: r.state.value for r in members.all()} == {u: "healthy" for u in urls}
    listing.write_text(f"{urls[2]}\n")
    wait_until(lambda: urls[1] not in members, 5, "the file's removal")
    # A replica from the command line is not the file's to remove.
    listing.write_text("")
    wait_until(lambda: urls[2] not in members, 5, "the file's removal")
    assert [r.url for r in members.all()] == [urls[0]]
    listing.write_text(f"{urls[1]}\nnot a url\n")  # a bad file changes nothing
    time.sleep(0.5)
    assert [r.url for r in members.all()] == [urls[0]]
    listing.write_text(f"{urls[1]}\n")
    wait_until(lambda: urls[1] in members and members.get(urls[1]).healthy, 5,
               "the file's addition")
