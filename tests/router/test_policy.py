"""Routing decisions: affinity, prefix, least loaded, spill, round-robin."""

from __future__ import annotations

from collections import Counter

from ember.router.hashing import owner
from ember.router.policy import Policy
from ember.router.prefix_index import PrefixIndex
from ember.router.replicas import ReplicaSet

URLS = ["http://a", "http://b", "http://c"]
IDS = [f"session-{i}" for i in range(3000)]


def make(policy: str = "affinity", max_load: int = 4, max_waiting: int = 2):
    replicas = ReplicaSet(eject_after=1, readmit_after=1)
    for url in URLS:
        replicas.record_check(replicas.add(url)[0])
    index = PrefixIndex(1000)
    return Policy(policy, replicas, index, max_load, max_waiting), replicas, index


def test_affinity_follows_hashing_and_moves_only_an_ejected_replicas_sessions():
    policy, replicas, _ = make()
    before = {i: policy.choose(i, []).replica.url for i in IDS}
    assert before == {i: owner(i, URLS) for i in IDS}
    assert all(policy.choose(i, []).route == "affinity" for i in IDS[:10])
    b = replicas.get("http://b")
    replicas.record_failure(b, "down")
    during = {i: policy.choose(i, []).replica.url for i in IDS}
    moved = {i for i in IDS if before[i] != during[i]}
    assert moved == {i for i in IDS if before[i] == "http://b"}
    assert "http://b" not in during.values()
    replicas.record_check(b)
    assert {i: policy.choose(i, []).replica.url for i in IDS} == before


def test_prefix_goes_to_the_longest_match_else_least_loaded():
    policy, replicas, index = make()
    index.record("http://b", [1, 2, 3])
    index.record("http://c", [1, 2])
    decision = policy.choose(None, [1, 2, 3, 4])
    assert (decision.replica.url, decision.route, decision.matched_blocks) == ("http://b",
                                                                               "prefix", 3)
    replicas.get("http://a").in_flight = 1
    replicas.get("http://b").in_flight = 2
    decision = policy.choose(None, [9])
    assert (decision.replica.url, decision.route) == ("http://c", "least_loaded")


def test_least_loaded_ties_rotate_over_idle_replicas():
    policy, _, _ = make()
    chosen = Counter(policy.choose(None, []).replica.url for _ in range(30))
    assert chosen == {url: 10 for url in URLS}


def test_an_overloaded_choice_spills_to_the_least_loaded_replica_that_has_room():
    policy, replicas, _ = make(max_load=4, max_waiting=2)
    session = next(i for i in IDS if owner(i, URLS) == "http://a")
    replicas.get("http://a").in_flight = 4
    replicas.get("http://b").in_flight = 3
    decision = policy.choose(session, [])
    assert decision.replica.url == "http://c" and decision.spilled_from.url == "http://a"
    assert decision.route == "affinity"
    # Queued work reported by the replica counts too.
    replicas.get("http://a").in_flight = 0
    replicas.get("http://a").reported_waiting = 2
    assert policy.choose(session, []).spilled_from.url == "http://a"
    # With no room anywhere the session stays where its cache is.
    for url in URLS:
        replicas.get(url).in_flight = 9
    decision = policy.choose(session, [])
    assert decision.replica.url == "http://a" and decision.spilled_from is None


def test_round_robin_cycles_and_ignores_sessions():
    policy, _, _ = make("round-robin")
    chosen = [policy.choose("same-session", []).replica.url for _ in range(6)]
    assert chosen == URLS + URLS
    assert policy.choose("x", []).route == "round_robin"


def test_exclusions_and_no_healthy_replica():
    policy, replicas, _ = make()
    session = IDS[0]
    first = policy.choose(session, []).replica.url
    second = policy.choose(session, [], [first]).replica.url
    assert second != first
    assert policy.choose(session, [], URLS) is None
    for replica in replicas.all():
        replicas.record_failure(replica, "down")
    # Nobody is healthy: every member is tried rather than none.
    assert policy.choose(session, []).replica.url == first


def test_a_prefix_shared_by_every_prompt_does_not_pull_traffic_to_one_replica():
    policy, _, index = make()
    index.record("http://b", [1, 2, 3, 4])  # say, a common system prompt
    assert policy.choose(None, [1, 2, 3, 4, 5, 6, 7, 8, 9]).route == "least_loaded"
    decision = policy.choose(None, [1, 2, 3, 4, 5, 6, 7])
    assert (decision.route, decision.replica.url) == ("prefix", "http://b")
