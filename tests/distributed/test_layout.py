"""Rank layout: the data x tensor parallel grid and the MoE grid over the same ranks."""

from __future__ import annotations

import pytest

from ember.distributed.layout import RankLayout, split_range


def test_tp_groups_are_consecutive_ranks_and_dp_groups_stride_over_them() -> None:
    layouts = [RankLayout(r, tensor_parallel_size=2, data_parallel_size=3,
                          expert_parallel_size=3) for r in range(6)]
    r = layouts[3]
    assert (r.world_size, r.tp_rank, r.dp_rank) == (6, 1, 1)
    assert r.tp_group_ranks(1) == [2, 3] and r.dp_group_ranks(1) == [1, 3, 5]
    assert r.driver_ranks() == [0, 2, 4]
    assert [lay.is_driver for lay in layouts] == [True, False] * 3
    # MoE: 3 EP shards of 2 expert-TP ranks each
    assert [(lay.ep_rank, lay.moe_tp_rank) for lay in layouts] == [
        (0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]


def test_invalid_layouts_name_the_field() -> None:
    with pytest.raises(ValueError, match="expert_parallel_size"):
        RankLayout(0, tensor_parallel_size=2, expert_parallel_size=4)
    with pytest.raises(ValueError, match="rank"):
        RankLayout(2, tensor_parallel_size=2)


def test_split_range() -> None:
    assert split_range(12, 3, 2) == (8, 4)
    with pytest.raises(ValueError):
        split_range(10, 3, 0)
