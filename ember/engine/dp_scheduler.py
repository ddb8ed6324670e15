"""Data parallelism on the scheduling side: one scheduler and KV cache per data-parallel group.

Each request lives in one group for its whole life (its KV blocks are that group's). New
requests go to the least-loaded group, except that requests of one session, or sharing their
first KV block with an earlier request, follow it while that group is not much busier, so
prefix-cache hits survive the split. A step schedules every group; the executor runs the
groups' batches side by side.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from ember.config import SchedulerConfig
from ember.core.kv_cache_manager import KVCacheManager, hash_block
from ember.core.request import Request, RequestStatus
from ember.core.scheduler import Scheduler
from ember.executor.executor import DataParallelOutput

AFFINITY_SLACK = 4  # a group may run this many more requests than the idlest and keep affinity
AFFINITY_ENTRIES = 4096  # remembered session / first-block keys


class DataParallelKV:
    """The groups' KV caches seen as one, for statistics."""

    def __init__(self, kvs: list[KVCacheManager]) -> None:
        self.kvs = kvs

    @property
    def num_free_blocks(self) -> int:
        return sum(kv.num_free_blocks for kv in self.kvs)

    @property
    def prefix_queries(self) -> int:
        return sum(kv.prefix_queries for kv in self.kvs)

    @property
    def prefix_hits(self) -> int:
        return sum(kv.prefix_hits for kv in self.kvs)

    def usage(self) -> float:
        return sum(kv.usage() for kv in self.kvs) / len(self.kvs)


class DataParallelScheduler:
    """The Scheduler interface over one Scheduler per data-parallel group."""

    def __init__(self, config: SchedulerConfig, kvs: list[KVCacheManager]) -> None:
        self.config = config
        self.groups = [Scheduler(config, kv) for kv in kvs]
        self._group_of: dict[str, int] = {}
        self._affinity: OrderedDict[object, int] = OrderedDict()

    @property
    def running(self) -> list[Request]:
        return [r for g in self.groups for r in g.running]

    @property
    def waiting(self) -> list[Request]:
        return [r for g in self.groups for r in g.waiting]

    @property
    def num_preemptions(self) -> int:
        return sum(g.num_preemptions for g in self.groups)

    @property
    def num_computed_tokens_total(self) -> int:
        return sum(g.num_computed_tokens_total for g in self.groups)

    def has_unfinished(self) -> bool:
        return any(g.has_unfinished() for g in self.groups)

    def add_request(self, request: Request) -> None:
        if any(request.request_id in g.requests for g in self.groups):
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        index = self._place(request)
        self.groups[index].add_request(request)
        self._group_of[request.request_id] = index

    def _place(self, request: Request) -> int:
        loads = [g.num_unfinished for g in self.groups]
        idlest = min(range(len(loads)), key=loads.__getitem__)
        key = self._affinity_key(request)
        if key is None:
            return idlest
        index = self._affinity.get(key)
        if index is None or loads[index] > loads[idlest] + AFFINITY_SLACK:
            index = idlest
        self._affinity[key] = index
        self._affinity.move_to_end(key)
        if len(self._affinity) > AFFINITY_ENTRIES:
            self._affinity.popitem(last=False)
        return index

    def _affinity_key(self, request: Request) -> object:
        if request.session_id is not None:
            return ("session", request.session_id)
        block = self.groups[0].kv.block_size
        if len(request.prompt_token_ids) < block:
            return None
        return hash_block(None, request.prompt_token_ids[:block])

    def schedule(self) -> DataParallelOutput:
        return DataParallelOutput([g.schedule() for g in self.groups])

    def update_from_output(self, out: DataParallelOutput,
                           sampled: dict[str, int]) -> list[Request]:
        advanced = []
        for group, part in zip(self.groups, out.parts, strict=True):
            advanced += group.update_from_output(part, sampled)
        for part in out.parts:  # requests released in the step before this one
            for rid in part.finished_request_ids:
                index = self._group_of.get(rid)
                if index is not None and rid not in self.groups[index].requests:
                    del self._group_of[rid]
        return advanced

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        for rid in request_ids:
            index = self._group_of.get(rid)
            if index is not None:
                self.groups[index].finish_requests([rid], status)

    def check_integrity(self) -> None:
        for group in self.groups:
            group.check_integrity()
