"""Fixtures for the parallel tests: tiny MoE checkpoints (DeepSeek-V3 with MLA, GLM-4 MoE, and
a GLM-4 MoE whose router is biased towards four experts), prompts with shared prefixes, and
helpers that run the engine in one process and with worker processes on gloo."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from ember import LLM, SamplingParams

MAX_TOKENS = 6
# prefix caching on, prefills chunked into 16-token steps, 4-token blocks
ENGINE_ARGS = dict(dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16, block_size=4,
                   enable_prefix_caching=True, enable_chunked_prefill=True)


def _models_kit() -> ModuleType:
    """tests/models/conftest.py (tiny transformers configs and checkpoint writers); its
    fixtures are scoped to that folder, so the module is loaded here by path."""
    name = "ember_tests_models_kit"
    if name not in sys.modules:
        path = Path(__file__).resolve().parent.parent / "models" / "conftest.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(autouse=True)
def one_thread_per_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """Worker processes inherit this: the suite shares two cores."""
    monkeypatch.setenv("EMBER_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def deepseek_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import DeepseekV3ForCausalLM

    kit = _models_kit()
    model = kit.build_model(DeepseekV3ForCausalLM, kit.deepseek_config())
    return kit.save_checkpoint(model, tmp_path_factory.mktemp("deepseek_v3"))


@pytest.fixture(scope="session")
def glm4_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import Glm4MoeForCausalLM

    kit = _models_kit()
    model = kit.build_model(Glm4MoeForCausalLM, kit.glm4_moe_config())
    return kit.save_checkpoint(model, tmp_path_factory.mktemp("glm4_moe"))


HOT_EXPERTS = (2, 3, 4, 5)  # all on EP rank 0 under the default placement


@pytest.fixture(scope="session")
def skewed_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """GLM-4 MoE whose selection bias makes every token pick experts 2..5 (the routing
    weights, which use unbiased scores, stay as trained)."""
    from transformers import Glm4MoeForCausalLM

    kit = _models_kit()
    model = kit.build_model(Glm4MoeForCausalLM, kit.glm4_moe_config(), seed=3)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf[list(HOT_EXPERTS)] += 5.0
    return kit.save_checkpoint(model, tmp_path_factory.mktemp("skewed_moe"))


def moe_prompts() -> list[list[int]]:
    """Four prompts over the tiny MoE vocabulary; three share a prefix."""
    return _models_kit().engine_prompts()


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def run_llm(model: Path, prompts: list[list[int]], max_tokens: int = MAX_TOKENS,
            **kwargs: Any) -> tuple[list[list[int]], LLM]:
    """Greedy tokens of an engine (shut down before returning) and the engine itself."""
    llm = LLM(str(model), **ENGINE_ARGS, **kwargs)
    try:
        return greedy(llm, prompts, max_tokens), llm
    finally:
        llm.shutdown()
