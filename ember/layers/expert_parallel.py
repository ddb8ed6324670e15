"""Expert parallelism: a MoE block whose routed experts are spread over every rank.

The MoE group is the whole world (data x tensor parallel ranks). Rank r holds the experts of
physical slots ep_rank * per_rank ... (ep_rank + 1) * per_rank - 1 (see distributed/eplb.py
for placements with redundant copies of hot experts), and slice moe_tp_rank of each expert's
intermediate dimension when there are more ranks than EP shards.

Dispatch: the data-parallel groups' tokens are all-gathered, so every rank routes every token
(the router is replicated and cheap). Each rank runs the (token, expert) pairs whose chosen
copy it holds. Combine: one all-reduce of a [tokens, top_k (+1 shared), hidden] buffer in
which every pair's output comes from exactly one EP shard (zeros elsewhere), so where an
expert lives never changes a sum; the routing weights are then applied locally in the same
order as on one process. Shared experts are tensor-parallel over the whole group and ride
in the same all-reduce.
"""

from __future__ import annotations

import torch

from ember.distributed.eplb import default_placement
from ember.distributed.parallel_state import ParallelContext
from ember.layers.linear import WeightSource, copy_weight
from ember.layers.moe import FusedExperts, GatedMLP, MoEConfig, SparseMoeBlock


def make_moe_block(cfg: MoEConfig, parallel: ParallelContext | None) -> SparseMoeBlock:
    """The plain block in one process, the expert-parallel one across several."""
    if parallel is None or parallel.moe.size == 1:
        return SparseMoeBlock(cfg)
    return ExpertParallelMoeBlock(cfg, parallel)


class ExpertParallelMoeBlock(SparseMoeBlock):
    def __init__(self, cfg: MoEConfig, parallel: ParallelContext) -> None:
        ep, moe_tp = parallel.ep_size, parallel.moe_tp_size
        num_slots = cfg.num_experts + parallel.num_redundant_experts
        if num_slots % ep:
            raise ValueError(f"expert_parallel_size: {ep} ranks cannot hold {num_slots} expert "
                             "slots (routed + redundant experts) evenly")
        if cfg.intermediate_size % moe_tp:
            raise ValueError(f"expert_parallel_size: {moe_tp} ranks per EP shard cannot split "
                             f"moe_intermediate_size ({cfg.intermediate_size}) evenly")
        per_rank, inter = num_slots // ep, cfg.intermediate_size // moe_tp
        shared = (GatedMLP(cfg.hidden_size, cfg.intermediate_size * cfg.num_shared_experts,
                           group=parallel.moe, reduce_output=False)
                  if cfg.num_shared_experts else None)
        super().__init__(cfg, FusedExperts(per_rank, cfg.hidden_size, inter), shared)
        self.parallel = parallel
        self.num_slots = num_slots
        self.slots_per_rank = per_rank
        self.slot_start = parallel.ep_rank * per_rank
        self.inter_start = parallel.moe_tp_rank * inter  # this rank's intermediate slice
        # pairs run per local slot since the last gather_slot_load() (plain attribute, like
        # expert_counts)
        self.slot_counts = torch.zeros(per_rank, dtype=torch.int64, device="cpu")
        self.set_placement(default_placement(cfg.num_experts, num_slots))

    # ---- placement ------------------------------------------------------------------------

    def set_placement(self, placement: list[int]) -> None:
        """Route by `placement` (slot -> expert); weights must already be where it says."""
        experts = self.cfg.num_experts
        if len(placement) != self.num_slots or set(placement) != set(range(experts)):
            raise ValueError(f"placement: needs {self.num_slots} slots covering all "
                             f"{experts} experts")
        self.placement = list(placement)
        copies = [[s for s, e in enumerate(placement) if e == x] for x in range(experts)]
        width = max(len(c) for c in copies)
        # plain CPU attributes (the model may be built on the meta device), moved on first use
        self._copies = torch.tensor([[c[i % len(c)] for i in range(width)] for c in copies],
                                    device="cpu")
        self._num_copies = torch.tensor([len(c) for c in copies], device="cpu")

    def local_experts(self) -> list[int]:
        return self.placement[self.slot_start:self.slot_start + self.slots_per_rank]

    def _physical_slots(self, ids: torch.Tensor) -> torch.Tensor:
        """The copy each (token, expert) pair uses: copies take tokens in turn."""
        if self._copies.device != ids.device:
            self._copies = self._copies.to(ids.device)
            self._num_copies = self._num_copies.to(ids.device)
        if self._copies.shape[1] == 1:
            return self._copies[ids, 0]
        token = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1)
        return self._copies[ids, token % self._num_copies[ids]]

    # ---- forward --------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.parallel
        xs, group_rows = p.dp.all_gather_rows(x)  # every data-parallel group's tokens
        weights, ids = self.gate(xs)
        n, k = ids.shape
        hidden = xs.shape[1]
        counts = torch.bincount(ids.flatten(), minlength=self.cfg.num_experts)
        if self.expert_counts.device != counts.device:
            self.expert_counts = self.expert_counts.to(counts.device)
            self.slot_counts = self.slot_counts.to(counts.device)
        self.expert_counts += counts
        local = self._physical_slots(ids).flatten() - self.slot_start
        pairs = ((local >= 0) & (local < self.slots_per_rank)).nonzero().squeeze(1)
        shared = self.shared_experts is not None
        buf = xs.new_zeros(n * (k + shared) * hidden)
        routed = buf[:n * k * hidden].view(n, k, hidden)
        if pairs.numel():
            out, slot_counts = self.experts.expert_outputs(xs, pairs // k, local[pairs])
            routed.view(n * k, hidden)[pairs] = out
            self.slot_counts += slot_counts
        if shared:
            buf[n * k * hidden:].view(n, hidden).copy_(self.shared_experts(xs))
        p.moe.all_reduce(buf)
        out = torch.bmm(weights.to(xs.dtype).unsqueeze(1), routed).squeeze(1)
        if shared:
            out = out + buf[n * k * hidden:].view(n, hidden)
        start = sum(group_rows[:p.dp.rank])
        return out[start:start + x.shape[0]]

    # ---- statistics and rebalancing -------------------------------------------------------

    def gather_slot_load(self) -> list[int]:
        """Pairs each physical slot ran since the last call, summed over ranks (a collective
        over the MoE group); resets the counts."""
        device = self.experts.down_proj.device
        full = torch.zeros(self.num_slots, dtype=torch.int64, device=device)
        if self.parallel.moe_tp_rank == 0:  # the other expert-TP ranks ran the same pairs
            full[self.slot_start:self.slot_start + self.slots_per_rank] = self.slot_counts
        self.parallel.moe.all_reduce(full)
        self.slot_counts = torch.zeros_like(self.slot_counts)
        return full.tolist()

    @torch.no_grad()
    def apply_placement(self, placement: list[int]) -> None:
        """Move expert weights to a new placement (point to point between ranks of the same
        expert-TP slice) and route by it. Collective: every rank calls it with the same
        placement between steps."""
        p = self.parallel
        per_rank, old = self.slots_per_rank, self.placement
        me, tp_rank = p.ep_rank, p.moe_tp_rank

        def global_rank(ep_rank: int) -> int:
            return ep_rank * p.moe_tp_size + tp_rank

        gate_up = torch.empty_like(self.experts.gate_up_proj)
        down = torch.empty_like(self.experts.down_proj)
        sends, recvs = [], []
        for dst in range(p.ep_size):
            held = old[dst * per_rank:(dst + 1) * per_rank]
            for i, expert in enumerate(placement[dst * per_rank:(dst + 1) * per_rank]):
                if expert in held:  # already on the destination rank
                    if dst == me:
                        j = held.index(expert)
                        gate_up[i].copy_(self.experts.gate_up_proj[j])
                        down[i].copy_(self.experts.down_proj[j])
                    continue
                src = next(r for r in range(p.ep_size)
                           if expert in old[r * per_rank:(r + 1) * per_rank])
                if src == me:
                    j = old[src * per_rank:(src + 1) * per_rank].index(expert)
                    sends += [(self.experts.gate_up_proj[j], global_rank(dst)),
                              (self.experts.down_proj[j], global_rank(dst))]
                if dst == me:
                    recvs += [(gate_up[i], global_rank(src)), (down[i], global_rank(src))]
        p.moe.exchange(sends, recvs)
        self.experts.gate_up_proj.copy_(gate_up)
        self.experts.down_proj.copy_(down)
        self.set_placement(placement)

    # ---- loading --------------------------------------------------------------------------

    def _local_slots(self, expert: int) -> list[int]:
        return [i for i, e in enumerate(self.local_experts()) if e == expert]

    def load_expert(self, expert: int, proj: str, tensor: WeightSource) -> None:
        if not 0 <= expert < self.cfg.num_experts:
            raise ValueError(f"expert index {expert} out of range 0..{self.cfg.num_experts - 1}")
        inter = self.experts.intermediate_size
        dim = 1 if proj == "down_proj" else 0
        for slot in self._local_slots(expert):
            self.experts.load_expert(slot, proj, tensor.narrow(dim, self.inter_start, inter))

    def load_stacked_experts(self, param: str, tensor: WeightSource) -> None:
        full, inter = self.cfg.intermediate_size, self.experts.intermediate_size
        target = self.experts.get_parameter(param)
        for slot, expert in enumerate(self.local_experts()):
            src = tensor.narrow(0, expert, 1)
            name = f"experts.{param}"
            if param == "down_proj":
                copy_weight(target[slot:slot + 1], src.narrow(2, self.inter_start, inter), name)
                continue
            for half in (0, 1):  # gate rows, then up rows
                copy_weight(target[slot:slot + 1, half * inter:(half + 1) * inter],
                            src.narrow(1, half * full + self.inter_start, inter), name)
