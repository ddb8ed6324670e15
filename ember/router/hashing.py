"""Rendezvous (highest random weight) hashing of session ids onto replicas.

Every (replica, key) pair gets a pseudo-random score; a key belongs to the replica with the
highest score among those eligible. Removing a replica moves only its own keys, each to its
second choice; adding one takes from every other replica the keys it now outscores, about
1/N of all. Scores depend only on the replica's name and the key, so a replica that leaves and
comes back under the same name gets back exactly the keys it had.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable


def score(node: str, key: str) -> int:
    """A stable 64-bit score; blake2b rather than hash() so it survives restarts."""
    digest = hashlib.blake2b(f"{node}\x00{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rank(key: str, nodes: Iterable[str]) -> list[str]:
    """The nodes in the key's order of preference, best first (ties broken by name)."""
    return sorted(nodes, key=lambda node: (-score(node, key), node))


def owner(key: str, nodes: Iterable[str]) -> str | None:
    """The node the key belongs to (rank's first), or None when there are no nodes."""
    return min(nodes, key=lambda node: (-score(node, key), node), default=None)
