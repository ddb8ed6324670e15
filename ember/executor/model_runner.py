"""Runs the model for one scheduled step: batch tensors in, sampled tokens out.

The runner owns the model weights, the paged KV cache tensors (one per layer, slot-indexed)
and per-request sampling state (seeded generators). It knows nothing of queues or HTTP: the
scheduler's output is its only input.

Under parallelism each rank's worker holds a runner over its shard of the model (built with
the rank's ParallelContext); every rank runs the forward pass, and only the first rank of each
tensor-parallel group (the driver) receives the logits and samples.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from ember import envs
from ember.config import EngineConfig
from ember.core.scheduler import ScheduledRequest, SchedulerOutput
from ember.distributed.parallel_state import ParallelContext
from ember.executor.checkpoint import Checkpoint
from ember.executor.structured_output import StructuredOutputManager
from ember.executor.weight_slices import ReadCounter, weight_sources
from ember.layers.attention import AttentionMetadata, PrefillSpan, attention_dtype
from ember.layers.expert_parallel import ExpertParallelMoeBlock
from ember.layers.linear import pack_for_cpu
from ember.layers.sampler import SamplerOutput, SamplingRow, sample
from ember.models.moe_base import MoEForCausalLM
from ember.models.registry import model_class

logger = logging.getLogger(__name__)

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class StepResult:
    sampled: dict[str, int]
    logprobs: dict[str, tuple[float, dict[int, float]]]


def load_model(checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device,
               parallel: ParallelContext | None = None,
               read_counter: ReadCounter | None = None) -> torch.nn.Module:
    """Build the model and load its weights; with a ParallelContext, only this rank's shard,
    read from lazy checkpoint slices."""
    cls = model_class(checkpoint.hf_config)
    with torch.device("meta"):
        if parallel is None:
            model = cls.from_hf_config(checkpoint.hf_config)
        else:
            model = cls.from_hf_config(checkpoint.hf_config, parallel)
    model = model.to_empty(device=device).to(dtype)
    # tensors go in as stored: parameters cast on copy, and ones kept in fp32 (MoE routers)
    # keep the checkpoint's precision
    tensors = (checkpoint.tensors() if parallel is None
               else weight_sources(checkpoint, read_counter))
    loaded = model.load_weights(tensors)
    missing = sorted(set(dict(model.named_parameters())) - loaded)
    if missing:
        raise ValueError(f"model: checkpoint {checkpoint.path} lacks {len(missing)} tensors, "
                         f"e.g. {missing[:3]}")
    pack_for_cpu(model)
    return model.eval()


def compute_dtype(requested: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype weights are held and multiplied in. A CPU without native bf16 (or fp16) matmul
    (oneDNN needs AVX512-BF16, AVX512-FP16, AVX-NE-CONVERT or AMX) emulates it at ~16 GFLOP/s on
    two AVX2 cores against ~80 for fp32, so there a half-precision request computes in fp32."""
    native = {torch.bfloat16: torch.ops.mkldnn._is_mkldnn_bf16_supported,
              torch.float16: torch.ops.mkldnn._is_mkldnn_fp16_supported}
    if device.type == "cpu" and requested in native and not native[requested]():
        return torch.float32
    return requested


class ModelRunner:
    def __init__(self, checkpoint: Checkpoint, config: EngineConfig,
                 parallel: ParallelContext | None = None,
                 device: torch.device | None = None) -> None:
        self.config = config
        self.checkpoint = checkpoint
        self.parallel = parallel
        if envs.num_threads():
            torch.set_num_threads(envs.num_threads())
        self.is_driver = parallel is None or parallel.layout.is_driver
        self.device = device or torch.device(config.model.device)
        self.dtype = compute_dtype(TORCH_DTYPES[config.model.dtype], self.device)
        if self.dtype != TORCH_DTYPES[config.model.dtype]:
            logger.info("dtype %s: this CPU has no native half-precision matmul, computing in %s",
                        config.model.dtype, self.dtype)
        self.block_size = config.cache.block_size
        self.bytes_read = ReadCounter()
        self.model = load_model(checkpoint, self.dtype, self.device, parallel, self.bytes_read)
        self.kv_dtype = attention_dtype(self.dtype, self.device)
        per_token = math.prod(self.model.kv_cache_shape(1)) * self.model.num_kv_layers
        self.kv_bytes_per_token = per_token * self.kv_dtype.itemsize
        self.num_kv_blocks = config.cache.num_kv_blocks or max(1, int(
            config.cache.kv_cache_memory_gb * 1e9 // (self.kv_bytes_per_token * self.block_size)))
        num_slots = self.num_kv_blocks * self.block_size
        self.kv_caches = [
            torch.empty(self.model.kv_cache_shape(num_slots), dtype=self.kv_dtype,
                        device=self.device)
            for _ in range(self.model.num_kv_layers)]
        self._generators: dict[str, torch.Generator] = {}
        self._default_generator = torch.Generator(device=self.device)
        self._default_generator.manual_seed(config.model.seed)
        self.structured_output: StructuredOutputManager | None = None  # made at first use
        logger.info("KV cache: %d blocks x %d tokens, %d bytes per token", self.num_kv_blocks,
                    self.block_size, self.kv_bytes_per_token)

    def _slots(self, block_ids: list[int], start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        table = torch.tensor(block_ids, dtype=torch.long)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def _build_metadata(self, scheduled: list[ScheduledRequest],
                        slot_mapping: torch.Tensor) -> AttentionMetadata:
        decode_rows, decode_tables, decode_lens, prefills = [], [], [], []
        row = 0
        for sr in scheduled:
            n = len(sr.token_ids)
            if n == 1:
                decode_rows.append(row)
                decode_tables.append(sr.block_ids)
                decode_lens.append(sr.start_pos + 1)
            else:
                kv_slots = (self._slots(sr.block_ids, 0, sr.start_pos + n) if sr.start_pos
                            else slot_mapping[row:row + n])
                prefills.append(PrefillSpan(row, row + n, kv_slots.to(self.device), sr.start_pos))
            row += n
        width = max((len(ids) for ids in decode_tables), default=1)
        tables = torch.tensor([ids + [0] * (width - len(ids)) for ids in decode_tables],
                              dtype=torch.long).view(len(decode_tables), width)
        return AttentionMetadata(
            slot_mapping=slot_mapping.to(self.device),
            decode_rows=torch.tensor(decode_rows, dtype=torch.long, device=self.device),
            decode_block_tables=tables.to(self.device),
            decode_seq_lens=torch.tensor(decode_lens, dtype=torch.long, device=self.device),
            decode_max_len=max(decode_lens, default=0),
            block_size=self.block_size,
            prefills=prefills,
        )

    def _sampling_row(self, sr: ScheduledRequest) -> SamplingRow:
        params = sr.sampling_params
        generator = None
        if params.seed is not None and not params.greedy:
            generator = self._generators.get(sr.request_id)
            if generator is None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(params.seed)
                self._generators[sr.request_id] = generator
        return SamplingRow(params, generator, sr.prompt_token_ids, sr.output_token_ids)

    def _structured_output_manager(self, vocab_size: int) -> StructuredOutputManager:
        if self.structured_output is None:
            from ember.engine.tokenizer import load_tokenizer  # the tokenizer lives one layer up

            tokenizer = load_tokenizer(self.checkpoint)
            eos = self.checkpoint.eos_token_ids() or tuple(tokenizer.eos_token_ids)
            self.structured_output = StructuredOutputManager(tokenizer.hf, vocab_size, eos)
        return self.structured_output

    @property
    def has_moe(self) -> bool:
        return isinstance(self.model, MoEForCausalLM) and bool(self.model.moe_blocks())

    def ep_blocks(self) -> dict[int, ExpertParallelMoeBlock]:
        """Expert-parallel MoE blocks by layer index (none in one process)."""
        if not isinstance(self.model, MoEForCausalLM):
            return {}
        return {i: b for i, b in self.model.moe_blocks().items()
                if isinstance(b, ExpertParallelMoeBlock)}

    @property
    def param_bytes(self) -> int:
        """Bytes of the parameters this process holds (its shard under parallelism)."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, lockstep: bool = False) -> StepResult:
        """Run one step. `lockstep`: run the model even on an empty batch, because MoE layers
        exchange tokens with other data-parallel groups that do have work."""
        for rid in out.finished_request_ids:
            self._generators.pop(rid, None)
        if self.structured_output is not None:
            self.structured_output.free(out.finished_request_ids)
        if out.is_empty:
            if lockstep:
                self._run_empty()
            return StepResult({}, {})
        scheduled = out.scheduled
        input_ids = torch.tensor([t for sr in scheduled for t in sr.token_ids], dtype=torch.long)
        positions = torch.cat([torch.arange(sr.start_pos, sr.start_pos + len(sr.token_ids))
                               for sr in scheduled])
        slot_mapping = torch.cat([self._slots(sr.block_ids, sr.start_pos,
                                              sr.start_pos + len(sr.token_ids))
                                  for sr in scheduled])
        meta = self._build_metadata(scheduled, slot_mapping)
        hidden = self.model(input_ids.to(self.device), positions.to(self.device),
                            self.kv_caches, meta)
        sample_rows, sample_reqs, row = [], [], 0
        for sr in scheduled:
            row += len(sr.token_ids)
            if sr.needs_sample:
                sample_rows.append(row - 1)
                sample_reqs.append(sr)
        if not sample_reqs:
            return StepResult({}, {})
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)])
        if not self.is_driver:
            return StepResult({}, {})
        constrained = [(i, sr.request_id, sr.sampling_params.structured_output)
                       for i, sr in enumerate(sample_reqs)
                       if sr.sampling_params.structured_output is not None]
        structured = self._structured_output_manager(logits.shape[-1]) if constrained else None
        if structured is not None:
            structured.mask_logits(logits, constrained)
        result: SamplerOutput = sample(logits, [self._sampling_row(sr) for sr in sample_reqs],
                                       self._default_generator)
        sampled = {sr.request_id: tok for sr, tok in zip(sample_reqs, result.token_ids,
                                                         strict=True)}
        if structured is not None:
            for _, rid, _ in constrained:
                structured.accept(rid, sampled[rid])
        logprobs = {sr.request_id: lp for sr, lp in zip(sample_reqs, result.logprobs,
                                                        strict=True) if lp is not None}
        return StepResult(sampled, logprobs)

    def _run_empty(self) -> None:
        empty = torch.zeros(0, dtype=torch.long, device=self.device)
        self.model(empty, empty, self.kv_caches,
                   AttentionMetadata.empty(self.block_size, self.device))
