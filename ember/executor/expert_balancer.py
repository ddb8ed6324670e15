"""Expert load statistics and the expert-parallel load balancer (--eplb), engine-core side.

Every `eplb_interval_steps` steps the executor has the ranks sum their per-slot token counts
(a collective) and records an `ExpertLoadReport`. With --eplb it then computes a new placement
per MoE layer from that window's load (distributed/eplb.py) and has the workers move expert
weights between steps; routing spreads a hot expert's tokens over its copies, and outputs do
not change.
"""

from __future__ import annotations

from dataclasses import dataclass

from ember.config import ParallelConfig
from ember.distributed.eplb import balanced_placement, expert_load, rank_loads


@dataclass
class ExpertLoadReport:
    step: int  # engine steps run when the window closed
    slot_load: dict[int, list[int]]  # MoE layer -> tokens per physical slot in the window
    placements: dict[int, list[int]]  # MoE layer -> slot -> expert, in force in the window
    num_ranks: int

    @property
    def rank_loads(self) -> list[int]:
        """Tokens each EP rank's experts ran, over all MoE layers."""
        totals = [0] * self.num_ranks
        for load in self.slot_load.values():
            for rank, n in enumerate(rank_loads(load, self.num_ranks)):
                totals[rank] += int(n)
        return totals

    @property
    def busiest_rank_share(self) -> float:
        """The busiest EP rank's share of routed tokens (1 / EP size is perfect balance)."""
        loads = self.rank_loads
        return max(loads) / sum(loads) if sum(loads) else 0.0


class ExpertBalancer:
    def __init__(self, config: ParallelConfig, placements: dict[int, list[int]]) -> None:
        self.config = config
        self.placements = {i: list(p) for i, p in placements.items()}
        self.reports: list[ExpertLoadReport] = []
        self.num_rebalances = 0

    def due(self, step: int) -> bool:
        return step % self.config.eplb_interval_steps == 0

    def record(self, step: int, slot_load: dict[int, list[int]]) -> ExpertLoadReport:
        report = ExpertLoadReport(step, slot_load, {i: list(p) for i, p in
                                                    self.placements.items()},
                                  self.config.expert_parallel_size)
        self.reports.append(report)
        return report

    def rebalance(self, report: ExpertLoadReport) -> dict[int, list[int]] | None:
        """New placements for the layers whose balanced placement differs (None: keep all)."""
        if not self.config.enable_eplb or not any(any(v) for v in report.slot_load.values()):
            return None
        changed = {}
        for layer, placement in self.placements.items():
            load = expert_load(report.slot_load[layer], placement, len(set(placement)))
            new = balanced_placement(load, len(placement), self.config.expert_parallel_size)
            if new != placement:
                changed[layer] = new
        if not changed:
            return None
        self.placements.update(changed)
        self.num_rebalances += 1
        return changed
