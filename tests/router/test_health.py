"""Active health checks and load polling against live replicas."""

from __future__ import annotations

from ember.router.health import parse_load


def test_parse_load_sums_label_sets_and_tolerates_other_servers():
    text = ("# TYPE ember:num_requests_running gauge\n"
            'ember:num_requests_running{model_name="a"} 3\n'
            'ember:num_requests_running{model_name="b"} 2\n'
            "# TYPE ember:num_requests_waiting gauge\n"
            'ember:num_requests_waiting{model_name="a"} 4.0\n'
            'ember:num_requests_waiting{lane="batch",model_name="a"} 40\n'
            "other_metric 7\n")
    assert parse_load(text) == (5, 4)
    assert parse_load("# TYPE ember:num_requests_waiting gauge\n"
                      "ember:num_requests_waiting 1\n") == (0, 1)
    assert parse_load("vllm:num_requests_running 3\n") is None
    assert parse_load("this is { not prometheus") is None


def test_a_failing_replica_is_ejected_and_readmitted_after_it_recovers(fake_replicas,
                                                                       start_router, wait_until):
    urls = [r.url for r in fake_replicas]
    router = start_router(urls, health_interval=0.1, eject_after=2)
    assert [router.replica_state(u) for u in urls] == ["healthy"] * 3  # checked at startup
    fake_replicas[0].control(healthy=False)
    wait_until(lambda: router.metric("ember:router_ejections_total", replica=urls[0]) == 1, 5,
               "ejection")
    assert router.replica_state(urls[0]) == "ejected"
    assert router.metric("ember:router_replica_healthy", replica=urls[0]) == 0
    assert "returned 503" in router.router.replicas.get(urls[0]).last_error
    fake_replicas[0].control(healthy=True)
    wait_until(lambda: router.metric("ember:router_readmissions_total", replica=urls[0]) == 1,
               5, "re-admission")
    assert router.replica_state(urls[0]) == "healthy"
    assert router.metric("ember:router_ejections_total", replica=urls[0]) == 1


def test_a_killed_replica_is_ejected_and_comes_back_when_restarted(fake_replicas,
                                                                   start_router, wait_until):
    urls = [r.url for r in fake_replicas]
    router = start_router(urls, health_interval=0.1, eject_after=2)
    fake_replicas[2].kill()
    wait_until(lambda: router.replica_state(urls[2]) == "ejected", 5, "ejection")
    fake_replicas[2].start()
    wait_until(lambda: router.replica_state(urls[2]) == "healthy", 5, "re-admission")


def test_load_gauges_are_polled(fake_replicas, start_router, wait_until):
    urls = [r.url for r in fake_replicas]
    router = start_router(urls, health_interval=0.1)
    fake_replicas[1].control(running=3, waiting=2)
    replica = router.router.replicas.get(urls[1])
    wait_until(lambda: (replica.reported_running, replica.reported_waiting) == (3, 2), 5,
               "the load poll")
    assert replica.load == 5
    assert router.metric("ember:router_replica_load", replica=urls[1]) == 5
