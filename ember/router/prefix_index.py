"""Which replica most likely caches a prompt's prefix: block hashes remembered per replica.

Each replica has an LRU of at most `capacity` block hashes (see prompt.block_hashes), so memory
is bounded by capacity * replicas whatever the traffic. A prompt's blocks are touched last to
first, which keeps its leading blocks (the ones every match needs, and the ones other prompts
share) the most recently used.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class PrefixIndex:
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity: must be >= 1, got {capacity}")
        self.capacity = capacity
        self._blocks: dict[str, OrderedDict[int, None]] = {}

    def record(self, replica: str, hashes: list[int]) -> None:
        """The replica has just been sent a prompt with these leading block hashes."""
        blocks = self._blocks.setdefault(replica, OrderedDict())
        for block in reversed(hashes):
            blocks[block] = None
            blocks.move_to_end(block)
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)

    def matched_blocks(self, replica: str, hashes: list[int]) -> int:
        """How many leading blocks of the prompt the replica was sent before."""
        blocks = self._blocks.get(replica)
        if not blocks:
            return 0
        count = 0
        for block in hashes:
            if block not in blocks:
                break
            count += 1
        return count

    def longest_match(self, hashes: list[int], replicas: Iterable[str]) -> tuple[list[str], int]:
        """The replicas sharing the longest leading run of blocks with the prompt, and its
        length in blocks; ([], 0) when none shares even the first block."""
        best: list[str] = []
        best_len = 0
        for replica in replicas:
            length = self.matched_blocks(replica, hashes)
            if length > best_len:
                best, best_len = [replica], length
            elif length == best_len and length > 0:
                best.append(replica)
        return best, best_len

    def forget(self, replica: str) -> None:
        """Drop a replica's blocks (it left, or restarted with an empty cache)."""
        self._blocks.pop(replica, None)

    def size(self, replica: str) -> int:
        return len(self._blocks.get(replica, ()))

    def check_integrity(self) -> None:
        for replica, blocks in self._blocks.items():
            if len(blocks) > self.capacity:
                raise RuntimeError(f"prefix index: {replica} holds {len(blocks)} blocks, "
                                   f"over its capacity {self.capacity}")
