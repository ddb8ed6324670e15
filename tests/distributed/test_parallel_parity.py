"""Tensor, expert and data parallelism with real worker processes on gloo give exactly the
greedy tokens of one process, with prefix caching and chunked prefill on; each rank holds and
reads only its shard of the weights."""

from __future__ import annotations

import pytest

from ember import LLM

from .conftest import ENGINE_ARGS, greedy, moe_prompts, run_llm

# (checkpoint fixture, tensor_parallel_size, expert_parallel_size, data_parallel_size)
CASES = [
    ("tiny_llama_dir", 2, 1, 1),
    ("tiny_llama_dir", 1, 1, 2),
    ("deepseek_dir", 2, 1, 1),  # MLA heads split; every expert split in two (expert TP)
    ("deepseek_dir", 2, 2, 1),  # MLA heads split; experts split between the two ranks
    ("deepseek_dir", 1, 2, 2),  # data-parallel attention, experts across the two groups
    ("glm4_moe_dir", 2, 2, 1),
    ("glm4_moe_dir", 1, 2, 2),
]

Reference = tuple[list[list[int]], int, int]


@pytest.fixture(scope="module")
def references() -> dict[str, Reference]:
    return {}


def reference(request: pytest.FixtureRequest, cache: dict[str, Reference],
              name: str) -> Reference:
    """One-process greedy tokens, parameter bytes and expert (routed + shared) parameter
    bytes, computed once per checkpoint."""
    if name not in cache:
        llm = LLM(str(request.getfixturevalue(name)), **ENGINE_ARGS)
        params = dict(llm.engine.runner.model.named_parameters())
        expert_bytes = sum(p.numel() * p.element_size() for n, p in params.items()
                           if ".experts." in n or ".shared_experts." in n)
        cache[name] = (greedy(llm, moe_prompts()), llm.engine.runner.param_bytes, expert_bytes)
    return cache[name]


@pytest.mark.parametrize(("model", "tp", "ep", "dp"), CASES,
                         ids=[f"{m.removesuffix('_dir')}-tp{t}-ep{e}-dp{d}"
                              for m, t, e, d in CASES])
def test_parallel_greedy_tokens_equal_one_process(request, references, model, tp, ep,
                                                  dp) -> None:
    expected, full_bytes, expert_bytes = reference(request, references, model)
    got, llm = run_llm(request.getfixturevalue(model), moe_prompts(), tensor_parallel_size=tp,
                       expert_parallel_size=ep, data_parallel_size=dp)
    assert got == expected
    stats = llm.stats()
    assert stats.prefix_hits > 0
    ready = llm.engine.runner.ready
    assert sorted(ready) == list(range(tp * dp))
    for r in ready.values():
        # a rank reads exactly what it keeps: its shard, never the whole checkpoint
        assert r.bytes_read == r.param_bytes
        if tp == 2:  # everything but norms, routers and MLA's latent projections is split
            assert r.param_bytes <= 0.55 * full_bytes
        else:  # data-parallel attention is replicated; routed and shared experts are split
            assert r.param_bytes == full_bytes - expert_bytes // 2
