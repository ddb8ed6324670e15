"""Where each rank sits: the attention grid (data x tensor parallel) and the MoE grid
(expert parallel x expert-tensor parallel) laid over the same ranks. torch-free.

Ranks are numbered data-parallel-major: rank = dp_rank * tp_size + tp_rank, so a tensor-parallel
group is a run of consecutive ranks (one host, on a real cluster). MoE layers span every rank:
rank r holds the experts of EP shard r // moe_tp_size and slice r % moe_tp_size of each of
their matrices.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankLayout:
    rank: int
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    expert_parallel_size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank: must be in [0, {self.world_size}), got {self.rank}")
        if self.world_size % self.expert_parallel_size:
            raise ValueError(f"expert_parallel_size: must divide the world size "
                             f"{self.world_size}, got {self.expert_parallel_size}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tensor_parallel_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tensor_parallel_size

    @property
    def moe_tp_size(self) -> int:
        return self.world_size // self.expert_parallel_size

    @property
    def ep_rank(self) -> int:
        return self.rank // self.moe_tp_size

    @property
    def moe_tp_rank(self) -> int:
        return self.rank % self.moe_tp_size

    @property
    def is_driver(self) -> bool:
        """The first rank of its tensor-parallel group samples and reports the group's tokens."""
        return self.tp_rank == 0

    def tp_group_ranks(self, dp_rank: int) -> list[int]:
        start = dp_rank * self.tensor_parallel_size
        return list(range(start, start + self.tensor_parallel_size))

    def dp_group_ranks(self, tp_rank: int) -> list[int]:
        """The ranks with this tp_rank in every data-parallel group (they hold distinct tokens)."""
        return [d * self.tensor_parallel_size + tp_rank for d in range(self.data_parallel_size)]

    def driver_ranks(self) -> list[int]:
        return [self.tp_group_ranks(d)[0] for d in range(self.data_parallel_size)]


def split_range(total: int, parts: int, index: int) -> tuple[int, int]:
    """(start, length) of part `index` when `total` items are cut into `parts` equal pieces."""
    if total % parts:
        raise ValueError(f"{total} items cannot be split into {parts} equal parts")
    size = total // parts
    return index * size, size
