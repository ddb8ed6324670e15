"""EngineCore: the engine loop. step() = schedule -> execute -> update.

It speaks token ids only; text (detokenization, stop strings, n > 1 fan-out) is the
OutputProcessor's business on the frontend side of the process boundary.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from ember.config import EngineConfig
from ember.core.kv_cache_manager import KVCacheManager
from ember.core.request import Lane, Request, RequestStatus
from ember.core.sampling_params import SamplingParams
from ember.core.scheduler import Scheduler
from ember.engine.dp_scheduler import DataParallelKV, DataParallelScheduler
from ember.executor.checkpoint import Checkpoint, open_checkpoint
from ember.executor.executor import MultiprocExecutor
from ember.executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass
class EngineCoreOutput:
    """What one request gained in one step."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[tuple[float, dict[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_running_by_lane: dict[str, int]
    num_waiting_by_lane: dict[str, int]
    kv_usage: float
    num_kv_blocks: int
    block_size: int
    kv_bytes_per_token: int
    prefix_queries: int
    prefix_hits: int
    num_preemptions: int
    num_computed_tokens: int
    num_steps: int
    # MoE models: per layer, max over mean tokens routed per expert (empty for dense models)
    expert_load_imbalance: dict[int, float] = field(default_factory=dict)


class EngineCore:
    def __init__(self, config: EngineConfig, checkpoint: Checkpoint | None = None) -> None:
        self.config = config
        self.checkpoint = checkpoint or open_checkpoint(config.model.model)
        # one process unless parallelism asks for workers (one per rank)
        self.runner: ModelRunner | MultiprocExecutor = (
            ModelRunner(self.checkpoint, config) if config.parallel.world_size == 1
            else MultiprocExecutor(config))
        capacity = self.runner.num_kv_blocks * config.cache.block_size
        model_len = int(self.checkpoint.text_config.get("max_position_embeddings") or capacity)
        if config.model.max_model_len is not None:
            if config.model.max_model_len > capacity:
                raise ValueError(
                    f"max_model_len: {config.model.max_model_len} exceeds the KV cache capacity "
                    f"of {capacity} tokens (raise num_kv_blocks or kv_cache_memory_gb)")
            self.max_model_len = config.model.max_model_len
        else:
            self.max_model_len = min(model_len, capacity)
        kvs = [KVCacheManager(self.runner.num_kv_blocks, config.cache.block_size,
                              config.cache.enable_prefix_caching)
               for _ in range(config.parallel.data_parallel_size)]
        if len(kvs) == 1:
            self.kv: KVCacheManager | DataParallelKV = kvs[0]
            self.scheduler: Scheduler | DataParallelScheduler = Scheduler(config.scheduler,
                                                                          kvs[0])
        else:  # a scheduler and KV cache per data-parallel group
            self.kv = DataParallelKV(kvs)
            self.scheduler = DataParallelScheduler(config.scheduler, kvs)
        self.eos_token_ids = self.checkpoint.eos_token_ids()
        self.num_steps = 0
        self.step_time_s = 0.0

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    lane: Lane = Lane.INTERACTIVE, priority: int = 0,
                    session_id: str | None = None) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt: must not be empty")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"prompt: {len(prompt_token_ids)} tokens does not fit the context of "
                             f"{self.max_model_len} tokens (the reply needs at least one)")
        vocab = self.checkpoint.text_config.get("vocab_size")
        if vocab is not None and any(not 0 <= t < vocab for t in prompt_token_ids):
            raise ValueError(f"prompt: token ids must be in [0, {vocab})")
        self.scheduler.add_request(Request(
            request_id, list(prompt_token_ids), params, eos_token_ids=self.eos_token_ids,
            lane=lane, priority=priority, session_id=session_id,
            max_model_len=self.max_model_len))

    def abort(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[EngineCoreOutput]:
        start = time.perf_counter()
        sched_out = self.scheduler.schedule()
        result = self.runner.execute(sched_out)
        advanced = self.scheduler.update_from_output(sched_out, result.sampled)
        outputs = []
        for req in advanced:
            lp = result.logprobs.get(req.request_id)
            outputs.append(EngineCoreOutput(
                request_id=req.request_id,
                new_token_ids=[req.output_token_ids[-1]],
                new_logprobs=[lp] if lp is not None else [],
                finish_reason=req.status.value if req.is_finished else None,
                stop_reason=req.stop_reason,
                num_cached_tokens=req.num_cached_tokens,
            ))
        if not sched_out.is_empty:
            self.num_steps += 1
            self.step_time_s += time.perf_counter() - start
        return outputs

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    def shutdown(self) -> None:
        """Stop the worker processes, if any (requests still open are dropped)."""
        if isinstance(self.runner, MultiprocExecutor):
            self.runner.shutdown()

    def stats(self) -> EngineStats:
        sched = self.scheduler
        lanes = {lane.name.lower(): lane for lane in Lane}
        return EngineStats(
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            num_running_by_lane={n: sum(r.lane == v for r in sched.running)
                                 for n, v in lanes.items()},
            num_waiting_by_lane={n: sum(r.lane == v for r in sched.waiting)
                                 for n, v in lanes.items()},
            kv_usage=self.kv.usage(),
            num_kv_blocks=self.runner.num_kv_blocks,
            block_size=self.config.cache.block_size,
            kv_bytes_per_token=self.runner.kv_bytes_per_token,
            prefix_queries=self.kv.prefix_queries,
            prefix_hits=self.kv.prefix_hits,
            num_preemptions=sched.num_preemptions,
            num_computed_tokens=sched.num_computed_tokens_total,
            num_steps=self.num_steps,
        )
