from hypothesis import given, settings
from hypothesis import strategies as st

from ember.core.kv_cache_manager import KVCacheManager, block_hashes, hash_block
from ember.core.request import Request
from ember.core.sampling_params import SamplingParams


def make_request(rid: str, tokens: list[int], session: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(), session_id=session)


def compute(kv: KVCacheManager, req: Request) -> None:
    """Pretend the model computed every token of the request."""
    blocks, hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - hit, blocks)
    req.num_computed_tokens = req.num_tokens
    kv.cache_blocks(req)


def test_hashes_are_chained_and_stable():
    a = block_hashes(list(range(8)), 4)
    b = block_hashes(list(range(8)), 4)
    assert a == b and len(a) == 2
    assert a[1] == hash_block(a[0], [4, 5, 6, 7])
    assert block_hashes([9, 1, 2, 3, 4, 5, 6, 7], 4)[1] != a[1]  # same block, other parent


def test_shared_prefix_hits_whole_blocks_only():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    first = make_request("a", list(range(10)))
    compute(kv, first)
    kv.free(first)
    second = make_request("b", list(range(9)) + [99, 100])
    blocks, hit = kv.get_computed_blocks(second)
    assert hit == 8 and len(blocks) == 2
    kv.check_integrity()


def test_full_prompt_hit_still_leaves_the_last_token_to_compute():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    first = make_request("a", list(range(8)))
    compute(kv, first)
    kv.free(first)
    _, hit = kv.get_computed_blocks(make_request("b", list(range(8))))
    assert hit == 4


def test_allocation_fails_cleanly_when_full():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    req = make_request("a", list(range(12)))
    assert not kv.allocate_slots(req, 12)
    assert kv.num_free_blocks == 2
    kv.check_integrity()


def test_concurrent_identical_prefixes_still_cache_the_chain():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a, b = make_request("a", list(range(12))), make_request("b", list(range(12)))
    for req in (a, b):
        assert kv.allocate_slots(req, 12)
    for req in (a, b):
        req.num_computed_tokens = 12
        kv.cache_blocks(req)
    kv.free(a)
    kv.free(b)
    _, hit = kv.get_computed_blocks(make_request("c", list(range(12)) + [1]))
    assert hit == 12
    kv.check_integrity()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 20), st.booleans()), max_size=25))
def test_request_lifecycles_keep_refcounts_consistent(plan):
    kv = KVCacheManager(num_blocks=24, block_size=4)
    live: list[Request] = []
    for i, (prefix_id, length, finish) in enumerate(plan):
        tokens = [prefix_id] * 8 + list(range(length))
        req = make_request(str(i), tokens)
        blocks, hit = kv.get_computed_blocks(req)
        if kv.allocate_slots(req, req.num_tokens - hit, blocks):
            req.num_computed_tokens = req.num_tokens
            kv.cache_blocks(req)
            live.append(req)
        if finish and live:
            kv.free(live.pop(0))
        kv.check_integrity()
    for req in live:
        kv.free(req)
    kv.check_integrity()
    assert kv.num_free_blocks == 24
