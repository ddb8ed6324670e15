from hypothesis import given, settings
from hypothesis import strategies as st

from ember.core.block_pool import BlockPool
from ember.core.kv_cache_manager import hash_block


def test_allocate_and_free_round_trip():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert pool.num_free_blocks == 1
    pool.free(blocks)
    assert pool.num_free_blocks == 4
    pool.check_integrity()


def test_double_free_is_refused():
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    pool.free([block])
    try:
        pool.free([block])
    except RuntimeError as exc:
        assert "double free" in str(exc)
    else:
        raise AssertionError("double free went through")


def test_cached_block_is_found_until_evicted_lru_first():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache_block(a, hash_block(None, [1, 2]), (1, 2), None)
    pool.cache_block(b, hash_block(None, [3, 4]), (3, 4), None)
    pool.free([a])
    pool.free([b])
    assert pool.lookup(hash_block(None, [1, 2]), (1, 2), None) is a
    [taken] = pool.allocate(1)  # least recently freed goes first
    assert taken is a
    assert pool.lookup(hash_block(None, [1, 2]), (1, 2), None) is None
    assert pool.lookup(hash_block(None, [3, 4]), (3, 4), None) is b


def test_lookup_verifies_tokens_so_a_hash_collision_never_hits():
    pool = BlockPool(1)
    [a] = pool.allocate(1)
    h = hash_block(None, [1, 2])
    pool.cache_block(a, h, (1, 2), None)
    assert pool.lookup(h, (9, 9), None) is None  # same hash, other tokens
    assert pool.lookup(h, (1, 2), parent_id=0) is None  # same tokens, other parent


def test_hot_blocks_are_evicted_after_cold_ones():
    pool = BlockPool(2)
    hot, cold = pool.allocate(2)
    pool.free([hot], hot=True)
    pool.free([cold])
    assert pool.allocate(1) == [cold]
    assert pool.allocate(1) == [hot]


ops = st.lists(st.tuples(st.sampled_from(["alloc", "free", "cache", "touch"]),
                         st.integers(0, 5), st.booleans()), max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_random_operation_sequences_never_leak_or_double_free(sequence):
    pool = BlockPool(8)
    held: list[list] = []
    for op, n, flag in sequence:
        if op == "alloc" and n <= pool.num_free_blocks:
            held.append(pool.allocate(n))
        elif op == "free" and held:
            pool.free(held.pop(n % len(held)), hot=flag)
        elif op == "cache" and held and held[-1]:
            block = held[-1][0]
            pool.cache_block(block, hash_block(None, [n, block.block_id]), (n, block.block_id),
                             None)
        elif op == "touch":
            cached = [b for b in pool.blocks if b.block_hash is not None]
            if cached:
                block = cached[n % len(cached)]
                found = pool.lookup(block.block_hash, block.token_ids, block.parent_id)
                assert found is block
                pool.touch([found])
                held.append([found])
        pool.check_integrity()
        in_use = sum(len(h) for h in held)
        distinct = {b.block_id for h in held for b in h}
        assert pool.num_free_blocks == pool.num_blocks - len(distinct)
        assert sum(b.ref_cnt for b in pool.blocks) == in_use
    for h in held:
        pool.free(h)
    pool.check_integrity()
    assert pool.num_free_blocks == pool.num_blocks
