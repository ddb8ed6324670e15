"""The one place that reads environment variables."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where ember keeps derived files (converted tokenizers). EMBER_CACHE_DIR overrides."""
    root = os.environ.get("EMBER_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "ember"


def num_threads() -> int | None:
    """Torch intra-op threads for the CPU path (EMBER_NUM_THREADS); None keeps torch's."""
    value = os.environ.get("EMBER_NUM_THREADS")
    return int(value) if value else None


def local_rank() -> int | None:
    """This process's GPU index on its host when a launcher (torchrun) sets LOCAL_RANK."""
    value = os.environ.get("LOCAL_RANK")
    return int(value) if value else None


def launcher_rank() -> tuple[int, int] | None:
    """(RANK, WORLD_SIZE) when a launcher such as torchrun started this process."""
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    return (int(rank), int(world)) if rank and world else None


def worker_authkey() -> bytes | None:
    """Shared secret between an engine and the workers a launcher starts for it
    (EMBER_WORKER_AUTHKEY)."""
    value = os.environ.get("EMBER_WORKER_AUTHKEY")
    return value.encode() if value else None


def cpu_kernels_enabled() -> bool:
    """Whether the compiled CPU attention kernel may be built and used (EMBER_CPU_KERNELS=0
    turns it off)."""
    return os.environ.get("EMBER_CPU_KERNELS", "1") != "0"
