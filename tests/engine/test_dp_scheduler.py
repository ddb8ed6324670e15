"""Data-parallel scheduling: one scheduler and KV cache per group, requests placed by load
and kept with their session or shared first block."""

from __future__ import annotations

from ember.config import SchedulerConfig
from ember.core.kv_cache_manager import KVCacheManager
from ember.core.request import Request, RequestStatus
from ember.core.sampling_params import SamplingParams
from ember.engine.dp_scheduler import DataParallelKV, DataParallelScheduler


def make(groups: int = 2) -> tuple[DataParallelScheduler, DataParallelKV]:
    kvs = [KVCacheManager(32, 4) for _ in range(groups)]
    return DataParallelScheduler(SchedulerConfig(max_num_batched_tokens=64), kvs), \
        DataParallelKV(kvs)


def request(rid: str, tokens: list[int], session: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                   session_id=session)


def test_requests_spread_over_groups_and_step_together() -> None:
    sched, kv = make()
    for i in range(4):
        sched.add_request(request(f"r{i}", [10 * i + j for j in range(3)]))
    assert [g.num_unfinished for g in sched.groups] == [2, 2]
    out = sched.schedule()
    assert [len(p.scheduled) for p in out.parts] == [2, 2]
    assert out.num_batched_tokens == 12 and not out.is_empty
    advanced = sched.update_from_output(out, {sr.request_id: 7 for sr in out.scheduled})
    assert len(advanced) == 4 and len(sched.running) == 4
    assert kv.num_free_blocks == 2 * 32 - 4
    sched.finish_requests(["r0", "r3"], RequestStatus.FINISHED_ABORTED)
    assert len(sched.running) == 2
    sched.check_integrity()


def test_sessions_and_shared_prefixes_stay_in_one_group() -> None:
    sched, _ = make()
    prefix = [1, 2, 3, 4]
    sched.add_request(request("a", prefix + [5]))
    sched.add_request(request("b", [9, 9]))  # the idler group
    sched.add_request(request("c", prefix + [6, 7]))  # same first block as "a"
    sched.add_request(request("d", [8], session="s"))
    sched.add_request(request("e", [3], session="s"))
    group_of = {r.request_id: i for i, g in enumerate(sched.groups) for r in g.waiting}
    assert group_of["a"] == group_of["c"] != group_of["b"]
    assert group_of["d"] == group_of["e"]
