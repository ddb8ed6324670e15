"""Facade between the scheduler and the block pool: per-request block tables and prefix hits.

Prefix caching uses chained block hashes: block i's hash covers its tokens and block i-1's
hash, so equal hashes mean equal prefixes. A hit is still verified against the stored token
ids and the parent block, so a hash collision can never serve wrong KV.
"""

from __future__ import annotations

import hashlib
from array import array

from ember.core.block_pool import BlockPool, KVBlock
from ember.core.request import Request


def hash_block(parent_hash: bytes | None, token_ids: list[int] | tuple[int, ...]) -> bytes:
    """Stable (cross-process) chained hash of one full block."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent_hash or b"\0")
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def block_hashes(token_ids: list[int], block_size: int) -> list[bytes]:
    """Chained hashes of every full block of a token sequence."""
    out: list[bytes] = []
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start:start + block_size])
        out.append(parent)
    return out


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self._blocks: dict[str, list[KVBlock]] = {}
        self._num_cached: dict[str, int] = {}
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._blocks.get(request_id, ())]

    def _update_hashes(self, request: Request) -> None:
        n_full = request.num_tokens // self.block_size
        hashes = request.block_hashes
        if len(hashes) >= n_full:
            return
        tokens = request.all_token_ids
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), n_full):
            parent = hash_block(parent, tokens[i * self.block_size:(i + 1) * self.block_size])
            hashes.append(parent)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest verified cached prefix of the request, as blocks and a token count.

        At least the last token is always left to compute, since its logits are needed.
        """
        if not self.enable_prefix_caching:
            return [], 0
        self._update_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        tokens = request.all_token_ids
        hits: list[KVBlock] = []
        parent_id = None
        for i in range(max_blocks):
            chunk = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            block = self.pool.lookup(request.block_hashes[i], chunk, parent_id)
            if block is None:
                break
            hits.append(block)
            parent_id = block.block_id
        self.prefix_queries += request.num_tokens
        self.prefix_hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[KVBlock] | None = None) -> bool:
        """Make room for num_new_tokens more tokens after the computed ones; False if full."""
        computed_blocks = computed_blocks or []
        held = self._blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens or len(computed_blocks) * self.block_size
        needed_total = -(-(num_computed + num_new_tokens) // self.block_size)
        num_new_blocks = needed_total - len(held) - len(computed_blocks)
        # cached-but-free hits leave the free queue when touched, so they count against it
        num_evictable_hits = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if num_new_blocks + num_evictable_hits > self.pool.num_free_blocks:
            return False
        if computed_blocks:
            self.pool.touch(computed_blocks)
            held = held + computed_blocks
            self._num_cached[request.request_id] = len(computed_blocks)
        if num_new_blocks > 0:
            held = held + self.pool.allocate(num_new_blocks)
        self._blocks[request.request_id] = held
        return True

    def cache_blocks(self, request: Request) -> None:
        """Index the request's newly computed full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        self._update_hashes(request)
        blocks = self._blocks.get(request.request_id, [])
        n_full = min(request.num_computed_tokens // self.block_size, len(blocks))
        start = self._num_cached.get(request.request_id, 0)
        if start >= n_full:
            return
        tokens = request.all_token_ids
        for i in range(start, n_full):
            # the parent is the canonical cached copy, which may be another request's block
            # when both computed the same prefix at once
            parent_id = self.pool.cached_block_id(request.block_hashes[i - 1]) if i else None
            chunk = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            self.pool.cache_block(blocks[i], request.block_hashes[i], chunk, parent_id)
        self._num_cached[request.request_id] = n_full

    def free(self, request: Request) -> None:
        blocks = self._blocks.pop(request.request_id, [])
        self._num_cached.pop(request.request_id, None)
        self.pool.free(list(reversed(blocks)), hot=request.session_id is not None)

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        refs: dict[int, int] = {}
        for blocks in self._blocks.values():
            for b in blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for block in self.pool.blocks:
            if block.ref_cnt != refs.get(block.block_id, 0):
                raise AssertionError(
                    f"block {block.block_id}: ref_cnt {block.ref_cnt} but held by "
                    f"{refs.get(block.block_id, 0)} requests")
