"""Offline entry point shaped like vLLM's: LLM(model).generate(prompts, params)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

from ember.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from ember.core.request import Lane
from ember.core.sampling_params import SamplingParams
from ember.engine.engine_core import EngineCore, EngineStats
from ember.engine.output_processor import OutputProcessor
from ember.engine.outputs import RequestOutput
from ember.engine.tokenizer import Tokenizer, load_tokenizer

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str | None = None, dtype: str = "bfloat16", block_size: int = 16,
                 max_num_batched_tokens: int = 2048, max_num_seqs: int = 128,
                 num_kv_blocks: int | None = None, kv_cache_memory_gb: float = 2.0,
                 enable_prefix_caching: bool = True, enable_chunked_prefill: bool = True,
                 max_model_len: int | None = None, seed: int = 0, device: str = "cpu",
                 tensor_parallel_size: int = 1, expert_parallel_size: int = 1,
                 data_parallel_size: int = 1, enable_eplb: bool = False,
                 eplb_interval_steps: int = 32,
                 eplb_num_redundant_experts: int | None = None,
                 worker_launcher: str = "spawn", worker_listen: str | None = None) -> None:
        self.config = EngineConfig(
            model=ModelConfig(model=model, dtype=dtype, max_model_len=max_model_len,
                              device=device, seed=seed),
            cache=CacheConfig(block_size=block_size, num_kv_blocks=num_kv_blocks,
                              kv_cache_memory_gb=kv_cache_memory_gb,
                              enable_prefix_caching=enable_prefix_caching),
            scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens,
                                      max_num_seqs=max_num_seqs,
                                      enable_chunked_prefill=enable_chunked_prefill),
            parallel=ParallelConfig(tensor_parallel_size=tensor_parallel_size,
                                    expert_parallel_size=expert_parallel_size,
                                    data_parallel_size=data_parallel_size,
                                    enable_eplb=enable_eplb,
                                    eplb_interval_steps=eplb_interval_steps,
                                    eplb_num_redundant_experts=eplb_num_redundant_experts,
                                    worker_launcher=worker_launcher,
                                    worker_listen=worker_listen),
        )
        self.engine = EngineCore(self.config)
        self.tokenizer: Tokenizer = load_tokenizer(self.engine.checkpoint)
        self.processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the worker processes of a parallel engine (a no-op in one process)."""
        self.engine.shutdown()

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None, lane: Lane = Lane.INTERACTIVE,
                    priority: int = 0, session_id: str | None = None) -> str:
        """Queue one request without running it; returns its id."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else str(next(self._ids))
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, list(prompt)
        children = self.processor.add_request(request_id, token_ids, params, text)
        try:
            for child_id, child_params in children:
                self.engine.add_request(child_id, token_ids, child_params, lane, priority,
                                        session_id)
        except ValueError:
            self.abort(request_id)
            raise
        return request_id

    def abort(self, request_id: str) -> None:
        self.engine.abort(self.processor.child_ids(request_id))
        self.processor.abort(request_id)

    def step(self) -> list[RequestOutput]:
        """One engine step; returns the requests that advanced (with this step's deltas)."""
        outputs, stop_early = self.processor.process(self.engine.step())
        if stop_early:
            self.engine.abort(stop_early)
        return outputs

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run prompts (strings or token-id lists) to completion; outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError("sampling_params: need one per prompt or a single one")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params_list, strict=True)]
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None,
               **kwargs: Any) -> Iterator[RequestOutput]:
        """Yield one request's output after every step that advanced it, deltas included."""
        request_id = self.add_request(prompt, params, **kwargs)
        try:
            while True:
                for out in self.step():
                    if out.request_id == request_id:
                        yield out
                        if out.finished:
                            return
        finally:
            if self.processor.has_request(request_id):
                self.abort(request_id)
