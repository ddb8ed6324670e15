from ember.config import SchedulerConfig
from ember.core.kv_cache_manager import KVCacheManager
from ember.core.request import Lane, Request, RequestStatus
from ember.core.sampling_params import SamplingParams
from ember.core.scheduler import Scheduler


def make_scheduler(budget: int = 64, blocks: int = 64, block_size: int = 4,
                   batch_cap: int = 256, max_seqs: int = 128) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                                     max_batch_lane_tokens=batch_cap),
                     KVCacheManager(blocks, block_size))


def add(s: Scheduler, rid: str, n_prompt: int, max_tokens: int = 4,
        lane: Lane = Lane.INTERACTIVE, first_token: int = 1) -> Request:
    """Prompts with the same first_token share a prefix (and so prefix-cache blocks)."""
    req = Request(rid, list(range(first_token, first_token + n_prompt)),
                  SamplingParams(max_tokens=max_tokens), lane=lane)
    s.add_request(req)
    return req


def run_step(s: Scheduler, token: int = 7):
    out = s.schedule()
    s.update_from_output(out, {sr.request_id: token for sr in out.scheduled if sr.needs_sample})
    s.check_integrity()
    return out


def test_long_prompt_is_chunked_under_the_budget():
    s = make_scheduler(budget=16)
    req = add(s, "a", 40)
    sizes = []
    while req.num_output_tokens == 0:
        out = run_step(s)
        sizes.append(out.num_batched_tokens)
    assert sizes == [16, 16, 8]
    assert [sr.needs_sample for sr in out.scheduled] == [True]


def test_decodes_and_a_new_prefill_share_one_step():
    s = make_scheduler(budget=32)
    add(s, "a", 8)
    run_step(s)
    b = add(s, "b", 20)
    out = run_step(s)
    # b's prompt starts with a's 8 tokens, which are served from the prefix cache
    assert b.num_cached_tokens == 8
    assert {sr.request_id: len(sr.token_ids) for sr in out.scheduled} == {"a": 1, "b": 12}


def test_interactive_lane_is_admitted_before_earlier_batch_work():
    s = make_scheduler(budget=8)
    add(s, "batch", 8, lane=Lane.BATCH)
    add(s, "chat", 8)
    out = s.schedule()
    assert [sr.request_id for sr in out.scheduled] == ["chat"]


def test_batch_prefill_pauses_while_an_interactive_prompt_prefills():
    s = make_scheduler(budget=16)
    batch = add(s, "batch", 100, lane=Lane.BATCH)
    run_step(s)  # the batch prompt is mid-prefill
    add(s, "chat", 12, first_token=1000)
    out = run_step(s)
    assert [(sr.request_id, len(sr.token_ids)) for sr in out.scheduled] == [("chat", 12)]
    assert batch.num_computed_tokens == 16
    out = run_step(s)  # chat decodes: the batch prefill goes on beside it
    assert [(sr.request_id, len(sr.token_ids)) for sr in out.scheduled] == [("chat", 1),
                                                                            ("batch", 15)]


def test_batch_decodes_go_on_while_an_interactive_prompt_prefills():
    s = make_scheduler(budget=64)
    batch = add(s, "batch", 8, max_tokens=10, lane=Lane.BATCH)
    run_step(s)
    add(s, "chat", 40, first_token=1000)
    waiting_batch = add(s, "batch2", 8, lane=Lane.BATCH, first_token=2000)
    out = run_step(s)
    assert {sr.request_id: len(sr.token_ids) for sr in out.scheduled} == {"chat": 40,
                                                                          "batch": 1}
    assert batch.num_output_tokens == 2 and waiting_batch.num_computed_tokens == 0


def test_batch_lane_tokens_per_step_are_capped():
    s = make_scheduler(budget=64, batch_cap=10)
    add(s, "batch", 40, lane=Lane.BATCH)
    add(s, "batch2", 40, lane=Lane.BATCH)
    sizes = [run_step(s).num_batched_tokens for _ in range(3)]
    assert sizes == [10, 10, 10]
    add(s, "chat", 30, first_token=1000)
    assert {sr.request_id: len(sr.token_ids) for sr in run_step(s).scheduled} == {"chat": 30}
    assert {sr.request_id: len(sr.token_ids) for sr in run_step(s).scheduled} == {"chat": 1,
                                                                                  "batch": 10}


def test_interactive_request_preempts_batch_work_for_blocks_and_slots():
    s = make_scheduler(budget=64, blocks=6, block_size=4)
    batch = add(s, "batch", 20, max_tokens=4, lane=Lane.BATCH)  # 23 tokens of KV fill 6 blocks
    run_step(s)
    chat = add(s, "chat", 8, first_token=1000)
    out = run_step(s)  # 5 of 6 blocks are the batch request's: it makes room
    assert out.preempted_request_ids == ["batch"]
    assert [sr.request_id for sr in out.scheduled] == ["chat"]
    assert batch.status == RequestStatus.PREEMPTED and batch.num_computed_tokens == 0
    while s.has_unfinished():
        run_step(s)
    assert chat.num_output_tokens == 4 and batch.num_output_tokens == 4

    s = make_scheduler(max_seqs=1)
    add(s, "batch", 8, max_tokens=30, lane=Lane.BATCH)
    run_step(s)
    add(s, "chat", 8, first_token=1000)
    out = run_step(s)
    assert out.preempted_request_ids == ["batch"]
    assert [sr.request_id for sr in out.scheduled] == ["chat"]


def test_preemption_by_recompute_when_blocks_run_out():
    s = make_scheduler(budget=64, blocks=8, block_size=4)
    a = add(s, "a", 8, max_tokens=20)
    b = add(s, "b", 8, max_tokens=20, lane=Lane.BATCH)
    steps = 0
    while s.has_unfinished() and steps < 200:
        run_step(s)
        steps += 1
    assert a.status == RequestStatus.FINISHED_LENGTH and b.status == RequestStatus.FINISHED_LENGTH
    assert s.num_preemptions > 0
    assert b.num_preemptions > 0 and a.num_preemptions == 0  # batch lane goes first
    assert a.num_output_tokens == 20 and b.num_output_tokens == 20
    assert s.kv.num_free_blocks == 8


def test_finish_requests_frees_blocks_and_reports_the_id_once():
    s = make_scheduler()
    add(s, "a", 8, max_tokens=50)
    run_step(s)
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert s.kv.num_free_blocks == 64
    assert s.schedule().finished_request_ids == {"a"}
    assert s.schedule().finished_request_ids == set()
