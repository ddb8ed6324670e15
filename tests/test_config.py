"""ParallelConfig: sizes, world size, and validation that names the bad field."""

from __future__ import annotations

import pytest

from ember.config import ParallelConfig


def test_world_size_and_redundant_expert_defaults() -> None:
    config = ParallelConfig(tensor_parallel_size=2, data_parallel_size=2,
                            expert_parallel_size=4, enable_eplb=True)
    assert config.world_size == 4
    assert config.num_redundant_experts == 4  # one per EP rank
    assert ParallelConfig(expert_parallel_size=1).num_redundant_experts == 0


@pytest.mark.parametrize(("kwargs", "field"), [
    (dict(tensor_parallel_size=0), "tensor_parallel_size"),
    (dict(data_parallel_size=-1), "data_parallel_size"),
    (dict(tensor_parallel_size=2, expert_parallel_size=3), "expert_parallel_size"),
    (dict(enable_eplb=True), "enable_eplb"),
    (dict(tensor_parallel_size=2, expert_parallel_size=2, enable_eplb=True,
          eplb_num_redundant_experts=3), "eplb_num_redundant_experts"),
    (dict(eplb_interval_steps=0), "eplb_interval_steps"),
    (dict(backend="mpi"), "backend"),
    (dict(worker_timeout_s=0), "worker_timeout_s"),
])
def test_invalid_values_name_the_field(kwargs, field) -> None:
    with pytest.raises(ValueError, match=f"^{field}:"):
        ParallelConfig(**kwargs)
