"""The scheduler: which requests run this step and how many tokens each computes (torch-free).

One rule covers every phase: each running request's num_computed_tokens catches up with its
num_tokens, under a per-step token budget. A fresh prompt is a long catch-up (chunked when it
exceeds the budget), a prefix hit starts the count above zero, a decode is a catch-up of one.
Requests are ordered by lane (interactive before batch), priority and arrival. Each lane's
running requests, then its waiting ones, take the budget before the next lane's, so a waiting
interactive request goes ahead of batch work already running; the batch lane also has its own
per-step cap, and while an interactive prompt is prefilled (or waits) batch requests only
decode. When KV blocks (or sequence slots) run out the last of that order is preempted and
later recomputed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ember.config import SchedulerConfig
from ember.core.kv_cache_manager import KVCacheManager
from ember.core.request import Lane, Request, RequestStatus
from ember.core.sampling_params import SamplingParams


@dataclass
class ScheduledRequest:
    """One request's share of a step: the model computes token_ids at positions start_pos..."""

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_ids: list[int]
    needs_sample: bool
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    finished_request_ids: set[str] = field(default_factory=set)
    preempted_request_ids: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._finished_since_last_step: set[str] = set()
        self.num_preemptions = 0
        self.num_computed_tokens_total = 0  # tokens the model actually computed

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self._enqueue_waiting(request)

    def _enqueue_waiting(self, request: Request) -> None:
        key = request.sort_key
        idx = len(self.waiting)
        while idx > 0 and self.waiting[idx - 1].sort_key > key:
            idx -= 1
        self.waiting.insert(idx, request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_request_ids=self._finished_since_last_step)
        self._finished_since_last_step = set()
        budget = self.config.max_num_batched_tokens
        self.running.sort(key=lambda r: r.sort_key)
        scheduled: list[tuple[Request, int]] = []
        preempted = False
        for lane in Lane:
            lane_budget = budget if lane == Lane.INTERACTIVE else min(
                budget, self.config.max_batch_lane_tokens)
            # while an interactive prompt is being prefilled (or waits), batch requests only
            # decode: their prefill chunks would lengthen the step that ends in its first token
            decode_only = lane == Lane.BATCH and self._interactive_prefilling(scheduled)
            left, preempted_now = self._schedule_running(lane, lane_budget, scheduled, out,
                                                         decode_only)
            preempted = preempted or preempted_now
            if not preempted and not decode_only:
                left = self._admit_waiting(lane, left, scheduled, out)
                self.running.sort(key=lambda r: r.sort_key)  # admitted ones join their lane
            budget -= lane_budget - left
        for req, n in scheduled:
            start = req.num_computed_tokens
            params = req.sampling_params
            with_history = params.has_penalties
            out.scheduled.append(ScheduledRequest(
                request_id=req.request_id,
                token_ids=req.token_ids_slice(start, start + n),
                start_pos=start,
                block_ids=self.kv.block_ids(req.request_id),
                needs_sample=start + n == req.num_tokens,
                sampling_params=params,
                prompt_token_ids=req.prompt_token_ids if with_history else [],
                output_token_ids=list(req.output_token_ids) if with_history else [],
            ))
        return out

    def _interactive_prefilling(self, scheduled: list[tuple[Request, int]]) -> bool:
        """Whether this step prefills an interactive prompt or one is left waiting."""
        return (any(n > 1 and req.lane == Lane.INTERACTIVE for req, n in scheduled)
                or any(req.lane == Lane.INTERACTIVE for req in self.waiting))

    def _schedule_running(self, lane: Lane, budget: int, scheduled: list[tuple[Request, int]],
                          out: SchedulerOutput, decode_only: bool = False) -> tuple[int, bool]:
        """Give the lane's running requests their catch-up tokens (with decode_only, only to
        those one token behind); returns the budget left and whether anything was preempted.
        Victims come from the end of the running order (the batch lane first), never from
        requests already scheduled this step."""
        preempted = False
        idx = 0
        while idx < len(self.running) and budget > 0:
            req = self.running[idx]
            remaining = req.num_tokens - req.num_computed_tokens
            n = min(remaining, budget)
            if req.lane != lane or n <= 0 or (decode_only and remaining > 1):
                idx += 1
                continue
            while not self.kv.allocate_slots(req, n):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted_request_ids.append(victim.request_id)
                preempted = True
                if victim is req:
                    break
            else:
                scheduled.append((req, n))
                budget -= n
                idx += 1
        return budget, preempted

    def _admit_waiting(self, lane: Lane, budget: int, scheduled: list[tuple[Request, int]],
                       out: SchedulerOutput) -> int:
        """Move the lane's waiting requests to running while budget, blocks and sequence slots
        last; an interactive request may preempt running batch work for blocks or slots."""
        just_preempted = set(out.preempted_request_ids)  # not back in the same step
        while budget > 0:
            req = next((r for r in self.waiting
                        if r.lane == lane and r.request_id not in just_preempted), None)
            if req is None:
                break
            computed_blocks, num_hit = [], 0
            if req.num_computed_tokens == 0:
                computed_blocks, num_hit = self.kv.get_computed_blocks(req)
            remaining = req.num_tokens - num_hit
            n = min(remaining, budget)
            if n < remaining and not self.config.enable_chunked_prefill:
                break
            if len(self.running) >= self.config.max_num_seqs:
                if not self._preempt_batch_for(req, out):
                    break
                continue
            if not self.kv.allocate_slots(req, n, computed_blocks):
                if not self._preempt_batch_for(req, out):
                    break
                continue
            self.waiting.remove(req)
            if req.status == RequestStatus.WAITING:
                req.num_cached_tokens = num_hit
            req.num_computed_tokens = num_hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append((req, n))
            budget -= n
        return budget

    def _preempt_batch_for(self, req: Request, out: SchedulerOutput) -> bool:
        """Preempt the last running batch-lane request to make room for an interactive one
        (batch requests are not scheduled yet when interactive ones are admitted)."""
        victim = next((r for r in reversed(self.running) if r.lane == Lane.BATCH), None)
        if req.lane != Lane.INTERACTIVE or victim is None:
            return False
        self.running.remove(victim)
        self._preempt(victim)
        out.preempted_request_ids.append(victim.request_id)
        return True

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue_waiting(req)

    def update_from_output(self, out: SchedulerOutput,
                           sampled: dict[str, int]) -> list[Request]:
        """Advance computed counts, append sampled tokens; return requests that got a token."""
        advanced = []
        for sr in out.scheduled:
            req = self.requests.get(sr.request_id)
            if req is None or req.is_finished:
                continue
            req.num_computed_tokens += len(sr.token_ids)
            self.num_computed_tokens_total += len(sr.token_ids)
            self.kv.cache_blocks(req)
            if sr.needs_sample:
                req.output_token_ids.append(sampled[sr.request_id])
                if req.check_stop():
                    self._release(req)
                advanced.append(req)
        return advanced

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """End requests from outside (stop strings, aborts)."""
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            if req in self.running:
                self.running.remove(req)
            elif req in self.waiting:
                self.waiting.remove(req)
            req.status = status
            self._release(req)

    def _release(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        self.kv.free(req)
        self.requests.pop(req.request_id, None)
        self._finished_since_last_step.add(req.request_id)

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        for req in self.running:
            if req.status != RequestStatus.RUNNING:
                raise AssertionError(f"{req.request_id} in running with status {req.status}")
        for req in self.waiting:
            if self.kv.block_ids(req.request_id):
                raise AssertionError(f"waiting request {req.request_id} holds blocks")
