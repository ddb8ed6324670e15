"""What ejection does to a replica's state, and the replicas file format."""

from __future__ import annotations

import pytest

from ember.router.membership import Membership, read_replicas_file
from ember.router.metrics import RouterMetrics
from ember.router.prefix_index import PrefixIndex
from ember.router.replicas import ReplicaSet


class RecordedStream:
    def __init__(self) -> None:
        self.reasons: list[str] = []

    def abort(self, reason: str) -> None:
        self.reasons.append(reason)


def ejected_replica(unreachable: bool) -> tuple[Membership, RecordedStream]:
    replicas = ReplicaSet(eject_after=1, readmit_after=1)
    index = PrefixIndex(10)
    membership = Membership(replicas, index, RouterMetrics(replicas))
    replica, _ = replicas.add("http://a")
    replicas.record_check(replica)
    index.record("http://a", [1, 2])
    stream = RecordedStream()
    replica.streams.add(stream)
    transition = replicas.record_failure(replica, "ReadTimeout" if unreachable else
                                         "returned 503", unreachable)
    membership.on_transition(replica, transition)
    return membership, stream


def test_an_unreachable_replica_loses_its_streams_and_its_prefixes():
    membership, stream = ejected_replica(unreachable=True)
    assert stream.reasons == ["replica failed mid-stream: ejected, ReadTimeout"]
    assert membership.index.size("http://a") == 0
    registry = membership.metrics.registry
    assert registry.get_sample_value("ember:router_ejections_total",
                                     {"replica": "http://a"}) == 1


def test_a_replica_that_still_answers_finishes_its_streams():
    _, stream = ejected_replica(unreachable=False)
    assert stream.reasons == []


def test_replicas_file_format(tmp_path):
    listing = tmp_path / "replicas"
    listing.write_text("# comment\n\nhttp://a:1/v1  # note\n  http://b:2/  \n")
    assert read_replicas_file(listing) == ["http://a:1", "http://b:2"]
    listing.write_text("http://a:1\nb:2\n")
    with pytest.raises(ValueError, match="replicas:2: must start with http"):
        read_replicas_file(listing)
