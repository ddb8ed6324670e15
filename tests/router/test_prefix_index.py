"""The prefix index: longest leading match per replica, bounded memory."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ember.router.prefix_index import PrefixIndex


def test_longest_leading_match_wins_and_ties_are_all_returned():
    index = PrefixIndex(100)
    index.record("a", [1, 2, 3])
    index.record("b", [1, 2, 7, 8])
    index.record("c", [9])
    assert index.longest_match([1, 2, 3, 4], ["a", "b", "c"]) == (["a"], 3)
    assert index.longest_match([1, 2, 5], ["a", "b", "c"]) == (["a", "b"], 2)
    assert index.longest_match([5, 1, 2], ["a", "b", "c"]) == ([], 0)
    # Only replicas asked about count.
    assert index.longest_match([1, 2, 3], ["b", "c"]) == (["b"], 2)


def test_a_gap_ends_the_match():
    index = PrefixIndex(100)
    index.record("a", [1, 3])
    assert index.matched_blocks("a", [1, 2, 3]) == 1


def test_capacity_evicts_least_recent_and_keeps_leading_blocks_longest():
    index = PrefixIndex(4)
    index.record("a", [1, 2, 3])
    index.record("a", [1, 5, 6])  # 1 touched again: 2 and 3 are the oldest now
    assert index.size("a") == 4
    assert index.matched_blocks("a", [1, 5, 6]) == 3
    assert index.matched_blocks("a", [1, 2, 3]) == 2  # its tail block 3 went first
    index.record("a", [10, 11, 12, 13, 14, 15])  # longer than capacity: its head survives
    assert index.matched_blocks("a", [10, 11, 12, 13, 14, 15]) == 4
    index.check_integrity()


def test_forget_drops_a_replica():
    index = PrefixIndex(10)
    index.record("a", [1])
    index.forget("a")
    assert index.size("a") == 0
    assert index.longest_match([1], ["a"]) == ([], 0)


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="^capacity: "):
        PrefixIndex(0)


@given(st.lists(st.tuples(st.sampled_from("abc"), st.lists(st.integers(0, 50), max_size=12)),
                max_size=60),
       st.integers(1, 16))
def test_memory_stays_bounded_whatever_is_recorded(records, capacity):
    index = PrefixIndex(capacity)
    for replica, hashes in records:
        index.record(replica, hashes)
        assert index.size(replica) <= capacity
        # What was just recorded is found, as far as capacity allows.
        distinct = len(dict.fromkeys(hashes))
        if distinct == len(hashes):
            assert index.matched_blocks(replica, hashes) == min(len(hashes), capacity)
    index.check_integrity()
