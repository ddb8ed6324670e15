"""ParallelContext: this rank's layout and its tensor-parallel, data-parallel and MoE groups.

Models receive the context when they are built; layers keep the group they reduce over. The
single-process context has groups of one, so layers take their plain path and nothing touches
torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from ember.distributed.comm import CommStats, GroupComm
from ember.distributed.layout import RankLayout


@dataclass
class ParallelContext:
    layout: RankLayout
    tp: GroupComm  # the ranks of this data-parallel group: they hold the same tokens
    dp: GroupComm  # one rank per data-parallel group (same tp_rank): they hold distinct tokens
    moe: GroupComm  # every rank: the expert-parallel x expert-tensor-parallel grid
    stats: CommStats = field(default_factory=CommStats)
    num_redundant_experts: int = 0  # extra expert slots per MoE layer, for load balancing

    @classmethod
    def single(cls) -> ParallelContext:
        return cls(RankLayout(0), GroupComm.single(), GroupComm.single(), GroupComm.single())

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def ep_size(self) -> int:
        return self.layout.expert_parallel_size

    @property
    def ep_rank(self) -> int:
        return self.layout.ep_rank

    @property
    def moe_tp_size(self) -> int:
        return self.layout.moe_tp_size

    @property
    def moe_tp_rank(self) -> int:
        return self.layout.moe_tp_rank


def default_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_distributed(layout: RankLayout, init_method: str, device: torch.device,
                     backend: str | None = None, timeout_s: float = 120.0) -> ParallelContext:
    """Join the process group (`tcp://host:port`, or `env://` under torchrun) and build the
    tensor-, data-parallel and MoE groups; every rank creates every group, in the same order."""
    dist.init_process_group(backend or default_backend(device), init_method=init_method,
                            rank=layout.rank, world_size=layout.world_size,
                            timeout=timedelta(seconds=timeout_s))
    stats = CommStats()
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    tp = dp = None
    for d in range(layout.data_parallel_size):
        ranks = layout.tp_group_ranks(d)
        group = dist.new_group(ranks)
        if layout.rank in ranks:
            tp = GroupComm(ranks, layout.rank, group, stats, sync)
    for t in range(layout.tensor_parallel_size):
        ranks = layout.dp_group_ranks(t)
        group = dist.new_group(ranks)
        if layout.rank in ranks:
            dp = GroupComm(ranks, layout.rank, group, stats, sync)
    moe = GroupComm(list(range(layout.world_size)), layout.rank, dist.group.WORLD, stats, sync)
    return ParallelContext(layout, tp, dp, moe, stats)


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
