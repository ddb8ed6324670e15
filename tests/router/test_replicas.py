"""The replica health state machine and load."""

from __future__ import annotations

import pytest

from ember.router.replicas import ReplicaSet, State, Transition


def test_a_new_replica_is_admitted_only_after_a_passed_check():
    replicas = ReplicaSet(eject_after=3, readmit_after=1)
    replica, new = replicas.add("http://a")
    assert new and replica.state is State.EJECTED and replicas.healthy() == []
    replicas.record_success(replica)  # a request's success does not admit
    assert not replica.healthy
    assert replicas.record_check(replica) is Transition.ADMITTED
    assert replicas.healthy() == [replica]
    assert replicas.add("http://a") == (replica, False)


def test_consecutive_failures_eject_once_and_success_resets_the_count():
    replicas = ReplicaSet(eject_after=3, readmit_after=2)
    replica, _ = replicas.add("http://a")
    replicas.record_check(replica)
    replicas.record_check(replica)
    assert replica.healthy
    assert replicas.record_failure(replica, "e1") is None
    assert replicas.record_failure(replica, "e2") is None
    replicas.record_success(replica)
    assert replicas.record_failure(replica, "e3") is None
    assert replicas.record_failure(replica, "e4") is None
    assert replicas.record_failure(replica, "e5") is Transition.EJECTED
    assert replica.state is State.EJECTED and replica.last_error == "e5"
    assert replicas.record_failure(replica, "e6") is None  # already out: no second ejection


def test_readmission_needs_consecutive_passed_checks():
    replicas = ReplicaSet(eject_after=1, readmit_after=2)
    replica, _ = replicas.add("http://a")
    assert replicas.record_check(replica) is None
    assert replicas.record_check(replica) is Transition.ADMITTED
    assert replicas.record_failure(replica, "down") is Transition.EJECTED
    assert replicas.record_check(replica) is None
    replicas.record_failure(replica, "flap")  # breaks the run of passed checks
    assert replicas.record_check(replica) is None
    assert replicas.record_check(replica) is Transition.READMITTED
    assert replica.healthy and replica.last_error is None


def test_load_is_the_larger_of_own_count_and_the_replica_report():
    replicas = ReplicaSet(1, 1)
    replica, _ = replicas.add("http://a")
    replica.in_flight = 3
    assert replica.load == 3
    replica.reported_running, replica.reported_waiting = 4, 2
    assert replica.load == 6


def test_remove_and_bad_thresholds():
    replicas = ReplicaSet(1, 1)
    replicas.add("http://a")
    assert replicas.remove("http://a").url == "http://a"
    assert replicas.remove("http://a") is None and len(replicas) == 0
    with pytest.raises(ValueError, match="^eject_after: "):
        ReplicaSet(0, 1)
    with pytest.raises(ValueError, match="^readmit_after: "):
        ReplicaSet(1, 0)


def test_failures_remember_whether_the_replica_answered_at_all():
    replicas = ReplicaSet(eject_after=2, readmit_after=1)
    replica, _ = replicas.add("http://a")
    replicas.record_check(replica)
    replicas.record_failure(replica, "returned 503")
    assert not replica.unreachable
    assert replicas.record_failure(replica, "ReadTimeout", unreachable=True) is Transition.EJECTED
    assert replica.unreachable
