"""Per-request routing through a live router: affinity, prefix, spill, retry, accounting."""

from __future__ import annotations

import httpx

from ember.router.hashing import owner

SYSTEM = "You are a careful code reviewer. " * 30


def chat(http: httpx.Client, router_url: str, session: str | None = None,
         messages: list | None = None, path: str = "/v1/chat/completions",
         **extra) -> httpx.Response:
    headers = {"x-session-affinity": session} if session else {}
    body = {"model": "fake", "messages": messages or [], "max_tokens": 2, **extra}
    return http.post(router_url + path, json=body, headers=headers)


def sessions_owned_by(url: str, urls: list[str], count: int) -> list[str]:
    ids = (f"s-{i}" for i in range(10_000))
    return [i for i in ids if owner(i, urls) == url][:count]


def test_sessions_stick_to_their_hashed_replica(fake_replicas, start_router, http):
    urls = [r.url for r in fake_replicas]
    router = start_router(urls)
    for i in range(30):
        session = f"user-{i}"
        served = {chat(http, router.url, session).headers["x-ember-replica"] for _ in range(2)}
        assert served == {owner(session, urls)}
    assert router.metric("ember:router_affinity_hits_total") == 60
    by_replica = [router.metric("ember:router_requests_total", replica=u, route="affinity")
                  for u in urls]
    assert sum(by_replica) == 60 and min(by_replica) > 0


def test_requests_without_a_session_follow_their_prompt_prefix(fake_replicas, start_router,
                                                              http):
    router = start_router([r.url for r in fake_replicas])
    served = {}
    for doc in range(6):
        history = [{"role": "system", "content": SYSTEM},
                   {"role": "user", "content": f"Review file {doc}. " * 80}]
        first = chat(http, router.url, messages=history)
        assert first.headers["x-ember-route"] == "least_loaded"
        served[doc] = first.headers["x-ember-replica"]
        for turn in range(2):
            history += [{"role": "assistant", "content": "Found nothing."},
                        {"role": "user", "content": f"Tool result {turn}. " * 30}]
            later = chat(http, router.url, messages=history)
            assert later.headers["x-ember-route"] == "prefix"
            assert later.headers["x-ember-replica"] == served[doc]
    # Idle replicas share new prompts instead of one taking them all.
    assert len(set(served.values())) == 3
    assert router.metric("ember:router_prefix_routed_total") == 12


def test_an_overloaded_replica_spills_its_sessions(fake_replicas, start_router, http, wait_until):
    urls = [r.url for r in fake_replicas]
    router = start_router(urls, max_waiting=4)
    session = sessions_owned_by(urls[0], urls, 1)[0]
    assert chat(http, router.url, session).headers["x-ember-replica"] == urls[0]
    fake_replicas[0].control(waiting=10)  # its /metrics now reports a queue
    wait_until(lambda: router.router.replicas.get(urls[0]).reported_waiting == 10, 5,
               "the load poll")
    response = chat(http, router.url, session)
    assert response.headers["x-ember-route"] == "spill"
    assert response.headers["x-ember-replica"] != urls[0]
    assert router.metric("ember:router_spills_total", replica=urls[0]) == 1
    fake_replicas[0].control(waiting=0)
    wait_until(lambda: router.router.replicas.get(urls[0]).reported_waiting == 0, 5,
               "the load poll")
    assert chat(http, router.url, session).headers["x-ember-replica"] == urls[0]


def test_a_dead_replica_costs_a_retry_until_ejected_and_loses_no_request(
        fake_replicas, start_router, http):
    urls = [r.url for r in fake_replicas]
    # No active checks during the test: only passive failures can eject.
    router = start_router(urls, health_interval=60.0, eject_after=2)
    fake_replicas[1].kill()
    sessions = sessions_owned_by(urls[1], urls, 5)
    for session in sessions:
        response = chat(http, router.url, session)
        assert response.status_code == 200
        assert response.headers["x-ember-replica"] == owner(session, [urls[0], urls[2]])
    assert router.metric("ember:router_retries_total", replica=urls[1]) == 2
    assert router.metric("ember:router_ejections_total", replica=urls[1]) == 1
    assert router.replica_state(urls[1]) == "ejected"
    assert router.metric("ember:router_upstream_errors_total", replica=urls[1],
                         phase="connect") == 2


def test_5xx_is_retried_only_where_running_twice_is_safe(fake_replicas, start_router, http):
    urls = [r.url for r in fake_replicas]
    router = start_router(urls, health_interval=60.0, eject_after=10)
    session = sessions_owned_by(urls[0], urls, 1)[0]
    fake_replicas[0].control(status=503)
    response = chat(http, router.url, session)
    assert response.status_code == 200 and response.headers["x-ember-route"] == "retry"
    assert response.headers["x-ember-replica"] != urls[0]
    # /v1/echo is not an inference endpoint: a POST there is passed back, not repeated.
    response = chat(http, router.url, session, path="/v1/echo")
    assert response.status_code == 503 and response.headers["x-ember-replica"] == urls[0]
    assert fake_replicas[0].requests() == ["/v1/chat/completions", "/v1/echo"]
    assert router.metric("ember:router_retries_total", replica=urls[0]) == 1


def test_in_flight_is_counted_and_released_when_the_client_goes_away(
        fake_replicas, start_router, wait_until):
    urls = [r.url for r in fake_replicas]
    router = start_router(urls)
    session = sessions_owned_by(urls[2], urls, 1)[0]
    replica = router.router.replicas.get(urls[2])
    body = {"model": "fake", "messages": [], "max_tokens": 50, "stream": True, "delay": 0.1}
    with httpx.stream("POST", router.url + "/v1/chat/completions", json=body,
                      headers={"x-session-affinity": session}, timeout=30) as response:
        lines = response.iter_lines()  # held: a dropped generator closes the connection
        next(lines)
        assert replica.in_flight == 1
    wait_until(lambda: replica.in_flight == 0, 5, "the router to release the request")
    # ... and the replica's stream was closed too, not left generating.
    wait_until(lambda: replica.reported_running == 0 and replica.in_flight == 0, 5,
               "the replica to stop streaming")


def test_no_replica_left_gives_an_openai_style_error(fake_replicas, start_router, http):
    urls = [r.url for r in fake_replicas]
    router = start_router(urls[:1], health_interval=60.0)
    fake_replicas[0].kill()
    response = chat(http, router.url, "s")
    assert response.status_code == 502
    assert "ember route" in response.json()["error"]["message"]
