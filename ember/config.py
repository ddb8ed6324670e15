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

    def __post_init__(self) -> None:
        _require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens",
                 f"must be >= 1, got {self.max_num_batched_tokens}")
        _require(self.max_num_seqs >= 1, "max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
