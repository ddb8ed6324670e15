"""Rendezvous hashing: even shares, and minimal movement when replicas come and go."""

from __future__ import annotations

from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from ember.router.hashing import owner, rank

IDS = [f"bench-0-agent-{i}" for i in range(10_000)]
NODES = [f"http://10.0.0.{i}:8000" for i in range(1, 5)]


def assignments(nodes: list[str]) -> dict[str, str]:
    return {key: owner(key, nodes) for key in IDS}


def test_shares_are_even_over_10000_ids():
    for n in (3, 4):
        shares = Counter(assignments(NODES[:n]).values())
        assert set(shares) == set(NODES[:n])
        for count in shares.values():
            assert abs(count / len(IDS) - 1 / n) < 0.03, shares


def test_adding_a_fourth_replica_moves_about_a_quarter_all_to_it():
    before, after = assignments(NODES[:3]), assignments(NODES)
    moved = [key for key in IDS if before[key] != after[key]]
    assert 0.22 < len(moved) / len(IDS) < 0.28
    assert {after[key] for key in moved} == {NODES[3]}


def test_removing_a_replica_moves_only_its_ids_and_readding_restores_them():
    full = assignments(NODES)
    without = assignments([n for n in NODES if n != NODES[1]])
    moved = {key for key in IDS if full[key] != without[key]}
    assert moved == {key for key in IDS if full[key] == NODES[1]}
    # Its ids spread over all the others, not onto one neighbour.
    assert set(without[key] for key in moved) == set(NODES) - {NODES[1]}
    assert assignments(list(reversed(NODES))) == full


def test_owner_of_no_nodes_is_none():
    assert owner("x", []) is None


@given(st.text(min_size=1), st.sets(st.text(min_size=1), min_size=2, max_size=8))
def test_rank_is_a_permutation_led_by_the_owner_and_removal_keeps_order(key, nodes):
    ranked = rank(key, nodes)
    assert sorted(ranked) == sorted(nodes)
    assert ranked[0] == owner(key, nodes)
    # Taking away any node leaves the relative order of the rest unchanged.
    dropped = ranked[len(ranked) // 2]
    assert rank(key, set(nodes) - {dropped}) == [n for n in ranked if n != dropped]
