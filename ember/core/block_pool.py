"""Fixed pool of KV-cache blocks: reference counts, an LRU free queue and the prefix-cache index.

A block is in exactly one of three states:
- in use: ref_cnt > 0 (held by one or more requests; shared prefix blocks have ref_cnt > 1);
- free and cached: ref_cnt == 0, still holds a verified full block of tokens, reusable by a
  later request with the same prefix until it is evicted;
- free and empty.
Free blocks (cached or not) sit in an LRU queue; allocation takes from its cold end and drops
the hash of a cached block it reuses. Blocks freed by a session-affine request go to a second
"hot" queue that is only drawn on when the cold one is empty, so that session's context
outlives anonymous traffic.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] | None = None
    parent_id: int | None = None


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free_cold: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._free_hot: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[bytes, int] = {}
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_cold) + len(self._free_hot)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self, n: int) -> list[KVBlock]:
        """Take n free blocks (least recently freed first), evicting their cached content."""
        if n > self.num_free_blocks:
            raise RuntimeError(f"asked for {n} blocks with {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            queue = self._free_cold if self._free_cold else self._free_hot
            block_id, _ = queue.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def lookup(self, block_hash: bytes, token_ids: tuple[int, ...],
               parent_id: int | None) -> KVBlock | None:
        """The cached block for this hash, only if its stored tokens and parent match too."""
        block_id = self._cached.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        if block.token_ids != token_ids or block.parent_id != parent_id:
            return None
        return block

    def cached_block_id(self, block_hash: bytes) -> int | None:
        return self._cached.get(block_hash)

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on cached blocks found by lookup (a prefix hit)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self._free_cold.pop(block.block_id, None)
                self._free_hot.pop(block.block_id, None)
            block.ref_cnt += 1

    def free(self, blocks: list[KVBlock], hot: bool = False) -> None:
        """Drop one reference from each block; blocks reaching zero join the free queue.

        Callers pass a request's blocks tail first so that, among equally old blocks, the
        end of a sequence is evicted before its (more shareable) beginning.
        """
        queue = self._free_hot if hot else self._free_cold
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                queue[block.block_id] = None

    def cache_block(self, block: KVBlock, block_hash: bytes, token_ids: tuple[int, ...],
                    parent_id: int | None) -> None:
        """Register a full, computed block under its chained hash."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return  # an identical block is already cached; this one stays private
        block.block_hash = block_hash
        block.token_ids = token_ids
        block.parent_id = parent_id
        self._cached[block_hash] = block.block_id

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            if block.ref_cnt == 0:
                self._evict(block)

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        if self._cached.get(block.block_hash) == block.block_id:
            del self._cached[block.block_hash]
            self.num_evictions += 1
        block.block_hash = None
        block.token_ids = None
        block.parent_id = None

    def check_integrity(self) -> None:
        """free + in-use == total; free queues hold exactly the zero-ref blocks; index sound."""
        free_ids = set(self._free_cold) | set(self._free_hot)
        if len(free_ids) != len(self._free_cold) + len(self._free_hot):
            raise AssertionError("a block sits in both free queues")
        in_use = [b for b in self.blocks if b.ref_cnt > 0]
        if any(b.ref_cnt < 0 for b in self.blocks):
            raise AssertionError("negative reference count")
        if len(in_use) + len(free_ids) != self.num_blocks:
            raise AssertionError(
                f"free ({len(free_ids)}) + in use ({len(in_use)}) != total ({self.num_blocks})")
        if any(b.block_id in free_ids for b in in_use):
            raise AssertionError("an in-use block is on the free queue")
        for block_hash, block_id in self._cached.items():
            if self.blocks[block_id].block_hash != block_hash:
                raise AssertionError(f"cache index points at block {block_id} with another hash")
