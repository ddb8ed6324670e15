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
