"""Which replica gets a request; pure logic over the replica set and the prefix index.

Policy "affinity", in order:
1. a request with a session id goes to the replica that rendezvous hashing assigns the id
   among the eligible replicas;
2. one without goes to the replica that was sent the longest run of its leading prompt blocks
   (the least loaded of those on a tie) when that run covers at least `prefix_min_match` of
   the prompt's blocks, else to the least loaded replica: a prefix that every prompt shares
   (a common system prompt) is soon cached everywhere and must not pull all traffic to one
   replica;
3. when the choice is overloaded, the request spills to the least loaded replica that is not.
Policy "round-robin" cycles through the eligible replicas and ignores everything else; it is
the baseline that affinity is measured against.

Eligible means healthy and not already tried for this request. When no replica is healthy
every member is eligible (a request that may fail beats one refused outright).
"""

from __future__ import annotations

import itertools
from collections.abc import Collection
from dataclasses import dataclass

from ember.router import hashing
from ember.router.prefix_index import PrefixIndex
from ember.router.replicas import Replica, ReplicaSet

ROUTES = ("affinity", "prefix", "least_loaded", "round_robin")


@dataclass(frozen=True)
class Decision:
    replica: Replica
    route: str  # one of ROUTES: why this replica was chosen before any spill
    spilled_from: Replica | None = None
    matched_blocks: int = 0


class Policy:
    def __init__(self, name: str, replicas: ReplicaSet, index: PrefixIndex, max_load: int,
                 max_waiting: int, prefix_min_match: float = 0.5) -> None:
        self.name = name
        self.prefix_min_match = prefix_min_match
        self.replicas = replicas
        self.index = index
        self.max_load = max_load
        self.max_waiting = max_waiting
        self._turn = itertools.count()  # round-robin position
        self._sequence = itertools.count()  # stamps each pick

    def eligible(self, exclude: Collection[str] = ()) -> list[Replica]:
        healthy = [r for r in self.replicas.healthy() if r.url not in exclude]
        return healthy or [r for r in self.replicas.all() if r.url not in exclude]

    def overloaded(self, replica: Replica) -> bool:
        return replica.load >= self.max_load or replica.reported_waiting >= self.max_waiting

    def choose(self, affinity: str | None, hashes: list[int],
               exclude: Collection[str] = ()) -> Decision | None:
        candidates = self.eligible(exclude)
        if not candidates:
            return None
        if self.name == "round-robin":
            ordered = sorted(candidates, key=lambda r: r.url)
            replica = ordered[next(self._turn) % len(ordered)]
            replica.last_chosen = next(self._sequence)
            return Decision(replica, "round_robin")
        matched = 0
        if affinity:
            target, route = self.assign(affinity, candidates), "affinity"
        else:
            best, matched = self.index.longest_match(hashes, [r.url for r in candidates])
            if not best or matched < self.prefix_min_match * len(hashes):
                best = []  # a shared system prompt alone does not outweigh load
            pool = [r for r in candidates if r.url in best] or candidates
            target, route = self.least_loaded(pool), "prefix" if best else "least_loaded"
        decision = Decision(target, route, None, matched)
        if self.overloaded(target):
            room = [r for r in candidates if not self.overloaded(r)]
            if room:
                decision = Decision(self.least_loaded(room), route, target, matched)
        decision.replica.last_chosen = next(self._sequence)
        return decision

    def assign(self, affinity: str, candidates: list[Replica]) -> Replica:
        by_url = {r.url: r for r in candidates}
        return by_url[hashing.owner(affinity, by_url)]

    def least_loaded(self, candidates: list[Replica]) -> Replica:
        """The replica with the least load; on a tie the one chosen least recently, so idle
        replicas share new work."""
        return min(candidates, key=lambda r: (r.load, r.last_chosen, r.url))
