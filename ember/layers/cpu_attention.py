"""The CPU paged decode-attention kernel: built from csrc/ at first use, loaded as a torch op.

`torch.ops.ember.paged_decode_attention(q, kv_cache, block_tables, seq_lens, block_size, scale)`
attends one fp32 query per sequence to its context read in place from a [2, Hkv, slots, D]
cache (fp32 or bf16) through its block table. It replaces gather-then-matmul on CPU, whose cost
was dominated by copying every sequence's context every layer. The build (a few tens of seconds,
once per machine) lands in torch's extension cache; without a C++ compiler, or with
EMBER_CPU_KERNELS=0, attention falls back to the torch path in attention.py.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
from pathlib import Path

import torch

from ember import envs

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_attention_cpu.cpp"


@functools.cache
def cpu_kernel_available() -> bool:
    """Build (or find in torch's extension cache) and load the kernel; False where it can't."""
    if not envs.cpu_kernels_enabled():
        return False
    from torch.utils import cpp_extension

    _put_ninja_on_path()
    try:
        cpp_extension.load(name="ember_cpu_attention", sources=[str(SOURCE)],
                           extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
                           extra_ldflags=["-fopenmp"],
                           is_python_module=False, verbose=False)
    except (OSError, RuntimeError, cpp_extension.CalledProcessError) as exc:  # no compiler
        logger.warning("CPU attention kernel unavailable, using the torch path: %s", exc)
        return False
    return True


def _put_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the `ninja` package's binary is not there when ember runs
    from a virtual environment that is not activated."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
    """q [B, Hq, D] (any float dtype) -> fp32 [B, Hq, D]."""
    return torch.ops.ember.paged_decode_attention(
        q.float().contiguous(), kv_cache, block_tables, seq_lens, block_size, scale)
