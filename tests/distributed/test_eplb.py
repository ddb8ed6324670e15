"""Expert-parallel load balancing: the placement algorithm, and --eplb on a real EP=2 run with
a router biased towards experts on one rank."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from ember.distributed.eplb import (
    balanced_placement,
    busiest_share,
    default_placement,
    expert_load,
    rank_loads,
)

from .conftest import HOT_EXPERTS, moe_prompts, run_llm


def test_default_placement_repeats_the_first_experts_in_redundant_slots() -> None:
    assert default_placement(4, 6) == [0, 1, 2, 3, 0, 1]


def test_hot_experts_get_copies_and_spread_over_ranks() -> None:
    load = [0.0] * 8
    load[0], load[1] = 60.0, 30.0  # both on rank 0 in the default placement
    placement = balanced_placement(load, num_slots=10, num_ranks=2)
    # one copy per rank at most: the hottest expert gets one extra, the next one the other
    assert placement.count(0) == 2 and placement.count(1) == 2
    copies = {e: placement.count(e) for e in range(8)}
    slot_load = [load[e] / copies[e] for e in placement]
    assert busiest_share(slot_load, 2) < 0.55
    assert busiest_share([load[e] if s < 8 else 0.0 for s, e in
                          enumerate(default_placement(8, 10))], 2) == 1.0
    assert expert_load(slot_load, placement, 8) == load


@given(st.lists(st.integers(0, 1000), min_size=2, max_size=24),
       st.sampled_from([(1, 0), (2, 0), (2, 2), (4, 4)]))
def test_placements_hold_every_expert_and_fill_every_rank(load, shape) -> None:
    ranks, redundant = shape
    experts = len(load) - len(load) % ranks or ranks
    load = (load * ranks)[:experts]
    slots = experts + redundant
    placement = balanced_placement(load, slots, ranks)
    assert len(placement) == slots and set(placement) == set(range(experts))
    per_rank = slots // ranks
    for r in range(ranks):
        mine = placement[r * per_rank:(r + 1) * per_rank]
        assert len(set(mine)) == len(mine)  # no rank holds two copies of one expert
    copies = [placement.count(e) for e in range(experts)]
    spread = [load[e] / copies[e] for e in placement]
    # greedy packing: the busiest rank carries at most the average plus the largest item
    assert max(rank_loads(spread, ranks)) <= sum(load) / ranks + max(spread) + 1e-9


def test_eplb_lowers_the_busiest_rank_share_without_changing_outputs(skewed_moe_dir) -> None:
    prompts = moe_prompts()
    expected, _ = run_llm(skewed_moe_dir, prompts, max_tokens=12)
    got, llm = run_llm(skewed_moe_dir, prompts, max_tokens=12, expert_parallel_size=2,
                       data_parallel_size=2, enable_eplb=True, eplb_interval_steps=4)
    assert got == expected
    executor = llm.engine.runner
    reports = executor.expert_load_reports
    first, later = reports[0], reports[1:]
    # before balancing every routed token ran on EP rank 0, which holds experts 2..5
    assert first.busiest_rank_share == 1.0
    assert executor.balancer.num_rebalances >= 1 and later
    assert all(r.busiest_rank_share <= 0.6 for r in later)
    for placement in later[-1].placements.values():
        assert any(placement.count(e) == 2 for e in HOT_EXPERTS)  # a hot expert has a copy
        per_rank = len(placement) // 2
        assert set(HOT_EXPERTS) & set(placement[per_rank:])  # hot experts moved to rank 1
