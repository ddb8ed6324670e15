"""One dataclass per subsystem. Validation raises ValueError naming the bad field.

This module is torch-free so that core/ can use it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DTYPES = ("bfloat16", "float16", "float32")


def _require(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{field_name}: {message}")


@dataclass
class ModelConfig:
    """What to load: a checkpoint folder, a .gguf file, or None for the default model."""

    model: str | None = None
    dtype: str = "bfloat16"
    max_model_len: int | None = None
    device: str = "cpu"
    seed: int = 0

    def __post_init__(self) -> None:
        _require(self.dtype in DTYPES, "dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        _require(self.max_model_len is None or self.max_model_len >= 1, "max_model_len",
                 f"must be >= 1, got {self.max_model_len}")


@dataclass
class CacheConfig:
    """The paged KV cache. num_kv_blocks=None sizes the pool from kv_cache_memory_gb."""

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float = 2.0
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        _require(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128, 256), "block_size",
                 f"must be a power of two <= 256, got {self.block_size}")
        _require(self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks",
                 f"must be >= 1, got {self.num_kv_blocks}")
        _require(self.kv_cache_memory_gb > 0, "kv_cache_memory_gb",
                 f"must be > 0, got {self.kv_cache_memory_gb}")


@dataclass
class SchedulerConfig:
    """Per-step token budget, batch size and chunked prefill."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    enable_chunked_prefill: bool = True
    # tokens the batch lane may compute per step: an interactive request arriving mid-step
    # waits for the step, so batch prefill chunks are kept short
    max_batch_lane_tokens: int = 256

    def __post_init__(self) -> None:
        _require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens",
                 f"must be >= 1, got {self.max_num_batched_tokens}")
        _require(self.max_batch_lane_tokens >= 1, "max_batch_lane_tokens",
                 f"must be >= 1, got {self.max_batch_lane_tokens}")
        _require(self.max_num_seqs >= 1, "max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")


def _is_address(value: str | None) -> bool:
    host, _, port = (value or "").rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536


@dataclass
class ParallelConfig:
    """How a model is spread over processes: world size = data x tensor parallel size.

    Attention and dense layers are tensor-parallel inside each of the data_parallel_size
    groups, and each group runs its own batch against its own KV cache. MoE layers span all
    ranks: routed experts are split expert_parallel_size ways, and each expert's matrices
    world_size / expert_parallel_size ways. With every size 1 the model runs in the calling
    process, without torch.distributed.
    """

    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_eplb: bool = False  # rebalance experts (with redundant copies) from observed load
    eplb_interval_steps: int = 32  # steps between expert-load gathers (and rebalances)
    eplb_num_redundant_experts: int | None = None  # extra expert slots; None: one per EP rank
    backend: str | None = None  # torch.distributed backend; None: nccl on cuda, else gloo
    master_addr: str = "127.0.0.1"  # where rank 0 listens for the process-group rendezvous
    master_port: int | None = None  # None: a free port
    worker_timeout_s: float = 120.0  # longest a step (or a collective) may take
    # "spawn": the engine starts one worker process per rank on this host. "external": a
    # launcher (torchrun, a cluster scheduler) starts `python -m ember.executor.worker` on
    # every host with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set, and the workers
    # connect to the engine at worker_listen ("host:port")
    worker_launcher: str = "spawn"
    worker_listen: str | None = None

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "expert_parallel_size", "data_parallel_size",
                     "eplb_interval_steps"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value >= 1, name, f"must be >= 1, got {value}")
        _require(self.world_size % self.expert_parallel_size == 0, "expert_parallel_size",
                 f"must divide the world size (tensor x data parallel = {self.world_size}), "
                 f"got {self.expert_parallel_size}")
        _require(not self.enable_eplb or self.expert_parallel_size > 1, "enable_eplb",
                 "needs expert_parallel_size > 1 (there is nothing to balance)")
        redundant = self.eplb_num_redundant_experts
        _require(redundant is None or (redundant >= 0 and redundant % self.expert_parallel_size
                                       == 0), "eplb_num_redundant_experts",
                 f"must be a multiple of expert_parallel_size ({self.expert_parallel_size}) "
                 f"so every rank holds as many experts, got {redundant}")
        _require(self.backend in (None, "gloo", "nccl"), "backend",
                 f"must be 'gloo' or 'nccl', got {self.backend!r}")
        _require(self.master_port is None or 0 < self.master_port < 65536, "master_port",
                 f"must be in [1, 65535], got {self.master_port}")
        _require(self.worker_timeout_s > 0, "worker_timeout_s",
                 f"must be > 0, got {self.worker_timeout_s}")
        _require(self.worker_launcher in ("spawn", "external"), "worker_launcher",
                 f"must be 'spawn' or 'external', got {self.worker_launcher!r}")
        _require(self.worker_launcher == "spawn" or _is_address(self.worker_listen),
                 "worker_listen", f"external workers need a 'host:port' to connect to, got "
                 f"{self.worker_listen!r}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def num_redundant_experts(self) -> int:
        """Extra expert slots the balancer may fill (0 without --eplb)."""
        if not self.enable_eplb:
            return 0
        if self.eplb_num_redundant_experts is None:
            return self.expert_parallel_size
        return self.eplb_num_redundant_experts


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
