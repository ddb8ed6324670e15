"""The replicas behind the router: membership, health state and load.

Health is a small state machine per replica. A replica starts ejected ("not checked yet") and
is admitted after `readmit_after` consecutive successful active checks. Any failure, active
(a failed /health) or passive (a proxied request that could not connect, or got a 502/503/504,
or broke mid-stream), adds to its consecutive failures; `eject_after` of them in a row eject a
healthy replica. A success resets the count. Only active checks re-admit: an ejected replica
gets no traffic, so it cannot prove itself on requests. A replica ejected while unreachable
(its last failure got no HTTP answer) has its open streams aborted, since a hung machine may
never close them; one that still answers (say, 503 while it drains) finishes them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol


class State(enum.Enum):
    HEALTHY = "healthy"
    EJECTED = "ejected"


class Transition(enum.Enum):
    EJECTED = "ejected"
    ADMITTED = "admitted"  # first admission of a new replica
    READMITTED = "readmitted"


class Stream(Protocol):
    """An open response from a replica that can be ended early (proxy.RelayResponse)."""

    def abort(self, reason: str) -> None: ...


@dataclass
class Replica:
    url: str
    source: str = "cli"  # cli | admin | file: who may remove it
    state: State = State.EJECTED
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    ever_healthy: bool = False
    last_error: str | None = "not checked yet"
    in_flight: int = 0  # requests this router has open on it
    reported_running: int = 0  # from its /metrics, when it exports them
    reported_waiting: int = 0
    last_chosen: int = -1  # the policy's sequence number of its latest pick, for tie-breaks
    unreachable: bool = False  # its latest failure was a timeout or a broken connection
    streams: set[Stream] = field(default_factory=set, repr=False)  # responses being relayed

    @property
    def healthy(self) -> bool:
        return self.state is State.HEALTHY

    @property
    def load(self) -> int:
        """Live in-flight count, or the replica's own last report when that is larger (it
        also counts work from other clients)."""
        return max(self.in_flight, self.reported_running + self.reported_waiting)

    def describe(self) -> dict[str, object]:
        return {"url": self.url, "source": self.source, "state": self.state.value,
                "consecutive_failures": self.consecutive_failures, "last_error": self.last_error,
                "in_flight": self.in_flight, "reported_running": self.reported_running,
                "reported_waiting": self.reported_waiting, "load": self.load}


class ReplicaSet:
    """Replicas by URL, in the order they were added."""

    def __init__(self, eject_after: int, readmit_after: int) -> None:
        if eject_after < 1:
            raise ValueError(f"eject_after: must be >= 1, got {eject_after}")
        if readmit_after < 1:
            raise ValueError(f"readmit_after: must be >= 1, got {readmit_after}")
        self.eject_after = eject_after
        self.readmit_after = readmit_after
        self._replicas: dict[str, Replica] = {}

    def __len__(self) -> int:
        return len(self._replicas)

    def __contains__(self, url: str) -> bool:
        return url in self._replicas

    def get(self, url: str) -> Replica | None:
        return self._replicas.get(url)

    def all(self) -> list[Replica]:
        return list(self._replicas.values())

    def healthy(self) -> list[Replica]:
        return [r for r in self._replicas.values() if r.healthy]

    def add(self, url: str, source: str = "cli") -> tuple[Replica, bool]:
        """The replica at url and whether it is new; an existing one is left as it is."""
        existing = self._replicas.get(url)
        if existing is not None:
            return existing, False
        replica = Replica(url, source)
        self._replicas[url] = replica
        return replica, True

    def remove(self, url: str) -> Replica | None:
        return self._replicas.pop(url, None)

    def record_failure(self, replica: Replica, error: str,
                       unreachable: bool = False) -> Transition | None:
        """A failed check or request; EJECTED when this failure ejects the replica.
        `unreachable`: no HTTP answer at all (refused, reset, timed out)."""
        replica.consecutive_failures += 1
        replica.consecutive_successes = 0
        replica.last_error = error
        replica.unreachable = unreachable
        if replica.healthy and replica.consecutive_failures >= self.eject_after:
            replica.state = State.EJECTED
            return Transition.EJECTED
        return None

    def record_success(self, replica: Replica) -> None:
        """A proxied request that got its answer: failures are no longer consecutive."""
        replica.consecutive_failures = 0

    def record_check(self, replica: Replica) -> Transition | None:
        """A successful active check; may (re-)admit an ejected replica."""
        replica.consecutive_failures = 0
        replica.consecutive_successes += 1
        if replica.healthy or replica.consecutive_successes < self.readmit_after:
            return None
        replica.state = State.HEALTHY
        replica.last_error = None
        first = not replica.ever_healthy
        replica.ever_healthy = True
        return Transition.ADMITTED if first else Transition.READMITTED

    def check_integrity(self) -> None:
        for url, replica in self._replicas.items():
            if replica.url != url or replica.in_flight < 0:
                raise RuntimeError(f"replica set: inconsistent entry {replica.describe()}")
