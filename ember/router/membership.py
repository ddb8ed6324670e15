"""Replicas joining and leaving at run time: from the admin endpoint or a watched file.

A replicas file lists one base URL per line (`#` starts a comment). The router re-reads it
whenever its modification time or size changes, adds the URLs that appeared and removes the
ones that disappeared; it never removes replicas that came from the command line or the admin
endpoint. A new replica is checked at once and takes traffic as soon as it passes.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from ember.router.config import normalize_url
from ember.router.health import HealthChecker
from ember.router.metrics import RouterMetrics
from ember.router.prefix_index import PrefixIndex
from ember.router.replicas import Replica, ReplicaSet, Transition

log = logging.getLogger("ember.router")


class Membership:
    def __init__(self, replicas: ReplicaSet, index: PrefixIndex, metrics: RouterMetrics) -> None:
        self.replicas = replicas
        self.index = index
        self.metrics = metrics
        self.checker: HealthChecker | None = None  # set once the HTTP client exists

    def on_transition(self, replica: Replica, transition: Transition) -> None:
        if transition is Transition.EJECTED:
            # Whatever it cached may be gone when it comes back (a restart empties it).
            self.index.forget(replica.url)
            self.metrics.ejections.labels(replica.url).inc()
            log.warning("ejected %s: %s", replica.url, replica.last_error)
            if replica.unreachable:
                for stream in list(replica.streams):
                    stream.abort(f"replica failed mid-stream: ejected, {replica.last_error}")
        elif transition is Transition.READMITTED:
            self.metrics.readmissions.labels(replica.url).inc()
            log.info("re-admitted %s", replica.url)
        else:
            log.info("admitted %s", replica.url)

    async def add(self, url: str, source: str) -> tuple[Replica, bool]:
        """Add the replica (if new) and check it now; (replica, whether it was new)."""
        replica, new = self.replicas.add(normalize_url(url, "url"), source)
        if new and self.checker is not None:
            await self.checker.check(replica)
        return replica, new

    def remove(self, url: str) -> Replica | None:
        replica = self.replicas.remove(normalize_url(url, "url"))
        if replica is not None:
            self.index.forget(replica.url)
            log.info("removed %s", replica.url)
        return replica


def read_replicas_file(path: Path) -> list[str]:
    """The URLs listed in the file, normalized; ValueError names a bad line."""
    urls = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        entry = line.split("#", 1)[0].strip()
        if entry:
            urls.append(normalize_url(entry, f"{path}:{number}"))
    return urls


class ReplicasFile:
    """Keeps the file's replicas in the set; call sync() whenever, run() to poll."""

    def __init__(self, path: Path, membership: Membership) -> None:
        self.path = path
        self.membership = membership
        self._seen: tuple[int, int] | None = None

    async def sync(self) -> None:
        try:
            stat = self.path.stat()
            if (stat.st_mtime_ns, stat.st_size) == self._seen:
                return
            self._seen = (stat.st_mtime_ns, stat.st_size)
            urls = read_replicas_file(self.path)
        except (OSError, ValueError) as exc:
            log.error("replicas file %s: %s; membership unchanged", self.path, exc)
            return
        listed = set(urls)
        for replica in self.membership.replicas.all():
            if replica.source == "file" and replica.url not in listed:
                self.membership.remove(replica.url)
        await asyncio.gather(*(self.membership.add(url, "file") for url in urls))

    async def run(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            await self.sync()
