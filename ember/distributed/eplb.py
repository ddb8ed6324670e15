"""Expert-parallel load balancing: where each expert lives, recomputed from observed load.

A placement maps every physical expert slot to the logical expert whose weights it holds.
There are num_experts + redundant slots, split evenly over the EP ranks (rank r owns slots
r * per_rank ... (r + 1) * per_rank - 1). `balanced_placement` gives the redundant slots to the
hottest experts (each extra copy halves, thirds... an expert's per-copy load; at most one copy
per rank) and then packs the copies onto ranks heaviest first, each onto the least-loaded rank
with a free slot that does not hold that expert yet. Routing then spreads an expert's tokens
over its copies. torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence


def default_placement(num_experts: int, num_slots: int) -> list[int]:
    """Slot s holds expert s % num_experts: experts in order, the redundant slots repeating
    the first experts."""
    return [s % num_experts for s in range(num_slots)]


def balanced_placement(load: Sequence[float], num_slots: int, num_ranks: int) -> list[int]:
    num_experts = len(load)
    if num_slots < num_experts or num_slots % num_ranks:
        raise ValueError(f"num_slots: {num_slots} slots cannot hold {num_experts} experts "
                         f"evenly on {num_ranks} ranks")
    per_rank = num_slots // num_ranks
    copies = [1] * num_experts
    for _ in range(num_slots - num_experts):
        # more copies than ranks would put two on one rank, which balances nothing
        spreadable = [e for e in range(num_experts) if copies[e] < num_ranks]
        hottest = max(spreadable or range(num_experts), key=lambda e: (load[e] / copies[e], -e))
        copies[hottest] += 1
    items = sorted(((load[e] / copies[e], e) for e in range(num_experts)
                    for _ in range(copies[e])), key=lambda item: (-item[0], item[1]))
    rank_load = [0.0] * num_ranks
    rank_slots: list[list[int]] = [[] for _ in range(num_ranks)]
    for weight, expert in items:
        open_ranks = [r for r in range(num_ranks) if len(rank_slots[r]) < per_rank]
        fresh = [r for r in open_ranks if expert not in rank_slots[r]] or open_ranks
        rank = min(fresh, key=lambda r: (rank_load[r], r))
        rank_slots[rank].append(expert)
        rank_load[rank] += weight
    return [e for slots in rank_slots for e in sorted(slots)]


def rank_loads(slot_load: Sequence[float], num_ranks: int) -> list[float]:
    """Tokens handled by each rank's slots."""
    per_rank = len(slot_load) // num_ranks
    return [sum(slot_load[r * per_rank:(r + 1) * per_rank]) for r in range(num_ranks)]


def busiest_share(slot_load: Sequence[float], num_ranks: int) -> float:
    """The busiest rank's share of all routed tokens (1 / num_ranks is perfect balance)."""
    loads = rank_loads(slot_load, num_ranks)
    total = sum(loads)
    return max(loads) / total if total else 0.0


def expert_load(slot_load: Sequence[float], placement: Sequence[int],
                num_experts: int) -> list[float]:
    """Per logical expert: the tokens of all its copies."""
    load = [0.0] * num_experts
    for slot, expert in enumerate(placement):
        load[expert] += slot_load[slot]
    return load
